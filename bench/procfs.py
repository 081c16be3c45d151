"""What the benchmark reads about a process from ``/proc`` (Linux), and small statistics helpers.

CPU time is the sum of ``sum_exec_runtime`` over the process's threads (``/proc/PID/task/*/schedstat``,
nanoseconds); where schedstat is missing it falls back to ``utime + stime`` of ``/proc/PID/stat``
(clock ticks, usually 10 ms, so short windows round badly there). Memory is ``VmRSS``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

__all__ = ["cpu_seconds", "cpu_source", "percentile", "rss_bytes"]

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
