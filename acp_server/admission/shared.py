"""Admission against limits shared by replicas: the policy's seats, tenant caps, waiting room and backend
pools counted by a :class:`~acp_server.coordinator.Coordinator`, with the refusals the bridge sends.

:class:`SharedAdmission` turns one arrival into one coordinator call (a seat now, else a place in the
waiting room, both with the backend pool's admission slot) and maps a refusal to the error kind the
in-process engine would send, with the cluster's figures:

| full limit | error |
|---|---|
| ``tenant:<id>`` | ``admission_deferred`` (``tenant_limit``) |
| ``room`` (or ``seats`` with no waiting room) | ``capacity_unavailable`` (``queue_full``) |
| ``pool:<backend>`` | ``capacity_exceeded`` (``limit``, ``activeCount``, ``waitingCount``) |
| the coordinator away | ``capacity_unavailable`` (``coordinator_unavailable``, ``retryAfterMs``) |
| this replica draining | ``capacity_unavailable`` (``draining``) |

A :class:`SharedHold` is the prompt's claim: its seat (taken later from the waiting room when it
queued), its backend permits and its release, all on one lease whose fencing token reaches the backend.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Final, Literal

from ..coordinator import Coordinator, CoordinatorUnavailable, Lease, LimitPlan, LimitRefused
from ..errors import AcpError, AdmissionDeferredError, CapacityExceededError, CapacityUnavailableError
from .policy_limits import PolicyLimits, seat_shares
from .policy_queue import rank_of
from .pool import PoolLimits

__all__ = ["SharedAdmission", "SharedHold", "draining_refusal", "shared_plan"]

log = logging.getLogger("acp_server.admission")

#: The retry hint of a shared refusal that has no better estimate (the cluster's drain rate is not known
#: to one replica).
SHARED_RETRY_AFTER_MS: Final = 1000

HoldState = Literal["seated", "queued", "admitted", "released"]


class SharedHold:
    """One admitted prompt's shared lease: its seat (or place in the waiting room) and its pool slot."""

    __slots__ = ("_admission", "backend", "lease", "position_hint", "rank", "state", "tenant")

    def __init__(self, admission: SharedAdmission, lease: Lease, tenant: str, rank: int, backend: str) -> None:
        self._admission = admission
        self.lease = lease
        self.tenant = tenant
        self.rank = rank
        self.backend = backend
        self.state: HoldState = "admitted"
        self.position_hint = 1

    def __repr__(self) -> str:
        return f"<SharedHold {self.state} {self.lease!r}>"

    @property
    def fencing_token(self) -> int:
        """The lease's fencing token (the newest, after a re-take)."""
        return self.lease.token

    @property
    def seated(self) -> bool:
        return self.state == "seated"

    async def take_seat(self) -> None:
        """Wait for a seat (a queued prompt leaves the waiting room in the same step); at once when seated
        or when the plan has no seats.

        Raises:
            RuntimeError: the hold was released (or its lease lost) while it waited.
        """
        if self.state == "seated":
            return
        admission = self._admission
        plan = admission.plan
        if not (plan.seats or plan.tenant_cap(self.tenant)):
            self.state = "seated"
            return
        leave = plan.room_names(self.rank) if self.state == "queued" else ()
        await admission.coordinator.wait_acquire(self.lease, plan.seat(self.tenant, self.rank), rank=self.rank, leave=leave)
        self.state = "seated"

    async def try_permit(self) -> bool:
        """Take one backend call's permit if it is free now (False: full, or the coordinator away)."""
        option = self._admission.plan.permit(self.backend)
        if option is None:
            return True
        try:
            await self._admission.coordinator.acquire(self.lease, option)
        except (LimitRefused, CoordinatorUnavailable):
            return False
        return True

    async def acquire_permit(self) -> None:
        """Wait for one backend call's permit (the pool's ``max_active`` across the cluster)."""
        option = self._admission.plan.permit(self.backend)
        if option is not None:
            await self._admission.coordinator.wait_acquire(self.lease, option, rank=self.rank)

    @property
    def holds_permit(self) -> bool:
        """True while the lease holds one backend call's permit (a
        :class:`~acp_server.backends.base.PermitControl`, as the pool's own lease is)."""
        names = self._admission.plan.permit_names(self.backend)
        holds = self.lease.holds
        return bool(names) and all(name in holds for name in names)

    def release_permit(self) -> None:
        """Give the permit back and keep the lease (a model backend between its retries: it holds no
        seat at the model server while it sleeps a backoff). Never waits: the coordinator sends the
        leave in the background, before this lease's next :meth:`acquire_permit`."""
        names = self._admission.plan.permit_names(self.backend)
        if names and self.state != "released":
            self._admission.coordinator.leave_nowait(self.lease, names)

    def release(self) -> None:
        """Give everything back, exactly once (later calls do nothing); never waits."""
        if self.state == "released":
            return
        self.state = "released"
        self._admission.coordinator.release(self.lease)


