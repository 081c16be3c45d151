"""A real server and Debian's chromium for the console's tests and ``make screenshots``.

Playwright drives ``/usr/bin/chromium`` (Playwright's own browser download is never used: nothing can
be downloaded here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-quic",
    "--disable-sync",
]
_HTTP = re.compile(r"http on (http://\S+)")
_TCP = re.compile(r"listening on (tcp://\S+)")


class ServerProcess:
    """``acp-server serve`` with a TCP and an HTTP listener, in a subprocess.

    Args:
        state_dir: its ``--state-dir``.
        args: more ``serve`` flags (and ``-- agent command``).
        http_port: the HTTP port (default: the kernel's pick at the first start). Both listeners
            bind port 0 at first, so they can never race for one port; :meth:`restart` binds the
            ports the first process got, so a page keeps its address.
    """

    def __init__(self, state_dir: Path, args: list[str], http_port: int | None = None) -> None:
        self.state_dir = state_dir
        self.args = args
        self.http_port = http_port or 0
        self.tcp_port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.http_url = ""
        self.tcp_url = ""

    def start(self) -> ServerProcess:
        before, sep, after = (self.args + [])[:], "", []
        if "--" in self.args:
            i = self.args.index("--")
            before, sep, after = self.args[:i], "--", self.args[i + 1 :]
        cmd = [
            sys.executable, "-m", "acp_server", "serve",
            "--listen", f"tcp://127.0.0.1:{self.tcp_port}",
            "--http-listen", f"http://127.0.0.1:{self.http_port}",
            "--state-dir", str(self.state_dir),
            *before, *([sep] if sep else []), *after,
        ]  # fmt: skip
        self.http_url = self.tcp_url = ""  # a restart waits for the new process's lines too
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 20
        assert self.proc.stderr is not None
        while not (self.http_url and self.tcp_url):
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited before listening: {cmd}")
            if m := _HTTP.search(line):
                self.http_url = m.group(1)
                self.http_port = int(self.http_url.rsplit(":", 1)[1])
            if m := _TCP.search(line):
                self.tcp_url = m.group(1)
                self.tcp_port = int(self.tcp_url.rsplit(":", 1)[1])
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not listen within 20 s")
        os.set_blocking(self.proc.stderr.fileno(), False)  # unread logs never block the server
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def load(
        self, prompts: int, *, session: str | None = None, text: str | None = None, hold: bool = False
    ) -> subprocess.Popen[str]:
        """Start ``tests.web_load`` against this server (the caller waits for it).

        With ``hold``, its unanswered prompts are cancelled once a line is written to its stdin (or
        stdin is closed): ``communicate("\n")`` releases them.
        """
        cmd = [sys.executable, "-m", "tests.web_load", "--connect", self.tcp_url, "--prompts", str(prompts)]
        if session is not None:
            cmd += ["--session", session]
        if text is not None:
            cmd += ["--text", text]
        if hold:
            cmd.append("--hold")
        stdin = subprocess.PIPE if hold else None
        return subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, text=True)


def launch(playwright: Any) -> Any:
    """Debian's chromium under Playwright."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
