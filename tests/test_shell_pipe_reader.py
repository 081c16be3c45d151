"""The shell reads the stdio ``PipeStream`` itself, and waits after a short read instead of reading.

As on a plain socket, ``ConnectionShell.run`` reads the pipe's descriptor with ``os.read`` and waits in
trio's readable wait directly (the epoll manager's own, under ``trio.lowlevel.wait_readable``), not through ``PipeStream.receive_some``; after a read that
emptied the pipe (a short read) it waits before it reads again, so that a request-response peer costs
one read per message and no read that fails with ``EAGAIN``. These tests check that, and a stream
closed behind the waiting reader's back; a split line, the end of input and a close while it waits
run on pipes and sockets alike in tests/test_shell_socket_reader.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.transports import shell as shell_module
from acp_server.transports import waits as waits_module
from acp_server.transports.listeners import PipeStream

from .helpers import RawClient, running_server
from .test_shell_socket_reader import _serve, awaited, pipe_pair


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """What each of the shell's reads returned: its length, ``None`` for a read that found nothing."""
    seen: list[int | None] = []
    real = shell_module._read_now

    def counting(fd: int) -> bytes | None:
        data = real(fd)
        seen.append(None if data is None else len(data))
        return data

    monkeypatch.setattr(shell_module, "_read_now", counting)
    return seen


@asynccontextmanager
async def _pipe_session() -> AsyncIterator[tuple[trio.Nursery, RawClient, PipeStream, str, trio.Event]]:
    """A server serving one pipe pair, its client initialized with one session, the reader waiting:
    the nursery, the client, the client's end, the session id and the event set when the connection ends."""
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = pipe_pair()
            ended = await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            await trio.testing.wait_all_tasks_blocked()
            yield nursery, client, client_end, session_id, ended


async def test_a_request_response_peer_costs_one_read_per_message(reads: list[int | None]) -> None:
    async with _pipe_session() as (nursery, client, client_end, session_id, _):
        del reads[:]
        for n in range(5):
            assert (await client.prompt(session_id, f"hello {n}"))["stopReason"] == "end_turn"
        await trio.testing.wait_all_tasks_blocked()
        assert len(reads) == 5 and None not in reads, reads  # one read per prompt, none that failed

        (task,) = [t for t in nursery.child_tasks if t.name == "the connection"]
        names = [c.co_qualname for c in awaited(task.coro)]
        run = names.index("ConnectionShell.run")
        # the edge-triggered wait of the pipe (transports/waits.py), trio's trap just under it
        assert names[run + 1 : run + 3] == ["edge_waiter.<locals>.wait_edge", "_real_async_yield"], names
        assert "PipeStream.receive_some" not in names
        await client_end.aclose()


async def test_a_stream_closed_under_the_waiting_reader_ends_the_connection() -> None:
    """Closing the stream itself (not the shell) wakes the reader, which ends the connection: it never
    reads the descriptor's number again once the stream let it go."""
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = pipe_pair()
            ended = await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            await trio.testing.wait_all_tasks_blocked()
            await server_end.aclose()
            await ended.wait()
            assert server_end.receive_fd is None
            assert not server.connections
            await client_end.aclose()


