"""``acp-server serve --stdio`` imports only what serving one stdio client needs.

An editor spawns its agent at every project open, so start-up time is felt; most of it is imports. The
server runs as a subprocess, as an editor starts it (``acp_server.cli.main(["serve", "--stdio"])``);
an ``atexit`` hook of the wrapper writes ``sys.modules`` to a file when it exits, after it answered
``initialize``, opened a session and served a prompt, so the list covers everything that path loads.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import IO, Any

from .helpers import ROOT

_WRAPPER = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from acp_server.cli import main
sys.exit(main(["serve", "--stdio", *sys.argv[2:]]))
"""

#: Modules of features ``serve --stdio`` does not use: the HTTP server and metrics, the SQLite store and
#: its writer, Redis, the HTTP client, TOML (no --config).
UNUSED = (
    "hypercorn",
    "prometheus_client",
    "sqlite3",
    "coredis",
    "httpx",
    "tomllib",
    "acp_server.metrics",
    "acp_server.store.session_store",
    "acp_server.store.writer",
)
#: jsonrpcserver pulls in jsonschema (with referencing and attrs) and asyncio, ~40% of start-up.
JSONRPCSERVER = ("jsonrpcserver", "jsonschema", "asyncio")

_REQUESTS = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1, "clientCapabilities": {}}},
    {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}},
]


def _serve_stdio(tmp_path: pathlib.Path, *flags: str) -> set[str]:
    """Run ``serve --stdio``: initialize, a session, one prompt, then stdin closed; the modules it had."""
    out = tmp_path / "modules.json"
    with subprocess.Popen(
        [sys.executable, "-c", _WRAPPER, str(out), *flags],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            answers = []
            for request in _REQUESTS:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
                answers.append(_answer(proc.stdout, request["id"]))
            assert answers[0]["result"]["protocolVersion"] == 1
            prompt = {"sessionId": answers[1]["result"]["sessionId"], "prompt": [{"type": "text", "text": "hi there"}]}
            request = {"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt}
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            assert _answer(proc.stdout, 3)["result"]["stopReason"] == "end_turn"
            proc.stdin.close()
            assert proc.wait(30) == 0, proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
    modules: list[str] = json.loads(out.read_text())
    return set(modules)


def _answer(stdout: IO[bytes], request_id: int) -> dict[str, Any]:
    while True:
        line = stdout.readline()
        assert line, "the server closed stdout before answering"
        msg = json.loads(line)
        if msg.get("id") == request_id:
            assert "result" in msg, msg
            return msg


def _loaded(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m in roots or m.startswith(tuple(r + "." for r in roots)))


def test_serve_stdio_loads_no_unused_feature(tmp_path: pathlib.Path) -> None:
    modules = _serve_stdio(tmp_path)
    assert "acp_server.bridge.bridge" in modules and "trio" in modules  # the list is the server's
    assert _loaded(modules, UNUSED) == []


def test_serve_stdio_loads_no_jsonrpcserver(tmp_path: pathlib.Path) -> None:
    assert _loaded(_serve_stdio(tmp_path), JSONRPCSERVER) == []


def test_a_state_dir_loads_the_store(tmp_path: pathlib.Path) -> None:
    """The lazy store is still there when asked for: the check above is not vacuous."""
    modules = _serve_stdio(tmp_path, "--state-dir", str(tmp_path / "state"))
    assert {"sqlite3", "acp_server.store.session_store"} <= modules

