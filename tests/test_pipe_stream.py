"""The stdio stream (``PipeStream``): I/O first, waiting only when it must, and trio's stream contract."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from acp_server.transports import PipeStream


@pytest.fixture
async def pair() -> AsyncIterator[tuple[PipeStream, PipeStream]]:
    """Two streams over two pipes, each the other's peer."""
    a_read, b_write = os.pipe()
    b_read, a_write = os.pipe()
    a, b = PipeStream(a_read, a_write), PipeStream(b_read, b_write)
    yield a, b
    await a.aclose()
    await b.aclose()


async def test_a_payload_larger_than_the_pipe_arrives_whole(pair: tuple[PipeStream, PipeStream]) -> None:
    """send_all waits for room when the pipe is full; the reader gets every byte, in order."""
    a, b = pair
    payload = bytes(range(256)) * 16384  # 4 MiB, far over a pipe's 64 KiB
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(payload):
            received.extend(await b.receive_some(65536))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await a.send_all(payload)
    assert bytes(received) == payload


async def test_after_a_short_read_it_waits_for_the_next_bytes(pair: tuple[PipeStream, PipeStream]) -> None:
    """A read that emptied the pipe is followed by a wait, which the next write ends."""
    a, b = pair
    await a.send_all(b"first\n")
    assert await b.receive_some(100) == b"first\n"
    got: list[bytes] = []

    async def reader() -> None:
        got.append(await b.receive_some(100))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # parked on readability, not spinning
            await a.send_all(b"second\n")
    assert got == [b"second\n"]


async def test_receive_some_is_a_checkpoint_even_when_data_is_ready(pair: tuple[PipeStream, PipeStream]) -> None:
    a, b = pair
    await a.send_all(b"x" * 10)
    with trio.testing.assert_checkpoints():
        assert await b.receive_some(4) == b"xxxx"  # a full read: the next one reads at once
    with trio.testing.assert_checkpoints():
        assert await b.receive_some(4) == b"xxxx"


async def test_end_of_input_and_closing(pair: tuple[PipeStream, PipeStream]) -> None:
    """EOF reads as b""; aclose wakes a waiting reader with ClosedResourceError; later calls fail."""
    a, b = pair
    await a.send_eof()
    assert await b.receive_some() == b""
    with pytest.raises(trio.ClosedResourceError):
        await a.send_all(b"late")

    async def wait_for_bytes() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await a.receive_some()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_bytes)
            await trio.testing.wait_all_tasks_blocked()
            await a.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await a.receive_some()


async def test_writing_to_a_pipe_nobody_reads_is_broken(pair: tuple[PipeStream, PipeStream]) -> None:
    a, b = pair
    await b.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await a.send_all(b"nobody listens\n")


async def test_a_cancelled_send_all_raises_before_writing(pair: tuple[PipeStream, PipeStream]) -> None:
    a, b = pair
    with trio.CancelScope() as scope:
        scope.cancel()
        await a.send_all(b"never\n")
    assert scope.cancelled_caught
    await a.send_all(b"after\n")
    assert await b.receive_some() == b"after\n"
