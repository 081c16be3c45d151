"""How a connection answers overload refusals: timed, counted, and charged to the peer's budget.

:class:`RefusalGuard` sits between the output side (:class:`~.outbox.Outbox`, its base) and the
request dispatch of :class:`~.shell.ConnectionShell` (its subclass, which hands it every error answer
through ``_reply_error``, and provides ``_start_waiting``, ``_handlers`` and ``max_inflight``).

Refusal timing: given a :class:`~.timing.LatencyHistogram`, the shell records how long each overload
refusal (an :class:`~acp_server.errors.OverloadError`: ``prompt_queue_full``, ``capacity_exceeded``,
``admission_deferred``, ``capacity_unavailable``) took from the moment the reader handed its request to
dispatch to the moment the writer's ``send_all`` carrying the error returned. The request is stamped
when it is read; the answer path pays only for errors (a type check), results pay nothing more.
Refusals inside a batch are answered in the batch's array and not timed.

Refusal budget: each overload refusal also spends from the peer's own budget
(:mod:`.refusal_budget`); a peer that spends it by re-sending what it was told to hold off has its
next requests on held scopes *parked*: they wait unstarted, by session, until the refill pays the debt
or until one of its admitted prompts on that session ends (room for the oldest parked one); its other
requests and its notifications (``session/cancel``) still run at once; a ``session/cancel`` answers the
session's prompts that wait unstarted (parked, or past the in-flight cap) ``stopReason: "cancelled"``
at once, as the bridge answers its queued ones. Once long in debt it is sent
``_acp_server/evicted {reason: "ignored_retry_after"}`` and closed. Accepted requests pay nothing, and
a connection never in debt pays one float test per request started.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..errors import OverloadError
from ..jsonrpc import Connection, Request, encode_result
from ..types.acp import PromptResult
from .outbox import Outbox
from .refusal_budget import RefusalBudget, RefusalBudgetSettings, session_of

if TYPE_CHECKING:
    from .inflight import Slot

__all__ = ["RefusalGuard"]

log = logging.getLogger("acp_server.connection")

#: the answer of a prompt that a ``session/cancel`` ended before it started (it has no prompt id)
_CANCELLED = PromptResult(stop_reason="cancelled")


class RefusalGuard(Outbox):
    """The overload refusals of one connection: timing, counts by kind, and the peer's refusal budget.

    Its slots are set by :class:`~.shell.ConnectionShell`'s ``__init__``.
    """

    __slots__ = (
        "_budget_settings",
        "_parked",
        "_parked_count",
        "_refusal_kinds",
        "_resume_at",
        "_rooms",
        "refusal_budget",
    )

    # set by ConnectionShell.__init__, which says what each holds
    _budget_settings: RefusalBudgetSettings | None
    _refusal_kinds: dict[str, int] | None
    refusal_budget: RefusalBudget | None
    _resume_at: float
    #: in debt: the requests parked on held scopes, by the session they name (``None``: none), oldest first
    _parked: dict[str | None, list[Request]] | None
    _parked_count: int
    #: sessions where room opened, still to start a parked request each (``None``: no wake-up under way)
    _rooms: list[str | None] | None
    # provided by the subclass (the request dispatch)
    _handlers: trio.Nursery | None
    _slots: dict[Any, Slot]
    _waiting: list[Request]
    _inflight: int
    _finished_unanswered: int
    max_inflight: int
    _start_waiting: Callable[[], None]
    _start: Callable[[Request, Slot, Callable[[bytes], None]], None]
    _slot_done: Callable[[], None]

    def _reply_error(self, data: bytes, slot: Slot, reply: Callable[[bytes], None]) -> None:
        """Queue an error answer; an overload refusal is timed until its bytes are written, and spends
        from the peer's refusal budget (evicted once it is spent)."""
        error = getattr(data, "error", None)
        if not isinstance(error, OverloadError):
            reply(data)
            return
        if self._refusal_kinds is not None:
            self._refusal_kinds[error.kind] = self._refusal_kinds.get(error.kind, 0) + 1
        if self._refusal_latency is not None and reply == self.reply and not self.evicted:
            self._refusals_queued.append(slot.read_ns)
        reply(data)
        if self._budget_settings is not None:
            self._spend(error)

    def _spend(self, error: OverloadError) -> None:
        """Charge one hold-off refusal to this peer's budget (made at its first refusal): in debt, its
        requests wait unstarted for a while; long in debt, the peer is evicted."""
        now = trio.current_time()
        budget = self.refusal_budget
        if budget is None:
            assert self._budget_settings is not None
            budget = self.refusal_budget = RefusalBudget(self._budget_settings, now)
        pause = budget.charge(error, now)
        if not pause:
            return
        if pause < math.inf:
            self._pause_requests(now + pause)
        elif not self.evicted:
            log.warning("%s: evicting a peer that ignored retryAfterMs: %s", self.name, budget.evicted_params())
            self.evicted = True
            self._enqueue(Connection.send_notification("_acp_server/evicted", budget.evicted_params()))
            self.close()

    def _pause_requests(self, until: float) -> None:
        """Until ``until`` (the refusal budget is in debt), park the peer's requests on the scopes it
        was told to hold off (:meth:`_park`); its other requests and its notifications still run."""
        first = not self._resume_at
        self._resume_at = max(self._resume_at, until)
        if first and self._handlers is not None and not self._closed:
            self._handlers.start_soon(self._resume_requests)

    def _park(self, req: Request) -> bool:
        """While in debt, whether ``req`` waits unstarted (parked): it names a session held off (or a
        kind is held), or one whose earlier requests are parked (a session's order is kept)."""
        key = session_of(req.params)
        parked = self._parked
        if parked is None:
            parked = self._parked = {}
        queue = parked.get(key)
        if queue is None:
            budget = self.refusal_budget
            if budget is None or not budget.holds_off(key, trio.current_time()):
                return False
            queue = parked[key] = []
        queue.append(req)
        self._parked_count += 1
        return True

    def _take_unstarted_prompts(self, session_id: str | None) -> list[Request]:
        """Before a ``session/cancel`` of ``session_id`` is dispatched: take out its ``session/prompt``
        requests still unstarted here (parked in debt, or waiting for the in-flight cap), in the order
        sent, so that the room the cancel opens does not start them; :meth:`_answer_cancelled` answers
        them once the cancel has run. The session's other requests keep their place."""
        gone: list[Request] = []
        if session_id is None:
            return gone
        parked = self._parked
        queue = parked.get(session_id) if parked else None
        if queue is not None:
            keep = [req for req in queue if req.method != "session/prompt"]
            gone += [req for req in queue if req.method == "session/prompt"]
            self._parked_count -= len(gone)
            if keep:
                queue[:] = keep
            else:
                del parked[session_id]  # type: ignore[union-attr]
        waiting = self._waiting
        if waiting:
            mine = [req for req in waiting if req.method == "session/prompt" and session_of(req.params) == session_id]
            if mine:
                waiting[:] = [req for req in waiting if req not in mine]
                gone += mine
                slots = self._slots
                gone.sort(key=lambda req: slots[req.id].read_ns)  # stable: a read's requests keep their order
        if gone and self._rooms is None:
            self._rooms = []  # the room the cancel opens starts the next parked request after these answers
        return gone

    def _answer_cancelled(self, gone: list[Request]) -> None:
        """The prompts :meth:`_take_unstarted_prompts` took were sent before the cancel: they end as the
        bridge's queued prompts did, ``stopReason: "cancelled"``, each answered once, and never run."""
        for req in gone:
            del self._slots[req.id]
            self.reply(encode_result(req.id, _CANCELLED))
        self._slot_done()
        rooms = self._rooms
        if rooms is None:
            return
        try:
            while rooms:
                self._unpark(rooms.pop(0))
        finally:
            self._rooms = None

    def _room_in(self, req: Request) -> None:
        """One of the peer's admitted requests (``req``) has its answer while requests are parked: its
        session has room for one more, so the oldest parked request naming it starts now."""
        rooms = self._rooms
        if rooms is not None:  # a wake-up under way (its start answered at once): it takes this one too
            rooms.append(session_of(req.params))
            return
        rooms = self._rooms = [session_of(req.params)]
        try:
            while rooms:
                self._unpark(rooms.pop(0))
        finally:
            self._rooms = None

    def _unpark(self, key: str | None) -> bool:
        """Start the oldest request parked on ``key``, if any and if the run cap allows; whether one started."""
        parked = self._parked
        if not parked or self._closed or self._inflight - self._finished_unanswered >= self.max_inflight:
            return False
        queue = parked.get(key)
        if queue is None:
            return False
        req = queue.pop(0)
        if not queue:
            del parked[key]
        self._parked_count -= 1
        self._start(req, self._slots[req.id], self.reply)
        return True

    async def _resume_requests(self) -> None:
        """At the end of a wait (the debt paid back) start the parked requests, a session's oldest
        after another's, until one is refused again (a new wait) or none is left; then the rest wait."""
        while trio.current_time() < self._resume_at:  # noqa: ASYNC110 - the deadline moves on with each refusal
            await trio.sleep_until(self._resume_at)
        self._resume_at = 0.0
        while (
            self._parked
            and not self._resume_at
            and not self._closed
            and self._inflight - self._finished_unanswered < self.max_inflight
        ):
            for key in list(self._parked):
                if self._resume_at:
                    break
                self._unpark(key)
        parked = self._parked
        if parked and not self._resume_at:
            # Out of debt, what the run cap held back waits as any request past it, ahead of those read
            # after it (each was parked when it reached the head of that queue).
            self._waiting[:0] = [req for queue in parked.values() for req in queue]
            parked.clear()
            self._parked_count = 0
        if not parked:
            self._parked = None  # an emptied dict keeps its table
        self._start_waiting()
