"""The ``acp-server serve`` command line: flags, refusals (exit 2), runtime failures (exit 1), the
listener lines on stderr, the Unix socket file, and a clean stdout in stdio mode."""

from __future__ import annotations

import json
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from acp_server import cli

from .helpers import ROOT
from .test_e2e_sdk import START_TIMEOUT_S, ServerProcess

SERVE = [sys.executable, "-m", "acp_server", "serve"]
#: The flags the issue asks for; the README table and ``--help`` may list more, never fewer.
REQUIRED_FLAGS = {
    "--stdio",
    "--listen",
    "--echo-delay-ms",
    "--max-message-bytes",
    "--max-pending-prompts-per-session",
    "--prompt-deadline-ms",
    "--max-inflight-requests",
    "--max-outbound-bytes",
    "--client-idle-timeout-s",
    "--session-idle-timeout-s",
    "--log-level",
}
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (``tmp_path`` can overflow the 107-byte ``AF_UNIX`` limit)."""
    path = Path(tempfile.mkdtemp(prefix="acp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_serve(
    *args: str, timeout: float = 20.0, stdin: int = subprocess.DEVNULL
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=timeout, stdin=stdin)


def help_flags() -> set[str]:
    run = run_serve("--help")
    assert run.returncode == 0, run.stderr
    return set(_FLAG.findall(run.stdout)) - {"--help"}


def readme_flags() -> set[str]:
    """The flags in the table of the README's ``acp-server serve`` section (other commands have their own)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## `acp-server serve`\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    return {found[0] for row in rows if (found := _FLAG.findall(row))}


# --- flags ----------------------------------------------------------------------------------------


def test_help_lists_every_flag() -> None:
    """``serve --help`` names every flag the issue and the README describe."""
    flags = help_flags()
    assert REQUIRED_FLAGS <= flags
    assert readme_flags() <= flags


def test_readme_documents_every_flag() -> None:
    """The README's flag table keeps up with ``serve --help``."""
    assert help_flags() - readme_flags() == set()


