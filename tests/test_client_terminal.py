"""``acp-server prompt`` as a person sees it: driven under a pseudo-terminal (``pty``) against real
servers, and without a terminal with ``--yes``, ``--deny`` and ``--json``.

The agent behind the server is ``tests/agents/fake_agent.py --tool-call --ask-permission``: it reports a
tool call ``call-1`` "Read notes.txt", asks permission for it (Allow / Deny), says
``permission:<optionId> `` (or stops ``cancelled`` when refused), updates the tool call to
``in_progress`` then ``completed``, and echoes the prompt's words.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from acp_server.client.terminal import HumanView, JsonView, pick_option

from .test_e2e_sdk import ServerProcess

CLI = [sys.executable, "-m", "acp_server", "prompt"]
FAKE_AGENT = ["--", sys.executable, "-m", "tests.agents.fake_agent", "--tool-call", "--ask-permission"]
TIMEOUT_S = 30.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class PtyRun:
    """One command on a pseudo-terminal (stdin, stdout and stderr all on it), its output read as it comes.

    Attributes:
        output: everything written so far, decoded (``\\r\\n`` as ``\\n``).
        seen_at: when each answered pattern first appeared (monotonic seconds).
    """

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.raw = b""
        self.started = time.monotonic()

    @property
    def output(self) -> str:
        return self.raw.decode(errors="replace").replace("\r\n", "\n")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the other side is closed
            return False
        if not data:
            return False
        self.raw += data
        return True

    def wait_for(self, pattern: str, timeout: float = TIMEOUT_S) -> float:
        """Read until ``pattern`` (a regex) appears; returns when it did (monotonic seconds)."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output):
            if time.monotonic() > deadline or not self._read(min(0.2, max(0.0, deadline - time.monotonic()))):
                raise AssertionError(f"{pattern!r} never appeared; output so far:\n{self.output}")
        return time.monotonic()

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        """Read to the end; the exit code."""
        deadline = time.monotonic() + timeout
        while self._read(0.2):
            if self.proc.poll() is not None and not select.select([self.master], [], [], 0.05)[0]:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"still running; output so far:\n{self.output}")
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def pty_runs() -> Iterator[list[PtyRun]]:
    runs: list[PtyRun] = []
    yield runs
    for run in runs:
        run.close()


def start(runs: list[PtyRun], *args: str) -> PtyRun:
    run = PtyRun([*CLI, *args])
    runs.append(run)
    return run


def plain(text: str) -> str:
    """Without terminal control sequences and carriage-return redraws (the last redraw of a line stays)."""
    lines = []
    for line in _ANSI.sub("", text).split("\n"):
        lines.append(line.rsplit("\r", 1)[-1])
    return "\n".join(lines)


@pytest.fixture(scope="module")
def agent_url() -> Iterator[str]:
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--ephemeral", *FAKE_AGENT) as server:
        (url,) = server.wait_listening()
        yield url


def run_plain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


# --- under a terminal ------------------------------------------------------------------------------


def test_tty_tool_call_lines_and_a_permission_answered_y(agent_url: str, pty_runs: list[PtyRun]) -> None:
    """On a terminal the tool call is one status line per update, the permission is asked with the
    option list, ``y`` picks the allow option, and the agent's text streams to the screen."""
    run = start(pty_runs, "--connect", agent_url, "--cwd", "/tmp", "hello", "pty")
    run.wait_for(r"allow\? \[y/n/1-2\]")
    screen = plain(run.output)
    assert "acp-server: tool call-1 Read notes.txt (read): pending\n" in screen
    assert "acp-server: the agent asks permission: Read notes.txt (call-1)\n  1) Allow [allow_once]\n  2) Deny [reject_once]\n" in screen
    run.send("y\n")
    assert run.finish() == 0, run.output
    screen = plain(run.output)
    assert "acp-server: permission for Read notes.txt (call-1): Allow [allow_once]\n" in screen
    assert "acp-server: tool call-1 Read notes.txt: in_progress\n" in screen
    assert "acp-server: tool call-1 Read notes.txt: completed\n" in screen
    assert "permission:allow \n" in screen  # the text line is ended before the next status line
    assert "hello pty\n" in screen
    assert screen.rstrip("\n").endswith("acp-server: stop end_turn")


