"""``/acp`` over a live HTTP listener: routing, status codes in their order, the error body, browser
rules (Host, Origin, CORS), h2c, the bounds (connection cap, grace period, slow readers), and garbage.

Each test runs a real server with a real hypercorn listener on a loopback port, and speaks HTTP with
httpx (trio) or raw sockets.
"""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import httpx
import pytest
import trio

from acp_server.admission import Limits
from acp_server.client.websocket import open_websocket

from .http_helpers import INIT, TIMEOUT_S, check_error_body, eventually, http_peer, http_server


async def test_health_and_a_prompt_over_http_and_sse() -> None:
    """``GET /health``; ``initialize`` answers 200 with ``Acp-Connection-Id``; ``session/new``'s answer
    comes on the connection stream, the prompt's updates, turn states and answer on the session's."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, nursery, url), http_peer(url, nursery) as peer:
            r = await peer.client.get(url + "/health")
            assert (r.status_code, r.json()) == (200, {"status": "ok"})
            init = await peer.initialize()
            assert init["result"]["protocolVersion"] == 1 and len(peer.connection_id or "") == 32
            sid = await peer.new_session()
            answer = await peer.prompt(sid, "hello over sse")
            assert answer["result"]["stopReason"] == "end_turn"
            on_session = peer.session_streams[sid].messages
            text = "".join(
                m["params"]["update"]["content"]["text"] for m in on_session if m.get("method") == "session/update"
            )
            assert text == "hello over sse"
            assert any(m.get("method") == "_acp_server/turn_state" for m in on_session)
            assert peer.conn_stream is not None
            assert all(m.get("method") != "session/update" for m in peer.conn_stream.messages)
            assert len(server.connections) == 1


async def test_messages_for_a_session_stream_not_yet_open_wait_for_it() -> None:
    """A prompt POSTed before its session's GET (as the SDK does) is answered once the stream opens."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_server, nursery, url), http_peer(url, nursery) as peer:
            await peer.initialize()
            id, r = await peer.post("session/new", {"cwd": "/tmp", "mcpServers": []})
            assert peer.conn_stream is not None
            sid = (await peer.conn_stream.wait_for(lambda m: m.get("id") == id))["result"]["sessionId"]
            pid, r = await peer.post(
                "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "early"}]}, session_id=sid
            )
            assert r.status_code == 202
            await trio.sleep(0.2)  # the answer is in, queued for the stream nobody opened yet
            stream = await peer.open_stream(sid)
            answer = await stream.wait_for(lambda m: m.get("id") == pid)
            assert answer["result"]["stopReason"] == "end_turn"
            assert [m["method"] for m in stream.messages if m.get("method") == "session/update"]


def _raw(method: str, path: str = "/acp", **kw: Any) -> dict[str, Any]:
    return {"method": method, "path": path, **kw}


JSON = {"content-type": "application/json"}
PROMPT = {"jsonrpc": "2.0", "id": 9, "method": "session/prompt", "params": {"sessionId": "s", "prompt": []}}

# (request, status, errorKind): each later case would also fail a later check, so the order shows.
REFUSALS = [
    (_raw("GET", "/nope", headers={"host": "evil.example"}), 404, "route_not_found"),
    (_raw("PUT", headers={"host": "evil.example"}), 405, "method_not_allowed"),
    (_raw("POST", headers={"host": "evil.example", "content-type": "text/plain"}), 403, "forbidden_host"),
    (_raw("POST", headers={"origin": "http://evil.example", "content-type": "text/plain"}), 403, "forbidden_origin"),
    (_raw("POST", headers={"content-type": "text/plain"}, content=b"{"), 415, "unsupported_media_type"),
    (_raw("POST", headers=JSON, content=b"[" * 5000), 413, "message_too_large"),
    (_raw("POST", headers=JSON, content=b'{"jsonrpc": "2.0",'), 400, "parse_error"),
    (_raw("POST", headers=JSON, content=b"[{}]"), 501, "batch_not_supported"),
    (_raw("POST", headers=JSON, content=b"5"), 400, "invalid_request"),
    (_raw("POST", headers=JSON, json=PROMPT), 400, "missing_header"),
    (_raw("POST", headers={"acp-connection-id": "nope"}, json=PROMPT), 404, "unknown_connection"),
    (_raw("GET", headers={"accept": "text/html"}), 406, "not_acceptable"),
    (_raw("GET", headers={"accept": "text/event-stream"}), 400, "missing_header"),
    (_raw("GET", headers={"accept": "text/event-stream", "acp-connection-id": "x"}), 404, "unknown_connection"),
    (_raw("DELETE"), 400, "missing_header"),
]


