"""One plain HTTP/1.1 request served to the ASGI app by :class:`~.lean.LeanH11Protocol` (its module
docstring tells the design): the app's messages from a deque, and the response written by the stream
itself, its head held until the first body part so that a whole response is one write."""

from __future__ import annotations

from collections import deque
from time import time
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, StreamClosed

from .http1 import _CHUNKED, _CLOSE, _CONNECTION, _LENGTH, _NO_BODY, _date, _head
from .wire import HeldWrite

if TYPE_CHECKING:
    from .lean import LeanH11Protocol

__all__ = ["LeanStream"]


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
