"""Tokens on NDJSON connections: ``initialize`` offers ``acp-server-token``, nothing but ``initialize`` and
``authenticate`` works before it, every failure is the same ``auth_required``, the token's tenant binds
the connection, scopes guard stats, rates and failed attempts are limited, and owners skip it all."""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_server import server as server_mod
from acp_server.auth import AuditLog, TokenRecord, TokenStore, hash_secret
from acp_server.auth.gate import Authenticator, PeerInfo
from acp_server.handlers import ConnContext
from acp_server.handlers.gate import evict_revoked, reload_credentials
from acp_server.jsonrpc.connection import EncodedError, Request
from acp_server.server import Server
from acp_server.transports import serve_unix

from .helpers import RawClient, RpcError, assert_error_valid, connect

ACME = "acme-secret-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
BETA = "beta-secret-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
ROOT = "root-secret-rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"
SCRAPER = "scrape-secret-sssssssssssssssssssssssssssssss"
OLD = "old-secret-oooooooooooooooooooooooooooooooooooo"


def _store() -> TokenStore:
    def rec(token_id: str, secret: str, tenant: str, *scopes: str, expires: datetime | None = None) -> TokenRecord:
        return TokenRecord(token_id, bytes.fromhex(hash_secret(secret)), tenant, frozenset(scopes), expires)

    return TokenStore(
        {
            "acme": rec("acme", ACME, "acme"),
            "beta": rec("beta", BETA, "beta"),
            "root": rec("root", ROOT, "ops", "admin"),
            "scraper": rec("scraper", SCRAPER, "ops", "metrics"),
            "old": rec("old", OLD, "acme", expires=datetime(2020, 1, 1, tzinfo=UTC)),
        }
    )


@asynccontextmanager
async def _server(rps: float | None = None) -> AsyncIterator[tuple[Server, trio.Nursery, io.StringIO]]:
    audit = io.StringIO()
    server = Server(auth=Authenticator(_store(), audit=AuditLog(stream=audit), rate_limit_rps=rps))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        yield server, nursery, audit
        nursery.cancel_scope.cancel()


async def _login(client: RawClient, secret: object, **init_meta: Any) -> Any:
    params: dict[str, Any] = {"protocolVersion": 1, "clientCapabilities": {}}
    if init_meta:
        params["_meta"] = init_meta
    await client.call("initialize", params)
    return await client.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": secret}})


def _without_id(error: dict[str, Any]) -> str:
    return json.dumps(error, sort_keys=True)


async def test_initialize_offers_the_token_method_and_nothing_else_works_before_it() -> None:
    async with _server() as (server, nursery, _):
        client = await connect(server, nursery, initialize=False)
        result = await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        assert result["authMethods"][0]["id"] == "acp-server-token"
        for method, params in (
            ("session/new", {"cwd": "/tmp", "mcpServers": []}),
            ("session/list", {}),
            ("_acp_server/stats", None),
            ("logout", None),
            ("authenticate", {"methodId": "some-agent-method"}),
        ):
            with pytest.raises(RpcError) as info:
                await client.call(method, params)
            assert info.value.code == -32000 and info.value.kind == "auth_required"
            assert info.value.data["methodId"] == "acp-server-token" and "backendId" not in info.value.data
            assert "authenticate" in info.value.data["detail"]


