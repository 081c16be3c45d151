"""The REST API's event stream beyond the basics (tests/test_http_rest.py): ``prompt_cancelled``,
``session_closed`` on every close, the subscriber limit, ``maxQueued``, the event epoch (stable
across restarts on one state directory), ``single`` sessions per cwd, and the feature tags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import trio

from acp_server.backends import EchoBackend
from acp_server.bridge.clients import TURN_STATES_TERMINAL
from acp_server.bridge.fanout import encode_update
from acp_server.transports.http.rest import FEATURES
from acp_server.transports.http.rest_events import SseSubscriber, encode_frame, envelopes, frames_of
from acp_server.transports.http.rest_stream import MAX_SUBSCRIBERS

from .helpers import RawClient
from .http_helpers import TIMEOUT_S, check_error_body, eventually, http_server
from .test_http_qwen_sdk import serve
from .test_http_rest import Events
from .test_http_sdk import wait_http

SDK_CLI = Path(__file__).resolve().parent / "node" / "node_modules" / "@qwen-code" / "sdk" / "dist" / "cli" / "chunks"
OK = [{"type": "text", "text": "x"}]


def _subs(server: object, sid: str) -> int:
    return sum(isinstance(p, SseSubscriber) for p in server.bridge.get(sid).attached)  # type: ignore[attr-defined]


async def test_cancelled_prompt_is_prompt_cancelled_then_turn_complete() -> None:
    """A cancel: ``prompt_cancelled {sessionId, promptId}`` (no id) right before the one
    ``turn_complete {stopReason: cancelled}`` that carries the event id; the same in replay."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(backend=EchoBackend(delay_ms=3000)) as (server, _n, url):
            async with httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
                sid = (await c.post(url + "/session", json={})).json()["sessionId"]
                ev = Events()
                await nursery.start(ev.run, c, f"{url}/session/{sid}/events")
                await eventually(lambda: _subs(server, sid) == 1)
                [sub] = [p for p in server.bridge.sessions[sid].attached if isinstance(p, SseSubscriber)]
                # accepted and running have no frame: the bridge does not send them to the subscriber
                assert server.bridge.clients.peers[sub].turn_states == TURN_STATES_TERMINAL
                accepted = (await c.post(f"{url}/session/{sid}/prompt", json={"prompt": OK})).json()
                await eventually(lambda: server.bridge.sessions[sid].pending_count == 1)
                assert (await c.post(f"{url}/session/{sid}/cancel")).status_code == 204
                [done] = await ev.wait_for("turn_complete")
                kinds = [f["type"] for f in ev.frames]
                cancelled = ev.frames[kinds.index("prompt_cancelled")]
                assert kinds.index("prompt_cancelled") == kinds.index("turn_complete") - 1
                assert cancelled["data"]["promptId"] == done["data"]["promptId"] == accepted["promptId"]
                assert "id" not in cancelled and done["data"]["stopReason"] == "cancelled" and done["id"] >= 1
                again = Events()
                await nursery.start(again.run, c, f"{url}/session/{sid}/events", {"Last-Event-ID": "0"})
                await again.wait_for("replay_complete")
                assert [f["type"] for f in again.frames if f["type"] in ("prompt_cancelled", "turn_complete")] == [
                    "prompt_cancelled", "turn_complete"]
                nursery.cancel_scope.cancel()


async def test_session_closed_when_another_peer_closes_the_session() -> None:
    """An ACP ``session/close`` from a connection: every subscriber gets ``session_closed`` and its
    stream ends; ``DELETE`` does the same."""
    from .helpers import connect

    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, outer, url), httpx.AsyncClient(timeout=10) as c:
            acp: RawClient = await connect(server, outer)
            for how in ("acp", "delete"):
                sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
                streams = [Events(), Events()]
                async with trio.open_nursery() as nursery:
                    for ev in streams:
                        await nursery.start(ev.run, c, f"{url}/session/{sid}/events")
                    await eventually(lambda sid=sid: _subs(server, sid) == 2)  # type: ignore[misc]
                    if how == "acp":
                        await acp.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                        await acp.call("session/close", {"sessionId": sid})
                    else:
                        assert (await c.delete(f"{url}/session/{sid}")).status_code == 204
                # both streams ended by themselves (the nursery returned)
                for ev in streams:
                    [closed] = await ev.wait_for("session_closed")
                    assert closed["data"] == {"sessionId": sid, "reason": "client_close"}
                    assert ev.frames[-1]["type"] == "session_closed"


