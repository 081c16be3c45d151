"""``acp-server prompt`` and ``acp-server sessions`` as subprocesses against a real
``python -m acp_server serve --listen tcp://127.0.0.1:0``: what goes to stdout and stderr, the exit
codes (0, 1, 130, 2), a self-heal seen from the command line, and Ctrl-C during a slow prompt.

The commands run through ``acp_server.client.cli.main`` (the lead mounts them on ``acp-server``).
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

import pytest

from acp_server.client import cli as client_cli

from .test_e2e_sdk import ServerProcess

CLI = [sys.executable, "-c", "from acp_server.client.cli import main; raise SystemExit(main())"]
SESSION_LINE = re.compile(r"^acp-server: session (sess_\w+) client (\S+)$")
RUN_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """A fast echo server shared by this module's tests."""
    with ServerProcess("--listen", "tcp://127.0.0.1:0") as server:
        (found,) = server.wait_listening()
        yield found


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)


def session_lines(stderr: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in stderr.splitlines() if (m := SESSION_LINE.match(line))]


def test_prompt_new_streams_text_to_stdout_and_reports_on_stderr(url: str) -> None:
    """``prompt --new`` prints the echoed text on stdout, and on stderr the session line then the stop line."""
    run = run_cli("prompt", "--connect", url, "--new", "--cwd", "/tmp", "hello", "world")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "hello world\n"
    lines = run.stderr.splitlines()
    assert SESSION_LINE.match(lines[0]), lines
    assert lines[-1] == "acp-server: stop end_turn"


def test_prompt_error_exits_1_naming_the_error_kind(url: str) -> None:
    """An error ends with ``acp-server: error <errorKind>: <message>`` and exit code 1."""
    run = run_cli("prompt", "--connect", url, "--session", "sess_missing", "--cwd", "/tmp", "hi")
    assert run.returncode == 1
    assert run.stdout == ""
    assert run.stderr.splitlines()[-1] == 'acp-server: error session_not_found: Session "sess_missing" not found'


def test_prompt_with_a_stale_client_id_self_heals(url: str) -> None:
    """``--session S --client-id STALE`` prompts as that id; the server's ``invalid_client_id`` makes the
    command re-register (a second session line, with the new id) and the prompt succeeds."""
    first = run_cli("prompt", "--connect", url, "--new", "--cwd", "/tmp", "make a session")
    ((session_id, client_id),) = session_lines(first.stderr)
    run = run_cli("prompt", "--connect", url, "--session", session_id, "--cwd", "/tmp", "--client-id", "client_stale", "again")
    assert run.returncode == 0, run.stderr
    lines = session_lines(run.stderr)
    assert [sid for sid, _ in lines] == [session_id, session_id]
    assert lines[0][1] == "client_stale"
    assert lines[1][1] not in ("client_stale", client_id)
    assert run.stdout == "again\n"
    assert run.stderr.splitlines()[-1] == "acp-server: stop end_turn"


def test_sessions_lists_the_servers_sessions_as_a_table(url: str) -> None:
    """``sessions`` prints a table with a header (id, title, cwd, updated, pending), one row per session;
    ``--json`` one object per session; nothing in another cwd (and a line on stderr saying so)."""
    made = run_cli("prompt", "--connect", url, "--new", "--cwd", "/tmp", "listed")
    ((session_id, _),) = session_lines(made.stderr)
    run = run_cli("sessions", "--connect", url)
    assert run.returncode == 0, run.stderr
    header, *lines = run.stdout.splitlines()
    assert header.split() == ["ID", "TITLE", "CWD", "UPDATED", "PENDING"]
    rows = {line.split()[0]: line.split() for line in lines}
    assert rows[session_id][1:3] == ["-", "/tmp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", rows[session_id][3])
    assert rows[session_id][4] == "0"
    assert header.index("CWD") == lines[0].index("/tmp")  # columns line up
    as_json = run_cli("sessions", "--connect", url, "--json")
    listed = {d["sessionId"]: d for d in map(json.loads, as_json.stdout.splitlines())}
    assert listed[session_id]["cwd"] == "/tmp" and listed[session_id]["_meta"] == {"pendingCount": 0}
    only_elsewhere = run_cli("sessions", "--connect", url, "--cwd", "/nowhere")
    assert only_elsewhere.returncode == 0 and only_elsewhere.stdout == ""
    assert only_elsewhere.stderr == f"acp-server: no sessions in /nowhere at {url}\n"


def test_connection_refused_exits_1() -> None:
    """Nobody listening: ``acp-server: error connection_failed: ...`` and exit code 1."""
    run = run_cli("sessions", "--connect", "tcp://127.0.0.1:1")
    assert run.returncode == 1
    assert run.stderr.startswith("acp-server: error connection_failed: cannot connect to tcp://127.0.0.1:1")


def test_bad_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed ``--connect`` exits 2 naming the flag and what it accepts."""
    with pytest.raises(SystemExit) as info:
        client_cli.main(["prompt", "--connect", "ftp://x", "hi"])
    assert info.value.code == 2
    accepted = "tcp://HOST:PORT, tls://HOST:PORT, unix:/absolute/path, http(s)://HOST:PORT/acp or ws(s)://HOST:PORT/acp"
    assert f"--connect 'ftp://x': unknown scheme; accepted: {accepted}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        client_cli.main(["prompt", "--connect", "http://x", "hi"])  # an HTTP endpoint needs its path
    assert info.value.code == 2
    assert "the endpoint's path, e.g. /acp, is needed" in capsys.readouterr().err


def test_add_commands_mounts_on_another_parser() -> None:
    """``add_commands`` registers ``prompt`` and ``sessions`` on any ``add_subparsers()`` result."""
    parser = argparse.ArgumentParser(prog="acp-server")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve")
    client_cli.add_commands(sub)
    args = parser.parse_args(["prompt", "--connect", "unix:/tmp/s.sock", "--session", "s1", "--client-id", "c1", "two", "words"])
    assert (args.command, args.session, args.client_id, args.text) == ("prompt", "s1", "c1", ["two", "words"])
    assert args.command in client_cli.COMMANDS
    assert parser.parse_args(["sessions", "--connect", "tcp://127.0.0.1:9"]).command == "sessions"


def _pump(pipe: IO[bytes], out: queue.Queue[bytes]) -> None:
    for chunk in iter(lambda: pipe.read1(4096), b""):
        out.put(chunk)


def test_ctrl_c_during_a_slow_prompt_cancels_it_and_exits_130() -> None:
    """SIGINT while the prompt runs sends ``$/cancel_request``: the server's ``request_cancelled`` is
    printed and the command exits 130, long before the 5 s turn would have ended."""
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--echo-delay-ms", "5000") as server:
        (slow_url,) = server.wait_listening()
        proc = subprocess.Popen(
            [*CLI, "prompt", "--connect", slow_url, "--new", "--cwd", "/tmp", "slow", "prompt"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            chunks: queue.Queue[bytes] = queue.Queue()
            threading.Thread(target=_pump, args=(proc.stdout, chunks), daemon=True).start()
            seen = b""
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while b"slow prompt" not in seen:  # the echo streams its text, then holds the turn
                seen += chunks.get(timeout=max(0.0, deadline - time.monotonic()))
            interrupted_at = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(RUN_TIMEOUT_S)
            elapsed = time.monotonic() - interrupted_at
            stderr = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        assert code == 130, stderr
        assert elapsed < 4.0
        assert stderr.splitlines()[-1] == "acp-server: error request_cancelled: Request cancelled", stderr
