"""End to end: the official ACP Python SDK against a real ``acp-server`` process over stdio, TCP and
Unix; two connections on different transports sharing one session; shutdown on a signal.

The SDK runs on asyncio, so it runs in its own process (``tests/sdk_driver.py``) and reports a JSON
summary; the other tests talk raw JSON-RPC to the server process with :class:`~tests.helpers.RawClient`.
"""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pytest
import trio

from .helpers import RawClient

DRIVER = Path(__file__).with_name("sdk_driver.py")
#: Each echo prompt takes this long, so a ``session/cancel`` sent once the turn streams its first
#: chunk finds it still running even on a slow machine.
ECHO_DELAY_MS = 500
START_TIMEOUT_S = 15.0
#: how long stop() waits for the output of an ended server to reach end of file
PUMP_EOF_TIMEOUT_S = 10.0


class ServerProcess:
    """``python -m acp_server serve ARGS`` with its stderr (and stdout, when piped) drained by threads.

    Draining keeps a chatty server (``--log-level debug``) from blocking on a full pipe; the lines
    are kept in order and can be waited for with a deadline.
    """

    def __init__(self, *args: str, stdin: int = subprocess.DEVNULL, stdout: int = subprocess.DEVNULL) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "acp_server", "serve", *args],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.PIPE,
        )
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[bytes] = []
        self._stderr_q: queue.Queue[str | None] = queue.Queue()
        self._stdout_q: queue.Queue[bytes | None] = queue.Queue()
        self._pumps: list[threading.Thread] = []
        assert self.proc.stderr is not None
        self._pump(self.proc.stderr, self._stderr_q, lambda b: b.decode(errors="replace").rstrip("\n"))
        if self.proc.stdout is not None:
            self._pump(self.proc.stdout, self._stdout_q, lambda b: b)

    def _pump(self, pipe: IO[bytes], out: queue.Queue[Any], convert: Callable[[bytes], Any]) -> None:
        def run() -> None:
            for raw in iter(pipe.readline, b""):
                out.put(convert(raw))
            out.put(None)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._pumps.append(thread)

    def _next(self, q: queue.Queue[Any], seen: list[Any], deadline: float, what: str) -> Any:
        try:
            item = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"timed out waiting for {what}; stderr so far: {self.stderr_lines}"
            ) from None
        if item is None:
            q.put(None)  # stay at end of file for later calls
            self.proc.wait(5)
            raise AssertionError(
                f"server ended (exit {self.proc.returncode}) before {what}; stderr: {self.stderr_lines}"
            )
        seen.append(item)
        return item

    def next_stderr_line(self, deadline: float, what: str = "a stderr line") -> str:
        return str(self._next(self._stderr_q, self.stderr_lines, deadline, what))

    def next_stdout_line(self, deadline: float, what: str = "a stdout line") -> bytes:
        return bytes(self._next(self._stdout_q, self.stdout_lines, deadline, what))

    def wait_listening(self, count: int = 1, timeout: float = START_TIMEOUT_S) -> list[str]:
        """The URLs of the next ``count`` ``acp-server: listening on URL`` lines."""
        deadline = time.monotonic() + timeout
        urls: list[str] = []
        while len(urls) < count:
            line = self.next_stderr_line(deadline, f"{count} 'listening on' lines")
            prefix = "acp-server: listening on "
            if line.startswith(prefix):
                urls.append(line[len(prefix) :])
        return urls

    def _rest(self, q: queue.Queue[Any], seen: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the server's output did not reach end of file") from None
            if item is None:
                q.put(None)
                return
            seen.append(item)

    def rest_of_stderr(self, timeout: float = 5.0) -> list[str]:
        """Every stderr line up to end of file (call once the process has ended)."""
        self._rest(self._stderr_q, self.stderr_lines, timeout)
        return self.stderr_lines

    def rest_of_stdout(self, timeout: float = 5.0) -> list[bytes]:
        """Every stdout line up to end of file (call once the process has ended)."""
        self._rest(self._stdout_q, self.stdout_lines, timeout)
        return self.stdout_lines

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        # The pumps read to end of file first (on a busy machine they may lag behind, and a child of
        # the server may hold the pipes a moment longer): a pipe closed under a reading thread loses
        # the rest of the output and its end of file, or raises in that thread.
        for thread in self._pumps:
            thread.join(PUMP_EOF_TIMEOUT_S)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (``tmp_path`` can overflow the 107-byte ``AF_UNIX`` limit)."""
    path = Path(tempfile.mkdtemp(prefix="acp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def server_process(*args: str, listeners: int = 1) -> AsyncIterator[tuple[ServerProcess, list[str]]]:
    """A server process and the URLs of its first ``listeners`` listeners; killed on exit."""
    server = await trio.to_thread.run_sync(partial(ServerProcess, *args))
    try:
        urls = await trio.to_thread.run_sync(server.wait_listening, listeners)
        yield server, urls
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.stop)


@asynccontextmanager
async def raw_clients() -> AsyncIterator[Callable[[str], Awaitable[RawClient]]]:
    """Opens initialized :class:`RawClient` connections to ``tcp://HOST:PORT`` or ``unix:/path`` URLs;
    all are closed on exit."""
    clients: list[RawClient] = []
    async with trio.open_nursery() as nursery:

        async def open_raw(url: str) -> RawClient:
            stream: trio.abc.Stream
            if url.startswith("unix:"):
                stream = await trio.open_unix_socket(url[len("unix:") :])
            else:
                parts = urlsplit(url)
                assert parts.hostname is not None and parts.port is not None
                stream = await trio.open_tcp_stream(parts.hostname, parts.port)
            client = RawClient(stream)
            clients.append(client)
            nursery.start_soon(client.pump)
            await client.initialize()
            return client

        try:
            yield open_raw
        finally:
            with trio.CancelScope(shield=True):
                for client in clients:
                    await client.stream.aclose()


async def wait_for(client: RawClient, condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds, re-checking each time ``client`` receives a notification."""
    while True:
        notified = client.notified
        if condition():
            return
        await notified.wait()


def kinds(client: RawClient, session_id: str) -> list[str]:
    return [u["update"]["sessionUpdate"] for u in client.updates(session_id)]


# --- the official SDK over every transport ----------------------------------------------------------


@pytest.mark.parametrize("transport", ["stdio", "tcp", "unix"])
def test_sdk_client_end_to_end(transport: str, sock_dir: Path) -> None:
    """The SDK's client runs the whole scenario and every message we send validates against its models."""
    server: ServerProcess | None = None
    try:
        if transport == "stdio":
            target = "stdio"
        else:
            listen = "tcp://127.0.0.1:0" if transport == "tcp" else f"unix:{sock_dir / 's.sock'}"
            server = ServerProcess("--listen", listen, "--echo-delay-ms", str(ECHO_DELAY_MS))
            (target,) = server.wait_listening()
        run = subprocess.run(
            [sys.executable, str(DRIVER), target, "--echo-delay-ms", str(ECHO_DELAY_MS)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        if server is not None:
            server.stop()
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    context = f"summary: {json.dumps(summary, indent=1)}\ndriver stderr: {run.stderr}"

    assert summary["failures"] == [], context
    assert summary["sdkErrors"] == [], context
    assert summary["protocolVersion"] == 1
    assert summary["agentName"] == "acp-server"
    for phase in ("first", "after"):
        assert summary[phase]["stopReason"] == "end_turn", context
        assert summary[phase]["text"] == summary[phase]["sent"], context
    concurrent = summary["concurrent"]
    assert concurrent["stopReasons"] == ["end_turn"] * 3, context
    # One session runs its prompts one at a time, in arrival order: the echoes do not interleave.
    assert concurrent["text"] == "".join(concurrent["sent"]), context
    assert summary["cancelled"]["stopReason"] == "cancelled", context
    assert summary["pendingPromptsAtEnd"] == 0

    # Every incoming message was validated: once as an envelope, once as its payload.
    validated = summary["validated"]
    assert validated["AgentResponseMessage"] + validated["AgentNotification"] == summary["received"], context
    assert validated["InitializeResponse"] == 1
    assert validated["NewSessionResponse"] == 1
    assert validated["PromptResponse"] == 6
    assert validated["SessionNotification"] == sum(summary["updateKinds"].values())
    # The other notifications are our turn states: 3 per prompt at least (accepted, running, terminal).
    assert validated["AgentNotification"] == validated["SessionNotification"] + validated["TurnState"], context
    assert validated["TurnState"] >= 3 * validated["PromptResponse"], context
    # The sender of a prompt is not sent its own prompt back; everything else it gets is the agent's reply.
    assert set(summary["updateKinds"]) == {"agent_message_chunk"}, context
    assert summary["updateSessions"] == [summary["sessionId"]]


# --- two connections, two transports, one session ---------------------------------------------------


async def test_two_transports_prompt_one_session(sock_dir: Path) -> None:
    """A session made over TCP is prompted over Unix; the TCP connection sees that prompt and its echo."""
    listen = ("--listen", "tcp://127.0.0.1:0", "--listen", f"unix:{sock_dir / 'two.sock'}")
    with trio.fail_after(30):
        async with server_process(*listen, listeners=2) as (_, urls), raw_clients() as open_raw:
            tcp = await open_raw(next(u for u in urls if u.startswith("tcp://")))
            unix = await open_raw(next(u for u in urls if u.startswith("unix:")))
            session_id, client_id = await tcp.new_session()

            text = "sent over the unix socket"
            result = await unix.prompt(session_id, text)
            assert result["stopReason"] == "end_turn"
            assert unix.agent_text(session_id) == text
            await wait_for(tcp, lambda: tcp.agent_text(session_id) == text)
            tcp_updates = tcp.updates(session_id)
            assert tcp_updates[0]["update"] == {
                "sessionUpdate": "user_message_chunk",
                "content": {"type": "text", "text": text},
            }
            assert "user_message_chunk" not in kinds(unix, session_id)
            event_ids = [u["_meta"]["eventId"] for u in tcp_updates]
            assert event_ids == sorted(set(event_ids))

            # And the other way round: the Unix connection, attached by its prompt, sees TCP's.
            back = "and back over tcp"
            result = await tcp.prompt(session_id, back, clientId=client_id)
            assert result["stopReason"] == "end_turn"
            await wait_for(unix, lambda: unix.agent_text(session_id) == text + back)
            user_chunks = [
                u for u in unix.updates(session_id) if u["update"]["sessionUpdate"] == "user_message_chunk"
            ]
            assert [u["update"]["content"]["text"] for u in user_chunks] == [back]
            assert user_chunks[0]["_meta"]["originatorClientId"] == client_id
            assert tcp.errors == [] and unix.errors == []


# --- shutdown -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_cancels_running_prompt_and_exits_0(signum: signal.Signals) -> None:
    """A signal during a running prompt: the prompt answers ``cancelled``, the process exits 0 within 5 s."""
    with trio.fail_after(30):
        args = ("--listen", "tcp://127.0.0.1:0", "--echo-delay-ms", "5000")
        async with server_process(*args) as (server, (url,)), raw_clients() as open_raw:
            client = await open_raw(url)
            session_id, _ = await client.new_session()
            outcome: dict[str, Any] = {}

            async with trio.open_nursery() as nursery:

                async def prompt() -> None:
                    outcome.update(await client.prompt(session_id, "interrupted by a signal"))

                nursery.start_soon(prompt)
                await wait_for(client, lambda: bool(client.agent_text(session_id)))  # the turn is running
                signalled_at = time.monotonic()
                server.proc.send_signal(signum)
                returncode = await trio.to_thread.run_sync(server.proc.wait, 5.0)
                elapsed = time.monotonic() - signalled_at
            await client.eof.wait()
            assert outcome["stopReason"] == "cancelled" and outcome["_meta"]["promptId"].startswith("prompt_")
            assert returncode == 0, server.rest_of_stderr()
            assert elapsed < 5.0
