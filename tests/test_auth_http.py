"""Tokens on the HTTP listener, driven in process through the ASGI app (no socket, a clock by hand):
the credential check comes first and answers one 401 for every failure, rates per token and failed
attempts per address (one count with NDJSON's ``authenticate``) answer 429, the tenant rules of
``X-Acp-Tenant``, scopes of ``/health?deep=1``, and a fuzz of credentials that never breaks the app."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acp_server.auth import AuditLog, TokenRecord, TokenStore, hash_secret
from acp_server.auth.gate import Authenticator, PeerInfo
from acp_server.auth.http_rules import UNAUTHORIZED_BODY, bearer_subprotocol, http_identity
from acp_server.auth.tokens import OWNER
from acp_server.server import Server
from acp_server.transports.http.app import AcpHttpApp, HttpLimits
from acp_server.transports.http.auth import HttpCaller, HttpGuard, HttpRefusal
from acp_server.transports.http.rest import RestApi
from acp_server.transports.http.rules import HostRules

from .helpers import RawClient, RpcError, assert_error_valid

ACME = "acme-secret-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
BETA = "beta-secret-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
ROOT = "root-secret-rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"
SCRAPER = "scrape-secret-sssssssssssssssssssssssssssssss"
OLD = "old-secret-oooooooooooooooooooooooooooooooooooo"
SECRETS = (ACME, BETA, ROOT, SCRAPER, OLD)
REMOTE = "203.0.113.9"  # a documentation address: not loopback, so its failures count
HOST = (b"host", b"127.0.0.1:8000")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store() -> TokenStore:
    def rec(token_id: str, secret: str, tenant: str, *scopes: str, expires: datetime | None = None) -> TokenRecord:
        return TokenRecord(token_id, bytes.fromhex(hash_secret(secret)), tenant, frozenset(scopes), expires)

    return TokenStore({
        "acme": rec("acme", ACME, "acme"),
        "beta": rec("beta", BETA, "beta"),
        "root": rec("root", ROOT, "ops", "admin"),
        "scraper": rec("scraper", SCRAPER, "ops", "metrics"),
        "old": rec("old", OLD, "acme", expires=datetime(2020, 1, 1, tzinfo=UTC)),
    })


class Http:
    """The ASGI app of one listener over an in-process server, and a way to call it."""

    def __init__(self, server: Server, app: AcpHttpApp, audit: io.StringIO, clock: Clock) -> None:
        self.server = server
        self.app = app
        self.audit = audit
        self.clock = clock
        self.bodies: list[bytes] = []

    async def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: Any = None,
        client: str = "127.0.0.1",
        query: bytes = b"",
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """One request; its status, headers (the last of each name) and body."""
        hdrs = [HOST, *(headers or [])]
        if token is not None:
            hdrs.append((b"authorization", f"Bearer {token}".encode()))
        raw = b""
        if body is not None:
            raw = json.dumps(body).encode()
            hdrs.append((b"content-type", b"application/json"))
        scope = {
            "type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": hdrs, "client": (client, 40000), "http_version": "1.1", "scheme": "http",
        }
        sent: list[dict[str, Any]] = []
        given = [False]

        async def receive() -> dict[str, Any]:
            if not given[0]:
                given[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await trio.sleep_forever()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with trio.fail_after(10):
            await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        self.bodies.append(data)
        return start["status"], dict(start["headers"]), data

    async def handshake(
        self, protocols: list[str], *, headers: list[tuple[bytes, bytes]] | None = None, client: str = "127.0.0.1"
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """A WebSocket handshake that the app refuses: the status, headers and body of its answer."""
        scope = {
            "type": "websocket", "path": "/acp", "raw_path": b"/acp", "query_string": b"",
            "headers": [HOST, *(headers or [])], "client": (client, 40000), "subprotocols": protocols,
            "extensions": {"websocket.http.response": {}}, "http_version": "1.1", "scheme": "ws",
        }
        sent: list[dict[str, Any]] = []
        given = [False]

        async def receive() -> dict[str, Any]:
            if not given[0]:
                given[0] = True
                return {"type": "websocket.connect"}
            await trio.sleep_forever()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "websocket.accept":
                raise AssertionError(f"the handshake was accepted: {message}")

        with trio.fail_after(10):
            await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "websocket.http.response.start")
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "websocket.http.response.body")
        self.bodies.append(data)
        return start["status"], dict(start["headers"]), data

    def audit_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.audit.getvalue().splitlines()]


@asynccontextmanager
async def _http(rps: float | None = None) -> AsyncIterator[Http]:
    audit = io.StringIO()
    clock = Clock()
    auth = Authenticator(_store(), audit=AuditLog(stream=audit), rate_limit_rps=rps, clock=clock)
    server = Server(auth=auth)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        rules = HostRules(port=8000, bound_host="127.0.0.1")
        app = AcpHttpApp(
            server.handle_stream, nursery, rules, HttpLimits(), RestApi(server, max_message_bytes=1 << 20),
            HttpGuard(auth, clock=clock),
        )
        http = Http(server, app, audit, clock)
        yield http
        for secret in SECRETS:  # no secret in an answer or an audit line
            assert all(secret.encode() not in body for body in http.bodies)
            assert secret not in audit.getvalue()
        nursery.cancel_scope.cancel()


def _error(body: bytes) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(body)
    assert set(out) >= {"error", "code"}
    return out


# --- the one 401 ------------------------------------------------------------------------------------


async def test_every_credential_failure_is_the_same_401_before_any_other_check() -> None:
    """Missing, malformed, wrong, expired (header or subprotocol, any route, even one that does not
    exist or takes another method): the same status, headers and body bytes."""
    async with _http() as http:
        answers = []
        auth_headers: list[list[tuple[bytes, bytes]]] = [
            [],
            [(b"authorization", b"Basic YWNtZTpwdw==")],
            [(b"authorization", b"Bearer")],
            [(b"authorization", b"Bearer a b")],
            [(b"authorization", b"Bearer " + b"x" * 5000)],
            [(b"authorization", b"Bearer wrong-secret")],
            [(b"authorization", f"Bearer {OLD}".encode())],  # expired
            [(b"authorization", f"Bearer {ACME}".encode()), (b"authorization", f"Bearer {ACME}".encode())],
            [(b"authorization", f"Bearer {ACME}x".encode())],
        ]
        routes = [("GET", "/capabilities"), ("POST", "/acp"), ("GET", "/session/s1/events"), ("POST", "/session"),
                  ("GET", "/no/such/route"), ("PUT", "/acp"), ("GET", "/health?deep=1")]
        for method, path in routes:
            path, _, query = path.partition("?")
            for headers in auth_headers:
                answers.append(await http.request(method, path, headers=headers, query=query.encode()))
        for protocols in ([], ["acp.v1"], ["acp.v1", "acp-bearer.!!"], ["acp.v1", bearer_subprotocol("wrong")],
                          ["acp.v1", bearer_subprotocol(OLD)], [bearer_subprotocol(ACME), bearer_subprotocol(ACME)]):
            answers.append(await http.handshake(protocols))
        statuses = {status for status, _, _ in answers}
        bodies = {body for _, _, body in answers}
        assert statuses == {401} and len(bodies) == 1, (statuses, bodies)
        assert len({tuple(sorted(h.items())) for _, h, _ in answers}) == 1
        _, first, body = answers[0]
        assert first[b"www-authenticate"].startswith(b"Bearer") and first[b"content-type"] == b"application/json"
        error = _error(body)
        assert body == UNAUTHORIZED_BODY
        assert error["code"] == "unauthorized" and "Authorization: Bearer" in error["error"]
        assert_error_valid({"code": -32600, "message": error["error"], "data": {"errorKind": "unauthorized",
                                                                               "scheme": error["scheme"]}})
        reasons = {line.get("reason") for line in http.audit_lines() if line["event"] == "auth_failed"}
        assert reasons == {"missing", "malformed", "unknown_or_expired"}
        # with a token the same requests reach their own checks
        assert (await http.request("GET", "/no/such/route", token=ACME))[0] == 404
        assert (await http.request("PUT", "/acp", token=ACME))[0] == 405
        assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200


async def test_liveness_and_the_console_files_need_no_token_but_deep_health_needs_a_scope() -> None:
    async with _http() as http:
        assert (await http.request("GET", "/health"))[0] == 200
        assert (await http.request("GET", "/"))[0] == 200
        assert (await http.request("OPTIONS", "/acp"))[0] == 204  # a CORS preflight carries no credentials
        assert (await http.request("GET", "/health", query=b"deep=1"))[0] == 401
        status, _, body = await http.request("GET", "/health", token=ACME, query=b"deep=1")
        assert status == 403 and _error(body)["code"] == "insufficient_scope"
        assert _error(body)["scopes"] == ["admin", "metrics"]
        for secret in (SCRAPER, ROOT):
            status, _, body = await http.request("GET", "/health", token=secret, query=b"deep=1")
            assert status == 200 and "sessions" in json.loads(body)


async def test_successes_are_audited_once_a_minute_per_token_address_and_transport() -> None:
    async with _http() as http:
        for _ in range(5):
            assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200
        assert (await http.request("GET", "/capabilities", token=BETA))[0] == 200
        assert (await http.request("GET", "/capabilities", token=ACME, client="198.51.100.4"))[0] == 200
        http.clock.now += 61
        assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200
        oks = [(a["tokenId"], a["source"]) for a in http.audit_lines() if a["event"] == "auth_ok"]
        assert oks == [("acme", "127.0.0.1"), ("beta", "127.0.0.1"), ("acme", "198.51.100.4"), ("acme", "127.0.0.1")]


# --- rates -------------------------------------------------------------------------------------------


async def test_the_request_rate_is_per_token_with_cancel_exempt() -> None:
    """``--rate-limit-rps 1`` (bursts of 2): the third request at once is 429 ``rate_limited`` with
    ``Retry-After`` and ``retryAfterMs``; another token is not slowed; cancels pass; a second later
    the token may go on."""
    async with _http(rps=1) as http:
        for _ in range(2):
            assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200
        status, headers, body = await http.request("GET", "/capabilities", token=ACME)
        error = _error(body)
        assert status == 429 and headers[b"retry-after"] == b"1"
        assert (error["code"], error["reason"]) == ("rate_limited", "request_rate") and 0 < error["retryAfterMs"] <= 1000
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
        assert (await http.request("POST", "/acp", token=ACME, body=initialize))[0] == 429
        # cancellations only free capacity: never counted, never refused for the rate
        for _ in range(3):
            status, _, body = await http.request("POST", "/session/s1/cancel", token=ACME)
            assert status == 404 and _error(body)["code"] == "session_not_found"
            cancel = {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 1}}
            assert (await http.request("POST", "/acp", token=ACME, body=cancel))[0] == 400  # no connection id
        assert (await http.request("GET", "/capabilities", token=BETA))[0] == 200
        http.clock.now += 1.0
        assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200


class _Addressed(trio.abc.Stream):
    """One end of an in-memory stream that says it comes from a TCP peer at ``address``."""

    def __init__(self, inner: trio.abc.Stream, address: str) -> None:
        self.inner = inner
        self.peer_info = PeerInfo("tcp", address)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.aclose()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_failed_authentications_per_address_are_one_count_across_http_and_ndjson() -> None:
    """Five failures over HTTP and five over NDJSON from one address: the 11th attempt, on either
    transport and with the right secret, is refused ``rate_limited`` without the secret being checked
    (the store is never asked, the audit says ``auth_refused``); another address is not affected; a
    minute later the address may try again."""
    async with _http() as http:
        store = http.server.auth.store  # type: ignore[union-attr]
        checked: list[object] = []
        real = store.authenticate

        def counting(secret: object, now: datetime | None = None) -> Any:
            checked.append(secret)
            return real(secret, now)

        store.authenticate = counting  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            client_end, server_end = trio.testing.memory_stream_pair()
            nursery.start_soon(http.server.handle_stream, _Addressed(server_end, REMOTE), "tcp test")
            ndjson = RawClient(client_end)
            nursery.start_soon(ndjson.pump)
            await ndjson.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            for i in range(10):
                if i % 2:
                    assert (await http.request("GET", "/capabilities", token=f"wrong-{i}", client=REMOTE))[0] == 401
                else:
                    with pytest.raises(RpcError) as info:
                        await ndjson.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": f"w{i}"}})
                    assert info.value.kind == "auth_required"
            assert len(checked) == 10
            status, headers, body = await http.request("GET", "/capabilities", token=ACME, client=REMOTE)
            error = _error(body)
            assert status == 429 and (error["code"], error["reason"]) == ("rate_limited", "auth_failures")
            assert int(headers[b"retry-after"]) >= 1 and error["retryAfterMs"] > 0
            with pytest.raises(RpcError) as info:
                await ndjson.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ACME}})
            assert info.value.kind == "rate_limited" and info.value.data["reason"] == "auth_failures"
            status, _, _ = await http.handshake(["acp.v1", bearer_subprotocol(ACME)], client=REMOTE)
            assert status == 429
            assert len(checked) == 10  # none of the refused attempts was looked at
            assert [line["event"] for line in http.audit_lines()].count("auth_refused") == 3
            # another address, and loopback, still authenticate
            assert (await http.request("GET", "/capabilities", token=ACME, client="198.51.100.4"))[0] == 200
            assert (await http.request("GET", "/capabilities", token=ACME))[0] == 200
            http.clock.now += 61
            assert (await http.request("GET", "/capabilities", token=ACME, client=REMOTE))[0] == 200
            assert await ndjson.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ACME}}) == {}
            nursery.cancel_scope.cancel()


# --- tenants -----------------------------------------------------------------------------------------


async def test_x_acp_tenant_is_for_admin_tokens_and_audited() -> None:
    async with _http() as http:
        status, _, body = await http.request("POST", "/session", token=BETA, body={"sessionScope": "thread", "cwd": "/tmp"})
        assert status == 200
        beta_session = json.loads(body)["sessionId"]
        tenant = [(b"x-acp-tenant", b"beta")]
        status, _, body = await http.request("GET", f"/session/{beta_session}/events", token=ACME, headers=tenant)
        error = _error(body)
        assert status == 400 and (error["code"], error["path"]) == ("invalid_params", "X-Acp-Tenant")
        status, _, body = await http.request("POST", f"/session/{beta_session}/heartbeat", token=ACME)
        assert status == 404 and _error(body)["code"] == "session_not_found" and "beta" not in body.decode()
        own = [(b"x-acp-tenant", b"acme")]
        assert (await http.request("POST", f"/session/{beta_session}/heartbeat", token=ACME, headers=own))[0] == 404
        status, _, body = await http.request("POST", f"/session/{beta_session}/heartbeat", token=ROOT, headers=tenant)
        assert status == 200 and json.loads(body)["sessionId"] == beta_session
        status, _, _ = await http.request("POST", f"/session/{beta_session}/heartbeat", token=ROOT)
        assert status == 404  # the admin's own tenant is ops
        acts = [line for line in http.audit_lines() if line["event"] == "admin_act"]
        assert len(acts) == 1 and acts[0]["tokenId"] == "root" and acts[0]["tenant"] == "beta"
        bad = [(b"x-acp-tenant", b"\x01")]
        assert (await http.request("GET", "/capabilities", token=ROOT, headers=bad))[0] == 400


# --- fuzz --------------------------------------------------------------------------------------------

_printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80)
_header_value = st.one_of(
    _printable,
    st.builds(lambda s: "Bearer " + s, _printable),
    st.sampled_from(["Bearer " + ACME, "bearer " + ACME, "Bearer  " + ACME + " ", "Bearer " + OLD]),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
)
_protocol = st.one_of(
    st.sampled_from(["acp.v1", "acp-bearer.", bearer_subprotocol(ACME), bearer_subprotocol(OLD)]),
    st.builds(lambda s: "acp-bearer." + s, _printable),
    _printable,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(_header_value, max_size=3),
    protocols=st.lists(_protocol, max_size=4),
    tenant=st.one_of(st.none(), _printable),
    websocket=st.booleans(),
)
def test_fuzzed_credentials_get_a_clear_answer_and_never_break_the_app(
    values: list[str], protocols: list[str], tenant: str | None, websocket: bool
) -> None:
    """Any ``Authorization`` values, subprotocols and ``X-Acp-Tenant``: a 401 exactly when the auth
    room's pure reading (``http_identity``) proves no token, else 200 or 400 for the tenant header, with
    the registry's body shape (never an exception out of the app, never a secret in an answer)."""

    async def main() -> None:
        async with _http() as http:
            headers = [(b"authorization", v.encode("latin-1")) for v in values]
            if tenant is not None:
                headers.append((b"x-acp-tenant", tenant.encode("latin-1")))
            # the reference: the auth room's pure reading of the same credentials
            expected = http_identity(
                _store(), authorization=values or None, ws_protocols=protocols if websocket else None
            ).identity
            if websocket:
                try:
                    status, _, body = await http.handshake(protocols, headers=headers)
                except AssertionError as exc:
                    assert "accepted" in str(exc) and expected is not None
                    return
            else:
                status, _, body = await http.request("GET", "/capabilities", headers=headers)
            assert status in (200, 400, 401), (status, body)
            assert (status == 401) == (expected is None), (status, body)
            if status != 200:
                assert _error(body)["code"] in ("unauthorized", "invalid_params")
            # the app still serves the next request
            assert (await http.request("GET", "/capabilities", token=BETA))[0] == 200

    trio.run(main)



