"""``serve --turn-states on|off`` and ``initialize`` capabilities as the official ACP SDK client sees them.

``_acp_server/turn_state`` is an extension: a client whose ``initialize`` does not say
(``_meta.turnStates``), as an editor's, gets none by default, and one that asks gets them.
``--turn-states on`` (or ``turn_states = true`` in ``--config``) sends them to the clients that do not
say; a client's ``_meta.turnStates: false`` still wins. ``loadSession`` is advertised only when sessions
outlive the process (a state directory).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
from typing import Any, cast

import acp
from acp import schema

from .sdk_driver import Recorder, RecordingClient

TURN_STATE = "_acp_server/turn_state"


async def _session(*serve_args: str, meta: dict[str, Any] | None = None) -> tuple[Any, Recorder, RecordingClient]:
    """Spawn ``serve --stdio ARGS`` through the SDK, initialize (with ``_meta`` keys), prompt once."""
    client = RecordingClient()
    recorder = Recorder()
    async with acp.spawn_agent_process(
        cast(acp.Client, client),
        sys.executable,
        "-m",
        "acp_server",
        "serve",
        "--stdio",
        *serve_args,
        env=dict(os.environ),
        transport_kwargs={"stderr": None},
        observers=[recorder],
    ) as (conn, _process):
        init = await conn.initialize(
            protocol_version=acp.PROTOCOL_VERSION,
            client_capabilities=schema.ClientCapabilities(),
            client_info=schema.Implementation(name="turn-states-test", version="0"),
            **(meta or {}),
        )
        session = await conn.new_session(cwd="/tmp", mcp_servers=[])
        result = await conn.prompt(session_id=session.session_id, prompt=[acp.text_block("turn states")])
        assert result.stop_reason == "end_turn"
        assert client.agent_text() == "turn states"
    return init, recorder, client


def _turn_states(recorder: Recorder) -> list[str]:
    return [m["params"]["state"] for m in recorder.incoming if m.get("method") == TURN_STATE]


def test_by_default_the_sdk_client_gets_no_turn_states() -> None:
    """Default: the SDK client, which does not say, gets no turn state; its updates still flow."""
    _, silent, client = asyncio.run(_session())
    assert _turn_states(silent) == []
    assert client.kinds() == {"agent_message_chunk": 2}


def test_a_client_that_asks_gets_turn_states() -> None:
    """``initialize`` ``_meta.turnStates: true`` gets accepted, running, completed (default server)."""
    _, recorder, _ = asyncio.run(_session(meta={"turnStates": True}))
    assert _turn_states(recorder) == ["accepted", "running", "completed"]


def test_turn_states_on_sends_them_to_clients_that_do_not_say() -> None:
    """``--turn-states on``: the SDK client gets all three; ``_meta.turnStates: false`` still wins."""
    _, on, _ = asyncio.run(_session("--turn-states", "on"))
    assert _turn_states(on) == ["accepted", "running", "completed"]
    _, opted_out, client = asyncio.run(_session("--turn-states", "on", meta={"turnStates": False}))
    assert _turn_states(opted_out) == []
    assert client.kinds() == {"agent_message_chunk": 2}


def test_turn_states_from_the_config_file(tmp_path: pathlib.Path) -> None:
    """``turn_states = true`` in ``--config`` turns them on; ``--turn-states off`` overrides the file."""
    config = tmp_path / "acp-server.toml"
    config.write_text("turn_states = true\n")
    _, on, _ = asyncio.run(_session("--config", str(config)))
    assert _turn_states(on) == ["accepted", "running", "completed"]
    _, off, _ = asyncio.run(_session("--config", str(config), "--turn-states", "off"))
    assert _turn_states(off) == []


def test_load_session_only_when_sessions_outlive_the_process(tmp_path: pathlib.Path) -> None:
    """stdio without a state directory (ephemeral): ``loadSession`` false; with ``--state-dir``: true.
    The other session capabilities (list, resume, close) work in memory and stay advertised."""
    ephemeral, _, _ = asyncio.run(_session())
    assert ephemeral.agent_capabilities.load_session is False
    caps = ephemeral.agent_capabilities.session_capabilities
    assert caps.list is not None and caps.resume is not None and caps.close is not None
    durable, _, _ = asyncio.run(_session("--state-dir", str(tmp_path / "state")))
    assert durable.agent_capabilities.load_session is True


def test_the_prompt_command_asks_for_turn_states() -> None:
    """``acp-server prompt`` needs them for its progress line: it sends ``_meta.turnStates: true``, so
    a server that sends none to clients that do not say (the default, and ``off``) still sends them."""
    import json
    import subprocess

    from .test_e2e_sdk import ServerProcess

    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--ephemeral", "--turn-states", "off") as server:
        (url,) = server.wait_listening()
        run = subprocess.run(
            [sys.executable, "-m", "acp_server", "prompt", "--connect", url, "--json", "x"],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )
    assert run.returncode == 0, run.stderr
    states = [e["state"] for e in map(json.loads, run.stdout.splitlines()) if e["type"] == "turn_state"]
    assert states == ["accepted", "running", "completed"]
