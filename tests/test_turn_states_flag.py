"""``serve --turn-states on|off`` and ``initialize`` capabilities as the official ACP SDK client sees them.

An editor cannot send ``initialize`` ``_meta.turnStates: false``; ``--turn-states off`` (or
``turn_states = false`` in ``--config``) spares it ``_acp_server/turn_state`` notifications, and a
client that asks for them (``_meta.turnStates: true``) still gets them. ``loadSession`` is advertised
only when sessions outlive the process (a state directory).
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


def test_turn_states_off_sends_none_to_the_sdk_client() -> None:
    """Default on: the SDK client gets accepted, running, completed. ``--turn-states off``: none."""
    _, on, _ = asyncio.run(_session())
    assert _turn_states(on) == ["accepted", "running", "completed"]
    _, off, client = asyncio.run(_session("--turn-states", "off"))
    assert _turn_states(off) == []
    assert client.kinds() == {"agent_message_chunk": 2}  # the updates still flow


def test_a_client_asking_for_turn_states_overrides_off() -> None:
    """``initialize`` ``_meta.turnStates: true`` wins over the server's ``off`` for that connection."""
    _, recorder, _ = asyncio.run(_session("--turn-states", "off", meta={"turnStates": True}))
    assert _turn_states(recorder) == ["accepted", "running", "completed"]


def test_turn_states_from_the_config_file(tmp_path: pathlib.Path) -> None:
    """``turn_states = false`` in ``--config``; ``--turn-states on`` overrides the file."""
    config = tmp_path / "acp-server.toml"
    config.write_text("turn_states = false\n")
    _, off, _ = asyncio.run(_session("--config", str(config)))
    assert _turn_states(off) == []
    _, on, _ = asyncio.run(_session("--config", str(config), "--turn-states", "on"))
    assert _turn_states(on) == ["accepted", "running", "completed"]


def test_load_session_only_when_sessions_outlive_the_process(tmp_path: pathlib.Path) -> None:
    """stdio without a state directory (ephemeral): ``loadSession`` false; with ``--state-dir``: true.
    The other session capabilities (list, resume, close) work in memory and stay advertised."""
    ephemeral, _, _ = asyncio.run(_session())
    assert ephemeral.agent_capabilities.load_session is False
    caps = ephemeral.agent_capabilities.session_capabilities
    assert caps.list is not None and caps.resume is not None and caps.close is not None
    durable, _, _ = asyncio.run(_session("--state-dir", str(tmp_path / "state")))
    assert durable.agent_capabilities.load_session is True


def test_the_prompt_command_asks_for_turn_states_on_a_server_with_them_off() -> None:
    """``acp-server prompt`` needs them for its progress line: it sends ``_meta.turnStates: true``."""
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
