"""What the REST API keeps for itself: the event epoch and each workspace cwd's default session.

With a state directory both live in it and survive a restart on the same directory:

- ``rest-event-epoch``: the token sent as ``X-Qwen-Event-Epoch`` (and ``eventEpoch``). Event ids are
  the transcript's, durable in the same directory, so a cursor from before a restart is still good
  and the epoch must not change; a different directory is a different event bus and a new epoch.
- ``rest-default-sessions.json``: ``{cwd: sessionId}``, the session ``POST /session`` with
  ``sessionScope: "single"`` attaches to.

Without a state directory the epoch is random per process (event ids restart with the process) and
the map lives in memory. Both files are small and written whole (a temporary file then a rename).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import secrets

__all__ = ["RestState"]

log = logging.getLogger("acp_server.http")

EPOCH_FILE = "rest-event-epoch"
DEFAULTS_FILE = "rest-default-sessions.json"


def _write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RestState:
    """The REST API's own small state (see the module docstring).

    Args:
        directory: the server's state directory, or ``None`` (kept in memory only).
    """

    def __init__(self, directory: pathlib.Path | str | None) -> None:
        self.directory = pathlib.Path(directory) if directory is not None else None
        self.epoch = self._load_epoch()
        self._defaults: dict[str, str] = self._load_defaults()

    def _load_epoch(self) -> str:
        if self.directory is None:
            return secrets.token_hex(8)
        path = self.directory / EPOCH_FILE
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
            return text
        epoch = secrets.token_hex(8)
        _write(path, epoch + "\n")
        return epoch

    def _load_defaults(self) -> dict[str, str]:
        if self.directory is None:
            return {}
        try:
            doc = json.loads((self.directory / DEFAULTS_FILE).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("rest: %s unreadable (%s); starting with no default sessions", DEFAULTS_FILE, exc)
            return {}
        if not isinstance(doc, dict):
            return {}
        return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}

    def _save_defaults(self) -> None:
        if self.directory is not None:
            _write(self.directory / DEFAULTS_FILE, json.dumps(self._defaults, sort_keys=True) + "\n")

    def default_session(self, cwd: str) -> str | None:
        """The default session of ``cwd`` (``None``: it has none yet)."""
        return self._defaults.get(cwd)

    def set_default(self, cwd: str, session_id: str) -> None:
        """Make ``session_id`` the default session of ``cwd``."""
        if self._defaults.get(cwd) != session_id:
            self._defaults[cwd] = session_id
            self._save_defaults()

    def forget_session(self, session_id: str) -> None:
        """``session_id`` ended: it is no longer any cwd's default."""
        gone = [cwd for cwd, sid in self._defaults.items() if sid == session_id]
        for cwd in gone:
            del self._defaults[cwd]
        if gone:
            self._save_defaults()