async def test_every_failed_authenticate_is_the_same_error_and_the_connection_stays_open() -> None:
    async with _server() as (server, nursery, audit):
        client = await connect(server, nursery)
        errors = []
        for meta in ({}, {"token": None}, {"token": 42}, {"token": ""}, {"token": "wrong"}, {"token": OLD},
                     {"token": ACME + "x"}, {"token": "x" * 5000}):
            resp = await client.call_raw("authenticate", {"methodId": "acp-server-token", "_meta": meta})
            errors.append(resp["error"])
        assert len({_without_id(e) for e in errors}) == 1
        assert errors[0]["data"] == {
            "errorKind": "auth_required",
            "methodId": "acp-server-token",
            "detail": errors[0]["data"]["detail"],
        }
        resp = await client.call_raw("authenticate", {"methodId": "acp-server-token"})  # no _meta at all
        assert _without_id(resp["error"]) == _without_id(errors[0])
        assert await client.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ACME}}) == {}
        session_id, _ = await client.new_session()
        assert session_id
        lines = [json.loads(line) for line in audit.getvalue().splitlines()]
        assert [line["event"] for line in lines].count("auth_failed") == 9
        assert {line["reason"] for line in lines if line["event"] == "auth_failed"} == {
            "missing", "malformed", "unknown_or_expired"
        }
        assert lines[-1]["event"] == "auth_ok" and lines[-1]["tokenId"] == "acme" and lines[-1]["transport"] == "stream"
        for secret in (ACME, OLD):
            assert secret not in audit.getvalue()


async def test_the_token_binds_the_tenant() -> None:
    async with _server() as (server, nursery, audit):
        acme = await connect(server, nursery, initialize=False)
        await _login(acme, ACME)
        session_id, _ = await acme.new_session()
        beta = await connect(server, nursery, initialize=False)
        await _login(beta, BETA)
        listed = await beta.call("session/list", {})
        assert session_id not in json.dumps(listed)
        with pytest.raises(RpcError) as info:
            await beta.call("session/load", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
        assert info.value.kind == "session_not_found"
        assert session_id in json.dumps(await acme.call("session/list", {}))
        for method, params in (
            ("session/resume", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []}),
            ("session/prompt", {"sessionId": session_id, "prompt": [{"type": "text", "text": "x"}]}),
            ("session/close", {"sessionId": session_id}),
            ("session/delete", {"sessionId": session_id}),
            ("_acp_server/heartbeat", {"sessionId": session_id}),
            ("_acp_server/fork", {"sessionId": session_id}),
        ):
            with pytest.raises(RpcError) as info:
                await beta.call(method, params)
            assert info.value.kind == "session_not_found", method
            assert "acme" not in json.dumps(info.value.error)
        await acme.prompt(session_id)  # untouched by all that
        # a client claiming another tenant is refused at authenticate
        liar = await connect(server, nursery, initialize=False)
        with pytest.raises(RpcError) as info:
            await _login(liar, BETA, tenantId="acme")
        assert info.value.kind == "invalid_params" and info.value.data["path"] == "_meta.tenantId"
        with pytest.raises(RpcError):
            await liar.call("session/list", {})
        # naming its own tenant is fine
        own = await connect(server, nursery, initialize=False)
        await _login(own, BETA, tenantId="beta")
        # an admin token may act for any tenant
        admin = await connect(server, nursery, initialize=False)
        await _login(admin, ROOT, tenantId="acme")
        assert session_id in json.dumps(await admin.call("session/list", {}))
        events = [json.loads(line) for line in audit.getvalue().splitlines()]
        assert {"event": "admin_act", "tokenId": "root", "action": "act_for_tenant", "tenant": "acme"}.items() <= next(
            e for e in events if e["event"] == "admin_act"
        ).items()
        # re-initialize without a tenant keeps the token's
        await own.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        assert session_id not in json.dumps(await own.call("session/list", {}))


async def test_stats_need_the_admin_or_metrics_scope() -> None:
    async with _server() as (server, nursery, _):
        plain = await connect(server, nursery, initialize=False)
        await _login(plain, ACME)
        with pytest.raises(RpcError) as info:
            await plain.call("_acp_server/stats")
        assert info.value.kind == "auth_required" and "admin or metrics scope" in info.value.data["detail"]
        for secret in (ROOT, SCRAPER):
            client = await connect(server, nursery, initialize=False)
            await _login(client, secret)
            assert "bridge" in await client.call("_acp_server/stats")


