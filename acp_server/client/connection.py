"""The client's side of one JSON-RPC connection: the trio shell around the sans-I/O core.

The mirror of :mod:`acp_server.transports.shell`: one reader feeds :class:`~acp_server.jsonrpc.Connection`
and routes its events (answers to our calls, ``session/update`` into per-session streams, the server's
own requests to the hooks); one writer owns the stream and joins what is queued into one ``send_all``.
Sending never waits (the outbox is unbounded: a client only writes what its caller asks for), so a
cancelled caller can still send ``$/cancel_request`` for its request.

A call abandoned by its caller stays in the table until its answer or the connection's end, so a late
answer is consumed quietly and whatever the call held (a pending-prompt slot) is released then.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from ..errors import AcpError, InternalError, MethodNotFoundError
from ..jsonrpc import (
    NEED_DATA,
    Batch,
    Connection,
    ErrorReply,
    Notification,
    Request,
    Response,
    TooLarge,
    encode_error,
)
from ..types.acp import CancelRequestParams
from .errors import ConnectionLostError, ProtocolError, error_from_response
from .hooks import Hooks
from .updates import Update, UpdateStream

__all__ = ["Call", "RpcConnection"]

log = logging.getLogger("acp_server.client")

Id = int | str

_READ_SIZE = 65536
_decode_update = msgspec.json.Decoder(Update).decode
_decode_any = msgspec.json.Decoder().decode


class Call:
    """One request of ours, from send to answer (or the connection's end).

    Attributes:
        id: its JSON-RPC id.
        method: the method called.
        done: set once the outcome is known.
        result: the result, when it succeeded.
        error: the error object, when the server answered with one.
        lost: why the connection ended before an answer (``None`` while it lives).
        undecodable: the server's answer to this id could not be read (the detail).
    """

    __slots__ = ("_on_done", "done", "error", "id", "lost", "method", "result", "undecodable")

    def __init__(self, id: Id, method: str) -> None:
        self.id = id
        self.method = method
        self.done = trio.Event()
        self.result: Any = None
        self.error: dict[str, Any] | None = None
        self.lost: str | None = None
        self.undecodable: str | None = None
        self._on_done: list[Callable[[], None]] = []

    def when_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the outcome is known (now, if it already is)."""
        if self.done.is_set():
            callback()
        else:
            self._on_done.append(callback)

    def _finish(self) -> None:
        self.done.set()
        callbacks, self._on_done = self._on_done, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a completion callback of %s (id %r) failed", self.method, self.id)

    def outcome(self) -> Any:
        """The result once :attr:`done` is set.

        Raises:
            RpcError: the server answered with an error.
            ConnectionLostError: the connection ended first.
            ProtocolError: the answer could not be decoded.
        """
        if self.undecodable is not None:
            raise ProtocolError(f"undecodable answer to {self.method} (id {self.id!r}): {self.undecodable}")
        if self.lost is not None:
            raise ConnectionLostError(f"{self.method} (id {self.id!r}) got no answer: {self.lost}")
        if self.error is not None:
            raise error_from_response(self.error, self.method)
        return self.result


class RpcConnection:
    """JSON-RPC over one trio stream, from the client's side. :meth:`run` serves it.

    Args:
        stream: a connected byte stream.
        hooks: answers to the server's requests.
        max_message_bytes: the longest line accepted from the server; a longer one ends the connection.
        max_buffered_updates: unread updates kept per session (see :class:`UpdateStream`).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        hooks: Hooks,
        max_message_bytes: int,
        max_buffered_updates: int,
    ) -> None:
        self.stream = stream
        self.hooks = hooks
        self.max_buffered_updates = max_buffered_updates
        self._core = Connection(max_message_bytes=max_message_bytes)
        self._calls: dict[Id, Call] = {}
        self._streams: dict[str, UpdateStream] = {}
        self._outbox_send, self._outbox = trio.open_memory_channel[bytes](math.inf)
        self._lost: str | None = None
        self._nursery: trio.Nursery | None = None
        self._scope = trio.CancelScope()
        #: why the server evicted us (``_acp_server/evicted`` params), if it did
        self.evicted: dict[str, Any] | None = None

    # --- state ---------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._lost is not None

    @property
    def nursery(self) -> trio.Nursery:
        """Where background work of this connection runs (hook answers, shared resumes)."""
        if self._nursery is None:
            raise ConnectionLostError(self._lost or "the connection is not running")
        return self._nursery

    @property
    def calls_in_flight(self) -> int:
        """Our requests still waiting for an answer (abandoned ones included)."""
        return len(self._calls)

    def updates(self, session_id: str) -> UpdateStream:
        """The update stream of ``session_id`` (created on first use; closed when the connection ends)."""
        stream = self._streams.get(session_id)
        if stream is None:
            stream = self._streams[session_id] = UpdateStream(session_id, self.max_buffered_updates)
            if self._lost is not None:
                stream.close()
        return stream

    def close_updates(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            stream.close()

    # --- sending -------------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        try:
            self._outbox_send.send_nowait(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("connection closed; dropping %d bytes", len(data))

    def start_call(self, method: str, params: Any = None) -> Call:
        """Send a request now; the returned :class:`Call` completes with its answer.

        Raises:
            ConnectionLostError: the connection has already ended.
        """
        if self._lost is not None:
            raise ConnectionLostError(f"cannot send {method}: {self._lost}")
        id, data = self._core.send_request(method, params)
        call = self._calls[id] = Call(id, method)
        self._send(data)
        return call

    async def call(self, method: str, params: Any = None) -> Any:
        """Send a request and return its result; a cancelled caller sends ``$/cancel_request``.

        Raises:
            RpcError, ConnectionLostError, ProtocolError: as :meth:`Call.outcome`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        call = self.start_call(method, params)
        await self.wait(call)
        return call.outcome()

    async def wait(self, call: Call) -> None:
        """Wait for ``call``'s answer; if the caller is cancelled first, ask the server to cancel it."""
        try:
            await call.done.wait()
        except trio.Cancelled:
            self.cancel_request(call)
            raise

    def cancel_request(self, call: Call) -> None:
        """``$/cancel_request`` for ``call`` if it is still unanswered (only that request is affected)."""
        if not call.done.is_set() and self._lost is None:
            self._send(self._core.send_notification("$/cancel_request", CancelRequestParams(request_id=call.id)))

    def notify(self, method: str, params: Any = None) -> None:
        """Send a notification (dropped quietly once the connection has ended)."""
        if self._lost is None:
            self._send(self._core.send_notification(method, params))

    # --- running -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until the server leaves, it breaks, or this task is cancelled."""
        reason = "the connection was closed"
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._writer)
                    task_status.started()
                    try:
                        reason = await self._reader()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        reason = f"read failed: {exc!r}"
                    nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._lose(reason)

    def close(self) -> None:
        """End the connection now: unanswered calls fail, update streams end, :meth:`run` returns."""
        self._lose("the client closed the connection")
        self._scope.cancel()

    def _lose(self, reason: str) -> None:
        """The connection is over: every unanswered call and every update stream ends."""
        if self._lost is not None:
            return
        if self.evicted is not None:
            reason = f"evicted by the server ({self.evicted.get('reason', 'no reason given')})"
        self._lost = reason
        self._outbox_send.close()
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.lost = reason
            call._finish()
        for stream in self._streams.values():
            stream.close()

    async def _writer(self) -> None:
        try:
            async for data in self._outbox:
                chunks = [data]
                while True:
                    try:
                        chunks.append(self._outbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self.stream.send_all(b"".join(chunks) if len(chunks) > 1 else data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("client connection: write failed: %r", exc)
            self._lose(f"write failed: {exc!r}")

    async def _reader(self) -> str:
        core = self._core
        while True:
            data = await self.stream.receive_some(_READ_SIZE)
            if not data:
                return "the server closed the connection"
            core.receive_data(data)
            while True:
                event = core.next_event()
                if event is NEED_DATA:
                    break
                if isinstance(event, TooLarge):
                    return f"the server sent a message over {event.limit} bytes"
                if isinstance(event, Batch):
                    for item in event.items:
                        self._route(item)
                elif isinstance(event, Request | Notification | Response | ErrorReply):
                    self._route(event)

    def _route(self, event: Request | Notification | Response | ErrorReply) -> None:
        if isinstance(event, Response):
            call = self._calls.pop(event.id, None)
            if call is None:
                log.debug("dropping an answer to %r, which is no call of ours", event.id)
                return
            if event.malformed is not None:
                call.undecodable = event.malformed
            else:
                call.result, call.error = event.result, event.error
            call._finish()
        elif isinstance(event, Notification):
            self._notification(event)
        elif isinstance(event, Request):
            self.nursery.start_soon(self._answer, event)
        else:
            self._undecodable(event)

    def _notification(self, note: Notification) -> None:
        if note.method == "session/update":
            try:
                update = _decode_update(note.params or b"{}")
            except msgspec.DecodeError as exc:
                log.warning("ignoring a malformed session/update: %s", exc)
                return
            self.updates(update.session_id).push(update)
            return
        params = _decode_params(note.params)
        if note.method == "_acp_server/evicted":
            log.warning("the server is evicting this connection: %r", params)
            self.evicted = params if isinstance(params, dict) else {}
        if self.hooks.on_notification is not None:
            try:
                self.hooks.on_notification(note.method, params)
            except Exception:
                log.exception("on_notification hook failed on %s", note.method)

    def _undecodable(self, event: ErrorReply) -> None:
        """A message the core could not take. When it names one of our calls, that call fails (it
        will get no other answer); otherwise the server is told, as it would tell us."""
        reply = _decode_params(msgspec.Raw(event.data))
        id = reply.get("id") if isinstance(reply, dict) else None
        call = self._calls.pop(id, None) if isinstance(id, (int, str)) else None
        if call is not None:
            self._core.send_failed(call.id)
            call.undecodable = str(event.error)
            call._finish()
            return
        log.warning("the server sent a message we cannot take: %s", event.error)
        self._send(event.data)

    async def _answer(self, req: Request) -> None:
        hook = self.hooks.for_method(req.method)
        if hook is None:
            self._send(encode_error(req.id, MethodNotFoundError(method=req.method)))
            return
        params = _decode_params(req.params)
        try:
            result = await hook(params if isinstance(params, dict) else {})
        except AcpError as exc:
            self._send(encode_error(req.id, exc))
        except Exception:
            log.exception("the hook for %s failed", req.method)
            self._send(encode_error(req.id, InternalError()))
        else:
            self._send(self._core.send_result(req.id, result))


def _decode_params(params: msgspec.Raw | None) -> Any:
    if params is None:
        return {}
    try:
        return _decode_any(params)
    except msgspec.DecodeError:
        return {}
