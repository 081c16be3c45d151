"""Scenario ``rest``: qwen serve's REST + SSE API beside ``/acp`` and TCP, on one server process.

1. Server CPU per echo prompt, sequential on one session, round after round alternating:
   - ``rest_sdk``: qwen's own SDK (``@qwen-code/sdk``'s ``DaemonSessionClient`` in Node, from
     ``tests/node``; ``bench/rest_sdk_driver.mjs``): one ``events()`` subscription, each prompt posted
     with ``submitPrompt`` and done at its ``turn_complete`` (the goal's row: qwen's client is what the
     API serves; Node's fetch writes a request's head and body in one write). Node runs with
     ``--single-threaded``: V8 then does its collector's and compilers' work on the main thread, between
     the client's own steps, instead of in background threads that run on the machine's other CPU
     while the server works and slow it (bench/README.md, "Scenario 8: Node's threads and the server's
     CPU");
   - ``rest_sdk_threads``: the same with Node as it comes (its background threads on), for reference;
   - ``rest``: the same prompts from httpx (``POST /session/:id/prompt`` (202) and its
     ``turn_complete`` read on the session's ``GET /session/:id/events`` stream, one subscriber);
     httpx writes a request's head and its body apart, so the server reads each POST twice;
   - ``acp_sse``: the official SDK client over our ``/acp`` (HTTP+SSE);
   - ``tcp``: the same client over our TCP NDJSON listener (the baseline; goal: REST within 2x).
2. SSE fan-out: the same REST prompts with 1, 10 and 64 subscribers on the session, each prompt done
   once every subscriber has its ``turn_complete``: server CPU per prompt, and per subscriber-frame.

CPU is the server process's own, from ``/proc``, read around each timed run. ``BENCH_REST_PIN=1``
runs the scenario with the server's threads on the first CPU this process may use and every client
(this process, Node and its threads) on the others.

``python bench/rest_bench.py --instr`` counts instead the instructions the server runs per REST prompt
(both clients), per TCP prompt and per ``/acp`` WebSocket prompt (scenario 6's; the same prompts, one
server under ``valgrind --tool=callgrind``, instrumented only while the timed prompts run): a figure
that a busy machine does not move, unlike CPU time (the ratio of the two is the goal's, without the
kernel's share and the caches' misses).

``python bench/rest_bench.py --kernel`` counts what the server asks of the kernel per prompt on the
same three paths (REST from httpx, REST from qwen's SDK, TCP): read and write system calls (all
threads, ``/proc/PID/io`` ``syscr``/``syscw``) and the main thread's context switches
(``/proc/PID/status``), and the user and system CPU time (``/proc/PID/stat``, clock ticks: give it
``--prompts 2000``); with ``--strace`` also every system call by name (``strace -c -f -p PID``
attached while the timed prompts run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import http_ab
import httpx
from http_ab import HttpSizes, _one, _Process
from http_ab import Run as AcpRun
from procfs import cpu_seconds
from sdk_ab import kernel_counts
from servers import BenchError, acp_server_argv, shell_command

__all__ = ["FANOUT", "run_rest", "sdk_missing"]

FANOUT = (1, 10, 64)
_SDK_DIR = Path(__file__).resolve().parent.parent / "tests" / "node"
_SDK_ENTRY = _SDK_DIR / "node_modules" / "@qwen-code" / "sdk" / "dist" / "daemon" / "index.js"
_SDK_DRIVER = Path(__file__).resolve().parent / "rest_sdk_driver.mjs"


def sdk_missing() -> str | None:
    """Why the ``rest_sdk`` row cannot run here (no ``node``, or ``tests/node`` not installed), or None."""
    if shutil.which("node") is None:
        return "no node on PATH"
    if not _SDK_ENTRY.is_file():
        return "tests/node/node_modules is not installed (cd tests/node && npm ci)"
    return None


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


async def _rest_run(
    base: str, pid: int, subscribers: int, warmup: int, prompts: int, text: str, out: Totals,
    meter: Callable[[int], float] = cpu_seconds,
) -> None:
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
            cpu0, started = meter(pid), time.perf_counter()
            for i in range(warmup + 1, warmup + prompts + 1):
                await one(i)
            seconds, cpu_s = time.perf_counter() - started, meter(pid) - cpu0
            out.add(prompts, seconds, cpu_s, sum(w.frames for w in watchers) - frames0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.delete(f"{base}/session/{sid}")


_NODE_ARGS = ("--single-threaded",)  # V8 without background threads (rest_sdk); () for rest_sdk_threads


async def _sdk_run(
    base: str, pid: int, warmup: int, prompts: int, text: str, out: Totals, meter: Callable[[int], float] = cpu_seconds,
    node_args: tuple[str, ...] = _NODE_ARGS,
) -> None:
    """``prompts`` sequential REST prompts from qwen's SDK (``rest_sdk_driver.mjs``), timed by ``meter``."""
    argv = [str(shutil.which("node")), *node_args, str(_SDK_DRIVER), str(_SDK_ENTRY), base, str(warmup), str(prompts), text]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    async def line(what: str) -> dict[str, Any]:
        raw = await asyncio.wait_for(proc.stdout.readline(), 120)  # type: ignore[union-attr]
        if not raw:
            err = (await proc.stderr.read()).decode(errors="replace")[-2000:]  # type: ignore[union-attr]
            raise BenchError(f"rest_sdk_driver.mjs ended before {what}: {err}")
        got: dict[str, Any] = json.loads(raw)
        return got

    try:
        await line("ready")
        cpu0 = meter(pid)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        done = await line("done")
        cpu_s = meter(pid) - cpu0
        out.add(prompts, done["seconds"], cpu_s, done["frames"])
        proc.stdin.write(b"end\n")
        await proc.stdin.drain()
        if await asyncio.wait_for(proc.wait(), 30) != 0:
            raise BenchError(f"rest_sdk_driver.mjs exited {proc.returncode}: {(await proc.stderr.read())[-2000:]!r}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


_SERVE = ["serve", "--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0"]
_LISTENING = rb"acp-server: (listening on tcp|http on http)://127\.0\.0\.1:(\d+)"


def _start(argv: list[str]) -> tuple[_Process, str, str]:
    """The server of ``argv``, once both listeners are up: the process, its HTTP and its TCP address."""
    server = _Process(argv, _LISTENING)
    while len(server.found) < 2:  # (both lines, with the same two groups, however fast they came)
        time.sleep(0.05)
        server.found = list(re.finditer(_LISTENING, Path(server.log.name).read_bytes()))
    ports = {m.group(1): int(m.group(2)) for m in server.found}
    return server, f"http://127.0.0.1:{ports[b'http on http']}", f"tcp://127.0.0.1:{ports[b'listening on tcp']}"


def _cpu_split() -> tuple[set[int], set[int]] | None:
    """The server's CPU and the clients' (the others this process may use), or None with one."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) >= 2 else None


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (the threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)  # CPUs this process may use: the kernel takes them or raises
        except ProcessLookupError:  # a thread that just ended
            pass


def run_rest(sizes: HttpSizes) -> tuple[dict[str, Any], str]:
    """Every round over the targets, then the fan-out runs; the figures and the server command."""
    argv = [*acp_server_argv(), *_SERVE]
    server, http, tcp = _start(argv)
    allowed = os.sched_getaffinity(0)
    split = _cpu_split() if os.environ.get("BENCH_REST_PIN") == "1" else None
    try:
        pid = server.proc.pid
        rest, rest_sdk, rest_sdk_threads, acp_sse, acp_tcp = Totals(), Totals(), Totals(), AcpRun(), AcpRun()
        fanout = {n: Totals() for n in FANOUT}
        sdk_rows = ("rest_sdk", "rest_sdk_threads") if sdk_missing() is None else ()
        targets = (*sdk_rows, "rest", "acp_sse", "tcp")

        async def rounds() -> None:
            for r in range(sizes.rounds):
                for target in targets if r % 2 == 0 else targets[::-1]:
                    if target == "rest":
                        await _rest_run(http, pid, 1, sizes.warmup, sizes.prompts, sizes.text, rest)
                    elif target == "rest_sdk":
                        await _sdk_run(http, pid, sizes.warmup, sizes.prompts, sizes.text, rest_sdk)
                    elif target == "rest_sdk_threads":
                        await _sdk_run(http, pid, sizes.warmup, sizes.prompts, sizes.text, rest_sdk_threads, node_args=())
                    elif target == "acp_sse":
                        await _one("ours_sse", http + "/acp", pid, sizes, acp_sse)
                    else:
                        await _one("ours_tcp", tcp, pid, sizes, acp_tcp)
            for r in range(sizes.rounds):
                for n in FANOUT if r % 2 == 0 else FANOUT[::-1]:
                    await _rest_run(http, pid, n, sizes.warmup, max(10, sizes.prompts // 3), sizes.text, fanout[n])

        if split is not None:
            _pin(pid, split[0])
            os.sched_setaffinity(0, split[1])  # this process, and the clients it starts
        asyncio.run(rounds())
    finally:
        os.sched_setaffinity(0, allowed)
        server.stop()

    def per(t: Any) -> dict[str, Any]:
        return {"prompts": t.prompts, "prompts_per_s": t.prompts / t.seconds, "cpu_us_per_prompt": t.cpu_s * 1e6 / t.prompts,
                "rounds": t.rounds}

    out: dict[str, Any] = {"rest": per(rest), "rest_sdk": per(rest_sdk) if rest_sdk.prompts else None,
                           "rest_sdk_threads": per(rest_sdk_threads) if rest_sdk_threads.prompts else None,
                           "node_args": list(_NODE_ARGS), "rest_sdk_missing": sdk_missing(), "acp_sse": per(acp_sse),
                           "tcp": per(acp_tcp), "fanout": {},
                           "pinned": None if split is None else {"server": sorted(split[0]), "clients": sorted(split[1])}}
    for n, t in fanout.items():
        out["fanout"][str(n)] = {**per(t), "frames_per_prompt": t.frames / t.prompts,
                                 "cpu_us_per_frame": t.cpu_s * 1e6 / t.frames if t.frames else None}
    json.dumps(out)  # plain data only
    return out, shell_command(argv)


class _Callgrind:
    """Instructions a server under callgrind runs between two readings (its instrumentation is on only
    between them: ``--instr-atstart=no``, then ``callgrind_control -i on``, and a dump at the second)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.dumps = 0
        self.on = False

    def __call__(self, pid: int) -> float:
        if not self.on:
            subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
            self.on = True
            return 0.0
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
        self.on = False
        self.dumps += 1
        text = Path(f"{self.out}.{self.dumps}").read_text()
        found = re.search(r"^totals: (\d+)", text, re.M) or re.search(r"^summary: (\d+)", text, re.M)
        if found is None:
            raise BenchError(f"no totals in {self.out}.{self.dumps}")
        return float(found.group(1))


@contextmanager
def _tcp_meter(meter: Callable[[int], float]) -> Iterator[None]:
    """``http_ab``'s timed TCP runs read ``meter`` instead of the CPU clock."""
    saved = http_ab.cpu_seconds
    http_ab.cpu_seconds = meter  # type: ignore[assignment]
    try:
        yield
    finally:
        http_ab.cpu_seconds = saved


def run_instr(
    prompts: int, warmup: int, text: str, keep: Path | None = None, node_args: tuple[str, ...] = _NODE_ARGS,
) -> dict[str, Any]:
    """Instructions per REST prompt (httpx's, and qwen's SDK's when it is installed), per TCP prompt and
    per ``/acp`` WebSocket prompt (the official SDK's clients; sequential echo prompts, as
    :func:`run_rest`); ``keep``: a directory for the callgrind dumps (``rest.callgrind``,
    ``rest_sdk.callgrind``, ``tcp.callgrind``, ``ws.callgrind``, for ``callgrind_annotate``)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise BenchError("--instr needs valgrind (Debian: apt-get install valgrind)")
    out = Path(f"/tmp/acp-bench-rest-{int(time.time())}.callgrind")
    server_argv = acp_server_argv()
    if len(server_argv) == 1:  # the console script: run by this Python (valgrind follows no #! line)
        server_argv = [sys.executable, *server_argv]
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *server_argv, *_SERVE]
    http_ab._START_TIMEOUT_S = 300.0  # type: ignore[attr-defined]  # (imports are ~50x slower under valgrind)
    server, http, tcp = _start(argv)
    meter = _Callgrind(out)
    rest, rest_sdk, acp_tcp, acp_ws = Totals(), Totals(), AcpRun(), AcpRun()
    try:
        pid = server.proc.pid

        async def both() -> None:
            await _rest_run(http, pid, 1, warmup, prompts, text, rest, meter)
            if sdk_missing() is None:
                await _sdk_run(http, pid, warmup, prompts, text, rest_sdk, meter, node_args)
            with _tcp_meter(meter):
                await _one("ours_tcp", tcp, pid, HttpSizes(1, warmup, prompts, text), acp_tcp)
                ws = http.replace("http://", "ws://", 1) + "/acp"
                await _one("ours_ws", ws, pid, HttpSizes(1, warmup, prompts, text), acp_ws)

        asyncio.run(both())
    finally:
        server.stop()
        order = ("rest", "rest_sdk", "tcp", "ws") if rest_sdk.prompts else ("rest", "tcp", "ws")
        names = {f"{out.name}.{n}": name for n, name in enumerate(order, 1)}
        for dump in out.parent.glob(out.name + "*"):
            if keep is not None and dump.name in names:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(dump, keep / f"{names[dump.name]}.callgrind")
            dump.unlink()
    per_rest, per_tcp = rest.cpu_s / rest.prompts, acp_tcp.cpu_s / acp_tcp.prompts
    per_ws = acp_ws.cpu_s / acp_ws.prompts
    out: dict[str, Any] = {
        "rest_instructions_per_prompt": per_rest,
        "tcp_instructions_per_prompt": per_tcp,
        "ratio": per_rest / per_tcp,
        "ws_instructions_per_prompt": per_ws,  # scenario 6's /acp WebSocket, the SDK's websocket client
        "ws_ratio": per_ws / per_tcp,
    }
    if rest_sdk.prompts:
        per_sdk = rest_sdk.cpu_s / rest_sdk.prompts
        out |= {"rest_sdk_instructions_per_prompt": per_sdk, "sdk_ratio": per_sdk / per_tcp}
    else:
        out["rest_sdk_missing"] = sdk_missing()
    return out


class _KernelMeter:
    """CPU seconds as ``cpu_seconds`` reads them, and at each second reading the kernel counters'
    difference since the first (:func:`sdk_ab.kernel_counts`; with ``strace``, every system call by
    name while the two readings are apart)."""

    def __init__(self, strace: bool) -> None:
        self.strace = strace
        self.runs: list[dict[str, Any]] = []
        self._start: dict[str, int] = {}
        self._cpu0 = 0.0
        self._tracer: subprocess.Popen[bytes] | None = None
        self._trace_out = Path(f"/tmp/acp-bench-rest-strace-{os.getpid()}.txt")

    def __call__(self, pid: int) -> float:
        if not self._start:
            if self.strace:
                self._tracer = subprocess.Popen(
                    ["strace", "-c", "-f", "-o", str(self._trace_out), "-p", str(pid)], stderr=subprocess.DEVNULL
                )
                time.sleep(1.0)  # (attached to every thread before the first timed prompt)
            self._start = kernel_counts(pid) | _user_system_us(pid)
            self._cpu0 = cpu_seconds(pid)
            return self._cpu0
        cpu = cpu_seconds(pid)
        now = kernel_counts(pid)
        now |= _user_system_us(pid)
        run: dict[str, Any] = {k: v - self._start[k] for k, v in now.items() if k in self._start}
        if self._tracer is not None:
            self._tracer.send_signal(2)
            self._tracer.wait(30)
            self._tracer = None
            run["syscalls"] = _strace_counts(self._trace_out.read_text())
            self._trace_out.unlink()
        self.runs.append(run)
        self._start = {}
        return cpu


def _user_system_us(pid: int) -> dict[str, int]:
    """The process's user and system CPU time so far, in µs (``/proc/PID/stat``, clock ticks: read
    over many prompts), and its main thread's voluntary and nonvoluntary context switches apart."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick_us = 1_000_000 // os.sysconf("SC_CLK_TCK")
    out = {"user_us": int(fields[11]) * tick_us, "system_us": int(fields[12]) * tick_us}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                out[line.split("_", 1)[0] + "_switches"] = int(line.split()[1])
    return out


