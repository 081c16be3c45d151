"""What the benchmark reads about a process from ``/proc`` (Linux), and small statistics helpers.

CPU time is the sum of ``sum_exec_runtime`` over the process's threads (``/proc/PID/task/*/schedstat``,
nanoseconds); where schedstat is missing it falls back to ``utime + stime`` of ``/proc/PID/stat``
(clock ticks, usually 10 ms, so short windows round badly there). Memory is ``VmRSS``.

How the machine's idle CPUs wait (``/sys``) is read beside them: in a virtual machine whose idle vCPUs
halt at once (the ``haltpoll`` cpuidle driver with ``guest_halt_poll_ns`` 0), every sleep of a process
between two requests exits to the hypervisor, and the process pays for it when it wakes (a 1-word
sequential echo prompt over stdio costs our server ~2.5x what it costs when the vCPU polls a while
before it halts: bench/README.md, "Goal 2's 1-word gap is this VM's halt").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "GUEST_HALT_POLL_NS",
    "cpu_seconds",
    "cpu_source",
    "describe_idle",
    "guest_halt_poll",
    "idle_policy",
    "percentile",
    "rss_bytes",
]

GUEST_HALT_POLL_NS = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
_CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")

_TICK = os.sysconf("SC_CLK_TCK")


def _schedstat_seconds(pid: int) -> float | None:
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended, or no schedstat at all
    return total / 1e9 if total else None


def _stat_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        # The command name may hold spaces: fields are counted after its closing parenthesis.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of proc(5))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used so far."""
    precise = _schedstat_seconds(pid)
    return precise if precise is not None else _stat_seconds(pid)


def cpu_source(pid: int) -> str:
    """Which counter :func:`cpu_seconds` reads for ``pid``."""
    if _schedstat_seconds(pid) is not None:
        return "/proc/PID/task/*/schedstat (ns)"
    return f"/proc/PID/stat utime+stime (1/{_TICK} s ticks)"


def idle_policy(halt_poll: Path = GUEST_HALT_POLL_NS, cpuidle: Path = _CPUIDLE) -> dict[str, str]:
    """The cpuidle governor and driver, and the guest's halt-polling window (ns) where the haltpoll
    driver has one: what a process's sleep between two requests costs it on wake-up depends on them.
    Keys are left out where the machine does not say."""
    found: dict[str, str] = {}
    for key, path in (
        ("governor", cpuidle / "current_governor"),
        ("driver", cpuidle / "current_driver"),
        ("guest_halt_poll_ns", halt_poll),
    ):
        try:
            found[key] = path.read_text().strip()
        except OSError:
            continue
    return found


def describe_idle(policy: dict[str, str]) -> str:
    """One line for a report's header, e.g. ``idle CPUs: cpuidle haltpoll/haltpoll, guest halt polling 0 ns``."""
    if not policy:
        return "idle CPUs: not known (no /sys/devices/system/cpu/cpuidle)"
    parts = ["cpuidle " + "/".join(policy[k] for k in ("driver", "governor") if k in policy)]
    if "guest_halt_poll_ns" in policy:
        parts.append(f"guest halt polling {policy['guest_halt_poll_ns']} ns")
    return "idle CPUs: " + ", ".join(parts)


@contextmanager
def guest_halt_poll(ns: int | None, path: Path = GUEST_HALT_POLL_NS) -> Iterator[None]:
    """Set the guest's halt-polling window to ``ns`` for the ``with`` block, then put the old value back
    (``None``: leave it as it is). Machine-wide and root only: an opt-in of the benchmarks that show
    what the VM's halt costs, never their default. Raises ``ValueError`` for a negative window and
    ``PermissionError``/``FileNotFoundError`` (``OSError``) naming the file when it cannot be set."""
    if ns is None:
        yield
        return
    if ns < 0:
        raise ValueError(f"a halt-polling window is 0 or more nanoseconds, not {ns}")
    try:
        old = path.read_text().strip()
        path.write_text(f"{ns}\n")
    except OSError as exc:
        raise type(exc)(
            exc.errno, f"cannot set {path} ({exc.strerror}): it needs the haltpoll cpuidle driver and root"
        ) from exc
    try:
        yield
    finally:
        path.write_text(f"{old}\n")


def rss_bytes(pid: int) -> int:
    """Resident set size (``VmRSS``) of the process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]
