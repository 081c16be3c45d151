"""The admission policy's bounds and statistics: :class:`PolicyLimits`, the frozen
:class:`PolicyStatistics` snapshot and its parts, and :func:`seat_shares` (how seats split by class).

Plain data, no clock and no trio: :mod:`.policy` is the engine that reads them.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import msgspec

from .limits import check_non_negative_int
from .policy_queue import PRIORITIES

__all__ = [
    "DECISION_KEYS",
    "DEFAULT_CLASS_SHARES",
    "QUEUE_WAIT_BOUNDS",
    "RETRY_AFTER_MAX_MS",
    "RETRY_AFTER_MIN_MS",
    "ClassStatistics",
    "Mode",
    "PolicyLimits",
    "PolicyStatistics",
    "Reason",
    "TenantStatistics",
    "WaitHistogram",
    "seat_shares",
]

#: Default shares of the global seats, in percent.
DEFAULT_CLASS_SHARES: Final[dict[str, float]] = {"critical": 10, "interactive": 60, "background": 25, "bulk": 5}
#: The bounds of every ``retryAfterMs`` the engine serves.
RETRY_AFTER_MIN_MS: Final = 1000
RETRY_AFTER_MAX_MS: Final = 32000
#: Upper bounds (seconds) of the queue-wait histogram's buckets; the last one catches everything.
QUEUE_WAIT_BOUNDS: Final[tuple[float, ...]] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf,
)

Mode = Literal["enforce", "observe"]
Reason = Literal["tenant_limit", "queue_full", "deadline_unreachable", "wait_too_long"]

#: The keys of :attr:`PolicyStatistics.decisions`: ``outcome`` or ``outcome.reason``.
DECISION_KEYS: Final = (
    "run",
    "queued",
    "deferred.tenant_limit",
    "rejected.queue_full",
    "rejected.deadline_unreachable",
    "rejected.wait_too_long",
)


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds (0 turns it off); got {value!r}")


class PolicyLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of the admission policy. Every limit defaults to off.

    Attributes:
        max_running_prompts: prompts running at once across the server (0: no global seats).
        max_queued_prompts: prompts waiting for a seat, decided at arrival (0: no waiting room);
            only used with ``max_running_prompts``.
        tenant_max_running: seats one tenant holds at once (0: no cap).
        tenant_overrides: tenant id -> its own cap instead of ``tenant_max_running`` (0: no cap).
        class_shares: priority class -> its share of the seats (any positive scale, e.g. percent);
            a class left out has no share and only borrows idle seats.
        interactive_max_wait_ms: the longest estimated wait an interactive prompt is queued for (0: any).
        aging_s: seconds of waiting that move a background or bulk waiter up one rank (0: no aging).
        min_deadline_left_ms: a prompt with a deadline starts only with this much of it left, and a
            waiter leaves the queue when less remains.
        mode: ``"enforce"``, or ``"observe"`` to admit everything and only count what would happen.
    """

    max_running_prompts: int = 0
    max_queued_prompts: int = 200
    tenant_max_running: int = 0
    tenant_overrides: dict[str, int] = msgspec.field(default_factory=dict)
    class_shares: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASS_SHARES))
    interactive_max_wait_ms: int = 2000
    aging_s: float = 30.0
    min_deadline_left_ms: int = 100
    mode: Mode = "enforce"

    def __post_init__(self) -> None:
        check_non_negative_int("max_running_prompts", self.max_running_prompts)
        check_non_negative_int("max_queued_prompts", self.max_queued_prompts, zero="0 means no waiting room")
        check_non_negative_int("tenant_max_running", self.tenant_max_running)
        for tenant, cap in self.tenant_overrides.items():
            if not isinstance(tenant, str):
                raise TypeError(f"tenant_overrides keys must be tenant id strings; got {tenant!r}")
            check_non_negative_int(f'tenant_overrides["{tenant}"]', cap)
        check_non_negative_int("interactive_max_wait_ms", self.interactive_max_wait_ms)
        check_non_negative_int("min_deadline_left_ms", self.min_deadline_left_ms, zero="0 means any time left")
        _check_seconds("aging_s", self.aging_s)
        for name, share in self.class_shares.items():
            if name not in PRIORITIES:
                raise ValueError(f"class_shares keys must be among {', '.join(PRIORITIES)}; got {name!r}")
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0 or math.isinf(share):
                raise ValueError(f'class_shares["{name}"] must be a non-negative number; got {share!r}')
        if not sum(self.class_shares.values()) > 0:
            raise ValueError("class_shares must give at least one class a positive share")
        if self.mode not in ("enforce", "observe"):
            raise ValueError(f'mode must be "enforce" or "observe"; got {self.mode!r}')

    @property
    def enabled(self) -> bool:
        """True when anything is limited; False makes the engine a no-op fast path."""
        return bool(self.max_running_prompts or self.tenant_max_running or any(self.tenant_overrides.values()))

    def tenant_cap(self, tenant: str) -> int:
        """The seats ``tenant`` may hold at once (0: no cap)."""
        return self.tenant_overrides.get(tenant, self.tenant_max_running)