def _strace_counts(text: str) -> dict[str, int]:
    """``strace -c``'s table as {system call: calls}."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3])
    return counts


def run_kernel(prompts: int, warmup: int, text: str, strace: bool, node_args: tuple[str, ...] = _NODE_ARGS) -> dict[str, Any]:
    """System calls and context switches per prompt: REST from httpx, from qwen's SDK, and TCP."""
    server, http, tcp = _start([*acp_server_argv(), *_SERVE])
    meter = _KernelMeter(strace)
    names = ["rest", "rest_sdk", "tcp"] if sdk_missing() is None else ["rest", "tcp"]
    try:
        pid = server.proc.pid

        async def all_three() -> None:
            await _rest_run(http, pid, 1, warmup, prompts, text, Totals(), meter)
            if sdk_missing() is None:
                await _sdk_run(http, pid, warmup, prompts, text, Totals(), meter, node_args)
            with _tcp_meter(meter):
                await _one("ours_tcp", tcp, pid, HttpSizes(1, warmup, prompts, text), AcpRun())

        asyncio.run(all_three())
    finally:
        server.stop()
    out: dict[str, Any] = {}
    for name, run in zip(names, meter.runs, strict=True):
        per: dict[str, Any] = {k: round(v / prompts, 2) for k, v in run.items() if k != "syscalls"}
        if "syscalls" in run:
            per["syscalls"] = {k: round(v / prompts, 2) for k, v in sorted(run["syscalls"].items(), key=lambda kv: -kv[1])}
        out[name] = per
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instr", action="store_true", help="count instructions under callgrind (see above)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--keep", type=Path, metavar="DIR", help="with --instr: keep the callgrind dumps in DIR")
    parser.add_argument("--kernel", action="store_true", help="count system calls and context switches (see above)")
    parser.add_argument("--strace", action="store_true", help="with --kernel: every system call by name (strace -c)")
    parser.add_argument("--node-threads", action="store_true",
                        help="with --instr or --kernel: Node as it comes (V8's background threads on), not --single-threaded")
    args = parser.parse_args()
    if not args.instr and not args.kernel:
        parser.error("run scenario 8 with: python bench/run.py --only rest (this script alone: --instr or --kernel)")
    from run import TEXT

    node_args = () if args.node_threads else _NODE_ARGS
    if args.kernel:
        print(json.dumps(run_kernel(args.prompts, args.warmup, TEXT, args.strace, node_args), indent=2))
    else:
        print(json.dumps(run_instr(args.prompts, args.warmup, TEXT, args.keep, node_args), indent=2))
