"""The configuration file (``--config``) and the backend flags of ``acp-server serve``: what is accepted,
what is refused (naming the key or flag), and that the command line overrides the file."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from acp_server import cli
from acp_server.config import BackendConfig, ConfigError, FileConfig, load_config, parse_config

from .helpers import ROOT
from .test_e2e_agent import CWD, TIMEOUT_S, agent_command, serve_process

FULL = """
default_backend = "claude"

[backends.claude]
command = ["claude-code-acp", "--debug"]
env = { ANTHROPIC_LOG = "info" }
cwd = "/srv/agents"
max_active = 4
max_waiting = 16

[backends.echo]
kind = "echo"
delay_ms = 250

[backends.free]
command = ["free-agent"]
"""

#: (configuration text, what the error message must contain)
BAD = {
    "unknown top-level key": ('colour = "red"\n', ": colour: unknown key"),
    "unknown backend key": ('[backends.x]\ncommand = ["a"]\nfoo = 1\n', "backends.x.foo: unknown key"),
    "wrong type": (
        '[backends.x]\ncommand = ["a"]\nmax_active = "four"\n',
        "backends.x.max_active: Expected `int",
    ),
    "bool for int": ('[backends.x]\ncommand = ["a"]\nmax_active = true\n', "backends.x.max_active"),
    "negative": (
        '[backends.x]\ncommand = ["a"]\nmax_waiting = -1\nmax_active = 1\n',
        "backends.x.max_waiting: must be a non-negative",
    ),
    "zero active": (
        '[backends.x]\ncommand = ["a"]\nmax_active = 0\n',
        "backends.x.max_active: must be at least 1",
    ),
    "waiting without active": (
        '[backends.x]\ncommand = ["a"]\nmax_waiting = 3\n',
        "backends.x.max_waiting: needs max_active",
    ),
    "echo with command": (
        '[backends.x]\nkind = "echo"\ncommand = ["a"]\n',
        'backends.x.command: not used by kind = "echo"',
    ),
    "acp without command": (
        "[backends.x]\nmax_active = 1\n",
        "backends.x.command: required for an ACP agent",
    ),
    "empty command": ("[backends.x]\ncommand = []\n", "backends.x.command: required"),
    "unknown kind": ('[backends.x]\nkind = "http"\n', "backends.x.kind"),
    "unknown default": (
        'default_backend = "y"\n[backends.x]\ncommand = ["a"]\n',
        "default_backend: no backend named 'y' (known: echo, x)",
    ),
    "bad name": ('[backends."a b"]\ncommand = ["a"]\n', "a backend name is 1-64 letters"),
    "backends not a table": ("backends = 3\n", "backends: must be a table"),
    "toml syntax": ('[backends.x\ncommand = ["a"]\n', "not valid TOML"),
}


# --- parse_config / load_config ---------------------------------------------------------------------


def test_config_full_file_parses() -> None:
    """Every key of the documented form is read into typed values; absent ones take their defaults."""
    config = parse_config(FULL)
    assert config == FileConfig(
        default_backend="claude",
        backends={
            "claude": BackendConfig(
                kind="acp",
                command=["claude-code-acp", "--debug"],
                env={"ANTHROPIC_LOG": "info"},
                cwd="/srv/agents",
                max_active=4,
                max_waiting=16,
            ),
            "echo": BackendConfig(kind="echo", delay_ms=250),
            "free": BackendConfig(command=["free-agent"]),
        },
    )
    assert config.backends["free"].max_active is None and config.backends["free"].max_waiting is None
    assert parse_config("") == FileConfig()
    # echo is built in: it may be the default without a table of its own
    assert parse_config('default_backend = "echo"\n').default_backend == "echo"


@pytest.mark.parametrize("case", sorted(BAD))
def test_config_refusals_name_the_key(case: str) -> None:
    """Each malformed file is a ConfigError whose message names the offending key and the rule."""
    text, expected = BAD[case]
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.toml")
    message = str(info.value)
    assert message.startswith("my.toml: ")
    assert expected in message


def test_config_load_reads_a_file_or_names_it(tmp_path: Path) -> None:
    """load_config parses a file like parse_config; an unreadable one names the path, errors name the file."""
    path = tmp_path / "acp-server.toml"
    path.write_text(FULL)
    assert load_config(str(path)) == parse_config(FULL)
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=f"--config {missing}: No such file or directory"):
        load_config(str(missing))
    path.write_text(BAD["unknown backend key"][0])
    with pytest.raises(ConfigError, match=rf"^--config {path}: backends\.x\.foo: unknown key$"):
        load_config(str(path))


# --- the command line: refusals ----------------------------------------------------------------------


def serve_refused(*args: str) -> str:
    """Run ``acp-server serve ARGS``; it must exit 2 at once; returns its stderr."""
    run = subprocess.run(
        [sys.executable, "-m", "acp_server", "serve", "--listen", "tcp://127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert run.stdout == ""
    return run.stderr


@pytest.mark.parametrize(
    "case",
    ["unknown backend key", "waiting without active", "echo with command", "toml syntax", "unknown default"],
)
def test_config_cli_refuses_bad_config_file(case: str, tmp_path: Path) -> None:
    """``--config`` with a bad file exits 2 with the file's name and the key."""
    path = tmp_path / "bad.toml"
    text, expected = BAD[case]
    path.write_text(text)
    stderr = serve_refused("--config", str(path))
    assert f"acp-server serve: error: --config {path}: " in stderr
    assert expected in stderr