def seat_shares(seats: int, shares: dict[str, float]) -> tuple[int, ...]:
    """Split ``seats`` by ``shares`` with largest-remainder rounding, in rank order (critical first).

    The parts sum to ``seats``; remainders that tie go to the higher-ranked class.
    """
    from fractions import Fraction  # exact shares, only when seats are split (--max-running-prompts)

    weights = [Fraction(shares.get(name, 0)) for name in PRIORITIES]
    total = sum(weights)
    exact = [seats * w / total for w in weights]
    parts = [math.floor(q) for q in exact]
    by_remainder = sorted(range(len(PRIORITIES)), key=lambda r: (-(exact[r] - parts[r]), r))
    for rank in by_remainder[: seats - sum(parts)]:
        parts[rank] += 1
    return tuple(parts)


class ClassStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One priority class in :class:`PolicyStatistics`.

    Attributes:
        share: its seats when all classes are busy (0 without global seats).
        running: seats it holds now (aged waiters count in the class they were granted in).
        waiting: prompts waiting in it now (aged waiters count in the class they climbed to).
        oldest_wait_ms: how long its oldest waiter has waited (0: nobody waits).
    """

    share: int
    running: int
    waiting: int
    oldest_wait_ms: int


class WaitHistogram(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds waited for a seat by the waiters granted in one class (Prometheus-style, cumulative).

    Attributes:
        buckets: ``[upper bound in seconds, waiters granted within it]``, the last bound ``inf``.
        sum: seconds waited in all; count: waiters granted.
    """

    buckets: list[tuple[float, int]]
    sum: float
    count: int


class TenantStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant in :class:`PolicyStatistics`: the seats it holds and its prompts waiting."""

    running: int
    waiting: int


class PolicyStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A snapshot of the engine, like ``trio.CapacityLimiter.statistics()``.

    Attributes:
        enabled: anything is limited (False: every other figure stays 0).
        mode: ``"enforce"`` or ``"observe"``.
        max_running_prompts: the global seats (0: none).
        running: seats held now; waiting: prompts in the waiting room now.
        tenants_running: tenants holding at least one seat.
        classes: per priority class, by name.
        decisions: arrival decisions by :data:`DECISION_KEYS` (in observe mode: what would have happened).
        admitted_total: prompts given a seat or a ticket (decided "run" or "queued", and every enqueue).
        granted_total, released_total: seats handed out and given back.
        expired_total: waiters removed because their deadline ran out; cancelled_total: waiters that left.
        retry_after_served: refusals sent with a ``retryAfterMs``; retry_after_ms_total: the sum of those.
        queue_wait: per class, how long its granted waiters waited.
        tenants: per tenant holding a seat or waiting: its seats and waiters (for metrics with tenant labels).
    """

    enabled: bool
    mode: str
    max_running_prompts: int
    running: int
    waiting: int
    tenants_running: int
    classes: dict[str, ClassStatistics]
    decisions: dict[str, int]
    admitted_total: int
    granted_total: int
    released_total: int
    expired_total: int
    cancelled_total: int
    retry_after_served: int
    retry_after_ms_total: int
    queue_wait: dict[str, WaitHistogram]
    tenants: dict[str, TenantStatistics]
