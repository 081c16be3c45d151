"""ACP's remote transport from the client's side: ``http://.../acp`` and ``ws://.../acp`` as a byte stream.

The client (:class:`~acp_server.client.connection.RpcConnection`) and ``acp-server connect`` speak
newline-delimited JSON to a trio stream; :func:`open_remote_stream` gives them one over the RFD's
transport, so every feature of ``tcp://`` (self-heal, retries, the pending limit, cancel) works
unchanged:

- ``http://``: each message written is POSTed (``initialize`` first, whose 200 answer carries
  ``Acp-Connection-Id``; the rest with that id, and ``Acp-Session-Id`` for session-scoped methods);
  what the server sends arrives on event streams (GET ``text/event-stream``): the connection's, opened
  after ``initialize``, and one per session, opened once a session is established (the answer to
  ``session/new``, ``load``, ``resume`` or ``_acp_server/fork``) or seen in a message. A refused POST
  becomes the JSON-RPC error of its request (the body carries the same ``errorKind`` and data); a
  connection the server no longer knows (404 ``unknown_connection``: it restarted) ends the stream, as
  a closed socket would, so the client heals.
- ``ws://``: one JSON-RPC message per text frame (:mod:`.websocket`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from ..errors import REGISTRY
from ..transports.http.rules import (
    CONNECTION_HEADER,
    ESTABLISHING_METHODS,
    RESULT_SESSION_METHODS,
    SESSION_HEADER,
    SESSION_SCOPED_METHODS,
    decode_outbound,
)

__all__ = ["HttpClientStream", "is_remote_url", "open_remote_stream"]

log = logging.getLogger("acp_server.client")

_JSON = {"content-type": "application/json"}


def is_remote_url(url: str) -> bool:
    """``http://`` or ``ws://``: served by :func:`open_remote_stream`."""
    return url.startswith(("http://", "ws://"))


