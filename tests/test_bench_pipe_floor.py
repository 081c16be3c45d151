"""``bench/pipe_floor.py``: the floor under scenario 1's sequential rows (a child that only copies its
stdin to its stdout, driven like an agent). Small counts: this shows it measures and cleans up, the
figures themselves are ``make bench``'s."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest

from .helpers import ROOT

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def pipe_floor() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its sibling import (procfs)
    try:
        spec = importlib.util.spec_from_file_location("bench_pipe_floor", BENCH / "pipe_floor.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _echo_children() -> list[str]:
    """Processes of ours running the echo child (its source is on its command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == os.getpid() and b"os.read(r, 65536)" in cmdline:
            found.append(pid)
    return found


def test_it_measures_the_child_and_leaves_no_process(pipe_floor: ModuleType) -> None:
    figures = pipe_floor.pipe_floor(round_trips=200, size=300, think_us=20, warmup=20)
    assert figures["round_trips"] == 200 and figures["bytes"] == 300 and figures["think_us"] == 20
    # The child did work (a read and a write per trip) and the driver waited for every answer,
    # spinning 20 us before each request.
    assert 0 < figures["cpu_us_per_round_trip"] < figures["wall_us_per_round_trip"]
    assert figures["wall_us_per_round_trip"] >= 20
    assert _echo_children() == [], "the echo child outlived the run"


def test_the_child_echoes_each_request_whole(pipe_floor: ModuleType) -> None:
    out = subprocess.run(
        [sys.executable, "-S", "-c", pipe_floor.ECHO_CHILD], input=b"one\ntwo\n", capture_output=True, timeout=30
    )
    assert out.returncode == 0 and out.stdout == b"one\ntwo\n"


@pytest.mark.parametrize("kw", [{"round_trips": 0}, {"size": 0}])
def test_it_refuses_empty_workloads(pipe_floor: ModuleType, kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        pipe_floor.pipe_floor(**kw)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bytes", "0"], "--bytes must be at least 1, not 0"),
        (["--round-trips", "0"], "--round-trips must be at least 1, not 0"),
        (["--think-us", "-1"], "--think-us must be 0 or more, not -1.0"),
    ],
)
def test_the_command_line_names_the_bad_flag(argv: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "pipe_floor.py"), *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and message in out.stderr


def test_the_command_line_prints_the_figures_and_the_idle_policy() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "pipe_floor.py"), "--round-trips", "100", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["round_trips"] == 100 and figures["cpu_us_per_round_trip"] > 0
    assert isinstance(figures["idle_cpus"], dict)
