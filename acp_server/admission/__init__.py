"""Admission control: the limits, the per-backend capacity pools and the admission policy engine. Knows nothing of JSON-RPC.

The names below load with their module on first use (PEP 562), so the command line reads the
defaults of :class:`Limits` and :class:`PolicyLimits` without importing the engine and trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .limits import Limits, check_non_negative_int, check_positive_int
    from .policy import PolicyEngine, Queued, Seat, WaitDeadlineExpired
    from .policy_limits import ClassStatistics, PolicyLimits, PolicyStatistics
    from .pool import CapacityManager, CapacityPool, Lease, Permit, PoolLimits, PoolStatistics

#: Each public name -> the module that defines it.
_HOMES = {
    "Limits": ".limits",
    "check_non_negative_int": ".limits",
    "check_positive_int": ".limits",
    "ClassStatistics": ".policy_limits",
    "PolicyEngine": ".policy",
    "PolicyLimits": ".policy_limits",
    "PolicyStatistics": ".policy_limits",
    "Queued": ".policy",
    "Seat": ".policy",
    "WaitDeadlineExpired": ".policy",
    "CapacityManager": ".pool",
    "CapacityPool": ".pool",
    "Lease": ".pool",
    "Permit": ".pool",
    "PoolLimits": ".pool",
    "PoolStatistics": ".pool",
}

__all__ = [
    "CapacityManager",
    "CapacityPool",
    "ClassStatistics",
    "Lease",
    "Limits",
    "Permit",
    "PolicyEngine",
    "PolicyLimits",
    "PolicyStatistics",
    "PoolLimits",
    "PoolStatistics",
    "Queued",
    "Seat",
    "WaitDeadlineExpired",
    "check_non_negative_int",
    "check_positive_int",
]


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)

