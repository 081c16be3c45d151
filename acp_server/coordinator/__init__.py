"""Shared limits: one Protocol, a local implementation and a Redis one. Knows no sessions or JSON-RPC.

The bridge (through admission) asks a :class:`Coordinator` for leases on named limits; it never calls
back. :func:`open_coordinator` picks the implementation from a URL, importing ``coredis`` only for
Redis, so a server without ``--coordinator`` never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (
    ClaimResult,
    ClassRule,
    ClusterStatistics,
    Coordinator,
    CoordinatorStatistics,
    CoordinatorUnavailable,
    FailureMode,
    Lease,
    LimitCount,
    LimitRefused,
    Need,
    Option,
    ReplicaInfo,
    local_share,
)
from .local import LocalCoordinator, default_replica_id
from .plan import LimitPlan

if TYPE_CHECKING:
    from .redis import RedisCoordinator

__all__ = [
    "ClaimResult",
    "ClassRule",
    "ClusterStatistics",
    "Coordinator",
    "CoordinatorStatistics",
    "CoordinatorUnavailable",
    "FailureMode",
    "Lease",
    "LimitCount",
    "LimitPlan",
    "LimitRefused",
    "LocalCoordinator",
    "Need",
    "Option",
    "ReplicaInfo",
    "default_replica_id",
    "local_share",
    "redis_coordinator",
]


def redis_coordinator(
    url: str,
    *,
    prefix: str = "acp-server",
    replica_id: str | None = None,
    lease_ttl_s: float = 30.0,
    timeout_ms: int = 500,
    failure: FailureMode = "closed",
    expected_replicas: int = 0,
) -> RedisCoordinator:
    """A :class:`~acp_server.coordinator.redis.RedisCoordinator` (``coredis`` is imported here, once).

    Raises:
        ValueError: a bad URL, prefix, TTL, timeout or failure mode (the message names the flag).
    """
    from .redis import RedisCoordinator

    return RedisCoordinator(
        url, prefix=prefix, replica_id=replica_id, lease_ttl_s=lease_ttl_s, timeout_ms=timeout_ms,
        failure=failure, expected_replicas=expected_replicas,
    )