@pytest.mark.parametrize(("request_", "status", "kind"), REFUSALS, ids=[f"{s}-{k}" for _, s, k in REFUSALS])
async def test_refusals_come_in_the_stated_order_with_one_body_shape(request_: dict[str, Any], status: int, kind: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_message_bytes=4096)) as (_s, _n, url):
            async with httpx.AsyncClient() as client:
                req = dict(request_)
                r = await client.request(req.pop("method"), url + req.pop("path"), **req)
                assert r.status_code == status, r.text
                body = check_error_body(r)
                assert body["code"] == kind
                if status == 405:
                    assert r.headers["allow"] == "GET, POST, DELETE, OPTIONS"
                if kind == "message_too_large":
                    assert body["limit"] == 4096


async def test_session_scoped_posts_need_a_session_established_here() -> None:
    """``Acp-Session-Id`` missing: 400; naming a session of another connection: 404 (the session
    exists, but not here); the same prompt with the right header: 202."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_s, nursery, url), http_peer(url, nursery) as a, http_peer(url, nursery) as b:
            await a.initialize()
            await b.initialize()
            sid = await a.new_session()
            params = {"sessionId": sid, "prompt": [{"type": "text", "text": "x"}]}
            _, r = await b.post("session/prompt", params)
            assert (r.status_code, check_error_body(r)["header"]) == (400, "Acp-Session-Id")
            _, r = await b.post("session/prompt", params, session_id=sid)
            assert (r.status_code, check_error_body(r)) == (404, r.json())
            assert r.json()["code"] == "session_not_established" and r.json()["sessionId"] == sid
            stream = await b.open_stream(sid)
            assert stream.status == 404
            _, r = await a.post("session/prompt", params, session_id=sid)
            assert r.status_code == 202


async def test_host_origin_and_cors() -> None:
    """Loopback names with the right port pass, others are 403; an allowed foreign origin gets its
    preflight answered and the connection headers exposed; our own origin passes without a list."""
    foreign = "https://editor.example"
    with trio.fail_after(TIMEOUT_S):
        async with http_server(allow_origins=frozenset({foreign})) as (_s, _n, url):
            port = int(url.rsplit(":", 1)[1])
            async with httpx.AsyncClient() as c:
                for host, ok in [
                    (f"localhost:{port}", True),
                    ("127.0.0.1", True),
                    (f"[::1]:{port}", True),
                    (f"127.0.0.1:{port + 1}", False),
                    ("attacker.example", False),
                ]:
                    r = await c.get(url + "/health", headers={"host": host})
                    assert (r.status_code == 200) is ok, (host, r.status_code)
                    if not ok:
                        assert check_error_body(r)["code"] == "forbidden_host"
                r = await c.options(
                    url + "/acp",
                    headers={
                        "origin": foreign,
                        "access-control-request-method": "POST",
                        "access-control-request-headers": "content-type, acp-connection-id",
                    },
                )
                assert r.status_code == 204
                assert r.headers["access-control-allow-origin"] == foreign
                assert "POST" in r.headers["access-control-allow-methods"]
                assert "Acp-Session-Id" in r.headers["access-control-allow-headers"]
                r = await c.post(url + "/acp", json=INIT, headers={"origin": foreign})
                assert r.status_code == 200
                assert r.headers["access-control-allow-origin"] == foreign
                assert "Acp-Connection-Id" in r.headers["access-control-expose-headers"]
                r = await c.post(url + "/acp", json=INIT, headers={"origin": f"http://localhost:{port}"})
                assert r.status_code == 200
                for origin in ("https://evil.example", f"http://localhost:{port + 1}", "null"):
                    r = await c.options(url + "/acp", headers={"origin": origin})
                    assert (r.status_code, check_error_body(r)["code"]) == (403, "forbidden_origin")
                    assert "access-control-allow-origin" not in r.headers


async def _raw_handshake(url: str, extra: str) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(
            (
                f"GET /acp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
            ).encode()
        )
        data = b""
        with trio.move_on_after(5):
            while b"}" not in data and b" 101 " not in data:
                chunk = await sock.receive_some(4096)
                if not chunk:
                    break
                data += chunk
        return data


async def test_websocket_handshakes_are_refused_before_the_upgrade() -> None:
    """A foreign Origin is 403 and the connection cap 503 with Retry-After, both as HTTP answers with
    the error body (no upgrade happens); an allowed handshake opens a peer."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(max_connections=1) as (server, _n, url):
            data = await _raw_handshake(url, "Origin: https://evil.example\r\n")
            assert data.startswith(b"HTTP/1.1 403"), data
            assert b'"code":"forbidden_origin"' in data
            async with open_websocket(url.replace("http", "ws") + "/acp") as ws:
                assert ws.connection_id and len(ws.connection_id) == 32
                data = await _raw_handshake(url, "")
                assert data.startswith(b"HTTP/1.1 503"), data
                assert b"retry-after: 1" in data.lower() and b'"code":"too_many_connections"' in data
                with pytest.raises(OSError, match="503"):
                    async with open_websocket(url.replace("http", "ws") + "/acp"):
                        pass
                await ws.send_all(json.dumps(INIT).encode() + b"\n")
                line = await ws.receive_some()
                assert json.loads(line)["result"]["protocolVersion"] == 1
            # the socket's end closes its peer like a socket's would
            await eventually(lambda: not server.connections)


