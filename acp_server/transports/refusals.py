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
next requests wait unstarted until the refill pays the debt (its notifications, ``session/cancel``,
still run at once), and once long in debt it is sent ``_acp_server/evicted {reason:
"ignored_retry_after"}`` and closed. Accepted requests pay nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ..errors import OverloadError
from ..jsonrpc import Connection
from .outbox import Outbox
from .refusal_budget import RefusalBudget, RefusalBudgetSettings

if TYPE_CHECKING:
    from .inflight import Slot

__all__ = ["RefusalGuard"]

log = logging.getLogger("acp_server.connection")


class RefusalGuard(Outbox):
    """The overload refusals of one connection: timing, counts by kind, and the peer's refusal budget.

    Its slots are set by :class:`~.shell.ConnectionShell`'s ``__init__``.
    """

    __slots__ = (
        "_budget_settings",
        "_refusal_kinds",
        "_resume_at",
        "_run_cap",
        "refusal_budget",
    )

    # set by ConnectionShell.__init__, which says what each holds
    _budget_settings: RefusalBudgetSettings | None
    _refusal_kinds: dict[str, int] | None
    refusal_budget: RefusalBudget | None
    _run_cap: int
    _resume_at: float
    # provided by the subclass (the request dispatch)
    _handlers: trio.Nursery | None
    max_inflight: int
    _start_waiting: Callable[[], None]

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
        """Start none of the peer's requests before ``until`` (its refusal budget is in debt): they wait
        unstarted, as past ``max_inflight_requests``; its notifications (``session/cancel``) still run."""
        self._resume_at = max(self._resume_at, until)
        if self._run_cap and self._handlers is not None and not self._closed:
            self._run_cap = 0
            self._handlers.start_soon(self._resume_requests)

    async def _resume_requests(self) -> None:
        while trio.current_time() < self._resume_at:  # noqa: ASYNC110 - the deadline moves on with each refusal
            await trio.sleep_until(self._resume_at)
        self._run_cap = self.max_inflight
        self._resume_at = 0.0
        self._start_waiting()
