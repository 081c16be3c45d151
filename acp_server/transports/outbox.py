"""The output side of a connection's shell: the queue of bytes for the peer, and the one writer task.

Everything for the peer is queued (:meth:`Outbox.send` for notifications fanned out to this connection,
:meth:`Outbox.reply` for answers to its own requests); one writer owns the stream and joins what is
queued into one ``send_all``. Notifications are bounded by ``max_outbound_bytes``: a connection that
lets them overflow is sent ``_acp_server/evicted`` and closed, instead of slowing anyone else. Answers
wait for the writer instead (their caller bounds them). A write that fails closes the connection.

Refusal timing: the read stamps of the overload refusals in the queue travel with the bytes that carry
them, and are recorded in the :class:`~.timing.LatencyHistogram` once their ``send_all`` returned.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns

import trio

from ..jsonrpc import Connection
from ..parking import ParkingSpot
from .timing import LatencyHistogram

__all__ = ["RELIABLE_WATERMARK_BYTES", "Outbox"]

log = logging.getLogger("acp_server.connection")

#: :meth:`Outbox.send_reliably` waits while more than this is queued (a replay is paced by the writer,
#: and never holds more than this of the connection's memory)
RELIABLE_WATERMARK_BYTES = 1 << 20


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
        "_out",
        "_out_bytes",
        "_refusal_latency",
        "_refusals_queued",
        "_writer_coalesce",
        "_writer_spot",
        "evicted",
        "max_outbound_bytes",
        "name",
        "stream",
    )

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
            self._wake_writer(True)
        out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes > self.max_outbound_bytes:
            self._evict()

    def reply(self, data: bytes) -> None:
        """Queue an answer to the peer (never evicts: the caller bounds these)."""
        if not self.evicted:
            self._enqueue(data)

    async def send_reliably(self, data: bytes) -> None:
        """Queue a message that must arrive (a replay): paced by the writer, it waits while more than
        :data:`RELIABLE_WATERMARK_BYTES` (or the outbound bound, if lower) are queued, instead of overflowing."""
        mark = min(RELIABLE_WATERMARK_BYTES, self.max_outbound_bytes)
        while self._out_bytes > mark and not self._closed:
            await self._wait_drained()
        self.reply(data)

    def _enqueue(self, data: bytes) -> None:
        out = self._out
        if not out:
            self._wake_writer(False)
        out.append(data)
        self._out_bytes += len(data)

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

    def _record_refusals(self, read_stamps: list[int]) -> None:
        histogram = self._refusal_latency
        assert histogram is not None
        written = perf_counter_ns()
        for read_ns in read_stamps:
            histogram.record(written - read_ns)
