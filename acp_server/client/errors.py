"""What the client SDK raises, as one small tree (blame split as in h11: the server's answer, our own
guard, the connection).

    ClientError                         base of everything the SDK raises for a failed call
    ├── RpcError                        an error in JSON-RPC shape: ``code``, ``message``, ``data``, ``kind``
    │   └── PendingPromptLimitError     ``prompt_queue_full``: the local guard (``local``) or the server's
    ├── ConnectionLostError             the connection ended before the answer (``connection_lost``)
    └── ProtocolError                   the server sent something we cannot decode (``protocol_error``)

``kind`` is the ``errorKind`` of the server's error (``acp_server.errors.REGISTRY``), or one of the
client's own kinds above. Misuse of the API (a bad argument) raises ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from typing import Any

from ..errors import REGISTRY, PromptQueueFullError, RequestCancelledError

__all__ = [
    "ClientError",
    "ConnectionLostError",
    "PendingPromptLimitError",
    "ProtocolError",
    "RpcError",
    "error_from_response",
    "is_retryable",
]


class ClientError(Exception):
    """Base of the errors a call can end with.

    Attributes:
        kind: a stable discriminator: the server's ``errorKind`` or a client-side kind.
    """

    kind: str | None = None

    @property
    def retryable(self) -> bool:
        """Whether the retry policy may send the call again (see :func:`is_retryable`)."""
        return is_retryable(self)


class RpcError(ClientError):
    """An error answer: the server's, or one the client made up in the same shape (``local``).

    Args:
        code: the JSON-RPC error code.
        message: the human-readable message.
        data: the error's ``data`` object (ours always carries ``errorKind``).
        method: the method of the request that failed, when known.
        local: the client raised it without asking the server.
    """

    def __init__(
        self,
        code: int,
        message: str,
        data: dict[str, Any] | None = None,
        *,
        method: str | None = None,
        local: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data: dict[str, Any] = dict(data) if isinstance(data, dict) else {}
        self.method = method
        self.local = local
        kind = self.data.get("errorKind")
        self.kind = kind if isinstance(kind, str) else None

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        where = "local" if self.local else "server"
        return f"{type(self).__name__}(code={self.code}, kind={self.kind!r}, {where}, message={self.message!r})"

    @property
    def retry_after_ms(self) -> int | None:
        """``data.retryAfterMs`` when the error carries a usable one."""
        value = self.data.get("retryAfterMs")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return value

    @property
    def safe_to_retry(self) -> bool | None:
        """``data.safeToRetry`` when the error carries it (``None``: not said)."""
        value = self.data.get("safeToRetry")
        return value if isinstance(value, bool) else None

    @classmethod
    def cancelled_locally(cls, method: str, why: str) -> RpcError:
        """``request_cancelled`` for a call stopped before (or between) sends: nothing was in flight."""
        return cls(
            RequestCancelledError.code, f"Request cancelled: {why}", {"errorKind": RequestCancelledError.kind},
            method=method, local=True,
        )


class PendingPromptLimitError(RpcError):
    """``prompt_queue_full``: the session already holds ``limit`` pending prompts.

    Raised by the client's own guard before anything is sent (``local`` is true, no
    ``retry_after_ms``), or from the server's refusal (carrying the server's figures).

    Args:
        session_id: the session whose queue is full.
        limit: its pending-prompt limit.
        pending_count: the prompts pending there when the prompt was refused.
    """

    def __init__(
        self,
        session_id: str,
        limit: int,
        pending_count: int,
        *,
        retry_after_ms: int | None = None,
        message: str | None = None,
        data: dict[str, Any] | None = None,
        local: bool = True,
    ) -> None:
        payload: dict[str, Any] = dict(data or {})
        payload.update(
            errorKind=PromptQueueFullError.kind, sessionId=session_id, limit=limit, pendingCount=pending_count
        )
        if retry_after_ms is not None:
            payload["retryAfterMs"] = retry_after_ms
        if message is None:
            message = (
                f'Prompt queue full for session "{session_id}" ({pending_count}/{limit} pending'
                f"{' on this connection' if local else ''})"
            )
        super().__init__(PromptQueueFullError.code, message, payload, method="session/prompt", local=local)
        self.session_id = session_id
        self.limit = limit
        self.pending_count = pending_count


class ConnectionLostError(ClientError):
    """The connection ended (closed, broken, evicted) before the call was answered."""

    kind = "connection_lost"


class ProtocolError(ClientError):
    """The server answered with something that is not what the protocol promises."""

    kind = "protocol_error"


def _int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_from_response(error: Any, method: str | None) -> RpcError:
    """The exception for an error object received as the answer to ``method``.

    A ``prompt_queue_full`` carrying its figures becomes :class:`PendingPromptLimitError`.
    """
    if not isinstance(error, dict):
        return RpcError(-32603, f"malformed error object: {error!r}", method=method)
    code = error.get("code")
    message = error.get("message")
    data = error.get("data")
    rpc = RpcError(
        code if isinstance(code, int) and not isinstance(code, bool) else -32603,
        message if isinstance(message, str) else "(no message)",
        data if isinstance(data, dict) else None,
        method=method,
    )
    if rpc.kind == PromptQueueFullError.kind:
        session_id = rpc.data.get("sessionId")
        limit, pending = _int(rpc.data, "limit"), _int(rpc.data, "pendingCount")
        if isinstance(session_id, str) and limit is not None and pending is not None:
            return PendingPromptLimitError(
                session_id, limit, pending, retry_after_ms=rpc.retry_after_ms, message=rpc.message,
                data=rpc.data, local=False,
            )
    return rpc


def is_retryable(exc: BaseException) -> bool:
    """Whether sending the same call again may succeed.

    Only errors whose kind the server's registry marks retryable (``REGISTRY[kind].retryable``:
    overload such as ``prompt_queue_full`` and ``capacity_exceeded``), and, when the error says
    ``safeToRetry``, only if that is true.
    """
    if not isinstance(exc, RpcError) or exc.kind is None:
        return False
    cls = REGISTRY.get(exc.kind)
    if cls is None or not cls.retryable:
        return False
    return exc.safe_to_retry is not False
