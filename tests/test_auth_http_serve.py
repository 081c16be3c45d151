"""``acp-server serve`` with tokens on its HTTP listener, as a process: tenant A's token cannot touch
tenant B's session over TCP, HTTP ``/acp``, WebSocket ``/acp`` or REST/SSE while an admin can; the
metrics endpoint asks for a scope; SIGHUP revocation evicts WebSocket peers, ``/acp`` connections and
SSE subscribers, whose prompts still end once; no secret is ever in a log, an audit line or an answer."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Message, RejectConnection, TextMessage
from wsproto.events import Request as WsRequest

from acp_server.auth.http_rules import bearer_subprotocol
from acp_server.auth.tokens import TokenRecord, hash_secret, new_secret, write_tokens
from acp_server.client import connect
from acp_server.client.errors import RpcError
from acp_server.client.websocket import open_websocket

from .test_e2e_sdk import ServerProcess
from .test_http_rest import Events
from .test_http_sdk import wait_http

TIMEOUT_S = 60


def _record(token_id: str, secret: str, tenant: str, *scopes: str) -> TokenRecord:
    return TokenRecord(token_id, bytes.fromhex(hash_secret(secret)), tenant, frozenset(scopes))


@dataclass
class Served:
    proc: ServerProcess
    tcp: str
    http: str
    metrics: str
    tokens: str
    audit: str
    workspace: str
    secrets: dict[str, str]
    records: list[TokenRecord]
    #: every answer body and error text the tests saw (searched for secrets at the end)
    seen: list[str] = field(default_factory=list)

    @property
    def ws(self) -> str:
        return "ws" + self.http.removeprefix("http") + "/acp"

    def auth(self, name: str, **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secrets[name]}", **extra}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("auth-http")
    names = {"acme": ("acme",), "beta": ("beta",), "root": ("ops", "admin"), "scraper": ("ops", "metrics"),
             "temp": ("acme",)}
    secrets = {name: new_secret() for name in names}
    records = [_record(name, secrets[name], tenant, *scopes) for name, (tenant, *scopes) in names.items()]
    tokens = str(tmp / "tokens.toml")
    write_tokens(tokens, records)
    audit = str(tmp / "audit.log")
    workspace = tmp / "beta-workspace"
    workspace.mkdir()
    proc = ServerProcess(
        "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0", "--metrics-listen", "tcp://127.0.0.1:0",
        "--ephemeral", "--echo-delay-ms", "1200", "--auth-tokens", tokens, "--audit-log", audit, "--log-level", "info",
    )
    try:
        (tcp,) = proc.wait_listening(1)
        http = wait_http(proc)
        metrics = next(line for line in proc.stderr_lines if "metrics on " in line).split(" on ", 1)[1]
        out = Served(proc, tcp, http, metrics, tokens, audit, str(workspace), secrets, records)
        yield out
    finally:
        proc.stop()
    text = "\n".join([*proc.rest_of_stderr(), *proc.stderr_lines, pathlib.Path(audit).read_text(), *out.seen])
    for secret in secrets.values():
        assert secret not in text, "a secret reached a log, an audit line or an answer"


async def _beta_session(s: Served, c: httpx.AsyncClient) -> str:
    r = await c.post(f"{s.http}/session", json={"cwd": s.workspace, "sessionScope": "thread"}, headers=s.auth("beta"))
    assert r.status_code == 200, r.text
    session_id: str = r.json()["sessionId"]
    return session_id


def _audit(s: Served) -> list[dict[str, Any]]:
    with open(s.audit) as f:
        return [json.loads(line) for line in f]


def _clean(s: Served, text: str) -> None:
    """An error seen by tenant acme: nothing in it about tenant beta or its workspace."""
    s.seen.append(text)
    assert "beta" not in text, text


@pytest.mark.parametrize("transport", ["tcp", "http", "ws"])
async def test_tenant_a_cannot_touch_tenant_b_over_acp_while_admin_can(served: Served, transport: str) -> None:
    """Over each ACP transport acme's token cannot list, load, resume, prompt, close, delete or cancel
    beta's session (``session_not_found``, nothing about beta), nor name tenant beta at ``initialize``;
    an admin token naming beta sees and resumes it."""
    s = served
    url = {"tcp": s.tcp, "http": s.http + "/acp", "ws": s.ws}[transport]
    with trio.fail_after(TIMEOUT_S):
        async with httpx.AsyncClient(timeout=20) as c, trio.open_nursery() as nursery:
            sid = await _beta_session(s, c)
            watch = Events()
            await nursery.start(watch.run, c, f"{s.http}/session/{sid}/events", s.auth("beta"))
            r = await c.post(f"{s.http}/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi"}]},
                             headers=s.auth("beta"))
            assert r.status_code == 202
            async with connect(url, token=s.secrets["acme"]) as acme:
                listed = await acme.request("session/list", {})
                assert sid not in json.dumps(listed)
                for method in ("session/load", "session/resume", "session/prompt", "session/close", "session/delete"):
                    params: dict[str, Any] = {"sessionId": sid}
                    if method in ("session/load", "session/resume"):
                        params.update(cwd=s.workspace, mcpServers=[])
                    if method == "session/prompt":
                        params["prompt"] = [{"type": "text", "text": "x"}]
                    with pytest.raises(RpcError) as info:
                        await acme.request(method, params)
                    kind = info.value.data.get("errorKind")
                    # over HTTP a session-scoped POST for a session not on the connection is refused first
                    assert kind == "session_not_found" or (transport == "http" and kind == "session_not_established"), (
                        method, info.value.data)
                    _clean(s, json.dumps([info.value.message, info.value.data]))
                acme.notify("session/cancel", {"sessionId": sid})
                await acme.request("session/list", {})  # the cancel has been read before this answer
            with pytest.raises(RpcError) as refused:
                async with connect(url, token=s.secrets["acme"], tenant_id="beta"):
                    pass
            assert refused.value.data.get("errorKind") == "invalid_params"
            _clean(s, str(refused.value.data.get("path")))
            async with connect(url, token=s.secrets["root"], tenant_id="beta") as admin:
                listed = await admin.request("session/list", {})
                assert sid in json.dumps(listed)
                resumed = await admin.request("session/resume", {"sessionId": sid, "cwd": s.workspace, "mcpServers": []})
                assert resumed is not None
            (done,) = await watch.wait_for("turn_complete")
            assert done["data"]["stopReason"] == "end_turn"  # acme's cancel did not reach it
            nursery.cancel_scope.cancel()
    acts = _audit(s)
    assert any(a["event"] == "admin_act" and a["tokenId"] == "root" and a.get("tenant") == "beta" for a in acts)


async def test_tenant_a_cannot_touch_tenant_b_over_rest_and_sse_while_admin_can(served: Served) -> None:
    """Every REST route and the SSE stream of beta's session are 404 ``session_not_found`` for acme
    (a permission answer too: the session is checked before the question); listing and
    ``sessionScope: single`` do not reach it; ``X-Acp-Tenant: beta`` with the admin token does."""
    s = served
    with trio.fail_after(TIMEOUT_S):
        async with httpx.AsyncClient(timeout=20) as c:
            sid = await _beta_session(s, c)
            acme = s.auth("acme")
            attempts = [
                ("POST", f"/session/{sid}/load", {}), ("POST", f"/session/{sid}/resume", {}),
                ("POST", f"/session/{sid}/heartbeat", None), ("POST", f"/session/{sid}/detach", None),
                ("POST", f"/session/{sid}/cancel", None),
                ("POST", f"/session/{sid}/prompt", {"prompt": [{"type": "text", "text": "x"}]}),
                ("POST", f"/session/{sid}/permission/perm_0123456789abcdef", {"optionId": "allow"}),
                ("GET", f"/session/{sid}/events", None), ("DELETE", f"/session/{sid}", None),
            ]
            for method, path, body in attempts:
                r = await c.request(method, s.http + path, json=body, headers=acme)
                assert r.status_code == 404 and r.json()["code"] == "session_not_found", (path, r.text)
                _clean(s, r.text)
            r = await c.post(f"{s.http}/sessions/delete", json={"sessionIds": [sid]}, headers=acme)
            assert r.json() == {"removed": [], "notFound": [sid]}
            listing = f"{s.http}/workspace/{quote(s.workspace, safe='')}/sessions"
            r = await c.get(listing, headers=acme)
            assert r.status_code == 200 and sid not in r.text
            r = await c.post(f"{s.http}/session", json={"cwd": s.workspace}, headers=acme)
            assert r.status_code == 200 and r.json()["sessionId"] != sid  # single scope: acme's own session
            admin = s.auth("root", **{"x-acp-tenant": "beta"})
            r = await c.get(listing, headers=admin)
            assert r.status_code == 200 and sid in r.text
            assert (await c.post(f"{s.http}/session/{sid}/heartbeat", headers=admin)).status_code == 200
            async with c.stream("GET", f"{s.http}/session/{sid}/events", headers=admin) as stream:
                assert stream.status_code == 200
            r = await c.get(listing, headers=s.auth("acme", **{"x-acp-tenant": "beta"}))
            assert r.status_code == 400 and r.json()["code"] == "invalid_params"
            # the beta owner still has it, untouched
            r = await c.post(f"{s.http}/session/{sid}/heartbeat", headers=s.auth("beta"))
            assert r.status_code == 200


async def _browser_handshake(s: Served, protocols: list[str]) -> tuple[Any, trio.SocketStream, WSConnection]:
    """A WebSocket handshake offering ``protocols`` (as a browser's, with no Authorization header)."""
    host, port = s.http.removeprefix("http://").rsplit(":", 1)
    sock = await trio.open_tcp_stream(host, int(port))
    ws = WSConnection(ConnectionType.CLIENT)
    await sock.send_all(ws.send(WsRequest(host=f"{host}:{port}", target="/acp", subprotocols=protocols)))
    while True:
        data = await sock.receive_some(65536)
        assert data, "closed during the handshake"
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, (AcceptConnection, RejectConnection)):
                return event, sock, ws