async def test_the_request_rate_per_token() -> None:
    async with _server(rps=1) as (server, nursery, _):
        client = await connect(server, nursery, initialize=False)
        await _login(client, ACME)
        other = await connect(server, nursery, initialize=False)
        await _login(other, BETA)
        await client.call("session/list", {})
        await client.call("session/list", {})  # the burst is 2 x 1
        with pytest.raises(RpcError) as info:
            await client.call("session/list", {})
        assert info.value.code == -32014 and info.value.kind == "rate_limited"
        assert info.value.data["reason"] == "request_rate" and 0 < info.value.data["retryAfterMs"] <= 1000
        await other.call("session/list", {})  # another token has its own bucket
        # a second connection of the same token shares the bucket
        again = await connect(server, nursery, initialize=False)
        await _login(again, ACME)
        with pytest.raises(RpcError):
            await again.call("session/list", {})


async def test_the_11th_failure_a_minute_from_one_address_is_refused_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "describe_stream", lambda stream: PeerInfo("tcp", "203.0.113.5"))
    async with _server() as (server, nursery, audit):
        client = await connect(server, nursery)
        for _ in range(10):
            resp = await client.call_raw("authenticate", {"methodId": "acp-server-token", "_meta": {"token": "bad"}})
            assert resp["error"]["data"]["errorKind"] == "auth_required"
        with pytest.raises(RpcError) as info:
            await client.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ACME}})
        assert info.value.kind == "rate_limited" and info.value.data["reason"] == "auth_failures"
        assert 0 < info.value.data["retryAfterMs"] <= 60_000
        assert json.loads(audit.getvalue().splitlines()[-1])["event"] == "auth_refused"
        assert '"auth_ok"' not in audit.getvalue()


async def test_unix_sockets_and_stdio_are_the_owners() -> None:
    async with _server() as (server, nursery, _):
        path = os.path.join(tempfile.mkdtemp(prefix="acp-auth-"), "s.sock")
        await nursery.start(serve_unix, server.handle_stream, path)
        stream = await trio.open_unix_socket(path)
        client = RawClient(stream)
        nursery.start_soon(client.pump)
        result = await client.initialize()
        assert all(m.get("id") != "acp-server-token" for m in result.get("authMethods", []))
        await client.new_session()
        assert "bridge" in await client.call("_acp_server/stats")
        await stream.aclose()


async def test_without_tokens_nothing_changes() -> None:
    server = Server()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        client = await connect(server, nursery)
        await client.new_session()
        assert await client.call("authenticate", {"methodId": "acp-server-token"}) == {}
        nursery.cancel_scope.cancel()


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=50)  # JSON text is valid UTF-8
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=10,
)
_SERVER = Server(auth=Authenticator(_store(), audit=AuditLog(stream=io.StringIO())))


@settings(max_examples=300, deadline=None)
@given(
    params=st.one_of(
        _json,
        st.fixed_dictionaries(
            {"methodId": st.sampled_from(["acp-server-token", "other"]) | _json},
            optional={"_meta": st.fixed_dictionaries({}, optional={"token": _json | st.sampled_from([ACME, OLD])}) | _json},
        ),
    ),
    tenant=st.none() | _text,
    source=st.sampled_from(["127.0.0.1", "198.51.100.1"]),  # loopback is never limited: both outcomes
)
def test_fuzz_authenticate_params_only_documented_errors(params: Any, tenant: str | None, source: str) -> None:
    ctx = ConnContext(_SERVER, None)  # type: ignore[arg-type]
    ctx.initialized = True
    ctx.identity = None
    ctx.peer_info = PeerInfo("tcp", source)
    ctx.tenant_named = tenant
    out = _SERVER.dispatcher.call(ctx, Request(1, "authenticate", msgspec.Raw(json.dumps(params).encode())))
    assert isinstance(out, bytes)
    message = json.loads(out)
    if isinstance(out, EncodedError):
        assert_error_valid(message["error"])
        assert message["error"]["data"]["errorKind"] in ("auth_required", "invalid_params", "rate_limited")
    else:
        assert message["result"] == {} and ctx.identity is not None
    for secret in (ACME, OLD):
        assert secret not in out.decode()


