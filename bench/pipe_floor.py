"""The floor under scenario 1's sequential rows: what a stdio peer costs when it does nothing at all.

A child process that only copies its stdin to its stdout (``os.read``, ``os.write``, no parsing, no
event loop) is driven through pipes the way the SDK client drives an agent: write a request, wait for
its answer, write the next. Its CPU per round trip, read from ``/proc`` like an agent's, is the least
any stdio agent can cost per sequential prompt on this machine. Where idle vCPUs halt at once (this
VM: haltpoll's ``guest_halt_poll_ns`` 0) that least is not small: each wait ends in a wake-up from the
hypervisor, and the child pays for it in system time and in slower user time afterwards
(bench/README.md, "Goal 2's 1-word gap is this VM's halt").

``python bench/pipe_floor.py [--round-trips N] [--bytes B] [--think-us US] [--guest-halt-poll-ns NS]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from procfs import cpu_seconds, describe_idle, guest_halt_poll, idle_policy

__all__ = ["ECHO_CHILD", "pipe_floor"]

# The child: one read, one write, until end of input. Nothing else runs in it between the two.
ECHO_CHILD = (
    "import os\n"
    "r, w = 0, 1\n"
    "while True:\n"
    "    b = os.read(r, 65536)\n"
    "    if not b:\n"
    "        break\n"
    "    os.write(w, b)\n"
)


def pipe_floor(
    round_trips: int = 20_000, size: int = 200, think_us: float = 0.0, warmup: int = 500
) -> dict[str, Any]:
    """CPU (us) the bare echo child spends per round trip of ``size`` bytes, and the wall time.

    ``size`` defaults to about a 1-word prompt's request line; the child reads each request whole
    (one write of at most 64 KiB into a pipe arrives in one read when the reader is waiting).
    ``think_us``: the driver spins that long between an answer and its next request, as a client
    turns an answer around (the SDK client takes ~80-130 us a prompt here); the longer the child's
    vCPU stays halted, the more the child pays when it wakes.
    """
    if round_trips < 1 or size < 1:
        raise ValueError("round_trips and size must be at least 1")
    message = b"x" * (size - 1) + b"\n"
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", ECHO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert child.stdin is not None and child.stdout is not None
    w, r = child.stdin.fileno(), child.stdout.fileno()

    think_s = think_us / 1e6

    def trip() -> None:
        if think_s:
            until = time.perf_counter() + think_s
            while time.perf_counter() < until:
                pass
        os.write(w, message)
        got = 0
        while got < size:
            chunk = os.read(r, 65536)
            if not chunk:
                raise RuntimeError("the echo child ended early")
            got += len(chunk)

    try:
        for _ in range(warmup):
            trip()
        cpu0, wall0 = cpu_seconds(child.pid), time.perf_counter()
        for _ in range(round_trips):
            trip()
        cpu1, wall1 = cpu_seconds(child.pid), time.perf_counter()
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        child.stdout.close()
    return {
        "round_trips": round_trips,
        "bytes": size,
        "think_us": think_us,
        "cpu_us_per_round_trip": (cpu1 - cpu0) * 1e6 / round_trips,
        "wall_us_per_round_trip": (wall1 - wall0) * 1e6 / round_trips,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=20_000, metavar="N")
    parser.add_argument("--bytes", type=int, default=200, metavar="B", help="request size (default 200)")
    parser.add_argument(
        "--guest-halt-poll-ns", type=int, default=None, metavar="NS",
        help="set the VM's halt-polling window for this run (root, machine-wide; put back after)",
    )
    parser.add_argument(
        "--think-us", type=float, default=0.0, metavar="US",
        help="the driver spins this long between an answer and the next request (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.round_trips < 1:
        parser.error(f"--round-trips must be at least 1, not {args.round_trips}")
    if args.bytes < 1:
        parser.error(f"--bytes must be at least 1, not {args.bytes}")
    if args.think_us < 0:
        parser.error(f"--think-us must be 0 or more, not {args.think_us}")
    with guest_halt_poll(args.guest_halt_poll_ns):
        idle = idle_policy()
        figures = pipe_floor(args.round_trips, args.bytes, args.think_us)
    figures["idle_cpus"] = idle
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(describe_idle(idle))
        print(
            f"bare pipe echo, {figures['round_trips']} round trips of {figures['bytes']} B: "
            f"{figures['cpu_us_per_round_trip']:.1f} us CPU per round trip in the child, "
            f"{figures['wall_us_per_round_trip']:.1f} us wall"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