async def test_the_65th_subscriber_gets_429_subscriber_limit_exceeded() -> None:
    """64 streams on one session are served; the 65th is 429 ``subscriber_limit_exceeded`` with
    ``Retry-After`` and the body of its kind; once one leaves, a new one is served."""
    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server() as (server, _n, url):
            limits = httpx.Limits(max_connections=MAX_SUBSCRIBERS + 8)
            async with httpx.AsyncClient(timeout=10, limits=limits) as c:
                sid = (await c.post(url + "/session", json={})).json()["sessionId"]
                async with trio.open_nursery() as nursery:
                    for _ in range(MAX_SUBSCRIBERS):
                        await nursery.start(Events().run, c, f"{url}/session/{sid}/events")
                    await eventually(lambda: _subs(server, sid) == MAX_SUBSCRIBERS)
                    r = await c.get(f"{url}/session/{sid}/events")
                    assert r.status_code == 429 and r.headers["retry-after"] == "1"
                    body = check_error_body(r)
                    assert (body["code"], body["sessionId"], body["limit"]) == ("subscriber_limit_exceeded", sid, 64)
                    assert body["retryAfterMs"] == 1000
                    nursery.cancel_scope.cancel()
                await eventually(lambda: _subs(server, sid) == 0)
                extra = Events()
                async with trio.open_nursery() as nursery:
                    await nursery.start(extra.run, c, f"{url}/session/{sid}/events")
                    assert extra.status == 200
                    nursery.cancel_scope.cancel()


async def test_max_queued_bounds_the_subscriber_and_is_checked() -> None:
    """``?maxQueued=N`` (16-2048) is the subscriber's frame bound; outside it, 400 ``invalid_params``."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, _n, url), httpx.AsyncClient(timeout=10) as c:
            sid = (await c.post(url + "/session", json={})).json()["sessionId"]
            for bad in ("15", "2049", "x", "-1"):
                r = await c.get(f"{url}/session/{sid}/events?maxQueued={bad}")
                assert r.status_code == 400 and check_error_body(r)["path"] == "maxQueued"
            async with trio.open_nursery() as nursery:
                await nursery.start(Events().run, c, f"{url}/session/{sid}/events?maxQueued=16")
                await eventually(lambda: _subs(server, sid) == 1)
                [sub] = [p for p in server.bridge.get(sid).attached if isinstance(p, SseSubscriber)]
                assert sub.max_frames == 16
                nursery.cancel_scope.cancel()


def _epoch_of(base: str, sid: str) -> str:
    with httpx.stream("GET", f"{base}/session/{sid}/events", timeout=10) as r:
        assert r.status_code == 200
        return r.headers["x-qwen-event-epoch"]


def test_event_epoch_is_stable_across_restarts_on_one_state_dir(tmp_path: Path) -> None:
    """``X-Qwen-Event-Epoch`` (and ``eventEpoch`` of prompt and resume answers) is the same after a
    restart on the same ``--state-dir`` and differs on another; a cursor sent with a foreign epoch gets
    ``state_resync_required`` (``epoch_reset``, ``epoch_mismatch``), then ``replay_complete``. The
    ``single`` session of a cwd is still that cwd's default after the restart."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--http-listen", "http://127.0.0.1:0", "--echo-delay-ms", "0")
    with serve("--state-dir", str(one), *args) as server:
        base = wait_http(server)
        sid = httpx.post(base + "/session", json={"cwd": "/tmp"}, timeout=10).json()["sessionId"]
        first = _epoch_of(base, sid)
        accepted = httpx.post(f"{base}/session/{sid}/prompt", json={"prompt": OK}, timeout=10).json()
        assert accepted["eventEpoch"] == first and re.fullmatch(r"[0-9a-f]{16}", first)
    with serve("--state-dir", str(one), *args) as server:
        base = wait_http(server)
        assert _epoch_of(base, sid) == first
        assert httpx.post(f"{base}/session/{sid}/resume", json={}, timeout=10).json()["eventEpoch"] == first
        again = httpx.post(base + "/session", json={"cwd": "/tmp"}, timeout=10).json()
        assert (again["sessionId"], again["attached"]) == (sid, True)
        headers = {"Last-Event-ID": "1", "X-Qwen-Event-Epoch": "0123456789abcdef"}
        with httpx.stream("GET", f"{base}/session/{sid}/events", headers=headers, timeout=10) as r:
            text = ""
            for chunk in r.iter_text():
                text += chunk
                if "replay_complete" in text:
                    break
        assert "event: state_resync_required" in text and '"detail":"epoch_mismatch"' in text
    with serve("--state-dir", str(two), *args) as server:
        base = wait_http(server)
        other = httpx.post(base + "/session", json={}, timeout=10).json()["sessionId"]
        assert _epoch_of(base, other) != first