async def test_revocation_while_a_prompt_runs_evicts_once_and_the_prompt_settles_once(tmp_path: Any) -> None:
    from acp_server.auth.tokens import write_tokens
    from acp_server.backends import EchoBackend

    path = str(tmp_path / "tokens.toml")
    store = _store()
    write_tokens(path, [r for i in store.ids() if (r := store.get(i)) is not None])
    audit = io.StringIO()
    auth = Authenticator(TokenStore.from_file(path), audit=AuditLog(stream=audit))
    server = Server(backend=EchoBackend(delay_ms=400), auth=auth)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        client = await connect(server, nursery, initialize=False)
        await _login(client, ACME)
        bystander = await connect(server, nursery, initialize=False)
        await _login(bystander, BETA)
        session_id, _ = await client.new_session()
        prompt_id, reply = client.start_request("session/prompt")
        await client.send({"jsonrpc": "2.0", "id": prompt_id, "method": "session/prompt",
                           "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": "hi"}]}})
        await trio.sleep(0.1)
        assert server.bridge.statistics().running_prompts == 1
        write_tokens(path, [r for i in store.ids() if i != "acme" and (r := store.get(i)) is not None])
        reload_credentials(server)
        with trio.fail_after(1):
            await client.eof.wait()
        assert [n["params"] for n in client.notifications if n["method"] == "_acp_server/evicted"] == [
            {"reason": "token_revoked"}
        ]
        assert evict_revoked(server) == 0  # evicted once, not again
        with trio.fail_after(5):
            while server.bridge.statistics().settled_total < 1:  # noqa: ASYNC110 - a counter of the bridge, no event to wait on
                await trio.sleep(0.05)
        stats = server.bridge.statistics()
        assert (stats.admitted_total, stats.settled_total, stats.running_prompts) == (1, 1, 0)
        await bystander.call("session/list", {})  # another token's connection is untouched
        events = [json.loads(line)["event"] for line in audit.getvalue().splitlines()]
        assert events.count("token_revoked") == 1 and "tokens_reloaded" in events
        nursery.cancel_scope.cancel()


async def test_garbage_auth_traffic_over_tcp_never_disturbs_the_listener() -> None:
    """Random authenticate/initialize lines and raw bytes over real TCP connections: each line gets an
    answer or the connection closes, and a fresh connection still authenticates and works."""
    import random
    from functools import partial

    from acp_server.transports import serve_tcp

    rng = random.Random(18)
    values: list[Any] = [None, 0, -1, 2**70, "", "x" * 3000, ACME, [ACME], {"token": ACME}, True, 1.5, "\u00e9\u4e2d"]

    def line() -> bytes:
        kind = rng.randrange(5)
        if kind == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b"") + b"\n"
        params: Any = {"methodId": rng.choice(["acp-server-token", "other", 7, None]),
                       "_meta": rng.choice([{"token": rng.choice(values)}, rng.choice(values)])}
        if kind == 1:
            params = rng.choice(values)
        method = rng.choice(["authenticate", "initialize", "session/new", "session/list"])
        return json.dumps({"jsonrpc": "2.0", "id": rng.randrange(100), "method": method, "params": params}).encode() + b"\n"

    async with _server() as (server, nursery, _):
        listeners = await nursery.start(partial(serve_tcp, host="127.0.0.1"), server.handle_stream, 0)
        port = listeners[0].socket.getsockname()[1]
        for _ in range(4):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"".join(line() for _ in range(60)))
            await stream.send_eof()
            with trio.fail_after(5):  # the server answers what it read, then closes at our end of input
                while await stream.receive_some(65536):
                    pass
            await stream.aclose()
        client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
        nursery.start_soon(client.pump)
        await _login(client, ACME)
        await client.new_session()
        await client.stream.aclose()
