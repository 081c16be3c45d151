"""The coordinator's settings (flags and the ``[coordinator]`` table), and ``acp-server cluster``'s report.

    [coordinator]
    url = "redis://127.0.0.1:6379/0"   # or rediss:// (TLS); absent: limits are this process's own
    prefix = "acp-server"              # the hash tag of every key: replicas sharing it share limits
    replica_id = "web-1"               # default host:pid
    failure = "closed"                 # or "local": admit against ceil(limit / N) while Redis is away
    expected_replicas = 0              # N of the local share (0: the live replicas last seen)
    lease_ttl_s = 30                   # leases are renewed every third of it
    timeout_ms = 500                   # a call unanswered this long means Redis is away
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from .base import ClusterStatistics, FailureMode
from .local import default_replica_id

__all__ = ["CoordinatorSettings", "format_cluster"]

#: Each setting's flag, for error messages.
FLAGS = {
    "url": "--coordinator",
    "prefix": "--coordinator-prefix",
    "replica_id": "--replica-id",
    "failure": "--coordinator-failure",
    "expected_replicas": "--expected-replicas",
    "lease_ttl_s": "--lease-ttl-s",
    "timeout_ms": "--coordinator-timeout-ms",
}


class CoordinatorSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the shared limits live and how a replica treats them. ``url`` ``None``: not shared.

    Raises:
        ValueError: on construction, a bad value; the message starts with the setting's flag.
    """

    url: str | None = None
    prefix: str = "acp-server"
    replica_id: str | None = None
    failure: Literal["closed", "local"] = "closed"
    expected_replicas: int = 0
    lease_ttl_s: float = 30.0
    timeout_ms: int = 500

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://")):
            raise ValueError(f"--coordinator must be a redis://HOST:PORT/DB or rediss:// URL; got {self.url!r}")
        if not self.prefix or any(c in self.prefix for c in "{}"):
            raise ValueError(f"--coordinator-prefix must be a non-empty string without braces; got {self.prefix!r}")
        if self.replica_id is not None and not self.replica_id.strip():
            raise ValueError("--replica-id must not be empty")
        if self.failure not in ("closed", "local"):
            raise ValueError(f'--coordinator-failure must be "closed" or "local"; got {self.failure!r}')
        if isinstance(self.expected_replicas, bool) or self.expected_replicas < 0:
            raise ValueError(
                f"--expected-replicas must be a non-negative integer (0: the live replicas); got {self.expected_replicas!r}"
            )
        ttl = self.lease_ttl_s
        if isinstance(ttl, bool) or math.isnan(ttl) or math.isinf(ttl) or ttl < 0.5:
            raise ValueError(f"--lease-ttl-s must be a number of seconds of at least 0.5; got {ttl!r}")
        if isinstance(self.timeout_ms, bool) or self.timeout_ms < 1:
            raise ValueError(f"--coordinator-timeout-ms must be a positive integer; got {self.timeout_ms!r}")

    @property
    def shared(self) -> bool:
        """True when a coordinator URL is set."""
        return self.url is not None

    @property
    def failure_mode(self) -> FailureMode:
        return self.failure

    def effective_replica_id(self) -> str:
        return self.replica_id or default_replica_id()


def format_cluster(stats: ClusterStatistics) -> str:
    """``acp-server cluster``'s text: the replicas, then every limit with its count and cap."""
    lines = [f"prefix {stats.prefix}", "", "replicas:"]
    if not stats.replicas:
        lines.append("  (none)")
    for r in sorted(stats.replicas, key=lambda r: r.replica_id):
        state = "live" if r.live else "gone"
        lines.append(f"  {r.replica_id:<32} {state:<5} last renew {r.last_renew_ms_ago} ms ago")
    groups = (("seats", "seats"), ("tenants", "tenant:"), ("waiting room", "room"), ("backend pools", "pool:"))
    for title, head in groups:
        rows = [x for x in stats.limits if x.name.startswith(head)]
        if not rows:
            continue
        lines += ["", f"{title}:"]
        for x in rows:
            cap = str(x.cap) if x.cap else "-"
            lines.append(f"  {x.name:<32} {x.count:>6} / {cap}")
    return "\n".join(lines) + "\n"
