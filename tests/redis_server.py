"""A real ``redis-server`` per test: a free loopback port, no persistence, stopped at the end.

Import the fixture into a test module with ``from .redis_server import redis_server  # noqa: F401``.
``make test`` installs Debian's ``redis-server`` when it is missing; without it these tests fail (they
never fall back to a fake).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator

import pytest

__all__ = ["RedisServer", "redis_server"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    Args:
        tmp: its working directory.
        tls: ``(cert, key, ca)`` PEM files: it listens with TLS only (``rediss://``), clients unauthenticated.
    """

    def __init__(self, tmp: str, tls: tuple[str, str, str] | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make test` (it installs it) or apt-get install redis-server")
        self.port = _free_port()
        self.tls = tls
        listen = ["--port", str(self.port)]
        if tls is not None:
            cert, key, ca = tls
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                      "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", tmp, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self._pong():
                    break
            except OSError:  # ssl.SSLError is an OSError
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def _pong(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
            if self.tls is None:
                raw.sendall(b"PING\r\n")
                return raw.recv(16).startswith(b"+PONG")
            context = ssl.create_default_context(cafile=self.tls[2])
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

    def command(self, *args: str) -> bytes:
        """One command through ``redis-cli`` (for checks from outside the code under test)."""
        tls = ["--tls", "--cacert", self.tls[2]] if self.tls is not None else []
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *tls, "--no-raw", *args], capture_output=True, check=True, timeout=10
        )
        return out.stdout

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    try:
        yield server
    finally:
        server.stop()