async def test_a_browser_websocket_proves_its_token_with_the_bearer_subprotocol(served: Served) -> None:
    """``acp.v1`` + ``acp-bearer.<base64url>``: accepted with ``acp.v1`` alone as the answer, the
    connection acts for the token's tenant; a wrong secret in the subprotocol is the one 401."""
    s = served
    with trio.fail_after(20):
        event, sock, ws = await _browser_handshake(s, ["acp.v1", bearer_subprotocol(s.secrets["acme"])])
        assert isinstance(event, AcceptConnection) and event.subprotocol == "acp.v1"
        line = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
        await sock.send_all(ws.send(Message(data=json.dumps(line))))
        frames: list[str] = []
        while not frames:  # one JSON-RPC message a text frame
            ws.receive_data(await sock.receive_some(65536))
            frames += [e.data for e in ws.events() if isinstance(e, TextMessage)]
        init = json.loads(frames[0])
        assert init["id"] == 1 and "result" in init
        assert all(m["id"] != "acp-server-token" for m in init["result"].get("authMethods", []))  # proved already
        line = {"jsonrpc": "2.0", "id": 2, "method": "session/list", "params": {}}
        await sock.send_all(ws.send(Message(data=json.dumps(line))))
        frames = []
        while not frames:
            ws.receive_data(await sock.receive_some(65536))
            frames += [e.data for e in ws.events() if isinstance(e, TextMessage)]
        listed = json.loads(frames[0])
        assert listed["id"] == 2 and "result" in listed, listed  # no authenticate needed
        await sock.aclose()
        event, sock, _ = await _browser_handshake(s, ["acp.v1", bearer_subprotocol("not-the-secret")])
        assert isinstance(event, RejectConnection) and event.status_code == 401
        await sock.aclose()