async def test_the_connection_cap_answers_503_and_frees_on_delete() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server(max_connections=2) as (server, nursery, url), http_peer(url, nursery) as a:
            async with http_peer(url, nursery) as b:
                await a.initialize()
                await b.initialize()
                r = await a.client.post(a.url, json=INIT)
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                body = check_error_body(r)
                assert (body["code"], body["limit"], body["retryAfterMs"]) == ("too_many_connections", 2, 1000)
                r = await b.client.delete(b.url, headers=b.headers())
                assert r.status_code == 202
                _, r = await b.post("_acp_server/stats", {})
                assert (r.status_code, r.json()["code"]) == (404, "unknown_connection")
                r = await a.client.post(a.url, json=INIT)
                assert r.status_code == 200
                await eventually(lambda: len(server.connections) == 2)  # b's shell is gone: a and the new one


async def test_h2c_with_prior_knowledge() -> None:
    """HTTP/2 over cleartext: initialize, the event streams and a prompt, multiplexed on one connection."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_s, nursery, url), http_peer(url, nursery, http1=False, http2=True) as peer:
            r = await peer.client.get(url + "/health")
            assert r.http_version == "HTTP/2" and r.json() == {"status": "ok"}
            await peer.initialize()
            sid = await peer.new_session()
            answers = []
            async with trio.open_nursery() as inner:
                for i in range(3):
                    inner.start_soon(lambda i=i: _append(answers, peer.prompt(sid, f"h2 {i}")))
            assert [a["result"]["stopReason"] for a in answers] == ["end_turn"] * 3


async def _append(out: list[Any], awaitable: Any) -> None:
    out.append(await awaitable)


async def test_a_connection_without_streams_ends_after_the_grace_period() -> None:
    """No stream open: the connection ends after ``connection_grace_s`` (404 after); one with an open
    stream stays; a vanished SSE client (its socket closed under it) is noticed and then ends too."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(connection_grace_s=0.3) as (server, nursery, url), http_peer(url, nursery) as kept:
            async with httpx.AsyncClient() as c:
                r = await c.post(url + "/acp", json=INIT)
                idle = r.headers["acp-connection-id"]
            await kept.initialize()
            await trio.sleep(0.8)
            async with httpx.AsyncClient() as c:
                r = await c.post(url + "/acp", json={"jsonrpc": "2.0", "id": 1, "method": "_acp_server/stats"},
                                 headers={"acp-connection-id": idle})
                assert (r.status_code, r.json()["code"]) == (404, "unknown_connection")
            _, r = await kept.post("_acp_server/stats", {})
            assert r.status_code == 202
            assert len(server.connections) == 1

            # a raw SSE client that vanishes: its socket is closed without a word
            port = int(url.rsplit(":", 1)[1])
            sock = await trio.open_tcp_stream("127.0.0.1", port)
            await sock.send_all(
                f"GET /acp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n"
                f"Acp-Connection-Id: {kept.connection_id}\r\n\r\n".encode()
            )
            assert (await sock.receive_some(4096)).startswith(b"HTTP/1.1 200")
            assert kept.conn_stream is not None
            kept.conn_stream.scope.cancel()  # the well-behaved stream goes; the raw one keeps it alive
            await trio.sleep(0.6)
            assert len(server.connections) == 1
            await sock.aclose()
            await eventually(lambda: not server.connections)


GARBAGE = [
    b"\x00\xff" * 2000,
    b"GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # truncated headers, then silence
    b"POST /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"jsonrpc\"",
    b"GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00" + b"\xde\xad" * 40,  # h2 preface, broken frames
    b"GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n\x81\xfe\xff",  # truncated frame
    b"GET /%%%\xff HTTP/9.9\r\n\r\n",
]


