"""The refusal to start on a locked state directory names the process that really holds the lock: after
its server was killed -9, that is the store writer still alive, not the dead server in the lock file."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from acp_server.store import StateDirLocked, StateLock

_SERVER = """
import os, subprocess, sys, pathlib
from acp_server.store import StateLock
lock = StateLock(pathlib.Path(sys.argv[1]))
lock.acquire()
# the "writer": inherits the locked descriptor and outlives its server
writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=(lock.fd,),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(os.getpid(), writer.pid, flush=True)
os.kill(os.getpid(), 9)
"""


def test_refusal_names_the_live_writer_after_its_server_was_killed(tmp_path: pathlib.Path) -> None:
    run = subprocess.run([sys.executable, "-c", _SERVER, str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert run.returncode == -signal.SIGKILL, run.stderr
    server_pid, writer_pid = map(int, run.stdout.split())
    try:
        with pytest.raises(StateDirLocked) as info:
            StateLock(tmp_path).acquire(dead_owner_wait_s=0.2)
        assert info.value.owner_pid == writer_pid
        assert info.value.dead_pid == server_pid
        message = str(info.value)
        assert f"in use by pid {writer_pid}" in message and f"server pid {server_pid}" in message
        assert "--state-dir" in message
    finally:
        os.kill(writer_pid, signal.SIGKILL)


def test_refusal_names_a_live_owner_as_before(tmp_path: pathlib.Path) -> None:
    first = StateLock(tmp_path)
    first.acquire()
    try:
        holder = subprocess.run(
            [sys.executable, "-c", "import pathlib, sys\nfrom acp_server.store import StateLock\n"
             "try:\n    StateLock(pathlib.Path(sys.argv[1])).acquire(0.1)\nexcept OSError as e:\n    print(e)",
             str(tmp_path)],
            capture_output=True, text=True, timeout=30,
        )
        assert f"in use by pid {os.getpid()};" in holder.stdout, holder
    finally:
        first.release()