async def test_the_metrics_endpoint_and_the_listener_share_the_one_401_and_ask_a_scope(served: Served) -> None:
    s = served
    async with httpx.AsyncClient(timeout=20) as c:
        missing = await c.get(s.metrics)
        wrong = await c.get(s.metrics, headers={"authorization": "Bearer nope"})
        listener = await c.get(f"{s.http}/capabilities")
        ws = await c.get(s.http + "/acp", headers={"connection": "Upgrade", "upgrade": "websocket",
                                                   "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert {missing.status_code, wrong.status_code, listener.status_code, ws.status_code} == {401}
        assert missing.content == wrong.content == listener.content == ws.content
        assert missing.headers["www-authenticate"].startswith("Bearer")
        r = await c.get(s.metrics, headers=s.auth("acme"))
        assert r.status_code == 403 and r.json()["code"] == "insufficient_scope"
        for name in ("scraper", "root"):
            r = await c.get(s.metrics, headers=s.auth(name))
            assert r.status_code == 200 and "acp_server_" in r.text
        assert (await c.get(f"{s.http}/health")).json() == {"status": "ok"}
        s.seen += [missing.text, r.text]


async def test_hostile_credentials_on_the_wire_leave_the_listener_serving(served: Served) -> None:
    """Raw requests with broken credentials (bytes outside ASCII, huge, repeated, a subprotocol that is
    not base64): each one answered or closed alone; the listener keeps serving."""
    s = served
    host, port = s.http.removeprefix("http://").rsplit(":", 1)
    heads = [
        b"Authorization: Bearer \xff\xfe\r\n",
        b"Authorization: Bearer " + b"A" * 20000 + b"\r\n",
        b"Authorization: \r\nAuthorization: Bearer x\r\n",
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: acp.v1, acp-bearer.%%%\r\n",
        b"Authorization: Bearer " + s.secrets["temp"].encode()[:-1] + b"\x00\r\n",
    ]

    def probe(extra: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + b"\r\n")
            try:
                return sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return b""

    for extra in heads:
        answer = await trio.to_thread.run_sync(probe, extra)
        assert answer == b"" or answer.split(b" ", 2)[1] in (b"400", b"401", b"431"), answer[:200]
        s.seen.append(answer.decode("latin-1"))
    async with httpx.AsyncClient(timeout=20) as c:
        assert (await c.get(f"{s.http}/capabilities", headers=s.auth("acme"))).status_code == 200


async def _read_until(ws: Any, predicate: Any, seen: list[dict[str, Any]]) -> dict[str, Any]:
    buf = b""
    while True:
        data = await ws.receive_some(65536)
        if not data:
            raise AssertionError(f"the WebSocket ended; seen {seen}")
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            seen.append(msg)
            if predicate(msg):
                return dict(msg)


async def test_revoking_a_token_evicts_its_websocket_acp_and_sse_peers_within_a_second(served: Served) -> None:
    """SIGHUP after the token ``temp`` left the file: its WebSocket peer gets ``_acp_server/evicted``
    (``token_revoked``) and closes, its ``/acp`` connection ends, its SSE subscriber gets
    ``client_evicted`` and ends, each within a second; their running prompts end exactly once (seen
    by another token's subscriber); the next request with it is 401; the audit log says so."""
    s = served
    temp = s.auth("temp")
    text = [{"type": "text", "text": "slow"}]
    with trio.fail_after(TIMEOUT_S):
        async with httpx.AsyncClient(timeout=20) as c, trio.open_nursery() as nursery:
            # a WebSocket peer with a prompt running
            ws_seen: list[dict[str, Any]] = []
            async with open_websocket(s.ws, token=s.secrets["temp"]) as ws:
                async def call(id: int, method: str, params: Any) -> dict[str, Any]:
                    await ws.send_all(json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode() + b"\n")
                    return await _read_until(ws, lambda m: m.get("id") == id, ws_seen)

                await call(1, "initialize", {"protocolVersion": 1, "clientCapabilities": {}})
                ws_sid = (await call(2, "session/new", {"cwd": s.workspace, "mcpServers": []}))["result"]["sessionId"]
                # a REST session of tenant acme with temp's SSE subscriber and a prompt running
                r = await c.post(f"{s.http}/session", json={"cwd": s.workspace, "sessionScope": "thread"}, headers=temp)
                rest_sid = r.json()["sessionId"]
                temp_events, ws_watch, rest_watch = Events(), Events(), Events()
                await nursery.start(temp_events.run, c, f"{s.http}/session/{rest_sid}/events", temp)
                await nursery.start(ws_watch.run, c, f"{s.http}/session/{ws_sid}/events", s.auth("acme"))
                await nursery.start(rest_watch.run, c, f"{s.http}/session/{rest_sid}/events", s.auth("acme"))
                await ws.send_all(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                                              "params": {"sessionId": ws_sid, "prompt": text}}).encode() + b"\n")
                r = await c.post(f"{s.http}/session/{rest_sid}/prompt", json={"prompt": text}, headers=temp)
                assert r.status_code == 202
                # an /acp connection over HTTP with a prompt running
                async with connect(s.http + "/acp", token=s.secrets["temp"]) as over_http:
                    http_sid = (await over_http.request("session/new", {"cwd": s.workspace, "mcpServers": []}))["sessionId"]
                    http_watch = Events()
                    await nursery.start(http_watch.run, c, f"{s.http}/session/{http_sid}/events", s.auth("acme"))
                    outcome: list[Any] = []
                    answered = trio.Event()

                    async def http_prompt() -> None:
                        try:
                            outcome.append(await over_http.request("session/prompt", {"sessionId": http_sid, "prompt": text}))
                        except Exception as exc:  # the connection is evicted under it
                            outcome.append(exc)
                        answered.set()

                    nursery.start_soon(http_prompt)
                    await ws_watch.wait_for("session_update")
                    await rest_watch.wait_for("session_update")
                    await http_watch.wait_for("session_update")
                    write_tokens(s.tokens, [r for r in s.records if r.id != "temp"])
                    began = time.monotonic()
                    s.proc.proc.send_signal(signal.SIGHUP)
                    note = await _read_until(ws, lambda m: m.get("method") == "_acp_server/evicted", ws_seen)
                    ws_evicted = time.monotonic() - began
                    assert note["params"] == {"reason": "token_revoked"}
                    (evicted,) = await temp_events.wait_for("client_evicted")
                    sse_evicted = time.monotonic() - began
                    assert evicted["data"] == {"sessionId": rest_sid, "reason": "token_revoked"}
                    with trio.fail_after(5):
                        await answered.wait()
                    http_evicted = time.monotonic() - began
                    with trio.fail_after(5):
                        while await ws.receive_some(65536):
                            pass  # the server closes the socket after the notice
            assert max(ws_evicted, sse_evicted, http_evicted) < 1.0 + 1.0, (ws_evicted, sse_evicted, http_evicted)
            for watch in (ws_watch, rest_watch, http_watch):  # each prompt ends once, for those still watching
                await watch.wait_for("turn_complete")
                await trio.sleep(0.3)
                ends = [f for f in watch.frames if f["type"] in ("turn_complete", "turn_error")]
                assert len(ends) == 1, watch.frames
            r = await c.get(f"{s.http}/capabilities", headers=temp)
            assert r.status_code == 401
            with pytest.raises(OSError, match="401"):
                async with open_websocket(s.ws, token=s.secrets["temp"]):
                    pass
            s.seen += [json.dumps(ws_seen), temp_events.raw, r.text]
            nursery.cancel_scope.cancel()
    revoked = [a for a in _audit(s) if a["event"] == "token_revoked"]
    assert revoked and revoked[-1]["tokenId"] == "temp" and revoked[-1]["evicted"] == 3  # the WebSocket, the /acp connection, the SSE stream