def test_config_cli_refuses_bad_backend_flags(tmp_path: Path) -> None:
    """A missing config file, ``--agent`` without '=', an unknown ``--default-backend``: exit 2, named."""
    stderr = serve_refused("--config", str(tmp_path / "absent.toml"))
    assert f"--config {tmp_path / 'absent.toml'}: No such file or directory" in stderr
    stderr = serve_refused("--agent", "claude-code-acp")
    assert "--agent must be NAME=COMMAND" in stderr and "'claude-code-acp'" in stderr
    stderr = serve_refused("--agent", "a=")
    assert "--agent must be NAME=COMMAND" in stderr
    stderr = serve_refused("--agent", "claude=fake-agent", "--default-backend", "nope")
    assert "--default-backend 'nope' is not a configured backend; known: claude, echo" in stderr


def merged(*args: str) -> tuple[dict[str, BackendConfig], str]:
    """The backend table and default ``serve ARGS`` would run with."""
    parser = cli.build_parser()
    return cli.backends_from(parser.parse_args(["serve", *args]), parser)


def test_config_cli_merge_over_the_file(tmp_path: Path) -> None:
    """The file's table with the command line over it: ``--agent`` keeps the file's limits, an explicit
    ``--echo-delay-ms`` (0 too) replaces delay_ms, ``-- CMD`` adds ``agent`` as the default,
    ``--default-backend`` wins over both."""
    path = tmp_path / "acp-server.toml"
    path.write_text(
        'default_backend = "claude"\n'
        '[backends.claude]\ncommand = ["old"]\nmax_active = 2\nmax_waiting = 3\nenv = { A = "1" }\n'
        '[backends.echo]\nkind = "echo"\ndelay_ms = 500\n'
    )
    config = ("--config", str(path))
    assert merged() == ({"echo": BackendConfig(kind="echo")}, "echo")

    backends, default = merged(*config)
    assert default == "claude" and backends["echo"].delay_ms == 500
    assert backends["claude"] == BackendConfig(command=["old"], max_active=2, max_waiting=3, env={"A": "1"})

    backends, _ = merged(*config, "--echo-delay-ms", "0", "--agent", "claude=new --flag 'two words'")
    assert backends["echo"].delay_ms == 0
    assert backends["claude"] == BackendConfig(
        command=["new", "--flag", "two words"], max_active=2, max_waiting=3, env={"A": "1"}
    )
    assert merged(*config, "--echo-delay-ms", "7")[0]["echo"].delay_ms == 7

    backends, default = merged(*config, "--", "my-agent", "--x")
    assert default == "agent" and backends["agent"] == BackendConfig(command=["my-agent", "--x"])
    assert merged(*config, "--default-backend", "echo", "--", "my-agent")[1] == "echo"


# --- the command line over the file ------------------------------------------------------------------


async def test_config_cli_overrides_the_file(tmp_path: Path) -> None:
    """Over a real server: ``--agent NAME=CMD`` replaces the file's command for NAME but keeps its limits,
    ``--echo-delay-ms`` replaces ``[backends.echo] delay_ms``, ``--default-backend`` the file's default;
    ``_acp_server/capabilities`` shows the merged table."""
    path = tmp_path / "acp-server.toml"
    path.write_text(
        'default_backend = "fake"\n'
        "[backends.fake]\n"
        'command = ["/nonexistent/acp-agent"]\n'
        "max_active = 2\n"
        "max_waiting = 3\n"
        "[backends.echo]\n"
        'kind = "echo"\n'
        "delay_ms = 600000\n"
        "[backends.spare]\n"
        'kind = "echo"\n'
        "max_active = 1\n"
    )
    agent = shlex.join(agent_command())
    args = (
        "--config",
        str(path),
        "--agent",
        f"fake={agent}",
        "--echo-delay-ms",
        "0",
        "--default-backend",
        "spare",
    )
    with trio.fail_after(TIMEOUT_S):
        async with serve_process(*args) as (client, _):
            caps = await client.call("_acp_server/capabilities")
            assert caps["defaultBackend"] == "spare"
            assert caps["backends"] == {
                "fake": {"kind": "acp", "maxActive": 2, "maxWaiting": 3},
                "echo": {"kind": "echo", "maxActive": None, "maxWaiting": None},
                "spare": {"kind": "echo", "maxActive": 1, "maxWaiting": None},
            }
            stats = await client.call("_acp_server/stats")
            assert set(stats["pools"]) == {"fake", "spare"}

            default = await client.call("session/new", {"cwd": CWD, "mcpServers": []})
            assert default["_meta"]["backend"] == "spare"

            echo_sid, _ = await client.new_session(CWD, backend="echo")
            start = trio.current_time()
            assert (await client.prompt(echo_sid, "quick"))["stopReason"] == "end_turn"
            assert trio.current_time() - start < 10  # not the file's 600 s

            created = await client.call(
                "session/new", {"cwd": CWD, "mcpServers": [], "_meta": {"backend": "fake"}}
            )
            assert created["_meta"]["fake"]["pid"] > 0  # the command line's agent, not the file's
            assert (await client.prompt(created["sessionId"], "from the flag"))["stopReason"] == "end_turn"
            assert client.agent_text(created["sessionId"]) == "from the flag"