async def test_single_scope_attaches_to_the_default_session_of_each_cwd() -> None:
    """``single`` makes a cwd's default session once and attaches to it after; ``thread`` always
    makes one and leaves the default alone; another cwd has its own; a closed default (``DELETE`` or
    an ACP ``session/close``) is replaced."""
    from .helpers import connect

    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, outer, url), httpx.AsyncClient(timeout=10) as c:
            a = (await c.post(url + "/session", json={"cwd": "/srv/a"})).json()
            assert a["attached"] is False
            thread = (await c.post(url + "/session", json={"cwd": "/srv/a", "sessionScope": "thread"})).json()
            again = (await c.post(url + "/session", json={"cwd": "/srv/a"})).json()
            b = (await c.post(url + "/session", json={"cwd": "/srv/b", "sessionScope": "single"})).json()
            assert (again["sessionId"], again["attached"]) == (a["sessionId"], True)
            assert again["clientId"] != a["clientId"]
            assert len({a["sessionId"], thread["sessionId"], b["sessionId"]}) == 3
            assert (await c.delete(f"{url}/session/{a['sessionId']}")).status_code == 204
            fresh = (await c.post(url + "/session", json={"cwd": "/srv/a"})).json()
            assert fresh["attached"] is False and fresh["sessionId"] not in (a["sessionId"], thread["sessionId"])
            acp = await connect(server, outer)  # closed by an ACP peer instead: replaced all the same
            await acp.call("session/load", {"sessionId": b["sessionId"], "cwd": "/srv/b", "mcpServers": []})
            await acp.call("session/close", {"sessionId": b["sessionId"]})
            other = (await c.post(url + "/session", json={"cwd": "/srv/b"})).json()
            assert other["attached"] is False and other["sessionId"] != b["sessionId"]


def _qwen_capability_tags() -> set[str]:
    for path in sorted(SDK_CLI.glob("*.js")):
        text = path.read_text(errors="replace")
        start = text.find("var SERVE_CAPABILITY_REGISTRY = {")
        if start >= 0:
            body = text[start: text.index("\n};", start)]
            return set(re.findall(r"^  ([a-z][a-z0-9_]*): \{", body, re.M))
    pytest.skip("qwen's SDK (tests/node, npm ci) is needed for its capability registry")


async def test_features_are_qwen_tags_of_what_is_served() -> None:
    """``features`` is qwen serve's own tag names (its capability registry, shipped in the SDK), each
    one a route or behaviour this server has; the routes the tags name answer."""
    tags = _qwen_capability_tags()
    assert set(FEATURES) <= tags, set(FEATURES) - tags
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_server, _n, url), httpx.AsyncClient(timeout=10) as c:
            caps = (await c.get(url + "/capabilities")).json()
            assert caps["features"] == list(FEATURES)
            sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
            served = {
                "session_load": (await c.post(f"{url}/session/{sid}/load", json={})).status_code,
                "session_resume": (await c.post(f"{url}/session/{sid}/resume", json={})).status_code,
                "client_heartbeat": (await c.post(f"{url}/session/{sid}/heartbeat")).status_code,
                "session_prompt": (await c.post(f"{url}/session/{sid}/prompt", json={"prompt": OK, "deadlineMs": 5000})).status_code,
                "session_cancel": (await c.post(f"{url}/session/{sid}/cancel")).status_code,
                "session_list": (await c.get(url + "/workspace/%2Ftmp/sessions")).status_code,
                "session_close": (await c.delete(f"{url}/session/{sid}")).status_code,
            }
            assert served == {"session_load": 200, "session_resume": 200, "client_heartbeat": 200, "session_prompt": 202,
                              "session_cancel": 204, "session_list": 200, "session_close": 204}
            assert set(served) <= set(FEATURES) and "permission_vote" not in FEATURES  # no POST /permission/:id


