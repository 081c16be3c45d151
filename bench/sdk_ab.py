"""Scenario 1: the official SDK client drives two stdio agents, our ``acp-server serve --stdio`` and the
SDK's own echo agent (bench/peers/sdk_echo_agent.py), in alternating A/B runs.

Run alone it compares any agents by turns in one run, e.g. main's tree against this one:
``python bench/sdk_ab.py --agent "main=env PYTHONPATH=/tmp/main python -m acp_server serve --stdio"
--agent ours --agent sdk --words 1 --rounds 4`` (``ours`` and ``sdk`` alone name this venv's
``acp-server serve --stdio`` and the SDK's echo agent).

Each run spawns the agent, checks that it echoes like ours (one ``agent_message_chunk`` per word,
whitespace kept, then ``end_turn``), warms up, then times sequential prompts on one session and
prompts from 8 sessions at once. The agent's CPU time is read from ``/proc`` around each timed part, with
its read and write system calls and context switches (per round, in the raw figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from acp import PROTOCOL_VERSION, Client, spawn_agent_process, text_block
from acp.schema import AgentMessageChunk, TextContentBlock
from procfs import cpu_seconds, describe_idle, guest_halt_poll, idle_policy, percentile
from servers import BenchError, acp_server_argv, sdk_echo_argv

__all__ = ["AbSizes", "Totals", "kernel_counts", "run_ab"]

_SPAWN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class AbSizes:
    rounds: int
    warmup: int
    sequential: int
    sessions: int
    per_session: int
    text: str


@dataclass
class Totals:
    """One agent's sums over every round of one workload."""

    prompts: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(
        self,
        prompts: int,
        seconds: float,
        cpu_s: float,
        latencies: list[float],
        client_cpu_s: float,
        kernel: dict[str, int] | None = None,
    ) -> None:
        self.prompts += prompts
        self.seconds += seconds
        self.cpu_s += cpu_s
        self.latencies += latencies
        self.rounds.append(
            {
                "prompts_per_s": round(prompts / seconds, 1),
                # this round's own latency percentiles (ms): rounds are compared in pairs
                "p50_ms": round((percentile(latencies, 0.50) or 0.0) * 1e3, 3),
                "p99_ms": round((percentile(latencies, 0.99) or 0.0) * 1e3, 3),
                "cpu_us_per_prompt": round(cpu_s * 1e6 / prompts, 1),
                # The SDK client's own CPU (this process): the workload's bottleneck, and it grows with
                # every message the agent sends it, handled or not.
                "client_cpu_us_per_prompt": round(client_cpu_s * 1e6 / prompts, 1),
                # What the agent asked of the kernel per prompt (see kernel_counts)
                **{f"{k}_per_prompt": round(v / prompts, 2) for k, v in (kernel or {}).items()},
            }
        )


def kernel_counts(pid: int) -> dict[str, int]:
    """Counters of ``pid`` that CPU time does not break down: its read and write system calls, all its
    threads (``syscr``/``syscw`` of ``/proc/PID/io``: reads of its stdin, writes of its stdout), and the
    context switches of its main thread (``/proc/PID/status``; both agents serve from it). Empty where
    ``/proc`` does not say."""
    counts: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("syscr", "syscw"):
                    counts["reads" if key == "syscr" else "writes"] = int(value)
        with open(f"/proc/{pid}/status") as f:
            switches = 0
            for line in f:
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    switches += int(line.split()[1])
            counts["context_switches"] = switches
    except (OSError, ValueError):
        return {}
    return counts


class _EchoClient:
    """The SDK ``Client`` side: collects the agent's text per session."""

    def __init__(self) -> None:
        self.text: dict[str, list[str]] = {}

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        if isinstance(update, AgentMessageChunk) and isinstance(update.content, TextContentBlock):
            self.text.setdefault(session_id, []).append(update.content.text)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the echo agents never ask for permission")


async def _timed(
    pid: int, jobs: list[Callable[[], Awaitable[list[float]]]]
) -> tuple[int, float, float, list[float], float, dict[str, int]]:
    """Run ``jobs`` at once; their latencies, and the agent's CPU and kernel counts meanwhile.

    The client's garbage collector is off while they run (collected just before): the SDK client
    allocates enough that a young-generation collection of its own ran every few hundred prompts,
    and one of its older-generation collections (up to 8 ms here) stalled every session's prompt in
    flight at once, 8 of a round's 1,200 samples, which is a p99's tail: a pause of the client's, not
    of either agent, landing in one agent's round or the other's by chance.
    """
    kernel0 = kernel_counts(pid)
    gc.collect()
    gc.disable()
    try:
        cpu0, started, client0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
        per_job = await asyncio.gather(*(job() for job in jobs))
        seconds, cpu_s = time.perf_counter() - started, cpu_seconds(pid) - cpu0
        client_s = time.process_time() - client0
    finally:
        gc.enable()
    kernel1 = kernel_counts(pid)
    kernel = {k: v - kernel0[k] for k, v in kernel1.items() if k in kernel0}
    latencies = [lat for lats in per_job for lat in lats]
    return len(latencies), seconds, cpu_s, latencies, client_s, kernel


