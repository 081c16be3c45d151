"""The over-limit window after a Redis outage longer than the lease TTL, in both failure modes.

Several replicas (in one process, one clock) share ``--seats`` seats on one Redis. Each runs arrivals
that take a seat at once or retry a little later, and hold it for a random time up to three TTLs (so
some prompts span the outage); a prompt stops when its lease is lost. The Redis server is SIGSTOPped
for ``2 x TTL`` and then SIGCONTed. From the running intervals the run computes, over the whole run,
the cluster's concurrency: how far it went over the seats (``max_over``), for how long in all
(``over_ms``) and when, relative to the resume (the window's first and last instant); and when every
replica had re-asserted its leases (``reassert_done_ms``), the one re-assert round the window must end
in. During the outage itself ``local`` mode admits against local shares: that is counted too.

Usage: ``python bench/coordinator_outage.py [--replicas N] [--seats S] [--ttl-s T] [--json]``; it starts
its own ``redis-server`` (from :mod:`coordinator`) and stops it. Imported by
``tests/test_coordinator_outage.py``, which runs the same measurement on a Redis of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from acp_server.coordinator import CoordinatorUnavailable, Lease, LimitRefused, Need, Option  # noqa: E402
from acp_server.coordinator.redis import RedisCoordinator  # noqa: E402


def over_limit(intervals: list[tuple[float, float]], cap: int) -> tuple[int, float, float | None, float | None]:
    """From running intervals ``(start, end)``: the most above ``cap`` at once, the total time above
    it, and the first and last instant above it (``None`` when never)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = worst = 0
    total = 0.0
    first = last = None
    since: float | None = None
    for t, step in events:
        running += step
        if running > cap and since is None:
            since = t
            first = t if first is None else first
        elif running <= cap and since is not None:
            total += t - since
            last = t
            since = None
        worst = max(worst, running - cap)
    return worst, total, first, last


async def outage_window(
    url: str, pid: int, failure: str, *, replicas: int = 3, seats: int = 6, ttl_s: float = 0.6,
    workers: int = 6, seed: int = 1, timeout_ms: int = 250,
) -> dict[str, Any]:
    """One run: load, a SIGSTOP of ``pid`` (the Redis server) for ``2 x ttl_s``, SIGCONT, more load."""
    rng = random.Random(seed)
    option = Option((Need("seats", seats),))
    intervals: list[tuple[float, float]] = []
    reasserted: list[float] = []
    prefix = f"outage-{failure}-{seed}"
    coords = [
        RedisCoordinator(
            url, prefix=prefix, replica_id=f"r{i}", lease_ttl_s=ttl_s, timeout_ms=timeout_ms,
            failure=failure,  # type: ignore[arg-type]
            expected_replicas=replicas,
        )
        for i in range(replicas)
    ]
    stop = trio.Event()
    lost_total = 0
    marks: list[float] = []

    async def prompt_loop(coord: RedisCoordinator) -> None:
        nonlocal lost_total
        while not stop.is_set():
            lease: Lease = coord.new_lease()
            try:
                await coord.acquire(lease, option)
            except (LimitRefused, CoordinatorUnavailable):
                coord.release(lease)
                await trio.sleep(0.005 + 0.01 * rng.random())
                continue
            start = trio.current_time()
            with trio.move_on_after(rng.random() * 3 * ttl_s):
                await lease.lost.wait()
            if lease.state == "lost":
                lost_total += 1
            intervals.append((start, trio.current_time()))
            coord.release(lease)

    with trio.fail_after(12 * ttl_s + 30):  # a hang is an error, not a stalled suite
        await _load(coords, workers, prompt_loop, stop, pid, ttl_s, reasserted, marks)
    worst, total, first, last = over_limit(intervals, seats)
    stopped_at, resumed_at = marks

    def rel(t: float | None) -> float | None:
        return None if t is None else round((t - resumed_at) * 1000, 1)

    return {
        "failure": failure,
        "replicas": replicas,
        "seats": seats,
        "ttl_ms": round(ttl_s * 1000),
        "outage_ms": round((resumed_at - stopped_at) * 1000),
        "prompts": len(intervals),
        "lost": lost_total,
        "outages": sum(c.statistics().outages_total for c in coords),
        "max_over": worst,
        "over_ms": round(total * 1000, 1),
        "first_over_ms": rel(first),
        "last_over_ms": rel(last),
        "reassert_done_ms": rel(max(reasserted)),
    }


async def _load(
    coords: list[RedisCoordinator], workers: int, prompt_loop: Any, stop: trio.Event, pid: int, ttl_s: float,
    reasserted: list[float], marks: list[float],
) -> None:
    """Run the coordinators and the load; stop Redis for 2 x TTL in the middle (``marks``: when it was
    stopped and resumed)."""
    async with trio.open_nursery() as outer:
        for coord in coords:
            await outer.start(_run_coordinator, coord)
        async with trio.open_nursery() as nursery:
            for coord in coords:
                for _ in range(workers):
                    nursery.start_soon(prompt_loop, coord)
            await trio.sleep(2 * ttl_s)
            os.kill(pid, signal.SIGSTOP)
            stopped_at = trio.current_time()
            try:
                await trio.sleep(2 * ttl_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed_at = trio.current_time()

            async def reassert(coord: RedisCoordinator) -> None:
                while coord.up and coord.statistics().outages_total == 0:  # noqa: ASYNC110 - not yet found away
                    await trio.sleep(0.01)
                await coord.wait_up()
                reasserted.append(trio.current_time())

            with trio.move_on_after(20):
                async with trio.open_nursery() as waits:
                    for coord in coords:
                        waits.start_soon(reassert, coord)
            if len(reasserted) < len(coords):
                states = [(c.replica_id, c.up, c._up_event.is_set(), c.statistics()) for c in coords]
                raise RuntimeError(f"not every replica re-asserted within 20 s: {states}")
            marks.extend((stopped_at, resumed_at))
            await trio.sleep(3 * ttl_s)
            stop.set()
        outer.cancel_scope.cancel()


async def _run_coordinator(coord: RedisCoordinator, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with coord.running():
        task_status.started()
        await trio.sleep_forever()


async def measure(replicas: int, seats: int, ttl_s: float, runs: int) -> list[dict[str, Any]]:
    from coordinator import Redis  # bench/coordinator.py: a redis-server of its own

    redis = Redis()
    try:
        out = []
        for failure in ("closed", "local"):
            for seed in range(1, runs + 1):
                out.append(await outage_window(
                    redis.url, redis.proc.pid, failure, replicas=replicas, seats=seats, ttl_s=ttl_s, seed=seed
                ))
        return out
    finally:
        redis.stop()


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| mode | replicas | seats | TTL | outage | outages seen | prompts | lost | most over | time over | over-limit window (from resume) | every replica re-asserted |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        window = "-" if r["first_over_ms"] is None else f"{r['first_over_ms']} .. {r['last_over_ms']} ms"
        rows.append(
            f"| {r['failure']} | {r['replicas']} | {r['seats']} | {r['ttl_ms']} ms | {r['outage_ms']} ms | {r['outages']} | "
            f"{r['prompts']} | {r['lost']} | {r['max_over']} | {r['over_ms']} ms | {window} | {r['reassert_done_ms']} ms |"
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seats", type=int, default=6)
    parser.add_argument("--ttl-s", type=float, default=0.6)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    results = trio.run(measure, args.replicas, args.seats, args.ttl_s, args.runs)
    print(json.dumps(results, indent=2) if args.json else markdown(results))


if __name__ == "__main__":
    main()