if sys.platform == "win32":  # pragma: no cover - SIGHUP
    pytestmark = pytest.mark.skip("POSIX signals")


def _relay(url: str, lines: list[dict[str, Any]], env: dict[str, str], wait_for: int) -> tuple[list[dict[str, Any]], str]:
    """``acp-server connect URL``: send ``lines``, read answers until the one with id ``wait_for`` (or
    the end), then close stdin and wait for the relay to end; the answers and stderr."""
    answers: list[dict[str, Any]] = []
    with subprocess.Popen([sys.executable, "-m", "acp_server", "connect", url], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write("".join(json.dumps(line) + "\n" for line in lines))
            proc.stdin.flush()
            for raw in proc.stdout:
                answers.append(json.loads(raw))
                if answers[-1].get("id") == wait_for:
                    break
            proc.stdin.close()
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        stderr = proc.stderr.read()
        assert proc.returncode == 0, (answers, stderr)
    return answers, stderr


def test_connect_relays_over_http_with_its_token_as_the_bearer(served: Served) -> None:
    """``acp-server connect http://.../acp`` with ``ACP_SERVER_TOKEN``: the bearer rides every request,
    so the session is created for the token's tenant; without the token ``initialize`` is refused."""
    s = served
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
        {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": s.workspace, "mcpServers": []}},
    ]
    env = {**os.environ, "ACP_SERVER_TOKEN": s.secrets["acme"]}
    answers, stderr = _relay(s.http + "/acp", lines, env, 2)
    s.seen += [json.dumps(answers), stderr]
    by_id = {m.get("id"): m for m in answers}
    assert "result" in by_id[1] and by_id[2]["result"]["sessionId"].startswith("sess_"), (answers, stderr)
    env.pop("ACP_SERVER_TOKEN")
    answers, stderr = _relay(s.http + "/acp", lines[:1], env, 1)
    s.seen += [json.dumps(answers), stderr]
    assert answers and answers[0]["error"]["data"]["errorKind"] == "unauthorized", (answers, stderr)
