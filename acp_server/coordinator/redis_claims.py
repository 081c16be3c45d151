"""The Redis coordinator's calls beside the leases: idempotency claims, fencing checks, the cluster readout.

:class:`RedisClaims` adds them to :class:`~acp_server.coordinator.redis_wire.RedisWire`; a claim while
Redis is away is refused (``failure="closed"``) or taken in this replica's own table (``failure="local"``).
:class:`~acp_server.coordinator.redis.RedisCoordinator` builds on it.
"""

from __future__ import annotations

import trio

from .base import ClaimResult, ClusterStatistics
from .local import LocalCoordinator
from .readout import cluster_statistics
from .redis_wire import RedisWire, _Down

__all__ = ["RedisClaims"]


class RedisClaims(RedisWire):
    """Idempotency claims, fencing checks and the cluster's figures, over the wire's calls."""

    #: this replica's own table: it takes the claims while Redis is away (``failure="local"``), and a
    #: settled claim is settled there too
    _local: LocalCoordinator

    async def claim(self, session_id: str, key: str, fingerprint: str, prompt_id: str, ttl_s: float) -> ClaimResult:
        """See :meth:`~acp_server.coordinator.base.Coordinator.claim`."""
        if not self._up:
            if self._failure == "local":
                return await self._local.claim(session_id, key, fingerprint, prompt_id, ttl_s)
            raise self._unavailable()
        ttl_ms = max(1, round(ttl_s * 1000))
        try:
            result = await self._call(
                "claim", [self.keys.claim(session_id, key)], [fingerprint, self._replica_id, ttl_ms, prompt_id]
            )
        except _Down:
            raise self._unavailable() from None
        if int(result[0]) == 1:
            return ClaimResult(
                claimed=True, fingerprint=fingerprint, replica_id=self._replica_id, state="running",
                prompt_id=prompt_id, ttl_ms=ttl_ms,
            )
        text = [v.decode() if isinstance(v, bytes) else str(v) for v in result[1:5]]
        return ClaimResult(
            claimed=False, fingerprint=text[0], replica_id=text[1], state=text[2], prompt_id=text[3],
            ttl_ms=max(0, int(result[5])),
        )

    async def settle_claim(self, session_id: str, key: str, prompt_id: str, *, drop: bool) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.settle_claim`."""
        try:
            await self._call(
                "settle_claim", [self.keys.claim(session_id, key)], [self._replica_id, prompt_id, "drop" if drop else "done"]
            )
        except _Down:
            pass  # the claim expires with its TTL
        await self._local.settle_claim(session_id, key, prompt_id, drop=drop)

    async def fence_valid(self, lease_id: str, token: int) -> bool:
        """True when ``lease_id`` is live in Redis with fencing token ``token`` (for a downstream's check)."""
        assert self._client is not None
        with trio.fail_after(self._timeout_s):
            value = await self._client.get(self.keys.lease(lease_id))
        return value is not None and value.split(b"|", 1)[0] == str(token).encode()

    async def cluster(self) -> ClusterStatistics:
        """See :meth:`~acp_server.coordinator.base.Coordinator.cluster`."""
        assert self._client is not None
        with trio.fail_after(max(self._timeout_s, 2.0)):
            return await cluster_statistics(self._client, self.keys, self._ttl_ms)
