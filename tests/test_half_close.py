"""Half-close against real processes: after the end of a client's input, the prompts it sent run to
their outcome and are answered, then the connection closes (``serve --stdio``, TCP after
``shutdown(SHUT_WR)``, and through ``acp-server connect``); at ``--drain-timeout-s`` they are answered
``cancelled``; a closed stdout ends the server at once.

Each test fails on a server that drops accepted work at the end of its client's input.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from .helpers import stored_events
from .test_e2e_sdk import ServerProcess

ECHO_DELAY_MS = 300
TIMEOUT_S = 30.0
PROMPTS = 3


def _line(id: int, method: str, params: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode() + b"\n"


INIT = _line(1, "initialize", {"protocolVersion": 1, "clientCapabilities": {}})
NEW = _line(2, "session/new", {"cwd": "/tmp", "mcpServers": []})


def _prompts(session_id: str) -> bytes:
    return b"".join(
        _line(10 + i, "session/prompt", {"sessionId": session_id, "prompt": [{"type": "text", "text": f"p{i}"}]})
        for i in range(PROMPTS)
    )


class LineReader:
    """Lines from a pipe or socket, each read within the test's deadline."""

    def __init__(self, fileobj: IO[bytes] | socket.socket) -> None:
        self.fileobj = fileobj
        self.buffer = b""
        self.eof = False
        self.deadline = time.monotonic() + TIMEOUT_S

    def _more(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.fileobj, selectors.EVENT_READ)
            left = self.deadline - time.monotonic()
            assert left > 0 and sel.select(left), "no answer in time"
        if isinstance(self.fileobj, socket.socket):
            data = self.fileobj.recv(65536)
        else:
            data = os.read(self.fileobj.fileno(), 65536)
        self.eof = not data
        self.buffer += data

    def message(self) -> dict[str, Any] | None:
        """The next message, or ``None`` at the end of the stream."""
        while b"\n" not in self.buffer:
            if self.eof:
                return None
            self._more()
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def answer(self, id: int) -> dict[str, Any]:
        while (message := self.message()) is not None:
            if message.get("id") == id and "method" not in message:
                return message
        raise AssertionError(f"the stream ended before the answer to {id}")

    def rest(self) -> list[dict[str, Any]]:
        """Every message until the end of the stream."""
        out = []
        while (message := self.message()) is not None:
            out.append(message)
        return out


def _answers(messages: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {m["id"]: m for m in messages if "id" in m and "method" not in m}


def _assert_all_answered(messages: list[dict[str, Any]], stop_reason: str = "end_turn") -> None:
    answers = _answers(messages)
    for i in range(PROMPTS):
        assert answers[10 + i].get("result", {}).get("stopReason") == stop_reason, answers


def _serve_stdio(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "acp_server", "serve", "--stdio", "--echo-delay-ms", str(ECHO_DELAY_MS), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            try:
                pipe.close()
            except BrokenPipeError:
                pass


def _open_session(proc: subprocess.Popen[bytes]) -> tuple[LineReader, str]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(INIT + NEW)
    proc.stdin.flush()
    reader = LineReader(proc.stdout)
    reader.answer(1)
    session_id: str = reader.answer(2)["result"]["sessionId"]
    return reader, session_id


def test_stdio_answers_every_prompt_sent_before_eof_then_exits_0(tmp_path: Path) -> None:
    """``printf ... | acp-server serve --stdio``: three prompts then EOF get their three answers, then
    exit 0; with ``--state-dir`` they are stored completed with their user messages."""
    state = tmp_path / "state"
    proc = _serve_stdio("--state-dir", str(state))
    try:
        reader, session_id = _open_session(proc)
        assert proc.stdin is not None
        proc.stdin.write(_prompts(session_id))
        proc.stdin.close()
        messages = reader.rest()
        _assert_all_answered(messages)
        assert proc.wait(TIMEOUT_S) == 0
    finally:
        _end(proc)
    events = stored_events(state, session_id)
    users = [body["content"]["text"] for _, _, method, body in events if method is None and body.get("sessionUpdate") == "user_message_chunk"]
    assert users == [f"p{i}" for i in range(PROMPTS)]
    states = [body["state"] for _, _, method, body in events if method is not None]
    assert states == ["completed"] * PROMPTS


def test_stdio_drain_timeout_answers_cancelled() -> None:
    """A prompt still running ``--drain-timeout-s`` after EOF is answered ``cancelled``, then exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_server", "serve", "--stdio", "--echo-delay-ms", "20000", "--drain-timeout-s", "0.5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        reader, session_id = _open_session(proc)
        assert proc.stdin is not None
        proc.stdin.write(_prompts(session_id))
        proc.stdin.close()
        started = time.monotonic()
        _assert_all_answered(reader.rest(), "cancelled")
        assert proc.wait(TIMEOUT_S) == 0
        assert time.monotonic() - started < 10
    finally:
        _end(proc)


def test_stdio_exits_at_once_when_stdout_is_closed() -> None:
    """Nobody reads the answers (stdout closed): the server does not wait out the drain."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_server", "serve", "--stdio", "--echo-delay-ms", "20000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        reader, session_id = _open_session(proc)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdout.close()  # the next write fails with EPIPE
        proc.stdin.write(_prompts(session_id))
        proc.stdin.close()
        assert proc.wait(10) == 0
    finally:
        _end(proc)


def _tcp_server() -> tuple[ServerProcess, str, int]:
    server = ServerProcess("--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", str(ECHO_DELAY_MS))
    (url,) = server.wait_listening(1)
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return server, parts.hostname, parts.port


def test_tcp_answers_every_prompt_sent_before_shutdown_wr() -> None:
    server, host, port = _tcp_server()
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            sock.sendall(INIT + NEW)
            reader = LineReader(sock)
            reader.answer(1)
            session_id = reader.answer(2)["result"]["sessionId"]
            sock.sendall(_prompts(session_id))
            sock.shutdown(socket.SHUT_WR)
            _assert_all_answered(reader.rest())  # then the server closes its side
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_connect_relays_every_answer_after_stdin_eof() -> None:
    server, host, port = _tcp_server()
    relay = subprocess.Popen(
        [sys.executable, "-m", "acp_server", "connect", f"tcp://{host}:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        reader, session_id = _open_session(relay)
        assert relay.stdin is not None
        relay.stdin.write(_prompts(session_id))
        relay.stdin.close()
        _assert_all_answered(reader.rest())
        assert relay.wait(TIMEOUT_S) == 0
    finally:
        _end(relay)
        server.stop()