async def test_single_scope_with_a_store_replaces_a_default_closed_by_an_acp_peer(tmp_path: Path) -> None:
    """With a state directory a closed session stays loadable, yet a default session closed by an ACP
    ``session/close`` is not attached to again: the next ``single`` makes a new default."""
    from acp_server.server import ListenAddress, Server
    from acp_server.store import SessionStore
    from acp_server.transports.http import HttpLimits, HttpOptions, serve_http

    from .helpers import connect

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            server = Server(store=SessionStore(tmp_path), drain_timeout_s=0)
            await nursery.start(server.bridge.run)
            lim = server.limits
            options = HttpOptions(limits=HttpLimits(max_message_bytes=lim.max_message_bytes, max_outbound_bytes=lim.outbound_bytes))
            url = await nursery.start(serve_http, server.handle_stream, ListenAddress("tcp", host="127.0.0.1", port=0), options)
            async with httpx.AsyncClient(timeout=10) as c:
                first = (await c.post(url + "/session", json={"cwd": "/srv/s"})).json()
                assert (await c.post(url + "/session", json={"cwd": "/srv/s"})).json()["sessionId"] == first["sessionId"]
                acp = await connect(server, nursery)
                await acp.call("session/load", {"sessionId": first["sessionId"], "cwd": "/srv/s", "mcpServers": []})
                await acp.call("session/close", {"sessionId": first["sessionId"]})
                assert first["sessionId"] in server.bridge.persistence.stored  # still loadable
                other = (await c.post(url + "/session", json={"cwd": "/srv/s"})).json()
                assert other["attached"] is False and other["sessionId"] != first["sessionId"]
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "line",
    [
        encode_update("s1", 7, b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi \\u00e9"}}'),
        encode_update("s1", 8, b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"x"}}', "cli-1"),
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"a":[1,2]}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{},"_meta":{"eventId":true}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{},"_meta":{"eventId":0}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{},"_meta":"odd"}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1"}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":[1]}\n',
        b'{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{"sessionId":"s1","state":"completed",'
        b'"promptId":"p1","_meta":{"eventId":9}}}\n',
        b'{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{"sessionId":"s1","state":"working"}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"a":\r1}}}\n',
        b"not json\n",
    ],
)
def test_frames_of_a_line_are_the_envelopes_encoded(line: bytes) -> None:
    """The session/update fast path writes the frames the general translation writes: the same ids and
    SSE lines, the same JSON (escapes may differ), each frame's data on one line."""
    fast = frames_of(line)
    general = [(event.get("id"), encode_frame(event)) for event in envelopes(line)]
    assert [i for i, _ in fast] == [i for i, _ in general]
    for (_, got), (_, want) in zip(fast, general, strict=True):
        head, _, data = got.partition(b"data: ")
        assert head == want.partition(b"data: ")[0]
        assert data.endswith(b"\n\n") and b"\n" not in data[:-2] and b"\r" not in data
        assert json.loads(data) == json.loads(want.partition(b"data: ")[2])


