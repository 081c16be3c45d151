"""The over-limit window after a Redis outage longer than the TTL (``bench/coordinator_outage.py`` on a
Redis of its own): three replicas, random holds spanning the outage, Redis SIGSTOPped for 2 x TTL then
SIGCONTed, in both failure modes. Whatever goes over the cluster's seats ends within the one re-assert
round after the resume (every replica re-asserted, woken by the first one's announcement); in ``closed``
mode nothing goes over during the outage, and in ``local`` mode a replica's share counts the shared
leases it still runs, so the cluster never runs twice its seats."""

from __future__ import annotations

import importlib.util
import math
from types import ModuleType

import pytest

from .helpers import ROOT
from .redis_server import RedisServer, redis_server  # noqa: F401

SLACK_MS = 60  # a lost lease's prompt stops at its holder's next checkpoint after the re-assert


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coordinator_outage", ROOT / "bench" / "coordinator_outage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_over_limit_counts_the_time_and_height_above_the_cap() -> None:
    over_limit = _bench().over_limit
    assert over_limit([(0, 10), (1, 2)], 2) == (0, 0.0, None, None)
    assert over_limit([(0, 10), (1, 4), (2, 3)], 2) == (1, 1.0, 2, 3)
    assert over_limit([(0, 10), (1, 4), (2, 3), (5, 7), (6, 8)], 2) == (1, 2.0, 2, 7)


@pytest.mark.parametrize("failure", ["closed", "local"])
async def test_the_over_limit_window_ends_within_one_reassert_round(redis_server: RedisServer, failure: str) -> None:  # noqa: F811
    replicas, seats = 3, 6
    bench = _bench()
    for seed in (3, 4, 5):
        run = await bench.outage_window(
            redis_server.url, redis_server.proc.pid, failure, replicas=replicas, seats=seats, ttl_s=1.0, seed=seed
        )
        # One outage per replica: on this loaded machine a replica may find Redis away a second time
        # right after the resume (a call slower than the timeout); that run measures two rounds.
        if run["outages"] == replicas:
            break
    assert run["outages"] == replicas, run
    assert run["outage_ms"] >= 2 * run["ttl_ms"] - 5
    assert run["prompts"] > 10
    # every replica found Redis again and re-asserted within a fraction of the TTL
    assert run["reassert_done_ms"] < run["ttl_ms"]
    if run["last_over_ms"] is not None:
        assert run["last_over_ms"] <= run["reassert_done_ms"] + SLACK_MS, run
    if failure == "closed":
        assert run["first_over_ms"] is None or run["first_over_ms"] >= 0, run  # not during the outage
        assert run["max_over"] <= seats // 2, run
    else:
        assert run["max_over"] <= (replicas - 1) * math.ceil(seats / replicas), run
