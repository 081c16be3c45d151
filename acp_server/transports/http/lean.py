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

Anything else keeps hypercorn's own stream: a WebSocket upgrade, ``h2c``, HTTP/1.0, ``HEAD``,
``Expect: 100-continue``, ``server_names`` or raw headers in the config. Backpressure is hypercorn's:
a body whose messages the app does not read stops the reader at ``max_app_queue_size`` messages, and
writes go through the server's bound (:class:`~.wire.BatchedWrites`).
"""

from __future__ import annotations

from collections import deque
from functools import cached_property
from time import time
from typing import Any

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, StreamClosed
from hypercorn.protocol.h11 import H11Protocol

from .http1 import (
    _CHUNKED,
    _CLOSE,
    _CONNECTION,
    _LENGTH,
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
from .wire import BatchedWrites, HeldWrite

__all__ = ["PARTIAL_MAX", "LeanH11Protocol", "LeanStream", "SimpleRequest", "simple_request"]

#: what the connection tells its server as a request comes in, and as it is over (frozen: made once)
_BUSY, _IDLE = Updated(idle=False), Updated(idle=True)


class LeanStream:
    """One plain HTTP/1.1 request served to the ASGI app (see the module docstring).

    Args:
        protocol: the connection's protocol (it writes and recycles the connection).
        scope: the request's ASGI scope.
        keep_alive: whether the request lets the connection serve another one after it.
    """

    def __init__(self, protocol: LeanH11Protocol, scope: dict[str, Any], *, keep_alive: bool) -> None:
        self.protocol = protocol
        self.scope = scope
        self.keep_alive = keep_alive
        self.closed = False
        self.start_time = time()
        self._log: Any = protocol.log
        self._inbox: deque[dict[str, Any]] = deque()

    idle = False
    #: the app's ``http.response.start`` (for the access log)
    _response: dict[str, Any] = {}  # noqa: RUF012 - never changed: replaced by the app's message
    #: what the app's ``receive`` and the reader's backpressure wait on (made when one waits)
    _ready: trio.Event | None = None
    _room: trio.Event | None = None
    #: "request", then "held" (head not written), "body" (head written), "done"
    _state = "request"
    #: the queued head, until a body part settles it or the flusher takes it as it is (an inline
    #: request's head is not queued: it waits for its body here)
    _held: HeldWrite | None = None
    _status = 0
    #: the status line and header lines (without the framing header and the blank line)
    _head_bytes = b""
    _seen = 0
    #: read whole by :func:`simple_request`, without h11
    fast = False
    #: served in the connection's reading task, which reads nothing more meanwhile
    inline = False
    _chunked = False

    # --- from the connection: the request body and the end of the connection -------------------------

    async def handle(self, event: Any) -> None:
        """A body part, the body's end, or the connection's end (``StreamClosed``)."""
        if self.closed:
            return
        if isinstance(event, Body):
            self._put({"type": "http.request", "body": bytes(event.data), "more_body": True})
            while len(self._inbox) >= self.protocol.config.max_app_queue_size and not self.closed:
                self._room = trio.Event()
                await self._room.wait()
        elif isinstance(event, EndBody):
            last = self._inbox[-1] if self._inbox else None
            if last is not None and last["type"] == "http.request":
                last["more_body"] = False  # the end rides on the body part not read yet
                self._wake_app()
            else:
                self._put({"type": "http.request", "body": b"", "more_body": False})
        elif isinstance(event, StreamClosed):
            self.closed = True
            if self._state != "done":
                await self._log.access(self.scope, None, time() - self.start_time)
            self._put({"type": "http.disconnect"})
            self._wake_reader()

    def _put(self, message: dict[str, Any]) -> None:
        self._inbox.append(message)
        self._wake_app()

    def _wake_app(self) -> None:
        if self._ready is not None:
            self._ready.set()

    def _wake_reader(self) -> None:
        if self._room is not None:
            self._room.set()

    # --- the app's side -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the app on this request (a task of the connection's task group), as hypercorn's ``_handle``."""
        protocol = self.protocol
        config: Any = protocol.config
        app: Any = protocol.app
        try:
            if type(app) is ASGIWrapper:  # (the ASGI app itself, without the wrapper's coroutine around it)
                inner: Any = app.app
                await inner(self.scope, self.receive, self.send)
            else:
                await app(self.scope, self.receive, self.send, trio.to_thread.run_sync, trio.from_thread.run)
        except trio.Cancelled:
            raise
        except BaseExceptionGroup as error:
            _, others = error.split(trio.Cancelled)
            if others is None:
                raise
            await config.log.exception("Error in ASGI Framework")
        except Exception:
            await config.log.exception("Error in ASGI Framework")
        finally:
            if self._held is not None or not (self.closed or self._state == "done"):
                await self._app_done()

    async def receive(self) -> dict[str, Any]:
        """The next message of the request (no checkpoint when one is there already). An inline
        request has nothing after its body that its reading task could bring: past it, it reads as gone."""
        if self.inline and not self._inbox:
            return {"type": "http.disconnect"}
        while not self._inbox:
            self._ready = trio.Event()
            await self._ready.wait()
        message = self._inbox.popleft()
        self._wake_reader()
        return message

    def body_nowait(self) -> bytes | None:
        """The request's whole body, taken, when it is all in already as the next message (what
        :meth:`receive` would give, to the end of the body); ``None``: read it with :meth:`receive`."""
        inbox = self._inbox
        if len(inbox) != 1:
            return None
        message = inbox[0]
        if message["type"] != "http.request" or message["more_body"]:
            return None
        inbox.popleft()
        self._wake_reader()
        body: bytes = message["body"]
        return body

    async def send(self, message: dict[str, Any]) -> None:
        """One ASGI message of the response (dropped once the connection is gone)."""
        kind = message["type"]
        if kind == "http.response.start" and self._state == "request":
            self._start_head(int(message["status"]), message.get("headers", []))
            self._response = message
        elif kind == "http.response.body" and self._state in ("held", "body"):
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if self.closed:
                if not more:
                    self._state = "done"
                return
            await self._write_body(body, more)
        elif kind in ("http.response.push", "http.response.early_hint", "http.response.trailers"):
            return  # HTTP/2 and /3 only: ignored on HTTP/1.1, as hypercorn does
        else:
            from hypercorn.utils import UnexpectedMessageError

            raise UnexpectedMessageError(self._state, kind)  # type: ignore[arg-type]

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response at once: what ``send`` of ``http.response.start`` then of its one
        ``http.response.body`` does, without the two messages."""
        if self._state != "request":
            await self.send({"type": "http.response.start", "status": status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})
            return
        if self.inline and not self.closed and self._log.access_logger is None:
            head, seen = _head(status, headers)  # a header h11 would refuse fails the app's send
            if not seen & (_LENGTH | _CHUNKED) and status >= 200:  # (the usual answer: one write, at once)
                # what _start_head then _write_body do for it, in one step: head, date, framing, body
                protocol = self.protocol
                config = protocol.config
                if seen & _CLOSE or protocol.keep_alive_requests >= config.keep_alive_max_requests:
                    self.keep_alive = False
                close = b"connection: close\r\n" if not self.keep_alive and not seen & _CONNECTION else b""
                if status in _NO_BODY:
                    body, framing = b"", b""
                else:
                    framing = b"content-length: %d\r\n" % len(body)
                self._status, self._seen = status, seen
                self._state = "body"
                data = b"".join((head, _date.get(config), close, framing, b"\r\n", body))
                batched = protocol.batched
                batched.join = False  # (an HTTP/1.1 response needs no joining)
                if not batched.send_nowait(data):
                    await protocol.send(RawData(data=data))
                self._state = "done"
                if not protocol.lean_done_now(self):
                    await protocol.lean_done(self)
                return
        self._start_head(status, headers)
        if self._log.access_logger is not None:
            self._response = {"type": "http.response.start", "status": status, "headers": headers}
        if self.closed:
            self._state = "done"
            return
        await self._write_body(body, False)

    def _start_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Check the head and queue it held: the first body part settles it, with the framing it
        allows, if it comes before the flusher takes the head; else the head leaves as it is, its
        body chunked (or as long as the app's ``content-length``). An inline request's head is not
        queued: its app sends the body right after (it only answers), and nothing else writes on the
        connection meanwhile (its reading task is the one answering)."""
        protocol = self.protocol
        config = protocol.config
        head, seen = _head(status, headers)  # a header h11 would refuse fails the app's send
        if seen & _CLOSE or protocol.keep_alive_requests >= config.keep_alive_max_requests:
            self.keep_alive = False
        close = b"connection: close\r\n" if not self.keep_alive and not seen & _CONNECTION else b""
        self._status, self._head_bytes, self._seen = status, b"".join((head, _date.get(config), close)), seen
        self._state = "held"
        if not self.inline:
            self._held = HeldWrite(self._head_alone)
            protocol.batched.hold(self._held)

    def _framing(self, body: bytes, more: bool) -> bytes:
        """The framing header of the head (none when the app framed it, or for a bodiless status)."""
        if self._status in _NO_BODY or self._status < 200 or self._seen & (_LENGTH | _CHUNKED):
            self._chunked = bool(self._seen & _CHUNKED)
            return b""
        if more:
            self._chunked = True
            return b"transfer-encoding: chunked\r\n"
        return b"content-length: %d\r\n" % len(body)

    def _head_alone(self) -> bytes:
        """The held head as the flusher takes it before any body part: the body's length is unknown."""
        self._state = "body"
        return b"".join((self._head_bytes, self._framing(b"", True), b"\r\n"))

    async def _write_body(self, body: bytes, more: bool) -> None:
        protocol = self.protocol
        held = self._held
        if self._state == "held":  # the head is not written yet (queued, or an inline one's): head and body leave as one
            self._held = None
            if self._status in _NO_BODY or self._status < 200:
                body = b""
            framing = self._framing(body, more)
            self._state = "body"
            data = b"".join((self._head_bytes, framing, b"\r\n", self._frame(body, more)))
            if held is not None:
                await protocol.batched.settle(held, data)
            else:
                batched = protocol.batched
                batched.join = False  # (as a held head does: an HTTP/1.1 response needs no joining)
                if not batched.send_nowait(data):
                    await protocol.send(RawData(data=data))
        else:
            self._held = None
            data = self._frame(body, more)
            if data:
                await protocol.send(RawData(data=data))
        if not more:
            self._state = "done"
            if self._log.access_logger is not None:  # (none by default: no coroutine per request for nothing)
                await self._log.access(self.scope, self._response, time() - self.start_time)
            await protocol.lean_done(self)

    def send_chunk_nowait(self, body: bytes) -> bool:
        """Write one more part of a chunked body, past its head, if that needs no wait (what
        ``send`` of ``more_body`` would write); ``False``: not done, use ``send``."""
        if self._state != "body" or self.closed or not self._chunked or not body:
            return False
        return self.protocol.batched.send_nowait(b"%x\r\n%s\r\n" % (len(body), body))

    def _frame(self, body: bytes, more: bool) -> bytes:
        """A body part as it goes on the wire (a chunk when chunked; the last chunk at the end)."""
        if not self._chunked:
            return body
        chunk = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
        return chunk if more else chunk + b"0\r\n\r\n"

    async def _app_done(self) -> None:
        """The app returned: a request it never answered gets a 500; a response it left unfinished
        closes the connection (hypercorn's ``app_send(None)``)."""
        protocol = self.protocol
        if self.closed or self._state == "done":
            if self._held is not None:
                protocol.batched.drop(self._held)  # a head nobody will settle
            return
        held = self._held
        head, _ = _head(500, [(b"content-length", b"0"), (b"connection", b"close")])
        error = b"".join((head, _date.get(protocol.config), b"\r\n"))
        unanswered = self._state in ("request", "held")
        if held is not None and self._state == "held":  # a head not sent yet: a 500 in its place
            await protocol.batched.settle(held, error)
        elif unanswered:  # nothing sent, or an inline request's head not written yet
            await protocol.send(RawData(data=error))
        if held is not None or unanswered:
            await self._log.access(self.scope, {"status": 500, "headers": []}, time() - self.start_time)
        self._state = "done"
        self.keep_alive = False
        await protocol.lean_done(self)


