"""``acp-server serve`` with tokens and TLS, as a process: tls:// and tcp:// listeners, SIGHUP revocation
and expiry evicting connections, a broken reload keeping the tokens, and the exit codes of bad setups."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import trio
import trustme

from acp_server.auth.tls import client_context
from acp_server.auth.tokens import TokenRecord, hash_secret, load_tokens, new_secret, write_tokens

from .helpers import RawClient, RpcError
from .test_e2e_sdk import ServerProcess

SERVE = [sys.executable, "-m", "acp_server", "serve"]


@dataclass
class Setup:
    dir: pathlib.Path
    tokens: str
    audit: str
    cert: str
    key: str
    ca: str
    secrets: dict[str, str]


def _record(token_id: str, secret: str, tenant: str, expires: datetime | None = None) -> TokenRecord:
    return TokenRecord(token_id, bytes.fromhex(hash_secret(secret)), tenant, expires=expires)


@pytest.fixture
def setup(tmp_path: pathlib.Path) -> Setup:
    ca = trustme.CA()
    issued = ca.issue_cert("localhost", "127.0.0.1")
    cert, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    issued.private_key_and_cert_chain_pem.write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    secrets_ = {"acme": new_secret(), "beta": new_secret(), "soon": new_secret()}
    tokens = str(tmp_path / "tokens.toml")
    soon = (datetime.now(UTC) + timedelta(seconds=4)).replace(microsecond=0)
    write_tokens(
        tokens,
        [_record("acme", secrets_["acme"], "acme"), _record("beta", secrets_["beta"], "beta"),
         _record("soon", secrets_["soon"], "acme", soon)],
    )
    return Setup(tmp_path, tokens, str(tmp_path / "audit.log"), str(cert), str(key), str(ca_file), secrets_)


@pytest.fixture
def server(setup: Setup) -> Iterator[tuple[ServerProcess, str, str]]:
    proc = ServerProcess(
        "--listen", "tls://127.0.0.1:0", "--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", "1500",
        "--auth-tokens", setup.tokens, "--audit-log", setup.audit, "--tls-cert", setup.cert, "--tls-key", setup.key,
        "--tls-handshake-timeout-s", "1", "--log-level", "info",
    )
    try:
        tls_url, tcp_url = proc.wait_listening(2)
        yield proc, tls_url, tcp_url
    finally:
        proc.stop()
        text = "\n".join(proc.rest_of_stderr()) + pathlib.Path(setup.audit).read_text()
        for secret in setup.secrets.values():
            assert secret not in text


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _open(url: str, ca: str | None = None) -> tuple[RawClient, trio.abc.Stream]:
    stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
    if url.startswith("tls://"):
        assert ca is not None
        tls = trio.SSLStream(stream, client_context(ca), server_hostname="localhost")
        await tls.do_handshake()
        stream = tls
    return RawClient(stream), stream


async def _login(client: RawClient, secret: str) -> None:
    result = await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    assert result["authMethods"][0]["id"] == "acp-server-token"
    await client.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": secret}})


def _audit(setup: Setup) -> list[dict[str, Any]]:
    return [json.loads(line) for line in pathlib.Path(setup.audit).read_text().splitlines()]


async def test_tls_and_tcp_listeners_ask_for_a_token(setup: Setup, server: tuple[ServerProcess, str, str]) -> None:
    proc, tls_url, tcp_url = server
    assert tls_url.startswith("tls://127.0.0.1:") and tcp_url.startswith("tcp://127.0.0.1:")
    async with trio.open_nursery() as nursery:
        silent = await trio.open_tcp_stream("127.0.0.1", _port(tls_url))  # never shakes hands
        client, stream = await _open(tls_url, setup.ca)
        nursery.start_soon(client.pump)
        await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        with pytest.raises(RpcError) as info:
            await client.call("session/new", {"cwd": "/tmp", "mcpServers": []})
        assert info.value.kind == "auth_required" and info.value.data["methodId"] == "acp-server-token"
        await client.call("authenticate", {"methodId": "acp-server-token", "_meta": {"token": setup.secrets["acme"]}})
        session_id, _ = await client.new_session()
        with trio.fail_after(5):
            assert await silent.receive_some() == b""  # dropped after the 1 s handshake timeout
        result = await client.prompt(session_id)  # the TLS client was not disturbed
        assert result["stopReason"] == "end_turn"
        await silent.aclose()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert {"event": "auth_ok", "tokenId": "acme", "transport": "tls"}.items() <= _audit(setup)[0].items()


async def test_sighup_revocation_evicts_the_connection_and_refuses_the_token(
    setup: Setup, server: tuple[ServerProcess, str, str]
) -> None:
    proc, _, tcp_url = server
    async with trio.open_nursery() as nursery:
        client, stream = await _open(tcp_url)
        nursery.start_soon(client.pump)
        await _login(client, setup.secrets["acme"])
        session_id, _ = await client.new_session()
        prompt_id, _reply = client.start_request("session/prompt")
        await client.send({"jsonrpc": "2.0", "id": prompt_id, "method": "session/prompt",
                           "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": "hi"}]}})
        await trio.sleep(0.3)  # the prompt runs (1.5 s echo)
        records = load_tokens(setup.tokens)
        del records["acme"]
        write_tokens(setup.tokens, records.values())
        os.kill(proc.proc.pid, signal.SIGHUP)
        with trio.fail_after(2):
            await client.eof.wait()
        evicted = [n for n in client.notifications if n["method"] == "_acp_server/evicted"]
        assert evicted and evicted[0]["params"]["reason"] == "token_revoked"
        again, again_stream = await _open(tcp_url)
        nursery.start_soon(again.pump)
        with pytest.raises(RpcError) as info:
            await _login(again, setup.secrets["acme"])
        assert info.value.kind == "auth_required"
        await _login(again, setup.secrets["beta"])  # the other tokens still hold
        await again_stream.aclose()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    events = _audit(setup)
    assert any(e["event"] == "tokens_reloaded" and e["removed"] == 1 for e in events)
    assert any(e["event"] == "token_revoked" and e["tokenId"] == "acme" and e["evicted"] == 1 for e in events)


async def test_a_broken_reload_keeps_the_tokens(setup: Setup, server: tuple[ServerProcess, str, str]) -> None:
    proc, _, tcp_url = server
    _write(setup.tokens, "[tokens.acme\n")
    os.kill(proc.proc.pid, signal.SIGHUP)
    await trio.sleep(0.5)
    async with trio.open_nursery() as nursery:
        client, stream = await _open(tcp_url)
        nursery.start_soon(client.pump)
        await _login(client, setup.secrets["acme"])
        await stream.aclose()
        nursery.cancel_scope.cancel()
    failed = [e for e in _audit(setup) if e["event"] == "tokens_reload_failed"]
    assert failed and "not valid TOML" in failed[0]["detail"]


def _write(path: str, text: str) -> None:
    pathlib.Path(path).write_text(text)


async def test_an_expiring_token_is_evicted(setup: Setup, server: tuple[ServerProcess, str, str]) -> None:
    proc, _, tcp_url = server
    # the expiry is set here, not in the fixture: a loaded machine may take seconds to start the server
    records = load_tokens(setup.tokens)
    soon = (datetime.now(UTC) + timedelta(seconds=4)).replace(microsecond=0)
    records["soon"] = _record("soon", setup.secrets["soon"], "acme", soon)
    write_tokens(setup.tokens, records.values())
    os.kill(proc.proc.pid, signal.SIGHUP)
    for _ in range(100):  # the reload's audit line: the new record is in force
        if any(e["event"] == "tokens_reloaded" for e in _audit(setup)):
            break
        await trio.sleep(0.05)
    else:
        raise AssertionError("the server did not reload its tokens within 5 s of SIGHUP")
    async with trio.open_nursery() as nursery:
        client, stream = await _open(tcp_url)
        nursery.start_soon(client.pump)
        await _login(client, setup.secrets["soon"])
        await client.call("session/list", {})
        with trio.fail_after(10):
            await client.eof.wait()
        assert [n["params"]["reason"] for n in client.notifications if n["method"] == "_acp_server/evicted"] == [
            "token_revoked"
        ]
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert any(e["event"] == "token_expired" and e["tokenId"] == "soon" for e in _audit(setup))


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, "--ephemeral", *args], capture_output=True, text=True, timeout=30)


def test_a_public_tokens_file_exits_1_with_the_fix(setup: Setup) -> None:
    os.chmod(setup.tokens, 0o644)
    run = _serve("--listen", "tcp://127.0.0.1:0", "--auth-tokens", setup.tokens)
    assert run.returncode == 1
    assert setup.tokens in run.stderr and f"chmod 600 {setup.tokens}" in run.stderr
    config = setup.dir / "c.toml"
    config.write_text(f'[auth]\ntokens = "{setup.tokens}"\n')
    run = _serve("--listen", "tcp://127.0.0.1:0", "--config", str(config))
    assert run.returncode == 1 and f"chmod 600 {setup.tokens}" in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "tcp://0.0.0.0:0"], "lacks TLS (the tls:// scheme with --tls-cert FILE and --tls-key FILE) and tokens"),
        (["--listen", "tcp://0.0.0.0:0", "--auth-tokens", "{tokens}"], "lacks TLS (the tls:// scheme"),
        (["--listen", "tls://0.0.0.0:0", "--tls-cert", "{cert}", "--tls-key", "{key}"], "lacks tokens (--auth-tokens FILE)"),
        (["--listen", "tcp://127.0.0.1:0", "--metrics-listen", "tcp://0.0.0.0:0", "--auth-tokens", "{tokens}"],
         "--metrics-listen tcp://0.0.0.0:0: 0.0.0.0 is not a loopback address"),
        (["--listen", "tls://127.0.0.1:0"], "a tls:// --listen needs --tls-cert FILE and --tls-key FILE"),
        (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
        (["--rate-limit-rps", "5"], "--rate-limit-rps limits requests per token: it needs --auth-tokens FILE"),
        (["--rate-limit-rps", "0", "--auth-tokens", "{tokens}"], "--rate-limit-rps must be a positive number"),
        (["--audit-log", "/tmp/x.log"], "--audit-log records authentications: it needs --auth-tokens FILE"),
    ],
)
def test_bad_setups_exit_2_naming_the_flag(setup: Setup, args: list[str], message: str) -> None:
    run = _serve(*[a.format(tokens=setup.tokens, cert=setup.cert, key=setup.key) for a in args])
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert "listening on" not in run.stderr


def test_a_bad_certificate_exits_1(setup: Setup) -> None:
    run = _serve("--listen", "tls://127.0.0.1:0", "--tls-cert", setup.key, "--tls-key", setup.key)
    assert run.returncode == 1 and "cannot load the certificate and its key" in run.stderr


def test_a_remote_tls_bind_with_tokens_is_accepted(setup: Setup) -> None:
    with ServerProcess(
        "--ephemeral", "--listen", "tls://0.0.0.0:0", "--auth-tokens", setup.tokens,
        "--tls-cert", setup.cert, "--tls-key", setup.key,
    ) as proc:
        (url,) = proc.wait_listening(1)
        assert url.startswith("tls://0.0.0.0:")


def test_the_auth_and_tls_config_tables() -> None:
    from acp_server.config import ConfigError, parse_config

    cfg = parse_config('[auth]\ntokens = "/t"\naudit_log = "/a"\nrate_limit_rps = 2.5\n[tls]\ncert = "/c"\nkey = "/k"\n'
                       "handshake_timeout_s = 2\n")
    assert (cfg.auth.tokens, cfg.auth.audit_log, cfg.auth.rate_limit_rps) == ("/t", "/a", 2.5)
    assert (cfg.tls.cert, cfg.tls.key, cfg.tls.handshake_timeout_s) == ("/c", "/k", 2)
    with pytest.raises(ConfigError, match="auth.secret: unknown key"):
        parse_config('[auth]\nsecret = "x"\n')


async def test_our_sdk_over_tls_with_a_token(setup: Setup, server: tuple[ServerProcess, str, str]) -> None:
    from acp_server.client import connect
    from acp_server.client.errors import RpcError as ClientRpcError

    _, tls_url, tcp_url = server
    async with connect(tls_url, token=setup.secrets["acme"], ca_file=setup.ca) as client:
        session = await client.new_session("/tmp")
        result = await session.prompt("hello")
        assert result.stop_reason == "end_turn"
    with pytest.raises(ClientRpcError) as info:
        async with connect(tcp_url, token="wrong"):
            pass
    assert info.value.kind == "auth_required"
    other = setup.dir / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    for ca in (str(other), None):  # another CA; the system store
        with pytest.raises(ConnectionError) as refused:
            async with connect(tls_url, token=setup.secrets["acme"], ca_file=ca):
                pass
        assert "the server's certificate is not trusted" in str(refused.value) and "--ca-file" in str(refused.value)


def test_the_sessions_command_takes_the_token_from_the_environment(
    setup: Setup, server: tuple[ServerProcess, str, str]
) -> None:
    _, tls_url, _ = server
    base = [sys.executable, "-m", "acp_server", "sessions", "--connect", tls_url, "--ca-file", setup.ca]
    env = {**os.environ, "ACP_SERVER_TOKEN": setup.secrets["beta"]}
    run = subprocess.run(base, capture_output=True, text=True, timeout=30, env=env)
    assert run.returncode == 0, run.stderr
    env["ACP_SERVER_TOKEN"] = "wrong"
    run = subprocess.run(base, capture_output=True, text=True, timeout=30, env=env)
    assert run.returncode == 1 and "auth_required" in run.stderr and "wrong" not in run.stderr


def test_the_official_sdk_over_tls_through_connect(setup: Setup) -> None:
    """The official SDK's whole scenario through ``acp-server connect tls://...``: the relay wraps the
    stream in TLS (the CA via ``SSL_CERT_FILE``, read by the system trust store) and authenticates with
    ``ACP_SERVER_TOKEN`` after the SDK's ``initialize``, keeping that answer from the SDK."""
    from .test_e2e_sdk import DRIVER

    admin = new_secret()
    records = load_tokens(setup.tokens)
    records["ops"] = TokenRecord("ops", bytes.fromhex(hash_secret(admin)), "ops", frozenset({"admin"}))
    write_tokens(setup.tokens, records.values())
    with ServerProcess(
        "--ephemeral", "--listen", "tls://127.0.0.1:0", "--echo-delay-ms", "500", "--auth-tokens", setup.tokens,
        "--tls-cert", setup.cert, "--tls-key", setup.key, "--audit-log", setup.audit,
    ) as proc:
        (url,) = proc.wait_listening()
        env = {**os.environ, "ACP_SERVER_TOKEN": admin, "SSL_CERT_FILE": setup.ca}
        run = subprocess.run(
            [sys.executable, str(DRIVER), f"connect:{url.replace('127.0.0.1', 'localhost')}"],
            capture_output=True, text=True, timeout=90, env=env,
        )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    context = f"summary: {json.dumps(summary, indent=1)}\ndriver stderr: {run.stderr}"
    assert summary["failures"] == [] and summary["sdkErrors"] == [], context
    assert summary["first"]["stopReason"] == "end_turn" and summary["cancelled"]["stopReason"] == "cancelled", context
    assert admin not in run.stderr and admin not in run.stdout
    assert any(e["event"] == "auth_ok" and e["tokenId"] == "ops" for e in _audit(setup))
