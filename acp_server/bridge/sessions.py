"""The table of live sessions: the one place a :class:`Session` is built, restored or counted.

A stored session that is not live is made live synchronously (:meth:`SessionTable.restore`: metadata
from the index, the transcript left on disk until a replay or a fork needs it,
:meth:`SessionTable.load_transcript`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
import trio

from ..admission.limits import Limits
from ..backends.base import Backend, TranscriptEntry
from ..errors import SessionLimitExceededError
from ..store import TURN_STATE, StoredEvent, StoredSession
from .clients import now_ms
from .fanout import FanOut
from .persistence import Persistence
from .session import Session

__all__ = ["SessionTable"]

log = logging.getLogger("acp_server.bridge")


class SessionTable:
    """Live sessions by id, bounded by ``limits.max_sessions``.

    Args:
        limits: ``max_sessions`` (0: unbounded).
        backends: name -> backend, for restored sessions; ``default`` when theirs is gone.
        persistence: where stored transcripts are read.
        fanout: what a restored session's backend emits outside a turn goes through it.
    """

    def __init__(
        self, limits: Limits, backends: Mapping[str, Backend], default: Backend, persistence: Persistence, fanout: FanOut
    ) -> None:
        self._limits = limits
        self._backends = backends
        self._default = default
        self._persistence = persistence
        self._fanout = fanout
        #: session id -> live session
        self.live: dict[str, Session] = {}

    def check_limit(self) -> None:
        """Raise ``session_limit_exceeded`` when ``max_sessions`` sessions are live."""
        limit = self._limits.max_sessions
        if limit and len(self.live) >= limit:
            raise SessionLimitExceededError(limit=limit)

    @staticmethod
    def build(
        backend: Backend,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        tenant: str,
        *,
        session_id: str | None = None,
        created_ms: int | None = None,
    ) -> Session:
        """A new session object (not live yet: see :meth:`add`), with a fresh id unless given one."""
        return Session(
            session_id or f"sess_{uuid.uuid4().hex}", cwd, mcp_servers, backend, trio.current_time(),
            now_ms() if created_ms is None else created_ms, tenant,
        )

    def add(self, session: Session) -> None:
        """Make ``session`` live."""
        self.live[session.session_id] = session

    def is_live(self, session: Session) -> bool:
        """``session`` is the live one of its id (not closed)."""
        return self.live.get(session.session_id) is session

    def restore(self, meta: StoredSession) -> Session:
        """Make a stored session live, synchronously: metadata from the index, transcript left on disk.

        Raises:
            SessionLimitExceededError: ``max_sessions`` sessions are live.
        """
        self.check_limit()
        backend = self._backends.get(meta.backend)
        if backend is None:
            log.warning("session %s was on backend %r, which is gone: using %s", meta.session_id, meta.backend, self._default.name)
            backend = self._default
        session = self.build(
            backend, meta.cwd, list(meta.mcp_servers), meta.tenant, session_id=meta.session_id, created_ms=meta.created_ms
        )
        session.updated_ms = meta.updated_ms
        session.title = meta.title
        session.next_event_id = meta.next_event_id
        session.stored_upto = meta.next_event_id - 1
        restore = getattr(backend, "restore_session", None)
        if restore is not None:
            restore(session.session_id, session.cwd, session.mcp_servers,
                    lambda u: self._fanout.emit(session, u, None), meta.backend_state)
        self.add(session)
        log.info("restored session %s from the store", session.session_id)
        return session

    async def load_transcript(self, session: Session) -> None:
        """Put the on-disk part of a restored session's transcript in front of its ``history``."""
        upto = session.stored_upto
        if not upto:
            return
        events = await self._persistence.read_transcript(session.session_id, upto)
        if session.stored_upto == upto:  # not merged by a concurrent load meanwhile
            session.history[:0] = [(e.event_id, e if e.method is not None else e.body) for e in events]
            session.stored_upto = 0

    async def transcript(self, session: Session, upto: int) -> list[TranscriptEntry]:
        """The session's transcript up to event ``upto``, decoded: ``(None, update)`` for each
        ``session/update`` payload, ``(method, params)`` for each extension notification kept (a
        backend that keeps a conversation rebuilds it from this after a restart or a fork)."""
        await self.load_transcript(session)
        out: list[TranscriptEntry] = []
        for event_id, entry in session.history:
            if event_id > upto:
                break
            if isinstance(entry, StoredEvent):
                out.append((entry.method or TURN_STATE, msgspec.json.decode(entry.body)))
            elif isinstance(entry, bytes | msgspec.Raw):
                out.append((None, msgspec.json.decode(entry)))
            else:
                out.append((None, msgspec.to_builtins(entry)))
        return out
