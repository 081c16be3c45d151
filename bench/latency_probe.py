"""Where scenario 1's latency goes: the SDK client's prompts from N sessions, and what the server did meanwhile.

The same client and load as ``bench/run.py --only sdk`` (the official SDK client spawns the agent on stdio,
N sessions each sending prompts one after the other), against ``acp-server serve --stdio`` run under probes
and against the SDK's echo agent, alternating rounds. Per agent: the client's latency (p50, p99, max) and
its own CPU per prompt (the SDK client is the bottleneck of this workload: every message it reads costs it
a task). For ``acp-server``, from probes installed in the server process (nothing in ``acp_server`` is
changed for it):

- every garbage collection (``gc.callbacks``): generation and duration;
- every trio scheduling pass (an instrument: from ``after_io_wait`` to ``before_io_wait``) with the tasks
  that ran in it, and the passes longer than 2 ms;
- every read of the stdio pipe (the shell's own ``os.read`` of it, ``shell._read_now``; ``PipeStream.receive_some``
  for any other reader) and every write (``write_nowait``, ``send_all``),
  stamped, with the bytes: a prompt's request is found in the reads by its id and its answer in the writes,
  so each prompt has its server-side time (request read -> answer written) and how many lines came with it.

For the slowest 1% of the client's prompts it prints where the time went: client send -> server read,
read -> answer written, written -> client done, and whether a collection or a long pass overlapped.
The clocks are the same (``time.perf_counter`` is ``CLOCK_MONOTONIC`` in both processes).

Run: ``python bench/latency_probe.py [--words 1] [--sessions 8] [--prompts 150] [--rounds 2] [-- SERVE_ARGS]``
(for example ``-- --turn-states on``). ``--serve`` is the probed server itself (what the client spawns).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

_HERE = Path(__file__).resolve().parent
_LONG_PASS_S = 0.002


def _serve(out_path: str, serve_args: list[str]) -> int:
    """The probed server: install the probes, then run ``acp-server serve --stdio``; dump at exit."""
    import trio

    from acp_server import cli
    from acp_server.transports import listeners, shell

    pc = time.perf_counter
    gcs: list[tuple[float, float, int]] = []
    passes: list[tuple[float, float, float, list[str]]] = []
    reads: list[tuple[float, bytes]] = []
    writes: list[tuple[float, bytes]] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = pc()
        else:
            gcs.append((gc_started[0], pc(), info["generation"]))

    gc.callbacks.append(on_gc)

    class Passes(trio.abc.Instrument):
        def __init__(self) -> None:
            self.started = pc()
            self.cpu = time.thread_time()
            self.tasks: list[str] = []

        def after_io_wait(self, timeout: float) -> None:
            self.started = pc()
            self.cpu = time.thread_time()
            self.tasks = []

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.tasks.append(task.name.rsplit(".", 1)[-1])

        def before_io_wait(self, timeout: float) -> None:
            passes.append((self.started, pc(), time.thread_time() - self.cpu, self.tasks))

    pipe = listeners.PipeStream
    write_nowait, send_all, receive_some = pipe.write_nowait, pipe.send_all, pipe.receive_some

    def probed_write_nowait(self: Any, data: bytes) -> int:
        stamp = pc()
        sent = write_nowait(self, data)
        writes.append((stamp, bytes(data[:sent])))
        return sent

    async def probed_send_all(self: Any, data: Any) -> None:
        stamp = pc()
        await send_all(self, data)
        writes.append((stamp, bytes(data)))

    async def probed_receive_some(self: Any, max_bytes: int | None = None) -> bytes:
        data = await receive_some(self, max_bytes)
        reads.append((pc(), data))
        return data

    read_now = shell._read_now

    def probed_read_now(fd: int) -> bytes | None:
        data = read_now(fd)
        if data is not None:
            reads.append((pc(), data))
        return data

    shell._read_now = probed_read_now
    pipe.write_nowait = probed_write_nowait  # type: ignore[method-assign]
    pipe.send_all = probed_send_all  # type: ignore[method-assign]
    pipe.receive_some = probed_receive_some  # type: ignore[method-assign]
    serve = cli.serve

    async def probed_serve(config: Any) -> None:
        trio.lowlevel.add_instrument(Passes())
        await serve(config)

    cli.serve = probed_serve  # type: ignore[assignment]

    def dump() -> None:
        record = {
            "gcs": gcs,
            "passes": [(a, b, cpu, tasks if b - a > _LONG_PASS_S else len(tasks)) for a, b, cpu, tasks in passes],
            "reads": [(t, d.decode()) for t, d in reads],
            "writes": [(t, d.decode()) for t, d in writes],
        }
        Path(out_path).write_text(json.dumps(record))

    atexit.register(dump)
    signal.signal(signal.SIGTERM, lambda *_: (dump(), os._exit(0)))
    return cli.main(["serve", "--stdio", *serve_args])


async def _client(argv: list[str], text: str, sessions_n: int, per_session: int) -> dict[str, Any]:
    from acp import PROTOCOL_VERSION, Client, spawn_agent_process, text_block
    from sdk_ab import _EchoClient

    client = _EchoClient()
    recs: list[tuple[str, float, float]] = []
    collections: list[tuple[float, float, int]] = []  # the client's own, (start, end, generation)
    started_gc = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_gc[0] = time.perf_counter()
        else:
            collections.append((started_gc[0], time.perf_counter(), info["generation"]))

    spawned = spawn_agent_process(cast(Client, client), *argv, transport_kwargs={"stderr": None})
    async with spawned as (conn, _proc):
        await conn.initialize(protocol_version=PROTOCOL_VERSION)
        prompt: list[Any] = [text_block(text)]
        sessions = [(await conn.new_session(cwd="/tmp", mcp_servers=[])).session_id for _ in range(sessions_n)]

        async def loop(session_id: str, count: int, keep: bool) -> None:
            for _ in range(count):
                started = time.perf_counter()
                await conn.prompt(session_id=session_id, prompt=prompt)
                if keep:
                    recs.append((session_id, started, time.perf_counter()))
            client.text.pop(session_id, None)

        await asyncio.gather(*(loop(s, 20, False) for s in sessions))
        gc.callbacks.append(on_gc)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            await asyncio.gather(*(loop(s, per_session, True) for s in sessions))
        finally:
            gc.callbacks.remove(on_gc)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"recs": recs, "client_cpu_s": cpu, "wall_s": wall, "t0": wall0, "t1": wall0 + wall, "gcs": collections}


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _lines(data: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.split("\n") if line]


def _server_view(probe: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """Per prompt id: (request read, session, lines in that read, answer written); and the timed window's
    collections and passes."""
    requests: dict[int, tuple[float, str, int]] = {}
    pending = ""
    for stamp, data in probe["reads"]:
        *lines, pending = (pending + data).split("\n")
        for message in _lines("\n".join(lines)):
            if message.get("method") == "session/prompt":
                requests[message["id"]] = (stamp, message["params"]["sessionId"], len(lines))
    answered: dict[int, float] = {}
    for stamp, data in probe["writes"]:
        for message in _lines(data):
            if "result" in message and isinstance(message["result"], dict) and "stopReason" in message["result"]:
                answered[message["id"]] = stamp
    prompts = [(rid, *requests[rid], answered[rid]) for rid in requests if rid in answered]
    gcs = [g for g in probe["gcs"] if t0 <= g[0] <= t1]
    passes = [p for p in probe["passes"] if t0 <= p[0] <= t1]
    return {"prompts": prompts, "gcs": gcs, "passes": passes}


def _report(name: str, runs: list[dict[str, Any]], probes: list[dict[str, Any] | None]) -> None:
    lat = [b - a for run in runs for _, a, b in run["recs"]]
    count = len(lat)
    cpu = sum(r["client_cpu_s"] for r in runs) * 1e6 / count
    client_gcs = [g for r in runs for g in r["gcs"]]
    slow_cut = _q(lat, 0.99)
    slow_hit = sum(
        1 for r in runs for _, a, b in r["recs"] if b - a >= slow_cut and any(a <= g[1] and g[0] <= b for g in r["gcs"])
    )
    print(
        f"{name}: {count} prompts, client p50 {_q(lat, 0.5) * 1e3:.2f} ms, p99 {slow_cut * 1e3:.2f} ms, "
        f"max {max(lat) * 1e3:.2f} ms; client CPU {cpu:.0f} µs/prompt; the client's collections: "
        f"{[sum(1 for g in client_gcs if g[2] == n) for n in range(3)]} by generation, max "
        f"{max((b - a for a, b, _ in client_gcs), default=0) * 1e3:.2f} ms, overlapping {slow_hit} of the slowest 1%"
    )
    views = [_server_view(p, r["t0"], r["t1"]) for p, r in zip(probes, runs, strict=True) if p is not None]
    if not views:
        return
    served = [w - r for v in views for _, r, _, _, w in v["prompts"]]
    batch = [n for v in views for _, _, _, n, _ in v["prompts"]]
    durations = [p[1] - p[0] for v in views for p in v["passes"]]
    longs = [p for v in views for p in v["passes"] if isinstance(p[3], list)]
    long_cpu = sum(p[2] for p in longs) / max(1e-9, sum(p[1] - p[0] for p in longs))
    gcs = [g for v in views for g in v["gcs"]]
    print(
        f"  server, request read -> answer written: p50 {_q(served, 0.5) * 1e3:.2f} ms, "
        f"p99 {_q(served, 0.99) * 1e3:.2f} ms, max {max(served) * 1e3:.2f} ms; lines per read: "
        f"mean {sum(batch) / len(batch):.1f}, max {max(batch)}"
    )
    print(
        f"  passes: {len(durations)}, p50 {_q(durations, 0.5) * 1e3:.3f} ms, p99 {_q(durations, 0.99) * 1e3:.3f} ms, "
        f"max {max(durations) * 1e3:.2f} ms, {len(longs)} over {_LONG_PASS_S * 1e3:.0f} ms (on a CPU "
        f"{long_cpu:.0%} of their time, tasks per long pass: mean "
        f"{sum(len(p[3]) for p in longs) / max(1, len(longs)):.1f}); collections in the "
        f"timed part: {len(gcs)} (by generation {[sum(1 for g in gcs if g[2] == n) for n in range(3)]}, "
        f"max {max((b - a for a, b, _ in gcs), default=0) * 1e3:.2f} ms)"
    )
    # The slowest 1% of the client's prompts, each matched to its request in the server's reads.
    by_session: dict[str, list[tuple[float, float, int]]] = {}
    for v in views:
        for _, read, session, lines, written in v["prompts"]:
            by_session.setdefault(session, []).append((read, written, lines))
    slow = sorted(((b - a, s, a, b) for run in runs for s, a, b in run["recs"]), reverse=True)
    print("  slowest 1%: client ms = send->read + read->written + written->done; lines read with it; overlaps")
    for total, session, sent, done in slow[: max(1, count // 100)]:
        match = [m for m in by_session.get(session, []) if sent <= m[0] and m[1] <= done]
        if not match:
            continue
        read, written, lines = match[0]
        hits = [f"gc{g[2]} {(g[1] - g[0]) * 1e3:.1f} ms" for v in views for g in v["gcs"] if sent <= g[1] and g[0] <= done]
        hits += [f"pass {(p[1] - p[0]) * 1e3:.1f} ms (CPU {p[2] * 1e3:.1f})" for p in longs if sent <= p[1] and p[0] <= done]
        print(
            f"    {total * 1e3:6.2f} = {(read - sent) * 1e3:6.2f} + {(written - read) * 1e3:5.2f} + "
            f"{(done - written) * 1e3:6.2f}; {lines} lines; {', '.join(hits) or 'no collection, no long pass'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=150, help="timed prompts per session and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", metavar="OUT", help=argparse.SUPPRESS)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    if args.serve:
        raise SystemExit(_serve(args.serve, serve_args))
    sys.path.insert(0, str(_HERE))
    from servers import sdk_echo_argv

    text = " ".join(["hello"] * args.words)
    runs: dict[str, list[dict[str, Any]]] = {"acp-server": [], "sdk": []}
    probes: list[dict[str, Any] | None] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("acp-server", "sdk") if r % 2 == 0 else ("sdk", "acp-server"):
                out = Path(tmp, f"probe{r}.json")
                argv = (
                    [sys.executable, str(Path(__file__).resolve()), "--serve", str(out), *serve_args]
                    if name == "acp-server"
                    else sdk_echo_argv()
                )
                runs[name].append(asyncio.run(_client(argv, text, args.sessions, args.prompts)))
                if name == "acp-server":
                    probes.append(json.loads(out.read_text()) if out.exists() else None)
    print(f"{args.sessions} sessions, {args.words}-word prompts, {args.rounds} rounds, serve args {serve_args}")
    _report("acp-server", runs["acp-server"], probes)
    _report("sdk echo agent", runs["sdk"], [None] * len(runs["sdk"]))


if __name__ == "__main__":
    main()
