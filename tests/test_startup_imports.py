"""``acp-server serve --stdio`` imports only what serving one stdio client needs; parsing, no server.

An editor spawns its agent at every project open, so start-up time is felt; most of it is imports. The
server runs as a subprocess, as an editor starts it (``acp_server.cli.main(["serve", "--stdio"])``);
an ``atexit`` hook of the wrapper writes ``sys.modules`` to a file when it exits, after it answered
``initialize``, opened a session and served a prompt, so the list covers everything that path loads.
``acp-server --help`` (and ``serve --help``, ``--version``, any command's usage error) runs the same
way and must load nothing but the parser: no trio, no server, no client, no wire types.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import IO, Any

import pytest

from .helpers import ROOT

_WRAPPER = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from acp_server.cli import main
sys.exit(main(["serve", "--stdio", *sys.argv[2:]]))
"""
#: The same, for any command line (``--help`` and a usage error leave through ``SystemExit``).
_PARSE_WRAPPER = _WRAPPER.replace('["serve", "--stdio", *sys.argv[2:]]', "sys.argv[2:]")

#: The flags of the commands other than ``serve``: a ``serve`` command line builds its own parser alone.
OTHER_COMMANDS = ("acp_server.auth.cli", "acp_server.client")
#: Modules of features ``serve --stdio`` does not use: the HTTP server and metrics, the SQLite store and
#: its writer, Redis, the HTTP client, TOML (no --config), our client SDK and its command line; the
#: token checks, the tokens file, TLS and the audit log (no --auth-tokens, no --tls-cert) and the ACP
#: agent subprocess backend (the echo agent alone).
UNUSED = (
    "hypercorn",
    "prometheus_client",
    "sqlite3",
    "coredis",
    "httpx",
    "tomllib",
    "fractions",
    "shlex",
    "acp_server.metrics",
    "acp_server.store.session_store",
    "acp_server.store.writer",
    "acp_server.client.client",
    "acp_server.client.cli",
    "acp_server.auth.gate",
    "acp_server.auth.tokens",
    "acp_server.auth.http_rules",
    "acp_server.auth.ratelimit",
    "acp_server.auth.audit",
    "acp_server.auth.tls",
    "acp_server.backends.acp_agent",
    "acp_server.backends.agent_process",
    "acp_server.backends.agent_relay",
    "acp_server.backends.agent_inbound",
    *OTHER_COMMANDS,
)
#: jsonrpcserver pulls in jsonschema (with referencing and attrs) and asyncio, ~40% of start-up.
JSONRPCSERVER = ("jsonrpcserver", "jsonschema", "asyncio")
#: What only a ``token`` command (or one that checks a token's --id or --expires) needs: the tokens
#: file's module and the hashing and randomness it loads (libcrypto for hashlib).
TOKENS_FILE = ("acp_server.auth.tokens", "hashlib", "hmac", "secrets", "random")
#: What building the parser does not need: the event loop (trio ~130 ms, with outcome, sniffio, ssl),
#: every feature's library, and our modules that load them or the wire types (msgspec's heavy users).
#: msgspec itself stays: the flags' defaults are fields of ``Limits`` and ``PolicyLimits``. The tokens
#: file's module loads to check ``token add --expires`` (see :data:`TOKENS_FILE` for the rest).
NOT_FOR_PARSING = (
    *(m for m in UNUSED if m not in (*TOKENS_FILE, *OTHER_COMMANDS)),
    *JSONRPCSERVER,
    "trio",
    "outcome",
    "sniffio",
    "ssl",
    "attrs",
    "acp_server.server",
    "acp_server.cli_config",
    "acp_server.config",
    "acp_server.errors",
    "acp_server.types",
    "acp_server.jsonrpc",
    "acp_server.bridge",
    "acp_server.handlers",
    "acp_server.backends",
    "acp_server.transports",
    "acp_server.coordinator",
    "acp_server.store",
    "acp_server.admission.policy",
    "acp_server.admission.pool",
    "acp_server.auth.tls",
    "acp_server.auth.http_rules",
)

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


