"""Scenario 1: the official SDK client drives two stdio agents, our ``acp-server serve --stdio`` and the
SDK's own echo agent (bench/peers/sdk_echo_agent.py), in alternating A/B runs.

Each run spawns the agent, checks that it echoes like ours (one ``agent_message_chunk`` per word,
whitespace kept, then ``end_turn``), warms up, then times sequential prompts on one session and
prompts from 8 sessions at once. The agent's CPU time is read from ``/proc`` around each timed part, with
its read and write system calls and context switches (per round, in the raw figures).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from acp import PROTOCOL_VERSION, Client, spawn_agent_process, text_block
from acp.schema import AgentMessageChunk, TextContentBlock
from procfs import cpu_seconds
from servers import BenchError

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
    kernel0 = kernel_counts(pid)
    cpu0, started, client0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
    per_job = await asyncio.gather(*(job() for job in jobs))
    seconds, cpu_s = time.perf_counter() - started, cpu_seconds(pid) - cpu0
    client_s = time.process_time() - client0
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
