"""An echo agent written with the official ACP Python SDK (``agent-client-protocol``), served on stdio.

It is the SDK side of the benchmark's A/B comparison, so it behaves like ``acp-server``'s echo
backend: the prompt's text comes back as ``agent_message_chunk`` updates, one chunk per word with
its whitespace kept (the chunks joined equal the text), then ``stopReason: "end_turn"``. It imports
nothing from ``acp_server``: it is what a developer would write with the SDK alone.

Run: ``python bench/peers/sdk_echo_agent.py`` (an ACP client spawns it and talks over stdin/stdout).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any, cast

from acp import (
    PROTOCOL_VERSION,
    Agent,
    Client,
    InitializeResponse,
    NewSessionResponse,
    PromptResponse,
    run_agent,
    update_agent_message_text,
)
from acp.schema import AgentCapabilities, Implementation

# The same split as acp_server.backends.echo.split_words: a word with the whitespace around it.
_WORD = re.compile(r"\s*\S+\s*|\s+")


def _block_text(block: Any) -> str:
    text = getattr(block, "text", None)
    if isinstance(text, str):
        return text
    return f"[{getattr(block, 'type', 'unknown')} block]"


class SdkEchoAgent:
    """Echoes every prompt back word by word through the SDK's connection.

    It implements the part of the SDK's ``Agent`` protocol a client uses here; the SDK answers the
    other methods with ``method_not_found``.
    """

    def __init__(self) -> None:
        self._conn: Client | None = None

    def on_connect(self, conn: Client) -> None:
        self._conn = conn

    async def initialize(
        self, protocol_version: int, client_capabilities: Any = None, client_info: Any = None, **kwargs: Any
    ) -> InitializeResponse:
        return InitializeResponse(
            protocol_version=PROTOCOL_VERSION,
            agent_capabilities=AgentCapabilities(),
            agent_info=Implementation(name="sdk-echo", version="0"),
        )

    async def new_session(
        self, cwd: str, additional_directories: Any = None, mcp_servers: Any = None, **kwargs: Any
    ) -> NewSessionResponse:
        return NewSessionResponse(session_id=f"sess_{uuid.uuid4().hex}")

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        assert self._conn is not None
        for block in prompt:
            for chunk in _WORD.findall(_block_text(block)):
                await self._conn.session_update(session_id, update_agent_message_text(chunk))
        return PromptResponse(stop_reason="end_turn")

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        return None


def main() -> None:
    asyncio.run(run_agent(cast(Agent, SdkEchoAgent())))


if __name__ == "__main__":
    main()
