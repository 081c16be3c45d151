"""qwen serve's event envelope ``{id?, v: 1, type, data, _meta, originatorClientId?}`` and its SSE frame:
the general translation of one NDJSON line the bridge sends (decoded), which :mod:`.rest_events`'s
cuts of the bridge's own layouts match byte for byte.

``session/update`` -> ``session_update {sessionId, update}``; the terminal ``_acp_server/turn_state``
(completed, cancelled, failed) -> exactly one ``turn_complete`` or ``turn_error`` per prompt, live and
in replay (the transcript keeps the terminal states); the other turn states are not sent (the bridge
gives a subscriber the terminal ones only).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["EVENT_TYPES", "HEARTBEAT", "control_event", "encode_frame", "envelope", "envelopes"]

#: Every event type this server sends on ``GET /session/:id/events``.
EVENT_TYPES = (
    "session_update",
    "permission_request",
    "permission_resolved",
    "turn_complete",
    "turn_error",
    "prompt_cancelled",
    "session_closed",
    "client_evicted",
    "slow_client_warning",
    "state_resync_required",
    "replay_complete",
)

#: the comment an idle stream is sent (proxies keep the connection open)
HEARTBEAT = b": heartbeat\n\n"
_TURN_STATE = "_acp_server/turn_state"
_REPLAY_TRUNCATED = "_acp_server/replay_truncated"
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def _event(type: str, data: dict[str, Any], event_id: int | None = None, originator: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": 1, "type": type, "data": data, "_meta": {}}
    if event_id is not None:
        out["id"] = event_id
        out["_meta"] = {"eventId": event_id}
    if originator is not None:
        out["originatorClientId"] = originator
    return out


def envelopes(line: bytes) -> list[dict[str, Any]]:
    """qwen's event envelopes for one NDJSON line the bridge sent (none: not sent over REST).

    A cancelled turn is ``prompt_cancelled`` then its ``turn_complete`` (which carries the event id);
    a replay that starts past a gap (``_acp_server/replay_truncated``) is ``state_resync_required``.
    """
    try:
        msg = _decoder.decode(line)
    except msgspec.DecodeError:
        return []
    if not isinstance(msg, dict) or not isinstance(msg.get("params"), dict):
        return []
    method = msg.get("method")
    params: dict[str, Any] = msg["params"]
    raw_meta = params.get("_meta")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    event_id = meta.get("eventId")
    if not isinstance(event_id, int) or isinstance(event_id, bool) or event_id < 1:
        event_id = None
    session_id = params.get("sessionId")
    if method == "session/update":
        data = {"sessionId": session_id, "update": params.get("update")}
        return [_event("session_update", data, event_id, meta.get("originatorClientId"))]
    if method == _TURN_STATE:
        return _turn_end(params, event_id)
    if method == _REPLAY_TRUNCATED:
        return [_event("state_resync_required", {
            "sessionId": session_id, "reason": "replay_window_exceeded",
            "lastDeliveredId": params.get("requestedAfterEventId", 0), "earliestAvailableId": params.get("firstEventId", 1),
        })]
    return []


def _turn_end(params: dict[str, Any], event_id: int | None) -> list[dict[str, Any]]:
    """The frames of a terminal turn state (none for the others)."""
    state = params.get("state")
    session_id = params.get("sessionId")
    prompt_id = params.get("promptId")
    if state == "completed":
        stop = params.get("reason") or "end_turn"
        return [_event("turn_complete", {"sessionId": session_id, "stopReason": stop, "promptId": prompt_id}, event_id)]
    if state == "cancelled":
        cancelled: dict[str, Any] = {"sessionId": session_id, "promptId": prompt_id}
        if params.get("reason"):
            cancelled["reason"] = params["reason"]
        data = {"sessionId": session_id, "stopReason": "cancelled", "promptId": prompt_id}
        return [_event("prompt_cancelled", cancelled), _event("turn_complete", data, event_id)]
    if state == "failed":
        code = params.get("reason") or "internal"
        data = {"sessionId": session_id, "message": f"the prompt failed: {code}", "code": code, "promptId": prompt_id}
        return [_event("turn_error", data, event_id)]
    return []


def envelope(line: bytes) -> dict[str, Any] | None:
    """The last of :func:`envelopes` (the one that carries the line's event id), or ``None``."""
    events = envelopes(line)
    return events[-1] if events else None


def control_event(type: str, data: dict[str, Any]) -> dict[str, Any]:
    """An envelope without a session event id (replay_complete, state_resync_required, session_closed)."""
    return _event(type, data)


def encode_frame(event: dict[str, Any]) -> bytes:
    """One SSE frame: ``id:`` (only with a session event id), ``event:`` and ``data:``."""
    head = f"id: {event['id']}\n" if "id" in event else ""
    return f"{head}event: {event['type']}\n".encode() + b"data: " + _encoder.encode(event) + b"\n\n"


class _UpdateMeta(msgspec.Struct):
    eventId: Any = None
    originatorClientId: Any = None


class _UpdateParams(msgspec.Struct):
    sessionId: Any = None
    update: msgspec.Raw = msgspec.Raw(b"null")
    meta: _UpdateMeta | None = msgspec.field(name="_meta", default=None)


class _Line(msgspec.Struct):
    method: Any = None
    params: _UpdateParams | None = None


_line_decoder = msgspec.json.Decoder(_Line)


def _update_frames(line: bytes) -> list[tuple[int | None, bytes]] | None:
    """:func:`envelopes` then :func:`encode_frame` for a ``session/update`` line, with the update kept
    as the line's own JSON (decoded into Structs, not dicts, and not encoded again: the same JSON value,
    its escapes as the line had them); ``None`` for any other line, one of another shape, or one with a
    carriage return (JSON whitespace, but a line end to SSE), which take the general path."""
    if b"\r" in line:
        return None
    try:
        msg = _line_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    params = msg.params
    if msg.method != "session/update" or params is None:
        return None
    meta = params.meta
    event_id = meta.eventId if meta is not None else None
    if not isinstance(event_id, int) or isinstance(event_id, bool) or event_id < 1:
        event_id = None
    data = {"sessionId": params.sessionId, "update": params.update}
    event = _event("session_update", data, event_id, meta.originatorClientId if meta is not None else None)
    return [(event_id, encode_frame(event))]
