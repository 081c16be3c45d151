"""A plain HTTP/1.1 request cycle with less per-request work: hypercorn's H11 protocol, one stream class swapped.

hypercorn serves each request through h11 and ``HTTPStream``: h11 parses it into events, the ASGI
app runs in a new task fed by a memory channel (two checkpoints per message, both sides), and every
response event (``http.response.start``, each body, the end) goes through h11's writer, which
validates and rewrites the headers again and frames a body of unknown length as chunks.
:class:`LeanH11Protocol` is hypercorn's H11 protocol with three shortcuts, each for what is plain:

- **Reading**: a whole request on a connection whose h11 state is fresh is read by
  :func:`simple_request` when it is plain (a strict request line and field grammar, HTTP/1.1, one
  ``Host``, at most one digits-only ``Content-Length``, no ``Transfer-Encoding``, ``Upgrade``,
  ``Expect`` or ``HTTP2-Settings``, not ``HEAD``, nothing pipelined after it; a small body that
  comes after its head is waited for). Anything else goes to h11 as before, which also answers a
  malformed request.
- **The app**: :class:`LeanStream` hands it its messages from a deque (a body already in comes
  without a checkpoint; the body's end rides on its last part). It runs in a task of its own, as in
  hypercorn, unless the app's ``inline_request(method, path)`` says the request only reads its body
  and answers (the REST API's ``POST`` and ``DELETE``): then it runs in the connection's reading
  task, and its answer leaves a scheduling pass earlier.
- **Answers from the head**: a request the app's ``direct_request(method, path, headers, body, client, fields)``
  answers (a REST prompt of the usual kind: see ``AcpHttpApp.direct_request``) gets no scope, no
  stream and no ASGI messages: its answer is written as an inline request's is.
- **Writing**: the stream writes the response, not h11. ``http.response.start`` is queued held
  (:class:`~.wire.HeldWrite`) and settled by the first body part when it comes before the queue is
  written, so that a whole response (head, ``content-length``, body) is one write; otherwise the head
  leaves as it is and the body is chunked, as h11 does. Header names and values are checked with
  h11's grammar (a bad one fails the app's send), and ``date`` is formatted once per second.

At the end of a response the connection serves the next request (h11 gets a fresh connection that
takes the bytes not parsed yet, where hypercorn calls ``start_next_cycle``), or closes when the
request asked to (``Connection: close``), its body was not read to its end, it was the last of
``keep_alive_max_requests``, or the app failed mid-response, as hypercorn does. A request that comes
while one read without h11 is served waits for its answer (h11's ``PAUSED``).

A WebSocket upgrade gets hypercorn's stream with its usual frames read and written without wsproto
(:class:`~.lean_ws.LeanWSStream`; once open, a read goes to it without the h11 loop). Anything else
keeps hypercorn's own stream: ``h2c``, HTTP/1.0, ``HEAD``,
``Expect: 100-continue``, ``server_names`` or raw headers in the config. Backpressure is hypercorn's:
a body whose messages the app does not read stops the reader at ``max_app_queue_size`` messages, and
writes go through the server's bound (:class:`~.wire.BatchedWrites`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, cast

import h11
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Request
from hypercorn.protocol.h11 import STREAM_ID, H11Protocol, H11WSConnection

from .http1 import (
    _CLOSE,
    _CONNECTION,
    _NO_BODY,
    PARTIAL_MAX,
    SimpleRequest,
    _date,
    _head,
    _target,
    _targets,
    _tokens,
    simple_request,
)
from .lean_stream import LeanStream
from .lean_ws import LeanWSStream
from .wire import BatchedWrites

__all__ = ["PARTIAL_MAX", "LeanH11Protocol", "LeanStream", "SimpleRequest", "simple_request"]

#: what the connection tells its server as a request comes in, and as it is over (frozen: made once)
_BUSY, _IDLE = Updated(idle=False), Updated(idle=True)


def _never(method: bytes, path: bytes) -> bool:
    return False


def _no_direct(*request: Any) -> None:
    """An app without ``direct_request``: every request takes its stream."""


class LeanH11Protocol(H11Protocol):
    """hypercorn's ``H11Protocol`` serving plain requests with :class:`LeanStream` (see the module docstring)."""

    _headers: list[tuple[bytes, bytes]]
    _plain = False
    #: the request being read is a WebSocket upgrade (set with ``_plain``, for a request that is not plain)
    _websocket = False
    #: the connection's stream (the server sets it): where a held head is queued
    batched: BatchedWrites
    #: the connection's server (it sets itself), whose keep-alive timer is told busy and idle by a
    #: call (``None``: by ``Updated`` events, as hypercorn's protocols tell it)
    timer: Any = None

    #: the h11 connection has seen nothing since it was made: a whole plain request may skip it
    _h11_fresh = True
    #: the first bytes of a plain request whose body is not all in yet, and that request
    _partial = b""
    _pending: SimpleRequest | None = None

    async def serve_plain(self, data: bytes) -> bool:
        """Bytes read, when they begin a plain request on a fresh connection with nothing else under
        way: served (or its first part kept) as :meth:`handle` would, without an event; ``False``:
        nothing was done, give them to :meth:`handle`."""
        config = self.config
        if not self._h11_fresh or self._pending is not None or config.server_names or config.h11_pass_raw_headers:
            return False  # (the last two: what _plain_off says, without its call)
        stream = self.stream
        if isinstance(stream, LeanStream) and stream.fast:
            return False  # (a request that waits for the one before it: handle pauses it)
        request = simple_request(data, config.h11_max_incomplete_size)
        if request is None:
            return False
        if request.missing:
            self._pending, self._partial = request, data
            await self._mark_busy()  # a request is coming in: no idle timeout
            return True
        await self._serve_simple(request)
        return True

    async def handle(self, event: Any) -> None:
        """Bytes read: a whole plain request on a fresh connection is served without h11 (the first
        part of one is kept until the rest is in); anything else goes through hypercorn's h11 loop."""
        if isinstance(event, RawData):
            data = event.data
            stream = self.stream
            if data and type(stream) is LeanWSStream and stream.lean_in:
                await stream.receive_frames(data)  # an open WebSocket's frames: no h11 loop, no event
                return
            if data:
                while isinstance(self.stream, LeanStream) and self.stream.fast:
                    await self.can_read.clear()  # the next request waits for this one's response (h11's PAUSED)
                    await self.can_read.wait()
                if self._h11_fresh and not self._plain_off:
                    request = self._pending
                    if request is not None:  # the rest of its body
                        self._pending = None
                        if len(data) <= request.missing:
                            request.body += data
                            request.missing -= len(data)
                        else:  # more than its body: a pipelined request, all of it for h11
                            request = None
                        data, self._partial = self._partial + data, b""
                    else:
                        request = simple_request(data, self.config.h11_max_incomplete_size)
                    if request is not None and request.missing:
                        self._pending, self._partial = request, data
                        await self._mark_busy()  # a request is coming in: no idle timeout
                        return
                    if request is not None:
                        await self._serve_simple(request)
                        return
                    event = RawData(data=data)
            elif self._partial:  # the end of input after part of a request: h11 tells it apart
                partial, self._partial, self._pending = self._partial, b"", None
                self._h11_fresh = False
                await super().handle(RawData(data=partial))
            self._h11_fresh = False
        await super().handle(event)

    @property
    def _plain_off(self) -> bool:
        return bool(self.config.server_names or self.config.h11_pass_raw_headers)

    async def _mark_busy(self) -> None:
        if self.timer is not None:
            self.timer.mark_busy()
        else:
            await self.send(_BUSY)

    async def _mark_idle(self) -> None:
        if self.timer is not None:
            self.timer.mark_idle()
        else:
            await self.send(_IDLE)

    async def _mark_request(self) -> None:
        """hypercorn's count of requests (it does nothing without ``max_requests``)."""
        if self.context.max_requests is not None:  # type: ignore[attr-defined]  # (trio's WorkerContext has it)
            await self.context.mark_request()

    async def _serve_simple(self, request: SimpleRequest) -> None:
        timer = self.timer
        if timer is not None:  # (what _mark_busy does, without a coroutine: once per request)
            timer.mark_busy()
        else:
            await self.send(_BUSY)
        path = request.target.partition(b"?")[0]
        direct = self._direct_rule
        if direct is None:
            direct = self._direct_rule = self._direct if self.log.access_logger is None else _no_direct
        answer = direct(request.method, path, request.headers, request.body, self.client, request.fields)
        if answer is not None:  # answered from its head (an inline request's answer, without its stream)
            self.keep_alive_requests += 1
            context = self.context
            if context.max_requests is not None:  # type: ignore[attr-defined]  # (as below)
                await context.mark_request()
            data, keep_alive = self._direct_bytes(answer, request.keep_alive)
            batched = self.batched
            batched.join = False  # (an HTTP/1.1 response needs no joining)
            if not batched.send_nowait(data):
                await self.send(RawData(data=data))
            # then what lean_done does once an inline request's answer is over
            if not keep_alive or context.terminated.is_set():
                await self.send(Closed())
            elif timer is not None:
                timer.mark_idle()
            else:
                await self.send(_IDLE)
            return
        rule = self._inline_rule
        if rule is None:
            rule = self._inline_rule = self._inline
        inline = rule(request.method, path)
        stream = self._open_stream(request.method, request.target, request.headers, keep_alive=request.keep_alive,
                                   spawn=not inline)
        stream.fast = True
        stream.inline = inline
        stream._inbox.append({"type": "http.request", "body": request.body, "more_body": False})  # (nobody waits yet)
        self.keep_alive_requests += 1
        if self.context.max_requests is not None:  # type: ignore[attr-defined]  # (trio's WorkerContext has it)
            await self.context.mark_request()
        if inline:
            await stream.run()

    #: :attr:`_inline` once asked
    _inline_rule: Any = None
    #: :attr:`_direct` once asked (:func:`_no_direct` with an access log, which needs the stream's scope)
    _direct_rule: Any = None

    def _direct_bytes(self, answer: tuple[int, list[tuple[bytes, bytes]], bytes], keep_alive: bool) -> tuple[bytes, bool]:
        """The whole response to a request the app answered from its head (``direct_request``), as
        :meth:`LeanStream.respond` writes an inline request's, and whether the connection stays. The
        app's headers carry no framing or connection header, and its status is a final one."""
        status, headers, body = answer
        config = self.config
        head, seen = _head(status, headers)
        if seen & _CLOSE or self.keep_alive_requests >= config.keep_alive_max_requests:
            keep_alive = False
        close = b"connection: close\r\n" if not keep_alive and not seen & _CONNECTION else b""
        if status in _NO_BODY:
            body, framing = b"", b""
        else:
            framing = b"content-length: %d\r\n" % len(body)
        return b"".join((head, _date.get(config), close, framing, b"\r\n", body)), keep_alive

    @property
    def _direct(self) -> Any:
        """The app's ``direct_request(method, path, headers, body, client, fields)`` (none: :func:`_no_direct`)."""
        app = getattr(self.app, "app", None)  # hypercorn's wrapper holds the ASGI app
        return getattr(app, "direct_request", None) or _no_direct

    @cached_property
    def log(self) -> Any:
        """The config's logger, read once (hypercorn's ``config.log`` is a property: a call per request)."""
        return self.config.log

    @cached_property
    def root_path(self) -> str:
        """The config's ``root_path``, read once (a property too)."""
        root: str = self.config.root_path
        return root

    @property
    def _inline(self) -> Any:
        """The app's ``inline_request(method, path)`` (``False`` for every request without one)."""
        app = getattr(self.app, "app", None)  # hypercorn's wrapper holds the ASGI app
        return getattr(app, "inline_request", None) or _never

    def _open_stream(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], *, keep_alive: bool, spawn: bool = True
    ) -> LeanStream:
        try:
            method_name, path_name, path, query_string = _targets[method, target]
        except KeyError:
            method_name, path_name, path, query_string = _target(method, target)
        scope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": method_name,
            "scheme": "https" if self.ssl else "http",
            "path": path_name,
            "raw_path": path,
            "query_string": query_string,
            "root_path": self.root_path,
            "headers": headers,
            "client": self.client,
            "server": self.server,
            "state": self.connection_state.copy(),
            "extensions": {},
        }
        stream = LeanStream(self, scope, keep_alive=keep_alive)
        self.stream = stream  # type: ignore[assignment]
        if spawn:
            self.task_group.spawn(stream.run)
        return stream

    async def _check_protocol(self, event: h11.Request) -> None:
        headers = list(event.headers)  # h11 lowercased the names and stripped the values
        self._headers = headers
        upgrade = expect = False
        close = False
        upgrade_value = connection_value = b""  # (the last of each, as hypercorn reads them)
        for name, value in headers:
            if name == b"upgrade" or name == b"http2-settings":
                upgrade = True
                if name == b"upgrade":
                    upgrade_value = value
            elif name == b"expect":
                expect = True
            elif name == b"connection":
                connection_value = value
                if b"close" in _tokens(value):
                    close = True
        config = self.config
        self._plain = not (
            upgrade or expect or event.http_version != b"1.1" or event.method.upper() in (b"HEAD", b"PRI")
            or config.server_names or config.h11_pass_raw_headers
        )
        self._close_asked = close
        if not self._plain:
            # hypercorn's test for a WebSocket upgrade (``H11Protocol._create_stream``), on the same walk
            self._websocket = (
                event.method.upper() == b"GET"
                and upgrade_value.lower() == b"websocket"
                and b"upgrade" in _tokens(connection_value)
                and not config.h11_pass_raw_headers
            )
            await super()._check_protocol(event)

    async def _create_stream(self, request: h11.Request) -> None:
        if not self._plain:
            if self._websocket:
                await self._open_websocket(request)
            else:
                await super()._create_stream(request)
            return
        self._open_stream(request.method, request.target, self._headers, keep_alive=not self._close_asked)
        self.keep_alive_requests += 1
        await self._mark_request()

    async def _open_websocket(self, request: h11.Request) -> None:
        """hypercorn's ``_create_stream`` for a WebSocket upgrade, with :class:`LeanWSStream`."""
        stream = LeanWSStream(
            self.app, self.config, self.context, self.task_group, self.ssl, self.client, self.server,
            self.stream_send, STREAM_ID,
        )
        stream.batched = getattr(self, "batched", None)
        self.stream = stream
        self.connection = H11WSConnection(cast(h11.Connection, self.connection))
        await stream.handle(
            Request(
                stream_id=STREAM_ID, headers=list(request.headers), http_version=request.http_version.decode(),
                method=request.method.decode("ascii").upper(), raw_path=request.target,
                state=self.connection_state,
            )
        )
        self.keep_alive_requests += 1
        await self._mark_request()

    def lean_done_now(self, stream: LeanStream) -> bool:
        """:meth:`lean_done` when it needs no wait: an inline request's answer is over and the
        connection stays (``False``: nothing done, await :meth:`lean_done`)."""
        timer = self.timer
        if not stream.inline or not stream.keep_alive or timer is None or self.context.terminated.is_set():
            return False
        if self.stream is stream:  # type: ignore[comparison-overlap]
            self.stream = None
        stream.closed = True
        stream._put({"type": "http.disconnect"})
        stream._wake_reader()
        timer.mark_idle()
        return True

    async def lean_done(self, stream: LeanStream) -> None:
        """``stream``'s response is over: serve the next request with a fresh h11 connection (it takes
        the bytes not parsed yet), or close when the request, the app or the bound says so."""
        if self.stream is stream:  # type: ignore[comparison-overlap]
            self.stream = None
        stream.closed = True
        stream._put({"type": "http.disconnect"})
        stream._wake_reader()
        old = self.connection
        if stream.fast:  # h11 saw nothing of it
            if not stream.inline:  # (an inline one's reader is the task answering: it waits for nothing)
                await self.can_read.set()
            if not stream.keep_alive or self.context.terminated.is_set():
                await self.send(Closed())
            elif self.timer is not None:  # (what _mark_idle does, without a coroutine)
                self.timer.mark_idle()
            else:
                await self.send(_IDLE)
        elif stream.keep_alive and not self.context.terminated.is_set() and old.their_state is h11.DONE:
            data, closed = old.trailing_data
            fresh = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)
            if data:
                fresh.receive_data(data)
            if closed:
                fresh.receive_data(b"")
            self.connection = fresh
            self._h11_fresh = not data and not closed
            await self.can_read.set()
            await self._mark_idle()
        else:
            await self.can_read.set()
            await self.send(Closed())

    async def _send_error_response(self, status_code: int) -> None:
        if isinstance(self.stream, LeanStream) and self.stream._state != "request":
            return  # the app answered already: no second response on the wire
        await super()._send_error_response(status_code)
