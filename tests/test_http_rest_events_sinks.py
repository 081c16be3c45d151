"""A subscriber handed its live updates as their parts (``FanOut.update_sinks``): the frames it queues
are those of the update's line, and the bridge hands them over only while the stream is attached alone."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from acp_server.bridge import fanout
from acp_server.bridge.fanout import encode_update
from acp_server.transports.http import rest_events
from acp_server.transports.http.rest_events import SseSubscriber

from .http_helpers import TIMEOUT_S, eventually, http_server
from .test_http_rest import Events

BODY = b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi \\u00e9 \\"x\\""}}'


@pytest.mark.parametrize(
    ("session_id", "event_id", "originator"),
    [
        ("s-1", 1, None),
        ("s-1", 42, "cli-1"),
        ("s-1", 10**16 - 1, "a.b:c_d-e"),
        ("s-1", 10**16, "cli-1"),  # past the cut's 16 digits: the line's path
        ("s-1", 7, "c 1"),  # an originating client id that is not plain: the line's path
        ("s 1", 7, "cli-1"),  # a session id that is not plain: the line's path
    ],
)
def test_an_update_handed_as_its_parts_is_queued_as_its_line(session_id: str, event_id: int, originator: str | None) -> None:
    """``send_update`` queues, byte for byte, the frames ``send`` queues for the update's line, with the
    same last event id and frame count, again and again (its originators' members are kept)."""
    line = encode_update(session_id, event_id, BODY, originator)
    by_line = SseSubscriber(session_id)
    rest_events._last_line = (b"", [])
    rest_events._last_update = (b"", b"", b"")
    by_line.send(line)
    by_parts = SseSubscriber(session_id)
    for _ in range(2):
        by_parts.send_update(event_id, BODY, originator)
    assert list(by_parts.frames) == list(by_line.frames) * 2 and len(by_line.frames) == 1
    assert by_parts.last_event_id == by_line.last_event_id and by_parts.frames_queued == 2


def test_many_originators_are_kept_within_a_bound() -> None:
    """The originating client ids' members a subscriber keeps are bounded; frames stay the line's."""
    sub = SseSubscriber("s-1", max_frames=1024)
    for n in range(200):
        sub.send_update(n + 1, b"{}", f"cli-{n}")
    assert len(sub._members) <= rest_events._TAIL_ENDS_KEPT
    rest_events._last_line = (b"", [])
    assert sub.frames[-1] == rest_events.frames_of(encode_update("s-1", 200, b"{}", "cli-199"))[0][1]


@pytest.mark.parametrize("closed_at", [None, 10])
def test_updates_from_changing_originators_a_warning_and_a_close_are_the_lines_frames(closed_at: int | None) -> None:
    """``send_update``'s fast path (the last originator's frame end kept) and its other path give the
    lines' frames as originators change, the warning comes at the same frame as ``send``'s, and a closed
    stream drops what it is sent, as the lines' subscriber does."""
    originators = [None, "cli-1", "cli-1", "cli-2", None, "c 1", "cli-1", "cli-1"] * 3
    by_line, by_parts = SseSubscriber("s-1", max_frames=30), SseSubscriber("s-1", max_frames=30)
    for n, originator in enumerate(originators, 1):
        if n == closed_at:
            by_line.close()
            by_parts.close()
        rest_events._last_update = (b"", b"", b"")
        by_line.send(encode_update("s-1", n, BODY, originator))
        by_parts.send_update(n, BODY, originator)
    assert list(by_parts.frames) == list(by_line.frames) and by_parts.warned == (closed_at is None)
    assert by_parts.last_event_id == by_line.last_event_id and by_parts.frames_queued == by_line.frames_queued
    assert not by_parts.evicted


async def test_a_stream_is_a_sink_while_it_is_open() -> None:
    """The event stream is registered as its session's update and completed-turn sink while open and
    removed once it ends; its prompt's updates and turn_complete arrive as before."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, _n, url), httpx.AsyncClient(timeout=10) as c:
            sinks = server.bridge.fanout.update_sinks
            completed = server.bridge.fanout.completed_sinks
            async with trio.open_nursery() as nursery:
                sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
                events = Events()
                await nursery.start(events.run, c, f"{url}/session/{sid}/events")
                await eventually(lambda: len(server.bridge.sessions[sid].attached) == 1)
                [sub] = server.bridge.sessions[sid].attached
                assert sinks == {sub: sub.send_update}  # type: ignore[attr-defined]
                assert completed == {sub: sub.send_completed}  # type: ignore[attr-defined]
                prompt = {"prompt": [{"type": "text", "text": "one two"}]}
                assert (await c.post(f"{url}/session/{sid}/prompt", json=prompt)).status_code == 202
                await events.wait_for("turn_complete")
                kinds = [f["type"] for f in events.frames]
                assert kinds == ["session_update"] * 3 + ["turn_complete"], kinds
                ids = [f["id"] for f in events.frames]
                assert ids == sorted(ids) and all(f["_meta"] == {"eventId": f["id"]} for f in events.frames)
                nursery.cancel_scope.cancel()
            await eventually(lambda: not sinks and not completed)


@pytest.mark.parametrize(
    ("session_id", "prompt_id", "reason", "event_id", "originator", "taken"),
    [
        ("s-1", "prompt_1", "end_turn", 3, None, True),
        ("s-1", "prompt_2", "max_tokens", 42, "cli-1", True),
        ("s-1", "a.b:c_d-e", "cancelled", 10**16 - 1, "a.b:c_d-e", True),
        ("s-1", "prompt_3", "end_turn", 10**16, None, False),  # past the cut's 16 digits
        ("s-1", "p 1", "end_turn", 5, None, False),  # a prompt id that is not plain
        ("s-1", "prompt_4", "end_turn", 5, "c 1", False),  # an originating client id that is not plain
        ("s-1", "prompt_5", "odd reason", 5, None, False),  # a stop reason that is not plain
        ("s 1", "prompt_6", "end_turn", 5, None, False),  # a session id that is not plain
    ],
)
def test_a_completed_turn_handed_as_its_parts_is_queued_as_its_line(
    session_id: str, prompt_id: str, reason: str, event_id: int, originator: str | None, taken: bool
) -> None:
    """``send_completed`` queues, byte for byte, the ``turn_complete`` frame ``send`` queues for the
    completed turn's line (``FanOut.completed``'s), with the same last event id; what its cut does not
    take is left to the line (``False``, nothing queued)."""
    head, tail = fanout._turn_state_ends(session_id, prompt_id, originator)
    extra = fanout._REASONS.get(reason) or b',"reason":' + msgspec.json.encode(reason)
    line = fanout._TURN_STATE % (head, b"completed", b"1764650000000", extra, event_id, tail)
    rest_events._last_line = (b"", [])
    rest_events._last_update = (b"", b"", b"")
    by_line = SseSubscriber(session_id)
    by_line.send(line)
    by_parts = SseSubscriber(session_id)
    by_parts.send_update(1, b"{}", originator)  # (its originator met already, as after a prompt's updates)
    by_parts.frames.clear()
    assert by_parts.send_completed(prompt_id, reason, event_id, originator) is taken
    if taken:
        assert list(by_parts.frames) == list(by_line.frames) and len(by_line.frames) == 1
        assert by_parts.last_event_id == by_line.last_event_id == event_id
    else:
        assert not by_parts.frames
