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

In the client (every agent): each request's write (the SDK sender's ``StreamWriter.write``), each
answer's receipt (its receive loop handing it to the waiting request) and every chunk its pipe reader
got (how many answers came in one read). It prints, per agent, where a prompt's time went, for every
prompt and for the slowest 1%: started -> request written (the client's own queue), written -> answer
received, received -> done (the answer's and the updates' handling); for ``acp-server`` the middle part
is split at the server's read and write. Also: answers per server write, and whether the answers of one
write came in the order their requests were read. For each of the slowest 1%: its parts, how many
answers its write held (and its place), a collection or a long pass that overlapped. The clocks are
the same (``time.perf_counter`` is ``CLOCK_MONOTONIC`` in both processes).

Run: ``python bench/latency_probe.py [--words 1] [--sessions 8] [--prompts 150] [--rounds 2] [--tree NAME=DIR]
[--dump FILE] [-- SERVE_ARGS]`` (for example ``-- --turn-states on``; ``--tree main=/tmp/main`` probes another
source tree's ``acp_server`` by turns too, e.g. ``git archive main | tar -x -C /tmp/main``). ``--serve``
is the probed server itself (what the client spawns).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
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


async def _client(
    argv: list[str], text: str, sessions_n: int, per_session: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
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

    # The client's own stamps: each request's write (the sender task's ``StreamWriter.write``) and each
    # answer's receipt (the receive loop handing it to its waiting request), by request id.
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    session_of: dict[int, str] = {}
    arrived: list[tuple[float, int]] = []  # every chunk the client's pipe reader got: stamp, answers in it
    pc = time.perf_counter
    spawned = spawn_agent_process(cast(Client, client), *argv, env=env, transport_kwargs={"stderr": None})
    async with spawned as (conn, _proc):
        inner = conn._conn  # type: ignore[attr-defined]
        writer = inner._transport._sender._writer
        reader = inner._transport._reader
        write, handle_response, feed_data = writer.write, inner._handle_response, reader.feed_data

        def probed_write(data: bytes) -> None:
            stamp = pc()
            for line in data.split(b"\n"):
                if line:
                    message = json.loads(line)
                    rid = message.get("id")
                    if isinstance(rid, int) and message.get("method") == "session/prompt":
                        sent[rid] = stamp
                        session_of[rid] = message["params"]["sessionId"]
            write(data)

        def probed_handle_response(message: dict[str, Any]) -> None:
            rid = message.get("id")
            if isinstance(rid, int):
                received[rid] = pc()
            handle_response(message)

        def probed_feed_data(data: bytes) -> None:
            arrived.append((pc(), data.count(b'"stopReason"')))
            feed_data(data)

        writer.write = probed_write
        reader.feed_data = probed_feed_data
        inner._handle_response = probed_handle_response
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
    return {
        "recs": recs,
        "client_cpu_s": cpu,
        "wall_s": wall,
        "t0": wall0,
        "t1": wall0 + wall,
        "gcs": collections,
        "sent": sent,
        "received": received,
        "sessions": session_of,
        "arrived": [a for a in arrived if wall0 <= a[0] <= wall0 + wall],
    }


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _lines(data: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.split("\n") if line]


def _server_view(probe: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """Per prompt id: (request read, session, lines in that read, answer written, answers in that write,
    its place in it); and the timed window's collections and passes."""
    requests: dict[int, tuple[float, str, int]] = {}
    pending = ""
    for stamp, data in probe["reads"]:
        *lines, pending = (pending + data).split("\n")
        for message in _lines("\n".join(lines)):
            if message.get("method") == "session/prompt":
                requests[message["id"]] = (stamp, message["params"]["sessionId"], len(lines))
    answered: dict[int, tuple[float, int, int]] = {}
    for stamp, data in probe["writes"]:
        ids = [
            m["id"]
            for m in _lines(data)
            if "result" in m and isinstance(m["result"], dict) and "stopReason" in m["result"]
        ]
        for place, rid in enumerate(ids):
            answered[rid] = (stamp, len(ids), place)
    prompts = {rid: (*requests[rid], *answered[rid]) for rid in requests if rid in answered}
    gcs = [g for g in probe["gcs"] if t0 <= g[0] <= t1]
    passes = [p for p in probe["passes"] if t0 <= p[0] <= t1]
    writes = [w for w in probe["writes"] if t0 <= w[0] <= t1]
    return {"prompts": prompts, "gcs": gcs, "passes": passes, "writes": writes}


def _ids(run: dict[str, Any]) -> list[tuple[int, str, float, float]]:
    """The run's timed prompts as (request id, session, started, done): each is the first request its
    session's loop wrote after it started."""
    sent: dict[str, list[tuple[float, int]]] = {}
    for rid, stamp in run["sent"].items():
        session = run["sessions"].get(rid)
        if session is not None:
            sent.setdefault(session, []).append((stamp, rid))
    for stamps in sent.values():
        stamps.sort()
    result = []
    for session, started, done in run["recs"]:
        stamps = sent.get(session, [])
        k = bisect.bisect_left(stamps, (started, -1))
        if k < len(stamps) and stamps[k][0] <= done:
            result.append((stamps[k][1], session, started, done))
    return result


def _dist(values: list[float]) -> str:
    if not values:
        return "-"
    return f"p50 {_q(values, 0.5) * 1e3:.2f} / p99 {_q(values, 0.99) * 1e3:.2f} / mean {sum(values) / len(values) * 1e3:.2f} ms"


def _hist(values: list[int]) -> str:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return " ".join(f"{k}:{counts[k]}" for k in sorted(counts))


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
    # The client's side, for every agent: started -> written (the client's sender), written -> received
    # (the agent, both pipes, and the client's receive loop getting to the line), received -> done (the
    # client handling the answer and the prompt's updates, and its task getting its turn).
    rows = []  # (total, started->sent, sent->received, received->done, rid, run index)
    for n, run in enumerate(runs):
        for rid, _session, started, done in _ids(run):
            sent, received = run["sent"].get(rid), run["received"].get(rid)
            if sent is None or received is None:
                continue
            rows.append((done - started, sent - started, received - sent, done - received, rid, n))
    slow = sorted(rows, reverse=True)[: max(1, count // 100)]
    print(
        f"  client: started->written {_dist([r[1] for r in rows])}; written->received {_dist([r[2] for r in rows])}; "
        f"received->done {_dist([r[3] for r in rows])}"
    )
    print(
        f"  slowest 1%, mean: started->written {sum(r[1] for r in slow) / len(slow) * 1e3:.2f}, written->received "
        f"{sum(r[2] for r in slow) / len(slow) * 1e3:.2f}, received->done {sum(r[3] for r in slow) / len(slow) * 1e3:.2f} ms"
    )
    arrived = [n for r in runs for _, n in r["arrived"]]
    print(f"  answers per chunk the client read: {_hist(arrived)} (mean {sum(arrived) / max(1, len(arrived)):.2f})")
    views = [_server_view(p, r["t0"], r["t1"]) if p is not None else None for p, r in zip(probes, runs, strict=True)]
    if not any(views):
        return
    live = [v for v in views if v is not None]
    served = [p[3] - p[0] for v in live for p in v["prompts"].values()]
    batch = [p[2] for v in live for p in v["prompts"].values()]
    joined = [len([m for m in _lines(d) if "stopReason" in json.dumps(m)]) for v in live for _, d in v["writes"]]
    durations = [p[1] - p[0] for v in live for p in v["passes"]]
    longs = [p for v in live for p in v["passes"] if isinstance(p[3], list)]
    long_cpu = sum(p[2] for p in longs) / max(1e-9, sum(p[1] - p[0] for p in longs))
    gcs = [g for v in live for g in v["gcs"]]
    print(
        f"  server, request read -> answer written: {_dist(served)}, max {max(served) * 1e3:.2f} ms; lines per "
        f"read: mean {sum(batch) / len(batch):.1f}, max {max(batch)}; answers per write: {_hist(joined)}"
    )
    # Prompts read together and answered in one write: in the order they were read, or not (trio runs a
    # batch of runnable tasks in its order or reversed, at random, unless the server fixes it).
    orders = {"in read order": 0, "reversed": 0, "other": 0}
    for v in live:
        for _, data in v["writes"]:
            ids = [m["id"] for m in _lines(data) if isinstance(m.get("result"), dict) and "stopReason" in m["result"]]
            read = [(v["prompts"][i][0], i) for i in ids if i in v["prompts"]]
            if len(read) < 2:
                continue
            ordered = [i for _, i in sorted(read)]
            order = [i for _, i in read]
            key = "in read order" if order == ordered else "reversed" if order == ordered[::-1] else "other"
            orders[key] += 1
    print("  writes of 2 answers or more: " + ", ".join(f"{v} {k}" for k, v in orders.items()))
    print(
        f"  passes: {len(durations)}, p50 {_q(durations, 0.5) * 1e3:.3f} ms, p99 {_q(durations, 0.99) * 1e3:.3f} ms, "
        f"max {max(durations) * 1e3:.2f} ms, {len(longs)} over {_LONG_PASS_S * 1e3:.0f} ms (on a CPU "
        f"{long_cpu:.0%} of their time, tasks per long pass: mean "
        f"{sum(len(p[3]) for p in longs) / max(1, len(longs)):.1f}); collections in the "
        f"timed part: {len(gcs)} (by generation {[sum(1 for g in gcs if g[2] == n) for n in range(3)]}, "
        f"max {max((b - a for a, b, _ in gcs), default=0) * 1e3:.2f} ms)"
    )
    split = []  # per prompt with a server record: written->read, read->written, written->received, place
    for row in rows:
        view = views[row[5]]
        if view is None or row[4] not in view["prompts"]:
            continue
        read, _s, _lines_n, written, answers, place = view["prompts"][row[4]]
        run = runs[row[5]]
        split.append((row, read - run["sent"][row[4]], written - read, run["received"][row[4]] - written, answers, place))
    print(
        f"  every prompt: written->read {_dist([x[1] for x in split])}; read->written {_dist([x[2] for x in split])}; "
        f"written->received {_dist([x[3] for x in split])}"
    )
    print(
        "  slowest 1%: client ms = started->written + written->read + read->written + written->received + "
        "received->done; answers in its write (place); overlaps"
    )
    keyed = {(x[0][4], x[0][5]): x for x in split}
    for row in slow:
        x = keyed.get((row[4], row[5]))
        if x is None:
            continue
        view = views[row[5]]
        assert view is not None
        run = runs[row[5]]
        start, done = run["sent"][row[4]] - row[1], run["sent"][row[4]] - row[1] + row[0]
        hits = [f"gc{g[2]} {(g[1] - g[0]) * 1e3:.1f} ms" for g in view["gcs"] if start <= g[1] and g[0] <= done]
        hits += [
            f"pass {(p[1] - p[0]) * 1e3:.1f} ms (CPU {p[2] * 1e3:.1f})"
            for p in view["passes"]
            if isinstance(p[3], list) and start <= p[1] and p[0] <= done
        ]
        print(
            f"    {row[0] * 1e3:6.2f} = {row[1] * 1e3:5.2f} + {x[1] * 1e3:5.2f} + {x[2] * 1e3:5.2f} + {x[3] * 1e3:5.2f} + "
            f"{row[3] * 1e3:5.2f}; {x[4]} ({x[5] + 1}); {', '.join(hits) or '-'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=150, help="timed prompts per session and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also probe the acp_server package of another source tree (e.g. main's, from git archive) by turns",
    )
    parser.add_argument("--dump", metavar="FILE", help="also write every run's stamps and probes here (JSON)")
    parser.add_argument("--serve", metavar="OUT", help=argparse.SUPPRESS)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    if args.serve:
        raise SystemExit(_serve(args.serve, serve_args))
    sys.path.insert(0, str(_HERE))
    from servers import sdk_echo_argv

    text = " ".join(["hello"] * args.words)
    # Each probed server: its name and the PYTHONPATH it runs with (None: this venv's acp_server).
    probed: dict[str, str | None] = {"acp-server": None}
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        probed[name] = str(Path(tree).resolve())
    names = [*probed, "sdk"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    probes: dict[str, list[dict[str, Any] | None]] = {name: [] for name in probed}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                out = Path(tmp, f"probe{r}-{len(runs[name])}-{names.index(name)}.json")
                if name in probed:
                    argv = [sys.executable, str(Path(__file__).resolve()), "--serve", str(out), *serve_args]
                    tree = probed[name]
                    env = {"PYTHONPATH": tree} if tree else None
                else:
                    argv, env = sdk_echo_argv(), None
                runs[name].append(asyncio.run(_client(argv, text, args.sessions, args.prompts, env)))
                if name in probed:
                    probes[name].append(json.loads(out.read_text()) if out.exists() else None)
    print(f"{args.sessions} sessions, {args.words}-word prompts, {args.rounds} rounds, serve args {serve_args}")
    if args.dump:
        Path(args.dump).write_text(json.dumps({"runs": runs, "probes": probes}))
    for name in probed:
        _report(name if probed[name] is None else f"{name} ({probed[name]})", runs[name], probes[name])
    _report("sdk echo agent", runs["sdk"], [None] * len(runs["sdk"]))


if __name__ == "__main__":
    main()
