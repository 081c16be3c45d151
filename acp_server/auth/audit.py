"""The audit log: one JSON object per line for each authentication, failure, revocation and admin act.

Lines go to stderr, or to ``--audit-log FILE`` (appended, created 0600)::

    {"ts":"2026-12-01T10:00:00.123Z","event":"auth_ok","tokenId":"ci-acme","tenant":"acme","transport":"tcp","source":"10.0.0.7"}

Events (:data:`EVENTS`): ``auth_ok``, ``auth_failed`` (``reason``: ``missing``, ``malformed``,
``unknown_or_expired``), ``auth_refused`` (an address over its failure limit, ``retryAfterMs``),
``token_revoked`` and ``token_expired`` (a token gone at a reload or past its expiry; ``evicted``:
connections closed), ``tokens_reloaded``, ``tokens_reload_failed`` (``detail``: why; the old tokens
stay), ``admin_act`` (``action``, ``target``).

A line never holds a secret: the writer takes only named fields (ids, tenants, addresses, reasons),
and a failure's presented credential is described by its reason alone, never quoted.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TextIO

import msgspec

__all__ = ["EVENTS", "AuditLog"]

log = logging.getLogger("acp_server.auth.audit")

EVENTS = (
    "auth_ok",
    "auth_failed",
    "auth_refused",
    "token_revoked",
    "token_expired",
    "tokens_reloaded",
    "tokens_reload_failed",
    "admin_act",
)
_FAILURE_REASONS = ("missing", "malformed", "unknown_or_expired")
_encode = msgspec.json.Encoder().encode


def _now() -> datetime:
    return datetime.now(UTC)


class AuditLog:
    """Writes audit lines to a text stream or an append-only file.

    Args:
        path: ``--audit-log FILE`` (opened for append, created 0600), or ``None`` for ``stream``.
        stream: where lines go without a path (default: stderr at the time of each write).
        clock: the wall clock of ``ts`` (injectable for tests).

    Raises:
        OSError: ``path`` cannot be opened.
    """

    def __init__(
        self, path: str | None = None, *, stream: TextIO | None = None, clock: Callable[[], datetime] = _now
    ) -> None:
        self.path = path
        self._clock = clock
        self._stream = stream
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._warned = False
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        """Close the file (a stream is left open: it is not ours)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, event: str, fields: dict[str, object]) -> None:
        when = self._clock().astimezone(UTC)
        record: dict[str, object] = {
            "ts": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
            "event": event,
        }
        record.update((k, v) for k, v in fields.items() if v is not None)
        line = _encode(record) + b"\n"
        try:
            with self._lock:
                if self._fd is not None:
                    os.write(self._fd, line)  # one write of one line: O_APPEND keeps lines whole
                else:
                    stream = self._stream or sys.stderr
                    stream.write(line.decode())
                    stream.flush()
        except (OSError, ValueError) as exc:  # a full disk or a closed stream must not stop serving
            if not self._warned:
                self._warned = True
                log.warning("audit log %s: cannot write (%s); audit lines are being lost", self.path or "stderr", exc)

    def auth_ok(self, *, token_id: str, tenant: str, transport: str, source: str | None) -> None:
        """A connection or request proved a token."""
        self._write("auth_ok", {"tokenId": token_id, "tenant": tenant, "transport": transport, "source": source})

    def auth_failed(self, *, reason: str, transport: str, source: str | None) -> None:
        """Credentials were refused; ``reason`` is one of ``missing``, ``malformed``, ``unknown_or_expired``."""
        if reason not in _FAILURE_REASONS:
            raise ValueError(f"audit: unknown failure reason {reason!r} (accepted: {', '.join(_FAILURE_REASONS)})")
        self._write("auth_failed", {"reason": reason, "transport": transport, "source": source})

    def auth_refused(self, *, transport: str, source: str | None, retry_after_ms: int) -> None:
        """An address over its failure limit was refused without its credentials being checked."""
        self._write("auth_refused", {"transport": transport, "source": source, "retryAfterMs": retry_after_ms})

    def token_revoked(self, *, token_id: str, evicted: int = 0) -> None:
        """A token left the file (or changed); ``evicted`` connections and streams of it were closed."""
        self._write("token_revoked", {"tokenId": token_id, "evicted": evicted})

    def token_expired(self, *, token_id: str, evicted: int = 0) -> None:
        """A token passed its expiry; ``evicted`` connections and streams of it were closed."""
        self._write("token_expired", {"tokenId": token_id, "evicted": evicted})

    def tokens_reloaded(self, *, path: str, added: int, removed: int, changed: int) -> None:
        """The tokens file was read again and taken."""
        self._write("tokens_reloaded", {"path": path, "added": added, "removed": removed, "changed": changed})

    def tokens_reload_failed(self, *, path: str, detail: str) -> None:
        """The tokens file could not be taken; the tokens in force stay."""
        self._write("tokens_reload_failed", {"path": path, "detail": detail})

    def admin_act(self, *, token_id: str | None, action: str, target: str | None = None, tenant: str | None = None) -> None:
        """An ``admin`` identity acted beyond its own tenant (``token_id`` ``None``: the owner)."""
        self._write("admin_act", {"tokenId": token_id, "action": action, "target": target, "tenant": tenant})
