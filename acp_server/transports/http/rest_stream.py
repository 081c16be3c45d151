"""``GET /session/:id/events``: one SSE subscription of the REST API, from its checks to its end.

The stream opens with ``retry:`` and the ``X-Qwen-Event-Epoch`` header. Without ``Last-Event-ID`` it
is live from now. With one (the header, or the ``lastEventId`` query parameter) the transcript is
replayed after it, then ``replay_complete``, then live; a cursor this bus never issued (newer than the
session's newest event, or sent with an ``X-Qwen-Event-Epoch`` that is not ours) gets
``state_resync_required`` (``epoch_reset``) and the stream goes on live from now. ``maxQueued``
(16-2048, default 256) sets this subscriber's frame bound; ``connectReason`` and
``previousStreamId`` (the SDK's diagnostics) are accepted and ignored. The stream ends when the client
leaves, the session closes (``session_closed``) or the subscriber is evicted (``client_evicted``);
``: heartbeat`` is written after 15 s without a frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ...errors import InvalidParamsError, SubscriberLimitExceededError
from .auth import current_caller
from .rest_events import SseSubscriber, control_event
from .rules import header

if TYPE_CHECKING:
    from ...bridge import Session
    from .rest import RestApi
    from .streams import Receive, Send

__all__ = ["HEARTBEAT_S", "MAX_SUBSCRIBERS", "QUEUE_BOUNDS", "serve_events", "subscribers"]

MAX_SUBSCRIBERS = 64
HEARTBEAT_S = 15.0
#: ``maxQueued``'s range and default (frames); the byte bound is 2 MiB whatever it is
QUEUE_BOUNDS = (16, 2048, 256)
_EPOCH_HEADER = b"x-qwen-event-epoch"


def subscribers(session: Session) -> list[SseSubscriber]:
    """The event streams attached to ``session``."""
    return [p for p in session.attached if isinstance(p, SseSubscriber)]


def _cursor(headers: list[tuple[bytes, bytes]], query: dict[str, list[str]]) -> int | None:
    last = header(headers, b"last-event-id") or query.get("lastEventId", [None])[0]
    if last is None:
        return None
    if not last.isascii() or not last.isdigit() or len(last) > 16:
        raise InvalidParamsError(path="Last-Event-ID", detail="must be a non-negative integer event id")
    return int(last)


def _max_queued(query: dict[str, list[str]]) -> int:
    low, high, default = QUEUE_BOUNDS
    value = query.get("maxQueued", [None])[0]
    if value is None:
        return default
    if not value.isascii() or not value.isdigit() or not low <= int(value) <= high:
        raise InvalidParamsError(path="maxQueued", detail=f"must be an integer from {low} to {high}")
    return int(value)


async def serve_events(
    api: RestApi, session: Session, headers: list[tuple[bytes, bytes]], query: dict[str, list[str]],
    receive: Receive, send: Send, cors: list[tuple[bytes, bytes]],
) -> None:
    """Serve one subscription (see the module docstring); refusals are raised before the stream opens."""
    session_id = session.session_id
    if len(subscribers(session)) >= MAX_SUBSCRIBERS:
        raise SubscriberLimitExceededError(session_id=session_id, limit=MAX_SUBSCRIBERS, retry_after_ms=1000)
    after = _cursor(headers, query)
    sub = SseSubscriber(session_id, max_frames=_max_queued(query))
    epoch = api.state.epoch
    their_epoch = header(headers, _EPOCH_HEADER)
    bridge = api.server.bridge
    bridge.clients.set_terminal_turn_states_only(sub)  # the others have no frame here
    sub.identity = current_caller.get().identity
    auth = api.server.auth
    start = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
             (_EPOCH_HEADER, epoch.encode()), *cors]
    await send({"type": "http.response.start", "status": 200, "headers": start})
    await send({"type": "http.response.body", "body": b"retry: 3000\n\n", "more_body": True})
    # on plain HTTP/1.1 (lean.LeanStream) live frames are written as their pass ends, not by the pump
    sub.direct = getattr(getattr(send, "__self__", None), "send_chunk_nowait", None)
    fanout = bridge.fanout
    try:
        fanout.update_sinks[sub] = sub.send_update  # its live updates as their parts, not lines
        fanout.completed_sinks[sub] = sub.send_completed  # and its completed turns
        if auth is not None:
            auth.streams.add(sub)  # evicted with its token (SIGHUP revocation, expiry)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch, receive, nursery.cancel_scope)
            nursery.start_soon(_pump, sub, send, nursery.cancel_scope)
            nursery.start_soon(_heartbeat, sub)
            await _replay(bridge, session, sub, after, their_epoch is not None and their_epoch != epoch)
    finally:
        sub.close()
        bridge.peer_closed(sub)
        fanout.update_sinks.pop(sub, None)
        fanout.completed_sinks.pop(sub, None)
        if auth is not None:
            auth.streams.discard(sub)
    with trio.CancelScope(shield=True):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _replay(bridge: Any, session: Session, sub: SseSubscriber, after: int | None, foreign: bool) -> None:
    """Attach ``sub``: replay after the cursor then ``replay_complete``, or from now on."""
    session_id = session.session_id
    newest = session.next_event_id - 1
    if after is None:
        await bridge.replay(session, sub, newest)
        return
    if after > newest or foreign:  # a cursor from another event bus, or made up
        sub.push_event(control_event("state_resync_required", {
            "sessionId": session_id, "reason": "epoch_reset", "lastDeliveredId": after,
            "earliestAvailableId": 1, "lastEventId": newest,
            **({"detail": "epoch_mismatch"} if foreign else {}),
        }))
        after = newest
    base = sub.frames_queued
    await bridge.replay(session, sub, after)
    sub.push_event(control_event("replay_complete", {
        "sessionId": session_id, "lastReplayedEventId": sub.last_event_id,
        "lastEventId": session.next_event_id - 1, "replayedCount": sub.frames_queued - base,
    }))


async def _watch(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _pump(sub: SseSubscriber, send: Send, scope: trio.CancelScope) -> None:
    """Write the subscriber's frames (and its heartbeats) as they come."""
    while True:
        frames = await sub.take()
        if frames is None:
            scope.cancel()
            return
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})


async def _heartbeat(sub: SseSubscriber) -> None:
    """Have ``: heartbeat`` written once the stream has had nothing for :data:`HEARTBEAT_S` seconds
    (one timer beside the pump, so that a wake-up of the pump sets no deadline)."""
    sub.taken_at = max(sub.taken_at, trio.current_time())
    while True:
        due = sub.taken_at + HEARTBEAT_S
        if trio.current_time() < due:
            await trio.sleep_until(due)
        elif sub.beat():
            await trio.sleep(HEARTBEAT_S)
        else:
            return
