"""A WebSocket whose usual frames skip wsproto: hypercorn's ``WSStream`` with two shortcuts.

hypercorn carries every message of a WebSocket through wsproto both ways: an inbound read becomes
wsproto events (its frame decoder, a generator per frame), an outbound ``websocket.send`` a wsproto
event framed by its frame protocol, then a ``Data`` event through the H11 protocol's ``stream_send``.
An ACP peer sends one JSON-RPC message per text frame, and the server sends up to a dozen per prompt,
so that path was most of a WebSocket prompt's CPU (bench/README.md, scenario 6).
:class:`LeanWSStream` keeps the handshake, the ASGI messages, close, ping and every error as
hypercorn has them, and does the usual frames itself once the socket is open:

- **Outbound**: a ``websocket.send`` of text while the connection is open is framed here (FIN, text
  opcode, the length, the payload; a server's frames are not masked, RFC 6455 5.1) and handed to the
  connection's :class:`~.wire.BatchedWrites` without a wait when it fits under its bound (written at
  once when nothing is queued before it); past the bound it goes the way hypercorn sends (which waits
  for room). The app may also skip the ASGI
  message: the scope's extension :data:`FRAMES_EXTENSION` (set at the accept) frames a list of texts
  into one queued write (``/acp``'s pump sends what its queue holds at once that way, and the peer
  what the shell writes when nothing is queued before it), and ``set_feed`` hands the texts read to
  the app's own function (``/acp``: the peer the shell reads) without a message each.
- **Inbound**: whole unfragmented masked text frames of valid UTF-8, no longer than
  ``websocket_max_message_size``, are unmasked here and handed to the app as ``websocket.receive``. At
  the first frame that is anything else (a control frame such as ping or close, a fragment, a binary
  frame, a reserved bit or opcode, an unmasked frame, a payload too long or not UTF-8) the bytes from
  that frame on go to wsproto, which from then on reads the connection as hypercorn does: a pong, the
  close handshake, 1009 for a message too long, the connection ended on a frame it cannot parse. Only whole frames were taken before it, so wsproto
  starts at a frame boundary, with no fragment or compression state to miss.

Neither applies when an extension was agreed. The handshake agrees none: hypercorn would accept
``permessage-deflate`` when the client offers it (browsers and Python's ``websockets`` do), and then
each message was compressed and decompressed with its context on both sides, ~10% more CPU per
prompt for JSON-RPC messages of a few hundred bytes, on a loopback or LAN where bytes are cheap. RFC
7692 lets a server decline an offer by answering without it: the client goes on uncompressed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.protocol.events import Data
from hypercorn.protocol.ws_stream import ASGIWebsocketState, WSStream
from wsproto.connection import ConnectionState

if TYPE_CHECKING:
    from .wire import BatchedWrites

__all__ = ["FRAMES_EXTENSION", "LeanWSStream", "frame_text", "parse_text_frames"]

#: the ASGI scope extension an open lean WebSocket offers its app: ``{"send_texts_nowait": callable}``
FRAMES_EXTENSION = "acp_server.ws_frames"

_OPEN = ConnectionState.OPEN
_CONNECTED = ASGIWebsocketState.CONNECTED
_FIN_TEXT = 0x81
_MASKED = 0x80


def _noop() -> None:
    pass


def frame_text(payload: bytes) -> bytes:
    """One unmasked final text frame carrying ``payload`` (UTF-8), as a server sends it."""
    n = len(payload)
    if n < 126:
        return bytes((_FIN_TEXT, n)) + payload
    if n < 0x10000:
        return bytes((_FIN_TEXT, 126)) + n.to_bytes(2, "big") + payload
    return bytes((_FIN_TEXT, 127)) + n.to_bytes(8, "big") + payload


def parse_text_frames(buf: bytes, max_size: int) -> tuple[list[str], int, bool]:
    """The texts of the whole plain frames at the start of ``buf`` (see the module docstring).

    Returns the texts, how many bytes of ``buf`` they took, and whether the frame after them is one
    this parser does not take (``True``: from that offset on the bytes are wsproto's). When it is
    ``False`` the bytes after the offset are the start of a frame not all in yet.
    """
    texts: list[str] = []
    at, end_of_buf = 0, len(buf)
    while end_of_buf - at >= 2:
        b1 = buf[at + 1]
        if buf[at] != _FIN_TEXT or not b1 & _MASKED:
            return texts, at, True
        n, head = b1 & 0x7F, at + 2
        if n == 126:
            if end_of_buf - at < 4:
                break
            n, head = int.from_bytes(buf[at + 2 : at + 4], "big"), at + 4
        elif n == 127:
            if end_of_buf - at < 10:
                break
            n, head = int.from_bytes(buf[at + 2 : at + 10], "big"), at + 10
        if n > max_size:
            return texts, at, True
        end = head + 4 + n
        if end > end_of_buf:
            break
        if n:
            mask = int.from_bytes(buf[head : head + 4] * ((n >> 2) + 1), "little") & ((1 << (n << 3)) - 1)
            data = (int.from_bytes(buf[head + 4 : end], "little") ^ mask).to_bytes(n, "little")
        else:
            data = b""
        try:
            texts.append(data.decode())
        except UnicodeDecodeError:
            return texts, at, True
        at = end
    return texts, at, False


class LeanWSStream(WSStream):
    """hypercorn's ``WSStream`` with the shortcuts of the module docstring."""

    #: the frames of an open connection without extensions are ours (set at the accept)
    lean = False
    #: the inbound frames are ours (until the first one that is not)
    lean_in = False
    #: the bytes of a frame not all in yet
    _partial = b""
    #: the connection's write queue, where frames go without a wait (the protocol sets it)
    batched: BatchedWrites | None = None
    #: where the texts read go instead of ``websocket.receive`` messages (see :meth:`set_feed`)
    feed: Callable[[bytes], Awaitable[None]] | None = None

    async def _accept(self, message: Any) -> None:
        self.handshake.extensions = None  # agree no extension (permessage-deflate): see the docstring
        await super()._accept(message)
        self.lean = self.lean_in = not self.connection._proto.extensions  # (none agreed: none enabled)
        if self.lean:
            self.scope["extensions"][FRAMES_EXTENSION] = {
                "send_texts_nowait": self.send_texts_nowait,
                "set_feed": self.set_feed,
            }

    def set_feed(self, feed: Callable[[bytes], Awaitable[None]] | None) -> None:
        """Hand the texts read from now on to ``feed`` (UTF-8 checked, as bytes) instead of as
        ``websocket.receive`` messages; it may wait, which pauses the reading as a full channel would.
        What wsproto reads after a hand-off still comes as messages, and so does the disconnect."""
        self.feed = feed

    def send_texts_nowait(self, payloads: list[bytes]) -> bool:
        """Frame each of ``payloads`` (UTF-8 text) and queue them in one write without a wait. ``False``:
        nothing was queued (the connection is closing, or the bytes are past the write bound): send
        them as ``websocket.send`` messages, which wait for room."""
        batched = self.batched
        if (
            batched is None
            or self.closed
            or self.state is not _CONNECTED
            or self.connection.state is not _OPEN
        ):
            return False
        # One call brings a whole burst (the shell's writes of a pass are joined before they come):
        # written at once when nothing is queued before it, as a socket's writes are, not joined by the
        # flusher in a pass of its own (hypercorn's own sends, which come a frame at a time, set it back).
        batched.join = False
        if not batched.send_nowait(b"".join([frame_text(p) for p in payloads])):
            return False
        if batched.queued:
            # Queued, not written (the kernel took less, or a write is under way): its writer was woken.
            # The shell's outbox may be calling from the end of a pass, just before trio waits for I/O:
            # make sure the run loop comes round for that writer.
            trio.lowlevel.current_trio_token().run_sync_soon(_noop)
        return True

    async def app_send(self, message: Any) -> None:
        if self.lean and message is not None and message["type"] == "websocket.send":
            text = message.get("text")
            if isinstance(text, str) and message.get("bytes") is None and self.send_texts_nowait([text.encode()]):
                return
        await super().app_send(message)  # (past the bound: wsproto frames it as we do, and the send waits)

    async def handle(self, event: Any) -> None:
        if self.lean_in and isinstance(event, Data) and not self.closed:
            await self.receive_frames(event.data)
            return
        await super().handle(event)

    async def receive_frames(self, data: bytes) -> None:
        """Bytes read from the open connection: their whole plain frames to the app, the rest kept or
        (from the first frame that is not plain) given to wsproto for good."""
        buf = self._partial + data if self._partial else data
        texts, taken, other = parse_text_frames(buf, self.config.websocket_max_message_size)
        feed = self.feed
        if feed is not None:
            for text in texts:
                await feed(text.encode())
        else:
            put = self.app_put
            assert put is not None  # (accepted: the app runs)
            for text in texts:
                await put({"type": "websocket.receive", "bytes": None, "text": text})
        if other:
            self.lean_in = False
            self._partial = b""
            await super().handle(Data(stream_id=self.stream_id, data=buf[taken:]))
        else:
            self._partial = buf[taken:]
