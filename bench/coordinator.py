"""The cost of shared limits: admission latency and CPU, local vs Redis, and Redis' CPU per admission.

One admission is what the bridge asks of the coordinator for a prompt arriving at an idle session:
one ``acquire`` over the arrival options of a :class:`~acp_server.coordinator.LimitPlan` (seats with
class shares, a tenant cap, the waiting room, a backend pool), then its ``release`` (queued, sent by the
coordinator's background task). The caps are never reached, so every admission takes a seat.

Measured for each implementation, with 1 task and with ``--tasks`` tasks admitting at once:

- the latency of ``acquire`` (p50, p99);
- this process's CPU per admission (acquire + release, background work included);
- for Redis: Redis' CPU per admission (``INFO cpu``) and the script's own time per call
  (``INFO commandstats``: ``cmdstat_evalsha`` usec / calls).

And the idle-seat gap under a steady backlog: two replicas share ``--seats`` seats, each with more
waiters than seats; every holder keeps its seat a few ms and releases it on its replica. The gap is the
time from a release to the next grant anywhere (the seat idle meanwhile), p50 and p99.

Usage: ``python bench/coordinator.py [--admissions N] [--tasks T] [--json]``; it starts its own
``redis-server`` on a free loopback port (no persistence) and stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from acp_server.coordinator import LimitPlan, LocalCoordinator  # noqa: E402
from acp_server.coordinator.redis import RedisCoordinator  # noqa: E402

PLAN = LimitPlan(
    seats=100_000, shares=(10_000, 60_000, 25_000, 5_000), room=1000, tenant_max_running=100_000,
    pools={"echo": (100_000, 100)},
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Redis:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(500):
            if self.cli("PING").strip() == "PONG":
                break
            time.sleep(0.01)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True)
        return out.stdout

    def info(self) -> dict[str, str]:
        fields: dict[str, str] = {}
        for section in ("cpu", "commandstats"):
            for line in self.cli("INFO", section).splitlines():
                if ":" in line:
                    key, value = line.strip().split(":", 1)
                    fields[key] = value
        return fields

    def cpu_s(self) -> float:
        info = self.info()
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def evalsha(self) -> tuple[int, int]:
        stat = self.info().get("cmdstat_evalsha", "calls=0,usec=0")
        parts = dict(p.split("=") for p in stat.split(","))
        return int(parts["calls"]), int(parts["usec"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def _run(coord: Any, admissions: int, tasks: int) -> dict[str, Any]:
    latencies: list[float] = []
    left = admissions

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            lease = coord.new_lease()
            t0 = time.perf_counter()
            await coord.acquire(lease, *PLAN.arrival("tenant", 1, "echo"))
            latencies.append(time.perf_counter() - t0)
            coord.release(lease)

    cpu0, t0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(worker)
    await coord.flush()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return {
        "admissions": admissions,
        "tasks": tasks,
        "p50_us": round(_percentile(latencies, 0.5) * 1e6, 1),
        "p99_us": round(_percentile(latencies, 0.99) * 1e6, 1),
        "cpu_us_per_admission": round(cpu / admissions * 1e6, 1),
        "admissions_per_s": round(admissions / wall),
    }


async def idle_gap(url: str, seats: int, grants: int) -> dict[str, Any]:
    """Two replicas, a steady backlog on each; the time a freed seat stays idle."""
    from acp_server.coordinator import Need, Option

    option = Option((Need("seats", seats),))
    released: list[float] = []  # release times not yet followed by a grant
    gaps: list[float] = []
    done = 0
    a = RedisCoordinator(url, prefix="gap", replica_id="a")
    b = RedisCoordinator(url, prefix="gap", replica_id="b")
    async with a.running(), b.running():

        async def waiter(coord: RedisCoordinator) -> None:
            nonlocal done
            while done < grants:
                lease = coord.new_lease()
                await coord.wait_acquire(lease, option)
                now = time.perf_counter()
                if released:
                    gaps.append(now - released.pop(0))
                done += 1
                await trio.sleep(0.002 + 0.004 * (done % 3))
                released.append(time.perf_counter())
                coord.release(lease)

        async with trio.open_nursery() as nursery:
            for i in range(4 * seats):
                nursery.start_soon(waiter, (a, b)[i % 2])
    return {
        "seats": seats,
        "grants": grants,
        "gap_p50_ms": round(_percentile(gaps, 0.5) * 1000, 2),
        "gap_p99_ms": round(_percentile(gaps, 0.99) * 1000, 2),
    }


def replicas_throughput(url: str | None, replicas: int, seats: int, duration_s: float, sessions: int) -> dict[str, Any]:
    """Echo prompts/s of ``replicas`` ``acp-server serve`` processes sharing ``seats`` seats on ``url``
    (``None``: one replica, no coordinator), each driven by its own ``loadgen.py echo`` at once."""
    from servers import TcpServer  # bench/servers.py

    flags = ["--max-running-prompts", str(seats)]
    if url is not None:
        flags += ["--coordinator", url, "--coordinator-prefix", f"tp{replicas}"]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(TcpServer(flags)) for _ in range(replicas)]
        loads = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "loadgen.py"), "echo", "--port", str(srv.port),
                 "--server-pid", str(srv.pid), "--sessions", str(sessions), "--depth", "1",
                 "--duration", str(duration_s), "--warmup", "0.5"],
                stdout=subprocess.PIPE, text=True,
            )
            for srv in servers
        ]
        outs = [json.loads(load.communicate(timeout=120)[0]) for load in loads]
    cpu = [o.get("server_cpu_us_per_ok") for o in outs]
    return {
        "replicas": replicas,
        "coordinator": url is not None,
        "seats": seats,
        "prompts_per_s": round(sum(o["ok_per_s"] or 0 for o in outs), 1),
        "refused": sum(o["refused"] for o in outs),
        "errors": sum(sum(o["errors"].values()) for o in outs),
        "p50_ms": max(o["ok_p50_ms"] or 0 for o in outs),
        "server_cpu_us_per_prompt": [c for c in cpu if c is not None],
    }


async def measure(admissions: int, tasks: int, replicas: tuple[int, ...] = ()) -> dict[str, Any]:
    results: dict[str, Any] = {"local": {}, "redis": {}}
    local = LocalCoordinator("bench")
    async with local.running():
        await _run(local, min(admissions, 1000), 1)  # warm-up
        for t in (1, tasks):
            results["local"][f"tasks_{t}"] = await _run(local, admissions, t)
    redis = Redis()
    try:
        coord = RedisCoordinator(redis.url, prefix="bench", replica_id="bench")
        async with coord.running():
            await _run(coord, min(admissions, 1000), 1)
            for t in (1, tasks):
                cpu0, (calls0, usec0) = redis.cpu_s(), redis.evalsha()
                run = await _run(coord, admissions, t)
                cpu1, (calls1, usec1) = redis.cpu_s(), redis.evalsha()
                run["redis_cpu_us_per_admission"] = round((cpu1 - cpu0) / admissions * 1e6, 1)
                run["script_us_per_call"] = round((usec1 - usec0) / max(1, calls1 - calls0), 2)
                run["script_calls_per_admission"] = round((calls1 - calls0) / admissions, 2)
                results["redis"][f"tasks_{t}"] = run
        results["idle_gap"] = await idle_gap(redis.url, 8, min(admissions, 2000))
        if replicas:
            duration = 1.0 if admissions < 1000 else 3.0
            runs = [trio.to_thread.run_sync(replicas_throughput, None, 1, 16, duration, 16)]
            runs += [trio.to_thread.run_sync(replicas_throughput, redis.url, n, 16, duration, 16) for n in replicas]
            results["replicas"] = [await run for run in runs]
    finally:
        redis.stop()
    results["load"] = list(os.getloadavg())
    return results


def markdown(results: dict[str, Any]) -> str:
    rows = ["| implementation | tasks | acquire p50 | acquire p99 | replica CPU / admission | admissions/s | Redis CPU / admission | script time / call |",
            "|---|---|---|---|---|---|---|---|"]
    for kind in ("local", "redis"):
        for run in results[kind].values():
            rows.append(
                f"| {kind} | {run['tasks']} | {run['p50_us']} us | {run['p99_us']} us | "
                f"{run['cpu_us_per_admission']} us | {run['admissions_per_s']} | "
                f"{run.get('redis_cpu_us_per_admission', '-')} us | {run.get('script_us_per_call', '-')} us |"
            )
    gap = results.get("idle_gap")
    if gap:
        rows.append("")
        rows.append(
            f"idle-seat gap, 2 replicas, {gap['seats']} seats, steady backlog, {gap['grants']} grants: "
            f"p50 {gap['gap_p50_ms']} ms, p99 {gap['gap_p99_ms']} ms"
        )
    if results.get("replicas"):
        rows += ["", "| replicas | shared seats | echo prompts/s (all replicas) | slowest replica's p50 | server CPU / prompt |",
                 "|---|---|---|---|---|"]
        for run in results["replicas"]:
            what = f"{run['replicas']}, Redis" if run["coordinator"] else "1, no coordinator"
            cpu = ", ".join(f"{c:.0f}" for c in run["server_cpu_us_per_prompt"])
            rows.append(f"| {what} | {run['seats']} | {run['prompts_per_s']} | {run['p50_ms']} ms | {cpu} us |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admissions", type=int, default=5000)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument(
        "--replicas", default="1,2,4",
        help="echo prompts/s with these numbers of serve processes sharing 16 seats (empty: skip)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args()
    replicas = tuple(int(n) for n in args.replicas.split(",") if n)
    results = trio.run(measure, args.admissions, args.tasks, replicas)
    print(json.dumps(results, indent=2) if args.json else markdown(results))


if __name__ == "__main__":
    main()
