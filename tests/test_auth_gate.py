"""The authenticator transports call: secrets and HTTP credentials checked, failures counted per address
(a request without credentials is no attempt), audit reasons, request rates per token."""

from __future__ import annotations

import io
import json
from typing import Any

import trio

from acp_server.auth import OWNER, AuditLog, TokenRecord, TokenStore, hash_secret, new_secret
from acp_server.auth.gate import Authenticator, PeerInfo, describe_stream
from acp_server.auth.http_rules import bearer_subprotocol

SECRET = new_secret()


def _auth(rps: float | None = None) -> tuple[Authenticator, io.StringIO, list[float]]:
    now = [0.0]
    out = io.StringIO()
    store = TokenStore({"a": TokenRecord("a", bytes.fromhex(hash_secret(SECRET)), "acme")})
    return Authenticator(store, audit=AuditLog(stream=out), rate_limit_rps=rps, clock=lambda: now[0]), out, now


def _events(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_http_credentials_and_their_audit_reasons() -> None:
    auth, out, _ = _auth()
    src = "203.0.113.9"
    ok, proto = auth.check_http(authorization=f"Bearer {SECRET}", source=src)
    assert ok.identity is not None and ok.identity.tenant == "acme" and proto is None
    ws, proto = auth.check_http(authorization=None, ws_protocols=f"acp.v1, {bearer_subprotocol(SECRET)}", source=src)
    assert ws.identity is not None and proto == "acp.v1"
    for authorization, protocols in ((None, None), ("Basic x", None), ("Bearer nope", None), (None, "acp.v1, acp-bearer.%")):
        outcome, proto = auth.check_http(authorization=authorization, ws_protocols=protocols, source=src)
        assert outcome.identity is None and outcome.retry_after_ms == 0 and proto is None
    reasons = [e.get("reason") for e in _events(out) if e["event"] == "auth_failed"]
    assert reasons == ["missing", "malformed", "unknown_or_expired", "malformed"]
    assert auth.failures.failures(src) == 3  # the request without credentials made no attempt
    assert SECRET not in out.getvalue()


def test_the_11th_failure_is_refused_unchecked_and_loopback_never() -> None:
    auth, out, now = _auth()
    for _ in range(10):
        assert auth.check("bad", source="198.51.100.4", transport="tcp").identity is None
    refused = auth.check(SECRET, source="198.51.100.4", transport="tcp")
    assert refused.identity is None and refused.retry_after_ms == 60_000
    assert _events(out)[-1] == {**_events(out)[-1], "event": "auth_refused", "retryAfterMs": 60_000}
    http, _ = auth.check_http(authorization=f"Bearer {SECRET}", source="198.51.100.4")
    assert http.retry_after_ms > 0
    now[0] = 60.0
    assert auth.check(SECRET, source="198.51.100.4", transport="tcp").identity is not None
    for _ in range(30):
        auth.check("bad", source="127.0.0.1", transport="tcp")
    assert auth.check(SECRET, source="127.0.0.1", transport="tcp").identity is not None


def test_throttle_per_token_and_never_the_owner() -> None:
    auth, _, now = _auth(rps=2)
    identity = auth.check(SECRET, source=None, transport="stream").identity
    assert identity is not None
    assert [auth.throttle(identity) for _ in range(5)] == [0, 0, 0, 0, 500]
    assert all(auth.throttle(OWNER) == 0 for _ in range(100))
    now[0] = 0.5
    assert auth.throttle(identity) == 0
    assert _auth()[0].throttle(identity) == 0  # no --rate-limit-rps: no limit


async def test_describe_stream() -> None:
    a, b = trio.testing.memory_stream_pair()
    assert describe_stream(a) == PeerInfo("stream")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
        info = describe_stream(server)
        assert info.transport == "tcp" and info.address == "127.0.0.1" and not info.trusted
        await client.aclose()
        await server.aclose()
        nursery.cancel_scope.cancel()
    for listener in listeners:
        await listener.aclose()
