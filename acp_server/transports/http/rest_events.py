"""The REST API's event side: qwen serve's event envelope, one SSE subscriber as a bridge ``Peer``,
and the channel a REST prompt's agent asks its permission questions on.

A subscriber (:class:`SseSubscriber`) is attached to its session with the bridge's own calls
(``replay`` then live fan-out), so it receives exactly the NDJSON lines an ACP connection receives.
:func:`envelope` turns each line into qwen's ``{id?, v: 1, type, data, _meta, originatorClientId?}``:
``session/update`` -> ``session_update {sessionId, update}``; the terminal ``_acp_server/turn_state``
(completed, cancelled, failed) -> exactly one ``turn_complete`` or ``turn_error`` per prompt, live and
in replay (the transcript keeps the terminal states); the other turn states are not sent.

Bounds: a subscriber's queue holds at most ``max_frames`` frames and ``max_bytes`` bytes. Past 75 % of
either it is sent one ``slow_client_warning``; past the bound it gets ``client_evicted`` and its
stream ends, and nobody else waits (the bridge never waits on a live send).
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ...types.acp import ClientCapabilities

if TYPE_CHECKING:
    from ...auth.tokens import Identity
    from ...bridge import Session

__all__ = ["EVENT_TYPES", "PermissionBoard", "RestChannel", "SseSubscriber", "control_event", "encode_frame", "envelope"]

#: Every event type this server sends on ``GET /session/:id/events``.
EVENT_TYPES = (
    "session_update",
    "permission_request",
    "permission_resolved",
    "turn_complete",
    "turn_error",
    "session_closed",
    "client_evicted",
    "slow_client_warning",
    "state_resync_required",
    "replay_complete",
)

_TURN_STATE = "_acp_server/turn_state"
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()
#: REST peers' ids stay clear of the socket shells' (small counters).
_ids = itertools.count(1 << 40)


def _event(type: str, data: dict[str, Any], event_id: int | None = None, originator: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": 1, "type": type, "data": data, "_meta": {}}
    if event_id is not None:
        out["id"] = event_id
        out["_meta"] = {"eventId": event_id}
    if originator is not None:
        out["originatorClientId"] = originator
    return out


def envelope(line: bytes) -> dict[str, Any] | None:
    """qwen's event envelope for one NDJSON line the bridge sent (``None``: not sent over REST)."""
    try:
        msg = _decoder.decode(line)
    except msgspec.DecodeError:
        return None
    if not isinstance(msg, dict):
        return None
    method = msg.get("method")
    params = msg.get("params")
    if not isinstance(params, dict):
        return None
    meta = params.get("_meta") or {}
    event_id = meta.get("eventId") if isinstance(meta, dict) else None
    if not isinstance(event_id, int) or isinstance(event_id, bool) or event_id < 1:
        event_id = None
    session_id = params.get("sessionId")
    if method == "session/update":
        originator = meta.get("originatorClientId") if isinstance(meta, dict) else None
        return _event("session_update", {"sessionId": session_id, "update": params.get("update")}, event_id, originator)
    if method == _TURN_STATE:
        state = params.get("state")
        prompt_id = params.get("promptId")
        if state == "completed":
            stop = params.get("reason") or "end_turn"
            return _event("turn_complete", {"sessionId": session_id, "stopReason": stop, "promptId": prompt_id}, event_id)
        if state == "cancelled":
            data = {"sessionId": session_id, "stopReason": "cancelled", "promptId": prompt_id}
            return _event("turn_complete", data, event_id)
        if state == "failed":
            code = params.get("reason") or "internal"
            data = {"sessionId": session_id, "message": f"the prompt failed: {code}", "code": code, "promptId": prompt_id}
            return _event("turn_error", data, event_id)
    return None


def control_event(type: str, data: dict[str, Any]) -> dict[str, Any]:
    """An envelope without a session event id (replay_complete, state_resync_required, session_closed)."""
    return _event(type, data)


def encode_frame(event: dict[str, Any]) -> bytes:
    """One SSE frame: ``id:`` (only with a session event id), ``event:`` and ``data:``."""
    head = f"id: {event['id']}\n" if "id" in event else ""
    return f"{head}event: {event['type']}\n".encode() + b"data: " + _encoder.encode(event) + b"\n\n"


