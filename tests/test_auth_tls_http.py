"""HTTPS on the HTTP and metrics listeners, with ``trustme`` certificates over real loopback sockets.

``/acp`` over HTTP/2 and HTTP/1.1 (ALPN), ``wss://``, a silent and a plain-HTTP client on the TLS port
dropped after the handshake timeout while others are served, certificates reloaded (in process, and by
SIGHUP on a real ``acp-server serve`` whose ``--http-listen`` and ``--metrics-listen`` are
``https://``), and the command line's checks of those flags.
"""

from __future__ import annotations

import pathlib
import signal
import ssl
import time

import httpx
import pytest
import trio
import trustme

from acp_server.auth.tls import HTTP_ALPN, client_context
from acp_server.client.websocket import open_websocket
from acp_server.metrics import serve_metrics
from acp_server.server import ListenAddress

from .helpers import RawClient, running_server
from .http_helpers import TIMEOUT_S, http_peer
from .test_e2e_sdk import ServerProcess
from .tls_helpers import CertFiles, https_server, replace_certs, write_certs


@pytest.fixture
def certs(tmp_path: pathlib.Path) -> CertFiles:
    return write_certs(tmp_path)


async def _handshake(port: int, ca_file: str, alpn: tuple[str, ...] = ()) -> trio.SSLStream[trio.SocketStream]:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, client_context(ca_file, alpn=alpn), server_hostname="localhost", https_compatible=True)
    try:
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


@pytest.mark.parametrize("http2", [True, False])
async def test_acp_over_https_with_h2_and_http11(certs: CertFiles, http2: bool) -> None:
    """A whole ``/acp`` exchange (initialize, session, a prompt on its event stream) over HTTPS; the
    protocol is the one ALPN chose, and the listener prints and reports an ``https://`` URL."""
    with trio.fail_after(TIMEOUT_S):
        async with https_server(certs) as (_server, nursery, url, _tls):
            assert url.startswith("https://127.0.0.1:")
            async with http_peer(url, nursery, verify=client_context(certs.ca), http2=http2) as peer:
                health = await peer.client.get(url + "/health")
                assert health.status_code == 200 and health.json() == {"status": "ok"}
                assert health.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
                await peer.initialize()
                sid = await peer.new_session()
                answer = await peer.prompt(sid, "over tls")
                assert answer["result"]["stopReason"] == "end_turn"


async def test_alpn_offers_h2_then_http11(certs: CertFiles) -> None:
    async with https_server(certs) as (_s, _n, url, _tls):
        for offered, chosen in [(HTTP_ALPN, "h2"), (("http/1.1",), "http/1.1"), (("spdy/3",), None)]:
            stream = await _handshake(_port(url), certs.ca, offered)
            assert stream.selected_alpn_protocol() == chosen
            await stream.aclose()


async def test_wss_carries_acp(certs: CertFiles) -> None:
    """``/acp`` over ``wss://``: our WebSocket client verifies the certificate against ``--ca-file``."""
    with trio.fail_after(TIMEOUT_S):
        async with https_server(certs) as (_s, nursery, url, _tls):
            wss = url.replace("https://", "wss://") + "/acp"
            async with open_websocket(wss, certs.ca) as ws_stream:
                ws = RawClient(ws_stream)
                nursery.start_soon(ws.pump)
                await ws.initialize()
                sid, _ = await ws.new_session()
                assert (await ws.prompt(sid, "over wss"))["stopReason"] == "end_turn"
                assert ws.agent_text(sid) == "over wss"


async def test_a_wrong_ca_fails_clearly_over_https_and_wss(certs: CertFiles, tmp_path: pathlib.Path) -> None:
    other = write_certs(tmp_path, name="other")
    async with https_server(certs) as (_s, _n, url, _tls):
        with pytest.raises(ConnectionError) as caught:
            async with open_websocket(url.replace("https://", "wss://") + "/acp", other.ca):
                pass
        message = str(caught.value)
        assert message.startswith("wss://127.0.0.1:") and "not trusted" in message and "--ca-file" in message
        async with httpx.AsyncClient(verify=client_context(other.ca)) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/health")


