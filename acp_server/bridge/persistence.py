"""The bridge's one seam to durability: what it records, and when a record is committed.

:class:`StorePersistence` writes through a :class:`~acp_server.store.SessionStore` (sessions,
transcript entries, admitted and settled prompts) and keeps the index of every stored session;
:class:`NullPersistence` (``--ephemeral``) records nothing and everything is committed at once. The
bridge calls the same methods either way; only the fan-out needs to know whether answers wait for a
commit (:attr:`Persistence.durable`, read once at construction).

Operation numbers: :meth:`Persistence.admit` returns the op whose commit lets the prompt run, and
:attr:`Persistence.committed` is the highest committed op; with nothing to commit both stay 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from operator import attrgetter
from time import time_ns
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..store import StoredEvent, StoredSession
from .session import PromptTicket, Session

if TYPE_CHECKING:
    from ..store import SessionStore

__all__ = ["NullPersistence", "Persistence", "StorePersistence"]

log = logging.getLogger("acp_server.bridge")


class Persistence(Protocol):
    """What the bridge records of its sessions (see the module docstring)."""

    #: answers and updates wait for the commit of what they follow (durable before visible)
    durable: bool
    #: every stored session's metadata, live or not (admission restores from it synchronously)
    stored: dict[str, StoredSession]

    @property
    def committed(self) -> int:
        """The highest committed op number."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run what commits records until cancelled (returns at once when nothing needs it)."""
        ...

    def save_session(self, session: Session) -> None:
        """Record the session's metadata (created, forked)."""
        ...

    def unload(self, session: Session) -> None:
        """The session closed but stays stored: keep its latest metadata in the index."""
        ...

    def forget(self, session_id: str) -> bool:
        """Delete a stored session and its transcript; False when it was not stored."""
        ...

    def add_event(self, session_id: str, event_id: int, update: Any, method: str | None = None) -> None:
        """Append one transcript entry (``update``: its JSON bytes, or anything msgspec encodes)."""
        ...

    def copy_transcript(self, session: Session) -> None:
        """Record every entry of ``session.history`` (a fork's copied transcript)."""
        ...

    def admit(self, ticket: PromptTicket) -> int:
        """Record an admitted prompt; returns the op whose commit lets it run."""
        ...

    def settle(self, ticket: PromptTicket) -> None:
        """Record a settled prompt's outcome."""
        ...

    def when_committed(self, op: int, callback: Callable[[], None]) -> None:
        """Run ``callback`` once op ``op`` (not committed yet) is."""
        ...

    def after_round(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current write round (what is recorded until it is taken) commits."""
        ...

    @property
    def generation(self) -> int:
        """Changes each time a write round is taken."""
        ...

    async def read_transcript(self, session_id: str, upto: int) -> list[StoredEvent]:
        """The stored transcript entries of ``session_id`` up to event ``upto``."""
        ...

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """The stored transcript entries of ``session_id`` with ``after < eventId <= upto`` (one page)."""
        ...

    def list_sessions(
        self, live: dict[str, Session], cwd: str | None, tenant: str | None
    ) -> list[Session | StoredSession]:
        """Every session to list, in creation order: the live ones, and the stored ones."""
        ...


class NullPersistence:
    """``--ephemeral``: nothing is recorded, everything is committed at once."""

    durable = False
    committed = 0
    generation = 0

    def __init__(self) -> None:
        self.stored: dict[str, StoredSession] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to run."""
        task_status.started()

    def save_session(self, session: Session) -> None:
        """Nothing is recorded."""

    def unload(self, session: Session) -> None:
        """Nothing is kept."""

    def forget(self, session_id: str) -> bool:
        """Nothing was stored."""
        return False

    def add_event(self, session_id: str, event_id: int, update: Any, method: str | None = None) -> None:
        """Nothing is recorded."""

    def copy_transcript(self, session: Session) -> None:
        """Nothing is recorded."""

    def admit(self, ticket: PromptTicket) -> int:
        """Nothing to commit: op 0, committed already."""
        return 0

    def settle(self, ticket: PromptTicket) -> None:
        """Nothing is recorded."""

    def when_committed(self, op: int, callback: Callable[[], None]) -> None:
        """Never called: every op is committed."""
        raise AssertionError("nothing waits for a commit without a store")

    def after_round(self, callback: Callable[[], None]) -> None:
        """Never called: nothing waits for a commit."""
        raise AssertionError("nothing waits for a commit without a store")

    async def read_transcript(self, session_id: str, upto: int) -> list[StoredEvent]:
        """Never called: no session has a stored part."""
        raise AssertionError("no transcript is stored without a store")

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """Never called: no session has a stored part."""
        raise AssertionError("no transcript is stored without a store")

    def list_sessions(
        self, live: dict[str, Session], cwd: str | None, tenant: str | None
    ) -> list[Session | StoredSession]:
        """The live sessions, with ``cwd`` and of ``tenant`` when given."""
        return [
            s for s in live.values()
            if (cwd is None or s.cwd == cwd) and (tenant is None or s.tenant == tenant)
        ]


class StorePersistence:
    """Records through a :class:`SessionStore` (see the module docstring).

    What the bridge calls several times per prompt goes to the store without a call of its own here:
    :attr:`committed` and :attr:`generation` read the store's (no Python frame), and
    :meth:`add_event`, :meth:`when_committed` and :meth:`after_round` are the store's own methods.

    Args:
        store: the store, opened.
        stored: its session index, as :meth:`SessionStore.open` returned it.
    """

    durable = True

    #: the store's highest committed op
    committed = property(attrgetter("store.committed"))
    #: the store's write-round generation
    generation = property(attrgetter("store.generation"))

    #: append one transcript entry (``session_id, event_id, update, method=None``): the store's
    #: :meth:`~acp_server.store.SessionStore.add_event`
    add_event: Callable[..., None]
    #: run ``callback`` once op ``op`` is committed: the store's ``when_committed``
    when_committed: Callable[[int, Callable[[], None]], None]
    #: run ``callback`` once the current write round is committed: the store's ``after_round``
    after_round: Callable[[Callable[[], None]], None]

    def __init__(self, store: SessionStore, stored: dict[str, StoredSession]) -> None:
        self.store = store
        self.stored = dict(stored)
        self.add_event = store.add_event
        self.when_committed = store.when_committed
        self.after_round = store.after_round

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the store's writer, unless it runs already."""
        if self.store.running:
            task_status.started()
            return
        await self.store.run(task_status=task_status)

    def save_session(self, session: Session) -> None:
        """Write the session's row and index it."""
        state = getattr(session.backend, "session_state", None)
        meta = StoredSession(
            session.session_id, session.cwd, session.backend.name, session.created_ms, session.updated_ms,
            list(session.mcp_servers), session.title, session.next_event_id,
            state(session.session_id) if state is not None else None, session.tenant,
        )
        self.stored[session.session_id] = meta
        self.store.save_session(meta)

    def unload(self, session: Session) -> None:
        """Keep the closed session's next event id, update time and title in the index."""
        meta = self.stored.get(session.session_id)
        if meta is not None:
            meta.next_event_id = session.next_event_id
            meta.updated_ms = session.updated_ms
            meta.title = session.title

    def forget(self, session_id: str) -> bool:
        """Delete the session's row and transcript, if it is stored."""
        if self.stored.pop(session_id, None) is None:
            return False
        self.store.delete_session(session_id)
        return True

    def copy_transcript(self, session: Session) -> None:
        """Append every entry of the session's history."""
        store = self.store
        for event_id, update in session.history:
            if isinstance(update, StoredEvent):
                store.add_event(session.session_id, event_id, update.body, update.method)
            else:
                store.add_event(session.session_id, event_id, update)

    def admit(self, ticket: PromptTicket) -> int:
        """Record the admitted prompt."""
        return self.store.admit(ticket.seq, ticket.prompt_id, ticket.session.session_id)

    def settle(self, ticket: PromptTicket) -> None:
        """Record the prompt's outcome (its stop reason or error kind); the session was updated now."""
        result, error = ticket.result, ticket.error
        outcome = result.stop_reason if result is not None else error.kind if error is not None else "internal"
        ticket.session.updated_ms = time_ns() // 1_000_000  # now_ms(), inline: once per prompt
        self.store.settle(ticket.seq, outcome)

    async def read_transcript(self, session_id: str, upto: int) -> list[StoredEvent]:
        """Read the session's stored entries up to ``upto``."""
        return await self.store.read_events(session_id, 0, upto)

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """Read one page of the session's stored entries."""
        return await self.store.read_events(session_id, after, upto)

    def list_sessions(
        self, live: dict[str, Session], cwd: str | None, tenant: str | None
    ) -> list[Session | StoredSession]:
        """Every stored session (live ones as they are now), with ``cwd`` and of ``tenant`` when given."""
        return [
            live.get(m.session_id) or m for m in self.stored.values()
            if (cwd is None or m.cwd == cwd) and (tenant is None or m.tenant == tenant)
        ]
