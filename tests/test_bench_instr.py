"""``make bench-instr``: the workload it counts, and the verdicts of its comparison with the baseline.

The callgrind run itself (about a minute) is ``make bench-instr``, which ``make test-full`` runs; here
the workload runs without valgrind, to show it drives the server through every phase, and the
comparison is fed figures of our own.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from .helpers import ROOT

INSTR = ROOT / "bench" / "instr.py"


@pytest.fixture(scope="module")
def instr() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_instr", INSTR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_workload_answers_every_prompt_through_the_server() -> None:
    """Every prompt of every phase is answered end_turn with its updates (the run checks the counts)."""
    proc = subprocess.run(
        [sys.executable, str(INSTR), "--workload", "--direct"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    # 1 + 9 + 1 updates per sequential triple, 1 per pipelined prompt; 3 turn states per prompt besides
    # on the connection that asked for them (1,600 prompts), none on the other (400)
    assert seen["updates"] == 5200 and seen["other_notifications"] == 3 * 1600
    assert seen["answers"] == 104 + 2000 and seen["phases"] == 5


def test_the_committed_baseline_is_of_this_workload(instr: ModuleType) -> None:
    """Changing the workload without re-recording would turn the guard into a permanent skip."""
    baseline = json.loads(instr.BASELINE.read_text())
    assert baseline["workload"] == instr.WORKLOAD
    assert set(baseline["instructions_per_prompt"]) == set(instr.PHASES)
    assert {"python", "valgrind"} <= set(baseline["versions"])


def _baseline(instr: ModuleType, **figures: int) -> dict[str, Any]:
    return {
        "versions": {"python": "CPython 3.11.7", "valgrind": "valgrind-3.19.0", "trio": "0.35.0", "msgspec": "0.23.0"},
        "workload": dict(instr.WORKLOAD),
        "git_commit": "abc1234",
        "instructions_per_prompt": figures,
    }


NOW = {"python": "CPython 3.11.7", "valgrind": "valgrind-3.19.0", "trio": "0.35.0", "msgspec": "0.23.0"}


def test_growth_over_ten_percent_fails_and_says_so(instr: ModuleType) -> None:
    base = _baseline(instr, **{"sequential-1word": 1000, "pipelined-1word": 1000})
    status, lines = instr.compare({"sequential-1word": 1101, "pipelined-1word": 1000}, base, NOW)
    assert status == 1
    assert lines[0].startswith("bench-instr: FAILED") and "abc1234" in lines[0]
    assert any("sequential-1word" in line and "REGRESSION" in line and "+10.1%" in line for line in lines)
    assert not any("pipelined-1word" in line and "REGRESSION" in line for line in lines)


def test_growth_within_ten_percent_passes(instr: ModuleType) -> None:
    base = _baseline(instr, **{"sequential-1word": 1000})
    status, lines = instr.compare({"sequential-1word": 1100}, base, NOW)
    assert status == 0 and lines[0].startswith("bench-instr: ok")
    status, lines = instr.compare({"sequential-1word": 800}, base, NOW)
    assert status == 0 and "re-record" in lines[1]


@pytest.mark.parametrize("key", ["python", "valgrind"])
def test_another_python_or_valgrind_skips_with_a_message(instr: ModuleType, key: str) -> None:
    base = _baseline(instr, **{"sequential-1word": 1000})
    status, lines = instr.compare({"sequential-1word": 5000}, base, {**NOW, key: "other 9.9"})
    assert status == 0 and lines[0].startswith("bench-instr: SKIPPED") and key in lines[0]


def test_another_workload_skips(instr: ModuleType) -> None:
    base = _baseline(instr, **{"sequential-1word": 1000})
    base["workload"]["sequential"] += 1
    status, lines = instr.compare({"sequential-1word": 5000}, base, NOW)
    assert status == 0 and "another workload" in lines[0]


def test_dumps_are_read_in_part_order(instr: ModuleType, tmp_path: Any) -> None:
    for name, part, total in (("callgrind.out", 3, 30), ("callgrind.out.1", 1, 10), ("callgrind.out.2", 2, 20)):
        (tmp_path / name).write_text(f"version: 1\ncreator: callgrind-3.19.0\npart: {part}\nsummary: {total}\n")
    assert instr.read_dumps(tmp_path) == [10, 20, 30]
