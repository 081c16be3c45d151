"""Session calls that reach the agent: session/set_config_option, and session/new with its `_meta`."""

from __future__ import annotations

from acp_server.backends import EchoBackend

from .helpers import RpcError, connect, running_server
from .test_e2e_agent import agent_server
from .test_e2e_agent import connect as connect_agent


async def test_set_config_option_is_forwarded_to_the_agent() -> None:
    async with agent_server(others={"echo": EchoBackend()}) as (server, nursery):
        client = await connect_agent(server, nursery)
        result = await client.call("session/new", {"cwd": "/tmp", "mcpServers": []})
        session_id = result["sessionId"]
        answer = await client.call(
            "session/set_config_option", {"sessionId": session_id, "configId": "verbose", "value": True}
        )
        assert answer["configOptions"][0]["currentValue"] is True
        try:
            await client.call("session/set_config_option", {"sessionId": session_id, "configId": "nope", "value": "x"})
        except RpcError as exc:
            assert exc.kind == "agent_error" and exc.data["agentCode"] == -32602
        else:
            raise AssertionError("the agent's refusal did not reach the client")


async def test_echo_has_no_config_options() -> None:
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        try:
            await client.call("session/set_config_option", {"sessionId": session_id, "configId": "x", "value": True})
        except RpcError as exc:
            assert exc.code == -32602 and exc.data["path"] == "configId"
        else:
            raise AssertionError("echo accepted a config option")
        try:
            await client.call("session/set_config_option", {"sessionId": "sess_nope", "configId": "x", "value": True})
        except RpcError as exc:
            assert exc.kind == "session_not_found"
        else:
            raise AssertionError("an unknown session was accepted")


async def test_session_new_meta_passes_through_without_our_keys() -> None:
    """Other ``_meta`` on session/new reaches the agent; ours (clientId, backend, ...) does not, and the
    agent's result ``_meta`` comes back beside our clientId."""
    async with agent_server() as (server, nursery):
        client = await connect_agent(server, nursery)
        result = await client.call(
            "session/new",
            {"cwd": "/tmp", "mcpServers": [], "_meta": {"trace": "t-1", "clientId": "client_x", "backend": "agent"}},
        )
        assert result["_meta"]["requestMeta"] == {"trace": "t-1"}
        assert result["_meta"]["clientId"].startswith("client_") and result["_meta"]["clientId"] != "client_x"
        assert result["_meta"]["fake"]["cwd"] == "/tmp"
