"""qwen serve's REST + SSE session API over a live HTTP listener: routes, statuses and bodies (each
non-2xx body validated against ``schemas/``), the event stream's envelope, replay and bounds."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.transports.http.rest_events import SseSubscriber, envelope

from .http_helpers import TIMEOUT_S, check_error_body, eventually, http_server


class Events:
    """One ``GET /session/:id/events`` stream: its parsed frames, in order."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.raw = ""
        self.changed = trio.Event()
        self.status: int | None = None

    async def run(self, client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with client.stream("GET", url, headers=headers or {}) as r:
            self.status = r.status_code
            task_status.started()
            buf = ""
            async for chunk in r.aiter_text():
                buf += chunk
                self.raw += chunk
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    fields: dict[str, str] = {}
                    for line in block.split("\n"):
                        if line.startswith(":") or ":" not in line:
                            continue
                        k, v = line.split(":", 1)
                        fields[k] = v.strip()
                    if "data" in fields:
                        frame = json.loads(fields["data"])
                        frame["_sse"] = fields
                        self.frames.append(frame)
                        self.changed.set()
                        self.changed = trio.Event()

    async def wait_for(self, type: str, count: int = 1) -> list[dict[str, Any]]:
        with trio.fail_after(10):
            while len([f for f in self.frames if f["type"] == type]) < count:
                await self.changed.wait()
        return [f for f in self.frames if f["type"] == type]


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(
        f["data"]["update"]["content"]["text"] for f in frames
        if f["type"] == "session_update" and f["data"]["update"]["sessionUpdate"] == "agent_message_chunk"
    )


async def test_capabilities_session_prompt_and_events() -> None:
    """Capabilities show the limit and workspace; a prompt's updates and its one turn_complete stream
    with ids; the 202 body names the prompt and the event id to subscribe from."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_pending_prompts_per_session=5)) as (server, _outer, url):
            async with httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
                caps = (await c.get(url + "/capabilities")).json()
                assert caps["v"] == 1 and caps["limits"]["maxPendingPromptsPerSession"] == 5
                assert caps["workspaceCwd"].startswith("/")
                r = await c.post(url + "/session", json={"cwd": "/tmp"})
                assert r.status_code == 200
                s = r.json()
                assert set(s) == {"sessionId", "workspaceCwd", "attached", "clientId", "createdAt"}
                assert s["attached"] is False and s["workspaceCwd"] == "/tmp"
                again = (await c.post(url + "/session", json={"cwd": "/tmp"})).json()
                assert again["sessionId"] == s["sessionId"] and again["attached"] is True
                thread = (await c.post(url + "/session", json={"cwd": "/tmp", "sessionScope": "thread"})).json()
                assert thread["sessionId"] != s["sessionId"]
                sid = s["sessionId"]
                ev = Events()
                await nursery.start(ev.run, c, f"{url}/session/{sid}/events")
                assert ev.status == 200
                await eventually(lambda: any(isinstance(p, SseSubscriber) for p in server.bridge.get(sid).attached))
                r = await c.post(f"{url}/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi there"}]},
                                 headers={"X-Qwen-Client-Id": s["clientId"]})
                assert r.status_code == 202, r.text
                body = r.json()
                assert body["promptId"].startswith("prompt_") and isinstance(body["lastEventId"], int)
                (done,) = await ev.wait_for("turn_complete")
                assert done["data"] == {"sessionId": sid, "stopReason": "end_turn", "promptId": body["promptId"]}
                assert text_of(ev.frames) == "hi there"
                assert ev.raw.startswith("retry: ")
                for f in ev.frames:
                    assert f["v"] == 1 and f["id"] == f["_meta"]["eventId"] == int(f["_sse"]["id"])
                    assert f["_sse"]["event"] == f["type"]
                upd = next(f for f in ev.frames if f["type"] == "session_update")
                assert upd["originatorClientId"] == s["clientId"] and set(upd["data"]) == {"sessionId", "update"}
                deep = (await c.get(url + "/health?deep=1")).json()
                assert deep["status"] == "ok" and deep["sessions"] >= 2 and deep["connectedClients"] >= 1
                nursery.cancel_scope.cancel()


async def test_replay_after_last_event_id_then_replay_complete() -> None:
    """A subscriber from a prompt's ``lastEventId`` sees the whole turn, then replay_complete; one
    from past the newest id gets state_resync_required."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_server, _outer, url), httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
            sid = (await c.post(url + "/session", json={})).json()["sessionId"]
            r = (await c.post(f"{url}/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "a b"}]})).json()
            ev0 = Events()
            nursery.start_soon(ev0.run, c, f"{url}/session/{sid}/events", {"Last-Event-ID": "0"})
            await ev0.wait_for("turn_complete")
            ev = Events()
            nursery.start_soon(ev.run, c, f"{url}/session/{sid}/events", {"Last-Event-ID": str(r["lastEventId"])})
            (done,) = await ev.wait_for("turn_complete")
            await ev.wait_for("replay_complete")
            assert done["data"]["promptId"] == r["promptId"] and text_of(ev.frames) == "a b"
            assert [f["type"] for f in ev.frames][-1] == "replay_complete"
            assert "id" not in ev.frames[-1]["_sse"]
            far = Events()
            nursery.start_soon(far.run, c, f"{url}/session/{sid}/events", {"Last-Event-ID": "999999"})
            await far.wait_for("state_resync_required")
            nursery.cancel_scope.cancel()


async def test_refusals_status_and_bodies() -> None:
    """Every refusal: its status, its ``Retry-After`` and a body that validates as its error kind."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_pending_prompts_per_session=1), EchoBackend(delay_ms=2000)) as (server, _n, url):
            async with httpx.AsyncClient(timeout=10) as c:
                ok = [{"type": "text", "text": "x"}]

                async def expect(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
                    assert r.status_code == status, (r.status_code, r.text)
                    body = check_error_body(r)
                    assert body["code"] == code
                    return body

                await expect(await c.get(url + "/nowhere"), 404, "route_not_found")
                await expect(await c.get(url + "/session"), 405, "method_not_allowed")
                await expect(await c.post(url + "/session", content=b"x", headers={"content-type": "text/plain"}),
                             415, "unsupported_media_type")
                await expect(await c.post(url + "/session", content=b"{", headers={"content-type": "application/json"}),
                             400, "parse_error")
                await expect(await c.post(url + "/session", json={"sessionScope": "x"}), 400, "invalid_params")
                sid = (await c.post(url + "/session", json={})).json()["sessionId"]
                p = f"{url}/session/{sid}/prompt"
                body = await expect(await c.post(p, json={"prompt": "nope"}), 400, "invalid_params")
                assert body["path"] == "prompt"
                # a shape error before a syntax error: the syntax is checked first
                await expect(await c.post(p, content=b'{"prompt": 5, "x": ', headers={"content-type": "application/json"}),
                             400, "parse_error")
                await expect(await c.post(p), 400, "invalid_params")  # no body: no prompt
                await expect(await c.post(p, json={"prompt": ok, "deadlineMs": -1}), 400, "invalid_params")
                await expect(await c.post(p, json={"prompt": ok}, headers={"X-Qwen-Client-Id": "bad id!"}), 400, "invalid_params")
                body = await expect(await c.post(f"{url}/session/nope/prompt", json={"prompt": ok}), 404, "session_not_found")
                assert body["sessionId"] == "nope"
                body = await expect(await c.post(p, json={"prompt": ok}, headers={"X-Qwen-Client-Id": "stale"}),
                                    400, "invalid_client_id")
                assert (body["sessionId"], body["clientId"]) == (sid, "stale")
                big = b'{"prompt":"' + b"x" * (server.limits.max_message_bytes + 1) + b'"}'
                await expect(await c.post(p, content=big, headers={"content-type": "application/json"}), 413, "message_too_large")
                await expect(await c.post(f"{url}/session/nope/detach"), 404, "session_not_found")
                await expect(await c.delete(f"{url}/session/nope"), 404, "session_not_found")
                await expect(await c.post(f"{url}/session/{sid}/permission/perm_x", json={"optionId": "a"}), 404,
                             "route_not_found")
                key = {"idempotencyKey": "k1"}
                first = await c.post(p, json={"prompt": ok, "_meta": key})
                assert first.status_code == 202
                await expect(await c.post(p, json={"prompt": [{"type": "text", "text": "other"}], "_meta": key}),
                             409, "idempotency_key_conflict")
                r = await c.post(p, json={"prompt": ok})
                body = await expect(r, 503, "prompt_queue_full")
                assert (body["limit"], body["pendingCount"]) == (1, 1)
                assert r.headers["retry-after"] == "5" and "promptId" not in body
                assert (await c.post(f"{url}/session/{sid}/cancel")).status_code == 204
                assert (await c.post(f"{url}/session/{sid}/detach")).status_code == 204
                assert (await c.delete(f"{url}/session/{sid}")).status_code == 204
                out = (await c.post(url + "/sessions/delete", json={"sessionIds": [sid, "nope"]})).json()
                assert out == {"removed": [], "notFound": [sid, "nope"]} or out["notFound"][-1] == "nope"


async def test_sessions_list_load_resume_heartbeat() -> None:
    """``GET /workspace/:cwd/sessions`` pages; load and resume give a client id and lastEventId."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, _n, url), httpx.AsyncClient(timeout=10) as c:
            sid = (await c.post(url + "/session", json={"cwd": "/srv/x"})).json()["sessionId"]
            page = (await c.get(url + "/workspace/%2Fsrv%2Fx/sessions")).json()
            assert [s["sessionId"] for s in page["sessions"]] == [sid]
            for action in ("load", "resume"):
                r = (await c.post(f"{url}/session/{sid}/{action}", json={})).json()
                assert r["sessionId"] == sid and r["clientId"].startswith("client_") and r["lastEventId"] >= 0
            assert server.bridge.self_heal_resumes == 1
            cid = r["clientId"]
            hb = await c.post(f"{url}/session/{sid}/heartbeat", headers={"X-Qwen-Client-Id": cid})
            assert hb.status_code == 200 and hb.json()["clientId"] == cid
            assert (await c.post(f"{url}/session/{sid}/detach", headers={"X-Qwen-Client-Id": cid})).status_code == 204
            assert cid not in server.bridge.get(sid).clients


def test_envelope_of_terminal_turn_states() -> None:
    """Completed and cancelled turns become turn_complete, failed ones turn_error; others are not sent."""
    def line(state: str, reason: str | None = None) -> bytes:
        params: dict[str, Any] = {"sessionId": "s", "promptId": "p", "state": state, "_meta": {"eventId": 3}}
        if reason:
            params["reason"] = reason
        return json.dumps({"jsonrpc": "2.0", "method": "_acp_server/turn_state", "params": params}).encode()

    assert envelope(line("cancelled"))["data"]["stopReason"] == "cancelled"  # type: ignore[index]
    failed = envelope(line("failed", "prompt_deadline_exceeded"))
    assert failed is not None and failed["type"] == "turn_error" and failed["data"]["code"] == "prompt_deadline_exceeded"
    assert envelope(line("running")) is None and envelope(b"not json") is None


def test_slow_subscriber_is_warned_then_evicted() -> None:
    """Past 75 % of its bound a subscriber is warned once; past the bound it gets client_evicted and ends."""
    sub = SseSubscriber("s", max_frames=8)
    for _ in range(6):
        sub.push(b"data: {}\n\n")
    assert sub.warned and not sub.closed
    for _ in range(3):
        sub.push(b"data: {}\n\n")
    assert sub.closed and sub.evicted
    assert b"client_evicted" in sub.frames[-1] and sum(b"slow_client_warning" in f for f in sub.frames) == 1


async def test_permission_requests_go_to_subscribers_and_the_first_answer_wins() -> None:
    """An agent's ``session/request_permission`` during a REST prompt is a ``permission_request`` event;
    the first ``POST .../permission/:requestId`` answers it (200 ``{}``), a second gets 404; with no
    subscriber the agent is answered ``cancelled`` at once."""
    import sys

    from .test_e2e_sdk import ServerProcess
    from .test_http_sdk import wait_http

    with ServerProcess("--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0",
                       "--", sys.executable, "-m", "tests.agents.fake_agent", "--ask-permission") as proc:
        url = wait_http(proc)
        with trio.fail_after(TIMEOUT_S):
            async with httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
                ok = [{"type": "text", "text": "please"}]
                sid = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
                r = await c.post(f"{url}/session/{sid}/prompt", json={"prompt": ok})
                # subscribe only once the turn is over: a subscriber there before the agent asks would be asked
                for _ in range(200):
                    if not (await c.get(url + "/health?deep=1")).json()["activePrompts"]:
                        break
                    await trio.sleep(0.05)
                ev0 = Events()
                nursery.start_soon(ev0.run, c, f"{url}/session/{sid}/events", {"Last-Event-ID": str(r.json()["lastEventId"])})
                (alone,) = await ev0.wait_for("turn_complete")
                assert alone["data"]["stopReason"] == "cancelled", ev0.frames  # nobody was there to ask
                ev = Events()
                await nursery.start(ev.run, c, f"{url}/session/{sid}/events")
                await trio.sleep(0.3)
                r = await c.post(f"{url}/session/{sid}/prompt", json={"prompt": ok})
                assert r.status_code == 202
                (ask,) = await ev.wait_for("permission_request")
                data = ask["data"]
                assert data["sessionId"] == sid and data["options"] and "id" not in ask
                option = data["options"][0]["optionId"]
                answer = await c.post(f"{url}/session/{sid}/permission/{data['requestId']}", json={"optionId": option})
                assert (answer.status_code, answer.json()) == (200, {})
                late = await c.post(f"{url}/session/{sid}/permission/{data['requestId']}", json={"optionId": option})
                assert late.status_code == 404 and check_error_body(late)["code"] == "route_not_found"
                (resolved,) = await ev.wait_for("permission_resolved")
                assert resolved["data"]["outcome"] == {"outcome": "selected", "optionId": option}
                (done,) = await ev.wait_for("turn_complete")
                assert done["data"]["stopReason"] == "end_turn"
                assert f"permission:{option}" in text_of(ev.frames)
                nursery.cancel_scope.cancel()


async def test_rest_prompt_watched_over_tcp_and_websocket_same_events_and_ids() -> None:
    """A session made over REST and loaded by a TCP ACP connection and a WebSocket ``/acp`` peer: a REST
    prompt's updates reach all three (REST as SSE frames) with the same event ids; the pending limit
    counts the prompts of all of them."""
    from functools import partial

    from acp_server.client.websocket import open_websocket
    from acp_server.transports import serve_tcp

    from .helpers import RawClient

    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server(Limits(max_pending_prompts_per_session=3)) as (server, outer, url):
            listeners = await outer.start(partial(serve_tcp, host="127.0.0.1"), server.handle_stream, 0)
            port = listeners[0].socket.getsockname()[1]
            async with httpx.AsyncClient(timeout=10) as c, trio.open_nursery() as nursery:
                sid = (await c.post(url + "/session", json={"cwd": "/tmp"})).json()["sessionId"]
                tcp = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
                nursery.start_soon(tcp.pump)
                await tcp.initialize()
                await tcp.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                async with open_websocket(url.replace("http://", "ws://") + "/acp") as ws_stream:
                    ws = RawClient(ws_stream)
                    nursery.start_soon(ws.pump)
                    await ws.initialize()
                    await ws.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                    ev = Events()
                    await nursery.start(ev.run, c, f"{url}/session/{sid}/events")
                    await eventually(lambda: any(isinstance(p, SseSubscriber) for p in server.bridge.get(sid).attached))
                    r = await c.post(f"{url}/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "from rest"}]})
                    assert r.status_code == 202
                    await ev.wait_for("turn_complete")
                    await eventually(lambda: tcp.agent_text(sid) == ws.agent_text(sid) == text_of(ev.frames) == "from rest")
                    rest_ids = [f["id"] for f in ev.frames if f["type"] == "session_update"]
                    for peer in (tcp, ws):
                        assert [u["_meta"]["eventId"] for u in peer.updates(sid)] == rest_ids

                    server.bridge.backend.delay_ms = 2000  # type: ignore[attr-defined]
                    async with trio.open_nursery() as inner:
                        inner.start_soon(tcp.prompt, sid, "one")
                        inner.start_soon(ws.prompt, sid, "two")
                        await eventually(lambda: server.bridge.sessions[sid].pending_count == 2)
                        ok = [{"type": "text", "text": "three"}]
                        assert (await c.post(f"{url}/session/{sid}/prompt", json={"prompt": ok})).status_code == 202
                        refusal = await c.post(f"{url}/session/{sid}/prompt", json={"prompt": ok})
                        body = check_error_body(refusal)
                        assert (refusal.status_code, body["code"], body["pendingCount"]) == (503, "prompt_queue_full", 3)
                        server.bridge.backend.delay_ms = 0  # type: ignore[attr-defined]
                        assert (await c.post(f"{url}/session/{sid}/cancel")).status_code == 204
                    await ws_stream.aclose()
                await tcp.stream.aclose()
                nursery.cancel_scope.cancel()
