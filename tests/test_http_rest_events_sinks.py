"""A subscriber handed its live updates as their parts (``FanOut.update_sinks``): the frames it queues
are those of the update's line, and the bridge hands them over only while the stream is attached alone."""

from __future__ import annotations

import httpx
import pytest
import trio

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


async def test_a_stream_is_a_sink_while_it_is_open() -> None:
    """The event stream is registered as its session's update sink while open and removed once it
    ends; its prompt's updates and turn_complete arrive as before."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, _n, url), httpx.AsyncClient(timeout=10) as c:
            sinks = server.bridge.fanout.update_sinks
            async with trio.open_nursery() as nursery:
                sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
                events = Events()
                await nursery.start(events.run, c, f"{url}/session/{sid}/events")
                await eventually(lambda: len(server.bridge.sessions[sid].attached) == 1)
                [sub] = server.bridge.sessions[sid].attached
                assert sinks == {sub: sub.send_update}  # type: ignore[attr-defined]
                prompt = {"prompt": [{"type": "text", "text": "one two"}]}
                assert (await c.post(f"{url}/session/{sid}/prompt", json=prompt)).status_code == 202
                await events.wait_for("turn_complete")
                kinds = [f["type"] for f in events.frames]
                assert kinds == ["session_update"] * 3 + ["turn_complete"], kinds
                ids = [f["id"] for f in events.frames]
                assert ids == sorted(ids) and all(f["_meta"] == {"eventId": f["id"]} for f in events.frames)
                nursery.cancel_scope.cancel()
            await eventually(lambda: not sinks)
