"""The output side of a connection's shell: the queue of bytes for the peer, and the one writer task.

Everything for the peer is queued (:meth:`Outbox.send` for notifications fanned out to this connection,
:meth:`Outbox.reply` for answers to its own requests) and leaves joined, in one write (see below) or
through the one writer task, which joins what is queued into one ``send_all``. Notifications are
bounded by ``max_outbound_bytes``: a connection that lets them overflow is sent ``_acp_server/evicted``
and closed, instead of slowing anyone else. Answers wait for the writer instead (their caller bounds
them). A write that fails closes the connection.

Writes at the end of the scheduling pass: on a stream that can be written without waiting (a socket, or
the stdio :class:`~.listeners.PipeStream`), what is queued is not handed to the writer task but written
by the run's :class:`_PassFlusher` (a trio instrument) as the pass ends, just before trio waits for I/O:
everything every task of the pass queued for a connection leaves in one ``write``, and the writer task is
woken only when the kernel takes less than all of it (a full socket or pipe) or the write fails (its
``send_all`` then meets the error and closes the connection). A sequential prompt then costs no writer
step and no scheduling pass of its own. A connection that has just handed a request to another task
(:meth:`Outbox.hold`) is flushed one pass later, so that the answer that task queues leaves with what
came before it. A lean WebSocket's peer is written the same way (``write_nowait``, the stream saying
so with ``writes_nowait``). Other streams (TLS, HTTP+SSE) are written by the writer task, woken at the
first message.

The first answer of a pass does not wait for the pass's end: :meth:`Outbox.reply` writes it at once,
with what was queued before it, and the pass's later output joins the write at its end (at most two
writes per pass and connection). A peer whose requests are answered in one pass (8 sessions' prompts
read at once, their turns taken in the next pass) gets to work on the first answer while the others are
made; a client handles what it reads one message after the other (the official SDK's spends a quarter
of a millisecond on an echo prompt's two), and its next request comes sooner.

Refusal timing: the read stamps of the overload refusals in the queue travel with the bytes that carry
them, and are recorded in the :class:`~.timing.LatencyHistogram` once their write returned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from time import perf_counter_ns

import trio
from trio.lowlevel import RunVar

from ..jsonrpc import Connection
from ..parking import ParkingSpot
from .listeners import PipeStream
from .timing import LatencyHistogram

__all__ = ["RELIABLE_WATERMARK_BYTES", "Outbox", "at_pass_end"]

log = logging.getLogger("acp_server.connection")

#: :meth:`Outbox.send_reliably` waits while more than this is queued (a replay is paced by the writer,
#: and never holds more than this of the connection's memory)
RELIABLE_WATERMARK_BYTES = 1 << 20


#: ``Outbox._held_pass`` of an outbox already kept one pass (it is written at the next pass's end)
_DEFERRED = -2


def _noop() -> None:
    pass


class _PassFlusher(trio.abc.Instrument):
    """Writes, as each scheduling pass of the run ends, what the pass queued on the run's direct outboxes.

    ``before_io_wait`` runs once per pass of trio's loop, after every task runnable in it took its step.
    """

    __slots__ = ("dirty", "ending", "passes", "token")

    def __init__(self) -> None:
        #: outboxes that got output while their writer was parked, in the order they got it
        self.dirty: list[Outbox] = []
        #: passes ended so far (:meth:`Outbox.hold` marks the current one)
        self.passes = 0
        self.token = trio.lowlevel.current_trio_token()
        #: callbacks for the end of the current pass (:func:`at_pass_end`)
        self.ending: list[Callable[[], bool]] = []

    def before_io_wait(self, timeout: float) -> None:
        if self.ending:
            self._run_ending(timeout)
        passes = self.passes
        self.passes = passes + 1
        dirty = self.dirty
        if not dirty:
            return
        self.dirty = []
        woke = False
        for outbox in dirty:
            try:
                if outbox._held_pass == passes and timeout == 0:
                    # A task of the next pass has its answer: they leave together. Once only: a peer
                    # whose requests keep coming is not kept waiting pass after pass.
                    outbox._held_pass = _DEFERRED
                    self.dirty.append(outbox)
                    continue
                outbox._held_pass = -1
                woke = outbox._flush_now() or woke
            except BaseException:  # never out of an instrument (trio would drop it, and every later flush)
                log.exception("%s: writing at the end of a pass failed; the writer takes it", outbox.name)
                outbox._writer_spot.wake()
                woke = True
        if woke and timeout > 0:
            # A writer was woken while trio is about to sleep: wake the loop at once for it.
            try:
                self.token.run_sync_soon(_noop)
            except BaseException:  # the run is ending: nothing waits for the loop any more
                log.debug("could not wake the run loop for a woken writer", exc_info=True)

    def _run_ending(self, timeout: float) -> None:
        ending, self.ending = self.ending, []
        woke = False
        for callback in ending:
            try:
                woke = callback() or woke
            except BaseException:  # never out of an instrument
                log.exception("a callback at the end of a pass failed")
        if woke and timeout > 0:
            try:
                self.token.run_sync_soon(_noop)
            except BaseException:  # the run is ending: nothing waits for the loop any more
                log.debug("could not wake the run loop for a woken task", exc_info=True)


_FLUSHER: RunVar[_PassFlusher] = RunVar("acp_server.outbox.flusher")


def _run_flusher() -> _PassFlusher:
    """The current trio run's flusher (installed at the first call)."""
    try:
        return _FLUSHER.get()
    except LookupError:
        flusher = _PassFlusher()
        _hook_checks_in_c()
        trio.lowlevel.add_instrument(flusher)
        _FLUSHER.set(flusher)
        return flusher


