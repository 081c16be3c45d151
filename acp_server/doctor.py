"""``acp-server doctor``: check what ``acp-server serve`` would use with the same flags, and say what to
do about each problem.

Checks, in order: the state directory (can it be created or written, does another process hold its
lock, and which one; the old shared location's database), each configured agent backend's command
(found on ``PATH`` or at its path, executable; its ``cwd``), and each listener (the TCP port free, or
who answers there; the Unix socket's directory and a live socket at the path). Nothing is started or
changed: the lock is tried and let go at once, a port is bound and closed, a socket only connected to.

Each line starts with ``ok``, ``info`` or ``FAIL``; a ``FAIL`` is followed by a ``->`` line saying what
to do. Exit 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import stat
import sys
from dataclasses import dataclass
from typing import TextIO

from .config import BackendConfig
from .server import ListenAddress, ServerConfig
from .statedir import legacy_database, state_root
from .store import DB_NAME

__all__ = ["Finding", "check_backend_command", "check_listen", "check_state_dir", "run_doctor"]

#: How long a probe of a port in use waits for an ``initialize`` answer.
PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``level`` is ``ok``, ``info`` or ``FAIL``; ``fix`` says what to do."""

    level: str
    what: str
    fix: str | None = None

    @property
    def failed(self) -> bool:
        return self.level == "FAIL"


def _ok(what: str) -> Finding:
    return Finding("ok", what)


def _fail(what: str, fix: str) -> Finding:
    return Finding("FAIL", what, fix)


def _cmdline(pid: int) -> str | None:
    try:
        raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    return " ".join(words) or None


def lock_holder(directory: pathlib.Path) -> tuple[bool, int | None]:
    """Whether another process holds ``directory``'s lock, and the pid written in it (not created if missing)."""
    try:
        fd = os.open(directory / "lock", os.O_RDWR)
    except OSError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return True, int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    finally:
        os.close(fd)


def _writable_ancestor(path: pathlib.Path) -> pathlib.Path | None:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent if os.access(parent, os.W_OK | os.X_OK) else None
    return None


def check_state_dir(config: ServerConfig, explicit: bool, urls: list[str]) -> list[Finding]:
    """The state directory: usable, not held by another process; the old shared location."""
    if config.state_dir is None:
        why = "--stdio without --state-dir" if config.stdio else "--ephemeral"
        return [Finding("info", f"state: none ({why}): sessions live in memory and end with the process")]
    directory = pathlib.Path(config.state_dir)
    out: list[Finding] = []
    if directory.exists():
        if not directory.is_dir():
            return [_fail(f"state directory {directory} is not a directory", "remove it or pass another --state-dir")]
        if not os.access(directory, os.W_OK | os.X_OK):
            return [_fail(f"state directory {directory} is not writable by you", "fix its permissions or pass another --state-dir")]
        held, pid = lock_holder(directory)
        if held:
            owner = f"pid {pid}" if pid is not None else "another process"
            cmd = _cmdline(pid) if pid is not None else None
            running = f" ({cmd})" if cmd else ""
            share = f" (`acp-server prompt --connect {urls[0]} ...`, editors: `acp-server connect {urls[0]}`)" if urls else ""
            out.append(
                _fail(
                    f"state directory {directory} is in use by {owner}{running}",
                    f"that server is running: use it{share}, stop it (kill {pid if pid is not None else 'PID'}), "
                    "or pass another --state-dir, or --ephemeral",
                )
            )
        else:
            sessions = " (with a database)" if (directory / DB_NAME).exists() else ""
            out.append(_ok(f"state directory {directory}{sessions}: writable, not in use"))
    else:
        ancestor = _writable_ancestor(directory)
        if ancestor is None:
            out.append(_fail(f"state directory {directory} cannot be created", "pass a --state-dir you can write"))
        else:
            out.append(_ok(f"state directory {directory}: created at the first start"))
    root = state_root()
    legacy = legacy_database(root)
    if legacy is not None and not explicit and not (directory / DB_NAME).exists():
        held, pid = lock_holder(root)
        if held:
            out.append(
                Finding(
                    "info",
                    f"the old shared location {root} holds sessions and is in use by pid {pid}: they stay there",
                )
            )
        else:
            out.append(Finding("info", f"the sessions at the old shared location {root} move to {directory} at start"))
    return out


def _found(command: str, cfg: BackendConfig) -> str | None:
    if "/" in command:
        path = pathlib.Path(cfg.cwd or os.getcwd()) / command
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    search = cfg.env.get("PATH", os.environ.get("PATH", os.defpath))
    return shutil.which(command, path=search)


