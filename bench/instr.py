"""``make bench-instr``: instructions per echo prompt, counted by callgrind, against a committed baseline.

A deterministic guard against regressions on the prompt path, where timing benchmarks on a shared
machine move by 10-20% from run to run. One process holds the server and its driver:
``acp_server.server.serve`` (no listener, store off: what ``serve --stdio`` runs) serves one connection
over two pipes (both ends :class:`~acp_server.transports.listeners.PipeStream`, the stdio transport)
through the real connection shell, JSON-RPC dispatch and bridge, and the driver sends pre-encoded
requests on the other end. It runs under
``valgrind --tool=callgrind`` with:

- ``PYTHONHASHSEED=0``, so that str hashes (dict and set layouts) are the same every run;
- trio's scheduler tuned as the command line tunes it (``acp_server.cli.tune_scheduler``: every batch of
  runnable tasks first-come, first-served, with no random draw, and trio's run loop and epoll manager
  given a two-argument ``min``/``max``), so that the counts are those of what ``serve`` runs; trio's
  generator is seeded first (``trio._core._run._r.seed(0)``), which keeps the run deterministic should
  ``tune_scheduler`` not find it (another trio); trio's Hypothesis mode, which sorts and shuffles every
  batch, is left off because the server does not run that way;
- a ``trio.testing.MockClock`` that stands still (``rate=0``): callgrind slows Python ~50x, and on the
  real clock timers (a runner's idle exit, the idle sweeper) would fire a different number of times
  per run. Nothing in the workload waits for time.

Phases are cut inside the one run: before each phase the driver calls ``os.getsid(0)`` and callgrind
runs with ``--dump-before=getsid``, so each phase's instructions land in a dump of their own (and the
counters restart at zero). Start-up, imports and a warm-up (which lets CPython 3.11 specialise the
hot bytecode) fall in the first dump; shutdown in the last. Nothing else in the process calls
``getsid``: the run checks that it got exactly one dump per phase and fails otherwise. The counts
include the in-process driver, kept small (requests encoded once, answers scanned by msgspec).

Phases (each a figure: instructions per prompt):
    sequential-1word   one session, one-word prompts one after the other (1 update each)
    sequential-9words  the same with the nine-word prompt of ``make bench`` scenario 1 (9 updates)
    pipelined-1word    100 sessions x 2 one-word prompts written at once, answers read, repeated
    sequential-1word-no-turn-states
                       sequential-1word on a second connection that did not ask for turn states (as
                       the official SDK client, the client of ``make bench`` scenario 1, does not)

The first three phases run on a connection that asks for turn states (``_meta.turnStates``).

Usage::

    python bench/instr.py            # measure, compare with bench/instr_baseline.json (exit 1 above +10%)
    python bench/instr.py --record   # measure and write the baseline (with the CPython and valgrind versions)
    python bench/instr.py --keep DIR # also keep the dumps: callgrind_annotate DIR/callgrind.out.2 (phase 1)
    python bench/instr.py --workload [--direct]   # the workload alone (--direct: without the markers' check)

The comparison skips, and says so, when the baseline was recorded with another CPython or valgrind
version (instruction counts differ between builds), or for another workload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

BENCH = Path(__file__).resolve().parent
BASELINE = BENCH / "instr_baseline.json"
#: the most a figure may grow over its baseline before ``make bench-instr`` fails
TOLERANCE = 0.10
#: the libc function whose entry cuts the phases (``--dump-before``); os.getsid calls it, nothing else does
MARKER = "getsid"
NINE_WORDS = "the quick brown fox jumps over the lazy dog"

#: name -> (what, sizes); the sizes are part of the baseline (another workload is not compared)
WORKLOAD: dict[str, Any] = {
    "warmup_sequential": 100,
    "warmup_pipelined_rounds": 1,
    "sequential": 300,
    "pipelined_sessions": 100,
    "pipelined_depth": 2,
    "pipelined_rounds": 3,
    "stream": "pipes",
}
PHASES = ("sequential-1word", "sequential-9words", "pipelined-1word", "sequential-1word-no-turn-states")


# --- the workload (runs inside callgrind) --------------------------------------------------------


def _prompt_template(session_id: str, text: str) -> bytes:
    params = msgspec.json.encode({"sessionId": session_id, "prompt": [{"type": "text", "text": text}]})
    return b'{"jsonrpc":"2.0","id":%d,"method":"session/prompt","params":' + params.replace(b"%", b"%%") + b"}\n"


def run_workload(sizes: dict[str, Any], marker: bool) -> dict[str, int]:
    """Serve the fixed workload in this process; the counts it saw (checked by the caller).

    Args:
        sizes: the :data:`WORKLOAD` counts.
        marker: call ``os.getsid(0)`` before each phase and after the last (the callgrind cuts).
    """
    import trio
    import trio.testing
    from trio._core import _run as trio_run

    from acp_server.cli import tune_gc, tune_scheduler
    from acp_server.server import Server, ServerConfig, serve
    from acp_server.transports.listeners import PipeStream

    trio_run._r.seed(0)
    tune_scheduler()  # what the command line does before serving (cli.main)

    class Msg(msgspec.Struct):
        id: int | None = None
        method: str | None = None
        result: msgspec.Raw = msgspec.Raw(b"")
        error: msgspec.Raw = msgspec.Raw(b"")

    decode = msgspec.json.Decoder(Msg).decode
    seen = {"answers": 0, "updates": 0, "other_notifications": 0, "phases": 0}

    def cut() -> None:
        if marker:
            os.getsid(0)
        seen["phases"] += 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server: Server = await nursery.start(serve, ServerConfig())
            # Two pipes, each end a PipeStream: what ``serve --stdio`` reads and writes (trio's memory
            # streams take two extra scheduler passes per read and per write, which no transport has).
            server_in, driver_out = os.pipe()
            driver_in, server_out = os.pipe()
            theirs = PipeStream(server_in, server_out)
            ours = PipeStream(driver_in, driver_out)
            nursery.start_soon(server.handle_stream, theirs, "instr")
            # A second connection that does not ask for turn states: the official SDK client's path.
            quiet_in, quiet_driver_out = os.pipe()
            quiet_driver_in, quiet_out = os.pipe()
            nursery.start_soon(server.handle_stream, PipeStream(quiet_in, quiet_out), "instr-quiet")
            quiet = PipeStream(quiet_driver_in, quiet_driver_out)
            bufs = {ours: bytearray(), quiet: bytearray()}
            next_id = 1

            async def answers(count: int, link: PipeStream = ours) -> list[bytes]:
                """Read until ``count`` answers arrived on ``link``; their results (an error stops the run)."""
                buf = bufs[link]
                results: list[bytes] = []
                while len(results) < count:
                    data = await link.receive_some(65536)
                    if not data:
                        raise RuntimeError("the server closed the connection")
                    buf.extend(data)
                    end = buf.rfind(b"\n") + 1
                    for line in bytes(buf[:end]).splitlines():
                        msg = decode(line)
                        if msg.id is None:
                            if msg.method == "session/update":
                                seen["updates"] += 1
                            else:
                                seen["other_notifications"] += 1
                        elif msg.error:
                            raise RuntimeError(f"request {msg.id} failed: {bytes(msg.error).decode()}")
                        else:
                            results.append(bytes(msg.result))
                    del buf[:end]
                seen["answers"] += len(results)
                return results

            async def call(method: str, params: dict[str, Any], link: PipeStream = ours) -> Any:
                nonlocal next_id
                request = {"jsonrpc": "2.0", "id": next_id, "method": method, "params": params}
                next_id += 1
                await link.send_all(msgspec.json.encode(request) + b"\n")
                return msgspec.json.decode((await answers(1, link))[0])

            async def sequential(template: bytes, count: int, link: PipeStream = ours) -> None:
                nonlocal next_id
                for _ in range(count):
                    await link.send_all(template % next_id)
                    next_id += 1
                    (result,) = await answers(1, link)
                    if b'"end_turn"' not in result:
                        raise RuntimeError(f"a prompt did not end its turn: {result!r}")

            async def pipelined(templates: list[bytes], rounds: int) -> None:
                nonlocal next_id
                depth = sizes["pipelined_depth"]
                for _ in range(rounds):
                    batch = []
                    for template in templates:
                        for _ in range(depth):
                            batch.append(template % next_id)
                            next_id += 1
                    await ours.send_all(b"".join(batch))
                    results = await answers(len(batch))
                    if sum(b'"end_turn"' in r for r in results) != len(batch):
                        raise RuntimeError("a pipelined prompt did not end its turn")

            # Asks for _acp_server/turn_state (sent only to a connection that asks): the guard covers
            # their path too, and every prompt does the work the baseline counted.
            await call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"turnStates": True}})
            new_session = {"cwd": "/tmp", "mcpServers": []}
            first = (await call("session/new", new_session))["sessionId"]
            many = [(await call("session/new", new_session))["sessionId"] for _ in range(sizes["pipelined_sessions"])]
            one_word = _prompt_template(first, "hello")
            nine_words = _prompt_template(first, NINE_WORDS)
            many_templates = [_prompt_template(s, "hello") for s in many]
            await call("initialize", {"protocolVersion": 1, "clientCapabilities": {}}, quiet)
            quiet_word = _prompt_template((await call("session/new", new_session, quiet))["sessionId"], "hello")
            tune_gc()  # what the command line does before serving: start-up objects frozen out of the GC
            await sequential(one_word, sizes["warmup_sequential"])
            await sequential(nine_words, sizes["warmup_sequential"])
            await pipelined(many_templates, sizes["warmup_pipelined_rounds"])
            await sequential(quiet_word, sizes["warmup_sequential"], quiet)

            cut()
            await sequential(one_word, sizes["sequential"])
            cut()
            await sequential(nine_words, sizes["sequential"])
            cut()
            await pipelined(many_templates, sizes["pipelined_rounds"])
            cut()
            await sequential(quiet_word, sizes["sequential"], quiet)
            cut()
            await quiet.aclose()
            await ours.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(rate=0))
    return seen


def expected_counts(sizes: dict[str, Any]) -> dict[str, int]:
    """The answers and updates the workload must see (a run that saw others measured something else)."""
    seq = sizes["warmup_sequential"] + sizes["sequential"]
    pipe = sizes["pipelined_sessions"] * sizes["pipelined_depth"] * (
        sizes["warmup_pipelined_rounds"] + sizes["pipelined_rounds"]
    )
    calls = 4 + sizes["pipelined_sessions"]  # initialize and session/new on each connection
    return {
        "answers": calls + 3 * seq + pipe,
        "updates": seq * (2 + len(NINE_WORDS.split())) + pipe,
        "phases": len(PHASES) + 1,
    }


def prompts_per_phase(sizes: dict[str, Any]) -> dict[str, int]:
    pipe = sizes["pipelined_sessions"] * sizes["pipelined_depth"] * sizes["pipelined_rounds"]
    return dict(zip(PHASES, (sizes["sequential"], sizes["sequential"], pipe, sizes["sequential"]), strict=True))


def check_counts(seen: dict[str, int], sizes: dict[str, Any]) -> None:
    want = expected_counts(sizes)
    got = {k: seen[k] for k in want}
    if got != want:
        raise SystemExit(f"bench-instr: the workload saw {got}, expected {want}")


# --- callgrind ------------------------------------------------------------------------------------


def valgrind_version() -> str | None:
    exe = shutil.which("valgrind")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """What the counts depend on; ``python`` and ``valgrind`` must match the baseline's to compare."""
    from importlib.metadata import PackageNotFoundError, version

    def dist(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "valgrind": valgrind_version(),
        "machine": platform.machine(),
        "trio": dist("trio"),
        "msgspec": dist("msgspec"),
    }


