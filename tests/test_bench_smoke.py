"""The benchmark suite's smoke test: ``bench/run.py --tiny`` runs every scenario end to end.

It is the only benchmark run under ``make test``: tiny counts, so it shows the suite works (the
servers start, the SDK peer echoes like ours, the load generator talks to the server), not how fast.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from .helpers import ROOT

RUN = ROOT / "bench" / "run.py"
FIGURE_KEYS = {"scenario", "name", "unit", "ours", "sdk", "ratio", "goal", "met", "command"}


def test_bench_tiny_prints_the_table_and_writes_json(tmp_path: pathlib.Path) -> None:
    """Every scenario runs, each figure is a table row with its command, and the JSON has them all."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| # | figure | unit | ours | SDK | ours/SDK | goal | met | reproduce |" in proc.stdout

    report = json.loads(out.read_text())
    assert set(report) == {"meta", "figures", "scenarios", "skipped", "notes", "errors"}
    assert report["errors"] == {}
    assert report["meta"]["tiny"] is True
    # How idle CPUs wait is recorded beside the figures (it moves a sequential prompt's CPU by 2.5x in a VM)
    idle = report["meta"]["idle_cpus"]
    assert isinstance(idle, dict) and report["scenarios"]["sdk"]["idle_cpus"] == idle
    assert "idle CPUs: " in proc.stdout
    assert set(report["scenarios"]) == {"sdk", "pipelined", "overload", "scale", "openai", "coordinator", "http", "rest"}
    figures = report["figures"]
    assert {f["scenario"] for f in figures} == {"1", "2", "3", "4", "5", "6", "7", "8"}
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(figures)
    for figure, row in zip(figures, rows, strict=True):
        assert set(figure) == FIGURE_KEYS
        assert figure["name"] in row and f"`{figure['command']}`" in row
        assert figure["command"].startswith("python bench/run.py --only ")

    sdk_side = [f for f in figures if f["scenario"] == "1"]
    assert sdk_side and all(f["sdk"] is not None and f["ratio"] is not None for f in sdk_side)
    served = next(f for f in figures if f["name"].startswith("connections served"))
    assert served["met"] is True
    echo = report["scenarios"]["pipelined"]["echo_depth2"][0]
    assert echo["ok"] > 0 and echo["notifications"] == echo["ok"]  # one update per one-word prompt
    assert report["scenarios"]["pipelined"]["echo_depth5 (store on)"][0]["ok"] > 0
    costs = [f for f in figures if f["name"].startswith("store cost, echo 100 sessions x ")]
    assert [f["goal"] for f in costs] == ["<= 25%", "<= 25%"] and all(f["ours"] is not None for f in costs)
    added = next(f for f in figures if f["name"] == "one sequential prompt: latency the store adds (p50)")
    assert added["unit"] == "ms" and added["ours"] is not None
    rest = report["scenarios"]["rest"]
    assert all(rest[k]["prompts"] > 0 for k in ("rest", "acp_sse", "tcp"))
    if rest["rest_sdk_missing"] is None:  # qwen's SDK, Node --single-threaded (the goal's row), and as it comes
        assert rest["rest_sdk"]["prompts"] == rest["rest_sdk_threads"]["prompts"] > 0
        assert rest["node_args"] == ["--single-threaded"] and rest["pinned"] is None
    assert [rest["fanout"][n]["frames_per_prompt"] for n in ("1", "10", "64")] == sorted(
        rest["fanout"][n]["frames_per_prompt"] for n in ("1", "10", "64"))  # more subscribers, more frames
    overload = report["scenarios"]["overload"]
    refusals = overload["refusals"]
    assert refusals["round_trips"] > 0 and refusals["pipelined"]["ok"] == 0
    # Server-side refusal timing, from a fresh server: exactly the refusals timed one at a time.
    assert refusals["server_one_at_a_time"]["count"] == refusals["round_trips"]
    assert 0 < refusals["server_one_at_a_time"]["p50Us"] <= refusals["server_one_at_a_time"]["maxUs"]
    polite, rude = overload["by_run"]["3x polite"][0], overload["by_run"]["3x at once"][0]
    assert polite["retry_after"] and polite["warmup_retry_waits"] > 0 and polite["warmup_refused"] > 0
    assert not rude["retry_after"] and rude["server_refusals"]["count"] >= rude["refused"] > 0
    assert overload["by_run"]["1x"][0]["refused"] == 0
    # the refusal budget's runs: the rude client reconnects if evicted; a polite neighbour's p99 beside
    # a client that only gets refusals, with the budget on and off
    assert overload["by_run"]["3x at once"][0]["reconnect"] is True
    neighbours = overload["neighbour_p99"]
    assert neighbours["alone"][0]["ok"] > 0
    for label in ("beside rude", "beside rude, budget off"):
        assert neighbours[label][0]["ok"] > 0 and neighbours[label][0]["rude"]["refused"] > 0
    assert any(f["name"] == "polite p99 beside a rude client / alone (budget on)" and f["goal"] == "<= 1.5" for f in figures)