def test_tty_answers_by_option_number_and_asks_again_on_nonsense(agent_url: str, pty_runs: list[PtyRun]) -> None:
    """``2`` picks the second option (Deny); an answer that is none of y, n or a number is asked again."""
    run = start(pty_runs, "--connect", agent_url, "--cwd", "/tmp", "numbered")
    run.wait_for(r"allow\? \[y/n/1-2\]")
    run.send("maybe\n")
    run.wait_for(r"answer y, n or an option's number \(1-2\)")
    run.send("2\n")
    assert run.finish() == 0, run.output
    screen = plain(run.output)
    assert "acp-server: permission for Read notes.txt (call-1): Deny [reject_once]\n" in screen
    assert "permission:deny " in screen


def test_tty_streams_text_as_it_arrives(pty_runs: list[PtyRun]) -> None:
    """The echo agent streams its text at once and holds the turn 1.5 s: the text is on the screen
    long before the stop line."""
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", "1500") as server:
        (url,) = server.wait_listening()
        run = start(pty_runs, "--connect", url, "--cwd", "/tmp", "streamed", "words")
        text_at = run.wait_for(r"streamed words")
        assert "stop" not in run.output
        stop_at = run.wait_for(r"acp-server: stop end_turn")
        assert run.finish() == 0
    assert stop_at - text_at > 0.7, run.output


def test_tty_retry_line_for_prompt_queue_full(pty_runs: list[PtyRun]) -> None:
    """A session at its pending limit refuses a second prompt with ``prompt_queue_full``: the command
    says ``retrying in 5.0 s (prompt_queue_full, attempt 2/5)`` (the server's ``retryAfterMs``) and the
    retry, after the first prompt ended, succeeds."""
    with ServerProcess(
        "--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", "4000",
        "--max-pending-prompts-per-session", "1",
    ) as server:
        (url,) = server.wait_listening()
        first = start(pty_runs, "--connect", url, "--cwd", "/tmp", "first")
        first.wait_for(r"\nfirst")
        session_id = re.search(r"session (sess_\w+)", first.output)
        assert session_id is not None
        second = start(pty_runs, "--connect", url, "--session", session_id.group(1), "--cwd", "/tmp", "second")
        second.wait_for(r"acp-server: retrying in 5\.0 s \(prompt_queue_full, attempt 2/5\)\n")
        assert first.finish() == 0
        assert second.finish() == 0, second.output
        assert plain(second.output).rstrip("\n").endswith("second\nacp-server: stop end_turn")


def test_tty_shows_the_turn_state_and_queue_position_while_waiting(pty_runs: list[PtyRun]) -> None:
    """With one seat for the whole server, a second prompt waits its turn: the progress line shows
    ``queued (position 1)`` with the time waited, redrawn in place, and is gone when the text comes."""
    with ServerProcess(
        "--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", "4000",
        "--max-running-prompts", "1", "--interactive-max-wait-ms", "0",
    ) as server:
        (url,) = server.wait_listening()
        first = start(pty_runs, "--connect", url, "--cwd", "/tmp", "holder")
        first.wait_for(r"\nholder")
        second = start(pty_runs, "--connect", url, "--cwd", "/tmp", "waiter")
        second.wait_for(r"queued \(position 1\), \d+\.\d s")
        second.wait_for(r"queued \(position 1\), (0\.[3-9]|[1-9]\.\d) s")  # redrawn while it waits
        assert first.finish() == 0
        assert second.finish() == 0, second.output
    screen = plain(second.output)
    assert "\r\x1b[K" in second.output  # redrawn in place, then cleared
    assert "queued" not in screen.split("waiter", 1)[1]
    assert screen.rstrip("\n").endswith("waiter\nacp-server: stop end_turn")


