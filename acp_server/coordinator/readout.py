"""Reading the cluster's state out of Redis for people: every limit's live holders and every replica's
last renewal (``acp-server cluster``, ``_acp_server/stats``). Not atomic: a snapshot, and it takes nothing.
"""

from __future__ import annotations

from typing import Final

import coredis
import trio
from coredis.retry import NoRetryPolicy

from .base import ClusterStatistics, LimitCount, ReplicaInfo
from .scripts import Keys

__all__ = ["cluster_statistics", "read_cluster", "redis_now_ms"]

_NOW_LUA: Final = "local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000)"


async def redis_now_ms(client: coredis.Redis[bytes]) -> int:
    """Redis' clock in ms, the one lease expiries are scored in (coredis' ``time()`` drops the
    microseconds' leading digits, so it is read through a script)."""
    value = await client.eval(_NOW_LUA)
    assert isinstance(value, int), value
    return value


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def cluster_statistics(client: coredis.Redis[bytes], keys: Keys, ttl_ms: int) -> ClusterStatistics:
    """Every limit's live holders and every replica's last renewal, read from Redis (not atomic: a
    snapshot for people). A replica counts as live when it renewed within ``ttl_ms``."""
    now = await redis_now_ms(client)
    caps = await client.hgetall(keys.caps)
    limits = []
    for key, cap in sorted(caps.items()):
        count = await client.zcount(key, f"({now}", "+inf")
        limits.append(LimitCount(name=keys.limit_name(_text(key)), cap=int(cap), count=count))
    replicas = []
    for member, score in await client.zrange(keys.replicas, 0, -1, withscores=True):
        ago = max(0, round(now - float(score)))
        replicas.append(ReplicaInfo(replica_id=_text(member), last_renew_ms_ago=ago, live=ago <= ttl_ms))
    return ClusterStatistics(prefix=keys.prefix, replicas=replicas, limits=limits)


async def read_cluster(url: str, prefix: str, *, lease_ttl_s: float = 30.0, timeout_s: float = 2.0) -> ClusterStatistics:
    """:func:`cluster_statistics` over a connection of its own (``acp-server cluster``): registers no
    replica and takes nothing.

    Raises:
        trio.TooSlowError: Redis did not answer within ``timeout_s``.
        coredis.exceptions.RedisError, OSError: the connection failed.
    """
    client: coredis.Redis[bytes] = coredis.Redis.from_url(
        url, connect_timeout=timeout_s, retry_policy=NoRetryPolicy(), verify_version=False
    )
    with trio.fail_after(timeout_s):
        async with client:
            return await cluster_statistics(client, Keys(prefix), round(lease_ttl_s * 1000))
