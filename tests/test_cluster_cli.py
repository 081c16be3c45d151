"""``acp-server cluster`` against a real Redis, and the ``[coordinator]`` table and flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

from acp_server.config import ConfigError, parse_config
from acp_server.coordinator import LimitPlan
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.coordinator.settings import CoordinatorSettings

from .redis_server import RedisServer, redis_server  # noqa: F401


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_server", "cluster", *args], capture_output=True, text=True, timeout=60
    )


async def test_cluster_prints_replicas_seats_pools_and_the_room(redis_server: RedisServer) -> None:  # noqa: F811
    plan = LimitPlan(seats=2, shares=(0, 2, 0, 0), room=3, tenant_max_running=3, pools={"echo": (2, 4)})
    a = RedisCoordinator(redis_server.url, prefix="c", replica_id="web-1")
    b = RedisCoordinator(redis_server.url, prefix="c", replica_id="web-2")
    async with a.running(), b.running():
        for coord in (a, b, a):
            await coord.acquire(coord.new_lease(), *plan.arrival("acme", 1, "echo"))
        text = (await trio.to_thread.run_sync(_cluster, "--coordinator", redis_server.url, "--coordinator-prefix", "c"))
        as_json = await trio.to_thread.run_sync(
            _cluster, "--coordinator", redis_server.url, "--coordinator-prefix", "c", "--json"
        )
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "web-1" in out and "web-2" in out and "live" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert lines["seats"][:3] == ["2", "/", "2"]
    assert lines["room"][:3] == ["1", "/", "3"]
    assert lines["pool:echo"][:3] == ["3", "/", "6"]
    assert lines["tenant:acme"][:3] == ["2", "/", "3"]
    stats = json.loads(as_json.stdout)
    assert {r["replicaId"] for r in stats["replicas"]} == {"web-1", "web-2"}


def test_cluster_needs_a_coordinator_and_reports_an_unreachable_one() -> None:
    missing = _cluster()
    assert missing.returncode == 2 and "--coordinator" in missing.stderr
    bad = _cluster("--coordinator", "http://x")
    assert bad.returncode == 2 and "redis://" in bad.stderr
    away = _cluster("--coordinator", "redis://127.0.0.1:1/0", "--coordinator-timeout-ms", "200")
    assert away.returncode == 1 and "cannot read" in away.stderr


def test_the_coordinator_table_is_checked() -> None:
    cfg = parse_config('[coordinator]\nurl = "redis://127.0.0.1:6379/0"\nfailure = "local"\nlease_ttl_s = 9\n')
    assert CoordinatorSettings(**cfg.coordinator.given()).failure == "local"
    with pytest.raises(ConfigError, match=r"coordinator\.lease_ttl_s"):
        parse_config("[coordinator]\nlease_ttl_s = 0.1\n")
    with pytest.raises(ConfigError, match=r"coordinator\.url"):
        parse_config('[coordinator]\nurl = "http://x"\n')
    with pytest.raises(ConfigError, match=r"coordinator\.nope.*unknown key"):
        parse_config("[coordinator]\nnope = 1\n")


def test_drain_timeout_is_a_non_negative_number_of_seconds() -> None:
    assert parse_config("drain_timeout_s = 2.5\n").drain_timeout_s == 2.5
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        parse_config("drain_timeout_s = -1\n")