class SharedAdmission:
    """The shared part of admission for one replica.

    Args:
        coordinator: where the limits are counted.
        plan: the limits (the same on every replica of the prefix).
        draining: True while the replica is shutting down: nothing new is admitted.
    """

    def __init__(self, coordinator: Coordinator, plan: LimitPlan, draining: Callable[[], bool] | None = None) -> None:
        self.coordinator = coordinator
        self.plan = plan
        self._draining = draining or (lambda: False)

    @property
    def enabled(self) -> bool:
        return self.plan.enabled

    def readiness(self) -> CapacityUnavailableError | None:
        """Why this replica should get no new prompts now, or ``None`` (``/health?ready=1``): it is
        draining, or the coordinator is down in ``closed`` mode (every prompt needing a shared limit
        would be refused). Logs nothing: a load balancer asks often."""
        if self._draining():
            reason = "draining"
        else:
            stats = self.coordinator.statistics()
            if stats.up or stats.failure_mode != "closed" or not self.plan.enabled:
                return None
            reason = "coordinator_unavailable"
        return CapacityUnavailableError(
            reason=reason, retry_after_ms=SHARED_RETRY_AFTER_MS, request_id=f"adm_{secrets.token_hex(8)}",
            safe_to_retry=True,
        )

    async def admit(self, *, tenant: str, priority: str, backend: str, session_id: str, first: bool) -> SharedHold:
        """Admit one prompt in one coordinator call, all or nothing.

        Args:
            first: the prompt arrives at a session with nothing pending (it asks for a seat now, else a
                place in the waiting room); one admitted behind others takes only its pool slot and asks
                for its seat when it reaches the head of its session (it is never refused then).

        Raises:
            AdmissionDeferredError, CapacityUnavailableError, CapacityExceededError: see the module's
                table; nothing was taken.
        """
        rank = rank_of(priority)
        if self._draining():
            raise _unavailable("draining", SHARED_RETRY_AFTER_MS)
        plan = self.plan
        coordinator = self.coordinator
        lease = coordinator.new_lease()
        hold = SharedHold(self, lease, tenant, rank, backend)
        if first:
            options = plan.arrival(tenant, rank, backend)
        else:
            admission = plan.admission(backend)
            if admission is None:
                return hold  # nothing shared to take until its seat
            options = (admission,)
        try:
            taken = await coordinator.acquire(lease, *options)
        except LimitRefused as exc:
            raise self._refusal(exc, tenant, backend, session_id) from None
        except CoordinatorUnavailable as exc:
            raise _unavailable("coordinator_unavailable", exc.retry_after_ms) from None
        if first:
            hold.state = "queued" if taken == 1 else "seated"
        return hold

    def _refusal(self, exc: LimitRefused, tenant: str, backend: str, session_id: str) -> AcpError:
        name = exc.name
        if name.startswith("tenant:"):
            return AdmissionDeferredError(
                reason="tenant_limit", tenant_id=tenant, retry_after_ms=SHARED_RETRY_AFTER_MS, safe_to_retry=True
            )
        if name.startswith("pool:"):
            active = self.plan.pools.get(backend, (exc.cap, 0))[0]
            running = min(exc.count, active)
            return CapacityExceededError(
                backend_id=backend, session_id=session_id, limit=exc.cap, active_count=running,
                waiting_count=exc.count - running, retry_after_ms=SHARED_RETRY_AFTER_MS,
            )
        return _unavailable("queue_full", SHARED_RETRY_AFTER_MS)


def _unavailable(reason: str, retry_after_ms: int) -> CapacityUnavailableError:
    request_id = f"adm_{secrets.token_hex(8)}"
    log.info("admission rejected: %s requestId=%s (shared limits) retryAfterMs=%d", reason, request_id, retry_after_ms)
    return CapacityUnavailableError(
        reason=reason, retry_after_ms=max(1, retry_after_ms), request_id=request_id, safe_to_retry=True
    )


def shared_plan(policy: PolicyLimits, pools: Mapping[str, PoolLimits]) -> LimitPlan:
    """The shared limits of a configuration: the policy's seats (split by its class shares), tenant caps
    and waiting room, and every limited backend pool."""
    seats = policy.max_running_prompts
    return LimitPlan(
        seats=seats,
        shares=seat_shares(seats, policy.class_shares) if seats else (),
        room=policy.max_queued_prompts if seats else 0,
        tenant_max_running=policy.tenant_max_running,
        tenant_overrides=policy.tenant_overrides,
        pools={name: (p.max_active, p.max_waiting) for name, p in pools.items() if p.max_active is not None},
    )


def draining_refusal() -> CapacityUnavailableError:
    """The refusal of a prompt arriving while the replica drains for a restart."""
    return _unavailable("draining", SHARED_RETRY_AFTER_MS)
