"""The state of one session: its FIFO of turns, its clients, the connections attached to it."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from ..admission.policy import Queued
from ..backends.base import ClientChannel, TranscriptEntry, Turn
from ..errors import AcpError
from ..parking import ParkingSpot
from ..types.acp import ContentBlock, PromptResult
from .lines import UPDATE, UPDATE_FROM

if TYPE_CHECKING:
    from ..backends.base import Backend
    from .fanout import FanOut

__all__ = ["ClientReg", "ForkTicket", "Peer", "PromptTicket", "Session", "new_ticket"]

_encoder = msgspec.json.Encoder()


class Peer(Protocol):
    """A connection as the bridge sees it: somewhere to send bytes, and whether it is gone.

    A transport hands its connections to the bridge as they are (hashable objects with these
    members) and calls :meth:`~acp_server.bridge.SessionBridge.peer_closed` once one is gone. What
    the bridge keeps per connection (its client ids, the sessions it receives, whether it takes turn
    states) lives in the bridge's :class:`~acp_server.bridge.clients.ClientRegistry`, not here.

    A connection may also have ``joins_lines = True`` (absent: false, read once per connection): one
    :meth:`send` may then carry several lines, which reach the client as if sent one by one (an NDJSON
    connection's queue), and the fan-out joins lines of one step for it (a prompt's ``accepted`` and
    ``running``). A peer that turns each send into one message (an SSE subscriber) leaves it out.
    """

    peer_id: int

    @property
    def closed(self) -> bool:
        """The connection is gone (what it is sent is dropped)."""
        ...

    def send(self, data: bytes) -> None:
        """Queue a notification; a connection that cannot keep up is evicted, never waited for. A
        closed connection drops what it is sent."""
        ...

    async def send_reliably(self, data: bytes) -> None:
        """Queue a message that must not be dropped (a replay): waits for the writer, never evicts."""
        ...

    async def request(self, method: str, params: Any = None) -> Any:
        """Send a request to the peer and wait for its response (``trio.EndOfChannel`` if it leaves)."""
        ...


class ClientReg:
    """One client id of a session: how many holders it has and when it was last seen (trio's clock)."""

    __slots__ = ("client_id", "last_seen", "refcount")

    def __init__(self, client_id: str, now: float) -> None:
        self.client_id = client_id
        self.refcount = 1
        self.last_seen = now


class PromptTicket(Turn):
    """One admitted prompt, from admission to its single, caller-visible outcome.

    It settles exactly once (:meth:`~acp_server.bridge.settlement.Settlement.settle` guards it): the
    session's pending count is released then, and its waiters are answered.

    The ticket is also its own *done* latch (:attr:`done` is the ticket: ``set``/``is_set``/``wait``
    as ``trio.Event``'s), raised when its answer may go out; its event is made only if somebody waits
    before then (on the wire a prompt's outcome goes to callbacks: a latch object and an event per
    prompt were ~3% of an echo prompt's instructions).

    It is also the :class:`~acp_server.backends.base.Turn` its backend call gets (one object per prompt
    instead of two: a turn object of its own was ~3,200 instructions to make): the runner sets
    :attr:`fanout` and :attr:`upto` as the call starts. Its ``emit`` is the fan-out's for it
    (:meth:`FanOut.emit`'s steps inline, without ``exclude``): a method, not a ``partial`` made per
    prompt. Its ``client`` (the prompt's channel as a :class:`TurnChannel`, which reports
    ``paused_for_approval``), its ``transcript`` reader and its ``result_meta`` are made when a backend
    first reads them: most turns never do.
    """

    __slots__ = (
        "_answered_event",
        "_client",
        "_result_meta",
        "_transcript",
        "accepted_due",
        "admitted_at",
        "answered",
        "call_scope",
        "channel",
        "client_id",
        "deadline_ms",
        "error",
        "fanout",
        "finish",
        "lease",
        "priority",
        "result",
        "running",
        "seat",
        "sender",
        "seq",
        "store_op",
        "wait_scope",
        "waiters",
        "session",
        "settled",
        "state_ends",
        "upto",
    )

    session: Session
    sender: Peer | None
    client_id: str | None
    admitted_at: float
    deadline_ms: int
    running: bool
    settled: bool
    result: PromptResult | None
    error: AcpError | None
    #: the done latch is up: the answer may go out (with a store: the outcome is committed)
    answered: bool
    _answered_event: trio.Event | None
    call_scope: trio.CancelScope | None
    #: the requests waiting on this prompt (see PromptWaiter): a list once one subscribes (most
    #: prompts are answered before anybody does)
    waiters: list[Any] | tuple[()]
    #: the sender, for the agent's own requests (permission, fs, terminal)
    channel: Any
    #: the request's ``_meta`` without our own keys, passed to the agent (with shared limits the
    #: runner adds the lease's fencing token as the call starts)
    meta: dict[str, Any] | None
    #: the backend pool lease, held from admission to settlement
    lease: Any
    #: the prompt's number (its id is ``prompt_<seq>``) and its admission record's op in the store
    seq: int
    store_op: int
    #: its class for the admission policy: ``_meta.priority``, default interactive
    priority: str
    #: with the policy on: its policy seat, or its ticket in the global waiting room
    seat: Any
    #: set while the runner waits in the waiting room: settling cancels the wait
    wait_scope: trio.CancelScope | None
    #: the head and tail of its ``_acp_server/turn_state`` lines (built by the fan-out at the first)
    state_ends: tuple[bytes, bytes] | None
    #: a backend call started in its enqueuer's step (what is left to await), until the runner awaits it
    finish: Any
    #: its ``accepted`` turn state is still to be sent: with ``running`` if the prompt starts in the
    #: step that admits it (:meth:`~acp_server.bridge.fanout.FanOut.start`), else once it is queued
    accepted_due: bool
    #: keys the backend adds to the result's ``_meta`` (``None``: none yet; see :attr:`result_meta`)
    _result_meta: dict[str, Any] | None
    #: set by the runner as the call starts: the fan-out its updates go through, and the last event
    #: before the call (its transcript reads up to there)
    fanout: FanOut
    upto: int
    #: made when a backend first reads ``client`` / ``transcript`` (unset until then)
    _client: ClientChannel | None
    _transcript: Callable[[], Awaitable[list[TranscriptEntry]]] | None

    #: made by :func:`new_ticket`: a class whose ``__init__`` is Python's is made through an argument
    #: tuple and ``slot_tp_init`` (~1,500 instructions more per prompt than object's, callgrind)
    if TYPE_CHECKING:

        def __init__(self) -> None: ...

    else:
        __init__ = object.__init__

    # --- the Turn its backend gets -----------------------------------------------------------------

    @property
    def expires_at(self) -> float:
        """When its deadline passes on trio's clock (``inf``: it has none; :attr:`deadline` is the turn's).
        Worked out when read (a deadline's heap entry, once): most prompts have none."""
        deadline_ms = self.deadline_ms
        return self.admitted_at + deadline_ms / 1000 if deadline_ms else math.inf

    @property
    def session_id(self) -> str:  # type: ignore[override]
        """The session's id."""
        return self.session.session_id

    @property
    def deadline(self) -> float | None:  # type: ignore[override]
        """When the prompt's deadline passes on trio's clock (``None``: it has none)."""
        return self.expires_at if self.deadline_ms else None

    @property
    def permit(self) -> Any:  # type: ignore[override]
        """Its pool lease or shared hold: a backend may hand it back between calls."""
        return self.lease

    def emit(self, update: Any) -> None:
        """Record and send one of the running prompt's updates (dropped once the prompt settled)."""
        if self.settled:
            return
        fanout = self.fanout
        session = self.session
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        history = session.history
        history.append((event_id, update))
        if len(history) > fanout._trim_at:
            fanout._trim(session)
        attached = session.attached
        add_event = fanout._add_event
        if not attached:
            if add_event is not None:
                add_event(session.session_id, event_id, update)
            return
        body = _encoder.encode(update)  # once, for the wire and the store
        if add_event is not None:
            add_event(session.session_id, event_id, body)
        originator = self.client_id
        sinks = fanout.update_sinks
        if sinks and fanout._direct and len(attached) == 1:
            for peer in attached:
                sink = sinks.get(peer)
                if sink is not None:
                    sink(event_id, body, originator)
                    return
        if originator is None:
            data = UPDATE % (session.session_id.encode(), body, event_id)
        else:
            data = UPDATE_FROM % (session.session_id.encode(), body, event_id, originator.encode())
        if fanout._direct and len(attached) == 1:
            for peer in attached:
                peer.send(data)
            return
        fanout.send(session, data, None)

    @property
    def result_meta(self) -> dict[str, Any]:
        """Keys the backend adds to the result's ``_meta`` (made on first use and kept)."""
        extra = self._result_meta
        if extra is None:
            extra = self._result_meta = {}
        return extra

    @result_meta.setter
    def result_meta(self, value: dict[str, Any]) -> None:
        self._result_meta = value

    @property
    def client(self) -> ClientChannel | None:
        """The prompt's sender (``None`` once it is gone), made on first use and kept."""
        try:
            return self._client
        except AttributeError:
            pass
        channel = self.channel
        client: ClientChannel | None = TurnChannel(self.fanout, channel, self) if channel is not None else None
        self._client = client
        return client

    @client.setter
    def client(self, value: ClientChannel | None) -> None:
        self._client = value

    @property
    def transcript(self) -> Callable[[], Awaitable[list[TranscriptEntry]]] | None:
        """Reads the session's transcript before this prompt."""
        try:
            return self._transcript
        except AttributeError:
            pass
        table = self.fanout.table
        transcript: Callable[[], Awaitable[list[TranscriptEntry]]] | None = (
            partial(table.transcript, self.session, self.upto) if table is not None else None
        )
        self._transcript = transcript
        return transcript

    @transcript.setter
    def transcript(self, value: Callable[[], Awaitable[list[TranscriptEntry]]] | None) -> None:
        self._transcript = value

    # --- the done latch ----------------------------------------------------------------------------

    @property
    def done(self) -> PromptTicket:
        """The latch raised once the prompt's answer may go out: the ticket itself."""
        return self

    def is_set(self) -> bool:
        """The answer may go out (the prompt settled and, with a store, its outcome is committed)."""
        return self.answered

    def set(self) -> None:
        """Raise the latch and wake whoever waits on it."""
        self.answered = True
        if self._answered_event is not None:
            self._answered_event.set()

    async def wait(self) -> None:
        """Return once the latch is raised (a checkpoint either way)."""
        if self.answered:
            await trio.lowlevel.checkpoint()
            return
        if self._answered_event is None:
            self._answered_event = trio.Event()
        await self._answered_event.wait()

    def release_holds(self) -> None:
        """Give back what the prompt holds for its backend call: its pool lease and its policy seat
        (or its place in the waiting room). A runner waiting for the seat is woken to give it back
        itself. Safe to call again: a released lease and a given-up seat do nothing."""
        lease = self.lease
        if lease is not None:
            lease.release()
        seat = self.seat
        if seat is not None:
            if self.wait_scope is not None:
                self.wait_scope.cancel()  # the runner's wait leaves the waiting room
                return
            self.seat = None
            if isinstance(seat, Queued):
                seat.cancel()
            else:
                seat.release()


def new_ticket(
    session: Session,
    prompt_id: str,
    prompt: list[ContentBlock],
    sender: Peer | None,
    client_id: str | None,
    admitted_at: float,
    deadline_ms: int,
    channel: Any = None,
    #: the request's ``_meta`` without our own keys, passed to the agent (with shared limits the
    #: runner adds the lease's fencing token as the call starts)
    meta: dict[str, Any] | None = None,
    lease: Any = None,
    priority: str = "interactive",
    seat: Any = None,
    seq: int = 0,
) -> PromptTicket:
    """A new prompt's ticket (see :class:`PromptTicket`: made here, not by an ``__init__``)."""
    t = PromptTicket()
    t.session = session
    t.prompt_id = prompt_id
    t.prompt = prompt
    t.sender = sender
    t.client_id = client_id
    t.admitted_at = admitted_at
    t.deadline_ms = deadline_ms
    t.running = False
    t.settled = False
    t.result = None
    t.error = None
    t.answered = False
    t._answered_event = None
    t.call_scope = None
    t.waiters = ()
    t.channel = channel
    t.meta = meta
    t.lease = lease
    t.seq = seq
    t.store_op = 0
    t.priority = priority
    t.seat = seat
    t.wait_scope = None
    t.state_ends = None
    t.finish = None
    t.accepted_due = False
    t._result_meta = None
    return t


class TurnChannel:
    """A prompt's client channel that reports ``paused_for_approval`` while a permission request is open."""

    __slots__ = ("_fanout", "_inner", "_open", "_ticket")

    def __init__(self, fanout: FanOut, inner: ClientChannel, ticket: PromptTicket) -> None:
        self._fanout = fanout
        self._inner = inner
        self._ticket = ticket
        self._open = 0

    @property
    def capabilities(self) -> Any:
        """The sender's capabilities."""
        return self._inner.capabilities

    async def request(self, method: str, params: Any) -> Any:
        """Relay the agent's request to the prompt's sender, after the updates it sent before it."""
        if method != "session/request_permission":
            await self._fanout.sent()
            return await self._inner.request(method, params)
        ticket = self._ticket
        self._open += 1
        if self._open == 1 and not ticket.settled:
            self._fanout.turn_state(ticket, "paused_for_approval")
        try:
            await self._fanout.sent()
            return await self._inner.request(method, params)
        finally:
            self._open -= 1
            if not self._open and not ticket.settled:
                self._fanout.turn_state(ticket, "running")


class ForkTicket:
    """A fork waiting in its source session's FIFO; it takes no pending slot."""

    __slots__ = ("client_id", "done", "error", "new_session", "requester", "settled")

    def __init__(self, requester: Peer | None, client_id: str | None) -> None:
        self.requester = requester
        self.client_id = client_id
        self.settled = False
        self.done = trio.Event()
        self.new_session: Session | None = None
        self.error: AcpError | None = None

    def fail(self, error: AcpError) -> None:
        """Settle the fork with ``error`` (its requester raises it)."""
        self.error = error
        self.settled = True
        self.done.set()

    def succeed(self, new: Session) -> None:
        """Settle the fork with the new session."""
        self.new_session = new
        self.settled = True
        self.done.set()


class Session:
    """One session: id, working directory, FIFO, clients and attached connections."""

    __slots__ = (
        "abandoned",
        "attached",
        "backend",
        "clients",
        "created_ms",
        "cwd",
        "fifo",
        "history",
        "last_activity",
        "mcp_servers",
        "mode_id",
        "modes",
        "next_event_id",
        "pending_count",
        "runner",
        "runner_active",
        "runner_idle_epoch",
        "session_id",
        "tenant",
        "title",
        "trimmed_upto",
        "updated_ms",
    )

    def __init__(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        backend: Backend,
        now: float,
        now_ms: int,
        tenant: str = "default",
    ) -> None:
        self.session_id = session_id
        #: the tenant of the connection that created it: other tenants do not see it
        self.tenant = tenant
        self.cwd = cwd
        self.mcp_servers = mcp_servers
        self.backend = backend
        self.mode_id = "default"
        #: the agent's SessionModeState (a dict) when the backend reports one
        self.modes: dict[str, Any] | None = None
        self.title: str | None = None
        self.created_ms = now_ms
        self.updated_ms = now_ms
        self.last_activity = now
        #: a list, not a deque: it is short (the pending limit), and an empty deque takes ~760 bytes,
        #: a third of an idle session's memory
        self.fifo: list[PromptTicket | ForkTicket] = []
        self.pending_count = 0
        #: a runner task exists; ``runner`` is where it parks while it waits for work (see runner.py)
        self.runner_active = False
        self.runner = ParkingSpot()
        self.runner_idle_epoch = 0
        #: set while a backend call whose prompt already settled (cancelled, expired) is still running
        self.abandoned: trio.Event | None = None
        self.clients: dict[str, ClientReg] = {}
        #: the connections that receive its updates (see ClientRegistry.attach)
        self.attached: set[Peer] = set()
        #: the recent (eventId, update) in order, at most ``max_history_events`` of them; older ones
        #: (and those of a session restored from the store) are on disk only (see FanOut.history_pages)
        self.history: list[tuple[int, Any]] = []
        self.next_event_id = 1
        #: the last eventId dropped from ``history`` (0: none): with a store it is on disk, without gone
        self.trimmed_upto = 0

    @property
    def running_ticket(self) -> PromptTicket | None:
        """The prompt whose backend call runs now (not yet settled), if any."""
        for item in self.fifo:
            if isinstance(item, PromptTicket) and item.running and not item.settled:
                return item
        return None
