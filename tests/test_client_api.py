"""The client SDK's public API: what ``acp_server.client`` exports, documented, and nothing else."""

from __future__ import annotations

import inspect

import acp_server.client as client

#: The public API, as the package docstring and the README describe it.
EXPORTS = {
    # connecting
    "connect",
    "Client",
    "Hooks",
    # sessions, prompts, updates
    "SessionClient",
    "PromptCall",
    "PromptResult",
    "SessionInfo",
    "Update",
    "UpdateStream",
    # retries
    "RetryPolicy",
    "Attempt",
    "retrying",
    "is_retryable",
    # errors
    "ClientError",
    "RpcError",
    "PendingPromptLimitError",
    "ConnectionLostError",
    "ProtocolError",
}


def test_exports_are_the_documented_api() -> None:
    """``__all__`` is exactly the documented API, and every name resolves."""
    assert set(client.__all__) == EXPORTS
    assert len(client.__all__) == len(EXPORTS)
    for name in EXPORTS:
        assert getattr(client, name) is not None


def test_every_export_has_a_docstring() -> None:
    """Each exported class and function says what it is."""
    for name in EXPORTS:
        obj = getattr(client, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name


def test_error_tree() -> None:
    """Every failure the SDK raises for a call is a ``ClientError``; the queue-full error is an ``RpcError``."""
    assert issubclass(client.RpcError, client.ClientError)
    assert issubclass(client.PendingPromptLimitError, client.RpcError)
    assert issubclass(client.ConnectionLostError, client.ClientError)
    assert issubclass(client.ProtocolError, client.ClientError)
    local = client.PendingPromptLimitError("sess_1", 2, 2)
    assert (local.kind, local.code, local.local, local.data["pendingCount"]) == ("prompt_queue_full", -32001, True, 2)
