"""Admission control: the limits and the per-backend capacity pools (policy comes later). Knows nothing of JSON-RPC."""

from .limits import Limits, check_non_negative_int, check_positive_int
from .pool import CapacityManager, CapacityPool, Lease, Permit, PoolLimits, PoolStatistics

__all__ = [
    "CapacityManager",
    "CapacityPool",
    "Lease",
    "Limits",
    "Permit",
    "PoolLimits",
    "PoolStatistics",
    "check_non_negative_int",
    "check_positive_int",
]
