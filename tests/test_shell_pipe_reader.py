"""The shell reads the stdio ``PipeStream`` itself, and waits after a short read instead of reading.

As on a plain socket, ``ConnectionShell.run`` reads the pipe's descriptor with ``os.read`` and waits in
``trio.lowlevel.wait_readable`` directly, not through ``PipeStream.receive_some``; after a read that
emptied the pipe (a short read) it waits before it reads again, so that a request-response peer costs
one read per message and no read that fails with ``EAGAIN``. These tests check that, and what the
reader must still do: a split line, the end of input (answers, then close), a close while it waits, a
stream closed behind its back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.server import Server
from acp_server.transports import shell as shell_module
from acp_server.transports.listeners import PipeStream
from acp_server.transports.shell import ConnectionShell

from .helpers import RawClient, running_server


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
            assert names[run + 1] == "wait_readable", names  # trio.lowlevel.wait_readable, nothing between
            assert "PipeStream.receive_some" not in names
            await client_end.aclose()


async def test_a_line_split_across_writes_then_the_end_of_input_is_answered_then_closed() -> None:
    with trio.fail_after(10):
        async with running_server(drain_timeout_s=5) as (server, nursery):
            client_end, server_end = pipe_pair()
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


async def test_a_pipe_closed_while_its_reader_waits_flushes_what_is_queued_and_ends() -> None:
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client_end, server_end = pipe_pair()
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
