"""The connection gate counts the sockets of every listener together: TCP and Unix share one limit."""

from __future__ import annotations

import json
import shutil
import tempfile
from functools import partial
from pathlib import Path

import trio

from acp_server.transports import ConnectionGate, serve_tcp, serve_unix


async def test_tcp_and_unix_share_one_limit() -> None:
    directory = Path(tempfile.mkdtemp(prefix="acp-", dir="/tmp"))
    gate = ConnectionGate(2)
    release = trio.Event()

    async def hold(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"hello\n")
        await release.wait()

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                (tcp_listener,) = await nursery.start(partial(serve_tcp, host="127.0.0.1", gate=gate), hold, 0)
                port = tcp_listener.socket.getsockname()[1]
                path = str(directory / "s")
                await nursery.start(partial(serve_unix, gate=gate), hold, path)
                first = await trio.open_tcp_stream("127.0.0.1", port)
                second = await trio.open_unix_socket(path)
                assert await first.receive_some() == b"hello\n"
                assert await second.receive_some() == b"hello\n"
                assert gate.open == 2
                for opener in (partial(trio.open_tcp_stream, "127.0.0.1", port), partial(trio.open_unix_socket, path)):
                    extra = await opener()
                    data = b""
                    while chunk := await extra.receive_some():
                        data += chunk
                    note = json.loads(data)
                    assert note == {
                        "jsonrpc": "2.0",
                        "method": "_acp_server/evicted",
                        "params": {"limit": 2, "reason": "too_many_connections"},
                    }
                    await extra.aclose()
                assert gate.refused == 2
                await first.aclose()
                release.set()
                await second.aclose()
                with trio.fail_after(5):
                    while gate.open:  # noqa: ASYNC110 - a counter of the gate, no event to wait on
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def test_http_listener_counts_in_the_same_gate_and_refuses_with_503() -> None:
    from acp_server.transports.address import ListenAddress
    from acp_server.transports.http import HttpOptions, serve_http

    gate = ConnectionGate(2)
    release = trio.Event()

    async def hold(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"hello\n")
        await release.wait()

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            (tcp_listener,) = await nursery.start(partial(serve_tcp, host="127.0.0.1", gate=gate), hold, 0)
            tcp_port = tcp_listener.socket.getsockname()[1]
            url = await nursery.start(
                partial(serve_http, gate=gate), hold, ListenAddress("tcp", "127.0.0.1", 0), HttpOptions()
            )
            http_port = int(url.rsplit(":", 1)[1])
            first = await trio.open_tcp_stream("127.0.0.1", tcp_port)
            assert await first.receive_some() == b"hello\n"
            idle_http = await trio.open_tcp_stream("127.0.0.1", http_port)  # holds a place, sends nothing
            while gate.open < 2:  # noqa: ASYNC110 - a counter of the gate, no event to wait on
                await trio.sleep(0.01)
            extra = await trio.open_tcp_stream("127.0.0.1", http_port)
            await extra.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while chunk := await extra.receive_some():
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ")
            assert b"Retry-After: 1" in head
            assert json.loads(body) == {
                "error": "The server holds its limit of 2 connections (--max-connections); retry later",
                "code": "too_many_connections",
                "limit": 2,
                "retryAfterMs": 1000,
            }
            assert gate.refused == 1
            await extra.aclose()
            await idle_http.aclose()
            await first.aclose()
            release.set()
            nursery.cancel_scope.cancel()