async def test_an_idle_event_stream_gets_a_heartbeat_every_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """``: heartbeat`` is written once a stream has had nothing for HEARTBEAT_S, and again after as long."""
    from acp_server.transports.http import rest_stream

    monkeypatch.setattr(rest_stream, "HEARTBEAT_S", 0.3)
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_server, _n, url), httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
            sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
            events = Events()
            started = trio.current_time()
            await nursery.start(events.run, c, f"{url}/session/{sid}/events")
            beats: list[float] = []
            while len(beats) < 2:
                await trio.sleep(0.02)
                if events.raw.count(": heartbeat\n\n") > len(beats):
                    beats.append(trio.current_time() - started)
            assert events.raw.startswith("retry: 3000\n\n")
            assert beats[0] >= 0.25 and beats[1] - beats[0] >= 0.25
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "line",
    [
        encode_update("s1", 7, b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi \\u00e9"}}'),
        encode_update("3f2a-b_c.d:e", 123456, b'{"a":{"_meta":{"eventId":3}},"b":",\\"_meta\\":{\\"eventId\\":9}}"}', "cli-1"),
        encode_update("s1", 1, b"[]"),
    ],
)
def test_a_bridge_update_line_is_cut_into_the_frame_its_decoding_writes(line: bytes) -> None:
    """A ``session/update`` line in the bridge's own layout becomes, cut from its bytes, exactly the
    frame the Struct decoding writes (the same bytes, the same event id)."""
    from acp_server.transports.http.rest_events import _bridge_update_frame, _update_frames

    cut = _bridge_update_frame(line)
    assert cut is not None and cut == _update_frames(line)


@pytest.mark.parametrize(
    "line",
    [
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s\\"1","update":{},"_meta":{"eventId":2}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{},"_meta":{"eventId":02}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{},"_meta":{"eventId":2,"x":1}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"a":\r1},"_meta":{"eventId":2}}}\n',
    ],
)
def test_other_update_lines_are_not_cut(line: bytes) -> None:
    """A line the bridge's layout does not describe exactly takes the decoding path."""
    from acp_server.transports.http.rest_events import _bridge_update_frame

    assert _bridge_update_frame(line) is None


def _turn(state: str, extra: str = "", session: str = "s-1", prompt: str = "prompt_1", origin: str = ',"originatorClientId":"c1"') -> bytes:
    return (f'{{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{{"sessionId":"{session}","promptId":"{prompt}",'
            f'"state":"{state}","at":1700000000000{extra},"_meta":{{"eventId":42{origin}}}}}}}\n').encode()


@pytest.mark.parametrize(
    "line",
    [
        encode_update("s-1", 7, b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi \\u00e9"}}'),
        encode_update("s-1", 123456, b'{"a":{"_meta":{"eventId":3}},"b":",\\"_meta\\":{\\"eventId\\":9}}"}', "cli-1"),
        encode_update("s-1", 8, b'{"a":1,"_meta":{"eventId":5}}', "cli-1"),
        encode_update("s-1", 9, b'{"a":"x\ny"}'),
        encode_update("s-1", 9, b'{"a":\r1}'),
        encode_update("s-2", 9, b'{"a":1}'),
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":02}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":2,"x":1}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":12345678901234567}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":,"originatorClientId":"c1"}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":5,"originatorClientId":"c 1"}}}\n',
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":5}}}\n\n',
        encode_update("s-1", 10, b'{"a":1}', "cli-1")[:-1],
        _turn("accepted"),
        _turn("queued", ',"positionHint":3'),
        _turn("running", origin=""),
        _turn("completed", ',"reason":"end_turn"'),
        _turn("completed", ',"reason":"max_tokens"', origin=""),
        _turn("completed"),
        _turn("completed", ',"reason":""'),
        _turn("completed", ',"reason":"a\\"b"'),
        _turn("completed", ',"reason":"end_turn"', prompt="p\\u00e9"),
        _turn("cancelled", ',"reason":"client_cancel"'),
        _turn("failed", ',"reason":"agent_error"'),
        _turn("completed", ',"reason":"end_turn"', session="s-2"),
        _turn("working"),
    ],
)
def test_a_subscriber_cuts_its_sessions_lines_into_the_frames_decoding_writes(line: bytes) -> None:
    """The frames a subscriber cuts from its session's lines (its session id known, nothing searched)
    are, byte for byte, the decoding path's: an update's frame keeps the update's own JSON, a terminal
    turn state's frames are its envelopes encoded, the other states have none; lines of other layouts
    or sessions, and any with a carriage return or a line feed inside, are decoded."""
    from acp_server.transports.http import rest_events

    sub = SseSubscriber("s-1")
    rest_events._last_line = (b"", [])
    got = sub._frames_of(line)
    if b'"method":"session/update"' in line:
        want = rest_events._update_frames(line)
        if want is None:
            want = [(event.get("id"), encode_frame(event)) for event in envelopes(line)]
    else:
        want = [(event.get("id"), encode_frame(event)) for event in envelopes(line)]
    assert got == want
    rest_events._last_line = (b"", [])
    assert frames_of(line) == want  # any session's line, through the general cut
    for _, frame in got:
        assert b"\r" not in frame and frame.count(b"\n") == frame.count(b"\n", 0, frame.index(b"data: ")) + 2
    rest_events._last_line = (b"", [])
    sent = SseSubscriber("s-1", max_frames=1024)
    sent.send(line)  # the live fan-out's own cut queues the same frames
    assert list(sent.frames) == [frame for _, frame in want]
    ids = [event_id for event_id, _ in want if event_id is not None]
    assert sent.last_event_id == (ids[-1] if ids else 0)