# --- without a terminal ----------------------------------------------------------------------------


def test_no_tty_without_a_flag_refuses_and_says_how_to_answer(agent_url: str) -> None:
    """No terminal to ask and no flag: the permission is refused (``cancelled``) with a line saying so;
    the agent stops ``cancelled`` (exit 130)."""
    run = run_plain("--connect", agent_url, "--cwd", "/tmp", "unasked")
    assert run.returncode == 130, run.stderr
    assert (
        "acp-server: permission for Read notes.txt (call-1): cancelled (refused), answered for you: "
        "no terminal to ask (pass --yes or --deny)\n" in run.stderr
    )
    assert run.stdout == "permission:cancelled \n"
    assert run.stderr.endswith("acp-server: stop cancelled\n")


def test_no_tty_yes_allows_and_says_it_answered(agent_url: str) -> None:
    """``--yes`` picks the allow option and says it answered for the user; the lines come in the order
    the agent sent them."""
    run = run_plain("--connect", agent_url, "--cwd", "/tmp", "--yes", "allowed", "words")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "permission:allow allowed words\n"
    lines = run.stderr.splitlines()
    assert lines[1:] == [
        "acp-server: tool call-1 Read notes.txt (read): pending",
        "acp-server: permission for Read notes.txt (call-1): Allow [allow_once], answered for you (--yes)",
        "acp-server: tool call-1 Read notes.txt: in_progress",
        "acp-server: tool call-1 Read notes.txt: completed",
        "acp-server: stop end_turn",
    ]


def test_no_tty_deny_rejects_and_says_it_answered(agent_url: str) -> None:
    """``--deny`` picks the reject option."""
    run = run_plain("--connect", agent_url, "--cwd", "/tmp", "--deny", "denied")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "permission:deny denied\n"
    assert "acp-server: permission for Read notes.txt (call-1): Deny [reject_once], answered for you (--deny)\n" in run.stderr