async def test_ndjson_a_second_initialize_cannot_switch_the_proved_tenant() -> None:
    """After ``authenticate``, an ``initialize`` naming another tenant is refused ``invalid_params``
    (the token binds the tenant), for an admin too; an admin names it at the first ``initialize``."""
    async with _http() as http:
        async with trio.open_nursery() as nursery:
            clients = []
            for _ in range(2):
                client_end, server_end = trio.testing.memory_stream_pair()
                nursery.start_soon(http.server.handle_stream, _Addressed(server_end, "127.0.0.1"), "tcp test")
                client = RawClient(client_end)
                nursery.start_soon(client.pump)
                clients.append(client)
            acme, root = clients
            plain = {"protocolVersion": 1, "clientCapabilities": {}}
            beta_meta = {**plain, "_meta": {"tenantId": "beta"}}
            await acme.call("initialize", plain)
            assert await acme.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ACME}}) == {}
            with pytest.raises(RpcError) as info:
                await acme.call("initialize", beta_meta)
            assert info.value.kind == "invalid_params" and info.value.data["path"] == "_meta.tenantId"
            session_id, _ = await acme.new_session()
            assert http.server.bridge.get(session_id).tenant == "acme"
            await root.call("initialize", beta_meta)
            assert await root.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": ROOT}}) == {}
            session_id, _ = await root.new_session()
            assert http.server.bridge.get(session_id).tenant == "beta"
            acts = [line for line in http.audit_lines() if line["event"] == "admin_act"]
            assert [(a["tokenId"], a["tenant"]) for a in acts] == [("root", "beta")]
            nursery.cancel_scope.cancel()


