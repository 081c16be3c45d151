"""Server-only instructions per echo prompt, counted by callgrind (not a guard): TCP pipelined, or stdio.

``bench/instr.py`` counts the server and its driver in one process; this counts the server alone, as
the benchmark's scenarios run it, under ``valgrind --tool=callgrind``. A SIGUSR1 handler in the server
calls ``os.getsid(0)``, which callgrind (``--dump-before=getsid``) takes as a cut: one dump for
start-up and a warm-up, one for the counted prompts, one for the rest.

- TCP (the default, scenario 2): ``acp-server serve --listen tcp://``, loaded by ``loadgen.py``'s
  pipeline from this process (100 sessions x 2 one-word prompts in flight, turn states on unless
  ``--no-turn-states``). The count moves by about 1% between runs (the load generator's batches
  follow the server's pace), so compare figures of one sitting.
- ``--stdio`` (scenario 1's path, goal 2 of issue 21): ``acp-server serve --stdio`` on two pipes, and a
  fixed blocking client in this process that sends sequential echo prompts of ``--words`` words on one
  session and waits for each answer, without turn states (as the official SDK client). The server
  then reads one request per read, so the count is steady from run to run. ``--probe`` chooses what
  watches the server instead of callgrind: ``strace`` (system calls per prompt, by name, between the
  two cuts), ``passes`` (trio scheduling passes, task steps and I/O waits per prompt, by an
  instrument the server is started with), ``cpu`` (the server's CPU time per prompt, user and
  system, from ``/proc``: no tool in the way) or ``cachesim`` (callgrind with its cache simulation:
  I1 and D1 of 32 KiB and a last level of ``--sim-ll-kb``, 64 KiB unless told; a prompt touches more
  than that, so the last level's misses per prompt count the cache lines it touches, code and data:
  what a prompt costs on caches a busy client evicted, repeatably, beside ``--sdk-agent``'s).

Usage::

    python bench/server_instr.py [--prompts 4000] [--no-turn-states] [-- extra serve flags]
    python bench/server_instr.py --stdio [--words 1] [--prompts 2000] [--probe callgrind|cachesim|strace|passes|cpu]
    python bench/server_instr.py --stdio --probe cpu --pace-us 130   # at the official SDK client's pace
    python bench/server_instr.py --stdio --probe cpu --pollute-kb 4096 [--sdk-agent]   # on caches a busy client evicted
    python bench/server_instr.py --stdio --probe cachesim [--sdk-agent] [--sim-ll-kb 64]   # the lines a prompt touches

The TCP server gets ``--ephemeral`` unless other flags are given after ``--`` (e.g. ``-- --state-dir DIR``).
With ``--stdio``, ``SERVER_INSTR_SCRIPT=FILE`` runs that Python file as the server instead (``python -c``
with the serve arguments, e.g. a profiler of one's own that starts and stops at the two SIGUSR1 cuts).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import loadgen  # noqa: E402
from procfs import cpu_seconds, describe_idle, guest_halt_poll, idle_policy  # noqa: E402

_SERVER = (
    "import os, signal, sys; signal.signal(signal.SIGUSR1, lambda *a: os.getsid(0)); "
    "from acp_server.cli import main; sys.exit(main(sys.argv[1:]))"
)

#: the server of ``--sdk-agent``: the official SDK's echo agent, with the SIGUSR1 cuts (its arguments ignored)
_SDK_AGENT = (
    "import os, runpy, signal, sys; signal.signal(signal.SIGUSR1, lambda *a: os.getsid(0)); "
    "sys.argv = sys.argv[:1]; runpy.run_path(%r, run_name='__main__')"
)

#: the server of ``--probe passes``: trio.run gets an instrument; each SIGUSR1 prints its counts so far
_SERVER_PASSES = """
import os, signal, sys, trio
counts = {"passes": 0, "task_steps": 0, "io_waits_blocking": 0}
class Count(trio.abc.Instrument):
    def before_io_wait(self, timeout):
        counts["passes"] += 1
        if timeout > 0:
            counts["io_waits_blocking"] += 1
    def before_task_step(self, task):
        counts["task_steps"] += 1