def test_json_is_one_object_per_line(agent_url: str) -> None:
    """``--json``: every stdout line is one JSON object with a ``type``; the session, the tool call and
    its updates, the permission (answered by ``--yes``), turn states and the result; nothing on stderr."""
    run = run_plain("--connect", agent_url, "--cwd", "/tmp", "--json", "--yes", "as", "json")
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    events = [json.loads(line) for line in run.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert types[0] == "session" and types[-1] == "result"
    assert events[-1]["stopReason"] == "end_turn" and events[-1]["_meta"]["promptId"].startswith("prompt_")
    updates = [e["update"] for e in events if e["type"] == "update"]
    assert [u["sessionUpdate"] for u in updates if u["sessionUpdate"].startswith("tool")] == [
        "tool_call", "tool_call_update", "tool_call_update",
    ]
    text = "".join(u["content"]["text"] for u in updates if u["sessionUpdate"] == "agent_message_chunk")
    assert text == "permission:allow as json"
    (permission,) = [e for e in events if e["type"] == "permission"]
    assert permission["by"] == "--yes"
    assert permission["answer"] == {"outcome": {"outcome": "selected", "optionId": "allow"}}
    states = [e["state"] for e in events if e["type"] == "turn_state"]
    assert states[0] == "accepted" and "paused_for_approval" in states and states[-1] == "completed"


def test_refused_after_its_attempts_exits_3() -> None:
    """``--max-attempts 1``: a ``prompt_queue_full`` is not retried; the command exits 3 (refused)
    naming the error kind; ``--json`` gives the error as one object with its data."""
    with ServerProcess(
        "--listen", "tcp://127.0.0.1:0", "--ephemeral", "--echo-delay-ms", "8000",
        "--max-pending-prompts-per-session", "1",
    ) as server:
        (url,) = server.wait_listening()
        first = subprocess.Popen([*CLI, "--connect", url, "--cwd", "/tmp", "hold"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert first.stderr is not None
            session_id = first.stderr.readline().split()[2]
            assert first.stdout is not None and first.stdout.read(4) == "hold"  # it runs now
            run = run_plain("--connect", url, "--session", session_id, "--cwd", "/tmp", "--max-attempts", "1", "x")
            as_json = run_plain("--connect", url, "--session", session_id, "--cwd", "/tmp", "--max-attempts", "1", "--json", "x")
        finally:
            first.send_signal(signal.SIGINT)
            first.communicate(timeout=TIMEOUT_S)
    assert run.returncode == 3, run.stderr
    assert run.stderr.splitlines()[-1].startswith("acp-server: error prompt_queue_full: ")
    assert "retrying" not in run.stderr
    assert as_json.returncode == 3
    error = json.loads(as_json.stdout.splitlines()[-1])
    assert error["type"] == "error" and error["errorKind"] == "prompt_queue_full"
    assert error["data"]["sessionId"] == session_id and error["data"]["retryAfterMs"] == 5000


def test_connect_defaults_to_acp_server_url(agent_url: str) -> None:
    """Without ``--connect``, ``$ACP_SERVER_URL`` names the server; a malformed one is a usage error
    naming the variable; nobody listening says how to start a server."""
    env = {**os.environ, "ACP_SERVER_URL": agent_url}
    run = subprocess.run([*CLI, "--cwd", "/tmp", "--yes", "via", "env"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and run.stdout == "permission:allow via env\n", run.stderr
    env["ACP_SERVER_URL"] = "ftp://nope"  # http:// is a scheme of /acp now
    bad = subprocess.run([*CLI, "x"], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert bad.returncode == 2
    assert "--connect 'ftp://nope': unknown scheme" in bad.stderr and "(from $ACP_SERVER_URL)" in bad.stderr
    env["ACP_SERVER_URL"] = "tcp://127.0.0.1:1"
    down = subprocess.run([*CLI, "x"], capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                          stdin=subprocess.DEVNULL)
    assert down.returncode == 1
    assert "cannot connect to tcp://127.0.0.1:1" in down.stderr and "make run" in down.stderr


# --- the pieces ------------------------------------------------------------------------------------


def test_pick_option_prefers_once_over_always() -> None:
    options = [
        {"optionId": "a2", "kind": "allow_always"},
        {"optionId": "a1", "kind": "allow_once"},
        {"optionId": "r2", "kind": "reject_always"},
    ]
    assert pick_option(options, True) == options[1]
    assert pick_option(options, False) == options[2]
    assert pick_option(options[:2], False) is None


def test_views_without_a_terminal_print_one_line_per_waiting_state() -> None:
    """Off a terminal the progress is one line per change of state or position (no redraws)."""
    import io

    out, err = io.StringIO(), io.StringIO()
    view = HumanView(out, err, tty=False)
    for state, position in (("accepted", None), ("queued", 2), ("queued", 2), ("queued", 1), ("running", None)):
        params = {"state": state, "positionHint": position} if position else {"state": state}
        view.turn_state(params)
    assert err.getvalue() == "acp-server: queued (position 2)\nacp-server: queued (position 1)\n"
    buf = io.StringIO()
    JsonView(buf).turn_state({"state": "queued", "positionHint": 3})
    assert json.loads(buf.getvalue()) == {"type": "turn_state", "state": "queued", "positionHint": 3}


def test_wait_buffered_leaves_the_update_in_the_stream() -> None:
    """``wait_buffered`` returns once an update is buffered, without taking it; at once when closed."""
    import trio.testing

    from acp_server.client.updates import Update, UpdateStream

    async def main() -> None:
        stream = UpdateStream("s", max_buffered=10)
        with trio.move_on_after(0.05) as idle:
            await stream.wait_buffered()
        assert idle.cancelled_caught  # nothing buffered: it waits
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.wait_buffered)
            await trio.testing.wait_all_tasks_blocked()
            stream.push(Update(session_id="s", update={"sessionUpdate": "plan"}))
        assert [u.kind for u in stream.drain_nowait()] == ["plan"]
        stream.close()
        with trio.fail_after(1):
            await stream.wait_buffered()

    trio.run(main)
