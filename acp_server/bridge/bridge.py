"""The session bridge: sessions, per-session prompt FIFOs, client ids and update fan-out.

Admission is synchronous: :meth:`SessionBridge.admit_prompt` checks and counts with no ``await`` in
between, so under trio nothing can run between the check and the increment. Its order is fixed:
session lookup, client id, a request already cancelled, the pending-prompt limit, then the increment
and enqueue. Every admitted prompt settles exactly once (result or error), and the session's pending
slot is released at that moment, whichever of success, error, cancel, deadline, lost connection or
crash comes first. The bridge touches no socket: connections are :class:`Peer` objects.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec
import outcome
import trio

from ..admission.limits import Limits
from ..admission.policy import PolicyEngine, Queued, Seat, WaitDeadlineExpired
from ..admission.pool import CapacityManager, Lease
from ..backends.base import Backend, ClientChannel, SessionSetup, Turn
from ..errors import (
    RETRY_AFTER_MS,
    AcpError,
    BackendUnavailableError,
    BranchWhilePromptActiveError,
    IdempotencyKeyConflictError,
    InternalError,
    InvalidClientIdError,
    InvalidParamsError,
    PromptDeadlineExceededError,
    PromptQueueFullError,
    RequestCancelledError,
    SessionLimitExceededError,
    SessionNotFoundError,
)
from ..jsonrpc.dispatch import Deferred
from ..store.records import TURN_STATE, StoredEvent, StoredSession
from ..types.acp import ContentBlock, PromptResult, SessionNotification, UserMessageChunk
from ..types.ext import TERMINAL_TURN_STATES

if TYPE_CHECKING:
    from ..store import SessionStore
from .session import ClientReg, ForkTicket, Peer, PromptTicket, Session

__all__ = ["BridgeStatistics", "PromptWaiter", "SessionBridge"]

log = logging.getLogger("acp_server.bridge")

_encoder = msgspec.json.Encoder()


class _UpdateMsg(msgspec.Struct):
    jsonrpc: str
    method: str
    params: SessionNotification


#: how long (one to two sweeps) a session's runner stays parked with an empty FIFO before it ends
RUNNER_IDLE_S = 1.0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _cancelled(ticket: PromptTicket) -> PromptResult:
    return PromptResult(stop_reason="cancelled", meta={"promptId": ticket.prompt_id})


def _terminal_state(result: PromptResult | None, error: AcpError | None) -> tuple[str, str | None]:
    """The terminal turn state of an outcome, and its reason (the stop reason or the error kind)."""
    if error is not None:
        return ("cancelled" if isinstance(error, RequestCancelledError) else "failed"), error.kind
    if result is not None and result.stop_reason == "cancelled":
        return "cancelled", None
    return "completed", result.stop_reason if result is not None else None


#: what waits for a write round's commit, in order: consecutive messages for the same connections
#: (sent as one), or a settled prompt to answer
_Deferred: TypeAlias = "tuple[tuple[Peer, ...], list[bytes]] | PromptTicket"


class _ExtMsg(msgspec.Struct):
    jsonrpc: str
    method: str
    params: dict[str, Any]


class _TurnChannel:
    """A prompt's client channel that reports ``paused_for_approval`` while a permission request is open."""

    __slots__ = ("_bridge", "_inner", "_open", "_ticket")

    def __init__(self, bridge: SessionBridge, inner: ClientChannel, ticket: PromptTicket) -> None:
        self._bridge = bridge
        self._inner = inner
        self._ticket = ticket
        self._open = 0

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    async def request(self, method: str, params: Any) -> Any:
        if method != "session/request_permission":
            return await self._inner.request(method, params)
        ticket = self._ticket
        self._open += 1
        if self._open == 1 and not ticket.settled:
            self._bridge.turn_state(ticket, "paused_for_approval")
        try:
            return await self._inner.request(method, params)
        finally:
            self._open -= 1
            if not self._open and not ticket.settled:
                self._bridge.turn_state(ticket, "running")


class PromptWaiter(Deferred):
    """A request waiting on a prompt's outcome, answered by callback when the prompt settles."""

    __slots__ = ("_done", "_settled", "bridge", "owner", "ticket")

    def __init__(self, bridge: SessionBridge, ticket: PromptTicket, owner: bool) -> None:
        self.bridge = bridge
        self.ticket = ticket
        self.owner = owner
        self._done: Callable[[Any, AcpError | None], None] | None = None
        self._settled: Callable[[], None] | None = None

    def on_settled(self, settled: Callable[[], None]) -> None:
        self._settled = settled

    def settled(self) -> None:
        """The prompt settled; its answer waits for the store's commit."""
        settled, self._settled = self._settled, None
        if settled is not None:
            settled()

    def subscribe(self, done: Callable[[Any, AcpError | None], None]) -> None:
        ticket = self.ticket
        if ticket.settled and ticket.done.is_set():
            done(ticket.result, ticket.error)
            return
        self._done = done
        ticket.waiters.append(self)

    def notify(self, result: Any, error: AcpError | None) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(result, error)

    def cancel(self, *, connection_lost: bool) -> None:
        ticket = self.ticket
        if ticket.settled or self._done is None:
            return
        if self.owner:
            self.bridge._caller_gone(ticket)  # settles (and so notifies us), unless the prompt runs on
            if ticket.settled:
                return
        ticket.waiters.remove(self)
        if connection_lost:
            self._done = None
        else:
            self.notify(None, RequestCancelledError())


class BridgeStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A snapshot of the bridge, as ``_acp_server/stats`` reports it."""

    sessions: int
    pending_prompts: int
    running_prompts: int
    queued_prompts: int
    clients: int
    attached_connections: int
    admitted_total: int
    refused_total: int
    settled_total: int


class SessionBridge:
    """Owns every session of one server instance.

    Args:
        backend: the agent sessions go to: one backend, or a table name -> backend.
        limits: the bounds; ``max_pending_prompts_per_session`` etc.
        max_pending_prompts_per_session: shortcut overriding ``limits``' field (validated the same way).
        default_backend: the name of the backend a session gets when it names none (with a table).
        store: the durable store (``None``: ephemeral, everything in memory); ``stored``: its session
            index as :meth:`SessionStore.open` returned it, and ``prompt_seq`` the highest prompt number.
        policy: the admission policy engine (default: one that limits nothing and costs nothing).

    Raises:
        TypeError, ValueError: a limit is not of its accepted form (the message names it).
    """

    def __init__(
        self,
        backend: Backend | Mapping[str, Backend],
        limits: Limits | None = None,
        *,
        max_pending_prompts_per_session: Any = None,
        default_backend: str | None = None,
        capacity: CapacityManager | None = None,
        store: SessionStore | None = None,
        stored: dict[str, StoredSession] | None = None,
        prompt_seq: int = 0,
        policy: PolicyEngine | None = None,
    ) -> None:
        limits = limits or Limits()
        if max_pending_prompts_per_session is not None:
            limits = msgspec.structs.replace(limits, max_pending_prompts_per_session=max_pending_prompts_per_session)
            limits.__post_init__()
        self.limits = limits
        self.capacity = capacity or CapacityManager()
        #: the admission policy (issue G): global seats, tenant caps, priority classes; off by default
        self.policy = policy or PolicyEngine()
        #: (session id, idempotency key) -> (prompt fingerprint, ticket, admitted at), oldest first
        self._idempotency: collections.OrderedDict[tuple[str, str], tuple[bytes, PromptTicket, float]] = (
            collections.OrderedDict()
        )
        if isinstance(backend, Mapping):
            self.backends: dict[str, Backend] = dict(backend)
            self.default_backend = default_backend or next(iter(self.backends))
        else:
            self.backends = {backend.name: backend}
            self.default_backend = backend.name
        if self.default_backend not in self.backends:
            raise ValueError(f"default_backend {self.default_backend!r} is not one of {sorted(self.backends)}")
        self.backend = self.backends[self.default_backend]
        for b in self.backends.values():
            if hasattr(b, "on_exit"):
                b.on_exit = self._backend_exited
        self.sessions: dict[str, Session] = {}
        self._nursery: trio.Nursery | None = None
        #: (deadline, seq, ticket): prompts with a deadline, soonest first (settled ones drop out lazily)
        self._deadlines: list[tuple[float, int, PromptTicket]] = []
        self._deadline_changed = trio.Event()
        self._prompt_seq = prompt_seq
        self.store = store
        #: every stored session's metadata, live or not (with a store): admission restores synchronously
        self.stored: dict[str, StoredSession] = dict(stored or {})
        #: with a store: what this write round's commit lets out, in order (see :meth:`_deferred`)
        self._fanout: list[_Deferred] | None = None
        self._fanout_generation = 0
        #: counts :meth:`_stop_idle_runners`' sweeps; a runner parks with the current one
        self._runner_epoch = 0
        self._admitted = 0
        self._refused = 0
        self._settled = 0
        self._closing = False
        #: ``session/resume`` calls that had to mint a new client id (the SDK's self-heal)
        self.self_heal_resumes = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the bridge's tasks (turn runners, backend calls, the idle reaper) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.store is not None and not self.store.running:
                await nursery.start(self.store.run)
            nursery.start_soon(self._reaper)
            nursery.start_soon(self._expire_deadlines)
            nursery.start_soon(self._stop_idle_runners)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def cancel_all(self) -> None:
        """Shutdown: every queued and running prompt ends with ``stopReason: "cancelled"``."""
        self._closing = True
        for session in list(self.sessions.values()):
            self._cancel_session_prompts(session)

    # --- sessions and clients ----------------------------------------------------------------------

    def backend_named(self, name: str | None) -> Backend:
        """The backend called ``name`` (the default for ``None``); ``invalid_params`` naming the known ones."""
        if name is None:
            return self.backend
        backend = self.backends.get(name)
        if backend is None:
            known = ", ".join(sorted(self.backends))
            raise InvalidParamsError(path="_meta.backend", detail=f"unknown backend {name!r}; known: {known}")
        return backend

    def new_session(
        self,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        peer: Peer | None,
        client_id: str | None = None,
        *,
        backend: Backend | None = None,
        tenant: str = "default",
    ) -> tuple[Session, str]:
        """Create a session and register the caller on it; returns the session and its client id.

        The backend is not told (see :meth:`open_session`, which is what ``session/new`` uses).
        """
        self._check_session_limit()
        session_id = f"sess_{uuid.uuid4().hex}"
        session = Session(
            self, session_id, cwd, mcp_servers, backend or self.backend, trio.current_time(), _now_ms(), tenant
        )
        self.sessions[session_id] = session
        self._store_session(session)
        return session, self.register(session, peer, client_id)

    async def open_session(
        self,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        peer: Peer | None,
        client_id: str | None = None,
        *,
        backend: Backend | None = None,
        meta: dict[str, Any] | None = None,
        tenant: str = "default",
    ) -> tuple[Session, str, SessionSetup]:
        """Create a session on its backend (the agent's side first), then register the caller."""
        backend = backend or self.backend
        self._check_session_limit()
        session_id = f"sess_{uuid.uuid4().hex}"
        session = Session(self, session_id, cwd, mcp_servers, backend, trio.current_time(), _now_ms(), tenant)
        setup = await backend.open_session(session_id, cwd, mcp_servers, lambda u: self.emit(session, u, None), meta)
        session.modes = setup.modes
        if setup.modes and isinstance(setup.modes.get("currentModeId"), str):
            session.mode_id = setup.modes["currentModeId"]
        try:
            self._check_session_limit()  # again: others may have been created during the await
        except AcpError:
            if self._nursery is not None:
                self._nursery.start_soon(self._close_on_backend, session)
            raise
        self.sessions[session_id] = session
        self._store_session(session)
        return session, self.register(session, peer, client_id), setup

    def get(self, session_id: str, tenant: str | None = None) -> Session:
        """The live session ``session_id``; a stored one that is not live is restored (no replay).

        With ``tenant``, a session of another tenant is ``session_not_found``, exactly as one that
        does not exist.
        """
        session = self.sessions.get(session_id)
        if session is None:
            meta = self.stored.get(session_id) if self.store is not None else None
            if meta is None or (tenant is not None and meta.tenant != tenant):
                raise SessionNotFoundError(session_id=session_id)
            session = self._restore(meta)
        elif tenant is not None and session.tenant != tenant:
            raise SessionNotFoundError(session_id=session_id)
        return session

    # --- the durable store -------------------------------------------------------------------------

    def _check_session_limit(self) -> None:
        limit = self.limits.max_sessions
        if limit and len(self.sessions) >= limit:
            raise SessionLimitExceededError(limit=limit)

    def _store_session(self, session: Session) -> None:
        store = self.store
        if store is None:
            return
        state = getattr(session.backend, "session_state", None)
        meta = StoredSession(
            session.session_id, session.cwd, session.backend.name, session.created_ms, session.updated_ms,
            list(session.mcp_servers), session.title, session.next_event_id,
            state(session.session_id) if state is not None else None, session.tenant,
        )
        self.stored[session.session_id] = meta
        store.save_session(meta)

    def _restore(self, meta: StoredSession) -> Session:
        """Make a stored session live, synchronously: metadata from the index, transcript left on disk."""
        self._check_session_limit()
        backend = self.backends.get(meta.backend)
        if backend is None:
            log.warning("session %s was on backend %r, which is gone: using %s", meta.session_id, meta.backend, self.backend.name)
            backend = self.backend
        session = Session(
            self, meta.session_id, meta.cwd, list(meta.mcp_servers), backend, trio.current_time(), meta.created_ms,
            meta.tenant,
        )
        session.updated_ms = meta.updated_ms
        session.title = meta.title
        session.next_event_id = meta.next_event_id
        session.stored_upto = meta.next_event_id - 1
        restore = getattr(backend, "restore_session", None)
        if restore is not None:
            restore(session.session_id, session.cwd, session.mcp_servers,
                    lambda u: self.emit(session, u, None), meta.backend_state)
        self.sessions[session.session_id] = session
        log.info("restored session %s from the store", session.session_id)
        return session

    async def _load_transcript(self, session: Session) -> None:
        """Put the on-disk part of a restored session's transcript in front of its ``history``."""
        upto = session.stored_upto
        if not upto or self.store is None:
            return
        events = await self.store.read_events(session.session_id, 0, upto)
        if session.stored_upto == upto:  # not merged by a concurrent load meanwhile
            session.history[:0] = [(e.event_id, e if e.method is not None else e.body) for e in events]
            session.stored_upto = 0

    def _unload(self, session: Session) -> None:
        meta = self.stored.get(session.session_id)
        if meta is not None:
            meta.next_event_id = session.next_event_id
            meta.updated_ms = session.updated_ms
            meta.title = session.title

    def close_or_delete(
        self, session_id: str, peer: Peer | None, client_id: str | None, *, delete: bool, tenant: str | None = None
    ) -> None:
        """``session/close`` / ``session/delete``: a stored session that is not live is not restored for it
        (it has no client ids: one given is invalid)."""
        session = self.sessions.get(session_id)
        store = self.store
        meta = self.stored.get(session_id) if session is None and store is not None else None
        if store is not None and meta is not None and (tenant is None or meta.tenant == tenant):
            if client_id is not None:
                raise InvalidClientIdError(session_id=session_id, client_id=client_id)
            if delete:
                del self.stored[session_id]
                store.delete_session(session_id)
            return
        session = self.get(session_id, tenant)
        self.resolve_client(session, peer, client_id)
        if delete:
            self.delete_session(session)
        else:
            self.close_session(session)

    def delete_session(self, session: Session) -> None:
        """``session/delete``: close it, then forget it and its transcript."""
        self.close_session(session)
        if self.store is not None and self.stored.pop(session.session_id, None) is not None:
            self.store.delete_session(session.session_id)

    def register(self, session: Session, peer: Peer | None, requested: str | None = None) -> str:
        """Register a client on ``session``: re-use ``requested`` if it is registered there, else mint one.

        Registration never fails; the caller's connection becomes attached to the session.
        """
        now = trio.current_time()
        reg = session.clients.get(requested) if requested else None
        if reg is not None:
            reg.refcount += 1
            reg.last_seen, reg.last_seen_ms = now, _now_ms()
        else:
            client_id = f"client_{uuid.uuid4()}"
            reg = session.clients[client_id] = ClientReg(client_id, now, _now_ms())
        session.last_activity = now
        if peer is not None and not peer.closed:
            peer.registrations[session.session_id] = reg.client_id
            self.attach(session, peer)
        return reg.client_id

    def resolve_client(self, session: Session, peer: Peer | None, requested: str | None) -> str | None:
        """The client id a request acts as; ``invalid_client_id`` for an id the session does not know.

        Absent: the connection's own registration for the session, else anonymous (``None``).
        """
        now = trio.current_time()
        if requested is not None:
            reg = session.clients.get(requested)
            if reg is None:
                raise InvalidClientIdError(session_id=session.session_id, client_id=requested)
        else:
            own = peer.registrations.get(session.session_id) if peer is not None else None
            reg = session.clients.get(own) if own is not None else None
            if reg is None:
                return None
        reg.last_seen, reg.last_seen_ms = now, _now_ms()
        session.last_activity = now
        return reg.client_id

    def heartbeat(self, session: Session, client_id: str | None) -> int:
        """Mark activity; returns the last-seen time (epoch ms) of the client, or of the session."""
        session.last_activity = trio.current_time()
        if client_id is not None:
            return session.clients[client_id].last_seen_ms
        return _now_ms()

    def detach(self, session: Session, peer: Peer | None, client_id: str | None) -> None:
        """Release one reference of ``client_id``; the connection stops receiving the session's updates
        once it no longer holds a registration there."""
        if client_id is not None:
            reg = session.clients.get(client_id)
            if reg is not None:
                reg.refcount -= 1
                if reg.refcount <= 0:
                    del session.clients[client_id]
        if peer is not None:
            own = peer.registrations.get(session.session_id)
            if own is None or own == client_id or own not in session.clients:
                peer.registrations.pop(session.session_id, None)
                self.unattach(session, peer)
        session.last_activity = trio.current_time()

    def attach(self, session: Session, peer: Peer) -> None:
        if not peer.closed:
            session.attached.add(peer)
            peer.attached.add(session.session_id)

    def unattach(self, session: Session, peer: Peer) -> None:
        session.attached.discard(peer)
        peer.attached.discard(session.session_id)

    def peer_closed(self, peer: Peer) -> None:
        """A connection is gone: it receives nothing more (its client ids stay with their sessions)."""
        for session_id in list(peer.attached):
            session = self.sessions.get(session_id)
            if session is not None:
                session.attached.discard(peer)
        peer.attached.clear()

    def close_session(self, session: Session) -> None:
        """End the session for every client: its running and queued prompts are cancelled."""
        self._cancel_session_prompts(session)
        if self.store is not None:
            self._unload(session)  # history kept: listed, and loadable again
        if self.sessions.pop(session.session_id, None) is not None and self._nursery is not None:
            self._nursery.start_soon(self._close_on_backend, session)
        self._wake_runner(session, False)  # a parked runner ends (or first drops the settled prompts)
        for peer in list(session.attached):
            peer.attached.discard(session.session_id)
            peer.registrations.pop(session.session_id, None)
        session.attached.clear()
        session.clients.clear()

    async def _close_on_backend(self, session: Session) -> None:
        try:
            await session.backend.close_session(session.session_id)
        except Exception as exc:  # the session is gone for us whatever the agent says
            log.info("backend %s could not close %s: %s", session.backend.name, session.session_id, exc)

    def _backend_exited(self, backend_name: str, exit_code: int | None) -> None:
        """An agent process died: every running and queued prompt on it gets one ``backend_unavailable``."""
        for session in list(self.sessions.values()):
            if session.backend.name != backend_name:
                continue
            for item in list(session.fifo):
                if isinstance(item, PromptTicket):
                    self._settle(
                        item,
                        None,
                        BackendUnavailableError(
                            backend_id=backend_name,
                            session_id=session.session_id,
                            reason="exited",
                            exit_code=exit_code,
                            prompt_id=item.prompt_id,
                        ),
                    )

    async def replay(self, session: Session, peer: Peer, after_event_id: int = 0) -> None:
        """Send the session's history after ``after_event_id`` to ``peer`` alone, then attach it.

        Replayed updates keep their original ``eventId`` and carry no ``originatorClientId``. They wait
        for the connection's writer instead of overflowing; updates that arrive meanwhile are sent in
        order before the connection is attached to the live stream (no gap, no duplicate).
        """
        if session.stored_upto:
            # Always, even for a tail after it: the merge shifts ``history``, so nobody may be iterating it.
            await self._load_transcript(session)
        history = session.history
        index = 0
        while index < len(history) and history[index][0] <= after_event_id:
            index += 1
        while True:
            end = len(history)
            for event_id, update in history[index:end]:
                if isinstance(update, StoredEvent):
                    if not peer.turn_states and (update.method or TURN_STATE) == TURN_STATE:
                        continue  # the connection opted out at initialize
                    params = msgspec.json.decode(update.body)
                    params.update(sessionId=session.session_id, _meta={"eventId": event_id})
                    await peer.send_reliably(_encoder.encode(_ExtMsg("2.0", update.method or TURN_STATE, params)) + b"\n")
                    continue
                data = _encoder.encode(
                    _UpdateMsg(
                        "2.0",
                        "session/update",
                        SessionNotification(session_id=session.session_id, update=update, meta={"eventId": event_id}),
                    )
                ) + b"\n"
                await peer.send_reliably(data)
            index = end
            if len(history) == index:
                break
        self.attach(session, peer)

    def list_sessions(self, cwd: str | None = None, tenant: str | None = None) -> list[Session | StoredSession]:
        """Live sessions, and with a store every stored one too (in creation order); with ``tenant``
        only that tenant's."""
        if self.store is None:
            return [
                s for s in self.sessions.values()
                if (cwd is None or s.cwd == cwd) and (tenant is None or s.tenant == tenant)
            ]
        live = self.sessions
        return [
            live.get(m.session_id) or m for m in self.stored.values()
            if (cwd is None or m.cwd == cwd) and (tenant is None or m.tenant == tenant)
        ]

    # --- prompts -----------------------------------------------------------------------------------

    def admit_prompt(self, session_id: str, prompt: list[ContentBlock], **kwargs: Any) -> PromptTicket:
        """:meth:`admit` returning only the ticket."""
        return self.admit(session_id, prompt, **kwargs)[0]

    def admit(
        self,
        session_id: str,
        prompt: list[ContentBlock],
        *,
        peer: Peer | None,
        client_id: str | None = None,
        deadline_ms: int | None = None,
        cancelled: bool = False,
        channel: ClientChannel | None = None,
        meta: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        priority: str = "interactive",
    ) -> tuple[PromptTicket, bool]:
        """Admit a prompt or refuse it, synchronously and all or nothing.

        Returns:
            The prompt's ticket, and whether it is an earlier attempt's (an idempotent duplicate).

        A prompt whose ``(session, idempotency_key)`` was admitted within the TTL takes no slot and
        does not run again: the earlier attempt's ticket is returned (wait on it with
        :meth:`waiter` with ``owner=False``), so every attempt gets the same outcome.

        With the admission policy on, a prompt arriving at a session with nothing pending is decided
        now (after the pending limit, before the backend pool's lease): it gets a seat, or a place in
        the global waiting room, or is refused. One admitted behind others is decided when it reaches
        the head of its session's FIFO, and is never refused then.

        Raises:
            SessionNotFoundError, InvalidClientIdError, RequestCancelledError,
            IdempotencyKeyConflictError, PromptQueueFullError, AdmissionDeferredError,
            CapacityUnavailableError, CapacityExceededError:
                in this order of checks; a refusal changes nothing.
        """
        session = self.get(session_id, tenant)
        client = self.resolve_client(session, peer, client_id)
        if cancelled:
            raise RequestCancelledError()
        fingerprint = b""
        if idempotency_key is not None:
            fingerprint = hashlib.blake2b(_encoder.encode(prompt), digest_size=16).digest()
            seen = self._idempotent(session_id, idempotency_key)
            if seen is not None:
                if seen[0] != fingerprint:
                    raise IdempotencyKeyConflictError(session_id=session_id, idempotency_key=idempotency_key)
                if peer is not None:
                    self.attach(session, peer)
                return seen[1], True
        limit = self.limits.max_pending_prompts_per_session
        if limit and session.pending_count >= limit:
            self._refused += 1
            raise PromptQueueFullError(
                session_id=session_id, limit=limit, pending_count=session.pending_count, retry_after_ms=RETRY_AFTER_MS
            )
        effective = self.limits.prompt_deadline_ms
        if deadline_ms is not None and (not effective or deadline_ms < effective):
            effective = deadline_ms
        now = trio.current_time()
        policy = self.policy
        seat: Seat | Queued | None = None
        if policy.enabled and not session.pending_count:
            try:
                seat = policy.decide(
                    tenant=session.tenant,
                    priority=priority,
                    deadline=now + effective / 1000 if effective else None,
                    session_id=session_id,
                )
            except AcpError:
                self._refused += 1
                raise
        pool = self.capacity.pool(session.backend.name)
        lease = None
        if pool is not None:
            try:
                lease = pool.try_lease(session_id)
            except AcpError:
                self._refused += 1
                if seat is not None:
                    policy.revoke(seat)  # all or nothing
                raise
        self._prompt_seq += 1
        ticket = PromptTicket(session, f"prompt_{self._prompt_seq}", prompt, peer, client, now, effective)
        ticket.channel = channel
        ticket.meta = meta
        ticket.lease = lease
        ticket.priority = priority
        ticket.seat = seat
        ticket.seq = self._prompt_seq
        if self.store is not None:
            ticket.store_op = self.store.admit(ticket.seq, ticket.prompt_id, session_id)
        if effective:
            heapq.heappush(self._deadlines, (ticket.deadline, self._prompt_seq, ticket))
            if self._deadlines[0][2] is ticket:
                self._deadline_changed.set()
        if idempotency_key is not None:
            self._remember(session_id, idempotency_key, fingerprint, ticket)
        session.pending_count += 1
        self._admitted += 1
        if peer is not None:
            self.attach(session, peer)
        self.turn_state(ticket, "accepted")
        if isinstance(seat, Queued):
            self.turn_state(ticket, "queued", position=seat.position_hint)
        self._enqueue(session, ticket)
        return ticket, False

    def _idempotent(self, session_id: str, key: str) -> tuple[bytes, PromptTicket, float] | None:
        table = self._idempotency
        cut = trio.current_time() - self.limits.idempotency_ttl_s
        while table:
            oldest = next(iter(table.values()))
            if oldest[2] > cut:
                break
            table.popitem(last=False)
        return table.get((session_id, key))

    def _remember(self, session_id: str, key: str, fingerprint: bytes, ticket: PromptTicket) -> None:
        table = self._idempotency
        table[(session_id, key)] = (fingerprint, ticket, ticket.admitted_at)
        while len(table) > self.limits.max_idempotency_keys:
            table.popitem(last=False)

    def waiter(self, ticket: PromptTicket, *, owner: bool = True) -> PromptWaiter:
        """A :class:`~acp_server.jsonrpc.Deferred` for a request waiting on ``ticket`` (no task needed).

        ``owner``: the request that admitted the prompt (its cancel cancels the prompt); an idempotent
        duplicate is not, and its cancel only ends its own wait.
        """
        return PromptWaiter(self, ticket, owner)

    async def prompt_outcome(self, ticket: PromptTicket) -> PromptResult:
        """Wait for the prompt's outcome, enforcing its deadline from admission.

        If the waiter is cancelled (``$/cancel_request``, or its connection closed) the prompt is
        cancelled, unless its connection is gone and another live connection is attached to the
        session: then it runs on and its outcome goes to history.
        """
        try:
            await ticket.done.wait()  # the deadline is enforced by the bridge's timer
        except trio.Cancelled:
            self._caller_gone(ticket)
            raise
        return ticket.outcome()

    def cancel_session(
        self, session_id: str, peer: Peer | None, client_id: str | None = None, tenant: str | None = None
    ) -> None:
        """``session/cancel``: the running prompt and every queued one end with ``cancelled``."""
        session = self.get(session_id, tenant)
        self.resolve_client(session, peer, client_id)
        self._cancel_session_prompts(session)

    def _cancel_session_prompts(self, session: Session) -> None:
        for item in list(session.fifo):
            if isinstance(item, PromptTicket):
                self._settle(item, _cancelled(item), None)
            elif not item.settled:
                item.settled = True
                item.error = RequestCancelledError()
                item.done.set()

    def _caller_gone(self, ticket: PromptTicket) -> None:
        if ticket.settled:
            return
        sender = ticket.sender
        if sender is not None and sender.closed and any(not p.closed for p in ticket.session.attached):
            log.info("%s runs on for the other attached connections of %s", ticket.prompt_id, ticket.session.session_id)
            return
        self._settle(ticket, None, RequestCancelledError())

    async def _expire_deadlines(self) -> None:
        """The one timer of the bridge: expires prompts at their deadline, queued or running."""
        heap = self._deadlines
        while True:
            now = trio.current_time()
            while heap and (heap[0][0] <= now or heap[0][2].settled):
                ticket = heapq.heappop(heap)[2]
                if not ticket.settled:
                    self._expire(ticket)
            self._deadline_changed = trio.Event()
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._deadline_changed.wait()

    def _expire(self, ticket: PromptTicket) -> None:
        elapsed = int((trio.current_time() - ticket.admitted_at) * 1000)
        self._settle(
            ticket,
            None,
            PromptDeadlineExceededError(
                session_id=ticket.session.session_id,
                deadline_ms=ticket.deadline_ms,
                elapsed_ms=elapsed,
                prompt_id=ticket.prompt_id,
            ),
        )

    def _settle(self, ticket: PromptTicket, result: PromptResult | None, error: AcpError | None) -> bool:
        """Give the prompt its one outcome and release its slot; later calls change nothing."""
        if ticket.settled:
            return False
        if error is not None:
            error = error.for_prompt(ticket.prompt_id)
        state, reason = _terminal_state(result, error)
        self.turn_state(ticket, state, reason=reason)
        ticket.settled = True
        ticket.result, ticket.error = result, error
        session = ticket.session
        session.pending_count -= 1
        assert session.pending_count >= 0, "pending count went negative"
        session.last_activity = trio.current_time()
        self._settled += 1
        if ticket.call_scope is not None:
            # The call runs on until the backend returns (at once, for one that honours cancellation).
            ticket.call_scope.cancel()
            if session.abandoned is None:
                session.abandoned = trio.Event()
        else:
            # Never reached the backend; a running call releases these as it ends.
            if ticket.lease is not None:
                ticket.lease.release()
            seat = ticket.seat
            if seat is not None:
                if ticket.wait_scope is not None:
                    ticket.wait_scope.cancel()  # the runner's wait leaves the waiting room
                else:
                    ticket.seat = None
                    if isinstance(seat, Queued):
                        seat.cancel()
                    else:
                        seat.release()
        if self.store is not None:
            # The answer waits for the terminal record's commit; the slot is free already.
            outcome = result.stop_reason if result is not None else error.kind if error is not None else "internal"
            session.updated_ms = _now_ms()
            self.store.settle(ticket.seq, outcome)
            self._deferred().append(ticket)  # answered after the commit, in order with the updates
            self._fail_head_forks(session)
            for waiter in list(ticket.waiters):  # last: a callback may start the connection's next request
                waiter.settled()  # the request no longer counts as running on its connection
            return True
        ticket.done.set()
        self._fail_head_forks(session)
        waiters, ticket.waiters = ticket.waiters, []
        for waiter in waiters:  # last: a callback may start the connection's next request
            waiter.notify(result, error)
        return True

    @staticmethod
    def _answer(ticket: PromptTicket) -> None:
        """Wake whoever waits on a settled prompt (with a store: once its outcome is committed)."""
        ticket.done.set()
        waiters, ticket.waiters = ticket.waiters, []
        for waiter in waiters:
            waiter.notify(ticket.result, ticket.error)

    # --- forks -------------------------------------------------------------------------------------

    def admit_fork(
        self, session_id: str, peer: Peer | None, client_id: str | None, tenant: str | None = None
    ) -> ForkTicket:
        session = self.get(session_id, tenant)
        client = self.resolve_client(session, peer, client_id)
        ticket = ForkTicket(peer, client)
        self._enqueue(session, ticket)
        self._fail_head_forks(session)
        return ticket

    async def fork_outcome(self, ticket: ForkTicket) -> tuple[Session, str]:
        try:
            await ticket.done.wait()
        except trio.Cancelled:
            if not ticket.settled:
                ticket.settled = True
                ticket.error = RequestCancelledError()
            raise
        if ticket.error is not None:
            raise ticket.error
        assert ticket.new_session is not None
        new = ticket.new_session
        return new, self.register(new, ticket.requester)

    # --- the runner --------------------------------------------------------------------------------

    def _enqueue(self, session: Session, item: PromptTicket | ForkTicket) -> None:
        fifo = session.fifo
        fifo.append(item)
        if session.runner_active:
            if session.runner_parked is not None and len(fifo) == 1:
                self._nudge(session)  # an idle runner: it takes this one (no new task)
            return
        if self._nursery is None:
            raise InternalError()
        session.runner_active = True
        self._nursery.start_soon(self._run_session, session)

    def _nudge(self, session: Session) -> None:
        """Wake the session's parked runner once its FIFO's head may run: now, or (with a store) when
        the head's admission record is committed."""
        head = session.fifo[0]
        store = self.store
        if store is not None and isinstance(head, PromptTicket) and store.committed < head.store_op:
            self._wake_at_commit(session, head.store_op)
        else:
            self._wake_runner(session, True)

    def _wake_at_commit(self, session: Session, op: int) -> None:
        assert self.store is not None
        self.store.when_committed(op, partial(self._wake_runner, session, True))

    @staticmethod
    def _wake_runner(session: Session, go: bool) -> None:
        """Resume the session's parked runner (if it is parked): to look at its FIFO again (``go``), or
        to end if the FIFO is empty (idle too long, or the session closed)."""
        task = session.runner_parked
        if task is not None:
            session.runner_parked = None
            trio.lowlevel.reschedule(task, outcome.Value(go))

    @staticmethod
    async def _park(session: Session) -> bool:
        """Wait, holding no task slot but this one, until :meth:`_wake_runner`; its ``go``."""
        session.runner_parked = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            session.runner_parked = None
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    async def _run_session(self, session: Session) -> None:
        """Run the session's FIFO: one turn at a time, in arrival order.

        The runner outlives an empty FIFO: it parks, and the next prompt wakes it (a task per busy
        spell, not per prompt: with a store each answer waits for a commit, so a busy session's FIFO
        empties between turns). :meth:`_stop_idle_runners` ends one parked for a whole sweep period,
        :meth:`close_session` at once. With a store, a head whose admission record is not committed
        yet parks the runner until that commit.

        The backend call runs here, in the runner's own task. A prompt that settles while its call is
        still running (cancelled, expired) leaves that call *abandoned*: the FIFO's next prompt waits
        for it (the agent is still busy), while a fork that reaches the head then fails at once
        (:meth:`_fail_head_forks`).
        """
        fifo = session.fifo
        store = self.store
        try:
            while True:
                # One cancel scope serves the calls until one is cancelled (its prompt settled while
                # it ran): then a fresh one, so the cancel reaches no later call. A scope per call
                # cost ~10% of an echo prompt's CPU. Nothing cancels it while the runner is parked.
                with trio.CancelScope() as scope:
                    while True:
                        if not fifo:
                            if self.sessions.get(session.session_id) is not session:
                                return  # closed
                            session.runner_idle_epoch = self._runner_epoch
                            if not await self._park(session) and not fifo:
                                return
                            continue
                        item = fifo[0]
                        if item.settled:
                            fifo.popleft()
                            continue
                        if isinstance(item, ForkTicket):
                            await self._run_fork(session, item)
                            fifo.popleft()
                            continue
                        if store is not None and store.committed < item.store_op:
                            self._wake_at_commit(session, item.store_op)  # its admission record first
                            await self._park(session)
                            continue  # re-check: it may have settled meanwhile
                        if self.policy.enabled and not await self._take_seat(item):
                            continue  # settled while it waited for a seat: the loop drops it
                        await self._call_backend(item, scope)
                        fifo.popleft()
                        if scope.cancel_called:
                            break  # the call finished before the cancel reached it
        finally:
            session.runner_active = False
            session.runner_parked = None

    async def _stop_idle_runners(self) -> None:
        """Every :data:`RUNNER_IDLE_S`, end the runners parked with an empty FIFO since the last sweep."""
        while True:
            await trio.sleep(RUNNER_IDLE_S)
            epoch = self._runner_epoch
            self._runner_epoch = epoch + 1
            for session in list(self.sessions.values()):
                if session.runner_parked is not None and not session.fifo and session.runner_idle_epoch < epoch:
                    self._wake_runner(session, False)

    async def _take_seat(self, ticket: PromptTicket) -> bool:
        """Hold a policy seat for the head prompt: the one decided at arrival, or one from the fair
        queue (never refused: an accepted prompt waits). False when the prompt settled meanwhile."""
        got = ticket.seat
        if got is None:
            session = ticket.session
            got = ticket.seat = self.policy.enqueue(
                tenant=session.tenant,
                priority=ticket.priority,
                deadline=ticket.deadline if ticket.deadline_ms else None,
                session_id=session.session_id,
            )
            if isinstance(got, Queued) and got.waiting:
                self.turn_state(ticket, "queued", position=got.position_hint)
        if isinstance(got, Seat):
            return True
        seat: Seat | None = None
        with trio.CancelScope() as scope:
            ticket.wait_scope = scope
            try:
                seat = await got.wait()
            except WaitDeadlineExpired:
                pass
            finally:
                ticket.wait_scope = None
        if seat is None:
            ticket.seat = None
            if not scope.cancelled_caught:
                self._expire(ticket)  # too little of its deadline left to start
            return False
        ticket.seat = seat
        if ticket.settled:
            ticket.seat = None
            seat.release()
            return False
        return True

    async def _call_backend(self, ticket: PromptTicket, scope: trio.CancelScope) -> None:
        """Run the head prompt's backend call under the runner's ``scope`` (cancelled if it settles first)."""
        session = ticket.session
        ticket.running = True
        channel = ticket.channel
        turn = Turn(
            session.session_id,
            ticket.prompt_id,
            ticket.prompt,
            lambda u: self._emit_for(ticket, u),
            _TurnChannel(self, channel, ticket) if channel is not None else None,
            ticket.meta,
        )
        lease = ticket.lease
        result: PromptResult | None = None
        error: AcpError | None = None
        try:
            ticket.call_scope = scope
            try:
                if lease is not None:
                    await self._permit(ticket, lease)  # at most max_active calls; FIFO
                self.turn_state(ticket, "running")
                self._emit_user_prompt(ticket)
                stop_reason = await session.backend.prompt(turn)
            finally:
                ticket.call_scope = None  # the call is over: settling now abandons nothing
            result = PromptResult(stop_reason=stop_reason, meta={"promptId": ticket.prompt_id})
        except AcpError as exc:
            result, error = None, exc
        except trio.Cancelled:
            self._settle(ticket, _cancelled(ticket), None)
            raise
        except Exception:
            log.exception("backend %s failed on %s of session %s", session.backend.name, ticket.prompt_id, session.session_id)
            result, error = None, InternalError()
        finally:
            if lease is not None:
                lease.release()  # with its permit
            seat = ticket.seat
            if seat is not None:
                ticket.seat = None
                seat.release()  # a seat is held for one prompt: busy sessions take turns
            abandoned = session.abandoned
            if abandoned is not None:
                session.abandoned = None
                abandoned.set()
        self._settle(ticket, result, error)  # no-op when it settled first (cancel, deadline, crash)

    async def _permit(self, ticket: PromptTicket, lease: Lease) -> None:
        """Take the backend pool's permit, reporting ``waiting_for_dependency`` when it has to wait."""
        try:
            lease.acquire_permit_nowait()
        except trio.WouldBlock:
            self.turn_state(ticket, "waiting_for_dependency")
            await lease.acquire_permit()

    def _fail_head_forks(self, session: Session) -> None:
        """While an abandoned call runs, forks at the head of the FIFO fail with branch_while_prompt_active."""
        if session.abandoned is None:
            return
        for item in session.fifo:
            if item.settled:
                continue
            if not isinstance(item, ForkTicket):
                return
            item.error = BranchWhilePromptActiveError(session_id=session.session_id)
            item.settled = True
            item.done.set()

    async def _run_fork(self, session: Session, item: ForkTicket) -> None:
        try:
            self._check_session_limit()
        except AcpError as exc:
            item.error = exc
            item.settled = True
            item.done.set()
            return
        await self._load_transcript(session)
        new = Session(
            self, f"sess_{uuid.uuid4().hex}", session.cwd, list(session.mcp_servers),
            session.backend, trio.current_time(), _now_ms(), session.tenant,
        )
        try:
            await session.backend.fork(session.session_id, new.session_id)
        except AcpError as exc:
            item.error = exc
        except Exception:
            log.exception("backend fork of %s failed", session.session_id)
            item.error = InternalError()
        else:
            new.history = list(session.history)
            new.next_event_id = session.next_event_id
            new.mode_id = session.mode_id
            new.modes = session.modes
            new.title = session.title
            self.sessions[new.session_id] = new
            if self.store is not None:
                self._store_session(new)
                for event_id, update in new.history:
                    if isinstance(update, StoredEvent):
                        self.store.add_event(new.session_id, event_id, update.body, update.method)
                    else:
                        self.store.add_event(new.session_id, event_id, update)
            item.new_session = new
        item.settled = True
        item.done.set()

    # --- updates -----------------------------------------------------------------------------------

    def _emit_user_prompt(self, ticket: PromptTicket) -> None:
        for block in ticket.prompt:
            self.emit(ticket.session, UserMessageChunk(content=block), ticket.client_id, exclude=ticket.sender)

    def _emit_for(self, ticket: PromptTicket, update: Any) -> None:
        if not ticket.settled:
            self.emit(ticket.session, update, ticket.client_id)

    def emit(self, session: Session, update: Any, originator: str | None, *, exclude: Peer | None = None) -> None:
        """Record ``update`` in the session's history and send it to every attached connection."""
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        session.history.append((event_id, update))
        store = self.store
        if not session.attached:
            if store is not None:
                store.add_event(session.session_id, event_id, update)
            return
        # Encoded once, for the wire and the store; the notification around it is SessionNotification's
        # shape built as text (our session and client ids need no escaping), as turn states are.
        body = _encoder.encode(update)
        if store is not None:
            store.add_event(session.session_id, event_id, body)
        if exclude is not None and len(session.attached) == 1 and exclude in session.attached:
            return  # a prompt's own text, to the one connection that sent it: nobody else to tell
        meta = f'{{"eventId":{event_id}}}' if originator is None else f'{{"eventId":{event_id},"originatorClientId":"{originator}"}}'
        data = b"".join((
            b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"', session.session_id.encode(),
            b'","update":', body, b',"_meta":', meta.encode(), b"}}\n",
        ))
        self._send(session, data, exclude)

    def turn_state(self, ticket: PromptTicket, state: str, *, reason: str | None = None, position: int | None = None) -> None:
        """Send ``_acp_server/turn_state`` for ``ticket`` to every connection attached to its session
        (but those that opted out at ``initialize`` with ``_meta.turnStates: false``).

        It takes the session's next ``eventId`` like an update. The terminal states (completed,
        failed, cancelled) are also kept in the transcript (replayed by load, stored with a store);
        the others are live only.
        """
        session = ticket.session
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        # Built as text (3 per prompt, on the hot path): our session and prompt ids and the state names
        # need no escaping; the reason (a stop reason may come from an agent) is JSON-encoded. The
        # shape is TurnStateParams' (tests decode every one into it).
        fields = f'"promptId":"{ticket.prompt_id}","state":"{state}","at":{_now_ms()}'
        if reason is not None:
            fields += ',"reason":' + _encoder.encode(reason).decode()
        if position is not None:
            fields += f',"positionHint":{position}'
        if state in TERMINAL_TURN_STATES:
            text = ("{" + fields + "}").encode()
            session.history.append((event_id, StoredEvent(event_id, TURN_STATE, msgspec.Raw(text))))
            if self.store is not None:
                self.store.add_event(session.session_id, event_id, text, TURN_STATE)
        attached = session.attached
        if len(attached) == 1:  # the usual case, without a generator
            (peer,) = attached
            peers: tuple[Peer, ...] = (peer,) if peer.turn_states else ()
        else:
            peers = tuple(p for p in attached if p.turn_states)
        if not peers:
            return
        data = (
            f'{{"jsonrpc":"2.0","method":"{TURN_STATE}","params":{{"sessionId":"{session.session_id}",{fields},'
            f'"_meta":{{"eventId":{event_id}}}}}}}\n'
        ).encode()
        self._send(session, data, None, peers)

    def _send(self, session: Session, data: bytes, exclude: Peer | None, peers: tuple[Peer, ...] | None = None) -> None:
        """Send to ``peers`` (default: every connection attached to ``session``) but ``exclude``."""
        if peers is None:
            peers = tuple(session.attached)
        store = self.store
        if store is None:
            for peer in peers:
                if peer is not exclude:
                    peer.send(data)
            return
        # Sent once committed, in order with the answers: durable before visible, and a round's
        # updates and answers leave a connection in one write instead of two.
        if exclude is not None:
            peers = tuple(p for p in peers if p is not exclude)
            if not peers:
                return
        segment = self._fanout
        if segment is None or self._fanout_generation != store.generation:
            segment = self._deferred()
        if segment:
            last = segment[-1]
            if type(last) is tuple and last[0] == peers:
                last[1].append(data)  # the same connections as the message before: one send for both
                return
        segment.append((peers, [data]))

    def _deferred(self) -> list[_Deferred]:
        """What waits for the commit of the current write round (one store callback per round)."""
        store = self.store
        assert store is not None
        segment = self._fanout
        if segment is None or self._fanout_generation != store.generation:
            segment = self._fanout = []
            self._fanout_generation = store.generation
            store.after_round(partial(self._committed, segment))  # also covers what is appended later
        return segment

    def _committed(self, segment: list[_Deferred]) -> None:
        """A write round is committed: send its messages and answer its prompts, in order."""
        for entry in segment:
            try:
                if isinstance(entry, PromptTicket):
                    self._answer(entry)
                else:
                    peers, parts = entry
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    for peer in peers:
                        peer.send(data)  # a closed one drops it
            except Exception:
                log.exception("after a store commit: %r failed", entry)

    # --- housekeeping ------------------------------------------------------------------------------

    async def _reaper(self) -> None:
        period = max(0.05, min(self.limits.client_idle_timeout_s, self.limits.session_idle_timeout_s) / 10)
        while True:
            await trio.sleep(period)
            self.reap(trio.current_time())

    def reap(self, now: float) -> None:
        """Drop client ids idle past their timeout; close idle, unattached, clientless sessions."""
        client_cut = now - self.limits.client_idle_timeout_s
        session_cut = now - self.limits.session_idle_timeout_s
        for session in list(self.sessions.values()):
            for cid in [c for c, reg in session.clients.items() if reg.last_seen <= client_cut]:
                log.info("client id %s of %s expired", cid, session.session_id)
                del session.clients[cid]
            if (
                not session.clients
                and not session.fifo
                and session.abandoned is None
                and not any(not p.closed for p in session.attached)
                and session.last_activity <= session_cut
            ):
                log.info("closing idle session %s", session.session_id)
                self.close_session(session)

    def statistics(self) -> BridgeStatistics:
        sessions = self.sessions.values()
        running = sum(1 for s in sessions if s.running_ticket is not None)
        pending = sum(s.pending_count for s in sessions)
        peers: set[int] = set()
        for s in sessions:
            peers.update(p.peer_id for p in s.attached)
        return BridgeStatistics(
            sessions=len(self.sessions),
            pending_prompts=pending,
            running_prompts=running,
            queued_prompts=pending - running,
            clients=sum(len(s.clients) for s in sessions),
            attached_connections=len(peers),
            admitted_total=self._admitted,
            refused_total=self._refused,
            settled_total=self._settled,
        )