_dict_instruments: type | None = None


def _hook_checks_in_c() -> None:
    """Make the current run's checks for instruments (``"before_io_wait" in runner.instruments``) dict
    lookups in C.

    trio keeps a run's instruments in ``trio._core._instrumentation.Instruments``, a ``UserDict`` from hook
    name to instruments, and asks it with ``in`` before every hook it could call: five times per pass with
    one task step, each a Python call of ``UserDict.__contains__`` (~0.3 us here). Once the flusher is
    installed every pass has an instrument. The same table is then held in a ``dict`` subclass that keeps
    ``Instruments``' own methods (they only use ``self.data``, set to the dict itself). Without those
    internals (another trio), nothing changes.
    """
    global _dict_instruments
    try:
        from trio._core import _instrumentation
        from trio._core import _run as trio_run

        runner = trio_run.GLOBAL_RUN_CONTEXT.runner
        current = runner.instruments
        base = _instrumentation.Instruments
    except (ImportError, AttributeError):
        return
    if type(current) is not base or type(getattr(current, "data", None)) is not dict:
        return
    if _dict_instruments is None:
        _dict_instruments = type(
            "DictInstruments",
            (dict,),
            {
                "__doc__": "trio's Instruments as a dict (see outbox._hook_checks_in_c).",
                "add_instrument": base.add_instrument,
                "remove_instrument": base.remove_instrument,
                "call": base.call,
            },
        )
    instruments = _dict_instruments(current.data)
    instruments.data = instruments  # an attribute, not a property: read at every hook call
    runner.instruments = instruments


def at_pass_end(callback: Callable[[], bool]) -> None:
    """Have ``callback`` called once, from the run's flusher, as the current scheduling pass ends (before
    the outboxes are written). It must not raise or wait; it returns whether it woke a task (a loop about
    to sleep is then woken for it). Another transport's writes use it to leave without a task step."""
    _run_flusher().ending.append(callback)


def _writes_nowait(stream: object) -> bool:
    """Whether ``stream`` can be written without waiting (``write_nowait``, or a plain trio socket); a
    stream that has ``write_nowait`` for some of its kinds says which with ``writes_nowait``."""
    says = getattr(stream, "writes_nowait", None)
    if says is not None:
        return bool(says)
    return hasattr(stream, "write_nowait") or type(stream) is trio.SocketStream