def test_a_subscriber_cuts_a_run_of_lines_as_each_alone() -> None:
    """Lines whose ends repeat (the ends a subscriber keeps after the first) are cut as each line
    alone is, a line of another layout between them included."""
    from acp_server.transports.http import rest_events

    lines = [
        encode_update("s-1", 1, b'{"a":1}', "cli-1"),
        encode_update("s-1", 2, b'{"a":2}', "cli-1"),
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s-1","update":{},"_meta":{"eventId":12345678901234567,"originatorClientId":"cli-1"}}}\n',
        encode_update("s-1", 4, b'{"a":4}'),
        encode_update("s-1", 5, b'{"a":5}', "cli-1"),
        encode_update("s-1", 6, b'{"a":6}'),
    ]
    want = []
    for line in lines:
        rest_events._last_line = (b"", [])
        want += [frame for _, frame in frames_of(line)]
    sub = SseSubscriber("s-1", max_frames=1024)
    for line in lines:
        sub.send(line)
    assert list(sub.frames) == want and len(want) == 6
    assert sub.last_event_id == 6


def test_a_subscriber_of_a_session_id_that_is_not_plain_decodes_its_lines() -> None:
    """A session id that would need escaping in JSON never takes the cut (its lines are decoded)."""
    from acp_server.transports.http import rest_events

    sub = SseSubscriber('s"1')
    line = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s\\"1","update":{},"_meta":{"eventId":2}}}\n'
    rest_events._last_line = (b"", [])
    assert sub._frames_of(line) == [(event.get("id"), encode_frame(event)) for event in envelopes(line)]


def test_a_subscriber_cuts_the_bridges_own_lines_without_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Updates and turn states in the bridge's layout (a completed turn's too) are cut, never decoded."""
    from acp_server.transports.http import rest_events

    def never(line: bytes) -> None:
        raise AssertionError(f"decoded: {line!r}")

    monkeypatch.setattr(rest_events, "envelopes", never)
    monkeypatch.setattr(rest_events, "_update_frames", never)
    sub = SseSubscriber("s-1")
    lines = [_turn("accepted"), _turn("running"), encode_update("s-1", 43, b'{"a":1}', "c1"), _turn("completed", ',"reason":"end_turn"')]
    got = [sub._frames_of(line) for line in lines]
    assert got[:2] == [[], []]
    assert got[2] == [(43, b'id: 43\nevent: session_update\ndata: {"v":1,"type":"session_update","data":{"sessionId":"s-1",'
                            b'"update":{"a":1}},"_meta":{"eventId":43},"id":43,"originatorClientId":"c1"}\n\n')]
    assert got[3] == [(42, b'id: 42\nevent: turn_complete\ndata: {"v":1,"type":"turn_complete","data":{"sessionId":"s-1",'
                            b'"stopReason":"end_turn","promptId":"prompt_1"},"_meta":{"eventId":42},"id":42}\n\n')]
