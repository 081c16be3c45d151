"""The shell reads the stdio ``PipeStream`` itself, and waits after a short read instead of reading.

As on a plain socket, ``ConnectionShell.run`` reads the pipe's descriptor with ``os.read`` and waits in
trio's readable wait directly (the epoll manager's own, under ``trio.lowlevel.wait_readable``), not through ``PipeStream.receive_some``; after a read that
emptied the pipe (a short read) it waits before it reads again, so that a request-response peer costs
one read per message and no read that fails with ``EAGAIN``. These tests check that, and a stream
closed behind the waiting reader's back; a split line, the end of input and a close while it waits
run on pipes and sockets alike in tests/test_shell_socket_reader.py.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from acp_server.transports import shell as shell_module

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


async def test_a_request_response_peer_costs_one_read_per_message(reads: list[int | None]) -> None:
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = pipe_pair()
            await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            await trio.testing.wait_all_tasks_blocked()
            del reads[:]
            for n in range(5):
                assert (await client.prompt(session_id, f"hello {n}"))["stopReason"] == "end_turn"
            await trio.testing.wait_all_tasks_blocked()
            assert len(reads) == 5 and None not in reads, reads  # one read per prompt, none that failed

            (task,) = [t for t in nursery.child_tasks if t.name == "the connection"]
            names = [c.co_qualname for c in awaited(task.coro)]
            run = names.index("ConnectionShell.run")
            # the epoll manager's own wait (trio.lowlevel.wait_readable without its wrappers), nothing between
            assert names[run + 1] in ("EpollIOManager._epoll_wait", "wait_readable"), names
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

    monkeypatch.setattr(shell_module, "inspect", types.SimpleNamespace(iscoroutinefunction=lambda f: False))
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
