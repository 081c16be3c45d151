"""``session/update`` notifications as the client hands them out: one bounded stream per session.

The connection's reader pushes into the stream and never waits, so a caller that does not read its
updates cannot stall the answers to its own requests; past ``max_buffered`` the oldest update is
dropped (and counted in :attr:`UpdateStream.dropped`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import msgspec
import trio

__all__ = ["Update", "UpdateStream"]

log = logging.getLogger("acp_server.client")

#: The update kinds whose ``content`` is one content block (text is read from it by :attr:`Update.text`).
_CHUNKS = frozenset({"agent_message_chunk", "user_message_chunk", "agent_thought_chunk"})


class Update(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    """One ``session/update`` notification's params.

    Attributes:
        session_id: the session it belongs to.
        update: the update object (``sessionUpdate`` names its kind).
        meta: its ``_meta`` (``eventId``, ``originatorClientId`` from acp-server).
    """

    session_id: str
    update: dict[str, Any]
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")

    @property
    def kind(self) -> str | None:
        """``update.sessionUpdate``: ``agent_message_chunk``, ``user_message_chunk``, ``tool_call``..."""
        kind = self.update.get("sessionUpdate")
        return kind if isinstance(kind, str) else None

    @property
    def event_id(self) -> int | None:
        """The server's ordinal of this update in the session's history (``_meta.eventId``)."""
        value = (self.meta or {}).get("eventId")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def originator_client_id(self) -> str | None:
        """The client id whose prompt produced this update (``_meta.originatorClientId``)."""
        value = (self.meta or {}).get("originatorClientId")
        return value if isinstance(value, str) else None

    @property
    def text(self) -> str | None:
        """The text of a message or thought chunk with text content, else ``None``."""
        if self.kind not in _CHUNKS:
            return None
        content = self.update.get("content")
        if isinstance(content, dict) and content.get("type") == "text":
            text = content.get("text")
            return text if isinstance(text, str) else None
        return None


class UpdateStream:
    """The updates of one session, in arrival order; an async iterator.

    Iteration ends when the session is closed through this client or the connection ends (after
    what was buffered has been read).

    Args:
        session_id: the session.
        max_buffered: updates kept unread before the oldest is dropped.
    """

    def __init__(self, session_id: str, max_buffered: int) -> None:
        self.session_id = session_id
        self.max_buffered = max_buffered
        #: updates dropped because nobody read them in time
        self.dropped = 0
        self._buf: collections.deque[Update] = collections.deque()
        self._wake = trio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._buf)

    def push(self, update: Update) -> None:
        """Buffer an update (the connection's reader calls this; it never blocks)."""
        if self._closed:
            return
        if len(self._buf) >= self.max_buffered:
            self._buf.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "session %s: %d update(s) dropped; read session.updates (or raise max_buffered_updates)",
                    self.session_id,
                    self.dropped,
                )
        self._buf.append(update)
        self._wake.set()

    def close(self) -> None:
        """No more updates will come; readers finish what is buffered, then stop."""
        self._closed = True
        self._wake.set()

    def receive_nowait(self) -> Update:
        """The next buffered update.

        Raises:
            trio.WouldBlock: none is buffered yet.
            trio.EndOfChannel: none is buffered and none will come.
        """
        if self._buf:
            return self._buf.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def drain_nowait(self) -> list[Update]:
        """Every update buffered now (possibly none)."""
        out = list(self._buf)
        self._buf.clear()
        return out

    async def wait_buffered(self) -> None:
        """Wait until an update is buffered or the stream is closed, without taking it (a reader that
        shows updates in order with other events drains them itself, with no checkpoint in between)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._buf and not self._closed:
            if self._wake.is_set():
                self._wake = trio.Event()
            await self._wake.wait()

    async def receive(self) -> Update:
        """Wait for the next update.

        Raises:
            trio.EndOfChannel: the stream is closed and drained.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                update = self.receive_nowait()
            except trio.WouldBlock:
                if self._wake.is_set():
                    self._wake = trio.Event()
                await self._wake.wait()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return update

    def __aiter__(self) -> UpdateStream:
        return self

    async def __anext__(self) -> Update:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