signal.signal(signal.SIGUSR1, lambda *a: print("passes " + repr(counts), file=sys.stderr, flush=True))
run = trio.run
trio.run = lambda *a, **k: run(*a, instruments=[Count()], **k)
from acp_server.cli import main
sys.exit(main(sys.argv[1:]))
"""

_NINE_WORDS = "the quick brown fox jumps over the lazy dog"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: ``--probe cachesim``'s simulated first-level caches (instructions and data alike): size, ways, line
_SIM_L1_KB = 32
_SIM_L1 = f"{_SIM_L1_KB * 1024},8,64"


def _dumps(out: str) -> dict[int, tuple[dict[str, int], str]]:
    """Each callgrind dump in ``out`` by part: its summary's events by name (``Ir`` first; with
    ``--cache-sim=yes`` also ``I1mr``, ``D1mr``, ...) and its path."""
    parts: dict[int, tuple[dict[str, int], str]] = {}
    for path in glob.glob(f"{out}/callgrind.out*"):
        text = Path(path).read_text(errors="replace")
        part = re.search(r"^part: *(\d+)$", text, re.M)
        names, summary = re.search(r"^events: *(.+)$", text, re.M), re.search(r"^summary: *(.+)$", text, re.M)
        if part and names and summary:
            parts[int(part.group(1))] = (dict(zip(names.group(1).split(), map(int, summary.group(1).split()), strict=True)), path)
    return parts


def _summaries(out: str) -> dict[int, tuple[int, str]]:
    """Each dump's instruction count by part, and its path."""
    return {part: (events["Ir"], path) for part, (events, path) in _dumps(out).items()}


def _tcp(args: argparse.Namespace) -> int:
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
    parts = _summaries(out)
    if 2 not in parts:
        raise SystemExit(f"server_instr: no dump of the counted prompts in {out}")
    count, path = parts[2]
    print(f"server instructions per prompt: {count / args.prompts:,.0f} (callgrind_annotate {path})")
    return 0


class _StdioClient:
    """A blocking NDJSON client on the server's two pipes: one request, then read up to its answer."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.out = proc.stdin.fileno()
        self.inp = proc.stdout.fileno()
        self.buf = b""
        self.next_id = 1

    def call(self, method: str, params: object) -> bytes:
        """Send one request and return its answer's line (the notifications before it are skipped)."""
        import msgspec

        request = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        self.next_id += 1
        os.write(self.out, msgspec.json.encode(request) + b"\n")
        return self._answer(b'"id":%d,' % request["id"])

    def _answer(self, marker: bytes) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            while end >= 0:
                line, self.buf = self.buf[:end], self.buf[end + 1 :]
                if marker in line and b'"method"' not in line[:40]:
                    return line
                end = self.buf.find(b"\n")
            data = os.read(self.inp, 65536)
            if not data:
                raise SystemExit("server_instr: the server closed its output")
            self.buf += data

    def prompts(self, template: bytes, count: int, pace_s: float = 0.0, pollute_kb: int = 0) -> None:
        """``count`` sequential prompts, each written once the last one's answer has been read (and,
        with ``pace_s``, that long after it: the server then sleeps between prompts, as it does for a
        client that does work of its own between them). With ``pollute_kb``, the client also writes
        over a buffer that large after each answer, as a busy client (the official SDK's, a Python
        asyncio process) evicts the caches the two CPUs share: the server then runs on cold caches."""
        pollute = _Polluter(pollute_kb * 1024) if pollute_kb else None
        for _ in range(count):
            if pollute is not None:
                pollute()
            if pace_s:
                time.sleep(pace_s)
            prompt_id = self.next_id
            self.next_id += 1
            os.write(self.out, template % prompt_id)
            line = self._answer(b'"id":%d,' % prompt_id)
            if b'"end_turn"' not in line:
                raise SystemExit(f"server_instr: a prompt did not end its turn: {line[:300]!r}")


class _Polluter:
    """Writes over a buffer of ``size`` bytes at each call (``memset``: one pass, every cache line of it)."""

    def __init__(self, size: int) -> None:
        import ctypes

        self._buf = (ctypes.c_char * size)()
        self._memset = ctypes.memset
        self._addr = ctypes.addressof(self._buf)
        self._size = size
        self._byte = 0

    def __call__(self) -> None:
        self._byte = (self._byte + 1) & 0xFF  # a new value each time: every line is dirtied again
        self._memset(self._addr, self._byte, self._size)


