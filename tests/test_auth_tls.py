"""TLS over real loopback sockets with trustme certificates: handshakes, a wrong CA, silent and plain
clients closed by the handshake timeout without disturbing others, certificate reload, ALPN."""

from __future__ import annotations

import logging
import pathlib
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trustme

from acp_server.auth.tls import (
    HTTP_ALPN,
    ServerTls,
    TlsConfigError,
    TlsHandshakeError,
    accept_tls,
    client_context,
    describe_tls_failure,
    tls_handler,
)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def cert_files(ca: trustme.CA, tmp_path: pathlib.Path) -> tuple[str, str, str]:
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    return str(cert_path), str(key_path), str(ca_path)


def _overwrite(path: str, text: str) -> None:
    pathlib.Path(path).write_text(text)


async def _echo(stream: trio.abc.Stream) -> None:
    async for data in stream:
        await stream.send_all(data.upper())


@asynccontextmanager
async def _serve(tls: ServerTls, handler: Callable[[trio.abc.Stream], object] = _echo) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, tls_handler(handler, tls, "test"), 0)  # type: ignore[arg-type]
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def _client(port: int, context: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="localhost", https_compatible=True)
    try:
        await stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream


async def test_a_client_trusting_the_ca_completes_the_handshake(cert_files: tuple[str, str, str]) -> None:
    cert, key, ca_file = cert_files
    async with _serve(ServerTls(cert, key)) as port:
        stream = await _client(port, client_context(ca_file))
        await stream.send_all(b"hello")
        assert await stream.receive_some() == b"HELLO"
        await stream.aclose()


async def test_a_wrong_ca_fails_clearly(cert_files: tuple[str, str, str], tmp_path: pathlib.Path) -> None:
    cert, key, _ = cert_files
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    async with _serve(ServerTls(cert, key)) as port:
        for context in (client_context(str(other)), client_context()):  # another CA; the system store
            with pytest.raises(trio.BrokenResourceError) as info:
                await _client(port, context)
            message = describe_tls_failure(info.value)
            assert "the server's certificate is not trusted" in message and "--ca-file" in message
        # the server still serves a good client afterwards
        good = await _client(port, client_context(cert_files[2]))
        await good.send_all(b"x")
        assert await good.receive_some() == b"X"
        await good.aclose()


async def test_a_silent_client_is_dropped_after_the_timeout_while_another_completes(
    cert_files: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    cert, key, ca_file = cert_files
    caplog.set_level(logging.INFO, logger="acp_server.auth.tls")
    async with _serve(ServerTls(cert, key, handshake_timeout_s=0.5)) as port:
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        good = await _client(port, client_context(ca_file))  # while the silent one holds its slot
        await good.send_all(b"ok")
        assert await good.receive_some() == b"OK"
        assert trio.current_time() - start < 0.5
        with trio.fail_after(5):
            assert await silent.receive_some() == b""  # closed by the server
        assert trio.current_time() - start >= 0.45
        # the good connection outlives the silent one's timeout
        await good.send_all(b"still")
        assert await good.receive_some() == b"STILL"
        await good.aclose()
        await silent.aclose()
    assert any("TLS handshake timeout" in r.getMessage() for r in caplog.records)


async def test_a_plain_tcp_client_is_closed(cert_files: tuple[str, str, str], caplog: pytest.LogCaptureFixture) -> None:
    cert, key, ca_file = cert_files
    caplog.set_level(logging.INFO, logger="acp_server.auth.tls")
    async with _serve(ServerTls(cert, key)) as port:
        plain = await trio.open_tcp_stream("127.0.0.1", port)
        await plain.send_all(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}\n')
        with trio.fail_after(5):
            while await plain.receive_some():  # the server may answer with a TLS alert, then closes
                pass
        await plain.aclose()
        good = await _client(port, client_context(ca_file))
        await good.aclose()
    assert any("TLS handshake failed" in r.getMessage() for r in caplog.records)


async def test_accept_tls_raises_and_closes_on_timeout(cert_files: tuple[str, str, str]) -> None:
    cert, key, _ = cert_files
    a, b = trio.testing.memory_stream_pair()
    with pytest.raises(TlsHandshakeError) as info:
        await accept_tls(a, ServerTls(cert, key), timeout_s=0.05)
    assert info.value.reason == "timeout"
    with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
        await a.send_all(b"x")


async def test_reload_swaps_certificates_and_keeps_them_on_failure(
    ca: trustme.CA, cert_files: tuple[str, str, str], tmp_path: pathlib.Path
) -> None:
    cert, key, ca_file = cert_files
    tls = ServerTls(cert, key)
    async with _serve(tls) as port:
        first = await _client(port, client_context(ca_file))
        serial = first.getpeercert()["serialNumber"]
        await first.aclose()
        # a broken key file: reload reports, the old context stays
        _overwrite(key, "not a key")
        error = tls.reload()
        assert error is not None and "--tls-key" in error
        same = await _client(port, client_context(ca_file))
        assert same.getpeercert()["serialNumber"] == serial
        await same.aclose()
        # a new certificate: the next handshake uses it
        fresh = ca.issue_cert("localhost")
        fresh.private_key_and_cert_chain_pem.write_to_path(cert)
        fresh.private_key_pem.write_to_path(key)
        assert tls.reload() is None
        after = await _client(port, client_context(ca_file))
        assert after.getpeercert()["serialNumber"] != serial
        await after.aclose()


async def test_alpn_offers_h2_and_http11(cert_files: tuple[str, str, str]) -> None:
    cert, key, ca_file = cert_files
    http = ServerTls(cert, key).with_alpn(HTTP_ALPN)
    async with _serve(http) as port:
        for offered, chosen in ((["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1")):
            stream = await _client(port, client_context(ca_file, alpn=offered))
            assert stream.selected_alpn_protocol() == chosen
            await stream.aclose()


def test_bad_files_name_the_flag(cert_files: tuple[str, str, str], tmp_path: pathlib.Path) -> None:
    cert, key, ca_file = cert_files
    with pytest.raises(TlsConfigError, match="--tls-cert .*: no such file"):
        ServerTls(str(tmp_path / "absent.pem"), key)
    with pytest.raises(TlsConfigError, match="cannot load the certificate and its key"):
        ServerTls(key, key)
    with pytest.raises(TlsConfigError, match="--tls-handshake-timeout-s must be a positive number"):
        ServerTls(cert, key, handshake_timeout_s=0)
    with pytest.raises(TlsConfigError, match="--ca-file .*: no such file"):
        client_context(str(tmp_path / "absent.pem"))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("nothing here")
    with pytest.raises(TlsConfigError, match="--ca-file .*not a PEM file"):
        client_context(str(garbage))
    assert client_context(ca_file).verify_mode == ssl.CERT_REQUIRED