async def test_garbage_on_the_wire_never_takes_the_listener_down() -> None:
    rng = random.Random(16)
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_s, nursery, url):
            port = int(url.rsplit(":", 1)[1])
            payloads = [*GARBAGE, *(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 3000))) for _ in range(10))]
            for payload in payloads:
                sock = await trio.open_tcp_stream("127.0.0.1", port)
                try:
                    await sock.send_all(payload)
                    with trio.move_on_after(0.1):
                        await sock.receive_some(65536)
                except (trio.BrokenResourceError, OSError):
                    pass
                finally:
                    await sock.aclose()
            async with http_peer(url, nursery) as peer:
                await peer.initialize()
                sid = await peer.new_session()
                assert (await peer.prompt(sid, "still serving"))["result"]["stopReason"] == "end_turn"


async def _small_buffer_socket(port: int) -> trio.socket.SocketType:
    """A client socket with a tiny receive buffer, so that not reading fills the server's side soon."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    return sock


async def _prompt_until_evicted(server: Any, peer: Any, sid: str) -> int:
    text = " ".join(f"word{i}" for i in range(200))
    for n in range(1, 200):
        answer = await peer.prompt(sid, text)
        assert answer["result"]["stopReason"] == "end_turn"
        if server.evictions:
            return n
    raise AssertionError("the slow reader was never evicted")


async def test_a_slow_sse_reader_is_evicted_while_another_peer_prompts() -> None:
    """A session stream whose client stops reading fills up; the connection is evicted
    (``_acp_server/evicted``, then closed) and the prompting peer never waits on it."""
    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server(Limits(max_outbound_bytes=256 * 1024)) as (server, nursery, url):
            port = int(url.rsplit(":", 1)[1])
            async with http_peer(url, nursery) as fast, http_peer(url, nursery) as slow:
                await fast.initialize()
                sid = await fast.new_session()
                await slow.initialize()
                id, r = await slow.post("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                assert slow.conn_stream is not None
                await slow.conn_stream.wait_for(lambda m: m.get("id") == id)
                raw = await _small_buffer_socket(port)
                await raw.send(
                    f"GET /acp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n"
                    f"Acp-Connection-Id: {slow.connection_id}\r\nAcp-Session-Id: {sid}\r\n\r\n".encode()
                )  # ... and never read
                try:
                    with trio.fail_after(TIMEOUT_S):
                        await _prompt_until_evicted(server, fast, sid)
                    assert server.evictions == 1
                    with trio.fail_after(5):
                        await slow.conn_stream.ended.wait()  # its connection stream ended with it
                    _, r = await slow.post("_acp_server/stats", {})
                    assert r.status_code == 404
                    assert (await fast.prompt(sid, "after"))["result"]["stopReason"] == "end_turn"
                finally:
                    raw.close()


async def test_a_slow_websocket_reader_is_evicted_while_another_peer_prompts() -> None:
    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server(Limits(max_outbound_bytes=256 * 1024)) as (server, nursery, url):
            port = int(url.rsplit(":", 1)[1])
            async with http_peer(url, nursery) as fast:
                await fast.initialize()
                sid = await fast.new_session()
                raw = await _small_buffer_socket(port)
                try:
                    await raw.send(
                        f"GET /acp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
                    )
                    assert (await raw.recv(4096)).startswith(b"HTTP/1.1 101")
                    from wsproto.frame_protocol import FrameProtocol

                    proto = FrameProtocol(client=True, extensions=[])
                    for message in (
                        INIT,
                        {"jsonrpc": "2.0", "id": 1, "method": "session/load",
                         "params": {"sessionId": sid, "cwd": "/tmp", "mcpServers": []}},
                    ):
                        await raw.send(proto.send_data(json.dumps(message), fin=True))
                    await trio.sleep(0.3)  # loaded and attached; from now on it never reads
                    with trio.fail_after(TIMEOUT_S):
                        await _prompt_until_evicted(server, fast, sid)
                    assert server.evictions == 1
                    assert (await fast.prompt(sid, "after"))["result"]["stopReason"] == "end_turn"
                finally:
                    raw.close()


async def test_a_unix_socket_listener(tmp_path: Any) -> None:
    """``--http-listen unix:/path``: mode 0600, any port in ``Host`` (there is none), ACP served."""
    import os
    import stat

    from acp_server.server import ListenAddress
    from acp_server.transports.http import HttpOptions, serve_http

    from .helpers import running_server

    path = str(tmp_path / "h.sock")
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            url = await nursery.start(serve_http, server.handle_stream, ListenAddress("unix", path=path), HttpOptions())
            assert url == f"unix:{path}"
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            transport = httpx.AsyncHTTPTransport(uds=path)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                assert (await c.get("/health")).json() == {"status": "ok"}
                r = await c.post("/acp", json=INIT)
                assert r.status_code == 200 and r.headers["acp-connection-id"]
            nursery.cancel_scope.cancel()
