"""``acp-server doctor`` on a machine with problems (a state directory held by a running server, an agent
command that is not installed, a port in use) and on one without; each subcommand's own usage on a bad
flag."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from .test_e2e_sdk import ServerProcess

ACP = [sys.executable, "-m", "acp_server"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ACP, *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def test_doctor_names_the_holder_of_the_state_dir_and_the_missing_agent(tmp_path: pathlib.Path) -> None:
    """A running server holds the directory: the doctor names its pid and command line and says to use
    it, stop it or pick another directory; a missing agent command is named with what to do."""
    state = tmp_path / "state"
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--state-dir", str(state)) as server:
        (url,) = server.wait_listening()
        port = url.rsplit(":", 1)[1]
        doctor = run(
            "doctor", "--state-dir", str(state), "--listen", f"tcp://127.0.0.1:{port}",
            "--agent", "ghost=no-such-agent-command --acp",
        )
        pid = server.proc.pid
    assert doctor.returncode == 1, doctor.stdout
    lines = doctor.stdout.splitlines()
    held = next(i for i, line in enumerate(lines) if line.startswith("FAIL  state directory"))
    assert lines[held].startswith(f"FAIL  state directory {state} is in use by pid {pid} (")
    assert "acp_server serve --listen tcp://127.0.0.1:0" in lines[held]
    assert lines[held + 1].startswith("      -> that server is running: use it")
    assert f"kill {pid}" in lines[held + 1] and "--ephemeral" in lines[held + 1]
    missing = lines.index(next(line for line in lines if line.startswith("FAIL  backend ghost")))
    assert lines[missing].startswith("FAIL  backend ghost: command 'no-such-agent-command' not found on PATH")
    assert "absolute path" in lines[missing + 1]
    assert f"FAIL  --listen tcp://127.0.0.1:{port}: port in use by a running acp-server" in doctor.stdout
    assert "ok    backend echo: the built-in echo agent" in lines
    assert lines[-1] == "acp-server doctor: 3 problems"


def test_doctor_all_good_on_a_fresh_setup(tmp_path: pathlib.Path) -> None:
    """Nothing held, a free port, an agent found by absolute path: exit 0; the default state directory
    is the one keyed by the listen address."""
    doctor = run("doctor", "--listen", "tcp://127.0.0.1:0", "--agent", f"py={sys.executable} -V")
    assert doctor.returncode == 0, doctor.stdout
    assert "/acp-server/tcp-127.0.0.1-0: created at the first start" in doctor.stdout
    assert f"ok    backend py: {sys.executable} -V" in doctor.stdout
    assert doctor.stdout.splitlines()[-1] == "acp-server doctor: all good"


def test_doctor_with_stdio_says_nothing_is_kept() -> None:
    doctor = run("doctor", "--stdio")
    assert doctor.returncode == 0
    assert "info  state: none (--stdio without --state-dir)" in doctor.stdout


@pytest.mark.parametrize("command", ["serve", "doctor", "prompt", "sessions"])
def test_a_bad_flag_prints_the_subcommands_own_usage(command: str) -> None:
    """``serve --bogus`` prints serve's usage (not the top level's) and exits 2."""
    args = [command, "--bogus"] + (["text"] if command == "prompt" else [])
    bad = run(*args)
    assert bad.returncode == 2
    assert bad.stderr.startswith(f"usage: acp-server {command} ")
    assert bad.stderr.splitlines()[-1] == f"acp-server {command}: error: unrecognized arguments: --bogus"