class SseSubscriber:
    """One ``GET /session/:id/events`` stream as the bridge's ``Peer`` (see the module docstring).

    Args:
        session_id: the session it watches.
        max_frames: frames its queue holds before it is evicted.
        max_bytes: bytes its queue holds before it is evicted.
    """

    def __init__(self, session_id: str, *, max_frames: int = 256, max_bytes: int = 2 * 1024 * 1024) -> None:
        self.peer_id = next(_ids)
        self.session_id = session_id
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.frames: deque[bytes] = deque()
        self.nbytes = 0
        self.warned = False
        self.evicted = False
        #: the newest session event id queued for this stream
        self.last_event_id = 0
        #: frames queued over the stream's life
        self.frames_queued = 0
        self._closed = False
        self._ready = trio.Event()
        self._room = trio.Event()
        #: the token the stream was opened with (evicted with it: :meth:`evict`)
        self.identity: Identity | None = None

    @property
    def closed(self) -> bool:
        """The stream ended (what it is sent is dropped)."""
        return self._closed

    def close(self) -> None:
        """End the stream once what is queued is written."""
        self._closed = True
        self._ready.set()
        self._room.set()

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
        self.frames_queued += 1
        self.frames.append(frame)
        self.nbytes += len(frame)
        self._ready.set()

    def push_event(self, event: dict[str, Any]) -> None:
        """Queue one envelope."""
        if "id" in event:
            self.last_event_id = event["id"]
        self.push(encode_frame(event))

    def send(self, data: bytes) -> None:
        """The bridge's live fan-out: translate and queue (never waits)."""
        event = envelope(data)
        if event is not None:
            self.push_event(event)

    async def send_reliably(self, data: bytes) -> None:
        """A replayed line: waits while the queue is at half its bound instead of evicting."""
        event = envelope(data)
        if event is None:
            return
        while not self._closed and (len(self.frames) * 2 >= self.max_frames or self.nbytes * 2 >= self.max_bytes):
            self._room = trio.Event()
            await self._room.wait()
        self.push_event(event)

    async def request(self, method: str, params: Any = None) -> Any:
        """A subscriber is never asked directly (permissions go through :class:`RestChannel`)."""
        raise trio.EndOfChannel

    async def take(self) -> list[bytes] | None:
        """Every queued frame, once there is one (``None``: closed and drained)."""
        while not self.frames:
            if self._closed:
                return None
            self._ready = trio.Event()
            await self._ready.wait()
        frames = list(self.frames)
        self.frames.clear()
        self.nbytes = 0
        self._room.set()
        return frames


class _Question:
    __slots__ = ("answer", "done", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.done = trio.Event()
        self.answer: Any = None


class PermissionBoard:
    """The permission questions REST prompts' agents asked and nobody has answered yet (first answer wins)."""

    def __init__(self) -> None:
        self.open: dict[str, _Question] = {}

    def ask(self, session_id: str) -> tuple[str, _Question]:
        """A new open question on ``session_id``: its request id and the question to wait on."""
        request_id = f"perm_{secrets.token_hex(8)}"
        question = self.open[request_id] = _Question(session_id)
        return request_id, question

    def answer(self, session_id: str, request_id: str, outcome: Any) -> bool:
        """Answer an open question; ``False`` if there is none (unknown, other session, already answered)."""
        question = self.open.get(request_id)
        if question is None or question.session_id != session_id:
            return False
        del self.open[request_id]
        question.answer = outcome
        question.done.set()
        return True


class RestChannel:
    """A REST prompt as its backend addresses the client: questions go to the session's subscribers.

    ``session/request_permission`` becomes a ``permission_request`` event on every subscriber of the
    session; the first ``POST /session/:id/permission/:requestId`` answers it. With no subscriber the
    answer is ``cancelled`` at once. Other requests (``fs/*``, ``terminal/*``) are refused as a client
    without those capabilities would.
    """

    def __init__(self, session: Session, board: PermissionBoard) -> None:
        self._session = session
        self._board = board

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities()

    def _subscribers(self) -> list[SseSubscriber]:
        return [p for p in self._session.attached if isinstance(p, SseSubscriber) and not p.closed]

    async def request(self, method: str, params: Any) -> Any:
        """Ask the session's subscribers (see the class docstring)."""
        cancelled = {"outcome": {"outcome": "cancelled"}}
        if method != "session/request_permission":
            from ...backends.base import ClientGoneError

            raise ClientGoneError(f"a REST client cannot answer {method}")
        subscribers = self._subscribers()
        if not subscribers:
            return cancelled
        session_id = self._session.session_id
        request_id, question = self._board.ask(session_id)
        p = params if isinstance(params, dict) else msgspec.to_builtins(params)
        data = {"requestId": request_id, "sessionId": session_id, "toolCall": p.get("toolCall") or {}, "options": p.get("options", [])}
        for sub in subscribers:
            sub.push_event(_event("permission_request", data))
        try:
            await question.done.wait()
        finally:
            self._board.open.pop(request_id, None)
        outcome = question.answer if question.answer is not None else cancelled
        for sub in self._subscribers():
            sub.push_event(_event("permission_resolved", {
                "requestId": request_id, "sessionId": session_id, "outcome": outcome["outcome"],
            }))
        return outcome
