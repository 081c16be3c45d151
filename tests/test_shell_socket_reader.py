"""The shell reads a plain trio socket itself, and an idle connection holds little.

On a ``trio.SocketStream`` the reader is ``ConnectionShell.run`` itself: it reads the descriptor with
``os.read`` and waits in trio's readable wait directly (the epoll manager's own, under ``trio.lowlevel.wait_readable``), not through the stream's
``receive_some`` (and the socket's ``recv``, its helper and their context manager); it keeps neither
its last read nor an exception while it waits; the connection has one nursery (the writer and the
requests' tasks); after a short read it waits before it reads again (a peer that waits for each
answer costs one read per message). These tests look at an idle connection's suspended calls and
locals, count the reads of a sequential peer, and check that what the socket path must still do works
on it: a split line, the peer's end of input (half-close, answers then EOF), a close while the reader
waits (what is queued is flushed first), the first-message timeout. The split line and the close run
on the stdio ``PipeStream`` too, which the shell reads the same way (tests/test_shell_pipe_reader.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.server import FIRST_MESSAGE_TIMEOUT_S, Server
from acp_server.transports import shell as shell_module
from acp_server.transports.listeners import PipeStream
from acp_server.transports.shell import ConnectionShell

from .helpers import RawClient, running_server

#: a connection's two ends: the client's, the server's
StreamPair = Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]]


def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


def pipe_pair() -> tuple[PipeStream, PipeStream]:
    """The client's end and the server's end: two pipes, as an editor and ``serve --stdio`` have."""
    server_in, client_out = os.pipe()
    client_in, server_out = os.pipe()
    return PipeStream(client_in, client_out), PipeStream(server_in, server_out)


def awaited(coro: Any) -> Iterator[Any]:
    """The code objects of ``coro`` and of everything it awaits, outermost first."""
    while coro is not None:
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        if code is None:
            return
        yield code
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


async def _serve(server: Server, nursery: trio.Nursery, stream: trio.abc.Stream) -> trio.Event:
    ended = trio.Event()

    async def serve() -> None:
        try:
            await server.handle_stream(stream, "test")
        finally:
            ended.set()

    nursery.start_soon(serve, name="the connection")
    return ended


def _connection_task(nursery: trio.Nursery) -> trio.lowlevel.Task:
    (task,) = [t for t in nursery.child_tasks if t.name == "the connection"]
    return task


async def test_an_idle_socket_connection_waits_on_its_descriptor_under_one_nursery() -> None:
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = socket_pair()
            await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            assert (await client.prompt(session_id, "hello there"))["stopReason"] == "end_turn"
            await trio.testing.wait_all_tasks_blocked()

            task = _connection_task(nursery)
            codes = list(awaited(task.coro))
            names = [c.co_qualname for c in codes]
            run = names.index("ConnectionShell.run")
            # the epoll manager's own wait (trio.lowlevel.wait_readable without its wrappers), nothing between
            assert names[run + 1] in ("EpollIOManager._epoll_wait", "wait_readable"), names
            assert not [c.co_filename for c in codes if c.co_filename.endswith(("_highlevel_socket.py", "_socket.py"))]
            assert len(task.child_nurseries) == 1  # the writer and the requests' tasks
            (writer,) = task.child_nurseries[0].child_tasks  # no request runs: the writer alone
            assert writer.name == "acp_server connection writer"

            run_frame = next(c for c in _frames(task.coro) if c.f_code.co_qualname == "ConnectionShell.run")
            local = run_frame.f_locals
            assert local["data"] == b"" and local["read"] is None  # the last read is not kept
            assert sys.exc_info() == (None, None, None)
            (shell,) = server.connections
            assert sys.getsizeof(shell._slots) == sys.getsizeof({})  # the emptied table was freed
            await client_end.aclose()


async def test_a_request_response_peer_costs_one_read_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int | None] = []  # each read's length, None for one that found nothing
    real = shell_module._read_now

    def counting(fd: int) -> bytes | None:
        data = real(fd)
        reads.append(None if data is None else len(data))
        return data

    monkeypatch.setattr(shell_module, "_read_now", counting)
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = socket_pair()
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
            await client_end.aclose()


def _frames(coro: Any) -> Iterator[Any]:
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            return
        yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


@pytest.mark.parametrize("stream_pair", [socket_pair, pipe_pair], ids=["socket", "pipe"])
async def test_a_line_split_across_reads_then_the_end_of_input_is_answered_then_closed(stream_pair: StreamPair) -> None:
    with trio.fail_after(10):
        async with running_server(drain_timeout_s=5) as (server, nursery):
            client_end, server_end = stream_pair()
            ended = await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            request = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n'
            await client.send_raw(request[:20])
            await trio.testing.wait_all_tasks_blocked()
            await client.send_raw(request[20:] + b'{"jsonrpc":"2.0","id":2,"method":"session/new",')
            await trio.testing.wait_all_tasks_blocked()
            await client.send_raw(b'"params":{"cwd":"/tmp","mcpServers":[]}}\n')
            await client_end.send_eof()
            await client.eof.wait()
            await ended.wait()
            answers = {m["id"]: m for m in client.messages if "id" in m}
            assert answers[1]["result"]["protocolVersion"] == 1
            assert answers[2]["result"]["sessionId"]
            await client_end.aclose()


@pytest.mark.parametrize("stream_pair", [socket_pair, pipe_pair], ids=["socket", "pipe"])
async def test_a_stream_closed_while_its_reader_waits_flushes_what_is_queued_and_ends(stream_pair: StreamPair) -> None:
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = stream_pair()
            ended = await _serve(server, nursery, server_end)
            client = RawClient(client_end)
            nursery.start_soon(client.pump)
            await client.initialize()
            await trio.testing.wait_all_tasks_blocked()
            (shell,) = server.connections
            assert isinstance(shell, ConnectionShell)
            shell.send(b'{"jsonrpc":"2.0","method":"_acp_server/test_last_words"}\n')
            shell.close()
            await ended.wait()
            await client.eof.wait()
            assert [n["method"] for n in client.notifications] == ["_acp_server/test_last_words"]
            assert not server.connections
            await client_end.aclose()


async def test_a_silent_socket_is_closed_after_the_first_message_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_server() as (server, nursery):
        silent_end, server_end = socket_pair()
        silent_ended = await _serve(server, nursery, server_end)
        talker_end, talker_server_end = socket_pair()
        talker_ended = await _serve(server, nursery, talker_server_end)
        talker = RawClient(talker_end)
        nursery.start_soon(talker.pump)
        await talker.initialize()
        await trio.sleep(FIRST_MESSAGE_TIMEOUT_S + 1)
        assert silent_ended.is_set() and not talker_ended.is_set()
        assert await silent_end.receive_some(100) == b""
        assert (await talker.call("_acp_server/capabilities"))["limits"]
        await silent_end.aclose()
        await talker_end.aclose()
