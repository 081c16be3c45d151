"""``ws://HOST:PORT/acp`` as a byte stream of NDJSON: wsproto (sans-I/O) under a small trio shell.

wsproto is what hypercorn itself speaks WebSocket with, so it costs no new dependency, and it keeps
the wire state machine apart from the task that moves bytes (the shape of our JSON-RPC core). Each
line written goes out as one text frame; each text message received comes back as one line. Binary
messages are ignored; pings are answered. Writes hold a lock (a pong may be sent by the reader while
the writer writes).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from ..auth.tls import open_tls_stream

__all__ = ["WebSocketStream", "open_websocket"]

log = logging.getLogger("acp_server.client")

_READ_SIZE = 65536


class WebSocketStream(trio.abc.Stream):
    """One open WebSocket, as NDJSON (see the module docstring)."""

    def __init__(self, sock: trio.abc.Stream, ws: WSConnection) -> None:
        self._sock = sock
        self._ws = ws
        self._lock = trio.Lock()
        self._inbound = bytearray()
        self._text: list[str] = []
        self._partial = b""
        self._ended = False
        #: the server's Acp-Connection-Id (from the handshake)
        self.connection_id: str | None = None

    async def _write(self, data: bytes) -> None:
        async with self._lock:
            await self._sock.send_all(data)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._ended:
            raise trio.BrokenResourceError("the WebSocket is closed")
        chunk = self._partial + bytes(data)
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        out = b"".join(self._ws.send(TextMessage(data=line.decode())) for line in lines if line.strip())
        if out:
            await self._write(out)

    async def wait_send_all_might_not_block(self) -> None:
        await self._sock.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        size = max_bytes or _READ_SIZE
        while not self._inbound:
            if self._ended:
                await trio.lowlevel.checkpoint()
                return b""
            data = await self._sock.receive_some(_READ_SIZE)
            self._ws.receive_data(bytes(data) if data else None)
            await self._events()
            if not data:
                self._ended = True
        out = bytes(self._inbound[:size])
        del self._inbound[:size]
        return out

    async def _events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    self._inbound += "".join(self._text).encode()
                    self._inbound += b"\n"
                    self._text = []
            elif isinstance(event, BytesMessage):
                continue
            elif isinstance(event, Ping):
                await self._write(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self._ended = True
                if self._ws.state is ConnectionState.REMOTE_CLOSING:  # the server closed first: answer
                    try:
                        await self._write(self._ws.send(event.response()))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    async def send_eof(self) -> None:
        """Close our side (a close frame): the server ends the connection, as after a socket's end."""
        if self._ws.state is not ConnectionState.OPEN:
            return
        try:
            await self._write(self._ws.send(CloseConnection(code=1000)))
        except Exception as exc:  # wsproto refuses when the close is already under way
            log.debug("WebSocket close: %r", exc)

    async def aclose(self) -> None:
        if not self._ended:
            with trio.move_on_after(1):
                await self.send_eof()
            self._ended = True
        await self._sock.aclose()


@asynccontextmanager
async def open_websocket(
    url: str, ca_file: str | None = None, *, token: str | None = None
) -> AsyncIterator[WebSocketStream]:
    """Open ``ws://HOST:PORT/PATH`` or ``wss://HOST:PORT/PATH``; the handshake's refusal (a 401, 403,
    503) is an ``OSError`` naming it.

    Args:
        url: the endpoint.
        ca_file: PEM file of the CAs a ``wss://`` server's certificate is checked against (default:
            the system trust store).
        token: sent as ``Authorization: Bearer`` with the handshake.

    Raises:
        ValueError: not a ``ws://`` or ``wss://`` URL.
        TlsConfigError: ``ca_file`` cannot be used.
        OSError: nothing listens there, the server refused the handshake, or (``ConnectionError``
            naming ``--ca-file``) its certificate is not trusted.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"{url!r} is not ws://HOST:PORT/PATH or wss://HOST:PORT/PATH")
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    sock: trio.abc.Stream
    if secure:
        try:
            sock = await open_tls_stream(parts.hostname, port, ca_file)
        except ConnectionError as exc:
            raise ConnectionError(str(exc).replace(f"tls://{parts.hostname}:{port}", url, 1)) from exc
    else:
        sock = await trio.open_tcp_stream(parts.hostname, port)
    try:
        ws = WSConnection(ConnectionType.CLIENT)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        extra = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
        await sock.send_all(ws.send(Request(host=f"{host}:{port}", target=target, extra_headers=extra)))
        stream = WebSocketStream(sock, ws)
        status: int | None = None
        body = b""
        refused = False
        while stream.connection_id is None and not refused:
            data = await sock.receive_some(_READ_SIZE)
            if not data:
                raise OSError(f"{url}: the server closed the connection during the WebSocket handshake")
            ws.receive_data(bytes(data))
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    headers = dict(event.extra_headers)
                    stream.connection_id = headers.get(b"acp-connection-id", b"").decode() or "?"
                elif isinstance(event, RejectConnection):
                    status = event.status_code
                    refused = not event.has_body
                elif isinstance(event, RejectData):
                    body += event.data
                    refused = event.body_finished
        if refused:
            detail = body.decode(errors="replace")[:500]
            raise OSError(f"{url}: the WebSocket handshake was refused: HTTP {status} {detail}")
    except BaseException:
        await sock.aclose()
        raise
    try:
        yield stream
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            await stream.aclose()