def check_backend_command(name: str, cfg: BackendConfig) -> list[Finding]:
    """One backend: the built-in echo, or an agent whose command must be found and runnable."""
    if cfg.kind == "echo":
        return [_ok(f"backend {name}: the built-in echo agent")]
    out: list[Finding] = []
    if cfg.cwd is not None and not pathlib.Path(cfg.cwd).is_dir():
        out.append(_fail(f"backend {name}: cwd {cfg.cwd} is not a directory", f"create it or fix backends.{name}.cwd"))
    program = (cfg.command or [""])[0]
    found = _found(program, cfg)
    if found is None:
        where = "at that path" if "/" in program else f"on PATH ({cfg.env.get('PATH', os.environ.get('PATH', ''))})"
        out.append(
            _fail(
                f"backend {name}: command {program!r} not found {where}",
                "install it, or name it by its absolute path (--agent NAME=/abs/path, `-- /abs/path`, or "
                f"[backends.{name}] command); an editor starts acp-server with its own PATH, which may lack it",
            )
        )
    else:
        out.append(_ok(f"backend {name}: {' '.join([found, *(cfg.command or [])[1:]])}"))
    return out


def _probe(host: str, port: int) -> str | None:
    """Who answers ``initialize`` at ``host:port`` (the agent's name and version), if anyone does."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n')
            data = b""
            while b"\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    try:
        info = json.loads(data.split(b"\n", 1)[0])["result"]["agentInfo"]
        return f"{info['name']} {info.get('version', '')}".strip()
    except (ValueError, KeyError, TypeError):
        return None


def check_listen(addr: ListenAddress, flag: str = "--listen") -> Finding:
    """One listener: its port or socket path is free to take."""
    if addr.kind == "unix":
        path = pathlib.Path(addr.path)
        if not path.parent.is_dir():
            return _fail(f"{flag} {addr}: directory {path.parent} does not exist", "create it or choose another path")
        try:
            st = path.lstat()
        except FileNotFoundError:
            return _ok(f"{flag} {addr}: free")
        if not stat.S_ISSOCK(st.st_mode):
            return _fail(f"{flag} {addr}: the path exists and is not a socket", "remove it or choose another path")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            try:
                sock.connect(str(path))
            except OSError:
                return _ok(f"{flag} {addr}: a stale socket file (replaced at start)")
        return _fail(
            f"{flag} {addr}: another server is live on this socket",
            f"use it (`acp-server prompt --connect {addr} ...`), stop it, or choose another path",
        )
    if addr.port == 0:
        return _ok(f"{flag} {addr}: any free port")
    try:
        infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return _fail(f"{flag} {addr}: cannot resolve {addr.host!r}: {exc.strerror}", "use 127.0.0.1, ::1 or localhost")
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return _fail(f"{flag} {addr}: cannot bind: {exc.strerror}", "choose another address")
        else:
            return _ok(f"{flag} {addr}: port free")
    who = _probe(addr.host, addr.port)
    if who is not None and who.startswith("acp-server"):
        return _fail(
            f"{flag} {addr}: port in use by a running {who}",
            f"use it (`acp-server prompt --connect {addr} ...`), stop it, or choose another port",
        )
    return _fail(f"{flag} {addr}: port in use by another program", "stop it or choose another port")


def _editor_command() -> Finding:
    exe = shutil.which("acp-server", path=os.path.dirname(sys.executable)) or shutil.which("acp-server")
    if exe is None:
        return Finding("info", f"no acp-server command found; editors can run {sys.executable} -m acp_server")
    return Finding("info", f"the command for an editor's settings: {os.path.abspath(exe)}")


def run_doctor(
    config: ServerConfig,
    args: argparse.Namespace,
    out: TextIO | None = None,
) -> int:
    """Run every check for ``config`` and print the findings; 0 when none failed, else 1."""
    out = out or sys.stdout
    urls = [str(a) for a in config.listen if not (a.kind == "tcp" and a.port == 0)]
    findings: list[Finding] = []
    findings += check_state_dir(config, args.state_dir is not None, urls)
    for name, cfg in config.backends.items():
        findings += check_backend_command(name, cfg)
    for addr in config.listen:
        findings.append(check_listen(addr))
    if config.metrics_listen is not None:
        findings.append(check_listen(config.metrics_listen, "--metrics-listen"))
    findings.append(_editor_command())
    for finding in findings:
        out.write(f"{finding.level:<5} {finding.what}\n")
        if finding.fix:
            out.write(f"      -> {finding.fix}\n")
    failed = sum(f.failed for f in findings)
    out.write(f"acp-server doctor: {failed} problem{'s' if failed != 1 else ''}\n" if failed else "acp-server doctor: all good\n")
    out.flush()
    return 1 if failed else 0