class _Inbox:
    """Bytes for ``receive_some``: NDJSON lines, then the end."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ended = False
        self._ready = trio.Event()

    def push(self, line: bytes) -> None:
        self.buffer += line
        self.buffer += b"\n"
        self._ready.set()

    def end(self) -> None:
        self.ended = True
        self._ready.set()

    async def take(self, max_bytes: int) -> bytes:
        while not self.buffer:
            if self.ended:
                await trio.lowlevel.checkpoint()
                return b""
            self._ready = trio.Event()
            await self._ready.wait()
        data = bytes(self.buffer[:max_bytes])
        del self.buffer[:max_bytes]
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data


class HttpClientStream(trio.abc.Stream):
    """NDJSON over Streamable HTTP (see the module docstring). Made by :func:`open_remote_stream`."""

    def __init__(self, url: str, client: Any, nursery: trio.Nursery) -> None:
        self.url = url
        self._client = client
        self._nursery = nursery
        self._inbox = _Inbox()
        self._partial = b""
        self.connection_id: str | None = None
        self._streams: set[str] = set()  # sessions whose stream is open (or opening)
        self._establishing: dict[Any, tuple[str, str | None]] = {}
        self._closed = False

    # --- writing: one POST per message --------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed or self._inbox.ended:
            raise trio.BrokenResourceError("the HTTP connection is closed")
        chunk = self._partial + bytes(data)
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        import httpx

        for line in lines:
            if line.strip():
                try:
                    await self._post(line)
                except httpx.HTTPError as exc:
                    self._inbox.end()
                    raise trio.BrokenResourceError(f"POST {self.url} failed: {exc!r}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _post(self, line: bytes) -> None:
        env = decode_outbound(line)
        method = env.method if env is not None else None
        headers = dict(_JSON)
        if method == "initialize":
            response = await self._client.post(self.url, content=line, headers=headers)
            if response.status_code == 200 and response.headers.get(CONNECTION_HEADER):
                self.connection_id = response.headers[CONNECTION_HEADER]
                self._received(response.content)
                self._open_stream(None)
            else:
                self._refused(env, response)
            return
        if self.connection_id is None:
            raise trio.BrokenResourceError("initialize first: the HTTP transport has no connection id yet")
        headers[CONNECTION_HEADER] = self.connection_id
        if env is not None and env.is_request:
            session_id = env.params_session()
            if method in SESSION_SCOPED_METHODS and session_id is not None:
                headers[SESSION_HEADER] = session_id
            if method in ESTABLISHING_METHODS:
                self._establishing[env.id] = (method, None if method in RESULT_SESSION_METHODS else session_id)
        elif env is not None and env.method in SESSION_SCOPED_METHODS:
            session_id = env.params_session()  # session/cancel
            if session_id is not None:
                headers[SESSION_HEADER] = session_id
        response = await self._client.post(self.url, content=line, headers=headers)
        if response.status_code not in (200, 202):
            self._refused(env, response)

    def _refused(self, env: Any, response: Any) -> None:
        """A non-2xx answer: its request fails with the same error; an unknown connection ends us."""
        try:
            body = msgspec.json.decode(response.content)
        except msgspec.DecodeError:
            body = {}
        kind = body.pop("code", "internal") if isinstance(body, dict) else "internal"
        message = body.pop("error", f"HTTP {response.status_code}") if isinstance(body, dict) else "HTTP error"
        log.info("POST %s refused: %s %s", self.url, response.status_code, message)
        if kind == "unknown_connection":
            self._inbox.end()
            return
        if env is None or not env.is_request:
            return
        cls = REGISTRY.get(kind)
        error = {"code": cls.code if cls else -32603, "message": message, "data": {"errorKind": kind, **body}}
        self._inbox.push(msgspec.json.encode({"jsonrpc": "2.0", "id": env.id, "error": error}))

    # --- reading: event streams ----------------------------------------------------------------------

    def _received(self, line: bytes) -> None:
        env = decode_outbound(line)
        if env is not None:
            session_id = env.params_session() or env.result_session()
            if env.is_response:
                route = self._establishing.pop(env.id, None)
                if route is not None and bytes(env.result) != b"null":
                    session_id = route[1] or session_id
            if session_id is not None and session_id not in self._streams:
                self._open_stream(session_id)
        self._inbox.push(line)

    def _open_stream(self, session_id: str | None) -> None:
        if self._closed:
            return
        if session_id is not None:
            self._streams.add(session_id)
        self._nursery.start_soon(self._read_stream, session_id)

    async def _read_stream(self, session_id: str | None) -> None:
        import httpx

        if self.connection_id is None:
            return  # the input ended (DELETE) before this stream could open
        headers = {"accept": "text/event-stream", CONNECTION_HEADER: self.connection_id}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
        try:
            async with self._client.stream("GET", self.url, headers=headers) as response:
                if response.status_code != 200:
                    log.info("GET %s (session %s): %s", self.url, session_id, response.status_code)
                    return
                data: list[str] = []
                async for text in response.aiter_lines():
                    if not text:
                        if data:
                            self._received("\n".join(data).encode())
                            data = []
                    elif text.startswith("data:"):
                        data.append(text[6:] if text.startswith("data: ") else text[5:])
        except httpx.HTTPError as exc:
            log.info("event stream of %s ended: %r", self.url, exc)
        finally:
            if session_id is None:
                self._inbox.end()  # the connection stream is the connection: its end is ours
            else:
                self._streams.discard(session_id)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._inbox.take(max_bytes or 65536)

    # --- closing -------------------------------------------------------------------------------------

    async def send_eof(self) -> None:
        """Like a socket's shutdown: the server ends the connection (DELETE)."""
        if self.connection_id is None:
            self._inbox.end()  # no connection was opened (initialize refused): nothing more will come
            return
        await self._delete()

    async def _delete(self) -> None:
        if self.connection_id is None or self._closed:
            return
        connection_id, self.connection_id = self.connection_id, None
        try:
            with trio.move_on_after(2):
                await self._client.request("DELETE", self.url, headers={CONNECTION_HEADER: connection_id})
        except Exception as exc:  # the server may be gone already; nothing to do about it
            log.debug("DELETE %s failed: %r", self.url, exc)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._delete()
        self._closed = True
        self._inbox.end()
        self._nursery.cancel_scope.cancel()


@asynccontextmanager
async def _open_http(url: str, token: str | None = None) -> AsyncIterator[trio.abc.Stream]:
    import httpx  # loaded only for http:// targets

    # no read timeout: event streams are long-lived; no connection cap: each open stream holds one
    timeout = httpx.Timeout(30.0, read=None)
    headers = {"authorization": f"Bearer {token}"} if token is not None else None
    limits = httpx.Limits(max_connections=None)
    raised: BaseException | None = None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        try:
            async with trio.open_nursery() as nursery:
                stream = HttpClientStream(url, client, nursery)
                try:
                    yield stream
                except BaseException as exc:
                    raised = exc
                    raise
                finally:
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
        except BaseExceptionGroup as group:
            # the caller's own error, wrapped by our nursery on its way out: hand it back as raised
            if raised is None or len(group.exceptions) != 1 or group.exceptions[0] is not raised:
                raise
            raise raised from None


@asynccontextmanager
async def open_remote_stream(url: str, *, token: str | None = None) -> AsyncIterator[trio.abc.Stream]:
    """A byte stream of NDJSON to the ``/acp`` endpoint at ``url`` (``http://`` or ``ws://``).

    ``token``: sent as ``Authorization: Bearer`` on every request (and the WebSocket handshake).

    Raises:
        ValueError: another scheme.
        OSError: nothing listens there (``ws://``; for ``http://`` the first POST fails).
    """
    if url.startswith("http://"):
        async with _open_http(url, token) as stream:
            yield stream
    elif url.startswith("ws://"):
        from .websocket import open_websocket

        async with open_websocket(url, token=token) as ws:
            yield ws
    else:
        raise ValueError(f"{url!r}: a remote ACP endpoint is http://HOST:PORT/acp or ws://HOST:PORT/acp")
