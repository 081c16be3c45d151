"""The servers under test: ``acp-server`` started on TCP, and the commands of both stdio agents."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["BenchError", "TcpServer", "acp_server_argv", "sdk_echo_argv", "server_flags", "shell_command"]

BENCH = Path(__file__).resolve().parent
_LISTENING = re.compile(rb"acp-server: listening on tcp://127\.0\.0\.1:(\d+)")
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


class BenchError(Exception):
    """A scenario could not run (the server failed, a peer misbehaved); the message says what happened."""


def acp_server_argv() -> list[str]:
    """The ``acp-server`` console script of the running venv (``python -m acp_server`` when absent)."""
    script = shutil.which("acp-server", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "acp_server"]


def sdk_echo_argv() -> list[str]:
    """The official SDK's echo agent (bench/peers), on stdio."""
    return [sys.executable, str(BENCH / "peers" / "sdk_echo_agent.py")]


def shell_command(argv: list[str]) -> str:
    """``argv`` for a reader to paste: the venv's paths shortened to their names."""
    short = []
    for arg in argv:
        if arg == sys.executable:
            arg = "python"
        elif arg.startswith(str(BENCH.parent) + os.sep):
            arg = os.path.relpath(arg, BENCH.parent)
            if arg.startswith(".venv/bin/"):
                arg = arg[len(".venv/bin/") :]
        short.append(arg)
    return shlex.join(short)


@functools.cache
def server_flags() -> frozenset[str]:
    """The flags ``acp-server serve`` accepts (later issues add some: the bench skips what is missing)."""
    out = subprocess.run(
        [*acp_server_argv(), "serve", "--help"], capture_output=True, timeout=60, check=False
    )
    return frozenset(m.decode() for m in re.findall(rb"--[a-z][a-z0-9-]*", out.stdout))


class TcpServer:
    """``acp-server serve`` on a free loopback port, for the length of a ``with`` block.

    Its stderr goes to a file (a pipe nobody reads could fill and stall it); the port is read from the
    ``listening on`` line. Leaving the block sends SIGTERM, then SIGKILL if it does not exit.

    Args:
        extra: more ``serve`` flags. Unless they name ``--state-dir`` the server runs ``--ephemeral``
            (the throughput baseline); with ``--state-dir`` the store is on, in a directory of the bench's.
    """

    def __init__(self, extra: list[str] | None = None) -> None:
        extra = list(extra or [])
        if "--state-dir" not in extra and "--ephemeral" not in extra:
            extra.insert(0, "--ephemeral")
        self.argv = [*acp_server_argv(), "serve", "--listen", "tcp://127.0.0.1:0", *extra]
        self.port = 0
        self._log = tempfile.NamedTemporaryFile(prefix="acp-bench-server-", suffix=".log", delete=False)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    @property
    def command(self) -> str:
        return shell_command(self.argv)

    def _log_tail(self) -> str:
        return Path(self._log.name).read_bytes()[-2000:].decode(errors="replace")

    def __enter__(self) -> TcpServer:
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = _LISTENING.search(Path(self._log.name).read_bytes())
            if found:
                self.port = int(found.group(1))
                return self
            if self._proc.poll() is not None:
                break
            time.sleep(0.02)
        self._stop()
        raise BenchError(f"{self.command} did not start listening:\n{self._log_tail()}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()
        if exc_type is None:
            os.unlink(self._log.name)
        else:
            print(f"bench: server log kept at {self._log.name}", file=sys.stderr)

    def _stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
