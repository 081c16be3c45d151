"""The README's quick start and editor snippets, run as written.

Each snippet is read from ``README.md`` itself (the fenced block after ``<!-- snippet: NAME -->``), so
the README cannot drift from what works. The editor snippets are spawned the way an editor does it: the
``command`` and ``args`` of the ``agent_servers`` entry, its ``env`` over a minimal environment (``PATH``
of the system only, a fresh ``HOME``), working directory ``/``, and the official ACP SDK as the editor's
side of the connection. Only the placeholders change: ``/path/to/acp-server`` becomes this checkout, the
daemon's ``tcp://127.0.0.1:4170`` the test daemon's address (the quick start gets its address through
the ``LISTEN`` and ``ACP_SERVER_URL`` variables the README documents), and ``claude-code-acp`` is a
stand-in script on that ``PATH`` that runs ``tests/agents/fake_agent.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Any, cast

import acp
import pytest
from acp import schema

from acp_server.client import cli as client_cli

from .helpers import ROOT
from .sdk_driver import Recorder, RecordingClient
from .test_e2e_sdk import ServerProcess

README = (ROOT / "README.md").read_text()
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
DAEMON_URL = "tcp://127.0.0.1:4170"
TIMEOUT_S = 60.0


def snippet(name: str) -> tuple[str, str]:
    """The language and the body of the fenced block after ``<!-- snippet: NAME -->``."""
    found = re.search(rf"<!-- snippet: {re.escape(name)} -->\n```(\w+)\n(.*?)\n```", README, re.S)
    assert found is not None, f"README.md has no snippet {name!r}"
    return found.group(1), found.group(2)


def editor_entry(name: str) -> dict[str, Any]:
    lang, body = snippet(name)
    assert lang == "json"
    (entry,) = json.loads(body)["agent_servers"].values()
    return cast(dict[str, Any], entry)


def minimal_env(home: pathlib.Path, **extra: str) -> dict[str, str]:
    return {"PATH": SYSTEM_PATH, "HOME": str(home), "XDG_STATE_HOME": str(home / "state"), **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _real(text: str, url: str | None = None) -> str:
    text = text.replace("/path/to/acp-server", str(ROOT))
    return text.replace(DAEMON_URL, url) if url else text


async def _as_editor(entry: dict[str, Any], env: dict[str, str], text: str) -> tuple[Any, str, str, Recorder]:
    """Spawn the entry like an editor (cwd /), initialize, open a session, prompt ``text``."""
    client = RecordingClient()
    recorder = Recorder()
    async with acp.spawn_agent_process(
        cast(acp.Client, client),
        entry["command"],
        *entry["args"],
        env={**env, **entry.get("env", {})},
        cwd="/",
        transport_kwargs={"stderr": None},
        observers=[recorder],
    ) as (conn, _process):
        init = await asyncio.wait_for(
            conn.initialize(
                protocol_version=acp.PROTOCOL_VERSION,
                client_capabilities=schema.ClientCapabilities(),
                client_info=schema.Implementation(name="zed-like", version="0"),
            ),
            TIMEOUT_S,
        )
        session = await conn.new_session(cwd="/tmp", mcp_servers=[])
        result = await asyncio.wait_for(
            conn.prompt(session_id=session.session_id, prompt=[acp.text_block(text)]), TIMEOUT_S
        )
        return init, session.session_id, result.stop_reason, recorder


def _agent_text(recorder: Recorder) -> str:
    out = []
    for msg in recorder.incoming:
        update = (msg.get("params") or {}).get("update") if msg.get("method") == "session/update" else None
        if update and update.get("sessionUpdate") == "agent_message_chunk":
            out.append(update["content"]["text"])
    return "".join(out)


def test_quick_start_as_written(tmp_path: pathlib.Path) -> None:
    """``make run`` in one terminal, ``.venv/bin/acp-server prompt "hello"`` in another: the server says
    where it listens and what to run next; the prompt prints ``hello`` and the stop line; the sessions
    are kept in the state directory of that address."""
    lang, body = snippet("quick-start")
    assert lang == "sh"
    commands = [line.split("#", 1)[0].strip() for line in body.splitlines() if line.strip()]
    assert commands == ["make run", '.venv/bin/acp-server prompt "hello"']
    url = f"tcp://127.0.0.1:{free_port()}"
    env = minimal_env(tmp_path, LISTEN=url, ACP_SERVER_URL=url)
    server = subprocess.Popen(
        shlex.split(commands[0]), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    said: list[str] = []
    try:
        assert server.stdout is not None
        deadline = time.monotonic() + TIMEOUT_S
        while not any("acp-server: listening on" in line for line in said):
            line = server.stdout.readline()
            assert line and time.monotonic() < deadline, f"make run never listened: {said}"
            said.append(line.rstrip("\n"))
        prompt = subprocess.run(shlex.split(commands[1]), cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in that terminal: make and its server
        rest, _ = server.communicate(timeout=TIMEOUT_S)
        said += rest.splitlines()
    assert f"acp-server: listening on {url}" in said
    hint = next(line for line in said if line.startswith("acp-server: serving the echo agent on"))
    assert f'.venv/bin/acp-server prompt --connect {url} "hello"' in hint
    assert f"{ROOT}/.venv/bin/acp-server connect {url}" in hint
    assert prompt.returncode == 0, prompt.stderr
    assert prompt.stdout == "hello\n"
    assert re.match(r"acp-server: session sess_\w+ client \S+\n", prompt.stderr)
    assert prompt.stderr.endswith("acp-server: stop end_turn\n")
    port = url.rsplit(":", 1)[1]
    assert (tmp_path / "state" / "acp-server" / f"tcp-127.0.0.1-{port}" / "sessions.db").is_file()


def test_zed_spawning_serve_stdio(tmp_path: pathlib.Path) -> None:
    """The ``serve --stdio`` entry, spawned from ``/`` with a bare environment, answers like an agent;
    sessions live in memory only, so it does not advertise ``loadSession``."""
    entry = json.loads(_real(json.dumps(editor_entry("zed-stdio"))))
    assert entry["type"] == "custom" and os.path.isabs(entry["command"])
    init, _, stop, recorder = asyncio.run(_as_editor(entry, minimal_env(tmp_path), "hello from zed"))
    assert init.agent_info.name == "acp-server"
    assert init.agent_capabilities.load_session is False
    assert stop == "end_turn"
    assert _agent_text(recorder) == "hello from zed"
    assert not (tmp_path / "state").exists()  # nothing written


def test_zed_sharing_a_daemon_with_connect(tmp_path: pathlib.Path) -> None:
    """The ``connect`` entry reaches the running daemon: the session made through it is listed there,
    and the daemon keeps sessions (``loadSession`` advertised)."""
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--state-dir", str(tmp_path / "daemon")) as daemon:
        (url,) = daemon.wait_listening()
        entry = json.loads(_real(json.dumps(editor_entry("zed-connect")), url))
        assert entry["args"] == ["connect", url]
        init, session_id, stop, recorder = asyncio.run(_as_editor(entry, minimal_env(tmp_path), "shared"))
        listed = subprocess.run([sys.executable, "-m", "acp_server", "sessions", "--connect", url],
                                capture_output=True, text=True, timeout=TIMEOUT_S)
    assert stop == "end_turn" and _agent_text(recorder) == "shared"
    assert init.agent_capabilities.load_session is True
    assert session_id in listed.stdout


def test_zed_in_front_of_an_existing_agent(tmp_path: pathlib.Path) -> None:
    """``serve --stdio -- claude-code-acp``: the agent found on the editor's ``PATH`` (here a stand-in
    running the fake agent) answers through acp-server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "claude-code-acp"
    stand_in.write_text(f"#!/bin/sh\ncd {shlex.quote(str(ROOT))} && exec {shlex.quote(sys.executable)} -m tests.agents.fake_agent\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    entry = json.loads(_real(json.dumps(editor_entry("zed-front"))))
    assert entry["args"][-2:] == ["--", "claude-code-acp"]
    env = minimal_env(tmp_path)
    env["PATH"] = f"{bin_dir}:{SYSTEM_PATH}"
    _, _, stop, recorder = asyncio.run(_as_editor(entry, env, "fronted agent"))
    assert stop == "end_turn"
    assert _agent_text(recorder) == "fronted agent"


def test_python_client_snippet_reads_text_and_tool_calls(tmp_path: pathlib.Path) -> None:
    """The README's Python client, run as written against a server whose agent makes a tool call,
    prints the tool call's lines, the streamed text and the stop reason."""
    lang, code = snippet("python-client")
    assert lang == "python"
    agent = ["--", sys.executable, "-m", "tests.agents.fake_agent", "--tool-call"]
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--ephemeral", *agent) as server:
        (url,) = server.wait_listening()
        run = subprocess.run([sys.executable, "-c", code.replace(DAEMON_URL, url)], cwd="/",
                             env=minimal_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "[tool call-1] Read notes.txt pending",
        "[tool call-1] in_progress",
        "[tool call-1] completed",
        "hello",
        "stop: end_turn",
    ]


def test_readme_documents_the_client_flags_and_variables() -> None:
    """Every ``prompt`` flag has a row in the README's table; every environment and ``make`` variable
    the code and the Makefile read is in the README's variable tables."""
    import argparse

    parser = argparse.ArgumentParser()
    client_cli.add_commands(parser.add_subparsers(dest="command"))
    prompt_parser = parser._subparsers._group_actions[0].choices["prompt"]  # type: ignore[union-attr]
    flags = {o for a in prompt_parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    section = README.split("**`acp-server prompt [FLAGS] TEXT...`**", 1)[1].split("\n**", 1)[0]
    documented = set(re.findall(r"`(--[a-z-]+)", section))
    assert flags <= documented, flags - documented
    makefile = (ROOT / "Makefile").read_text()
    for variable in re.findall(r"^([A-Z_]+) \?=", makefile, re.M):
        assert f"| `{variable}` |" in README, variable
    for variable in ("ACP_SERVER_URL", "XDG_STATE_HOME", "ACP_SERVER_FULL"):
        assert f"| `{variable}` |" in README, variable


@pytest.mark.parametrize("name", ["zed-stdio", "zed-connect", "zed-front"])
def test_editor_snippets_are_valid_zed_entries(name: str) -> None:
    entry = editor_entry(name)
    assert set(entry) == {"type", "command", "args", "env"}
    assert entry["command"] == "/path/to/acp-server/.venv/bin/acp-server"
