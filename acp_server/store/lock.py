"""One server per state directory: an exclusive ``flock`` on ``DIR/lock``, holding the owner's pid."""

from __future__ import annotations

import fcntl
import os
import pathlib
import time

__all__ = ["StateDirLocked", "StateLock"]

#: how long to wait for the lock when its owner is dead: its store writer process (which holds the
#: lock too) is writing the last records it was sent
DEAD_OWNER_WAIT_S = 10.0


class StateDirLocked(OSError):
    """Another process owns the state directory; the message names its pid and the ways out.

    Attributes:
        owner_pid: the live process that holds the lock, when known.
        dead_pid: the server whose pid the lock file holds, when it has exited and ``owner_pid`` is the
            process that inherited its lock (its store writer).
    """

    def __init__(self, directory: pathlib.Path, owner_pid: int | None, dead_pid: int | None = None) -> None:
        owner = f"pid {owner_pid}" if owner_pid is not None else "another process"
        if dead_pid is not None:
            owner += f" (it holds the lock of server pid {dead_pid}, which has exited: stop it, or let it finish)"
        super().__init__(
            f"state directory {directory} is in use by {owner}; use another --state-dir, run with --ephemeral, "
            "or share that server with `acp-server connect URL`"
        )
        self.directory = directory
        self.owner_pid = owner_pid
        self.dead_pid = dead_pid


class StateLock:
    """An exclusive, non-blocking ``flock`` on ``DIR/lock``; released when the process dies, even by kill -9."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.path = directory / "lock"
        self._fd: int | None = None

    @property
    def fd(self) -> int | None:
        """The locked file's descriptor (a process that inherits it holds the lock too)."""
        return self._fd

    def acquire(self, dead_owner_wait_s: float = DEAD_OWNER_WAIT_S) -> None:
        """Take the lock and write our pid in the file.

        A lock held although the pid in the file is dead belongs to that server's store writer, still
        writing what it was sent: wait for it, up to ``dead_owner_wait_s``.

        Raises:
            StateDirLocked: another process holds it.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + dead_owner_wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = _read_pid(fd)
                if owner is not None and not _alive(owner) and time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                refusal = _refusal(self.directory, fd, owner)
                os.close(fd)
                raise refusal from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:  # a zombie (killed, not yet reaped by its parent) is dead too
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _refusal(directory: pathlib.Path, fd: int, recorded: int | None) -> StateDirLocked:
    """The refusal naming the live holder: the recorded pid when it lives, else a process that has the
    lock file open (a dead server's writer inherited the locked descriptor)."""
    if recorded is not None and _alive(recorded):
        return StateDirLocked(directory, recorded)
    holders = _holders(fd)
    return StateDirLocked(directory, holders[0] if holders else None, recorded if holders else None)


def _holders(fd: int) -> list[int]:
    """Live processes other than ours with the file of ``fd`` open (from ``/proc``; empty elsewhere)."""
    target = os.fstat(fd)
    me = os.getpid()
    found: list[int] = []
    try:
        pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return found
    for pid in pids:
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to look at
        for name in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if st.st_ino == target.st_ino and st.st_dev == target.st_dev:
                if _alive(pid):
                    found.append(pid)
                break
    return found
