"""Server-only instructions per pipelined echo prompt over TCP, counted by callgrind (not a guard).

``bench/instr.py`` counts the server and its driver in one process; this counts the server alone, as
scenario 2 runs it: ``acp-server serve --listen tcp://`` under ``valgrind --tool=callgrind``, loaded by
``loadgen.py``'s pipeline from this process (100 sessions x 2 one-word prompts in flight, turn states
on unless ``--no-turn-states``). A SIGUSR1 handler in the server calls ``os.getsid(0)``, which
callgrind (``--dump-before=getsid``) takes as a cut: one dump for start-up and a warm-up of 1,500
prompts, one for the counted prompts, one for the rest. The count moves by about 1% between runs
(the load generator's batches follow the server's pace), so compare figures of one sitting.

Usage::

    python bench/server_instr.py [--prompts 4000] [--no-turn-states] [-- extra serve flags]

The server gets ``--ephemeral`` unless other flags are given after ``--`` (e.g. ``-- --state-dir DIR``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import loadgen  # noqa: E402

_SERVER = (
    "import os, signal, sys; signal.signal(signal.SIGUSR1, lambda *a: os.getsid(0)); "
    "from acp_server.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4000, help="prompts counted (default 4000)")
    parser.add_argument("--no-turn-states", action="store_true", help="the load generator opts out of turn states")
    parser.add_argument("serve_flags", nargs="*", help="flags for acp-server serve (default --ephemeral)")
    args = parser.parse_args()
    port = _free_port()
    out = tempfile.mkdtemp(prefix="acp-server-instr-")
    argv = [
        "valgrind", "--tool=callgrind", "--dump-before=getsid", f"--callgrind-out-file={out}/callgrind.out",
        sys.executable, "-c", _SERVER, "serve", "--listen", f"tcp://127.0.0.1:{port}",
        *(args.serve_flags or ["--ephemeral"]),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    try:
        for _ in range(1200):
            try:
                wire = loadgen.Wire(port, timeout=600)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit("server_instr: the server did not start")
        wire.handshake(turn_states=not args.no_turn_states)
        templates = [loadgen.prompt_template(wire.new_session(), "hello") for _ in range(100)]
        if loadgen.pipeline(wire, templates, 2, count=1500).summary()["ok"] != 1500:
            raise SystemExit("server_instr: the warm-up's prompts were not all answered")
        time.sleep(1)
        server.send_signal(signal.SIGUSR1)
        time.sleep(2)
        run = loadgen.pipeline(wire, templates, 2, count=args.prompts, first_id=10**6)
        if run.summary()["ok"] != args.prompts:
            raise SystemExit("server_instr: the counted prompts were not all answered")
        time.sleep(1)
        server.send_signal(signal.SIGUSR1)
        time.sleep(2)
        wire.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    parts: dict[int, tuple[int, str]] = {}
    for path in glob.glob(f"{out}/callgrind.out*"):
        text = Path(path).read_text(errors="replace")
        part, summary = re.search(r"^part: *(\d+)$", text, re.M), re.search(r"^summary: *(\d+)$", text, re.M)
        if part and summary:
            parts[int(part.group(1))] = (int(summary.group(1)), path)
    if 2 not in parts:
        raise SystemExit(f"server_instr: no dump of the counted prompts in {out}")
    count, path = parts[2]
    print(f"server instructions per prompt: {count / args.prompts:,.0f} (callgrind_annotate {path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