def test_a_unix_socket_listener_is_the_owners() -> None:
    """On a Unix-socket HTTP listener (mode 0600) the peer is the owner, as on NDJSON's: no token asked."""
    auth = Authenticator(_store(), audit=AuditLog(stream=io.StringIO()))
    scope = {"type": "http", "method": "GET", "path": "/capabilities", "headers": [HOST], "client": None}
    caller = HttpGuard(auth, trusted=True).admit(scope)
    assert isinstance(caller, HttpCaller) and caller.identity is OWNER
    refused = HttpGuard(auth).admit(scope)
    assert isinstance(refused, HttpRefusal) and refused.status == 401


async def test_an_acp_connection_answers_only_the_token_that_opened_it() -> None:
    """``initialize`` with acme's token opens a connection bound to it: a request on that connection
    id with beta's (valid) token is 404 ``unknown_connection``; acme's own goes through."""
    async with _http() as http:
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
        status, headers, body = await http.request("POST", "/acp", token=ACME, body=initialize)
        assert status == 200 and "result" in json.loads(body)
        assert "acp-server-token" not in body.decode()  # the bearer proved the token already
        conn = [(b"acp-connection-id", headers[b"acp-connection-id"])]
        listing = {"jsonrpc": "2.0", "id": 2, "method": "session/list", "params": {}}
        status, _, body = await http.request("POST", "/acp", token=BETA, headers=conn, body=listing)
        assert status == 404 and _error(body)["code"] == "unknown_connection"
        status, _, _ = await http.request("POST", "/acp", token=ACME, headers=conn, body=listing)
        assert status == 202
        status, _, _ = await http.request("DELETE", "/acp", token=BETA, headers=conn)
        assert status == 404
        assert (await http.request("DELETE", "/acp", token=ACME, headers=conn))[0] == 202
