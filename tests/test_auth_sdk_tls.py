"""Both SDKs over TLS with ``trustme`` certificates: ours over ``tls://``, ``https://`` and ``wss://``
(``ca_file``), a wrong CA failing clearly on each; the official SDK (0.12.1) with its own streams over
TLS: its Streamable HTTP client on an httpx client trusting the CA (HTTP/2 by ALPN), its WebSocket
client over ``wss://``, and its NDJSON connection over an asyncio TLS stream to ``tls://``, each
running the whole scenario of ``tests/sdk_driver.py`` against a real ``acp-server serve``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio

from acp_server.auth.tls import ServerTls, tls_handler
from acp_server.client import connect
from acp_server.transports import serve_tcp

from .http_helpers import TIMEOUT_S
from .test_e2e_sdk import DRIVER, ECHO_DELAY_MS, ServerProcess
from .tls_helpers import CertFiles, https_server, write_certs

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def certs(tmp_path: pathlib.Path) -> CertFiles:
    return write_certs(tmp_path)


@asynccontextmanager
async def tls_and_https(certs: CertFiles) -> AsyncIterator[dict[str, str]]:
    """One server with a ``tls://`` NDJSON listener and an ``https://`` HTTP listener; yields the
    three URLs our SDK takes."""
    async with https_server(certs) as (server, nursery, url, tls):
        ndjson_tls = ServerTls(certs.cert, certs.key)
        handler = tls_handler(server.handle_stream, ndjson_tls, "tls test")
        listeners = await nursery.start(partial(serve_tcp, host="127.0.0.1"), handler, 0)
        port = listeners[0].socket.getsockname()[1]
        yield {
            "tls": f"tls://localhost:{port}",
            "https": url.replace("127.0.0.1", "localhost") + "/acp",
            "wss": url.replace("https://127.0.0.1", "wss://localhost") + "/acp",
        }


@pytest.mark.parametrize("scheme", ["tls", "https", "wss"])
async def test_our_sdk_prompts_over_each_tls_scheme(certs: CertFiles, scheme: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with tls_and_https(certs) as urls:
            async with connect(urls[scheme], ca_file=certs.ca) as client:
                session = await client.new_session("/tmp")
                result = await session.prompt(f"hello over {scheme}")
                assert result.stop_reason == "end_turn"
                listed = [s.session_id for s in await client.list_sessions()]
                assert session.session_id in listed


async def test_a_wrong_ca_fails_clearly_on_each_scheme(certs: CertFiles, tmp_path: pathlib.Path) -> None:
    """Another CA, and the system trust store (which does not hold the test CA): a ``ConnectionError``
    naming the URL, saying the certificate is not trusted and naming ``--ca-file``."""
    other = write_certs(tmp_path, name="other")
    with trio.fail_after(TIMEOUT_S):
        async with tls_and_https(certs) as urls:
            for scheme, url in urls.items():
                for ca in (other.ca, None):
                    with pytest.raises(ConnectionError) as refused:
                        async with connect(url, ca_file=ca):
                            pass
                    message = str(refused.value)
                    shown = url if scheme != "tls" else url.removesuffix("/acp")
                    assert message.startswith(shown), (scheme, message)
                    assert "the server's certificate is not trusted" in message and "--ca-file" in message, message


def test_the_cli_over_https_and_wss(certs: CertFiles) -> None:
    """``acp-server prompt --connect https://...`` without the CA: exit 1 and the message names
    ``--ca-file``; with ``--ca-file``, or with the CA in the system trust store (``SSL_CERT_FILE``),
    the prompt runs; ``acp-server connect wss://... --ca-file`` relays an ``initialize``."""
    with ServerProcess("--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "https://127.0.0.1:0",
                       "--tls-cert", certs.cert, "--tls-key", certs.key) as server:
        url = _wait_http(server)
        base = [sys.executable, "-m", "acp_server", "prompt", "--connect", url + "/acp"]
        env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
        run = subprocess.run([*base, "hello"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert run.returncode == 1 and "--ca-file" in run.stderr, run.stderr
        run = subprocess.run([*base, "--ca-file", certs.ca, "hello"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        assert "hello" in run.stdout
        env["SSL_CERT_FILE"] = certs.ca
        run = subprocess.run([*base, "from the store"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert run.returncode == 0 and "from the store" in run.stdout, run.stderr
        wss = url.replace("https://", "wss://") + "/acp"
        init = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}})
        with subprocess.Popen(
            [sys.executable, "-m", "acp_server", "connect", wss, "--ca-file", certs.ca],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        ) as relay:
            try:
                assert relay.stdin is not None and relay.stdout is not None
                relay.stdin.write(init + "\n")
                relay.stdin.flush()
                answer = json.loads(relay.stdout.readline())  # an editor waits for its answer, then leaves
                relay.stdin.close()
                assert relay.wait(30) == 0
            finally:
                relay.kill()
        assert answer["id"] == 1 and answer["result"]["protocolVersion"] == 1


def _wait_http(server: ServerProcess, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = server.next_stderr_line(deadline, "the 'http on' line")
        if line.startswith("acp-server: http on "):
            return line.split(" on ", 1)[1].replace("127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], CertFiles]]:
    certs = write_certs(tmp_path_factory.mktemp("sdk-tls"))
    with ServerProcess(
        "--ephemeral", "--listen", "tls://127.0.0.1:0", "--http-listen", "https://127.0.0.1:0",
        "--tls-cert", certs.cert, "--tls-key", certs.key, "--echo-delay-ms", str(ECHO_DELAY_MS),
    ) as server:
        (tls_url,) = server.wait_listening()
        https = _wait_http(server)
        yield {
            "tls": tls_url.replace("127.0.0.1", "localhost"),
            "https": https + "/acp",
            "wss": https.replace("https://", "wss://") + "/acp",
        }, certs


@pytest.mark.parametrize("scheme", ["https", "wss", "tls"])
def test_the_official_sdk_over_its_own_tls_streams(tls_server: tuple[dict[str, str], CertFiles], scheme: str) -> None:
    urls, certs = tls_server
    env = {**os.environ, "SSL_CERT_FILE": certs.ca}
    run = subprocess.run(
        [sys.executable, str(DRIVER), urls[scheme]], capture_output=True, text=True, timeout=90, env=env, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    summary: dict[str, Any] = json.loads(run.stdout)
    context = f"summary: {json.dumps(summary, indent=1)}\ndriver stderr: {run.stderr[-3000:]}"
    assert summary["failures"] == [] and summary["sdkErrors"] == [], context
    for phase in ("first", "after"):
        assert summary[phase]["stopReason"] == "end_turn", context
        assert summary[phase]["text"] == summary[phase]["sent"], context
    assert summary["concurrent"]["stopReasons"] == ["end_turn"] * 3, context
    assert summary["cancelled"]["stopReason"] == "cancelled", context
    assert summary["pendingPromptsAtEnd"] == 0, context
    validated = summary["validated"]
    assert validated["AgentResponseMessage"] + validated["AgentNotification"] == summary["received"], context
    if scheme != "https":
        return
    # without the CA the SDK's TLS fails at its handshake: the driver does not get through (once: the
    # three share the trust store's handling, and each run costs an SDK start)
    run = subprocess.run(
        [sys.executable, str(DRIVER), urls[scheme]], capture_output=True, text=True, timeout=90,
        env={k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}, cwd=ROOT,
    )
    assert run.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in run.stderr, run.stderr[-2000:]
