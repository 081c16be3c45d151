"""Property test of the session bridge: random interleavings of admissions, cancels, failures,
deadlines, disconnections and closes, checked after every step.

Hypothesis draws a list of operations; each example runs them in one ``trio.run`` on a
:class:`trio.testing.MockClock` that only moves when an operation says so, driving the bridge
directly with a scripted backend and fake connections. After each operation everything runnable
has run (``wait_all_tasks_blocked``), so the state can be checked exactly:

- every session's ``pending_count`` equals the number of its admitted, unsettled prompts, never negative;
- a prompt is refused for a full queue exactly when that number is at the limit;
- each session's prompts run one at a time and start in admission order;
- each caller gets at most one answer, and gets it as soon as its prompt settles;
- a passed deadline, a ``session/cancel`` or a close settles what it concerns;

and at the end, with every backend call released, every admitted prompt has settled exactly once,
every caller has exactly one answer and every pending count is back to 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acp_server.admission import Limits
from acp_server.bridge import PromptTicket, Session, SessionBridge
from acp_server.errors import AcpError, InvalidParamsError, PromptQueueFullError, SessionNotFoundError

from .fakes import FakeBackend, FakePeer, admit_ticket, open_session, running_bridge, text_blocks
from .helpers import scaled

LIMIT = 2
SESSIONS = 2
PEERS = 3
BEHAVIOURS = ("echo", "hold", "hold", "ignore_cancel", "fail", "crash", "delay")


@dataclass(frozen=True)
class Admit:
    """A prompt sent on ``session`` (or, when ``stale``, on the session that slot had before a close)."""

    session: int
    peer: int
    behaviour: str
    deadline_ms: int | None
    stale: bool = False


@dataclass(frozen=True)
class CancelRequest:
    """``$/cancel_request`` of one earlier prompt: its waiter is cancelled."""

    index: int


@dataclass(frozen=True)
class SessionCancel:
    session: int


@dataclass(frozen=True)
class Release:
    """The backend finishes a held call (if the prompt is held)."""

    index: int


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Disconnect:
    """A connection is lost (its waiters are cancelled); a new one registers in its place."""

    peer: int


@dataclass(frozen=True)
class Close:
    """``session/close``; a new session takes the slot."""

    session: int


Op = Admit | CancelRequest | SessionCancel | Release | Advance | Disconnect | Close

_session = st.integers(0, SESSIONS - 1)
_admit = st.builds(
    Admit,
    session=_session,
    peer=st.integers(0, PEERS - 1),
    behaviour=st.sampled_from(BEHAVIOURS),
    deadline_ms=st.sampled_from([None, None, 1000, 2500]),
    stale=st.sampled_from([False] * 9 + [True]),
)
_hold = st.builds(Admit, session=_session, peer=st.just(0), behaviour=st.just("hold"), deadline_ms=st.none())
# Admissions are drawn most often, so that queues fill up and the limit is reached.
OPS = st.one_of(
    _admit,
    _admit,
    _hold,
    _hold,
    st.builds(CancelRequest, index=st.integers(0, 60)),
    st.builds(Release, index=st.integers(0, 60)),
    st.builds(Advance, seconds=st.sampled_from([0.5, 1.0, 3.0])),
    st.builds(SessionCancel, session=_session),
    st.builds(Disconnect, peer=st.integers(0, PEERS - 1)),
    st.builds(Close, session=_session),
)


class Tracked:
    """One admitted prompt and what its caller has seen.

    The caller waits the way the ``session/prompt`` handler does: through the bridge's callback
    waiter (``bridge.waiter``), cancelled as the connection shell cancels it.
    """

    def __init__(self, index: int, ticket: PromptTicket, text: str, peer: FakePeer) -> None:
        self.index = index
        self.ticket = ticket
        self.text = text
        self.peer = peer
        self.answers: list[tuple[str, str]] = []
        #: ``$/cancel_request`` was sent for it
        self.cancelled = False
        #: its connection is gone (it can get no answer any more)
        self.lost = False
        self._deferred: Any = None

    @property
    def settled(self) -> bool:
        return self.ticket.done.is_set()

    def start(self, bridge: SessionBridge) -> None:
        self._deferred = bridge.waiter(self.ticket)
        self._deferred.subscribe(self._answer)

    def cancel_request(self) -> None:
        self.cancelled = True
        self._deferred.cancel(connection_lost=False)

    def connection_lost(self) -> None:
        self.lost = True
        self._deferred.cancel(connection_lost=True)

    def _answer(self, result: Any, error: AcpError | None) -> None:
        self.answers.append(("error", error.kind) if error is not None else ("result", result.stop_reason))


class Harness:
    def __init__(self, bridge: SessionBridge, backend: FakeBackend, clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
        self.bridge = bridge
        self.backend = backend
        self.clock = clock
        self.nursery = nursery
        self.peers = [FakePeer() for _ in range(PEERS)]
        self.sessions: list[Session] = []
        #: every session ever opened, and the last closed one of each slot
        self.all_sessions: list[Session] = []
        self.closed: dict[int, Session] = {}
        self.tracked: list[Tracked] = []

    async def start(self) -> None:
        self.sessions = [await self.open(i) for i in range(SESSIONS)]
        self.all_sessions = list(self.sessions)

    async def open(self, slot: int) -> Session:
        # Slot 0's session has every connection attached; slot 1's only the first, so that a lost
        # connection sometimes leaves others watching (its prompts run on) and sometimes not.
        session, _ = await open_session(self.bridge, self.peers[0])
        if slot == 0:
            for peer in self.peers[1:]:
                self.bridge.register(session, peer)
        return session

    def unsettled(self, session: Session) -> list[Tracked]:
        return [t for t in self.tracked if t.ticket.session is session and not t.settled]

    def pick(self, index: int) -> Tracked | None:
        return self.tracked[index % len(self.tracked)] if self.tracked else None

    # --- operations --------------------------------------------------------------------------------

    async def apply(self, op: Op) -> None:
        if isinstance(op, Admit):
            self.admit(op)
        elif isinstance(op, CancelRequest):
            tracked = self.pick(op.index)
            if tracked is not None and not tracked.lost:
                tracked.cancel_request()
        elif isinstance(op, SessionCancel):
            before = self.unsettled(self.sessions[op.session])
            self.bridge.cancel_session(self.sessions[op.session].session_id, self.peers[0])
            await trio.testing.wait_all_tasks_blocked()
            for t in before:
                assert t.settled and t.ticket.result is not None and t.ticket.result.stop_reason == "cancelled"
        elif isinstance(op, Release):
            tracked = self.pick(op.index)
            if tracked is not None:
                self.backend.release(tracked.text)
        elif isinstance(op, Advance):
            self.clock.jump(op.seconds)
        elif isinstance(op, Disconnect):
            await self.disconnect(op.peer)
        else:
            old = self.sessions[op.session]
            before = self.unsettled(old)
            self.bridge.close_session(old)
            self.closed[op.session] = old
            self.sessions[op.session] = await self.open(op.session)
            self.all_sessions.append(self.sessions[op.session])
            await trio.testing.wait_all_tasks_blocked()
            for t in before:
                assert t.settled and t.ticket.result is not None and t.ticket.result.stop_reason == "cancelled"
        await trio.testing.wait_all_tasks_blocked()

    def admit(self, op: Admit) -> None:
        stale = op.stale and op.session in self.closed
        session = self.closed[op.session] if stale else self.sessions[op.session]
        peer = self.peers[op.peer]
        index = len(self.tracked)
        text = f"t{index}"
        expected_full = len(self.unsettled(session)) >= LIMIT
        try:
            ticket = admit_ticket(
                self.bridge,
                session.session_id, text_blocks(text), peer=peer, deadline_ms=op.deadline_ms
            )
        except SessionNotFoundError:
            assert stale, "a live session was not found"
            return
        except PromptQueueFullError as exc:
            assert not stale, "a closed session admitted a prompt"
            assert expected_full, "refused below the limit"
            assert exc.payload.pending_count == LIMIT and exc.payload.limit == LIMIT
            return
        assert not stale, "a closed session admitted a prompt"
        assert not expected_full, "admitted above the limit"
        if op.behaviour == "hold":
            self.backend.hold(text)
        elif op.behaviour == "ignore_cancel":
            self.backend.ignore_cancel(text)
        elif op.behaviour == "fail":
            self.backend.fail(text, InvalidParamsError(path="prompt", detail="scripted"))
        elif op.behaviour == "crash":
            self.backend.crash(text)
        elif op.behaviour == "delay":
            self.backend.delay(text, 1.5)
        tracked = Tracked(index, ticket, text, peer)
        self.tracked.append(tracked)
        tracked.start(self.bridge)

    async def disconnect(self, index: int) -> None:
        old = self.peers[index]
        registrations = {s.session_id: self.bridge.clients.registration(old, s.session_id) for s in self.sessions}
        old.closed = True
        self.bridge.peer_closed(old)
        mine = [t for t in self.tracked if t.peer is old and not t.settled]
        for t in mine:
            t.connection_lost()
        await trio.testing.wait_all_tasks_blocked()
        for t in mine:
            # A prompt whose caller left runs on only while another live connection watches its session.
            assert t.settled or any(not p.closed for p in t.ticket.session.attached)
        new = FakePeer()
        for session in self.sessions:
            registered = registrations[session.session_id]
            if registered is not None:
                self.bridge.register(session, new, registered)
        self.peers[index] = new

    # --- checks ------------------------------------------------------------------------------------

    def check(self) -> None:
        now = trio.current_time()
        for session in self.all_sessions:
            unsettled = self.unsettled(session)
            assert session.pending_count >= 0
            assert session.pending_count == len(unsettled)
            running = [c for c in self.backend.running if c.session_id == session.session_id]
            assert len(running) <= 1, "two backend calls of one session at once"
        for t in self.tracked:
            assert len(t.answers) <= 1, f"{t.text} answered twice: {t.answers}"
            if not t.lost and (t.settled or t.cancelled):
                assert len(t.answers) == 1, f"{t.text} settled or cancelled but its caller has no answer"
            if not t.settled:
                assert not t.answers, f"{t.text} answered before it settled"
                assert now < t.ticket.expires_at, f"{t.text} outlived its deadline"

    async def finish(self) -> None:
        self.backend.release_all()
        for _ in range(len(self.tracked) + 2):
            await trio.testing.wait_all_tasks_blocked()
            if all(t.settled for t in self.tracked) and not self.backend.running:
                break
            self.clock.jump(2.0)
        self.check()
        for t in self.tracked:
            assert t.settled, f"{t.text} never settled"
            if not t.lost:
                assert len(t.answers) == 1, f"{t.text}: {t.answers}"
        for session in self.all_sessions:
            assert session.pending_count == 0
        stats = self.bridge.statistics()
        assert stats.admitted_total == stats.settled_total == len(self.tracked)
        assert self.backend.running == []
        # Per session, prompts started in admission order.
        order = {t.text: t.index for t in self.tracked}
        for session in self.all_sessions:
            started = [order[c.text] for c in self.backend.calls if c.session_id == session.session_id]
            assert started == sorted(started)


async def _run(ops: list[Any]) -> None:
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    backend = FakeBackend()
    limits = Limits(max_pending_prompts_per_session=LIMIT, client_idle_timeout_s=1e6, session_idle_timeout_s=1e6)
    async with running_bridge(backend, limits) as bridge, trio.open_nursery() as callers:
        harness = Harness(bridge, backend, clock, callers)
        await harness.start()
        for op in ops:
            await harness.apply(op)
            harness.check()
        await harness.finish()
        callers.cancel_scope.cancel()


@settings(max_examples=scaled(500, 50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=10, max_size=60))
def test_bridge_invariants_hold_under_random_operations(ops: list[Any]) -> None:
    """Pending counts, FIFO order, single answers and single settlement hold for any interleaving."""
    trio.run(_run, ops, clock=trio.testing.MockClock())
