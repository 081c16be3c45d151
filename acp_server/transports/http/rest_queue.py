"""One SSE stream's bounded queue of encoded frames: its bounds, warning and eviction, the wait of its
writer, and the end-of-pass write of the live frames a pass queued (:class:`FrameQueue`).
:class:`~.rest_events.SseSubscriber` is one, fed with the frames it translates from the bridge's lines.

Bounds: the queue holds at most ``max_frames`` frames and ``max_bytes`` bytes. Past 75 % of either the
reader is sent one ``slow_client_warning``; past the bound it gets ``client_evicted`` and its stream
ends, and nobody else waits (the bridge never waits on a live send).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from ..outbox import at_pass_end
from .rest_envelope import HEARTBEAT, _event, encode_frame

__all__ = ["FrameQueue"]


class FrameQueue:
    """The frames queued for one ``GET /session/:id/events`` stream, and its writer's side (see the
    module docstring).

    Args:
        session_id: the session the stream watches.
        max_frames: frames the queue holds before the stream is evicted.
        max_bytes: bytes the queue holds before the stream is evicted.
    """

    def __init__(self, session_id: str, *, max_frames: int = 256, max_bytes: int = 2 * 1024 * 1024) -> None:
        self.session_id = session_id
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.frames: deque[bytes] = deque()
        self.nbytes = 0
        self.warned = False
        self.evicted = False
        #: the newest session event id queued for this stream (:attr:`last_event_id`), or its digits
        #: as the line had them (``bytes``), read when asked
        self._last_id: int | bytes = 0
        #: frames taken from the queue over the stream's life (:attr:`frames_queued` counts from it)
        self._taken = 0
        self._closed = False
        self._ready = trio.Event()
        #: the writer waits on ``_ready`` (a frame queued meanwhile sets it; others need not)
        self._waiting = False
        #: what a replay waits on while the queue is full (``None``: nobody waits; see ``send_reliably``)
        self._room: trio.Event | None = None
        #: the run's clock (:attr:`taken_at`'s), read once there is a run
        self._clock: trio.abc.Clock | None = None
        #: the queue lengths at which the reader is warned (75 % of either bound)
        self._warn_frames = -(-max_frames * 3 // 4)
        self._warn_bytes = -(-max_bytes * 3 // 4)
        #: the queue length from which a frame is queued through :meth:`push` (its warning's check)
        self._fast_frames = self._warn_frames - 1
        #: when the stream's writer last took something (trio's clock): the heartbeat counts from it
        self.taken_at = 0.0
        self._beat = False
        #: writes a run of frames on the stream at once if that needs no wait (``False``: not written):
        #: the bridge's live frames then leave as their pass ends, without a step of the writer
        self.direct: Callable[[bytes], bool] | None = None
        self._at_end = False

    @property
    def last_event_id(self) -> int:
        """The newest session event id queued for this stream (0: none yet)."""
        last = self._last_id
        if type(last) is bytes:
            last = self._last_id = int(last)
        return last  # type: ignore[return-value]  # (an int: bytes were read above)

    @last_event_id.setter
    def last_event_id(self, value: int) -> None:
        self._last_id = value

    @property
    def frames_queued(self) -> int:
        """Frames queued over the stream's life (those taken and those waiting)."""
        return self._taken + len(self.frames)

    @property
    def closed(self) -> bool:
        """The stream ended (what it is sent is dropped)."""
        return self._closed

    def close(self) -> None:
        """End the stream once what is queued is written."""
        self._closed = True
        self._ready.set()
        self._made_room()

    def evict(self, reason: str) -> None:
        """End the stream with ``client_evicted`` (``reason``: ``token_revoked``), after what is queued."""
        if self._closed:
            return
        self.evicted = True
        self._append(encode_frame(_event("client_evicted", {"sessionId": self.session_id, "reason": reason})))
        self.close()

    def push(self, frame: bytes) -> None:
        """Queue one frame for the stream, warning then evicting a reader that falls behind."""
        if self._closed:
            return
        frames = len(self.frames) + 1
        size = self.nbytes + len(frame)
        if frames > self.max_frames or size > self.max_bytes:
            self.evicted = True
            data = {"sessionId": self.session_id, "reason": "queue_overflow", "queueSize": len(self.frames),
                    "maxQueued": self.max_frames, "queuedBytes": self.nbytes, "maxQueuedBytes": self.max_bytes,
                    "eventBytes": len(frame)}
            self._append(encode_frame(_event("client_evicted", data)))
            self.close()
            return
        self._append(frame)
        if not self.warned and (frames * 4 >= self.max_frames * 3 or size * 4 >= self.max_bytes * 3):
            self.warned = True
            data = {"sessionId": self.session_id, "queueSize": frames, "maxQueued": self.max_frames,
                    "lastEventId": self.last_event_id, "queuedBytes": size, "maxQueuedBytes": self.max_bytes,
                    "threshold": "frames" if frames * 4 >= self.max_frames * 3 else "bytes"}
            self._append(encode_frame(_event("slow_client_warning", data)))

    def _append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.nbytes += len(frame)
        self._ready.set()

    def push_event(self, event: dict[str, Any]) -> None:
        """Queue one envelope."""
        if "id" in event:
            self.last_event_id = event["id"]
        self.push(encode_frame(event))

    def push_frame(self, event_id: int | None, frame: bytes) -> None:
        """Queue one encoded frame (``event_id``: the session event id it carries)."""
        if event_id is not None:
            self.last_event_id = event_id
        self.push(frame)

    def _queue(self, frame: bytes) -> None:
        """Queue one live frame: here below the warning mark, else through :meth:`push`."""
        size = self.nbytes + len(frame)
        if self._closed or len(self.frames) >= self._fast_frames or size >= self._warn_bytes:
            self.push(frame)
            return
        self.frames.append(frame)
        self.nbytes = size
        if self._waiting:
            self._wake()

    def _wake(self) -> None:
        """The writer waits: wake it, or have the frames written as this pass ends (:attr:`direct`)."""
        self._waiting = False
        if self.direct is None:
            self._ready.set()
        elif not self._at_end:
            self._at_end = True
            at_pass_end(self._write_at_end)

    def _write_at_end(self) -> bool:
        """As the pass that queued live frames ends: write them through :attr:`direct` while the writer
        waits; what that cannot write wakes the writer. Whether it woke it."""
        self._at_end = False
        frames = self.frames
        if self._ready.is_set() or not frames:
            return False  # the writer was woken by another frame, or took them already
        direct = self.direct
        if direct is not None and not self._closed and direct(b"".join(frames) if len(frames) > 1 else frames[0]):
            self._taken += len(frames)
            frames.clear()
            self.nbytes = 0
            self.taken_at = self._now()
            if self._room is not None:
                self._made_room()
            self._waiting = True  # the writer still waits on ``_ready``
            return False
        self._ready.set()
        return True

    def beat(self) -> bool:
        """Have the writer send ``: heartbeat`` (unless frames come first); ``False`` once closed."""
        if self._closed:
            return False
        self._beat = True
        self._ready.set()
        return True

    async def take(self) -> list[bytes] | None:
        """Every queued frame, once there is one, or a heartbeat (``None``: closed and drained)."""
        while not self.frames:
            if self._closed:
                return None
            if self._beat:
                self._beat = False
                self.taken_at = self._now()
                return [HEARTBEAT]
            self._ready = trio.Event()
            self._waiting = True
            await self._ready.wait()
        self._beat = False
        self.taken_at = self._now()
        frames = list(self.frames)
        self._taken += len(frames)
        self.frames.clear()
        self.nbytes = 0
        if self._room is not None:
            self._made_room()
        return frames

    def _made_room(self) -> None:
        """Wake a replay that waits for room (if one does)."""
        room, self._room = self._room, None
        if room is not None:
            room.set()

    async def wait_for_room(self) -> None:
        """Wait until the queue was taken from, or the stream closed."""
        if self._closed:
            return
        if self._room is None:
            self._room = trio.Event()
        await self._room.wait()

    def _now(self) -> float:
        """The run's clock (``trio.current_time()``, without its two calls to get to the clock)."""
        clock = self._clock
        if clock is None:
            clock = self._clock = trio.lowlevel.current_clock()
        return clock.current_time()
