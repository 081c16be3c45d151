"""The SDK names its tenant at ``initialize``: sessions belong to it, other tenants cannot see them."""

from __future__ import annotations

import pytest
import trio

from acp_server.client import RpcError
from acp_server.client.client import Client
from acp_server.server import Server

from .helpers import running_server
from .test_client_session import TIMEOUT_S, client_for


async def test_sdk_tenant_id_scopes_sessions() -> None:
    async with running_server() as (server, nursery):
        assert isinstance(server, Server)
        with trio.fail_after(TIMEOUT_S):
            async with (
                client_for(server, nursery, tenant_id="acme") as acme,
                client_for(server, nursery, tenant_id="globex") as globex,
                client_for(server, nursery, tenant_id="acme") as acme2,
            ):
                session = await acme.new_session("/tmp")
                assert (await session.prompt("hello")).stop_reason == "end_turn"
                assert server.bridge.sessions[session.session_id].tenant == "acme"
                with pytest.raises(RpcError) as info:
                    await globex.request(
                        "session/prompt", {"sessionId": session.session_id, "prompt": [{"type": "text", "text": "x"}]}
                    )
                assert info.value.kind == "session_not_found"
                listed = await globex.request("session/list", {})
                assert listed["sessions"] == []
                listed = await acme2.request("session/list", {})
                assert [s["sessionId"] for s in listed["sessions"]] == [session.session_id]


def test_sdk_tenant_id_must_be_a_non_empty_string() -> None:
    with pytest.raises(ValueError, match="tenant_id"):
        Client(None, tenant_id="")  # type: ignore[arg-type]