async def test_silent_and_plain_clients_are_dropped_while_others_are_served(
    certs: CertFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """A TCP client that never speaks holds no more than the handshake timeout; a plain-HTTP request
    on the TLS port is closed; HTTPS requests made meanwhile are answered."""
    caplog.set_level("INFO", logger="acp_server.http")
    with trio.fail_after(TIMEOUT_S):
        async with https_server(certs, handshake_timeout_s=0.5) as (_s, _n, url, _tls):
            port = _port(url)
            # before the silent client connects: the server's handshake timer cannot start earlier
            started = trio.current_time()
            silent = await trio.open_tcp_stream("127.0.0.1", port)
            plain = await trio.open_tcp_stream("127.0.0.1", port)
            async with silent, plain:  # closed even when an assertion fails (no socket left to the GC)
                await plain.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                async with httpx.AsyncClient(verify=client_context(certs.ca)) as client:
                    for _ in range(3):
                        assert (await client.get(url + "/health")).status_code == 200
                # the plain client gets no HTTP answer: its bytes were not a TLS hello
                leftover = b""
                with trio.move_on_after(3):
                    while chunk := await plain.receive_some(4096):
                        leftover += chunk
                assert b"HTTP/1.1" not in leftover
                with trio.fail_after(3):
                    assert await silent.receive_some(1) == b""  # closed by the server
                assert trio.current_time() - started >= 0.4
                async with httpx.AsyncClient(verify=client_context(certs.ca)) as client:
                    assert (await client.get(url + "/health")).status_code == 200  # still serving
    reasons = [r.getMessage() for r in caplog.records if "TLS handshake" in r.getMessage()]
    assert any("timeout" in r for r in reasons) and any("failed" in r for r in reasons), reasons


async def test_reload_takes_new_certificates_for_new_connections(certs: CertFiles, tmp_path: pathlib.Path) -> None:
    """``ServerTls.reload`` (what SIGHUP runs) reaches the HTTPS listener's ALPN sibling: a handshake
    after it shows the new certificate; a connection made before it keeps working."""
    async with https_server(certs) as (_s, _n, url, tls):
        async with httpx.AsyncClient(verify=client_context(certs.ca)) as before:
            assert (await before.get(url + "/health")).status_code == 200
            fresh = write_certs(tmp_path, name="fresh")
            replace_certs(certs, fresh)
            assert tls.reload() is None
            assert (await before.get(url + "/health")).status_code == 200  # its connection stays
        stream = await _handshake(_port(url), fresh.ca, HTTP_ALPN)
        assert stream.selected_alpn_protocol() == "h2"
        await stream.aclose()
        with pytest.raises(trio.BrokenResourceError):
            await _handshake(_port(url), certs.ca, HTTP_ALPN)


async def test_metrics_over_https(certs: CertFiles) -> None:
    from acp_server.auth.tls import ServerTls

    tls = ServerTls(certs.cert, certs.key)
    async with running_server() as (server, nursery):
        host, port = await nursery.start(
            lambda task_status: serve_metrics(
                server.stats_snapshot, ListenAddress("https", host="127.0.0.1", port=0), tls=tls, task_status=task_status
            )
        )
        async with httpx.AsyncClient(verify=client_context(certs.ca), http2=True) as client:
            r = await client.get(f"https://localhost:{port}/metrics")
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        assert "acp_server_" in r.text
        with pytest.raises(ValueError, match="https:// needs --tls-cert"):
            await serve_metrics(lambda: {}, ListenAddress("https", host="127.0.0.1", port=0))


def _wait_line(server: ServerProcess, prefix: str, deadline: float) -> str:
    while True:
        line = server.next_stderr_line(deadline, f"a line starting {prefix!r}")
        if line.startswith(prefix):
            return line


def _peer_certificate(port: int, ca_file: str) -> bytes:
    context = ssl.create_default_context(cafile=ca_file)
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_serve_https_and_metrics_https_then_sighup_reloads_both(certs: CertFiles, tmp_path: pathlib.Path) -> None:
    """``acp-server serve --http-listen https://... --metrics-listen https://...``: both announce
    ``https://`` URLs and answer over TLS; after the files are replaced and SIGHUP is sent, new
    handshakes on both show the new certificate while the process keeps serving."""
    with ServerProcess(
        "--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "https://127.0.0.1:0",
        "--metrics-listen", "https://127.0.0.1:0", "--tls-cert", certs.cert, "--tls-key", certs.key,
    ) as server:
        deadline = time.monotonic() + 20
        metrics_url = _wait_line(server, "acp-server: metrics on ", deadline).split(" on ", 1)[1]
        http_url = _wait_line(server, "acp-server: http on ", deadline).split(" on ", 1)[1]
        assert metrics_url.startswith("https://127.0.0.1:") and metrics_url.endswith("/metrics")
        assert http_url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=client_context(certs.ca)) as client:
            assert client.get(http_url + "/health").json() == {"status": "ok"}
            assert "acp_server_" in client.get(metrics_url).text
        ports = [_port(http_url), _port(metrics_url)]
        old = [_peer_certificate(p, certs.ca) for p in ports]
        fresh = write_certs(tmp_path, trustme.CA(), name="fresh")
        replace_certs(certs, fresh)
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            try:
                new = [_peer_certificate(p, fresh.ca) for p in ports]
                break
            except ssl.SSLError:
                assert time.monotonic() < deadline, "the certificates were not reloaded"
                time.sleep(0.1)
        assert new != old
        with httpx.Client(verify=client_context(fresh.ca)) as client:
            assert client.get(http_url + "/health").status_code == 200
        assert server.proc.poll() is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--http-listen", "https://127.0.0.1:0"], "an https:// --http-listen needs --tls-cert FILE and --tls-key FILE"),
        (["--metrics-listen", "https://127.0.0.1:0"], "an https:// --metrics-listen needs --tls-cert FILE and --tls-key FILE"),
        (["--http-listen", "tls://127.0.0.1:0"], "HTTP over TLS is https://HOST:PORT"),
        (["--metrics-listen", "unix:/tmp/m.sock"], "metrics are served over HTTP"),
    ],
)
def test_https_flags_are_checked(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from acp_server.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--ephemeral", *argv])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
