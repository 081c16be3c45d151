"""The client registry: client ids on sessions, and everything the bridge keeps per connection.

Two kinds of membership, kept apart by name:

- a *client id* (``client_<uuid>``) is registered on a session and counted by its holders
  (:meth:`ClientRegistry.register`, :meth:`~ClientRegistry.release`); it outlives connections until
  it idles past ``client_idle_timeout_s`` (:meth:`~ClientRegistry.expire_idle`);
- a connection is *attached* to a session while it receives the session's updates
  (:meth:`~ClientRegistry.attach`, :meth:`~ClientRegistry.detach`); a closed connection is detached
  from everything (:meth:`~ClientRegistry.peer_closed`).

Per connection the registry keeps a :class:`PeerState`: the client id it registered on each session,
the sessions it is attached to, and whether it takes ``_acp_server/turn_state`` notifications. A
transport never holds any of it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import trio

from ..errors import InvalidClientIdError
from .session import ClientReg, Peer, Session

__all__ = ["TURN_STATES_ALL", "TURN_STATES_NONE", "TURN_STATES_TERMINAL", "ClientRegistry", "PeerState"]

log = logging.getLogger("acp_server.bridge")


def now_ms() -> int:
    """The wall clock in epoch milliseconds (what ``lastSeenAt`` and session timestamps report)."""
    return time.time_ns() // 1_000_000


#: :attr:`PeerState.turn_states`: none, the terminal ones (completed, failed, cancelled), all of them
TURN_STATES_NONE, TURN_STATES_TERMINAL, TURN_STATES_ALL = 0, 1, 2


class PeerState:
    """What the bridge keeps for one connection."""

    __slots__ = ("_attached", "joins_lines", "registrations", "turn_states")

    def __init__(self, joins_lines: bool = False) -> None:
        #: session id -> the client id this connection registered there
        self.registrations: dict[str, str] = {}
        #: the sessions this connection is attached to (receives the updates of): none, the one, or a
        #: set of two or more (most connections hold one session, and a set of one takes 216 bytes)
        self._attached: Session | set[Session] | None = None
        #: which ``_acp_server/turn_state`` it receives (:data:`TURN_STATES_ALL`, ``_TERMINAL`` or
        #: ``_NONE``): an ACP connection's ``initialize`` sets all or none (its ``_meta.turnStates``, else
        #: the server's ``--turn-states``); a REST event stream, which turns the terminal ones into its
        #: own events and has no use for the others, takes the terminal ones only
        self.turn_states = TURN_STATES_ALL
        #: one ``send`` may carry several lines (the connection's ``joins_lines``, see
        #: :class:`~.session.Peer`): the fan-out then sends the lines of one step for it in one call
        self.joins_lines = joins_lines

    @property
    def sessions(self) -> set[Session]:
        """The sessions this connection is attached to (a new set)."""
        held = self._attached
        if held is None:
            return set()
        return set(held) if isinstance(held, set) else {held}

    def holds_sessions(self) -> bool:
        """Whether the connection is attached to some session."""
        return self._attached is not None

    def attach(self, session: Session) -> None:
        """The connection receives ``session``'s updates."""
        held = self._attached
        if held is None:
            self._attached = session
        elif isinstance(held, set):
            held.add(session)
        elif held is not session:
            self._attached = {held, session}

    def detach(self, session: Session) -> None:
        """The connection no longer receives ``session``'s updates."""
        held = self._attached
        if held is session:
            self._attached = None
        elif isinstance(held, set):
            held.discard(session)
            if len(held) == 1:
                self._attached = next(iter(held))


