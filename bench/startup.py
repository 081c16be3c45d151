"""Start-up figures of scenario 1: spawn to the answer of ``initialize`` on stdio, and spawn to exit.

What an editor feels when it opens a project: it spawns its agent and waits for ``initialize``. Each
run spawns a fresh process, writes one ``initialize`` request on its stdin at once (the pipe holds it
until the agent reads) and stops the clock when the answer's line arrives on stdout; stdin is then
closed and the process reaped, untimed. Agents alternate run by run, after one untimed run each (so
that both find their files in the page cache and their bytecode compiled: the processes run without
``PYTHONDONTWRITEBYTECODE``, as an editor would start them).
"""

from __future__ import annotations

import os
import selectors
import statistics
import subprocess
import time
from collections.abc import Sequence

from procfs import cpu_seconds
from servers import BenchError

__all__ = ["median_ms", "spawn_to_exit", "spawn_to_initialize", "startup_runs"]

_TIMEOUT_S = 60.0
#: the environment of the spawned processes: bytecode caches written, as outside a test harness
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
_INITIALIZE = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}}\n'


def spawn_to_initialize(argv: Sequence[str]) -> tuple[float, float]:
    """Seconds from spawning ``argv`` to reading the line that answers ``initialize``, and the CPU
    seconds the process had used by then (steadier than the wall time on a busy machine)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_ENV)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(_INITIALIZE)
        proc.stdin.flush()
        fd, buf = proc.stdout.fileno(), b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                if not sel.select(max(0.0, started + _TIMEOUT_S - time.perf_counter())):
                    raise BenchError(f"{argv[-1]}: no answer to initialize within {_TIMEOUT_S:g} s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise BenchError(f"{argv[-1]}: stdout closed before it answered initialize")
                buf += chunk
                for line in buf.split(b"\n")[:-1]:
                    if b'"id":1' in line.replace(b" ", b"") and b'"result"' in line:
                        return time.perf_counter() - started, cpu_seconds(proc.pid)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn_to_exit(argv: Sequence[str]) -> tuple[float, float]:
    """Seconds from spawning ``argv`` to its exit (it must exit 0), and the CPU seconds it used."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_ENV)
    assert proc.stderr is not None
    with proc.stderr:
        err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return elapsed, usage.ru_utime + usage.ru_stime


def startup_runs(
    agents: dict[str, list[str]], extra: dict[str, list[str]], runs: int
) -> dict[str, list[tuple[float, float]]]:
    """``runs`` alternating (wall, CPU) seconds per name: ``agents`` to their initialize answer, ``extra``
    to their exit."""
    timed: dict[str, list[tuple[float, float]]] = {name: [] for name in [*agents, *extra]}
    jobs = [(name, argv, spawn_to_initialize) for name, argv in agents.items()]
    jobs += [(name, argv, spawn_to_exit) for name, argv in extra.items()]
    for _, argv, fn in jobs:
        fn(argv)  # untimed: page cache and bytecode
    for r in range(runs):
        for name, argv, fn in jobs if r % 2 == 0 else jobs[::-1]:
            timed[name].append(fn(argv))
    return timed


def median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000
