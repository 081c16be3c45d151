"""Who may reach the HTTP listeners: ``--http-allow-host`` (DNS rebinding), exact ``--http-allow-origin``
entries and ``*`` only with tokens, ``--trusted-proxy`` (``X-Forwarded-For``/``X-Forwarded-Proto``
believed only from listed peers), and the remote-bind refusals of each listener flag (exit 2).

The listener tests run over real loopback sockets; a test client sets ``Host``, ``Origin`` and the
forwarded headers itself, as a rebinding page or a proxy would.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config

from acp_server.auth.http_rules import TrustedProxies
from acp_server.auth.tokens import TokenRecord, hash_secret, new_secret, write_tokens
from acp_server.errors import REGISTRY
from acp_server.server import ListenAddress
from acp_server.transports.http import HttpOptions, serve_http
from acp_server.transports.http.addresses import PEER_KEY, ForwardedFor, client_address, forwarded_scope
from acp_server.transports.http.listener import serve_app
from acp_server.transports.http.rules import HostRules
from acp_server.transports.listeners import bind_tcp_socket

from .helpers import running_server
from .http_helpers import TIMEOUT_S, check_error_body
from .tls_helpers import CertFiles, write_certs


@asynccontextmanager
async def listener(options: HttpOptions) -> AsyncIterator[str]:
    async with running_server() as (server, nursery):
        address = ListenAddress("tcp", host="127.0.0.1", port=0)
        url = await nursery.start(lambda task_status: serve_http(server.handle_stream, address, options, task_status=task_status))
        yield url


async def _get(url: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url + "/health", headers=headers)


# --- Host ---------------------------------------------------------------------------------------------


def test_host_rules_allow_listed_names_with_any_port() -> None:
    rules = HostRules(port=4171, allow_hosts=frozenset({"acp.example.com", "10.0.0.5", "[2001:db8::1]"}))
    for ok in ("acp.example.com", "ACP.example.com:443", "acp.example.com:8443", "10.0.0.5:4171", "[2001:db8::1]:443",
               "localhost:4171", "127.0.0.1"):
        assert rules.check_host(ok) is None, ok
    for bad in ("evil.example", "acp.example.com.evil", "sub.acp.example.com", "10.0.0.6", "localhost:80",
                "acp.example.com:99999", ""):
        refusal = rules.check_host(bad)
        assert refusal is not None and refusal.kind == "forbidden_host" and refusal.status == 403, bad
        assert "--http-allow-host" in str(refusal.message)


def test_an_unspecified_bound_address_is_no_host_name() -> None:
    """Bound to ``0.0.0.0`` or ``::``, the listener still does not answer to ``Host: 0.0.0.0`` (a name
    some browsers reach loopback by), nor count it among its own origins."""
    for bound in ("0.0.0.0", "[::]"):
        rules = HostRules(port=4171, bound_host=bound)
        assert rules.check_host(f"{bound}:4171") is not None
        assert rules.check_host("localhost:4171") is None
        assert f"http://{bound}:4171" not in rules.own_origins()
    assert HostRules(port=4171, bound_host="10.1.2.3").check_host("10.1.2.3:4171") is None


async def test_a_rebinding_host_is_refused_with_the_registry_body_and_an_allowed_one_served() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with listener(HttpOptions()) as url:
            refused = await _get(url, host="acp.example.com")
            assert refused.status_code == 403
            body = check_error_body(refused)
            assert body["code"] == "forbidden_host" and body["host"] == "acp.example.com"
            assert "--http-allow-host" in body["error"]
            assert REGISTRY["forbidden_host"].__name__ == "ForbiddenHostError"
        async with listener(HttpOptions(allow_hosts=frozenset({"acp.example.com"}))) as url:
            assert (await _get(url, host="acp.example.com")).status_code == 200
            assert (await _get(url, host="acp.example.com:443")).status_code == 200
            assert (await _get(url, host="evil.example")).status_code == 403
            assert (await _get(url)).status_code == 200  # 127.0.0.1:PORT, always


# --- Origin ---------------------------------------------------------------------------------------------


def test_origins_are_exact_the_pages_own_or_any_with_star() -> None:
    rules = HostRules(port=4171, allow_origins=frozenset({"https://app.example"}), allow_hosts=frozenset({"acp.example.com"}))
    assert rules.check_origin("https://app.example") is None
    assert rules.check_origin("https://app.example:443") is not None  # exact strings
    # the page's own origin: the scheme the client used and the Host it sent
    assert rules.check_origin("http://acp.example.com", host="acp.example.com", scheme="http") is None
    assert rules.check_origin("https://acp.example.com", host="acp.example.com", scheme="http") is not None
    assert rules.check_origin("https://acp.example.com", host="acp.example.com", scheme="wss") is None
    assert rules.check_origin("https://evil.example", host="acp.example.com", scheme="https") is not None
    star = HostRules(port=4171, allow_origins=frozenset({"*"}))
    assert star.check_origin("https://anything.example") is None


def _tokens(tmp_path: pathlib.Path) -> str:
    path = str(tmp_path / "tokens.toml")
    write_tokens(path, [TokenRecord("t", bytes.fromhex(hash_secret(new_secret())), "acme")])
    return path


def _config(argv: list[str]) -> Any:
    from acp_server import cli

    parser, serve = cli._build()
    args = cli._parse(parser, ["serve", "--ephemeral", *argv])
    return cli.server_config(args, serve)


def test_star_origin_needs_tokens(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        _config(["--http-listen", "http://127.0.0.1:0", "--http-allow-origin", "*"])
    assert caught.value.code == 2
    assert "--http-allow-origin '*' needs --auth-tokens" in capsys.readouterr().err
    config = _config(["--http-listen", "http://127.0.0.1:0", "--http-allow-origin", "*", "--auth-tokens", _tokens(tmp_path)])
    assert config.http.allow_origins == frozenset({"*"})
    # an entry is kept as a browser spells the origin, and then compared exactly
    config = _config(["--http-listen", "http://127.0.0.1:0", "--http-allow-origin", "HTTPS://App.Example:443"])
    assert config.http.allow_origins == frozenset({"https://app.example"})


def test_allow_host_and_trusted_proxy_flags_and_config_keys(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[http]\nlisten = ["http://127.0.0.1:0"]\nallow_host = ["ACP.example.com", "[2001:DB8::1]"]\n'
                    'trusted_proxy = ["10.0.0.0/8", "127.0.0.1"]\n')
    config = _config(["--config", str(file)])
    assert config.http.allow_hosts == frozenset({"acp.example.com", "[2001:db8::1]"})
    assert config.http.trusted_proxies == ("10.0.0.0/8", "127.0.0.1/32")
    config = _config(["--config", str(file), "--http-allow-host", "other.example", "--trusted-proxy", "::1"])
    assert config.http.allow_hosts == frozenset({"other.example"}) and config.http.trusted_proxies == ("::1/128",)
    for argv, message in [
        (["--http-allow-host", "acp.example.com:443"], "--http-allow-host 'acp.example.com:443': a host name or address, without a port"),
        (["--http-allow-host", "2001:db8::1"], "without a port"),
        (["--trusted-proxy", "10.0.0.0/33"], "--trusted-proxy '10.0.0.0/33': an IP address or network in CIDR form"),
    ]:
        with pytest.raises(SystemExit) as caught:
            _config(["--http-listen", "http://127.0.0.1:0", *argv])
        assert caught.value.code == 2 and message in capsys.readouterr().err
    file.write_text('[http]\nlisten = ["http://127.0.0.1:0"]\ntrusted_proxy = ["nowhere"]\n')
    with pytest.raises(SystemExit):
        _config(["--config", str(file)])
    assert "http.trusted_proxy" in capsys.readouterr().err


# --- trusted proxies ---------------------------------------------------------------------------------


async def _whoami(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering with what the app behind the listener sees of the client."""
    if scope["type"] != "http":
        return
    body = f"{client_address(scope)} {scope['scheme']}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def _whoami_listener(trusted: tuple[str, ...]) -> AsyncIterator[str]:
    sock = trio.SocketListener(await bind_tcp_socket("127.0.0.1", 0))
    async with sock, trio.open_nursery() as nursery:
        port = sock.socket.getsockname()[1]
        await nursery.start(serve_app, ForwardedFor(_whoami, TrustedProxies(trusted)), Config(), sock)
        yield f"http://127.0.0.1:{port}/"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("trusted", "headers", "seen"),
    [
        (("127.0.0.1/32",), {"x-forwarded-for": "203.0.113.7", "x-forwarded-proto": "https"}, "203.0.113.7 https"),
        # read from the right: the first hop the trusted proxies did not vouch for is the client
        (("127.0.0.0/8", "10.0.0.0/8"), {"x-forwarded-for": "198.51.100.1, 203.0.113.7, 10.1.1.1"}, "203.0.113.7 http"),
        # the peer is no listed proxy: both headers are anyone's to write, and ignored
        (("10.0.0.0/8",), {"x-forwarded-for": "203.0.113.7", "x-forwarded-proto": "https"}, "127.0.0.1 http"),
        ((), {"x-forwarded-for": "203.0.113.7"}, "127.0.0.1 http"),
        # garbage in the header stops the walk at the last good hop
        (("127.0.0.1/32",), {"x-forwarded-for": "not-an-ip, 203.0.113.9"}, "203.0.113.9 http"),
    ],
)
async def test_forwarded_headers_count_only_from_trusted_proxies(trusted: tuple[str, ...], headers: dict[str, str], seen: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with _whoami_listener(trusted) as url, httpx.AsyncClient() as client:
            r = await client.get(url, headers=headers)
    assert r.status_code == 200 and r.text == seen


def test_forwarded_scope_keeps_the_peer_and_maps_websocket_schemes() -> None:
    scope = {"type": "websocket", "scheme": "ws", "client": ("10.0.0.2", 5555),
             "headers": [(b"x-forwarded-for", b"192.0.2.4"), (b"x-forwarded-proto", b"https")]}
    out = forwarded_scope(scope, TrustedProxies(["10.0.0.0/8"]))
    assert out["client"][0] == "192.0.2.4" and out["scheme"] == "wss" and out[PEER_KEY] == ("10.0.0.2", 5555)
    assert forwarded_scope(scope, TrustedProxies(["192.168.0.0/16"])) is scope
    assert client_address({"type": "http", "client": None}) is None  # a Unix socket's peer


async def test_the_forwarded_scheme_makes_a_proxied_page_same_origin() -> None:
    """Behind a TLS-terminating proxy on loopback, the page ``https://acp.example.com`` is the
    listener's own origin when the proxy is trusted; the same headers from an untrusted peer do not
    make it so (403 ``forbidden_origin``)."""
    headers = {"host": "acp.example.com", "origin": "https://acp.example.com", "x-forwarded-proto": "https"}
    hosts = frozenset({"acp.example.com"})
    with trio.fail_after(TIMEOUT_S):
        async with listener(HttpOptions(allow_hosts=hosts, trusted_proxies=("127.0.0.1/32",))) as url:
            r = await _get(url, **headers)
            assert r.status_code == 200, r.text
        async with listener(HttpOptions(allow_hosts=hosts, trusted_proxies=("10.0.0.0/8",))) as url:
            r = await _get(url, **headers)
            assert r.status_code == 403 and check_error_body(r)["code"] == "forbidden_origin"


# --- remote binds ----------------------------------------------------------------------------------------


@pytest.fixture
def certs(tmp_path: pathlib.Path) -> CertFiles:
    return write_certs(tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--http-listen", "http://0.0.0.0:0"], "--http-listen tcp://0.0.0.0:0: 0.0.0.0 is not a loopback address; a listener "
         "reachable from other machines needs TLS and tokens, and this one lacks TLS (the https:// scheme with --tls-cert "
         "FILE and --tls-key FILE) and tokens (--auth-tokens FILE)"),
        (["--http-listen", "https://0.0.0.0:0", "{tls}"], "--http-listen https://0.0.0.0:0: 0.0.0.0 is not a loopback "
         "address; a listener reachable from other machines needs TLS and tokens, and this one lacks tokens (--auth-tokens FILE)"),
        (["--http-listen", "http://0.0.0.0:0", "{tokens}"], "lacks TLS (the https:// scheme with --tls-cert FILE and --tls-key FILE);"),
        (["--metrics-listen", "http://0.0.0.0:0", "{tokens}"], "--metrics-listen tcp://0.0.0.0:0: 0.0.0.0 is not a loopback "
         "address; a listener reachable from other machines needs TLS and tokens, and this one lacks TLS (the https:// scheme"),
        (["--metrics-listen", "https://0.0.0.0:0", "{tls}"], "--metrics-listen https://0.0.0.0:0: 0.0.0.0 is not a loopback "
         "address; a listener reachable from other machines needs TLS and tokens, and this one lacks tokens (--auth-tokens FILE)"),
        (["--listen", "tcp://0.0.0.0:0", "{tokens}"], "--listen tcp://0.0.0.0:0: 0.0.0.0 is not a loopback address"),
    ],
)
def test_remote_binds_without_tls_and_tokens_exit_2(
    argv: list[str], message: str, certs: CertFiles, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill = {"{tls}": ["--tls-cert", certs.cert, "--tls-key", certs.key], "{tokens}": ["--auth-tokens", _tokens(tmp_path)]}
    args = [part for a in argv for part in fill.get(a, [a])]
    with pytest.raises(SystemExit) as caught:
        _config(args)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_remote_https_binds_with_tls_and_tokens_are_accepted(certs: CertFiles, tmp_path: pathlib.Path) -> None:
    config = _config(["--http-listen", "https://0.0.0.0:0", "--metrics-listen", "https://0.0.0.0:0",
                      "--tls-cert", certs.cert, "--tls-key", certs.key, "--auth-tokens", _tokens(tmp_path)])
    assert [str(a) for a in config.http_listen] == ["https://0.0.0.0:0"]
    assert str(config.metrics_listen) == "https://0.0.0.0:0"