def _stdio(args: argparse.Namespace) -> int:
    import msgspec

    out = tempfile.mkdtemp(prefix="acp-server-instr-")
    serve = ["serve", "--stdio", *args.serve_flags]
    probe = args.probe
    script = _SERVER_PASSES if probe == "passes" else _SERVER
    if args.sdk_agent:
        script = _SDK_AGENT % str(BENCH / "peers" / "sdk_echo_agent.py")
    if os.environ.get("SERVER_INSTR_SCRIPT"):
        script = Path(os.environ["SERVER_INSTR_SCRIPT"]).read_text()
    argv = [sys.executable, "-c", script, *serve]
    if probe in ("callgrind", "cachesim"):
        sim = []
        if probe == "cachesim":
            sim = ["--cache-sim=yes", f"--I1={_SIM_L1}", f"--D1={_SIM_L1}", f"--LL={args.sim_ll_kb * 1024},16,64"]
        argv = ["valgrind", "--tool=callgrind", *sim, "--dump-before=getsid", f"--callgrind-out-file={out}/callgrind.out", *argv]
    elif probe == "strace":
        argv = ["strace", "-f", "-o", f"{out}/strace.out", *argv]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    server = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tempfile.gettempdir()
    )
    passes: list[dict[str, int]] = []
    try:
        client = _StdioClient(server)
        client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        target = server.pid if probe != "strace" else _child_of(server.pid)  # strace's child is the server
        session = msgspec.json.decode(client.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["result"]["sessionId"]
        text = "hello" if args.words == 1 else " ".join((_NINE_WORDS.split() * args.words)[: args.words])
        params = msgspec.json.encode({"sessionId": session, "prompt": [{"type": "text", "text": text}]})
        template = b'{"jsonrpc":"2.0","id":%d,"method":"session/prompt","params":' + params.replace(b"%", b"%%") + b"}\n"
        client.prompts(template, args.warmup)
        time.sleep(0.5)
        os.kill(target, signal.SIGUSR1)
        time.sleep(1 if probe in ("callgrind", "cachesim") else 0.3)
        before = cpu_seconds(server.pid) if probe == "cpu" else None
        user_sys = _user_sys(server.pid) if probe == "cpu" else None
        client.prompts(template, args.prompts, args.pace_us / 1e6, args.pollute_kb)
        after = cpu_seconds(server.pid) if probe == "cpu" else None
        user_sys_after = _user_sys(server.pid) if probe == "cpu" else None
        time.sleep(0.3)
        os.kill(target, signal.SIGUSR1)
        time.sleep(1 if probe in ("callgrind", "cachesim") else 0.3)
    finally:
        try:
            _, err = server.communicate(timeout=120)  # closes the server's stdin: it exits
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    n = args.prompts
    if probe == "callgrind":
        parts = _summaries(out)
        if 2 not in parts:
            raise SystemExit(f"server_instr: no dump of the counted prompts in {out}")
        count, path = parts[2]
        print(f"server instructions per stdio prompt ({args.words} word(s)): {count / n:,.0f} (callgrind_annotate {path})")
    elif probe == "cachesim":
        dumps = _dumps(out)
        if 2 not in dumps:
            raise SystemExit(f"server_instr: no dump of the counted prompts in {out}")
        events = dumps[2][0]
        print(f"server per stdio prompt ({args.words} word(s)), simulated caches (I1/D1 {_SIM_L1_KB} KiB, LL {args.sim_ll_kb} KiB): "
              + ", ".join(f"{k} {v / n:,.0f}" for k, v in events.items()))
    elif probe == "strace":
        calls = _strace_between_cuts(Path(out) / "strace.out")
        total = sum(calls.values())
        print(f"system calls per stdio prompt ({args.words} word(s)): {total / n:.2f}")
        for name, c in calls.most_common():
            print(f"  {name}: {c / n:.2f}")
    elif probe == "passes":
        for line in err.decode(errors="replace").splitlines():
            if line.startswith("passes "):
                passes.append(eval(line[len("passes ") :], {}))  # noqa: S307 - our own repr of a dict of ints
        if len(passes) < 2:
            raise SystemExit("server_instr: the server printed no pass counts")
        a, b = passes[0], passes[1]
        print(f"per stdio prompt ({args.words} word(s)): " + ", ".join(f"{k} {(b[k] - a[k]) / n:.2f}" for k in a))
    else:
        if os.environ.get("SERVER_INSTR_SCRIPT"):
            sys.stderr.write(err.decode(errors="replace"))
        assert before is not None and after is not None and user_sys is not None and user_sys_after is not None
        print(
            f"server CPU per stdio prompt ({args.words} word(s)): {(after - before) / n * 1e6:.1f} us "
            f"(user {(user_sys_after[0] - user_sys[0]) / n * 1e6:.1f}, system {(user_sys_after[1] - user_sys[1]) / n * 1e6:.1f}; "
            "clock ticks: coarse)"
        )
    return 0


def _child_of(pid: int) -> int:
    """The one child process of ``pid`` (the server strace started), once it has answered."""
    children = [c for path in glob.glob(f"/proc/{pid}/task/*/children") for c in Path(path).read_text().split()]
    if len(children) != 1:
        raise SystemExit(f"server_instr: expected one child of strace, found {children}")
    return int(children[0])


def _user_sys(pid: int) -> tuple[float, float]:
    """utime and stime of ``pid`` in seconds (``/proc/PID/stat``, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _strace_between_cuts(path: Path) -> Counter[str]:
    """System calls by name between the first and the second SIGUSR1 of the trace (every thread)."""
    calls: Counter[str] = Counter()
    cuts = 0
    call = re.compile(r"^\d+ +(?:<\.\.\. )?([a-z_0-9]+)[( ]")
    for line in path.read_text(errors="replace").splitlines():
        if "--- SIGUSR1" in line:
            cuts += 1
            continue
        if cuts == 1 and "resumed>" not in line:
            m = call.match(line)
            if m:
                calls[m.group(1)] += 1
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=None, help="prompts counted (default 4000; --stdio 2000)")
    parser.add_argument("--no-turn-states", action="store_true", help="the load generator opts out of turn states")
    parser.add_argument("--stdio", action="store_true", help="serve --stdio, sequential prompts from a fixed client")
    parser.add_argument("--words", type=int, default=1, help="--stdio: words per prompt (default 1)")
    parser.add_argument("--warmup", type=int, default=500, help="--stdio: prompts before the counted ones (default 500)")
    parser.add_argument(
        "--pace-us",
        type=float,
        default=0.0,
        help="--stdio: the client sleeps this long after each answer before its next prompt (default 0: at "
        "once). The official SDK client's pace (~130 us between prompts) leaves the server's caches cold: "
        "with --probe cpu this shows what a prompt costs then, which instruction counts do not",
    )
    parser.add_argument(
        "--sdk-agent",
        action="store_true",
        help="--stdio: serve with the official SDK's echo agent (bench/peers/sdk_echo_agent.py) instead, "
        "the goal's reference (e.g. with --probe cpu --pollute-kb 4096)",
    )
    parser.add_argument(
        "--pollute-kb",
        type=int,
        default=0,
        help="--stdio: after each answer the client writes over a buffer of this many KiB before its next "
        "prompt (default 0), as a busy client evicts the caches it shares with the server; with --probe cpu "
        "this makes the cold-cache cost of a prompt repeatable",
    )
    parser.add_argument(
        "--sim-ll-kb",
        type=int,
        default=64,
        help="--probe cachesim: the simulated last-level cache's size in KiB (default 64: smaller than what a "
        "prompt touches, so its misses count the memory a prompt touches, as on caches a busy client evicted)",
    )
    parser.add_argument(
        "--probe", choices=("callgrind", "cachesim", "strace", "passes", "cpu"), default="callgrind", help="--stdio: what watches the server"
    )
    parser.add_argument(
        "--guest-halt-poll-ns",
        type=int,
        metavar="NS",
        help="--stdio: for this run only, set the VM's guest halt polling window (haltpoll's "
        "guest_halt_poll_ns; root; machine-wide, put back after): with --probe cpu, e.g. 200000 against 0 "
        "shows what an idle vCPU's halt between two prompts costs the server",
    )
    parser.add_argument("serve_flags", nargs="*", help="flags for acp-server serve (default --ephemeral for TCP)")
    args = parser.parse_args()
    if not args.stdio:
        if args.guest_halt_poll_ns is not None:
            parser.error("--guest-halt-poll-ns goes with --stdio (the TCP workload never lets the server sleep)")
        args.prompts = args.prompts or 4000
        return _tcp(args)
    args.prompts = args.prompts or 2000
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(guest_halt_poll(args.guest_halt_poll_ns))
        except (ValueError, OSError) as exc:
            parser.error(f"--guest-halt-poll-ns: {exc}")
        if args.probe == "cpu":
            print(describe_idle(idle_policy()))
        return _stdio(args)


if __name__ == "__main__":
    raise SystemExit(main())
