"""The outbox's end-of-pass writes: what a scheduling pass queued leaves in one write as it ends, the
writer task takes over when the kernel takes less than all of it, and a failed write closes."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from acp_server.transports.listeners import PipeStream
from acp_server.transports.outbox import Outbox


class _Box(Outbox):
    """An outbox alone (the shell's close is a flag here)."""

    __slots__ = ("closes",)

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream, "test", max_outbound_bytes=1 << 30, refusal_latency=None)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        self._closed = True


class _CountingPipe(PipeStream):
    def __init__(self, receive_fd: int, send_fd: int) -> None:
        super().__init__(receive_fd, send_fd)
        self.nowait: list[int] = []
        self.waited: list[int] = []

    def write_nowait(self, data: bytes) -> int:
        sent = super().write_nowait(data)
        self.nowait.append(sent)
        return sent

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.waited.append(len(data))
        await super().send_all(data)


async def _read_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        chunk = await stream.receive_some(65536)
        assert chunk, "the stream ended early"
        got += chunk
    return bytes(got)


@asynccontextmanager
async def _pipe_box() -> AsyncIterator[tuple[_CountingPipe, PipeStream, _Box, trio.Nursery]]:
    """An outbox on a counting pipe, its writer task parked; the peer's end of the pipe; the nursery
    (cancelled and both ends closed on exit)."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pipe = _CountingPipe(r2, w1)
    peer = PipeStream(r1, w2)
    box = _Box(pipe)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box._writer)
        await trio.testing.wait_all_tasks_blocked()
        yield pipe, peer, box, nursery
        nursery.cancel_scope.cancel()
    await pipe.aclose()
    await peer.aclose()


async def test_one_pass_of_messages_is_one_write_without_the_writer() -> None:
    async with _pipe_box() as (pipe, peer, box, nursery):
        box.send(b"one\n")
        box.send(b"two\n")
        box.reply(b"three\n")
        assert await _read_exactly(peer, 14) == b"one\ntwo\nthree\n"
        assert pipe.nowait == [14] and pipe.waited == []
        assert box._drained


async def test_a_full_pipe_hands_the_rest_to_the_writer_in_order() -> None:
    parts = [bytes([65 + i % 26]) * 50_000 + b"\n" for i in range(12)]  # ~600 KB, far over a pipe's buffer
    expected = b"".join(parts)
    async with _pipe_box() as (pipe, peer, box, nursery):
        for part in parts:
            box.reply(part)
        assert await _read_exactly(peer, len(expected)) == expected
        assert pipe.nowait and pipe.nowait[0] < len(expected)  # the pipe took part of it at the pass's end
        assert pipe.waited, "the writer task did not take the rest"
        await trio.testing.wait_all_tasks_blocked()
        assert box._drained and not box._out
        box.reply(b"after\n")  # the writer parked again: the next pass's end writes this
        assert await _read_exactly(peer, 6) == b"after\n"


async def test_a_failed_write_at_the_end_of_a_pass_closes_through_the_writer() -> None:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pipe = _CountingPipe(r2, w1)
    box = _Box(pipe)
    os.close(r1)  # the peer is gone: the write fails (EPIPE)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:  # the writer ends once it met the error
            nursery.start_soon(box._writer)
            await trio.testing.wait_all_tasks_blocked()
            box.reply(b"lost\n")
    assert box.closes == 1
    assert box._drained and not box._out
    await pipe.aclose()
    os.close(w2)


async def test_a_socket_is_written_at_the_end_of_the_pass() -> None:
    a, b = socket.socketpair()
    ours, theirs = trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.SocketStream(trio.socket.from_stdlib_socket(b))
    box = _Box(ours)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box._writer)
        await trio.testing.wait_all_tasks_blocked()
        assert box._flusher is not None  # a plain socket takes the direct path
        box.send(b'{"a":1}\n')
        assert box._flusher.dirty == [box]  # marked for the end of the pass
        box.reply(b'{"b":2}\n')  # the pass's first answer: both written at once, the mark dropped
        assert box._flusher.dirty == [] and not box._out
        assert await _read_exactly(theirs, 16) == b'{"a":1}\n{"b":2}\n'
        nursery.cancel_scope.cancel()
    await ours.aclose()
    await theirs.aclose()


async def test_a_held_outbox_waits_one_pass_for_the_answer() -> None:
    async def answer_next_pass() -> None:
        box.reply(b"answer\n")

    async with _pipe_box() as (pipe, peer, box, nursery):
        box.send(b"accepted\n")
        box.hold()
        nursery.start_soon(answer_next_pass)  # runs in the next pass
        assert await _read_exactly(peer, 16) == b"accepted\nanswer\n"
        assert pipe.nowait == [16]


async def test_a_hold_renewed_every_pass_delays_the_output_once() -> None:
    passes: list[int] = []

    async def holding_every_pass() -> None:
        # a peer whose requests keep coming: each pass another dispatch holds the outbox
        for _ in range(50):
            box.hold()
            await trio.lowlevel.cancel_shielded_checkpoint()

    async with _pipe_box() as (pipe, peer, box, nursery):
        box.send(b"first\n")
        box.hold()
        assert box._flusher is not None
        passes.append(box._flusher.passes)
        nursery.start_soon(holding_every_pass)
        assert await _read_exactly(peer, 6) == b"first\n"
        passes.append(box._flusher.passes)
        assert passes[1] - passes[0] <= 2, passes  # written at the end of the next pass, not after the 50


async def test_the_first_answer_of_a_pass_leaves_at_once_and_the_rest_at_its_end() -> None:
    async with _pipe_box() as (pipe, peer, box, nursery):
        for turn in range(2):  # and again in the next pass
            box.send(b"update 1\n")
            box.reply(b"answer 1\n")
            # written before the pass ends, with what was queued before it
            assert pipe.nowait == [18, 27] * turn + [18]
            box.send(b"update 2\n")
            box.reply(b"answer 2\n")
            box.send(b"update 3\n")
            assert pipe.nowait == [18, 27] * turn + [18]
            assert await _read_exactly(peer, 45) == b"update 1\nanswer 1\nupdate 2\nanswer 2\nupdate 3\n"
            assert pipe.nowait == [18, 27] * (turn + 1)  # the rest: one write as the pass ended
        assert pipe.waited == []
        assert box._drained


async def test_a_busy_writer_takes_the_first_answer_too() -> None:
    big = b"x" * 200_000 + b"\n"  # more than the pipe holds: the writer task takes the rest and waits
    async with _pipe_box() as (pipe, peer, box, nursery):
        box.reply(big)
        assert len(pipe.nowait) == 1 and pipe.nowait[0] < len(big)
        await trio.testing.wait_all_tasks_blocked()
        assert pipe.waited  # the writer waits for the peer to read
        box.reply(b"next\n")  # not written past the bytes before it: the writer sends it after them
        assert len(pipe.nowait) == 1
        assert await _read_exactly(peer, len(big) + 5) == big + b"next\n"


async def test_the_runs_instruments_still_work_once_their_checks_are_a_dict() -> None:
    """Installing the flusher makes the run's hook checks dict lookups; instruments added and removed
    afterwards are called as trio calls them, and one that raises is dropped as trio drops it."""
    from collections import UserDict

    from trio._core._run import GLOBAL_RUN_CONTEXT

    from acp_server.transports.outbox import _run_flusher

    _run_flusher()
    instruments = GLOBAL_RUN_CONTEXT.runner.instruments
    assert not isinstance(instruments, UserDict)
    assert "before_io_wait" in instruments and "after_task_step" not in instruments

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.steps = 0

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            self.steps += 1

    class Broken(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            raise RuntimeError("an instrument that fails")

    steps, broken = Steps(), Broken()
    trio.lowlevel.add_instrument(steps)
    trio.lowlevel.add_instrument(broken)
    await trio.lowlevel.checkpoint()
    assert steps.steps >= 1
    assert "before_task_step" not in instruments  # the broken one was removed, as trio does
    trio.lowlevel.remove_instrument(steps)
    assert "after_task_step" not in instruments
    counted = steps.steps
    await trio.lowlevel.checkpoint()
    assert steps.steps == counted