def test_a_tokens_file_loads_the_token_checks(tmp_path: pathlib.Path) -> None:
    """``--auth-tokens`` loads the tokens file and the checks (stdio stays the owner's, no token asked)."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("")
    tokens.chmod(0o600)
    modules = _serve_stdio(tmp_path, "--auth-tokens", str(tokens))
    assert {"acp_server.auth.gate", "acp_server.auth.tokens", "acp_server.auth.audit"} <= modules



def _parse_only(tmp_path: pathlib.Path, *argv: str) -> tuple[int, str, set[str]]:
    """Run ``acp-server ARGV`` that exits while parsing; its exit code, stdout and the modules it had."""
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_WRAPPER, str(out), *argv],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    modules: list[str] = json.loads(out.read_text())
    return done.returncode, done.stdout.decode() + done.stderr.decode(), set(modules)


@pytest.mark.parametrize(
    ("argv", "code", "shown"),
    [
        (["--help"], 0, "serve"),
        (["serve", "--help"], 0, "--max-running-prompts"),
        (["doctor", "--help"], 0, "--listen"),
        (["--version"], 0, "acp-server "),
        (["serve", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["serve", "--listen", "ftp://x"], 2, "unknown scheme"),
        (["prompt", "--bogus", "hi"], 2, "unrecognized arguments: --bogus"),
        (["prompt", "--connect", "ftp://x", "hi"], 2, "unknown scheme"),
        (["token", "add", "--tenant", "t", "--file", "f", "--expires", "2000-01-01T00:00:00Z"], 2, "in the past"),
        (["cluster", "--help"], 0, "--coordinator"),
    ],
)
def test_parsing_loads_no_server(tmp_path: pathlib.Path, argv: list[str], code: int, shown: str) -> None:
    returncode, output, modules = _parse_only(tmp_path, *argv)
    assert (returncode, shown in output) == (code, True), output
    assert "acp_server.cli_flags" in modules and "argparse" in modules  # the list is the parser's
    assert _loaded(modules, NOT_FOR_PARSING) == []


def test_the_check_of_parsing_sees_a_command_that_runs(tmp_path: pathlib.Path) -> None:
    """A command that runs imports what it runs: the check above is not vacuous."""
    returncode, output, modules = _parse_only(tmp_path, "cluster", "--coordinator", "redis://127.0.0.1:1/0")
    assert returncode == 1, output
    assert {"trio", "coredis", "acp_server.coordinator.redis"} <= modules


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["--version"], ["token", "--help"]])
def test_help_loads_no_tokens_file(tmp_path: pathlib.Path, argv: list[str]) -> None:
    returncode, output, modules = _parse_only(tmp_path, *argv)
    assert returncode == 0, output
    assert "acp_server.cli_flags" in modules  # the list is the parser's
    assert _loaded(modules, TOKENS_FILE) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["serve", "--stdio", "--max-running-prompts", "4", "--listen", "tcp://127.0.0.1:0"],
        ["serve", "--bogus"],
        ["serve", "--listen", "ftp://x"],
        ["serve", "--help"],
    ],
)
def test_serve_parses_the_same_without_the_other_commands(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``serve`` command lines are parsed with the ``serve`` subparser alone (the others are not built):
    the same values, the same help, the same errors as with every command built."""
    from acp_server import cli

    def parse(command: str | None) -> tuple[object, str, str]:
        parser, serve = cli._build(command)
        try:
            result: object = vars(cli._parse(parser, argv))
        except SystemExit as exc:
            result = ("exit", exc.code)
        out, err = capsys.readouterr()
        return result, out, err + serve.format_help()

    everything = parse(None)
    assert parse("serve") == everything
    assert everything[0] != {} and (everything[1] or everything[2])
