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
