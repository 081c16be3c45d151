"""The HTTP listener's socket layer (``transports/http/wire.py``): hypercorn's keep-alive bound between
requests with one timer per connection, and writes queued whole and in order."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from hypercorn.config import Config

from acp_server.transports.http.listener import serve_app
from acp_server.transports.http.wire import BatchedWrites
from acp_server.transports.listeners import bind_tcp_socket

KEEP_ALIVE_S = 0.5


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/slow?S`` answers after S seconds; any other path at once; each body names the path."""
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] == "/slow":
        await trio.sleep(float(scope["query_string"] or b"0"))
    body = scope["path"].encode() * 200
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def _listener(keep_alive_s: float = KEEP_ALIVE_S) -> AsyncIterator[int]:
    config = Config()
    config.keep_alive_timeout = keep_alive_s
    config.accesslog = None
    sock = trio.SocketListener(await bind_tcp_socket("127.0.0.1", 0))
    async with sock, trio.open_nursery() as nursery:
        await nursery.start(serve_app, _app, config, sock)
        yield sock.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


async def _read_answers(stream: trio.SocketStream, count: int) -> list[bytes]:
    """``count`` whole answers (their bodies), read off ``stream``."""
    data = b""
    bodies: list[bytes] = []
    with trio.fail_after(10):
        while len(bodies) < count:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].decode()
                length = int(head.lower().split("content-length:")[1].split("\r\n")[0])
                if len(data) >= head_end + 4 + length:
                    assert head.startswith("HTTP/1.1 200")
                    bodies.append(data[head_end + 4:head_end + 4 + length])
                    data = data[head_end + 4 + length:]
                    continue
            chunk = await stream.receive_some()
            assert chunk, f"the server closed the connection after {len(bodies)} answer(s)"
            data += chunk
    return bodies


async def _closed_within(stream: trio.SocketStream, seconds: float) -> float:
    """How long until the server closes ``stream`` (fails past ``seconds``)."""
    started = trio.current_time()
    with trio.fail_after(seconds):
        while True:
            try:
                if not await stream.receive_some():
                    break
            except trio.BrokenResourceError:
                break
    return trio.current_time() - started


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    async with _listener() as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(_get("/a"))
            assert await _read_answers(stream, 1) == [b"/a" * 200]
            waited = await _closed_within(stream, KEEP_ALIVE_S * 8)
            assert waited >= KEEP_ALIVE_S * 0.8


async def test_the_timer_restarts_after_each_request_and_spares_a_slow_one() -> None:
    # a bound of 1.5 s and gaps of 0.3 s: each gap has 1.2 s to spare for a loaded machine's hiccups
    # (with 0.5 s and 0.25 s a parallel `make test` could stall the client past the bound)
    bound = 1.5
    async with _listener(bound) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            # idle gaps shorter than the bound, over more than the bound in all: the connection stays
            for i in range(6):
                await stream.send_all(_get(f"/r{i}"))
                assert await _read_answers(stream, 1) == [f"/r{i}".encode() * 200]
                await trio.sleep(bound / 5)
            # a request served longer than the bound is not idle time
            await stream.send_all(_get(f"/slow?{bound * 2}"))
            assert await _read_answers(stream, 1) == [b"/slow" * 200]
            # and the bound still holds once it is answered
            await _closed_within(stream, bound * 8)


async def test_pipelined_requests_are_answered_whole_and_in_order() -> None:
    async with _listener() as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            paths = [f"/p{i}" for i in range(20)]
            await stream.send_all(b"".join(_get(p) for p in paths))
            assert await _read_answers(stream, len(paths)) == [p.encode() * 200 for p in paths]


class _Recorder(trio.abc.HalfCloseableStream):
    """A stream that records each ``send_all``."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_send_nowait_refuses_past_the_bound_and_send_all_waits_for_room() -> None:
    recorder = _Recorder()
    batched = BatchedWrites(recorder, limit=4, socket=object())
    assert batched.send_nowait(b"1234")
    assert not batched.send_nowait(b"5")  # past the bound: the caller must wait (send_all)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batched.flusher)
        with trio.fail_after(5):
            await batched.send_all(b"5")
        await batched._drain()
        nursery.cancel_scope.cancel()
    assert b"".join(recorder.writes) == b"12345"
