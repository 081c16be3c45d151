"""Settlement: every admitted prompt gets exactly one outcome, and its slot back at that moment.

:meth:`Settlement.settle` is the one place a prompt ends, whichever of result, error, cancel,
deadline, lost connection or crash comes first; later calls change nothing. It sends the terminal
turn state, releases the session's pending slot and what the prompt holds for its backend call (or
cancels the call, which then runs on *abandoned* until the backend returns), records the outcome
and answers the prompt's waiters through the fan-out (with a store: once the outcome is committed).

It also owns the deadlines (one timer for the whole bridge) and :class:`PromptWaiter`, the
:class:`~acp_server.jsonrpc.Deferred` a ``session/prompt`` request waits on.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from ..errors import (
    AcpError,
    BranchWhilePromptActiveError,
    PromptDeadlineExceededError,
    RequestCancelledError,
)
from ..jsonrpc.dispatch import Deferred
from ..types.acp import PromptResult
from .fanout import FanOut
from .persistence import Persistence
from .session import ForkTicket, PromptTicket, Session

__all__ = ["PromptWaiter", "Settlement", "cancelled_result"]

log = logging.getLogger("acp_server.bridge")


def cancelled_result(ticket: PromptTicket) -> PromptResult:
    """The result of a cancelled prompt: ``stopReason: "cancelled"``."""
    return PromptResult(stop_reason="cancelled", meta={"promptId": ticket.prompt_id})


def _terminal_state(result: PromptResult | None, error: AcpError | None) -> tuple[str, str | None]:
    """The terminal turn state of an outcome, and its reason (the stop reason or the error kind)."""
    if error is not None:
        return ("cancelled" if isinstance(error, RequestCancelledError) else "failed"), error.kind
    if result is not None and result.stop_reason == "cancelled":
        return "cancelled", None
    return "completed", result.stop_reason if result is not None else None


class Settlement:
    """Settles prompts and forks, and expires prompts at their deadline.

    Args:
        fanout: sends the terminal turn states and the answers.
        persistence: records the outcomes.
    """

    def __init__(self, fanout: FanOut, persistence: Persistence) -> None:
        self._fanout = fanout
        #: the fan-out answers at once (no store): its hold_answer and answer_waiters are inlined
        self._direct = (
            type(fanout).hold_answer is FanOut.hold_answer and type(fanout).answer_waiters is FanOut.answer_waiters
        )
        #: where outcomes are recorded (``None`` without a store: nothing to call)
        self._record = persistence.settle if persistence.durable else None
        #: prompts settled so far
        self.settled_total = 0
        #: (deadline, seq, ticket): prompts with a deadline, soonest first (settled ones drop out lazily)
        self._deadlines: list[tuple[float, int, PromptTicket]] = []
        self._deadline_changed = trio.Event()
        #: trio's clock (the bridge binds the run's own once it runs)
        self.now: Callable[[], float] = trio.current_time

    def settle(
        self, ticket: PromptTicket, result: PromptResult | None, error: AcpError | None, now: float | None = None
    ) -> bool:
        """Give the prompt its one outcome and release its slot (``now``: trio's clock, if the caller
        read it in this step already).

        Returns:
            False when it had settled already (nothing changes then).
        """
        if ticket.settled:
            return False
        if error is not None:
            error = error.for_prompt(ticket.prompt_id)
            self._fanout.turn_state(ticket, *_terminal_state(result, error))
        elif result is not None and result.stop_reason != "cancelled":
            self._fanout.completed(ticket, result.stop_reason)  # the usual outcome
        else:
            self._fanout.turn_state(ticket, *_terminal_state(result, error))
        ticket.settled = True
        ticket.result, ticket.error = result, error
        session = ticket.session
        session.pending_count -= 1
        assert session.pending_count >= 0, "pending count went negative"
        session.last_activity = self.now() if now is None else now
        self.settled_total += 1
        if ticket.call_scope is not None:
            # The call runs on until the backend returns (at once, for one that honours cancellation);
            # it gives back the lease and the seat as it ends.
            ticket.call_scope.cancel()
            if session.abandoned is None:
                session.abandoned = trio.Event()
        elif ticket.finish is not None:
            # Started in its enqueuer's step and not yet awaited: the runner cancels the call as it
            # takes it, and gives back the holds as the call ends.
            if session.abandoned is None:
                session.abandoned = trio.Event()
        elif ticket.lease is not None or ticket.seat is not None:
            ticket.release_holds()  # it never reached the backend (or holds what it was given back)
        if self._record is not None:
            self._record(ticket)
        if not self._direct:
            self._fanout.hold_answer(ticket)
            if session.abandoned is not None:
                self.fail_head_forks(session)
            self._fanout.answer_waiters(ticket)
            return True
        ticket.answered = True  # FanOut.hold_answer's ticket.set(), inline
        if ticket._answered_event is not None:
            ticket._answered_event.set()
        if session.abandoned is not None:
            self.fail_head_forks(session)
        waiters = ticket.waiters  # FanOut.answer_waiters', inline
        if waiters:
            ticket.waiters = ()
            for waiter in waiters:  # last: a callback may start the connection's next request
                waiter.notify(result, error)
        return True

    @staticmethod
    def fail_head_forks(session: Session) -> None:
        """While an abandoned call runs, forks at the head of the FIFO fail with branch_while_prompt_active."""
        if session.abandoned is None:
            return
        for item in session.fifo:
            if item.settled:
                continue
            if not isinstance(item, ForkTicket):
                return
            item.fail(BranchWhilePromptActiveError(session_id=session.session_id))

    def cancel_prompts(self, session: Session) -> None:
        """Every queued and running prompt of ``session`` ends ``cancelled``; waiting forks fail."""
        for item in list(session.fifo):
            if isinstance(item, PromptTicket):
                self.settle(item, cancelled_result(item), None)
            elif not item.settled:
                item.fail(RequestCancelledError())

    def caller_gone(self, ticket: PromptTicket) -> None:
        """The request that admitted the (unsettled) prompt was cancelled, or its connection closed: the
        prompt is cancelled, unless its connection is gone and another live connection is attached to
        the session (it runs on, and its outcome goes to history)."""
        sender = ticket.sender
        if sender is not None and sender.closed and any(not p.closed for p in ticket.session.attached):
            log.info("%s runs on for the other attached connections of %s", ticket.prompt_id, ticket.session.session_id)
            return
        self.settle(ticket, None, RequestCancelledError())

    # --- deadlines ---------------------------------------------------------------------------------

    def watch_deadline(self, ticket: PromptTicket) -> None:
        """Expire ``ticket`` at its deadline unless it settles first."""
        heapq.heappush(self._deadlines, (ticket.expires_at, ticket.seq, ticket))
        if self._deadlines[0][2] is ticket:
            self._deadline_changed.set()

    async def expire_deadlines(self) -> None:
        """The one timer of the bridge: expires prompts at their deadline, queued or running."""
        heap = self._deadlines
        while True:
            now = trio.current_time()
            while heap and (heap[0][0] <= now or heap[0][2].settled):
                ticket = heapq.heappop(heap)[2]
                if not ticket.settled:
                    self.expire(ticket)
            self._deadline_changed = trio.Event()
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._deadline_changed.wait()

    def expire(self, ticket: PromptTicket) -> None:
        """Settle ``ticket`` with ``prompt_deadline_exceeded``."""
        elapsed = int((trio.current_time() - ticket.admitted_at) * 1000)
        self.settle(
            ticket,
            None,
            PromptDeadlineExceededError(
                session_id=ticket.session.session_id,
                deadline_ms=ticket.deadline_ms,
                elapsed_ms=elapsed,
                prompt_id=ticket.prompt_id,
            ),
        )


class PromptWaiter(Deferred):
    """A request waiting on a prompt's outcome, answered by callback when the prompt settles.

    Args:
        settlement: settles the prompt when its owner goes away.
        ticket: the prompt.
        owner: the request that admitted the prompt (its cancel cancels the prompt); an idempotent
            duplicate is not, and its cancel only ends its own wait.
    """

    __slots__ = ("_done", "_settled", "owner", "settlement", "ticket")

    def __init__(self, settlement: Settlement, ticket: PromptTicket, owner: bool) -> None:
        self.settlement = settlement
        self.ticket = ticket
        self.owner = owner
        self._done: Callable[[Any, AcpError | None], None] | None = None
        self._settled: Callable[[], None] | None = None

    def on_settled(self, settled: Callable[[], None]) -> None:
        """``settled`` runs when the prompt settles and its answer waits for the store's commit."""
        self._settled = settled

    def settled(self) -> None:
        """The prompt settled; its answer waits for the store's commit."""
        settled, self._settled = self._settled, None
        if settled is not None:
            settled()

    def subscribe(self, done: Callable[[Any, AcpError | None], None]) -> None:
        """``done(result, error)`` runs once with the prompt's outcome (now, if it is answered already)."""
        ticket = self.ticket
        if ticket.answered:
            done(ticket.result, ticket.error)
            return
        self._done = done
        if ticket.waiters:
            ticket.waiters.append(self)
        else:
            ticket.waiters = [self]

    def notify(self, result: Any, error: AcpError | None) -> None:
        """Deliver the outcome to the subscriber (once)."""
        done, self._done = self._done, None
        # The shell's callbacks hold the request's slot, which holds this waiter: dropped here, the
        # prompt's objects are freed at once instead of waiting for the cycle collector (a cycle per
        # prompt filled the young generation; collecting them took 50-140 ms at 8 busy sessions).
        self._settled = None
        if done is not None:
            done(result, error)

    def stop(self) -> None:
        """The connection's drain ran out: the prompt ends ``cancelled``, as at shutdown (a duplicate
        only stops waiting)."""
        ticket = self.ticket
        if ticket.settled or self._done is None:
            return
        if self.owner:
            self.settlement.settle(ticket, cancelled_result(ticket), None)
        else:
            self.cancel(connection_lost=False)

    def cancel(self, *, connection_lost: bool) -> None:
        """The request was cancelled (``$/cancel_request``) or its connection closed.

        The owner's cancel cancels the prompt (see :meth:`Settlement.caller_gone`); a request whose
        prompt runs on, or a duplicate, stops waiting: answered ``request_cancelled`` unless its
        connection is gone.
        """
        ticket = self.ticket
        if ticket.settled or self._done is None:
            return
        if self.owner:
            self.settlement.caller_gone(ticket)  # settles (and so notifies us), unless the prompt runs on
            if ticket.settled:
                return
        ticket.waiters.remove(self)  # type: ignore[union-attr]
        if connection_lost:
            self._done = None
        else:
            self.notify(None, RequestCancelledError())