class ClientRegistry:
    """Client ids per session and state per connection (see the module docstring)."""

    __slots__ = ("now", "peers")

    def __init__(self) -> None:
        #: every connection the bridge knows, until :meth:`peer_closed`
        self.peers: dict[Peer, PeerState] = {}
        #: trio's clock (the bridge binds the run's own once it runs)
        self.now: Callable[[], float] = trio.current_time

    def state(self, peer: Peer) -> PeerState:
        """The connection's state (created on first use)."""
        state = self.peers.get(peer)
        if state is None:
            state = self.peers[peer] = PeerState(getattr(peer, "joins_lines", False) is True)
        return state

    def set_turn_states(self, peer: Peer, enabled: bool) -> None:
        """Whether ``peer`` receives ``_acp_server/turn_state`` (what it chose at ``initialize``)."""
        self.state(peer).turn_states = TURN_STATES_ALL if enabled else TURN_STATES_NONE

    def set_terminal_turn_states_only(self, peer: Peer) -> None:
        """``peer`` receives the terminal turn states only (a REST event stream: the others have no
        frame there, so they would be sent to it only to be dropped)."""
        self.state(peer).turn_states = TURN_STATES_TERMINAL

    def turn_states(self, peer: Peer) -> bool:
        """Whether ``peer`` receives ``_acp_server/turn_state``, at least the terminal ones (default:
        all)."""
        state = self.peers.get(peer)
        return state is None or state.turn_states != TURN_STATES_NONE

    def registration(self, peer: Peer, session_id: str) -> str | None:
        """The client id ``peer`` registered on session ``session_id``, if any."""
        state = self.peers.get(peer)
        return state.registrations.get(session_id) if state is not None else None

    # --- client ids --------------------------------------------------------------------------------

    def register(self, session: Session, peer: Peer | None, requested: str | None = None) -> str:
        """Register a client on ``session``: re-use ``requested`` if it is registered there, else mint one.

        Registration never fails; the caller's connection (unless closed) is attached to the session.

        Returns:
            The client id.
        """
        now = trio.current_time()
        reg = session.clients.get(requested) if requested else None
        if reg is not None:
            reg.refcount += 1
            reg.last_seen = now
        else:
            client_id = f"client_{uuid.uuid4()}"
            reg = session.clients[client_id] = ClientReg(client_id, now)
        session.last_activity = now
        if peer is not None and not peer.closed:
            state = self.state(peer)
            state.registrations[session.session_id] = reg.client_id
            session.attached.add(peer)
            state.attach(session)
        return reg.client_id

    def resolve(self, session: Session, peer: Peer | None, requested: str | None, now: float | None = None) -> str | None:
        """The client id a request acts as, marked as seen now (``now``: trio's clock, if the caller read it).

        Absent ``requested``: the connection's own registration on the session, else anonymous (``None``).

        Raises:
            InvalidClientIdError: ``requested`` is not registered on the session.
        """
        if now is None:
            now = self.now()
        if requested is not None:
            reg = session.clients.get(requested)
            if reg is None:
                raise InvalidClientIdError(session_id=session.session_id, client_id=requested)
        else:
            state = self.peers.get(peer) if peer is not None else None
            own = state.registrations.get(session.session_id) if state is not None else None
            reg = session.clients.get(own) if own is not None else None
            if reg is None:
                return None
        reg.last_seen = now
        session.last_activity = now
        return reg.client_id

    @staticmethod
    def heartbeat(session: Session, client_id: str | None) -> int:
        """Mark activity (the caller resolved ``client_id`` in this step: :meth:`resolve` marked it seen).

        Returns:
            The time of this heartbeat (epoch ms): the client's last-seen time, or the session's. A
            client id keeps its last-seen time on trio's clock only (for expiry): the wall clock is read
            here, not at every request that marks the client seen.
        """
        session.last_activity = trio.current_time()
        return now_ms()

    def release(self, session: Session, peer: Peer | None, client_id: str | None) -> None:
        """Drop one holder of ``client_id`` (``_acp_server/detach``); the connection is detached once
        it no longer holds a registration on the session."""
        if client_id is not None:
            reg = session.clients.get(client_id)
            if reg is not None:
                reg.refcount -= 1
                if reg.refcount <= 0:
                    del session.clients[client_id]
        if peer is not None:
            state = self.peers.get(peer)
            own = state.registrations.get(session.session_id) if state is not None else None
            if own is None or own == client_id or own not in session.clients:
                if state is not None:
                    state.registrations.pop(session.session_id, None)
                self.detach(session, peer)
        session.last_activity = trio.current_time()

    @staticmethod
    def expire_idle(session: Session, cut: float) -> None:
        """Drop the session's client ids last seen at or before ``cut`` (trio clock)."""
        for cid in [c for c, reg in session.clients.items() if reg.last_seen <= cut]:
            log.info("client id %s of %s expired", cid, session.session_id)
            del session.clients[cid]

    # --- attachment --------------------------------------------------------------------------------

    def attach(self, session: Session, peer: Peer) -> None:
        """``peer`` receives the session's updates from now on (a closed one is not attached)."""
        if not peer.closed:
            session.attached.add(peer)
            state = self.peers.get(peer)
            if state is None:
                state = self.peers[peer] = PeerState(getattr(peer, "joins_lines", False) is True)
            state.attach(session)

    def detach(self, session: Session, peer: Peer) -> None:
        """``peer`` stops receiving the session's updates (its client ids stay registered)."""
        session.attached.discard(peer)
        state = self.peers.get(peer)
        if state is not None:
            state.detach(session)

    def peer_closed(self, peer: Peer) -> None:
        """A connection is gone: it receives nothing more and is forgotten (its client ids stay with
        their sessions)."""
        state = self.peers.pop(peer, None)
        if state is not None:
            for session in state.sessions:
                session.attached.discard(peer)

    def session_closed(self, session: Session) -> None:
        """The session ended: every connection is detached from it and every client id dropped."""
        session_id = session.session_id
        for peer in list(session.attached):
            state = self.peers.get(peer)
            if state is not None:
                state.detach(session)
                state.registrations.pop(session_id, None)
            # a peer that watches one session (a REST event stream) is told, so that it can end
            ended = getattr(peer, "session_ended", None)
            if ended is not None:
                ended(session_id)
        session.attached.clear()
        session.clients.clear()

    def any_live(self, session: Session) -> bool:
        """Some connection attached to ``session`` is still open."""
        return any(not p.closed for p in session.attached)