def _never(method: bytes, path: bytes) -> bool:
    return False


def _no_direct(*request: Any) -> None:
    """An app without ``direct_request``: every request takes its stream."""


class LeanH11Protocol(H11Protocol):
    """hypercorn's ``H11Protocol`` serving plain requests with :class:`LeanStream` (see the module docstring)."""

    _headers: list[tuple[bytes, bytes]]
    _plain = False
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
        answer = direct(request.method, path, request.headers, request.body, self.client)
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
        """The app's ``direct_request(method, path, headers, body, client)`` (none: :func:`_no_direct`)."""
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
        for name, value in headers:
            if name == b"upgrade" or name == b"http2-settings":
                upgrade = True
            elif name == b"expect":
                expect = True
            elif name == b"connection" and b"close" in _tokens(value):
                close = True
        config = self.config
        self._plain = not (
            upgrade or expect or event.http_version != b"1.1" or event.method.upper() in (b"HEAD", b"PRI")
            or config.server_names or config.h11_pass_raw_headers
        )
        self._close_asked = close
        if not self._plain:
            await super()._check_protocol(event)

    async def _create_stream(self, request: h11.Request) -> None:
        if not self._plain:
            await super()._create_stream(request)
            return
        self._open_stream(request.method, request.target, self._headers, keep_alive=not self._close_asked)
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
