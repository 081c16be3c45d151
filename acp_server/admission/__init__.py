"""Admission control: the limits, the per-backend capacity pools and the admission policy engine. Knows nothing of JSON-RPC."""

from .limits import Limits, check_non_negative_int, check_positive_int
from .policy import (
    ClassStatistics,
    PolicyEngine,
    PolicyLimits,
    PolicyStatistics,
    Queued,
    Seat,
    WaitDeadlineExpired,
)
from .pool import CapacityManager, CapacityPool, Lease, Permit, PoolLimits, PoolStatistics

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
