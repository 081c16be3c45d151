"""The session runner: one task per busy session runs its FIFO, one turn at a time, in arrival order.

For each prompt at the head it waits (with a store) for the prompt's admission record to commit,
takes a policy seat (the admission policy on), then calls the backend in its own task: under the
backend pool's permit, with a :class:`~acp_server.backends.base.Turn` whose ``emit`` goes to the
fan-out. A fork at the head branches the session on its backend. Outcomes go to the
:class:`~acp_server.bridge.settlement.Settlement`; the runner settles nothing by itself.

The runner outlives an empty FIFO: it parks, and the next prompt wakes it (a task per busy spell, not
per prompt: with a store each answer waits for a commit, so a busy session's FIFO empties between
turns). :meth:`SessionRunner.stop_idle` ends one parked for a whole sweep period, a closed session's
at once.

A prompt that nothing precedes (the FIFO empty, the runner parked or gone, no commit or seat to
wait for) starts in the step that admits it, on a backend with a synchronous start
(:meth:`SessionRunner._start_now`): the echo agent's whole turn ends there, an agent process's
request is queued there, and the runner awaits only what is left. With a store, the prompts at a
parked runner's FIFO head start that way in the step that learns their admission records are
committed (:meth:`SessionRunner._committed`), one after the other, instead of waking the runner.

A prompt that settles while its call is still running (cancelled, expired) leaves that call
*abandoned*: the FIFO's next prompt waits for it (the agent is still busy), while a fork that reaches
the head then fails at once (:meth:`Settlement.fail_head_forks`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from contextlib import aclosing
from functools import partial
from typing import Any

import outcome
import trio

from ..admission.policy import PolicyEngine, Queued, Seat, WaitDeadlineExpired
from ..admission.pool import Lease
from ..admission.shared import SharedHold
from ..errors import AcpError, InternalError
from ..types.acp import PromptResult
from .fanout import FanOut
from .persistence import Persistence
from .session import ForkTicket, PromptTicket, Session
from .sessions import SessionTable
from .settlement import Settlement, cancelled_result

__all__ = ["RUNNER_IDLE_S", "SessionRunner"]

log = logging.getLogger("acp_server.bridge")

#: how long (one to two sweeps) a session's runner stays parked with an empty FIFO before it ends
RUNNER_IDLE_S = 1.0


#: ``PromptTicket.finish`` while :meth:`SessionRunner._start_now` runs the backend's start
_STARTING: Any = object()


class SessionRunner:
    """Runs the sessions' FIFOs (see the module docstring).

    Args:
        table: the live sessions (a closed session's runner ends; a fork adds one).
        settlement: where outcomes go.
        fanout: turn states, the prompt's own text and the agent's updates.
        persistence: the commit a head prompt waits for; a fork's new session is recorded there.
        policy: the admission policy (seats).
    """

    def __init__(
        self,
        table: SessionTable,
        settlement: Settlement,
        fanout: FanOut,
        persistence: Persistence,
        policy: PolicyEngine,
    ) -> None:
        self._table = table
        self._settlement = settlement
        self._fanout = fanout
        self._persistence = persistence
        self._policy = policy
        #: where runner tasks start (set while the bridge runs)
        self.nursery: trio.Nursery | None = None
        #: counts :meth:`stop_idle`'s sweeps; a runner parks with the current one
        self._epoch = 0
        #: a prompt may start in its enqueuer's step: no commit to wait for (see :meth:`_start_now`)
        self._eager = not persistence.durable
        self._seats = policy.enabled  # fixed for the engine's life
        #: the session whose FIFO :meth:`_committed` runs now (its kicks wait until it stops)
        self._draining: Session | None = None

    def enqueue(self, session: Session, item: PromptTicket | ForkTicket) -> None:
        """Append ``item`` to the session's FIFO, and make sure a runner will take it.

        A prompt that can start at once (see :meth:`_start_now`) starts here, in the caller's step;
        with a store, one on a session without a runner starts in the step of its commit (see
        :meth:`_committed`), and no runner task is made for it.

        Raises:
            InternalError: the bridge is not running.
        """
        fifo = session.fifo
        if (
            not fifo
            and self._eager
            and type(item) is PromptTicket
            and (not session.runner_active or session.runner.task is not None)
            and self._start_now(session, item)
        ):
            return
        fifo.append(item)
        if session.runner_active:
            runner = session.runner
            if runner.task is not None and len(fifo) == 1:  # an idle runner: it takes this one (no new task)
                if self._persistence.durable:
                    self._nudge(session)
                else:
                    runner.wake(outcome.Value(True))  # nothing to commit first: as wake(session, True)
            return
        if self._persistence.durable:
            # No runner: the commit of the head's admission record runs the FIFO (_committed), and
            # starts a runner only for what it cannot start at once. A FIFO longer than this item
            # has that commit pending already.
            if len(fifo) > 1:
                return
            if type(item) is PromptTicket and self._persistence.committed < item.store_op:
                self._persistence.when_committed(item.store_op, partial(self._committed, session))
                return
        if self.nursery is None:
            raise InternalError()
        session.runner_active = True
        self.nursery.start_soon(self._run, session)

    def _start_now(self, session: Session, ticket: PromptTicket) -> bool:
        """Start the prompt's backend call in the enqueuer's step, when nothing comes before it.

        :meth:`enqueue` checked that the session's FIFO is empty and its runner parked or gone, and
        (no store) that there is no commit to wait for; here: its policy seat is held (or none is
        needed), no shared limits apply, the pool's permit is free and the backend has a synchronous
        start (``start_prompt``, see :class:`~acp_server.backends.base.Backend`). The start runs
        here, between the same turn states and updates as in the runner: a turn it completes settles
        at once (no runner step, no extra scheduler pass: its answer leaves in this pass); one still
        under way is awaited by the runner under its cancel scope (:meth:`_finish_call`), so
        cancellation, deadlines and the FIFO hold as for a call the runner makes.

        Returns:
            False when nothing was done: the prompt goes through the runner.
        """
        lease = ticket.lease
        if (lease is not None and isinstance(lease, SharedHold)) or (self._seats and not isinstance(ticket.seat, Seat)):
            return False
        start = getattr(session.backend, "start_prompt", None)
        if start is None or self.nursery is None:
            return False
        if lease is not None:
            try:
                lease.acquire_permit_nowait()
            except trio.WouldBlock:
                return False  # the runner waits for it, reporting waiting_for_dependency
        session.fifo.insert(0, ticket)  # its head: the FIFO is empty, or (after a commit) holds what follows
        ticket.running = True
        fanout = ticket.fanout = self._fanout  # the ticket is the backend's turn
        ticket.upto = session.next_event_id - 1  # the transcript before this prompt
        fanout.start(ticket)  # accepted (still due) and running, the prompt's own text to the others
        ticket.finish = _STARTING  # settling meanwhile leaves the holds and abandons the call
        try:
            started = start(ticket)
        except AcpError as exc:
            self._end_now(session, ticket, None, exc)
            return True
        except Exception:
            log.exception("backend %s failed on %s of session %s", session.backend.name, ticket.prompt_id, session.session_id)
            self._end_now(session, ticket, None, InternalError())
            return True
        if isinstance(started, str):
            self._end_now(session, ticket, _result(ticket, started), None)
            return True
        ticket.finish = started
        self._kick(session)
        return True

    def _end_now(self, session: Session, ticket: PromptTicket, result: PromptResult | None, error: AcpError | None) -> None:
        """The end of a call that :meth:`_start_now` completed: as :meth:`_call_backend`'s, and the
        prompt leaves the FIFO before it settles (its answer may bring the connection's next prompt)."""
        ticket.finish = None
        if ticket.lease is not None or ticket.seat is not None:
            ticket.release_holds()
        abandoned = session.abandoned
        if abandoned is not None:  # it settled during the start
            session.abandoned = None
            abandoned.set()
        fifo = session.fifo
        if fifo and fifo[0] is ticket:
            del fifo[0]
        elif ticket in fifo:
            fifo.remove(ticket)
        self._settlement.settle(ticket, result, error, ticket.admitted_at)  # admitted in this step
        if fifo:
            self._kick(session)  # something was queued meanwhile

    def _kick(self, session: Session) -> None:
        """Make sure a runner looks at the session's FIFO: wake the parked one, or start one (not while
        :meth:`_committed` runs that FIFO: it looks at the FIFO again, and kicks when it stops)."""
        if session is self._draining:
            return
        if session.runner_active:
            runner = session.runner
            if runner.task is not None:
                runner.wake(outcome.Value(True))
            return  # a runner that is not parked looks at the FIFO before it parks again
        if self.nursery is None:
            raise InternalError()
        session.runner_active = True
        self.nursery.start_soon(self._run, session)

    def _nudge(self, session: Session) -> None:
        """Wake the session's parked runner once its FIFO's head may run: now, or (with a store) when
        the head's admission record is committed."""
        head = session.fifo[0]
        if isinstance(head, PromptTicket) and self._persistence.committed < head.store_op:
            self._persistence.when_committed(head.store_op, partial(self._committed, session))
        else:
            self.wake(session, True)

    def _committed(self, session: Session) -> None:
        """The admission record of the session's FIFO head is committed (a store callback, in the step
        that reads the writer's report): start the prompts at the head that can start at once
        (:meth:`_start_now`), one after the other while each ends there, instead of waking the runner
        for them; what is left goes to the runner.

        Nothing is done for a runner that is not parked: it looks at its FIFO before it parks again.
        A head whose record is not committed yet waits for its commit here again.
        """
        if session.runner_active and session.runner.task is None:
            return
        fifo = session.fifo
        persistence = self._persistence
        session.runner_idle_epoch = self._epoch  # busy: the parked runner is not idle for stop_idle
        self._draining = session
        try:
            while fifo:
                head = fifo[0]
                if type(head) is not PromptTicket or head.finish is not None:
                    break  # a fork, or a call under way: the runner's
                if head.settled:
                    del fifo[0]
                    continue
                if persistence.committed < head.store_op:
                    persistence.when_committed(head.store_op, partial(self._committed, session))
                    return
                del fifo[0]
                if not self._start_now(session, head):
                    fifo.insert(0, head)
                    break
                if fifo and fifo[0] is head:
                    break  # its call is under way: the runner awaits the rest
        finally:
            self._draining = None
        if fifo:
            self._kick(session)

    @staticmethod
    def wake(session: Session, go: bool) -> None:
        """Resume the session's parked runner (if it is parked): to look at its FIFO again (``go``), or
        to end if the FIFO is empty (idle too long, or the session closed)."""
        runner = session.runner
        if runner.task is not None:
            runner.wake(outcome.Value(go))

    async def _run(self, session: Session) -> None:
        """Run the session's FIFO until it is closed, or idle for a sweep."""
        fifo = session.fifo
        persistence = self._persistence
        seats = self._policy.enabled  # fixed for the engine's life
        try:
            while True:
                # One cancel scope serves the calls until one is cancelled (its prompt settled while
                # it ran): then a fresh one, so the cancel reaches no later call. A scope per call
                # cost ~10% of an echo prompt's CPU. Nothing cancels it while the runner is parked.
                with trio.CancelScope() as scope:
                    while True:
                        if not fifo:
                            if not self._table.is_live(session):
                                return  # closed
                            session.runner_idle_epoch = self._epoch
                            if not await session.runner.park() and not fifo:
                                return
                            continue
                        item = fifo[0]
                        if type(item) is PromptTicket and item.finish is not None:
                            cancelled = await self._finish_call(item, scope)  # started by _start_now
                            del fifo[0]
                            if cancelled:
                                break
                            continue
                        if item.settled:
                            del fifo[0]
                            continue
                        if isinstance(item, ForkTicket):
                            await self._fork(session, item)
                            del fifo[0]
                            continue
                        if persistence.committed < item.store_op:
                            # its admission record first
                            persistence.when_committed(item.store_op, partial(self._committed, session))
                            await session.runner.park()
                            continue  # re-check: it may have settled meanwhile
                        if (seats or isinstance(item.lease, SharedHold)) and not await self._take_seat(item):
                            continue  # settled while it waited for a seat: the loop drops it
                        cancelled = await self._call_backend(item, scope)
                        del fifo[0]
                        if cancelled:
                            break  # the call finished before the cancel reached it
        finally:
            session.runner_active = False
            session.runner.task = None

    async def stop_idle(self) -> None:
        """Every :data:`RUNNER_IDLE_S`, end the runners parked with an empty FIFO since the last sweep."""
        while True:
            await trio.sleep(RUNNER_IDLE_S)
            epoch = self._epoch
            self._epoch = epoch + 1
            for session in list(self._table.live.values()):
                if session.runner.parked and not session.fifo and session.runner_idle_epoch < epoch:
                    self.wake(session, False)

    async def _take_seat(self, ticket: PromptTicket) -> bool:
        """Hold a policy seat for the head prompt: the one decided at arrival, or one from the fair
        queue (never refused: an accepted prompt waits). False when the prompt settled meanwhile."""
        if isinstance(ticket.lease, SharedHold):
            return await self._take_shared_seat(ticket, ticket.lease)
        got = ticket.seat
        if got is None:
            session = ticket.session
            got = ticket.seat = self._policy.enqueue(
                tenant=session.tenant,
                priority=ticket.priority,
                deadline=ticket.deadline,
                session_id=session.session_id,
            )
            if isinstance(got, Queued) and got.waiting:
                self._fanout.turn_state(ticket, "queued", position=got.position_hint)
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
                self._settlement.expire(ticket)  # too little of its deadline left to start
            return False
        ticket.seat = seat
        if ticket.settled:
            ticket.release_holds()
            return False
        return True

    async def _take_shared_seat(self, ticket: PromptTicket, hold: SharedHold) -> bool:
        """:meth:`_take_seat` for limits shared by replicas: the cluster's seat (a waiter leaves the
        waiting room in the same step). False when the prompt settled meanwhile."""
        if hold.seated:
            return True
        got = False
        with trio.CancelScope() as scope:
            ticket.wait_scope = scope
            try:
                await hold.take_seat()
                got = True
            except RuntimeError:
                pass  # the hold was released: the prompt settled while it waited
            finally:
                ticket.wait_scope = None
        if not got or scope.cancelled_caught:
            return False
        if ticket.settled:
            ticket.release_holds()
            return False
        return True

    async def _call_backend(self, ticket: PromptTicket, scope: trio.CancelScope) -> bool:
        """Run the head prompt's backend call under the runner's ``scope`` (cancelled if it settles first).

        Returns:
            Whether ``scope`` was cancelled (the prompt settled while its call ran: the call was
            abandoned), so that the next call gets a fresh one.
        """
        ticket.running = True
        lease = ticket.lease
        ticket.fanout = self._fanout  # the ticket is the backend's turn
        ticket.upto = ticket.session.next_event_id - 1  # the transcript before this prompt
        if isinstance(lease, SharedHold):
            ticket.meta = _with_fence(ticket.meta, lease)
        return await self._settle_call(ticket, scope, self._start_call(ticket, lease))

    async def _start_call(self, ticket: PromptTicket, lease: Lease | SharedHold | None) -> Any:
        """A call the runner starts: the pool's permit, ``running``, the prompt's own text to the
        session's other connections, then the backend's turn."""
        if lease is not None:
            await self._permit(ticket, lease)  # at most max_active calls; FIFO
        fanout = self._fanout
        session = ticket.session
        fanout.turn_state(ticket, "running")
        fanout.own_text(ticket)
        return await session.backend.prompt(ticket)

    async def _finish_call(self, ticket: PromptTicket, scope: trio.CancelScope) -> bool:
        """Await the rest of a call that :meth:`_start_now` started, as :meth:`_call_backend` does its
        call (a prompt settled since its start has its call cancelled now).

        Returns:
            Whether ``scope`` was cancelled, so that the next call gets a fresh one.
        """
        call = ticket.finish
        if ticket.settled:
            scope.cancel()  # settling marked the call abandoned, and left this to the runner
        return await self._settle_call(ticket, scope, call)

    async def _settle_call(self, ticket: PromptTicket, scope: trio.CancelScope, call: Awaitable[Any]) -> bool:
        """Await a prompt's ``call`` under ``scope``, release its holds and settle it with the outcome
        (a no-op when it settled first: cancel, deadline, crash).

        Returns:
            Whether ``scope`` was cancelled, so that the next call gets a fresh one.
        """
        session = ticket.session
        result: PromptResult | None = None
        error: AcpError | None = None
        try:
            ticket.call_scope = scope
            try:
                stop_reason = await call
            finally:
                ticket.call_scope = None  # the call is over: settling now abandons nothing
                ticket.finish = None
            result = _result(ticket, stop_reason)
        except AcpError as exc:
            result, error = None, exc
        except trio.Cancelled:
            self._settlement.settle(ticket, cancelled_result(ticket), None)
            raise
        except Exception:
            log.exception("backend %s failed on %s of session %s", session.backend.name, ticket.prompt_id, session.session_id)
            result, error = None, InternalError()
        finally:
            if ticket.lease is not None or ticket.seat is not None:
                ticket.release_holds()  # the lease with its permit; the seat (busy sessions take turns)
            abandoned = session.abandoned
            if abandoned is not None:  # settling cancelled the scope (it does so only then)
                session.abandoned = None
                abandoned.set()
        self._settlement.settle(ticket, result, error)
        return abandoned is not None

    async def _permit(self, ticket: PromptTicket, lease: Lease | SharedHold) -> None:
        """Take the backend pool's permit, reporting ``waiting_for_dependency`` when it has to wait."""
        if isinstance(lease, SharedHold):
            if not await lease.try_permit():
                self._fanout.turn_state(ticket, "waiting_for_dependency")
                await lease.acquire_permit()
            return
        try:
            lease.acquire_permit_nowait()
        except trio.WouldBlock:
            self._fanout.turn_state(ticket, "waiting_for_dependency")
            await lease.acquire_permit()

    async def _fork(self, session: Session, item: ForkTicket) -> None:
        """Branch ``session`` on its backend into a new live session with a copy of its transcript."""
        table = self._table
        try:
            table.check_limit()
        except AcpError as exc:
            item.fail(exc)
            return
        async with aclosing(self._fanout.history_pages(session, 0)) as pages:
            copied = [entry async for page in pages for entry in page]
        new = table.build(session.backend, session.cwd, list(session.mcp_servers), session.tenant)
        try:
            await session.backend.fork(session.session_id, new.session_id)
        except AcpError as exc:
            item.fail(exc)
            return
        except Exception:
            log.exception("backend fork of %s failed", session.session_id)
            item.fail(InternalError())
            return
        new.history = copied  # the whole transcript, for the store's copy; trimmed at the next event
        new.next_event_id = session.next_event_id
        new.mode_id = session.mode_id
        new.modes = session.modes
        new.title = session.title
        table.add(new)
        self._persistence.save_session(new)
        self._persistence.copy_transcript(new)
        item.succeed(new)


def _result(ticket: PromptTicket, stop_reason: Any) -> PromptResult:
    """A completed call's result: its stop reason, the backend's ``_meta`` keys and the prompt's id."""
    extra = ticket._result_meta
    meta = {**extra, "promptId": ticket.prompt_id} if extra else {"promptId": ticket.prompt_id}
    return PromptResult(stop_reason=stop_reason, meta=meta)


def _with_fence(meta: dict[str, Any] | None, hold: Any) -> dict[str, Any] | None:
    """The ``_meta`` of the backend call: with shared limits, the lease's fencing token and id, so a
    downstream can refuse a stale holder."""
    if not isinstance(hold, SharedHold):
        return meta
    return {**(meta or {}), "fencingToken": hold.fencing_token, "leaseId": hold.lease.id}
