"""The connection shell's bookkeeping of the peer's requests: one :class:`Slot` per request in flight,
and :class:`BatchReplies`, which joins a batch's answers into one JSON array."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import trio

from ..jsonrpc import Deferred

__all__ = ["BatchReplies", "Slot"]


class Slot(msgspec.Struct, eq=False):
    """One request of the peer's, from arrival to answer (a Struct: built by C code, one per request).

    Attributes:
        read_ns: ``perf_counter_ns()`` when the read that carried the request returned.
        cancelled: ``$/cancel_request`` named it.
        scope: the cancel scope of its task, while one runs it.
        deferred: the :class:`~acp_server.jsonrpc.Deferred` that answers it, while it waits.
        running: it counts towards ``max_inflight_requests``, from its start until its work ends (see
            the shell's ``_release``).
    """

    read_ns: int
    cancelled: bool = False
    scope: trio.CancelScope | None = None
    deferred: Deferred | None = None
    running: bool = False


class BatchReplies:
    """Collects the answers of a batch; sends them with ``reply`` as one JSON array once all are in."""

    __slots__ = ("missing", "parts", "reply")

    def __init__(self, reply: Callable[[bytes], None]) -> None:
        self.reply = reply
        self.parts: list[bytes] = []
        self.missing = 0

    def add(self, data: bytes) -> None:
        """One answer of the batch (newline-terminated)."""
        self.parts.append(data.rstrip(b"\n"))
        self.missing -= 1
        self.flush()

    def flush(self) -> None:
        """Send the array if every answer is in."""
        if self.missing == 0 and self.parts:
            self.reply(b"[" + b",".join(self.parts) + b"]\n")
            self.parts = []
