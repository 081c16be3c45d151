"""The SDK's ``connect(..., turn_states=...)``: ``_acp_server/turn_state`` reaches
``Hooks(on_notification=...)`` only when the client asks, or when the server sends them to clients that
do not say (``--turn-states on``); ``False`` opts out either way. The client's own prompts work without
them."""

from __future__ import annotations

from typing import Any

import trio

from acp_server.client import Hooks

from .helpers import running_server
from .test_client_session import TIMEOUT_S, client_for

TURN_STATE = "_acp_server/turn_state"


async def _states(*, server_sends: bool, **options: Any) -> list[str]:
    """One prompt through the SDK; the turn states its ``on_notification`` hook saw, in order."""
    seen: list[str] = []

    def note(method: str, params: Any) -> None:
        if method == TURN_STATE:
            seen.append(params["state"])

    async with running_server() as (server, nursery):
        server.turn_states = server_sends
        with trio.fail_after(TIMEOUT_S):
            async with client_for(server, nursery, hooks=Hooks(on_notification=note), **options) as client:
                session = await client.new_session("/tmp")
                assert (await session.prompt("hello")).stop_reason == "end_turn"
                await client.request("_acp_server/stats")  # every notification before this answer is in
    return seen


async def test_the_sdk_gets_turn_states_when_it_asks() -> None:
    assert await _states(server_sends=False, turn_states=True) == ["accepted", "running", "completed"]


async def test_the_sdk_gets_none_by_default() -> None:
    assert await _states(server_sends=False) == []


async def test_the_server_may_send_them_to_an_sdk_that_does_not_say_unless_it_opts_out() -> None:
    assert await _states(server_sends=True) == ["accepted", "running", "completed"]
    assert await _states(server_sends=True, turn_states=False) == []