_PART = re.compile(r"^part: *(\d+)$", re.M)
_SUMMARY = re.compile(r"^summary: *(\d+)$", re.M)


def read_dumps(out_dir: Path) -> list[int]:
    """The instruction total of each callgrind dump in ``out_dir``, in part order."""
    parts: dict[int, int] = {}
    for path in out_dir.glob("callgrind.out*"):
        text = path.read_text(errors="replace")
        part, summary = _PART.search(text), _SUMMARY.search(text)
        if part is None or summary is None:
            raise SystemExit(f"bench-instr: {path} has no part/summary line")
        parts[int(part.group(1))] = int(summary.group(1))
    return [parts[k] for k in sorted(parts)]


def measure(keep: Path | None = None) -> dict[str, Any]:
    """Run the workload under callgrind; instructions per prompt of each phase.

    Args:
        keep: copy the callgrind dumps here (``callgrind.out.N`` is phase N, for ``callgrind_annotate``).
    """
    exe = shutil.which("valgrind")
    if exe is None:
        raise SystemExit("bench-instr: valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="acp-instr-") as tmp:
        out_dir = Path(tmp)
        seen_file = out_dir / "seen.json"
        argv = [
            exe,
            "--tool=callgrind",
            f"--dump-before={MARKER}",
            f"--callgrind-out-file={out_dir / 'callgrind.out'}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--workload",
            "--seen",
            str(seen_file),
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, cwd=BENCH.parent)
        if proc.returncode != 0:
            raise SystemExit(f"bench-instr: the workload failed under callgrind:\n{proc.stderr[-3000:]}")
        seen = json.loads(seen_file.read_text())
        check_counts(seen, WORKLOAD)
        dumps = read_dumps(out_dir)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for path in out_dir.glob("callgrind.out*"):
                shutil.copy(path, keep / path.name)
    # dumps: [start-up + warm-up, phase 1, ..., phase 4, shutdown]
    if len(dumps) != len(PHASES) + 2:
        raise SystemExit(
            f"bench-instr: expected {len(PHASES) + 2} callgrind dumps (one per {MARKER} call, plus the end), "
            f"got {len(dumps)}: something else called {MARKER}, the phases cannot be told apart"
        )
    counts = prompts_per_phase(WORKLOAD)
    figures = {name: round(dumps[i + 1] / counts[name]) for i, name in enumerate(PHASES)}
    return {
        "instructions_per_prompt": figures,
        "phase_instructions": dict(zip(PHASES, dumps[1:-1], strict=True)),
        "startup_and_warmup_instructions": dumps[0],
        "shutdown_instructions": dumps[-1],
    }


# --- the comparison -------------------------------------------------------------------------------


def compare(current: dict[str, int], baseline: dict[str, Any], now: dict[str, str | None]) -> tuple[int, list[str]]:
    """Exit status and the lines to print: 0 within tolerance (or skipped), 1 above it."""
    then = baseline.get("versions", {})
    for key in ("python", "valgrind"):
        if then.get(key) != now.get(key):
            return 0, [
                f"bench-instr: SKIPPED: the baseline was recorded with {key} {then.get(key)!r}, this is "
                f"{now.get(key)!r} (instruction counts differ between builds); re-record with "
                "`make bench-instr-record` to guard this machine"
            ]
    if baseline.get("workload") != WORKLOAD:
        return 0, ["bench-instr: SKIPPED: the baseline is of another workload; re-record with `make bench-instr-record`"]
    lines, status = [], 0
    for name, count in current.items():
        base = baseline["instructions_per_prompt"].get(name)
        if base is None:
            lines.append(f"  {name}: {count:,} instructions per prompt (no baseline)")
            continue
        change = count / base - 1
        verdict = "ok"
        if count > base * (1 + TOLERANCE):
            verdict, status = f"REGRESSION (over +{TOLERANCE:.0%})", 1
        elif count < base * (1 - TOLERANCE):
            verdict = "faster: re-record the baseline to tighten the guard"
        lines.append(f"  {name}: {count:,} instructions per prompt, baseline {base:,} ({change:+.1%}) {verdict}")
    drift = [f"{k} {baseline['versions'].get(k)} -> {now.get(k)}" for k in ("trio", "msgspec") if then.get(k) != now.get(k)]
    if drift:
        lines.append(f"  note: dependencies differ from the baseline's: {', '.join(drift)}")
    of = f" (baseline of {baseline.get('git_commit') or 'an unknown commit'})"
    head = f"bench-instr: FAILED: instructions per prompt grew over the baseline{of}" if status else f"bench-instr: ok{of}"
    return status, [head, *lines]


def _git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/instr.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"write the baseline ({BASELINE.name})")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="the baseline JSON")
    parser.add_argument("--out", type=Path, help="also write this run's figures as JSON here")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="keep the callgrind dumps in DIR (callgrind.out.2-4: the phases)"
    )
    parser.add_argument("--workload", action="store_true", help="run the workload in this process")
    parser.add_argument("--direct", action="store_true", help="with --workload: no callgrind markers")
    parser.add_argument("--seen", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workload:
        seen = run_workload(WORKLOAD, marker=not args.direct)
        if args.seen:
            args.seen.write_text(json.dumps(seen))
        check_counts(seen, WORKLOAD)
        print(json.dumps(seen))
        return 0
    now = versions()
    result = {"versions": now, "workload": WORKLOAD, "git_commit": _git_commit(), **measure(args.keep)}
    figures: dict[str, int] = result["instructions_per_prompt"]
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.record:
        args.baseline.write_text(json.dumps(result, indent=2) + "\n")
        print(f"bench-instr: recorded {args.baseline} ({now['python']}, {now['valgrind']}):")
        for name, count in figures.items():
            print(f"  {name}: {count:,} instructions per prompt")
        return 0
    if not args.baseline.exists():
        print(f"bench-instr: SKIPPED: no baseline at {args.baseline}; record one with `make bench-instr-record`")
        return 0
    status, lines = compare(figures, json.loads(args.baseline.read_text()), now)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
