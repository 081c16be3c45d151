"""Hostile input against a real ``acp-server`` process: bursts of signals, lines nested too deep for the
decoder over TCP and stdio, a flood of idle connections at a lowered descriptor limit.

Each test fails on a server that lets one peer (or one burst of signals) cost the process, another
connection or an answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest
import trio

from .helpers import assert_error_valid
from .test_e2e_sdk import ServerProcess, raw_clients, server_process, wait_for

DEEP = 5000  # far deeper than msgspec decodes (about 1,000)


def _deep_request(id: Any, depth: int = DEEP) -> bytes:
    return (
        b'{"jsonrpc":"2.0","id":' + json.dumps(id).encode() + b',"method":"session/prompt","params":{"x":'
        + b"[" * depth + b"]" * depth + b"}}\n"
    )


# --- signals ------------------------------------------------------------------------------------------


def _signal_burst(pid: int, count: int, gap_s: float) -> None:
    for i in range(count):
        if i:
            time.sleep(gap_s)
        os.kill(pid, signal.SIGINT)


@pytest.mark.parametrize(
    ("count", "store", "gap_s"),
    [(2, False, 0.002), (3, False, 0.002), (3, True, 0.002), (3, False, 0.2)],
    ids=["two", "three", "three-store", "three-spaced"],
)
async def test_sigint_burst_during_a_prompt_exits_0_without_traceback(
    count: int, store: bool, gap_s: float, tmp_path: Any
) -> None:
    """SIGINTs 2 ms apart (as a process group's Ctrl-C or ``timeout`` send them) while a prompt runs:
    exit 0 and no traceback; with two, the prompt is still answered ``cancelled`` (the second is absorbed).
    (trio folds signals that arrive before its receiver runs into one, so the count seen may be lower.)"""
    with trio.fail_after(30):
        durable = ("--state-dir", str(tmp_path / "state")) if store else ("--ephemeral",)
        args = ("--listen", "tcp://127.0.0.1:0", "--echo-delay-ms", "5000", *durable)
        async with server_process(*args) as (server, (url,)), raw_clients() as open_raw:
            client = await open_raw(url)
            session_id, _ = await client.new_session()
            outcome: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:

                async def prompt() -> None:
                    try:
                        outcome.update(await client.prompt(session_id, "interrupted by signals"))
                    except trio.EndOfChannel:
                        pass

                nursery.start_soon(prompt)
                await wait_for(client, lambda: bool(client.agent_text(session_id)))  # the turn is running
                signalled = time.monotonic()
                await trio.to_thread.run_sync(_signal_burst, server.proc.pid, count, gap_s)
                returncode = await trio.to_thread.run_sync(server.proc.wait, 10.0)
                elapsed = time.monotonic() - signalled
                await client.eof.wait()
                nursery.cancel_scope.cancel()
            stderr = "\n".join(await trio.to_thread.run_sync(server.rest_of_stderr))
            assert returncode == 0, stderr
            assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
            if count == 2:
                assert outcome.get("stopReason") == "cancelled", (outcome, stderr)
            assert elapsed < 5.0


# --- nesting too deep ---------------------------------------------------------------------------------


async def test_deep_line_over_tcp_answers_with_its_id_while_another_connection_prompts() -> None:
    """A line nested thousands of levels deep gets ``invalid_request`` (``maxDepth``) with its id, its
    connection stays usable, and another connection's prompts all complete meanwhile."""
    with trio.fail_after(60):
        args = ("--listen", "tcp://127.0.0.1:0", "--ephemeral")
        async with server_process(*args) as (server, (url,)), raw_clients() as open_raw:
            busy = await open_raw(url)
            hostile = await open_raw(url)
            busy_session, _ = await busy.new_session()
            done: list[str] = []

            async def keep_prompting() -> None:
                for i in range(30):
                    result = await busy.prompt(busy_session, f"prompt {i}")
                    done.append(result["stopReason"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_prompting)
                for n in range(5):
                    id, receive = hostile.start_request("session/prompt", id=f"deep-{n}")
                    await hostile.send_raw(_deep_request(id))
                    reply = await receive.receive()
                    error = reply["error"]
                    assert error["data"]["errorKind"] == "invalid_request" and error["data"]["maxDepth"] >= 256
                    # the same connection still works
                    session_id, _ = await hostile.new_session()
                    assert (await hostile.prompt(session_id, "after"))["stopReason"] == "end_turn"
            assert done == ["end_turn"] * 30
            assert hostile.errors and all(e["data"]["errorKind"] == "invalid_request" for e in hostile.errors)
            assert server.proc.poll() is None


def test_deep_line_over_stdio_is_answered_and_the_server_keeps_serving() -> None:
    """Over ``--stdio`` the deep line is answered with its id and the server stays up (it used to exit 1)."""
    with ServerProcess("--stdio", stdin=subprocess.PIPE, stdout=subprocess.PIPE) as server:
        assert server.proc.stdin is not None
        deadline = time.monotonic() + 20

        def call(line: bytes) -> dict[str, Any]:
            assert server.proc.stdin is not None
            server.proc.stdin.write(line)
            server.proc.stdin.flush()
            msg: dict[str, Any] = json.loads(server.next_stdout_line(deadline))
            return msg

        init = call(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n')
        assert "result" in init
        deep = call(_deep_request(2))
        assert deep["id"] == 2 and deep["error"]["data"]["errorKind"] == "invalid_request"
        assert_error_valid(deep["error"])
        # a batch whose second item is too deep: the first is served, the second answered with its id
        batch = call(
            b'[{"jsonrpc":"2.0","id":3,"method":"_acp_server/capabilities"},' + _deep_request(4).rstrip() + b"]\n"
        )
        assert isinstance(batch, list) and {m["id"] for m in batch} == {3, 4}
        assert "result" in next(m for m in batch if m["id"] == 3)
        after = call(b'{"jsonrpc":"2.0","id":5,"method":"_acp_server/capabilities"}\n')
        assert after["id"] == 5 and "result" in after
        assert server.proc.poll() is None
        server.proc.stdin.close()
        assert server.proc.wait(10) == 0


# --- descriptors and connection counts ----------------------------------------------------------------


def _limited_server(tmp: Any, nofile: int, *args: str) -> tuple[subprocess.Popen[bytes], Any, tuple[str, int]]:
    """A server process whose soft RLIMIT_NOFILE is ``nofile``; its stderr goes to a file."""
    import resource
    import sys

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    err = open(tmp / "stderr.log", "w+b")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_server", "serve", "--listen", "tcp://127.0.0.1:0", "--ephemeral", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=lower,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = (tmp / "stderr.log").read_text(errors="replace")
        if "listening on tcp://" in text:
            host, port = text.split("listening on tcp://", 1)[1].split()[0].rsplit(":", 1)
            return proc, err, (host, int(port))
        assert proc.poll() is None, text
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the server did not start")


def _stderr(tmp: Any) -> str:
    return str((tmp / "stderr.log").read_text(errors="replace"))


def _initialize(sock: Any) -> dict[str, Any]:
    sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n')
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the answer"
        buf += chunk
    msg: dict[str, Any] = json.loads(buf.split(b"\n", 1)[0])
    return msg


def _wait_for_text(tmp: Any, needle: str, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _stderr(tmp).count(needle) < count:
        assert time.monotonic() < deadline, (needle, count, _stderr(tmp))
        time.sleep(0.05)


def test_emfile_backs_off_with_one_log_line_per_episode(tmp_path: Any) -> None:
    """At a lowered fd limit, a flood of idle connections runs accept out of descriptors: one log line
    per episode (not a traceback every 0.1 s), and accepting resumes once descriptors are free."""
    import socket

    proc, err, addr = _limited_server(tmp_path, 96, "--max-connections", "10000")
    flood: list[socket.socket] = []
    try:
        for episode in (1, 2):
            for _ in range(120):  # more than the fd limit leaves for sockets
                flood.append(socket.create_connection(addr, timeout=5))
            _wait_for_text(tmp_path, "accept failed with EMFILE", episode)
            time.sleep(1.5)  # several retries inside the episode: still one line
            assert _stderr(tmp_path).count("accept failed with EMFILE") == episode
            for sock in flood:
                sock.close()
            flood.clear()
            # descriptors are free again: a new client is served
            deadline = time.monotonic() + 10
            while True:
                with socket.create_connection(addr, timeout=5) as sock:
                    try:
                        if "result" in _initialize(sock):
                            break
                    except (AssertionError, OSError):
                        pass
                assert time.monotonic() < deadline, _stderr(tmp_path)
                time.sleep(0.2)
        assert proc.poll() is None
        assert "Traceback" not in _stderr(tmp_path), _stderr(tmp_path)
    finally:
        for sock in flood:
            sock.close()
        proc.kill()
        proc.wait(10)
        err.close()


def test_max_connections_refuses_the_next_connection_with_evicted(tmp_path: Any) -> None:
    """Past ``--max-connections`` (every listener together) a new connection is sent
    ``_acp_server/evicted {reason: too_many_connections}`` and closed; the others keep working and a
    closed one makes room."""
    import socket

    proc, err, addr = _limited_server(tmp_path, 1024, "--max-connections", "3")
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            sock = socket.create_connection(addr, timeout=5)
            assert "result" in _initialize(sock)
            held.append(sock)
        for _ in range(2):
            with socket.create_connection(addr, timeout=5) as extra:
                data = b""
                while chunk := extra.recv(65536):
                    data += chunk
                note = json.loads(data.split(b"\n", 1)[0])
                assert note["method"] == "_acp_server/evicted"
                assert note["params"] == {"reason": "too_many_connections", "limit": 3}
        assert _stderr(tmp_path).count("--max-connections limit") == 1  # one line per episode
        held[0].sendall(b'{"jsonrpc":"2.0","id":2,"method":"_acp_server/capabilities"}\n')
        assert b'"id":2' in held[0].recv(65536)
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:
            with socket.create_connection(addr, timeout=5) as sock:
                if "result" in _initialize(sock):
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for sock in held:
            sock.close()
        proc.kill()
        proc.wait(10)
        err.close()


# --- the signal counting itself ----------------------------------------------------------------------


class _signals:
    """A stand-in for trio's signal receiver: yields ``nums``, then waits forever."""

    def __init__(self, *nums: int) -> None:
        self.nums = list(nums)

    def __aiter__(self) -> _signals:
        return self

    async def __anext__(self) -> int:
        await trio.lowlevel.checkpoint()
        if not self.nums:
            await trio.sleep_forever()
        return self.nums.pop(0)


async def test_second_signal_is_absorbed_and_the_third_forces(caplog: pytest.LogCaptureFixture) -> None:
    from acp_server.signals import ShutdownSignals

    two = ShutdownSignals(_signals(signal.SIGINT, signal.SIGTERM))
    assert await two.first() == signal.SIGINT
    with trio.CancelScope() as force:
        with trio.move_on_after(0.2):
            await two.absorb(force)
    assert two.count == 2 and not force.cancel_called
    three = ShutdownSignals(_signals(signal.SIGINT, signal.SIGINT, signal.SIGINT))
    await three.first()
    with trio.CancelScope() as force:
        with trio.fail_after(1):
            await three.absorb(force)
    assert three.count == 3 and force.cancel_called
    text = caplog.text
    assert "already shutting down" in text and "a third time" in text
