"""Scenario ``rest``: qwen serve's REST + SSE API beside ``/acp`` and TCP, on one server process.

1. Server CPU per echo prompt, sequential on one session, round after round alternating:
   - ``rest``: ``POST /session/:id/prompt`` (202) and its ``turn_complete`` read on the session's
     ``GET /session/:id/events`` stream (httpx, one subscriber);
   - ``acp_sse``: the official SDK client over our ``/acp`` (HTTP+SSE);
   - ``tcp``: the same client over our TCP NDJSON listener (the baseline; goal: REST within 2x).
2. SSE fan-out: the same REST prompts with 1, 10 and 64 subscribers on the session, each prompt done
   once every subscriber has its ``turn_complete``: server CPU per prompt, and per subscriber-frame.

CPU is the server process's own, from ``/proc``, read around each timed run.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from http_ab import HttpSizes, _one, _Process
from http_ab import Run as AcpRun
from procfs import cpu_seconds
from servers import acp_server_argv, shell_command

__all__ = ["FANOUT", "run_rest"]

FANOUT = (1, 10, 64)


@dataclass
class Totals:
    prompts: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    frames: int = 0
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(self, prompts: int, seconds: float, cpu_s: float, frames: int) -> None:
        self.prompts += prompts
        self.seconds += seconds
        self.cpu_s += cpu_s
        self.frames += frames
        self.rounds.append({"prompts_per_s": round(prompts / seconds, 1), "cpu_us_per_prompt": round(cpu_s * 1e6 / prompts, 1)})


class _Watcher:
    """One SSE subscriber: counts frames and ``turn_complete`` frames."""

    def __init__(self) -> None:
        self.frames = 0
        self.done = 0
        self.changed = asyncio.Event()
        self.open = asyncio.Event()

    async def run(self, client: httpx.AsyncClient, url: str) -> None:
        async with client.stream("GET", url) as r:
            if r.status_code != 200:
                raise RuntimeError(f"GET {url}: {r.status_code} {await r.aread()!r}")
            self.open.set()
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    self.frames += 1
                    if line == "event: turn_complete":
                        self.done += 1
                        self.changed.set()

    async def wait(self, count: int) -> None:
        while self.done < count:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 30)


async def _rest_run(base: str, pid: int, subscribers: int, warmup: int, prompts: int, text: str, out: Totals) -> None:
    limits = httpx.Limits(max_connections=subscribers + 4, max_keepalive_connections=subscribers + 4)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        sid = (await client.post(base + "/session", json={"cwd": "/tmp", "sessionScope": "thread"})).json()["sessionId"]
        watchers = [_Watcher() for _ in range(subscribers)]
        tasks = [asyncio.create_task(w.run(client, f"{base}/session/{sid}/events")) for w in watchers]
        try:
            await asyncio.wait_for(asyncio.gather(*(w.open.wait() for w in watchers)), 30)
            body = {"prompt": [{"type": "text", "text": text}]}
            url = f"{base}/session/{sid}/prompt"

            async def one(i: int) -> None:
                r = await client.post(url, json=body)
                if r.status_code != 202:
                    raise RuntimeError(f"POST {url}: {r.status_code} {r.text}")
                await asyncio.gather(*(w.wait(i) for w in watchers))

            for i in range(1, warmup + 1):
                await one(i)
            frames0 = sum(w.frames for w in watchers)
            cpu0, started = cpu_seconds(pid), time.perf_counter()
            for i in range(warmup + 1, warmup + prompts + 1):
                await one(i)
            seconds, cpu_s = time.perf_counter() - started, cpu_seconds(pid) - cpu0
            out.add(prompts, seconds, cpu_s, sum(w.frames for w in watchers) - frames0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.delete(f"{base}/session/{sid}")


def run_rest(sizes: HttpSizes) -> tuple[dict[str, Any], str]:
    """Every round over the targets, then the fan-out runs; the figures and the server command."""
    argv = [*acp_server_argv(), "serve", "--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0"]
    server = _Process(argv, rb"acp-server: (?:listening on tcp|http on http)://127\.0\.0\.1:(\d+)")
    try:
        while len(server.found) < 2:
            time.sleep(0.05)
            server.found = list(re.finditer(rb"acp-server: (listening on tcp|http on http)://127\.0\.0\.1:(\d+)",
                                            Path(server.log.name).read_bytes()))
        ports = {m.group(1): int(m.group(2)) for m in server.found}
        http = f"http://127.0.0.1:{ports[b'http on http']}"
        tcp = f"tcp://127.0.0.1:{ports[b'listening on tcp']}"
        pid = server.proc.pid
        rest, acp_sse, acp_tcp = Totals(), AcpRun(), AcpRun()
        fanout = {n: Totals() for n in FANOUT}

        async def rounds() -> None:
            for r in range(sizes.rounds):
                order = ("rest", "acp_sse", "tcp") if r % 2 == 0 else ("tcp", "acp_sse", "rest")
                for target in order:
                    if target == "rest":
                        await _rest_run(http, pid, 1, sizes.warmup, sizes.prompts, sizes.text, rest)
                    elif target == "acp_sse":
                        await _one("ours_sse", http + "/acp", pid, sizes, acp_sse)
                    else:
                        await _one("ours_tcp", tcp, pid, sizes, acp_tcp)
            for r in range(sizes.rounds):
                for n in FANOUT if r % 2 == 0 else FANOUT[::-1]:
                    await _rest_run(http, pid, n, sizes.warmup, max(10, sizes.prompts // 3), sizes.text, fanout[n])

        asyncio.run(rounds())
    finally:
        server.stop()

    def per(t: Any) -> dict[str, Any]:
        return {"prompts": t.prompts, "prompts_per_s": t.prompts / t.seconds, "cpu_us_per_prompt": t.cpu_s * 1e6 / t.prompts,
                "rounds": t.rounds}

    out: dict[str, Any] = {"rest": per(rest), "acp_sse": per(acp_sse), "tcp": per(acp_tcp), "fanout": {}}
    for n, t in fanout.items():
        out["fanout"][str(n)] = {**per(t), "frames_per_prompt": t.frames / t.prompts,
                                 "cpu_us_per_frame": t.cpu_s * 1e6 / t.frames if t.frames else None}
    json.dumps(out)  # plain data only
    return out, shell_command(argv)