class Outbox:
    """The output queue and writer of one connection; :class:`~.shell.ConnectionShell` is one.

    Its attributes are slots (one per connection). A subclass provides :meth:`close`.

    Args:
        stream: the byte stream written to.
        name: for logs.
        max_outbound_bytes: how much queued notification data evicts the connection.
        refusal_latency: where the shell's timed refusals are recorded once written (``None``: nowhere).
    """

    __slots__ = (
        "_closed",
        "_drained",
        "_drained_event",
        "_early_pass",
        "_flusher",
        "_held_pass",
        "_out",
        "_out_bytes",
        "_pipe",
        "_refusal_latency",
        "_refusals_queued",
        "_writer_coalesce",
        "_write_nowait",
        "_writer_spot",
        "evicted",
        "max_outbound_bytes",
        "name",
        "stream",
    )

    #: what one :meth:`send` queues may be several lines: they leave joined anyway (the bridge's
    #: fan-out then sends the lines of one step in one call, see :class:`~acp_server.bridge.session.Peer`)
    joins_lines = True

    def __init__(
        self,
        stream: trio.abc.HalfCloseableStream | trio.abc.Stream,
        name: str,
        max_outbound_bytes: int,
        refusal_latency: LatencyHistogram | None,
    ) -> None:
        self.stream = stream
        self.name = name
        self.max_outbound_bytes = max_outbound_bytes
        self.evicted = False
        self._closed = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._refusal_latency = refusal_latency
        self._refusals_queued: list[int] = []  # read stamps of the refusals now in _out
        self._writer_spot = ParkingSpot()  # where the writer waits for output
        self._writer_coalesce = False
        #: nothing is queued for the writer; ``_drained_event`` is made only when somebody waits for it
        self._drained = True
        self._drained_event: trio.Event | None = None
        #: the run's end-of-pass flusher while the writer runs on a stream written without waiting
        self._flusher: _PassFlusher | None = None
        self._held_pass = -1  # the pass :meth:`hold` was called in
        self._early_pass = -1  # the last pass whose first answer :meth:`reply` wrote at once
        #: the stream's ``write_nowait`` while the flusher writes it (``None``: a socket, the stdio pipe,
        #: or no flusher)
        self._write_nowait: Callable[[bytes], int] | None = None
        #: the stdio :class:`~.listeners.PipeStream` while the flusher writes it: its descriptor is
        #: written with ``os.write`` here (what its ``write_nowait`` does, without the call)
        self._pipe: PipeStream | None = None

    def close(self) -> None:
        """Stop serving the connection (what is queued is flushed for a short while)."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, data: bytes) -> None:
        """Queue a notification; evict the connection if it lets its queue overflow."""
        if self._closed:
            return
        out = self._out
        if not out:
            flusher = self._flusher  # _first_out's, inline (a turn's first update comes here)
            if flusher is not None:
                flusher.dirty.append(self)
                self._drained = False
            else:
                self._wake_writer(True)
        out.append(data)
        queued = self._out_bytes = self._out_bytes + len(data)
        if queued > self.max_outbound_bytes:
            self._evict()

    def reply(self, data: bytes) -> None:
        """Queue an answer to the peer (never evicts: the caller bounds these).

        On a stream written at the end of the pass, the pass's first answer does not wait for it: it is
        written at once, with what was queued before it (see the module's docstring).
        """
        if self.evicted:
            return
        out = self._out
        flusher = self._flusher
        if flusher is None or self._early_pass == flusher.passes:
            if not out:  # _enqueue's, inline
                self._first_out(False)
            out.append(data)
            self._out_bytes += len(data)
            return
        self._early_pass = flusher.passes
        if self._writer_spot.task is None:  # the writer is busy: it takes this after what it writes
            if not out:
                self._first_out(False)
            out.append(data)
            self._out_bytes += len(data)
            return
        # The pass's first answer, the writer idle: written now (what _flush_now does, inline: this is
        # every sequential prompt's answer). ``out`` non-empty: this outbox has its mark for the pass's end.
        if out:
            out.append(data)
            data = b"".join(out)
        try:
            pipe = self._pipe
            if pipe is not None:
                fd = pipe.send_fd
                sent = os.write(fd, data) if fd is not None else -1
            elif (write := self._write_nowait) is not None:
                sent = write(data)
            else:
                sent = os.write(self.stream.socket.fileno(), data)  # type: ignore[union-attr]  # a trio.SocketStream
        except BlockingIOError:
            sent = 0
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            sent = -1
        if sent == len(data):
            if out:
                self._out = []
                self._out_bytes = 0
                if self._held_pass == -1:
                    # All written, nothing held: this outbox's mark for the pass's end (the last one,
                    # made when its queue began) would find nothing to write.
                    dirty = flusher.dirty
                    if dirty and dirty[-1] is self:
                        dirty.pop()
            if self._refusals_queued:
                refused, self._refusals_queued = self._refusals_queued, []
                self._record_refusals(refused)
            if self._drained_event is None:
                self._drained = True  # what _set_drained does when nobody waits
            else:
                self._set_drained()
            return
        # The kernel took less than all of it (or the write failed): the writer takes the rest (its
        # send_all meets the error, if any, and closes the connection).
        rest = data[sent:] if sent > 0 else data
        self._out = [rest]
        self._out_bytes = len(rest)
        self._drained = False
        self._writer_coalesce = False
        self._writer_spot.wake()

    async def send_reliably(self, data: bytes) -> None:
        """Queue a message that must arrive (a replay): paced by the writer, it waits while more than
        :data:`RELIABLE_WATERMARK_BYTES` (or the outbound bound, if lower) are queued, instead of overflowing."""
        mark = min(RELIABLE_WATERMARK_BYTES, self.max_outbound_bytes)
        while self._out_bytes > mark and not self._closed:
            await self._wait_drained()
        self.reply(data)

    def hold(self) -> None:
        """A request was handed to a task that runs in the next scheduling pass: what is queued now waits
        for the end of that pass, to leave with the answer (in one write) if it comes by then."""
        flusher = self._flusher
        if flusher is not None and self._held_pass != _DEFERRED:
            self._held_pass = flusher.passes

    def _enqueue(self, data: bytes) -> None:
        out = self._out
        if not out:
            self._first_out(False)
        out.append(data)
        self._out_bytes += len(data)

    def _first_out(self, update: bool) -> None:
        """The queue is about to become non-empty: mark it for the end of the pass (on a stream written
        without waiting), else wake the writer (``update``: as :meth:`_wake_writer` takes it)."""
        flusher = self._flusher
        if flusher is not None:
            flusher.dirty.append(self)
            self._drained = False
        else:
            self._wake_writer(update)

    def _flush_now(self) -> bool:
        """At the end of a pass: write what is queued if the writer is idle; whether the writer was woken
        (the kernel took less than all of it, or the write failed: its ``send_all`` then decides)."""
        out = self._out
        if not out or self._writer_spot.task is None:
            return False  # nothing left, or the writer is busy (it takes this next) or gone
        data = b"".join(out) if len(out) > 1 else out[0]
        try:
            pipe = self._pipe
            if pipe is not None:
                fd = pipe.send_fd
                sent = os.write(fd, data) if fd is not None else -1
            elif (write := self._write_nowait) is not None:
                sent = write(data)
            else:
                sent = os.write(self.stream.socket.fileno(), data)  # type: ignore[union-attr]  # a trio.SocketStream
        except BlockingIOError:
            sent = 0
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            sent = -1
        if sent == len(data):
            self._out = []
            self._out_bytes = 0
            if self._refusals_queued:
                refused, self._refusals_queued = self._refusals_queued, []
                self._record_refusals(refused)
            if self._drained_event is None:
                self._drained = True  # what _set_drained does when nobody waits
            else:
                self._set_drained()
            return False
        if sent > 0:
            rest = data[sent:]
            self._out = [rest]
            self._out_bytes = len(rest)
        self._writer_coalesce = False
        self._writer_spot.wake()
        return True

    def _wake_writer(self, update: bool) -> None:
        """The queue is about to become non-empty: wake the writer if it waits (once per batch).

        ``update``: what comes first is a notification (a turn under way, whose answer may follow at
        once), so the writer lets the other runnable tasks go first, to send both in one write. An
        answer first (a refusal, a quick method) goes out without that extra pass.
        """
        if self._writer_spot.wake():
            self._writer_coalesce = update
        self._drained = False

    def _set_drained(self) -> None:
        self._drained = True
        event = self._drained_event
        if event is not None:
            self._drained_event = None
            event.set()

    async def _wait_drained(self) -> None:
        """Return once nothing is queued for the writer (a checkpoint either way)."""
        if self._drained:
            await trio.lowlevel.checkpoint()
            return
        event = self._drained_event
        if event is None:
            event = self._drained_event = trio.Event()
        await event.wait()

    async def _wait_for_room(self) -> None:
        while self._out_bytes > self.max_outbound_bytes and not self._closed:
            await self._wait_drained()

    def _evict(self) -> None:
        log.warning(
            "%s: evicting a slow consumer (%d bytes queued, limit %d)", self.name, self._out_bytes, self.max_outbound_bytes
        )
        self.evicted = True
        self._out.append(
            Connection.send_notification(
                "_acp_server/evicted",
                {"reason": "queue_overflow", "limit": self.max_outbound_bytes, "queuedBytes": self._out_bytes},
            )
        )
        self.close()

    async def _writer(self) -> None:
        stream = self.stream
        if _writes_nowait(stream):
            if type(stream) is PipeStream:
                self._pipe = stream
            else:
                self._write_nowait = getattr(stream, "write_nowait", None)  # None: a plain trio socket
            self._flusher = _run_flusher()
        try:
            while True:
                if not self._out:
                    self._set_drained()
                    await self._writer_spot.park()
                    if self._writer_coalesce:
                        # Let the tasks woken with us queue their part first: a turn's last updates
                        # and its answer then leave in one write (one system call, one peer wakeup).
                        await trio.lowlevel.checkpoint()
                data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
                self._out = []
                self._out_bytes = 0
                refused: list[int] | None = None
                if self._refusals_queued:  # taken with the bytes that carry them, not aliased
                    refused, self._refusals_queued = self._refusals_queued, []
                await stream.send_all(data)
                data = b""  # not kept while the writer waits: an idle connection would hold its last write
                if refused is not None:
                    self._record_refusals(refused)
        except Exception as exc:
            if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, OSError)):
                log.info("%s: write failed: %s", self.name, exc)
            else:
                log.exception("%s: unexpected error while writing; closing the connection", self.name)
            self._out = []
            self._out_bytes = 0
            self._refusals_queued = []
            self._set_drained()
            self.close()
        finally:
            self._flusher = None
            self._write_nowait = None
            self._pipe = None

    def _record_refusals(self, read_stamps: list[int]) -> None:
        histogram = self._refusal_latency
        assert histogram is not None
        written = perf_counter_ns()
        for read_ns in read_stamps:
            histogram.record(written - read_ns)
