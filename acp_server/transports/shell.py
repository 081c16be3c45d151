"""The thin trio shell around one connection: a reader feeding the sans-I/O core, and one writer.

Modelled on hypercorn's trio TCP server: the reader turns bytes into events and runs each request's
synchronous part at once, in arrival order; requests that must wait run as tasks. Everything queued
for the peer leaves joined: in one write as the scheduling pass ends, or through the one writer task. The shell knows no ACP method: it
gets a :class:`~acp_server.jsonrpc.Dispatcher` and a context for its handlers. The output side (the
queue, the writer, eviction of a slow consumer) is :class:`~.outbox.Outbox`, the base of its
base :class:`~.refusals.RefusalGuard`.

Bounds: at most ``max_inflight_requests`` requests run at once, later ones wait unstarted; reading
pauses (backpressure through the transport, no error) only when four times that many wait. A request
runs until answered, or until its work is over when the answer has to wait (a prompt's outcome waiting
for the store's commit: :meth:`Deferred.on_settled`).
Notifications fanned out to this connection are queued up to ``max_outbound_bytes``; a connection
that lets that overflow is sent ``_acp_server/evicted`` and closed, instead of slowing anyone else.
Answers to the connection's own requests wait for the writer instead of overflowing.

Half-close: at the end of the peer's input, the requests already read run to their outcome (each
within its own deadline, all within ``drain_timeout_s``, after which they are cancelled and answered
``cancelled``), their answers are written, then the connection closes. Our own requests to the peer
fail at once then (nobody can answer them). A write that fails (the peer closed its read side too)
ends the wait at once.

Socket hygiene (not for stdio): the first-message and idle timeouts, in the base :class:`~.hygiene.IdleTimeouts`.
How the reader waits for input (the stdio pipe edge-triggered): :mod:`.waits`.

Overload refusals (timed, counted, charged to the peer's refusal budget) are answered through
the base class :class:`~.refusals.RefusalGuard`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from time import perf_counter_ns
from typing import Any

import msgspec
import trio

from ..errors import InvalidRequestError, RequestCancelledError
from ..jsonrpc import (
    Batch,
    Connection,
    Deferred,
    Dispatcher,
    EncodedError,
    ErrorReply,
    HandlerContext,
    Notification,
    Request,
    Response,
    TooLarge,
    encode_error,
    encode_result,
)
from ..logtext import clip
from ..types.acp import CancelRequestParams
from .deadlines import Deadline
from .hygiene import IdleTimeouts
from .inflight import BatchReplies, Slot
from .listeners import PipeStream
from .outbox import RELIABLE_WATERMARK_BYTES, _run_flusher
from .refusal_budget import RefusalBudget, RefusalBudgetSettings, session_of
from .timing import LatencyHistogram
from .waits import READ_SIZE, edge_waiter, readable_waiter
from .waits import read_now as _read_now  # (a global here: tests count the reads)

__all__ = ["RELIABLE_WATERMARK_BYTES", "ConnectionShell"]

log = logging.getLogger("acp_server.connection")

_ids = itertools.count(1)
_decode_cancel = msgspec.json.Decoder(CancelRequestParams).decode
_FLUSH_TIMEOUT_S = 2.0
#: task names given to trio (one it derived from the function would be a new string per task)
_WRITER_TASK = "acp_server connection writer"
_HANDLER_TASK = "acp_server connection request"


class ConnectionShell(IdleTimeouts):
    """Serve one JSON-RPC connection on a trio stream.

    Its attributes are slots (a server holds one per connection: an instance dict of this many keys
    took ~1.5 KiB); ``__dict__`` stays for attributes a subclass or a caller adds.

    Args:
        stream: the byte stream (socket, stdio pair, or in-memory for tests).
        dispatcher: routes requests and notifications to handlers.
        make_context: builds the handler context for this connection (given the shell).
        max_message_bytes, max_outbound_bytes, max_inflight_requests: the bounds described above.
        on_close: called once, synchronously, when the connection is gone.
        name: for logs.
        refusal_latency: where to record each overload refusal's time from read to written (see the
            module docstring); ``None`` records nothing.
        drain_timeout_s: after the end of input, how long the requests already read may still run (0: the
            end of input is a disconnect: what runs is treated as its client leaving).
        first_message_timeout_s: close the connection if no complete line arrived by then (``None``: never).
        idle_timeout_s: close a connection that holds nothing after this long without input (``None``: never).
        holds: given the shell, whether the rest of the server keeps something for this connection (an attached
            session): such a connection is not idle.
        refusal_kinds: where to count each overload refusal written, by ``errorKind``.
        transport: what the connection came over (``tcp``, ``ws``, ...), for statistics.
        refusal_budget: the per-peer budget of hold-off refusals (see :mod:`.refusal_budget`); a peer
            that spends it is sent ``_acp_server/evicted`` (``ignored_retry_after``) and closed.
            ``None`` (or a zero rate): no budget.
    """

    __slots__ = (
        "__dict__",
        "_finished_unanswered",
        "_got_line",
        "_handlers",
        "_holds",
        "_inflight",
        "_input_ended",
        "_on_close",
        "_outbound",
        "_reading",
        "_room",
        "_slots",
        "_slots_gone",
        "_waiting",
        "core",
        "ctx",
        "dispatcher",
        "drain_timeout_s",
        "max_inflight",
        "peer_id",
        "transport",
    )

    def __init__(
        self,
        stream: trio.abc.HalfCloseableStream | trio.abc.Stream,
        dispatcher: Dispatcher,
        make_context: Callable[[ConnectionShell], HandlerContext],
        *,
        max_message_bytes: int,
        max_outbound_bytes: int,
        max_inflight_requests: int,
        on_close: Callable[[ConnectionShell], None] | None = None,
        name: str = "connection",
        refusal_latency: LatencyHistogram | None = None,
        drain_timeout_s: float = 30.0,
        first_message_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        holds: Callable[[ConnectionShell], bool] | None = None,
        refusal_kinds: dict[str, int] | None = None,
        transport: str = "stream",
        refusal_budget: RefusalBudgetSettings | None = None,
    ) -> None:
        super().__init__(stream, name, max_outbound_bytes, refusal_latency)
        self.peer_id = next(_ids)
        self.transport = transport
        self._refusal_kinds = refusal_kinds
        self._budget_settings = refusal_budget if refusal_budget is not None and refusal_budget.enabled else None
        #: this peer's refusal budget, from its first hold-off refusal on (``None`` before, or when off)
        self.refusal_budget: RefusalBudget | None = None
        self._resume_at = 0.0  # trio time: the budget is in debt, requests on held scopes park until then
        self._parked = None
        self._parked_count = 0
        self._rooms = None
        self.core = Connection(max_message_bytes=max_message_bytes)
        self.dispatcher = dispatcher
        self.max_inflight = max_inflight_requests
        self._on_close = on_close
        self._slots: dict[Any, Slot] = {}
        self._waiting: list[Request] = []  # a list: an empty deque alone takes ~760 bytes
        self._inflight = 0  # started and not answered
        #: of those, the ones whose work is over and whose answer waits (they no longer count as running)
        self._finished_unanswered = 0
        self._room: trio.Event | None = None  # what the reader waits on while too many requests wait
        self._outbound: dict[Any, trio.MemorySendChannel[Response]] = {}
        self._handlers: trio.Nursery | None = None  # the writer's and the requests' tasks
        self._reading: trio.CancelScope | None = None  # the reader's, while it reads
        self.drain_timeout_s = drain_timeout_s
        self._first_message_timeout_s = first_message_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._holds = holds
        self._input_ended = False  # the peer's input ended (EOF): nothing more will be read
        self._got_line = False  # a complete line has arrived
        self._last_input = 0.0  # trio.current_time() of the last bytes read
        self._opened = 0.0  # trio.current_time() when run() began
        #: this socket's pending wake-up in the run's shared timer (first message or idle), if any
        self._deadline: Deadline | None = None
        self._slots_gone: trio.Event | None = None  # set when the last request in flight leaves _slots
        self.ctx = make_context(self)

    # --- the Peer interface of the bridge ----------------------------------------------------------

    def close(self) -> None:
        """Stop reading; what is queued is flushed (for a short while) and the connection closes."""
        self._mark_closed()
        if self._reading is not None:
            # The reader stops; run() then cancels the requests that run, and flushes what is queued.
            self._reading.cancel()

    def _mark_closed(self) -> None:
        if not self._closed:
            self._closed = True
            for channel in self._outbound.values():
                channel.close()  # our requests in flight end with EndOfChannel
            self._outbound.clear()
            if self._on_close is not None:
                self._on_close(self)

    # --- our own requests to the peer --------------------------------------------------------------

    async def request(self, method: str, params: Any = None) -> Response:
        """Send a request to the peer and wait for its response.

        Raises:
            trio.EndOfChannel: the connection closed before the peer answered.
        """
        if self._closed or self._input_ended:
            raise trio.EndOfChannel
        send, receive = trio.open_memory_channel[Response](1)
        id, data = self.core.send_request(method, params)
        self._outbound[id] = send
        try:
            await self._wait_for_room()
            self.reply(data)
            return await receive.receive()
        finally:
            self._outbound.pop(id, None)
            self.core.send_failed(id)

    # --- running -----------------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return self._inflight

    async def run(self) -> None:
        """Serve until the peer leaves, the connection is closed or evicted, or we are cancelled.

        One nursery holds the writer and the requests' tasks; this task is the reader, under a cancel
        scope of its own that :meth:`close` cancels. When the reading ends, the requests still running
        are cancelled (their tasks each have a scope), what is queued is flushed for a short while, and
        the nursery is cancelled. An idle connection thus costs one nursery, one more scope and two
        tasks, and its reader waits with nothing stacked above the socket but this call.
        """
        stream = self.stream
        # A plain trio socket is read with os.read on its descriptor, waiting in wait_readable when it
        # is empty, with the checkpoints SocketStream.receive_some makes (one scheduling point per read):
        # an idle connection then waits without the suspended calls of receive_some, the socket's recv
        # and its helper, and their context manager (about 1.4 KB per connection). The stdio PipeStream
        # too (its descriptor asked for at each use: the stream may close). After a short read, which
        # emptied the kernel's buffer, the reader waits before it reads again: a peer that waits for
        # each answer costs one read per message, none failing with EAGAIN. Other streams: receive_some.
        fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
        pipe = stream if type(stream) is PipeStream else None
        emptied = False  # the last read was short
        limit_waiting = 4 * self.max_inflight
        wait_readable = readable_waiter()
        # The stdio pipe is waited on edge-triggered, without re-arming it at each wait (see .waits);
        # ``drained`` is the scheduling pass in which a read last saw it empty: the reader waits on it
        # only if no pass (no epoll_wait, which may take the edge) ended since, else it reads first.
        wait_edge = edge_waiter(pipe) if pipe is not None else None
        flusher = _run_flusher() if wait_edge is not None else None
        drained = -1
        received = self._received
        try:
            async with trio.open_nursery() as tasks:
                self._handlers = tasks
                tasks.start_soon(self._writer, name=_WRITER_TASK)
                if self._first_message_timeout_s is not None or self._idle_timeout_s is not None:
                    self._arm_timeouts()
                try:
                    with trio.CancelScope() as reading:
                        self._reading = reading
                        if self._closed:
                            reading.cancel()
                        while True:
                            data: bytes | bytearray = b""  # not kept while waiting: an idle connection would hold its last read
                            while len(self._waiting) + self._parked_count >= limit_waiting:
                                room = self._room = trio.Event()
                                await room.wait()
                            if self._out_bytes > self.max_outbound_bytes:
                                await self._wait_for_room()
                            if pipe is not None or fd >= 0:
                                # The pipe's descriptor is asked for at each read (the stream may be
                                # closed); a wait it ends raises ClosedResourceError (notify_closing).
                                rfd = fd if pipe is None else pipe.receive_fd  # pipe.open_fd(), inline
                                if rfd is None:
                                    raise trio.ClosedResourceError("the stream is closed")
                                read = None
                                if emptied and flusher is not None and flusher.passes != drained:
                                    emptied = False  # an epoll_wait since the pipe was seen empty: read first
                                if not emptied:
                                    await trio.lowlevel.checkpoint_if_cancelled()
                                    if (read := _read_now(rfd)) is not None:
                                        if flusher is not None:  # (if short) the pipe was empty in this pass
                                            drained = flusher.passes
                                        await trio.lowlevel.cancel_shielded_checkpoint()
                                # Waited for outside any ``except`` block: a handled exception stays
                                # alive (with its traceback) as long as the block runs, awaits included.
                                while read is None:
                                    if wait_edge is not None:
                                        await wait_edge(rfd)  # seen empty in this step, no epoll_wait since
                                        read = _read_now(rfd)
                                        assert flusher is not None
                                        drained = flusher.passes
                                    else:
                                        await wait_readable(rfd, "read_task")
                                        read = _read_now(rfd)
                                emptied = len(read) < READ_SIZE
                                data, read = read, None
                            else:
                                data = await stream.receive_some(READ_SIZE)
                            if not data:
                                log.debug("%s: end of input", self.name)
                                await self._drain()
                                break
                            if not received(data):
                                break
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    log.info("%s: read failed: %s", self.name, exc)
                except Exception:
                    # A defect met while serving this peer ends this peer, never the server.
                    log.exception("%s: unexpected error while reading; closing the connection", self.name)
                finally:
                    self._reading = None
                    self._mark_closed()
                    for slot in list(self._slots.values()):
                        if slot.deferred is not None:
                            slot.deferred.cancel(connection_lost=True)
                        elif slot.scope is not None:
                            slot.scope.cancel()
                with trio.move_on_after(_FLUSH_TIMEOUT_S):
                    await self._wait_drained()
                tasks.cancel_scope.cancel()
        finally:
            self._mark_closed()
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.stream.aclose()

    async def _drain(self) -> None:
        """The peer's input ended: let the requests read so far finish and their answers go out."""
        self._input_ended = True
        for channel in self._outbound.values():
            channel.close()  # our requests to the peer: nobody can answer them now
        self._outbound.clear()
        if self._slots and self.drain_timeout_s > 0:
            log.debug("%s: end of input with %d requests in flight: draining", self.name, len(self._slots))
            with trio.move_on_after(self.drain_timeout_s) as timer:
                await self._wait_slots_gone()
            if timer.cancelled_caught:
                log.warning(
                    "%s: %d requests still running %.0f s after the end of input: cancelling them",
                    self.name,
                    len(self._slots),
                    self.drain_timeout_s,
                )
                for slot in list(self._slots.values()):
                    if slot.deferred is not None:
                        slot.deferred.stop()  # a prompt: answered stopReason "cancelled"
                    else:
                        self._cancel_slot(slot)
                with trio.move_on_after(_FLUSH_TIMEOUT_S):
                    await self._wait_slots_gone()
        # What is queued by now is flushed by run() before the connection closes.

    async def _wait_slots_gone(self) -> None:
        while self._slots:
            gone = self._slots_gone = trio.Event()
            await gone.wait()

    def _slot_done(self) -> None:
        if not self._slots:
            # An emptied dict keeps its table (~160 bytes an idle connection would hold); clear() frees it.
            self._slots.clear()
            if self._slots_gone is not None:
                self._slots_gone.set()

    def _received(self, data: bytes | bytearray) -> bool:
        """Dispatch what ``data`` completes; ``False``: the connection must close (a line too large)."""
        events = self.core.receive(data)
        if self._idle_timeout_s is not None:  # only the idle timeout reads it
            self._last_input = trio.current_time()
        if not events:
            return True
        self._got_line = True
        reply = self.reply
        read_ns = perf_counter_ns()  # the read stamp of its requests (see Slot.read_ns)
        for event in events:
            if type(event) is Request:
                self._take(event, reply, read_ns)
            elif type(event) is TooLarge:
                log.warning("%s: message over %d bytes; closing", self.name, event.limit)
                reply(event.data)
                return False
            else:
                self._handle(event, reply, read_ns)
        return True

    def _take(self, req: Request, reply: Callable[[bytes], None], read_ns: int) -> None:
        """A request read: started now, or queued behind those that wait (not a batch's item: its
        answer is joined with the others' at once).

        A request started now gets its :class:`Slot` only once its synchronous part is over and it still
        runs: one answered by that part (an echo prompt's turn ended, a refusal) never had anything in
        flight that a ``$/cancel_request`` or the drain could find, since nothing else ran meanwhile.
        """
        slots = self._slots
        if req.id in slots:
            reply(encode_error(req.id, InvalidRequestError(detail=f"id {req.id!r} is already in use by a request in flight")))
            return
        if self._waiting or self._inflight - self._finished_unanswered >= self.max_inflight:
            if reply == self.reply:
                slots[req.id] = Slot(read_ns)
                self._waiting.append(req)
                return
        elif self._resume_at and reply == self.reply and self._park(req):
            slots[req.id] = Slot(read_ns)
            return
        out = self.dispatcher.call(self.ctx, req)  # never cancelled yet: ctx.cancelled stays False
        if type(out) is bytes:
            reply(out)
            return
        slot = Slot(read_ns)
        if isinstance(out, bytes):  # an error answer (EncodedError): a refusal is timed from the read
            self._reply_error(out, slot, reply)
            return
        slots[req.id] = slot
        self._run(req, slot, out, reply)

    def _handle(self, event: Any, reply: Callable[[bytes], None], read_ns: int) -> None:
        if isinstance(event, Request):
            self._take(event, reply, read_ns)
        elif isinstance(event, Notification):
            if event.method == "$/cancel_request":
                self._cancel_request(event)
            else:
                gone = None
                if (self._parked or self._waiting) and event.method == "session/cancel":
                    gone = self._take_unstarted_prompts(session_of(event.params))
                self.dispatcher.notify(self.ctx, event)
                if gone:
                    self._answer_cancelled(gone)
        elif isinstance(event, Response):
            channel = self._outbound.pop(event.id, None)
            if channel is not None:
                channel.send_nowait(event)
        elif isinstance(event, ErrorReply):
            reply(event.data)
        elif isinstance(event, Batch):
            replies = BatchReplies(self.reply)
            replies.missing = sum(1 for item in event.items if isinstance(item, (Request, ErrorReply)))
            for item in event.items:
                self._handle(item, replies.add, read_ns)
            replies.flush()

    def _cancel_request(self, note: Notification) -> None:
        try:
            params = _decode_cancel(note.params or b"{}")
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
            log.warning("%s: ignoring malformed $/cancel_request: %s", self.name, clip(str(exc)))
            return
        slot = self._slots.get(params.request_id)
        if slot is None:
            log.debug("%s: $/cancel_request for %s, which is not in flight", self.name, clip(params.request_id))
            return
        self._cancel_slot(slot)

    @staticmethod
    def _cancel_slot(slot: Slot) -> None:
        """Cancel one request in flight: it is answered ``cancelled`` (or its outcome if it had one)."""
        slot.cancelled = True
        if slot.scope is not None:
            slot.scope.cancel()
        elif slot.deferred is not None:
            slot.deferred.cancel(connection_lost=False)

    def _start(self, req: Request, slot: Slot, reply: Callable[[bytes], None]) -> None:
        if slot.cancelled:
            method = self.dispatcher.requests.get(req.method)
            if method is None or not method.sees_cancel:
                del self._slots[req.id]
                reply(encode_error(req.id, RequestCancelledError()))
                self._slot_done()
                return
        ctx = self.ctx
        if slot.cancelled:
            ctx.cancelled = True  # type: ignore[attr-defined]
            try:
                out = self.dispatcher.call(ctx, req)
            finally:
                ctx.cancelled = False  # type: ignore[attr-defined]
        else:
            out = self.dispatcher.call(ctx, req)  # ctx.cancelled is False outside the branch above
        if isinstance(out, bytes):
            del self._slots[req.id]
            if type(out) is bytes:
                reply(out)
            else:
                self._reply_error(out, slot, reply)
            self._slot_done()
            return
        self._run(req, slot, out, reply)

    def _run(
        self, req: Request, slot: Slot, out: Coroutine[Any, Any, Any] | Deferred, reply: Callable[[bytes], None]
    ) -> None:
        """``req``'s synchronous part left work that runs on (``slot`` is in ``_slots``): count it in
        flight and have its answer come from the deferred's callback or a task."""
        self._inflight += 1
        slot.running = True
        self.hold()  # its answer comes from a task of the next pass: what is queued waits to leave with it
        if isinstance(out, Deferred):
            slot.deferred = out
            out.on_settled(partial(self._release, slot))
            out.subscribe(partial(self._deferred_done, req, reply))
            return
        assert self._handlers is not None
        self._handlers.start_soon(self._finish, req, out, slot, reply, name=_HANDLER_TASK)

    def _release(self, slot: Slot) -> None:
        """``slot``'s work is over but its answer waits: the next waiting request may start."""
        if slot.running:
            slot.running = False
            self._finished_unanswered += 1
            self._start_waiting()

    def _deferred_done(self, req: Request, reply: Callable[[bytes], None], result: Any, error: Any) -> None:
        self._inflight -= 1
        slot = self._slots.pop(req.id, None)
        if slot is not None:
            slot.deferred = None  # it is answered: the slot and the deferred no longer hold each other
            if not slot.running:
                self._finished_unanswered -= 1
        if not self._closed:
            if error is None:
                reply(encode_result(req.id, result))  # Dispatcher.shape's result, inline
            elif slot is None:
                reply(EncodedError.of(req.id, error))
            else:
                self._reply_error(EncodedError.of(req.id, error), slot, reply)
        if not self._slots:
            self._slot_done()
        if self._parked:
            self._room_in(req)
        if self._waiting or self._room is not None:
            self._start_waiting()

    def _start_waiting(self) -> None:
        while self._waiting and not self._closed and self._inflight - self._finished_unanswered < self.max_inflight:
            req = self._waiting.pop(0)
            if self._resume_at and self._park(req):
                continue
            self._start(req, self._slots[req.id], self.reply)
        room = self._room
        if room is not None:
            self._room = None
            room.set()

    async def _finish(
        self, req: Request, pending: Coroutine[Any, Any, Any], slot: Slot, reply: Callable[[bytes], None]
    ) -> None:
        data: bytes | None = None
        try:
            with trio.CancelScope() as scope:
                slot.scope = scope
                if slot.cancelled or self._closed:
                    scope.cancel()
                data = await self.dispatcher.finish(req.id, req.method, pending)
            if data is None and not self._closed:
                data = encode_error(req.id, RequestCancelledError())
        finally:
            self._inflight -= 1
            self._start_waiting()
        try:
            if data is not None and not self._closed:
                await self._wait_for_room()
                if type(data) is bytes:
                    reply(data)
                else:
                    self._reply_error(data, slot, reply)
        finally:
            # Its id stays in use until its answer is queued (a drain waits for exactly that).
            self._slots.pop(req.id, None)
            self._slot_done()
