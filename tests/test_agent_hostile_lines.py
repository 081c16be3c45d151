"""An ACP agent that writes lines the decoder cannot use (nested too deep, not UTF-8, truncated): each
such line is skipped with a log line, or fails the one prompt it answers with a structured error; the
agent's other sessions, the other connections and the server carry on."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from acp_server.backends import AcpAgentBackend, Backend, EchoBackend
from acp_server.server import Server

from .helpers import ROOT, RpcError, connect

AGENT = "raw"
RAW_AGENT = [sys.executable, str(ROOT / "tests" / "agents" / "raw_agent.py")]


@asynccontextmanager
async def raw_agent_server() -> AsyncIterator[tuple[Server, trio.Nursery]]:
    agent = AcpAgentBackend(AGENT, RAW_AGENT, cwd=str(ROOT))
    backends: dict[str, Backend] = {AGENT: agent, "echo": EchoBackend()}
    server = Server(None, backends, default_backend=AGENT)
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        await nursery.start(server.bridge.run)
        await agent.ensure_started()
        yield server, nursery
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("text", ["deep-update", "bad-utf8", "truncated"])
async def test_an_unusable_agent_update_is_skipped_and_the_turn_completes(
    text: str, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(30):
        async with raw_agent_server() as (server, nursery):
            client = await connect(server, nursery)
            other = await connect(server, nursery)
            session_id, _ = await client.new_session(str(ROOT))
            echo_session, _ = await other.new_session(str(ROOT), backend="echo")
            done: list[str] = []

            async def keep_prompting() -> None:
                for i in range(10):
                    done.append((await other.prompt(echo_session, f"p{i}"))["stopReason"])

            async with trio.open_nursery() as inner:
                inner.start_soon(keep_prompting)
                for _ in range(3):
                    result = await client.prompt(session_id, text)
                    assert result["stopReason"] == "end_turn"
            assert client.agent_text(session_id) == "ok " * 3  # the unusable lines were skipped
            assert done == ["end_turn"] * 10
            # and the agent still serves plain prompts
            assert (await client.prompt(session_id, "plain"))["stopReason"] == "end_turn"
    assert any("agent" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


async def test_an_answer_nested_too_deep_fails_its_prompt_with_a_structured_error() -> None:
    with trio.fail_after(30):
        async with raw_agent_server() as (server, nursery):
            client = await connect(server, nursery)
            session_id, _ = await client.new_session(str(ROOT))
            with pytest.raises(RpcError) as info:
                await client.prompt(session_id, "deep-answer")
            assert info.value.kind not in (None, "internal"), info.value.error
            assert (await client.prompt(session_id, "plain"))["stopReason"] == "end_turn"
            result: Any = await client.call("_acp_server/capabilities")
            assert "limits" in result
