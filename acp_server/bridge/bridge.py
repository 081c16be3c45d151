"""The session bridge: the one object handlers and transports call, over rooms with one job each.

    SessionBridge (this module)     lifecycle, forks, reaping, statistics
    ├── admit.PromptAdmission       admission with idempotency, the ticket (a base of SessionBridge)
    ├── runner.SessionRunner        a task per busy session: its FIFO, policy seats, the backend call
    │   │                           (a prompt's ticket is the backend's Turn: session.PromptTicket)
    │   └── settlement.Settlement   one outcome per prompt, its slot back, deadlines, PromptWaiter
    │       ├── fanout.FanOut       updates and turn states: history, encoding, sends (after a commit)
    │       └── persistence         the store, or nothing (--ephemeral): what is recorded and committed
    ├── sessions.SessionTable       live sessions: built, restored from the store, counted
    └── clients.ClientRegistry      client ids, and all per-connection state (attachment, turn states)

The arrows point one way: the runner settles, settlement sends and records; none of them calls back
into the bridge. The bridge touches no socket: connections are :class:`~.session.Peer` objects.

Admission (the synchronous, all-or-nothing check and count of a prompt) is :mod:`.admit`'s.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..admission.limits import Limits
from ..admission.policy import PolicyEngine
from ..admission.pool import CapacityManager
from ..admission.shared import SharedAdmission
from ..backends.base import Backend, SessionSetup
from ..errors import (
    AcpError,
    BackendUnavailableError,
    InvalidClientIdError,
    InvalidParamsError,
    RequestCancelledError,
    SessionNotFoundError,
)
from ..store import StoredSession
from .admit import PromptAdmission
from .clients import ClientRegistry
from .fanout import CommitFanOut, FanOut
from .persistence import NullPersistence, Persistence, StorePersistence
from .runner import SessionRunner
from .session import ForkTicket, Peer, PromptTicket, Session
from .sessions import SessionTable
from .settlement import PromptWaiter, Settlement

if TYPE_CHECKING:
    from ..store import SessionStore

__all__ = ["BridgeStatistics", "PromptWaiter", "SessionBridge"]

log = logging.getLogger("acp_server.bridge")

_encoder = msgspec.json.Encoder()


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


class SessionBridge(PromptAdmission):
    """Owns every session of one server instance.

    Args:
        backend: the agent sessions go to: one backend, or a table name -> backend.
        limits: the bounds; ``max_pending_prompts_per_session`` etc.
        max_pending_prompts_per_session: shortcut overriding ``limits``' field (validated the same way).
        default_backend: the name of the backend a session gets when it names none (with a table).
        capacity: the backend pools (default: none limited).
        store: the durable store (``None``: ephemeral, everything in memory); ``stored``: its session
            index as :meth:`SessionStore.open` returned it, and ``prompt_seq`` the highest prompt number.
        policy: the admission policy engine (default: one that limits nothing and costs nothing).

    Raises:
        TypeError, ValueError: a limit is not of its accepted form (the message names it), or
            ``default_backend`` is not in the table.
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
        shared: SharedAdmission | None = None,
    ) -> None:
        limits = limits or Limits()
        if max_pending_prompts_per_session is not None:
            limits = msgspec.structs.replace(limits, max_pending_prompts_per_session=max_pending_prompts_per_session)
            limits.__post_init__()
        self.limits = limits
        self.capacity = capacity or CapacityManager()
        #: the admission policy: global seats, tenant caps, priority classes; off by default
        self.policy = policy or PolicyEngine()
        self._policy_on = self.policy.enabled  # fixed for the engine's life
        #: backend id -> its pool (the limited ones; empty: no backend is limited)
        self._pools = self.capacity.pools
        #: with --coordinator: the limits counted across replicas (then the policy and pools are not used)
        self.shared = shared if shared is not None and shared.enabled else None
        #: session id -> the shared admission its next prompt waits for (arrival order through the
        #: shared step)
        self.admission_gates: dict[str, trio.Event] = {}
        #: shutting down with a drain: new prompts are refused ``draining``
        self.draining = False
        self._claim_seq = 0
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
        self.store = store
        self.persistence: Persistence = (
            StorePersistence(store, stored or {}) if store is not None else NullPersistence()
        )
        self.clients = ClientRegistry()
        self.fanout: FanOut = (CommitFanOut if self.persistence.durable else FanOut)(
            self.clients, self.persistence, limits.max_history_events
        )
        self.settlement = Settlement(self.fanout, self.persistence)
        self.table = SessionTable(limits, self.backends, self.backend, self.persistence, self.fanout)
        self.fanout.table = self.table
        self.runner = SessionRunner(self.table, self.settlement, self.fanout, self.persistence, self.policy)
        #: the live sessions by id
        self.sessions = self.table.live
        #: (session id, idempotency key) -> (prompt fingerprint, ticket, admitted at), oldest first
        self._idempotency: collections.OrderedDict[tuple[str, str], tuple[bytes, PromptTicket, float]] = (
            collections.OrderedDict()
        )
        self._prompt_seq = prompt_seq
        #: trio's clock (the run's own, bound once it runs: one call instead of three per read)
        self._now: Callable[[], float] = trio.current_time
        self._admitted = 0
        self._refused = 0
        #: ``session/resume`` calls that had to mint a new client id (the SDK's self-heal)
        self.self_heal_resumes = 0

    @property
    def stored(self) -> dict[str, StoredSession]:
        """Every stored session's metadata, live or not (empty without a store)."""
        return self.persistence.stored

    # --- lifecycle ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the bridge's tasks (the store's writer, turn runners, deadlines, the reaper) until cancelled."""
        self._now = self.settlement.now = self.clients.now = trio.lowlevel.current_clock().current_time
        async with trio.open_nursery() as nursery:
            await nursery.start(self.persistence.run)
            self.runner.nursery = nursery
            nursery.start_soon(self._reaper)
            nursery.start_soon(self.settlement.expire_deadlines)
            nursery.start_soon(self.runner.stop_idle)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.runner.nursery = None

    def cancel_all(self) -> None:
        """Shutdown: every queued and running prompt ends with ``stopReason: "cancelled"``."""
        for session in list(self.sessions.values()):
            self.settlement.cancel_prompts(session)

    # --- sessions ----------------------------------------------------------------------------------

    def backend_named(self, name: str | None) -> Backend:
        """The backend called ``name`` (the default for ``None``).

        Raises:
            InvalidParamsError: no backend has that name (the message lists the known ones).
        """
        if name is None:
            return self.backend
        backend = self.backends.get(name)
        if backend is None:
            known = ", ".join(sorted(self.backends))
            raise InvalidParamsError(path="_meta.backend", detail=f"unknown backend {name!r}; known: {known}")
        return backend

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
        """``session/new``: create a session on its backend (the agent's side first), then register
        the caller.

        Returns:
            The session, the caller's client id, and what the backend answered.

        Raises:
            SessionLimitExceededError: ``max_sessions`` sessions are live (checked before and after
                the backend's call).
        """
        backend = backend or self.backend
        table = self.table
        table.check_limit()
        session = table.build(backend, cwd, mcp_servers, tenant)
        setup = await backend.open_session(
            session.session_id, cwd, mcp_servers, lambda u: self.fanout.emit(session, u, None), meta
        )
        session.modes = setup.modes
        if setup.modes and isinstance(setup.modes.get("currentModeId"), str):
            session.mode_id = setup.modes["currentModeId"]
        try:
            table.check_limit()  # again: others may have been created during the await
        except AcpError:
            self._close_on_backend_soon(session)
            raise
        table.add(session)
        self.persistence.save_session(session)
        return session, self.clients.register(session, peer, client_id), setup

    def get(self, session_id: str, tenant: str | None = None) -> Session:
        """The live session ``session_id``; a stored one that is not live is restored (no replay).

        With ``tenant``, a session of another tenant is ``session_not_found``, exactly as one that
        does not exist.
        """
        session = self.sessions.get(session_id)
        if session is None:
            meta = self.persistence.stored.get(session_id)
            if meta is None or (tenant is not None and meta.tenant != tenant):
                raise SessionNotFoundError(session_id=session_id)
            session = self.table.restore(meta)
        elif tenant is not None and session.tenant != tenant:
            raise SessionNotFoundError(session_id=session_id)
        return session

    def list_sessions(self, cwd: str | None = None, tenant: str | None = None) -> list[Session | StoredSession]:
        """Live sessions, and with a store every stored one too (in creation order); with ``tenant``
        only that tenant's."""
        return self.persistence.list_sessions(self.sessions, cwd, tenant)

    async def replay(self, session: Session, peer: Peer, after_event_id: int = 0) -> None:
        """Send the session's history after ``after_event_id`` to ``peer`` alone, then attach it.

        Replayed updates keep their original ``eventId`` and carry no ``originatorClientId``. They wait
        for the connection's writer instead of overflowing; updates that arrive meanwhile are sent in
        order before the connection is attached to the live stream (no gap, no duplicate).
        """
        await self.fanout.replay(session, peer, after_event_id)
        self.clients.attach(session, peer)

    def close_or_delete(
        self, session_id: str, peer: Peer | None, client_id: str | None, *, delete: bool, tenant: str | None = None
    ) -> None:
        """``session/close`` / ``session/delete``: a stored session that is not live is not restored for it
        (it has no client ids: one given is invalid)."""
        meta = self.persistence.stored.get(session_id) if session_id not in self.sessions else None
        if meta is not None and (tenant is None or meta.tenant == tenant):
            if client_id is not None:
                raise InvalidClientIdError(session_id=session_id, client_id=client_id)
            if delete:
                self.persistence.forget(session_id)
            return
        session = self.get(session_id, tenant)
        self.clients.resolve(session, peer, client_id)
        if delete:
            self.delete_session(session)
        else:
            self.close_session(session)

    def delete_session(self, session: Session) -> None:
        """``session/delete``: close it, then forget it and its transcript."""
        self.close_session(session)
        self.persistence.forget(session.session_id)

    def close_session(self, session: Session) -> None:
        """End the session for every client: its running and queued prompts are cancelled."""
        self.settlement.cancel_prompts(session)
        self.persistence.unload(session)  # history kept: listed, and loadable again
        if self.sessions.pop(session.session_id, None) is not None:
            self._close_on_backend_soon(session)
        self.runner.wake(session, False)  # a parked runner ends (or first drops the settled prompts)
        self.clients.session_closed(session)

    def _close_on_backend_soon(self, session: Session) -> None:
        """Tell the backend the session ended, in a task of the bridge's (none when it is not running)."""
        nursery = self.runner.nursery
        if nursery is not None:
            nursery.start_soon(self._close_on_backend, session)

    @staticmethod
    async def _close_on_backend(session: Session) -> None:
        """Tell the backend the session ended (whatever it answers, the session is gone for us)."""
        try:
            await session.backend.close_session(session.session_id)
        except Exception as exc:
            log.info("backend %s could not close %s: %s", session.backend.name, session.session_id, exc)

    def _backend_exited(self, backend_name: str, exit_code: int | None) -> None:
        """An agent process died: every running and queued prompt on it gets one ``backend_unavailable``."""
        for session in list(self.sessions.values()):
            if session.backend.name != backend_name:
                continue
            for item in list(session.fifo):
                if isinstance(item, PromptTicket):
                    self.settlement.settle(
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

    # --- clients and connections -------------------------------------------------------------------

    def register(self, session: Session, peer: Peer | None, requested: str | None = None) -> str:
        """Register a client on ``session`` (see :meth:`ClientRegistry.register`); returns its id."""
        return self.clients.register(session, peer, requested)

    def resolve_client(self, session: Session, peer: Peer | None, requested: str | None) -> str | None:
        """The client id a request acts as (see :meth:`ClientRegistry.resolve`).

        Raises:
            InvalidClientIdError: ``requested`` is not registered on the session.
        """
        return self.clients.resolve(session, peer, requested)

    def heartbeat(self, session: Session, client_id: str | None) -> int:
        """Mark activity; returns the last-seen time (epoch ms) of the client, or of the session."""
        return self.clients.heartbeat(session, client_id)

    def release_client(self, session: Session, peer: Peer | None, client_id: str | None) -> None:
        """``_acp_server/detach``: drop one holder of ``client_id`` (see :meth:`ClientRegistry.release`)."""
        self.clients.release(session, peer, client_id)

    def peer_closed(self, peer: Peer) -> None:
        """A connection is gone: it receives nothing more (its client ids stay with their sessions).
        Every transport calls this once for each connection it handed to the bridge."""
        self.clients.peer_closed(peer)

    # --- prompts (admission: .admit.PromptAdmission) -------------------------------------------

    def cancel_session(
        self, session_id: str, peer: Peer | None, client_id: str | None = None, tenant: str | None = None
    ) -> None:
        """``session/cancel``: the running prompt and every queued one end with ``cancelled``."""
        session = self.get(session_id, tenant)
        self.clients.resolve(session, peer, client_id)
        self.settlement.cancel_prompts(session)

    # --- forks -------------------------------------------------------------------------------------

    def admit_fork(
        self, session_id: str, peer: Peer | None, client_id: str | None, tenant: str | None = None
    ) -> ForkTicket:
        """``_acp_server/fork``: queue a fork in the session's FIFO (it runs when it reaches the head)."""
        session = self.get(session_id, tenant)
        client = self.clients.resolve(session, peer, client_id)
        ticket = ForkTicket(peer, client)
        self.runner.enqueue(session, ticket)
        self.settlement.fail_head_forks(session)
        return ticket

    async def fork_outcome(self, ticket: ForkTicket) -> tuple[Session, str]:
        """Wait for the fork; register its requester on the new session.

        Returns:
            The new session and the requester's client id there.

        Raises:
            AcpError: the fork failed (its error).
        """
        try:
            await ticket.done.wait()
        except trio.Cancelled:
            if not ticket.settled:
                ticket.fail(RequestCancelledError())  # the runner drops it
            raise
        if ticket.error is not None:
            raise ticket.error
        assert ticket.new_session is not None
        new = ticket.new_session
        return new, self.clients.register(new, ticket.requester)

    # --- housekeeping ------------------------------------------------------------------------------

    async def _reaper(self) -> None:
        """Run :meth:`reap` ten times per the shorter idle timeout."""
        period = max(0.05, min(self.limits.client_idle_timeout_s, self.limits.session_idle_timeout_s) / 10)
        while True:
            await trio.sleep(period)
            self.reap(trio.current_time())

    def reap(self, now: float) -> None:
        """Drop client ids idle past their timeout; close idle, unattached, clientless sessions."""
        client_cut = now - self.limits.client_idle_timeout_s
        session_cut = now - self.limits.session_idle_timeout_s
        for session in list(self.sessions.values()):
            self.clients.expire_idle(session, client_cut)
            if (
                not session.clients
                and not session.fifo
                and session.abandoned is None
                and not self.clients.any_live(session)
                and session.last_activity <= session_cut
            ):
                log.info("closing idle session %s", session.session_id)
                self.close_session(session)

    def statistics(self) -> BridgeStatistics:
        """A frozen snapshot of the bridge's gauges and counters."""
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
            settled_total=self.settlement.settled_total,
        )