async def test_without_the_epoll_managers_wait_the_reader_uses_trios_public_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's wait falls back to ``trio.lowlevel.wait_readable`` when the run's I/O manager has no
    ``_epoll_wait`` coroutine to call (another trio, another platform), and serves the same."""
    import types

    monkeypatch.setattr(waits_module, "inspect", types.SimpleNamespace(iscoroutinefunction=lambda f: False))
    monkeypatch.setattr(shell_module, "edge_waiter", lambda pipe: None)  # (the pipe's own wait is a socket's then)
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = pipe_pair()
            await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            assert (await client.prompt(session_id, "hello"))["stopReason"] == "end_turn"
            await trio.testing.wait_all_tasks_blocked()
            (task,) = [t for t in nursery.child_tasks if t.name == "the connection"]
            names = [c.co_qualname for c in awaited(task.coro)]
            run = names.index("ConnectionShell.run")
            assert names[run + 1 : run + 3] == ["_public_wait_readable", "wait_readable"], names
            await client_end.aclose()


async def test_lines_and_the_end_of_input_in_one_edge_are_answered_then_the_connection_ends() -> None:
    """The pipe is waited on edge-triggered (transports/waits.py): when the last lines and the
    writer's close arrive before the server's next epoll_wait, one event reports both; the read after it
    is short, and no edge comes any more. The reader must still see the end of input (``printf ... |
    acp-server serve --stdio``): the prompts are answered and the connection ends."""
    async with _pipe_session() as (nursery, client, client_end, session_id, ended):
        (task,) = [t for t in nursery.child_tasks if t.name == "the connection"]
        assert "edge_waiter.<locals>.wait_edge" in [c.co_qualname for c in awaited(task.coro)]
        lines = b"".join(
            json.dumps({"jsonrpc": "2.0", "id": 100 + n, "method": "session/prompt",
                        "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": f"p{n}"}]}}).encode()
            + b"\n"
            for n in range(3)
        )
        fd, client_end.send_fd = client_end.send_fd, None
        assert fd is not None
        os.write(fd, lines)  # the lines and the close with no scheduling pass between them
        os.close(fd)
        await ended.wait()
        await client.eof.wait()
        answers = {m.get("id"): m for m in client.messages if "result" in m}
        assert [answers[100 + n]["result"]["stopReason"] for n in range(3)] == ["end_turn"] * 3


async def test_the_pipe_read_with_trios_own_wait_first_is_then_waited_on_edge_triggered() -> None:
    """``PipeStream.receive_some`` (trio's one-shot wait) and the shell's edge-triggered wait on one
    descriptor, one after the other: each drops or replaces the other's registration."""
    with trio.fail_after(10):
        a, b = pipe_pair()
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(0.01)
                await b.send_all(b"x")

            nursery.start_soon(later)
            assert await a.receive_some(10) == b"x"  # trio's wait: a one-shot registration
            wait = shell_module.edge_waiter(a)
            assert wait is not None
            assert a.receive_fd is not None
            nursery.start_soon(later)
            await wait(a.receive_fd)  # registered anew, edge-triggered
            assert os.read(a.receive_fd, 10) == b"x"
            assert a.edge_epoll is not None
            nursery.start_soon(later)
            assert await a.receive_some(10) == b"x"  # the edge registration dropped, trio's again
            assert a.edge_epoll is None
        await a.aclose()
        await b.aclose()


class _CountingEpoll:
    """The run's epoll object, counting the registrations trio makes through it (``epoll_ctl`` calls)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.ctl = 0

    def poll(self, *args: Any) -> Any:
        return self.real.poll(*args)

    def modify(self, *args: Any) -> None:
        self.ctl += 1
        self.real.modify(*args)

    def register(self, *args: Any) -> None:
        self.ctl += 1
        self.real.register(*args)

    def unregister(self, *args: Any) -> None:
        self.ctl += 1
        self.real.unregister(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def test_sequential_prompts_on_the_pipe_make_no_epoll_registration() -> None:
    """A sequential prompt on stdio costs one epoll_wait and no epoll_ctl (the pipe's registration is
    kept, edge-triggered): a guard for a trio whose internals would make the shell fall back silently."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    async with _pipe_session() as (_, client, client_end, session_id, _):
        io: Any = GLOBAL_RUN_CONTEXT.runner.io_manager
        counting = io._epoll = _CountingEpoll(io._epoll)
        try:
            for n in range(5):
                assert (await client.prompt(session_id, f"hello {n}"))["stopReason"] == "end_turn"
                await trio.testing.wait_all_tasks_blocked()
            # the client's end is read with trio's one-shot wait: one re-arm per answer it waited for
            # (PipeStream.receive_some); the server's end, none
            assert counting.ctl <= 5, counting.ctl
        finally:
            io._epoll = counting.real
        await client_end.aclose()


async def test_an_edge_wait_cancelled_leaves_the_registration_for_the_next_wait() -> None:
    """A cancelled wait gives up its entry in trio's table but keeps the kernel's registration: the next
    wait on the same pipe is woken by the next write, with no registration of its own."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    with trio.fail_after(10):
        a, b = pipe_pair()
        assert a.receive_fd is not None
        wait = shell_module.edge_waiter(a)
        assert wait is not None
        with trio.move_on_after(0.01) as scope:
            await wait(a.receive_fd)
        assert scope.cancelled_caught and a.edge_epoll is not None
        io: Any = GLOBAL_RUN_CONTEXT.runner.io_manager
        assert a.receive_fd not in io._registered
        counting = io._epoll = _CountingEpoll(io._epoll)
        try:
            async with trio.open_nursery() as nursery:

                async def later() -> None:
                    await trio.sleep(0.01)
                    assert b.send_fd is not None
                    os.write(b.send_fd, b"y")

                nursery.start_soon(later)
                await wait(a.receive_fd)
            assert os.read(a.receive_fd, 10) == b"y"
            assert counting.ctl == 0
        finally:
            io._epoll = counting.real
        await a.aclose()
        await b.aclose()
