"""Server CPU per echo prompt of two source trees, in back-to-back pairs of fresh servers.

For a change that must not cost CPU: each repetition starts one server from the base tree and one
from this tree (fresh processes, a fresh state directory for the store), runs the pipelined echo load
(``loadgen.py echo``, 100 sessions x 2 in flight) against both, in an order swapped every repetition,
and takes the ratio of their server CPU per prompt. The figure is the median of those ratios, per mode
(``--ephemeral`` and store on), the way scenario 2 of ``bench/run.py`` measures the store's cost.

Each server runs on this venv from inside its tree with ``PYTHONPATH`` pointing at it (its store
writer process inherits both), so both share every dependency and nothing else::

    git worktree add /tmp/acp-base <commit>
    python bench/ab.py --base /tmp/acp-base

Prints one JSON document: per mode, each pair's figures, and the median ratio (this tree / base).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import loadgen, progress  # noqa: E402
from servers import TcpServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class TreeServer(TcpServer):
    """``acp-server serve`` run from the source tree at ``root`` (its own code, this venv's packages)."""

    def __init__(self, root: Path, extra: list[str]) -> None:
        super().__init__(extra)
        serve = self.argv.index("serve")
        # from inside the tree: ``-m`` puts the working directory first on sys.path (and the store's
        # writer process, started by the server, inherits both)
        self.argv = ["env", "-C", str(root), f"PYTHONPATH={root}", sys.executable, "-m", "acp_server", *self.argv[serve:]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the base source tree (a git worktree)")
    parser.add_argument("--reps", type=int, default=7, help="pairs per mode (the median ratio is reported)")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {"base": args.base.resolve(), "new": ROOT}
    load = ["--sessions", str(args.sessions), "--depth", str(args.depth),
            "--duration", str(args.duration), "--warmup", str(args.warmup)]
    runs: list[dict[str, str]] = []
    out: dict[str, Any] = {"base": str(trees["base"]), "new": str(ROOT), "load": load, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="acp-bench-ab-") as state:
        for mode in ("ephemeral", "store on"):
            pairs: list[dict[str, Any]] = []
            for rep in range(args.reps):
                progress(f"ab: {mode}, pair {rep + 1} of {args.reps}")
                order = ("base", "new") if rep % 2 == 0 else ("new", "base")
                figures: dict[str, Any] = {}
                for tree in order:
                    extra = ["--ephemeral"] if mode == "ephemeral" else ["--state-dir", os.path.join(state, f"{tree}{rep}")]
                    with TreeServer(trees[tree], extra) as server:
                        result = loadgen("echo", server, load, runs)
                    figures[tree] = {
                        "cpu_us_per_prompt": result["server_cpu_us_per_ok"],
                        "prompts_per_s": result["ok_per_s"],
                        "server_cpu_share": result.get("server_cpu_share"),
                    }
                figures["ratio"] = figures["new"]["cpu_us_per_prompt"] / figures["base"]["cpu_us_per_prompt"]
                pairs.append(figures)
            out["modes"][mode] = {
                "pairs": pairs,
                "median_ratio": statistics.median(p["ratio"] for p in pairs),
            }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