@pytest.mark.parametrize(
    ("argv", "flag", "accepts"),
    [
        (
            ["--max-pending-prompts-per-session", "-1"],
            "--max-pending-prompts-per-session",
            "non-negative integer",
        ),
        (
            ["--max-pending-prompts-per-session", "1.5"],
            "--max-pending-prompts-per-session",
            "non-negative integer",
        ),
        (
            ["--max-pending-prompts-per-session", "nan"],
            "--max-pending-prompts-per-session",
            "non-negative integer",
        ),
        (
            ["--max-pending-prompts-per-session", "abc"],
            "--max-pending-prompts-per-session",
            "non-negative integer",
        ),
        (["--listen", "foo://x"], "--listen", "tcp://HOST:PORT"),
        (["--listen", "tcp://host-without-port"], "--listen", "tcp://HOST:PORT"),
        (["--listen", "unix:relative.sock"], "--listen", "unix:/"),
        (["--log-level", "loud"], "--log-level", "'debug', 'info', 'warning', 'error'"),
        (["--echo-delay-ms", "-5"], "--echo-delay-ms", "non-negative integer"),
        (["--max-message-bytes", "0"], "--max-message-bytes", "positive integer"),
        (["--client-idle-timeout-s", "inf"], "--client-idle-timeout-s", "positive number of seconds"),
    ],
)
def test_bad_value_exits_2_naming_flag_and_what_it_accepts(
    argv: list[str], flag: str, accepts: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is a usage error: exit 2, and the message says which flag and what it takes."""
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["serve", *argv])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert flag in message and accepts in message, err
    assert repr(argv[-1]) in message or argv[-1] in message


def test_bad_value_exits_2_as_a_process() -> None:
    """The real process exits 2 too (not only ``main`` raising ``SystemExit``)."""
    run = run_serve("--max-pending-prompts-per-session", "abc")
    assert run.returncode == 2
    assert (
        "--max-pending-prompts-per-session must be a non-negative integer (0 disables the limit)"
        in run.stderr
    )
    assert run.stdout == ""


def test_non_loopback_listen_exits_2() -> None:
    """``tcp://0.0.0.0:0`` is refused before anything binds: no authentication yet, so loopback only."""
    run = run_serve("--listen", "tcp://0.0.0.0:0")
    assert run.returncode == 2
    assert "0.0.0.0 is not a loopback address" in run.stderr
    assert "listening on" not in run.stderr


# --- runtime failures -------------------------------------------------------------------------------


def test_port_in_use_exits_1_with_a_message() -> None:
    """A port someone else holds: exit 1 and one line saying why, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_serve("--listen", f"tcp://127.0.0.1:{port}")
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("acp-server: cannot listen on tcp://127.0.0.1:"), run.stderr
    assert lines[0].endswith("Address already in use"), run.stderr


def test_live_unix_socket_is_refused(sock_dir: Path) -> None:
    """A Unix socket path another server accepts on is not stolen: exit 1, and that server keeps it."""
    path = sock_dir / "live.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        run = run_serve("--listen", f"unix:{path}")
        assert run.returncode == 1
        assert run.stderr.strip().splitlines() == [
            f"acp-server: cannot listen on unix:{path}: another server is live on this socket"
        ]
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(path))  # still the other server's


def test_stale_unix_socket_is_replaced_and_mode_0600(sock_dir: Path) -> None:
    """A socket file nobody accepts on is replaced; the new one is 0600 and serves; it is removed on exit."""
    path = sock_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # closed without unlinking: a stale file
    assert stat.S_ISSOCK(path.stat().st_mode)
    with ServerProcess("--listen", f"unix:{path}") as server:
        assert server.wait_listening() == [f"unix:{path}"]
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(START_TIMEOUT_S)
            client.connect(str(path))
            client.sendall(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n')
            reply = json.loads(client.makefile("rb").readline())
        assert reply["id"] == 1 and reply["result"]["protocolVersion"] == 1
        server.proc.terminate()
        assert server.proc.wait(10) == 0
    assert not path.exists()


def test_localhost_prints_one_line_per_bound_address(sock_dir: Path) -> None:
    """``tcp://localhost:0`` binds every address localhost resolves to and prints a line for each."""
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    # Listeners start in order, so the Unix line comes after every localhost line.
    marker = f"unix:{sock_dir / 'marker.sock'}"
    with ServerProcess("--listen", "tcp://localhost:0", "--listen", marker) as server:
        urls = server.wait_listening(len(addresses) + 1)
    assert urls[-1] == marker
    tcp = urls[:-1]
    assert all(u.startswith("tcp://") for u in tcp)
    hosts = {re.sub(r"^tcp://\[?(.*?)\]?:\d+$", r"\1", u) for u in tcp}
    assert hosts == addresses
    assert all(int(u.rsplit(":", 1)[1]) > 0 for u in tcp)


# --- stdio ----------------------------------------------------------------------------------------


def test_stdin_eof_with_stdio_only_exits_0() -> None:
    """With ``--stdio`` and no listener, the end of stdin ends the server, cleanly and quietly."""
    started = time.monotonic()
    run = run_serve("--stdio", stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert time.monotonic() - started < 15


def test_stdio_stdout_carries_protocol_lines_only() -> None:
    """At ``--log-level debug`` the logs go to stderr; stdout has nothing but JSON-RPC lines."""
    with ServerProcess(
        "--stdio", "--log-level", "debug", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as server:
        stdin = server.proc.stdin
        assert stdin is not None
        deadline = time.monotonic() + START_TIMEOUT_S

        def call(id: int, method: str, params: dict[str, Any]) -> dict[str, Any]:
            stdin.write(
                json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode() + b"\n"
            )
            stdin.flush()
            while True:
                msg: dict[str, Any] = json.loads(server.next_stdout_line(deadline, f"the answer to {method}"))
                if msg.get("id") == id:
                    return msg

        assert "result" in call(1, "initialize", {"protocolVersion": 1, "_meta": {"turnStates": True}})
        session = call(2, "session/new", {"cwd": "/tmp", "mcpServers": []})["result"]
        prompt = {"sessionId": session["sessionId"], "prompt": [{"type": "text", "text": "only json here"}]}
        result = call(3, "session/prompt", prompt)["result"]
        assert result["stopReason"] == "end_turn"
        error = call(4, "no/such_method", {})["error"]
        assert error["data"]["errorKind"] == "method_not_found"
        stdin.close()
        assert server.proc.wait(10) == 0
        stdout = server.rest_of_stdout()
        stderr = server.rest_of_stderr()
    # 4 answers, the echo's chunks ("only ", "json ", "here") and the prompt's 3 turn states (asked for),
    # nothing else.
    messages = [json.loads(line) for line in stdout]
    assert all(m["jsonrpc"] == "2.0" for m in messages)
    assert len(messages) == 4 + 3 + 3, stdout
    states = [m["params"]["state"] for m in messages if m.get("method") == "_acp_server/turn_state"]
    assert states == ["accepted", "running", "completed"]
    assert [
        m["params"]["update"]["content"]["text"] for m in messages if m.get("method") == "session/update"
    ] == [
        "only ",
        "json ",
        "here",
    ]
    assert any(" DEBUG " in line for line in stderr), stderr
