"""The TCP and Unix listeners in process: the bound port reported through ``nursery.start``, per
connection isolation, and what a client vanishing in the middle of a prompt does (and does not) do."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from acp_server.backends.base import BaseBackend, Turn
from acp_server.server import Server
from acp_server.transports import listener_url, serve_tcp, serve_unix
from acp_server.types.acp import AgentMessageChunk, StopReason, TextContent

from .helpers import RawClient, running_server

Connect = Callable[[], Awaitable[trio.SocketStream]]
Handler = Callable[[trio.abc.Stream], Awaitable[None]]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (``tmp_path`` can overflow the 107-byte ``AF_UNIX`` limit)."""
    path = Path(tempfile.mkdtemp(prefix="acp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def listen(nursery: trio.Nursery, kind: str, handler: Handler, sock_dir: Path) -> Connect:
    """Start ``serve_tcp`` or ``serve_unix`` in ``nursery``; returns how to open a connection to it."""
    if kind == "tcp":
        listeners = await nursery.start(partial(serve_tcp, host="127.0.0.1"), handler, 0)
        port = listeners[0].socket.getsockname()[1]
        return partial(trio.open_tcp_stream, "127.0.0.1", port)
    path = str(sock_dir / "t.sock")
    await nursery.start(serve_unix, handler, path)
    return partial(trio.open_unix_socket, path)


async def receive_line(stream: trio.abc.ReceiveStream) -> bytes:
    """One line (``b""`` at end of stream)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(1024)
        if not chunk:
            return data
        data += chunk
    return data


async def echo_lines(stream: trio.abc.Stream) -> None:
    """A connection handler: echoes each line; ``boom`` makes it raise."""
    async with stream:
        while line := await receive_line(stream):
            if line == b"boom\n":
                raise RuntimeError("handler failed on purpose")
            await stream.send_all(line)


async def round_trip(stream: trio.abc.Stream, line: bytes) -> bytes:
    await stream.send_all(line)
    return await receive_line(stream)


# --- listeners ------------------------------------------------------------------------------------


async def test_serve_tcp_reports_bound_port() -> None:
    """``nursery.start(serve_tcp, ..., 0)`` returns the listeners, bound: the real port is known."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(serve_tcp, host="127.0.0.1"), echo_lines, 0)
            assert len(listeners) == 1
            host, port = listeners[0].socket.getsockname()[:2]
            assert host == "127.0.0.1" and port != 0
            assert listener_url(listeners[0]) == f"tcp://127.0.0.1:{port}"
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                assert await round_trip(stream, b"ping\n") == b"ping\n"
            nursery.cancel_scope.cancel()


async def test_serve_unix_binds_0600_and_removes_the_file(sock_dir: Path) -> None:
    """``serve_unix`` reports its listener, the socket file is 0600, and it is gone after the server."""
    path = sock_dir / "u.sock"
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_unix, echo_lines, str(path))
            assert listener_url(listeners[0]) == f"unix:{path}"
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            async with await trio.open_unix_socket(str(path)) as stream:
                assert await round_trip(stream, b"ping\n") == b"ping\n"
            nursery.cancel_scope.cancel()
    assert not path.exists()


@pytest.mark.parametrize("kind", ["tcp", "unix"])
async def test_failing_handler_closes_only_its_connection(
    kind: str, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that raises closes its own connection; others keep working, the listener keeps accepting."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            connect = await listen(nursery, kind, echo_lines, sock_dir)
            async with await connect() as good, await connect() as bad:
                assert await round_trip(good, b"1\n") == b"1\n"
                assert await round_trip(bad, b"2\n") == b"2\n"
                assert await round_trip(bad, b"boom\n") == b""  # closed by the server
                assert await round_trip(good, b"3\n") == b"3\n"
                async with await connect() as later:
                    assert await round_trip(later, b"4\n") == b"4\n"
            nursery.cancel_scope.cancel()
    failures = [r for r in caplog.records if "connection handler failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.ERROR
    assert failures[0].exc_info is not None and isinstance(failures[0].exc_info[1], RuntimeError)


# --- a client vanishing mid-prompt --------------------------------------------------------------------


class HoldingBackend(BaseBackend):
    """Each turn streams ``started``, then waits for :attr:`release`, then streams ``finished``."""

    name = "holding"

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.cancelled = trio.Event()
        self.finished = 0

    async def prompt(self, turn: Turn) -> StopReason:
        turn.emit(AgentMessageChunk(content=TextContent(text="started ")))
        self.started.set()
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled.set()
            raise
        turn.emit(AgentMessageChunk(content=TextContent(text="finished")))
        self.finished += 1
        return "end_turn"


class Served:
    """A server behind a real listener; :attr:`ended` holds one event per connection, set when its
    handler has returned (the connection is closed and the bridge has been told)."""

    def __init__(self, server: Server, nursery: trio.Nursery) -> None:
        self.server = server
        self.nursery = nursery
        self.connect: Connect | None = None
        self.ended: list[trio.Event] = []
        self.clients: list[RawClient] = []

    async def handle(self, stream: trio.abc.Stream) -> None:
        ended = trio.Event()
        self.ended.append(ended)
        try:
            await self.server.handle_stream(stream, "test")
        finally:
            ended.set()

    async def client(self) -> RawClient:
        """A new initialized connection; its handler's event is ``ended[-1]`` once this returns."""
        assert self.connect is not None
        client = RawClient(await self.connect())
        self.clients.append(client)
        self.nursery.start_soon(client.pump)
        await client.initialize()
        return client

    @property
    def pending(self) -> int:
        return self.server.bridge.statistics().pending_prompts


@asynccontextmanager
async def served(kind: str, backend: HoldingBackend, sock_dir: Path) -> AsyncIterator[Served]:
    async with running_server(backend=backend) as (server, nursery):
        box = Served(server, nursery)
        box.connect = await listen(nursery, kind, box.handle, sock_dir)
        try:
            yield box
        finally:
            with trio.CancelScope(shield=True):
                for client in box.clients:
                    await client.stream.aclose()


async def send_prompt(client: RawClient, session_id: str, text: str) -> None:
    """Send a ``session/prompt`` without waiting for its answer."""
    id, _ = client.start_request("session/prompt")
    await client.send(
        {
            "jsonrpc": "2.0",
            "id": id,
            "method": "session/prompt",
            "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]},
        }
    )


async def wait_for(client: RawClient, condition: Callable[[], bool]) -> None:
    while True:
        notified = client.notified
        if condition():
            return
        await notified.wait()


@pytest.mark.parametrize("kind", ["tcp", "unix"])
async def test_disconnect_mid_prompt_cancels_it(kind: str, sock_dir: Path) -> None:
    """The only connection of a session leaves while its prompt runs: the prompt is cancelled, its slot
    freed, and the server carries on (a new connection prompts the same session)."""
    backend = HoldingBackend()
    with trio.fail_after(10):
        async with served(kind, backend, sock_dir) as box:
            leaver = await box.client()
            session_id, _ = await leaver.new_session()
            await send_prompt(leaver, session_id, "left behind")
            await backend.started.wait()
            assert box.pending == 1

            await leaver.stream.aclose()
            await backend.cancelled.wait()
            await box.ended[0].wait()
            assert box.pending == 0
            assert box.server.bridge.statistics().running_prompts == 0
            assert backend.finished == 0

            backend.release.set()
            newcomer = await box.client()
            result = await newcomer.prompt(session_id, "after")
            assert result["stopReason"] == "end_turn"
            assert newcomer.agent_text(session_id) == "started finished"
            assert box.pending == 0


@pytest.mark.parametrize("kind", ["tcp", "unix"])
async def test_disconnect_mid_prompt_runs_on_for_another_attached_connection(
    kind: str, sock_dir: Path
) -> None:
    """The sender leaves while another live connection is attached to the session: the prompt runs to
    its end and that connection receives all of it, the sender's prompt included."""
    backend = HoldingBackend()
    with trio.fail_after(10):
        async with served(kind, backend, sock_dir) as box:
            watcher = await box.client()
            session_id, _ = await watcher.new_session()
            sender = await box.client()
            await send_prompt(sender, session_id, "keep going")
            await backend.started.wait()

            await sender.stream.aclose()
            await box.ended[1].wait()
            assert not backend.cancelled.is_set()
            assert box.pending == 1

            backend.release.set()
            await wait_for(watcher, lambda: watcher.agent_text(session_id) == "started finished")
            updates = [u["update"] for u in watcher.updates(session_id)]
            assert updates[0] == {
                "sessionUpdate": "user_message_chunk",
                "content": {"type": "text", "text": "keep going"},
            }
            assert backend.finished == 1 and not backend.cancelled.is_set()
            assert box.pending == 0
            assert not box.ended[0].is_set()  # the watcher's connection is untouched
            assert watcher.errors == []
