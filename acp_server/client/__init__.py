"""The Python client SDK for acp-server (trio), on the same sans-I/O JSON-RPC core as the server.

    async with connect("tcp://127.0.0.1:4170") as client:
        session = await client.new_session("/work")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(show, session.updates)      # session/update, as an async iterator
            result = await session.prompt("hello", retry=RetryPolicy())
        print(result.stop_reason)

What it adds over raw ACP: a :class:`SessionClient` per session carrying the server-given client id
(``_meta.clientId``) on every call and re-registering it once when it went stale (self-heal); a local
pending-prompt guard (:class:`PendingPromptLimitError`, nothing sent); retries of refusals for capacity
within the caller's deadline, every attempt carrying one ``_meta.idempotencyKey``; and cancellation of
one's own prompt with ``$/cancel_request`` (never ``session/cancel``, which ends everyone's).

The names below load with their module on first use (PEP 562): ``acp-server --help`` reads the
``prompt`` and ``sessions`` flags from :mod:`acp_server.client.cli_flags` without importing the client
and trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from ..types.acp import PromptResult, SessionInfo
    from .client import Client, connect
    from .errors import (
        ClientError,
        ConnectionLostError,
        PendingPromptLimitError,
        ProtocolError,
        RpcError,
        is_retryable,
    )
    from .hooks import Hooks
    from .retry import Attempt, RetryPolicy, retrying
    from .session import PromptCall, SessionClient
    from .updates import Update, UpdateStream

#: Each public name -> the module that defines it.
_HOMES = {
    "PromptResult": "..types.acp",
    "SessionInfo": "..types.acp",
    "Client": ".client",
    "connect": ".client",
    "ClientError": ".errors",
    "ConnectionLostError": ".errors",
    "PendingPromptLimitError": ".errors",
    "ProtocolError": ".errors",
    "RpcError": ".errors",
    "is_retryable": ".errors",
    "Hooks": ".hooks",
    "Attempt": ".retry",
    "RetryPolicy": ".retry",
    "retrying": ".retry",
    "PromptCall": ".session",
    "SessionClient": ".session",
    "Update": ".updates",
    "UpdateStream": ".updates",
}

__all__ = [
    "Attempt",
    "Client",
    "ClientError",
    "ConnectionLostError",
    "Hooks",
    "PendingPromptLimitError",
    "PromptCall",
    "PromptResult",
    "ProtocolError",
    "RetryPolicy",
    "RpcError",
    "SessionClient",
    "SessionInfo",
    "Update",
    "UpdateStream",
    "connect",
    "is_retryable",
    "retrying",
]


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)

