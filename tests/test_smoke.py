"""A first end-to-end pass over memory streams: initialize, new session, prompt, refusals."""

import trio

from acp_server.admission import Limits
from acp_server.backends import EchoBackend

from .helpers import RpcError, connect, running_server


async def test_echo_round_trip() -> None:
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, client_id = await client.new_session()
        assert client_id.startswith("client_")
        result = await client.prompt(session_id, "hello  big world ")
        assert result["stopReason"] == "end_turn"
        assert client.agent_text(session_id) == "hello  big world "


async def test_sixth_prompt_refused() -> None:
    async with running_server(Limits(), EchoBackend(delay_ms=100)) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        outcomes: list[object] = []

        async def one(i: int) -> None:
            try:
                outcomes.append(await client.prompt(session_id, f"p{i}"))
            except RpcError as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
                await trio.sleep(0.001)
        refused = [o for o in outcomes if isinstance(o, RpcError)]
        assert len(refused) == 1
        assert refused[0].code == -32001
        assert refused[0].data["pendingCount"] == 5 and refused[0].data["limit"] == 5
