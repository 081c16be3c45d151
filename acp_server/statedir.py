"""The default state directory: one per set of listen addresses (and config file) under
``$XDG_STATE_HOME/acp-server/`` (else ``~/.local/state/acp-server/``).

Two servers on one machine (two checkouts, two users of one account, a test run beside ``make run``)
used to share ``$XDG_STATE_HOME/acp-server`` itself, so the second one was refused and ``sessions``
listed the other's sessions. Now ``serve --listen tcp://127.0.0.1:4170`` keeps its sessions in
``.../acp-server/tcp-127.0.0.1-4170/``, and ``--config team.toml`` adds the file's name and a hash of
its path (``tcp-127.0.0.1-4170+team-1a2b3c4d``). ``--state-dir`` still names any directory.

The database of the old shared location (``.../acp-server/sessions.db``) is still found: the first
server whose keyed directory has no database yet moves it there (with its WAL), under the old
location's lock, and says so on stderr; a server running on the old location keeps it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .store import DB_NAME, StateDirLocked, StateLock, default_state_dir

if TYPE_CHECKING:
    from .server import ListenAddress

__all__ = ["LEGACY_FILES", "adopt_legacy", "keyed_state_dir", "state_key", "state_root"]

#: The files of a database at the old shared location, moved together.
LEGACY_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def state_root() -> pathlib.Path:
    """``$XDG_STATE_HOME/acp-server`` (else ``~/.local/state/acp-server``): the keyed directories' parent
    and the old shared location."""
    return default_state_dir()


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _slug(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-") or "x"


def _address_key(addr: ListenAddress) -> str:
    if addr.kind == "unix":
        name = os.path.basename(addr.path.rstrip("/")) or "socket"
        return f"unix-{_slug(name)}-{_short_hash(os.path.abspath(addr.path))}"
    return _slug(f"tcp-{addr.host}-{addr.port}")


def state_key(listen: Sequence[ListenAddress], config_path: str | None = None) -> str:
    """The directory name for a server listening on ``listen`` with ``config_path``.

    Sorted, so ``--listen A --listen B`` and ``--listen B --listen A`` share one directory.
    """
    parts = sorted({_address_key(addr) for addr in listen}) or ["stdio"]
    key = "+".join(parts)
    if config_path:
        path = os.path.abspath(config_path)
        key += f"+{_slug(pathlib.Path(path).stem)}-{_short_hash(path)}"
    return key


def keyed_state_dir(listen: Sequence[ListenAddress], config_path: str | None = None) -> pathlib.Path:
    """The default ``--state-dir`` of a server listening on ``listen`` with ``config_path``."""
    return state_root() / state_key(listen, config_path)


def legacy_database(root: pathlib.Path | None = None) -> pathlib.Path | None:
    """The database at the old shared location, if there is one."""
    path = (root or state_root()) / DB_NAME
    return path if path.is_file() else None


def adopt_legacy(target: pathlib.Path, root: pathlib.Path | None = None) -> str | None:
    """Move the old shared location's database into ``target`` when ``target`` has none yet.

    Returns:
        What happened, for one line on stderr (``None``: nothing to do).
    """
    root = root or state_root()
    if legacy_database(root) is None or (target / DB_NAME).exists():
        return None
    lock = StateLock(root)
    try:
        lock.acquire(dead_owner_wait_s=0)
    except StateDirLocked as exc:
        owner = f"pid {exc.owner_pid}" if exc.owner_pid is not None else "another process"
        return f"the sessions at {root} (the old default) stay there: in use by {owner}"
    try:
        if legacy_database(root) is None:  # another server moved it meanwhile
            return None
        target.mkdir(parents=True, exist_ok=True)
        for name in LEGACY_FILES:
            source = root / name
            if source.exists():
                os.replace(source, target / name)
    finally:
        lock.release()
    return f"moved the sessions of {root} (the old shared default) to {target}"
