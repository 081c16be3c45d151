"""Host names, origins, bearer headers, WebSocket subprotocols, trusted proxies, and a fuzz of them all."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_server.auth.http_rules import (
    UNAUTHORIZED_BODY,
    TrustedProxies,
    WsOffer,
    bearer_subprotocol,
    http_identity,
    normalize_origin,
    parse_bearer,
    parse_ws_subprotocols,
    retry_after_seconds,
    split_host,
)
from acp_server.auth.tokens import TokenRecord, TokenStore, hash_secret, new_secret
from acp_server.transports.http.rules import HostRules

SECRET = new_secret()
EXPIRED = new_secret()
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def _store() -> TokenStore:
    return TokenStore(
        {
            "a": TokenRecord("a", bytes.fromhex(hash_secret(SECRET)), "acme"),
            "old": TokenRecord("old", bytes.fromhex(hash_secret(EXPIRED)), "acme", expires=datetime(2026, 1, 1, tzinfo=UTC)),
        },
        clock=lambda: NOW,
    )


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("localhost", ("localhost", None)),
        ("LocalHost:4170", ("localhost", 4170)),
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]", ("::1", None)),
        ("[::1]:4170", ("::1", 4170)),
        ("example.com", ("example.com", None)),
        ("::1", None),
        ("[::1", None),
        ("[127.0.0.1]", None),
        ("host:0", None),
        ("host:65536", None),
        ("host:12ab", None),
        ("host:", None),
        ("ho st", None),
        ("evil.com@localhost", None),
        ("", None),
    ],
)
def test_split_host(header: str, expected: tuple[str, int | None] | None) -> None:
    assert split_host(header) == expected


def test_normalize_origin() -> None:
    assert normalize_origin("HTTPS://A.com:443") == "https://a.com"
    assert normalize_origin("http://a.com:8080/") == "http://a.com:8080"
    assert normalize_origin("http://[::1]:80") == "http://[::1]"
    assert normalize_origin("http://a.com:99999") is None


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"Bearer {SECRET}", SECRET),
        (f"bearer   {SECRET}  ", SECRET),
        ("Bearer abc==", "abc=="),
        ("Bearer", None),
        ("Bearer ", None),
        (f"Basic {SECRET}", None),
        (f"Bearer {SECRET} extra", None),
        ("Bearer a\u00e9b", None),
        (None, None),
        ("", None),
        ([f"Bearer {SECRET}"], SECRET),
        ([f"Bearer {SECRET}", f"Bearer {SECRET}"], None),
        ("Bearer " + "a" * 600, None),
    ],
    ids=lambda value: value.replace(SECRET, "SECRET") if isinstance(value, str) else None,
)
def test_parse_bearer(header: str | list[str] | None, expected: str | None) -> None:
    assert parse_bearer(header) == expected


def test_ws_subprotocols_round_trip() -> None:
    proto = bearer_subprotocol(SECRET)
    assert proto.startswith("acp-bearer.") and "=" not in proto and SECRET not in proto
    assert parse_ws_subprotocols(f"acp.v1, {proto}") == WsOffer(acp=True, secret=SECRET)
    assert parse_ws_subprotocols(["acp.v1", proto]) == WsOffer(acp=True, secret=SECRET)
    assert parse_ws_subprotocols("acp.v1") == WsOffer(acp=True)
    assert parse_ws_subprotocols(None) == WsOffer()
    assert parse_ws_subprotocols("acp.v1, acp-bearer.") == WsOffer(acp=True, malformed=True)
    assert parse_ws_subprotocols("acp-bearer.a+b") == WsOffer(malformed=True)
    assert parse_ws_subprotocols(f"{proto}, {proto}") == WsOffer(malformed=True)
    bad_utf8 = "acp-bearer." + base64.urlsafe_b64encode(b"\xff\xfe").rstrip(b"=").decode()
    assert parse_ws_subprotocols(bad_utf8) == WsOffer(malformed=True)
    assert parse_ws_subprotocols("acp-bearer.a") == WsOffer(malformed=True)  # one base64 char is no byte


def test_http_identity_and_the_one_401() -> None:
    store = _store()
    ok = http_identity(store, authorization=f"Bearer {SECRET}")
    assert ok.identity is not None and ok.identity.tenant == "acme" and ok.subprotocol is None
    ws = http_identity(store, authorization=None, ws_protocols=f"acp.v1, {bearer_subprotocol(SECRET)}")
    assert ws.identity is not None and ws.subprotocol == "acp.v1"
    refused = [
        http_identity(store, authorization=None),  # missing
        http_identity(store, authorization="Bearer"),  # malformed
        http_identity(store, authorization="Bearer wrong"),  # wrong
        http_identity(store, authorization=f"Bearer {EXPIRED}"),  # expired
        http_identity(store, authorization=None, ws_protocols="acp.v1, acp-bearer.%%"),
        http_identity(store, authorization=None, ws_protocols=f"acp.v1, {bearer_subprotocol('wrong')}"),
    ]
    assert all(r.identity is None and r.subprotocol is None for r in refused)
    assert [r.presented for r in refused] == [False, True, True, True, True, True]
    assert SECRET.encode() not in UNAUTHORIZED_BODY


def test_trusted_proxies() -> None:
    proxies = TrustedProxies(["10.0.0.0/8", "::1"])
    assert proxies.trusts("10.1.2.3") and proxies.trusts("::ffff:10.1.2.3") and proxies.trusts("::1")
    assert not proxies.trusts("192.0.2.1") and not proxies.trusts("not-an-ip")
    # from a trusted peer: the rightmost untrusted hop is the client, the proto counts
    view = proxies.client("10.0.0.1", scheme="http", forwarded_for="198.51.100.7, 203.0.113.9, 10.0.0.2", forwarded_proto="https")
    assert (view.address, view.scheme) == ("203.0.113.9", "https")
    # all trusted: the leftmost
    assert proxies.client("10.0.0.1", scheme="http", forwarded_for="10.9.9.9").address == "10.9.9.9"
    # a garbage hop stops the walk at the last good address
    assert proxies.client("10.0.0.1", scheme="http", forwarded_for="evil, 10.0.0.5").address == "10.0.0.5"
    # an unknown proto is ignored
    assert proxies.client("10.0.0.1", scheme="http", forwarded_proto="gopher").scheme == "http"
    # from anyone else the headers are ignored
    view = proxies.client("192.0.2.1", scheme="http", forwarded_for="127.0.0.1", forwarded_proto="https")
    assert (view.address, view.scheme) == ("192.0.2.1", "http")
    # with no trusted proxy at all, nobody is believed
    assert TrustedProxies().client("10.0.0.1", scheme="http", forwarded_for="1.2.3.4").address == "10.0.0.1"
    with pytest.raises(ValueError, match="--trusted-proxy '10.0.0.0/33': an IP address or network in CIDR form"):
        TrustedProxies(["10.0.0.0/33"])


def test_retry_after_seconds() -> None:
    assert [retry_after_seconds(ms) for ms in (0, 1, 999, 1000, 1001)] == ["1", "1", "1", "1", "2"]


_text = st.text(max_size=200)
_headers = st.none() | _text | st.lists(_text, max_size=3)
_proto_text = st.lists(
    st.one_of(
        st.sampled_from(["acp.v1", "acp-bearer.", " ", ","]),
        st.builds(bearer_subprotocol, st.text(max_size=60)),
        st.text(max_size=40),
    ),
    max_size=5,
).map(", ".join)


@settings(max_examples=300, deadline=None)
@given(authorization=_headers, protocols=st.none() | _proto_text | st.lists(_proto_text, max_size=3), host=_text,
       origin=st.none() | _text, xff=_headers, xfp=_headers, peer=st.sampled_from(["10.0.0.1", "192.0.2.1", "::1"]))
def test_fuzz_http_auth_inputs_never_raise(
    authorization: str | list[str] | None,
    protocols: str | list[str] | None,
    host: str,
    origin: str | None,
    xff: str | list[str] | None,
    xfp: str | list[str] | None,
    peer: str,
) -> None:
    store = _store()
    result = http_identity(store, authorization=authorization, ws_protocols=protocols)
    assert result.identity is None or result.identity.tenant == "acme"
    rules = HostRules(port=4170, allow_hosts=frozenset({"acp.example.com"}), allow_origins=frozenset({"https://a.example"}))
    refused = rules.check_host(host)
    assert refused is None or refused.status == 403
    if origin is not None:
        refused = rules.check_origin(origin, host=host, scheme="http")
        assert refused is None or refused.status == 403
    view = TrustedProxies(["10.0.0.0/8"]).client(peer, scheme="http", forwarded_for=xff, forwarded_proto=xfp)
    assert view.scheme in ("http", "https")
    split_host(host)
    if origin is not None:
        normalize_origin(origin)
