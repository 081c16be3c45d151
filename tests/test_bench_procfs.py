"""``bench/procfs.py``'s view of how idle CPUs wait, and the opt-in that changes it for one benchmark run.

The sysfs files are stood in for by temporary ones: the real knob is machine-wide, and a test must not
touch it (``bench/sdk_ab.py --guest-halt-poll-ns`` is what does, by hand).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType

import pytest

from .helpers import ROOT

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def procfs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_procfs", BENCH / "procfs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sysfs(tmp_path: pathlib.Path, poll: str | None = "0\n") -> tuple[pathlib.Path, pathlib.Path]:
    cpuidle = tmp_path / "cpuidle"
    cpuidle.mkdir()
    (cpuidle / "current_governor").write_text("haltpoll\n")
    (cpuidle / "current_driver").write_text("haltpoll\n")
    knob = tmp_path / "guest_halt_poll_ns"
    if poll is not None:
        knob.write_text(poll)
    return knob, cpuidle


def test_idle_policy_reads_what_the_machine_says_and_leaves_out_the_rest(
    procfs: ModuleType, tmp_path: pathlib.Path
) -> None:
    knob, cpuidle = _sysfs(tmp_path)
    policy = procfs.idle_policy(knob, cpuidle)
    assert policy == {"governor": "haltpoll", "driver": "haltpoll", "guest_halt_poll_ns": "0"}
    assert procfs.describe_idle(policy) == "idle CPUs: cpuidle haltpoll/haltpoll, guest halt polling 0 ns"

    knob.unlink()  # bare metal, or a VM without the haltpoll driver
    (cpuidle / "current_driver").write_text("intel_idle\n")
    (cpuidle / "current_governor").write_text("menu\n")
    policy = procfs.idle_policy(knob, cpuidle)
    assert policy == {"governor": "menu", "driver": "intel_idle"}
    assert procfs.describe_idle(policy) == "idle CPUs: cpuidle intel_idle/menu"

    assert procfs.idle_policy(knob, tmp_path / "absent") == {}
    assert procfs.describe_idle({}).startswith("idle CPUs: not known")


def test_guest_halt_poll_sets_the_window_for_the_block_and_puts_the_old_one_back(
    procfs: ModuleType, tmp_path: pathlib.Path
) -> None:
    knob, _ = _sysfs(tmp_path, "0\n")
    with procfs.guest_halt_poll(200_000, knob):
        assert knob.read_text() == "200000\n"
    assert knob.read_text() == "0\n"

    with pytest.raises(RuntimeError, match="the run failed"), procfs.guest_halt_poll(50_000, knob):
        assert knob.read_text() == "50000\n"
        raise RuntimeError("the run failed")
    assert knob.read_text() == "0\n"  # put back when the run raises too

    with procfs.guest_halt_poll(None, knob):  # no flag: the machine is left as it is
        assert knob.read_text() == "0\n"
    assert knob.read_text() == "0\n"


def test_guest_halt_poll_refuses_a_negative_window_and_names_a_knob_it_cannot_set(
    procfs: ModuleType, tmp_path: pathlib.Path
) -> None:
    knob, _ = _sysfs(tmp_path, "0\n")
    with pytest.raises(ValueError, match="0 or more nanoseconds, not -1"), procfs.guest_halt_poll(-1, knob):
        pass
    assert knob.read_text() == "0\n"

    missing = tmp_path / "no-haltpoll" / "guest_halt_poll_ns"
    with (
        pytest.raises(FileNotFoundError, match="haltpoll cpuidle driver and root") as info,
        procfs.guest_halt_poll(200_000, missing),
    ):
        pass
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (
            "sdk_ab.py",
            ["--guest-halt-poll-ns", "-5"],
            "--guest-halt-poll-ns: a halt-polling window is 0 or more",
        ),
        (
            "server_instr.py",
            ["--stdio", "--guest-halt-poll-ns", "-5"],
            "--guest-halt-poll-ns: a halt-polling window",
        ),
        ("server_instr.py", ["--guest-halt-poll-ns", "0"], "--guest-halt-poll-ns goes with --stdio"),
    ],
)
def test_the_benchmarks_name_the_flag_when_its_value_is_refused(
    script: str, args: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