async def _one_agent(name: str, argv: list[str], sizes: AbSizes, seq: Totals, conc: Totals) -> None:
    client = _EchoClient()
    # stderr=None: the agent's stderr is ours (an unread pipe could fill and stall it).
    spawned = spawn_agent_process(cast(Client, client), *argv, transport_kwargs={"stderr": None})
    async with spawned as (conn, proc):
        await asyncio.wait_for(conn.initialize(protocol_version=PROTOCOL_VERSION), _SPAWN_TIMEOUT_S)
        prompt: list[Any] = [text_block(sizes.text)]

        async def session() -> str:
            return (await conn.new_session(cwd="/tmp", mcp_servers=[])).session_id

        first = await session()
        reply = await conn.prompt(session_id=first, prompt=prompt)
        echoed = "".join(client.text.pop(first, []))
        if reply.stop_reason != "end_turn" or echoed != sizes.text:
            raise BenchError(
                f"{name} does not echo like ours: {reply.stop_reason!r}, {echoed!r} for {sizes.text!r}"
            )

        def loop(session_id: str, count: int) -> Callable[[], Awaitable[list[float]]]:
            async def run() -> list[float]:
                lats = []
                for _ in range(count):
                    started = time.perf_counter()
                    await conn.prompt(session_id=session_id, prompt=prompt)
                    lats.append(time.perf_counter() - started)
                client.text.pop(session_id, None)
                return lats

            return run

        await loop(first, sizes.warmup)()
        seq.add(*await _timed(proc.pid, [loop(first, sizes.sequential)]))
        sessions = [await session() for _ in range(sizes.sessions)]
        await asyncio.gather(*(loop(s, max(1, sizes.warmup // sizes.sessions))() for s in sessions))
        conc.add(*await _timed(proc.pid, [loop(s, sizes.per_session) for s in sessions]))


async def _run(agents: dict[str, list[str]], sizes: AbSizes) -> dict[str, dict[str, Totals]]:
    totals = {name: {"sequential": Totals(), "concurrent": Totals()} for name in agents}
    names = list(agents)
    for r in range(sizes.rounds):
        # A/B then B/A: neither agent always runs on a colder (or warmer) machine.
        for name in names if r % 2 == 0 else names[::-1]:
            await _one_agent(
                name, agents[name], sizes, totals[name]["sequential"], totals[name]["concurrent"]
            )
    return totals


def run_ab(agents: dict[str, list[str]], sizes: AbSizes) -> dict[str, dict[str, Totals]]:
    """Run every round; per agent name and workload (``sequential``, ``concurrent``), the totals."""
    return asyncio.run(_run(agents, sizes))


def _agent(spec: str) -> tuple[str, list[str]]:
    """``NAME=COMMAND`` (split as a shell would), or ``ours`` / ``sdk`` alone."""
    name, eq, command = spec.partition("=")
    if eq:
        return name, shlex.split(command)
    if spec == "ours":
        return spec, [*acp_server_argv(), "serve", "--stdio"]
    if spec == "sdk":
        return spec, sdk_echo_argv()
    raise SystemExit(f"--agent {spec!r}: NAME=COMMAND, ours or sdk")


def main() -> None:
    parser = argparse.ArgumentParser(description="The SDK client against stdio agents by turns, one run.")
    parser.add_argument("--agent", action="append", type=_agent, help="NAME=COMMAND, ours or sdk (repeat)")
    parser.add_argument("--words", type=int, default=1, help="words per prompt (one update each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--sequential", type=int, default=1000, help="timed prompts on one session")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--per-session", type=int, default=150, help="timed prompts per session at once")
    parser.add_argument(
        "--guest-halt-poll-ns",
        type=int,
        metavar="NS",
        help="for this run only, set the VM's guest halt polling window (the haltpoll cpuidle driver's "
        "guest_halt_poll_ns; root; machine-wide, put back after) to show what an idle vCPU's halt costs a "
        "sequential prompt, e.g. 200000 (the driver's stock default) against 0",
    )
    args = parser.parse_args()
    agents = dict(args.agent or [_agent("ours"), _agent("sdk")])
    sizes = AbSizes(args.rounds, args.warmup, args.sequential, args.sessions, args.per_session, " ".join(["hello"] * args.words))
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(guest_halt_poll(args.guest_halt_poll_ns))
        except (ValueError, OSError) as exc:
            parser.error(f"--guest-halt-poll-ns: {exc}")
        idle = describe_idle(idle_policy())
        totals = run_ab(agents, sizes)
    print(f"{args.words} word(s), {args.rounds} rounds, {args.sessions} sessions x {args.per_session}; {sizes.sequential} sequential; {idle}")
    for workload in ("sequential", "concurrent"):
        for name, per in totals.items():
            t = per[workload]
            p50, p99 = percentile(t.latencies, 0.5), percentile(t.latencies, 0.99)
            def mean(key: str, rounds: list[dict[str, float]] = t.rounds) -> float:
                return sum(r.get(key, 0.0) for r in rounds) / max(1, len(rounds))

            print(
                f"{workload:10} {name:12} p50 {(p50 or 0) * 1e3:6.2f} ms  p99 {(p99 or 0) * 1e3:6.2f} ms  "
                f"{t.prompts / t.seconds:7.0f} prompts/s  server CPU {t.cpu_s * 1e6 / t.prompts:6.1f} µs  "
                f"client CPU {mean('client_cpu_us_per_prompt'):6.1f} µs per prompt; the agent's reads "
                f"{mean('reads_per_prompt'):.2f}, writes {mean('writes_per_prompt'):.2f}, context switches "
                f"{mean('context_switches_per_prompt'):.2f} per prompt"
            )
        print("  p99 by round: " + "; ".join(
            f"{name} " + " ".join(f"{v:.2f}" for v in _round_p99(per[workload], sizes, workload))
            for name, per in totals.items()
        ))


def _round_p99(t: Totals, sizes: AbSizes, workload: str) -> list[float]:
    """Each round's own p99 (ms): the latencies are kept in round order."""
    n = sizes.sequential if workload == "sequential" else sizes.sessions * sizes.per_session
    return [(percentile(t.latencies[i : i + n], 0.99) or 0) * 1e3 for i in range(0, len(t.latencies), n)]


if __name__ == "__main__":
    sys.exit(main())
