"""Server-side idempotency keys: a duplicate takes no slot, runs nothing, and gets the same outcome."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import EchoBackend, Turn
from acp_server.types.acp import StopReason

from .helpers import RpcError, connect, running_server


class CountingEcho(EchoBackend):
    """The echo agent, counting its turns."""

    def __init__(self, delay_ms: int = 0) -> None:
        super().__init__(delay_ms=delay_ms)
        self.turns = 0

    async def prompt(self, turn: Turn) -> StopReason:
        self.turns += 1
        return await super().prompt(turn)


async def test_hundred_concurrent_duplicates_run_the_backend_once() -> None:
    backend = CountingEcho(delay_ms=50)
    async with running_server(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        results: list[Any] = []

        async def attempt() -> None:
            results.append(await client.prompt(session_id, "same words", idempotencyKey="k-1"))

        async with trio.open_nursery() as n:
            for _ in range(100):
                n.start_soon(attempt)
        assert backend.turns == 1
        assert len(results) == 100
        prompt_ids = {r["_meta"]["promptId"] for r in results}
        assert len(prompt_ids) == 1 and all(r["stopReason"] == "end_turn" for r in results)
        assert server.bridge.sessions[session_id].pending_count == 0
        # the echo streamed once: duplicates add no updates
        assert client.agent_text(session_id) == "same words"


async def test_recorded_outcome_is_returned_after_completion() -> None:
    backend = CountingEcho()
    async with running_server(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        first = await client.prompt(session_id, "hello", idempotencyKey="k")
        second = await client.prompt(session_id, "hello", idempotencyKey="k")
        assert first == second and backend.turns == 1
        # the key is per session
        other, _ = await client.new_session()
        await client.prompt(other, "hello", idempotencyKey="k")
        assert backend.turns == 2


async def test_same_key_with_a_different_prompt_is_a_conflict() -> None:
    async with running_server(Limits(), CountingEcho()) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        await client.prompt(session_id, "hello", idempotencyKey="k")
        try:
            await client.prompt(session_id, "something else", idempotencyKey="k")
        except RpcError as exc:
            assert exc.code == -32008
            assert exc.data == {"errorKind": "idempotency_key_conflict", "sessionId": session_id, "idempotencyKey": "k"}
        else:
            raise AssertionError("a conflicting prompt was admitted")
        # _meta is not compared: another deadline with the same content is the same prompt
        assert (await client.prompt(session_id, "hello", idempotencyKey="k", deadlineMs=60000))["stopReason"] == "end_turn"


async def test_refused_admission_records_nothing() -> None:
    backend = CountingEcho(delay_ms=1000)
    limits = Limits(max_pending_prompts_per_session=1)
    async with running_server(limits, backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        nursery.start_soon(client.prompt, session_id, "first")
        await trio.testing.wait_all_tasks_blocked()
        try:
            await client.prompt(session_id, "second", idempotencyKey="r")
        except RpcError as exc:
            assert exc.kind == "prompt_queue_full"
        else:
            raise AssertionError("second prompt was admitted past the limit")
        assert ("r" not in {key for (_, key) in server.bridge._idempotency})


async def test_keys_expire_after_the_ttl(autojump_clock: trio.testing.MockClock) -> None:
    backend = CountingEcho()
    async with running_server(Limits(idempotency_ttl_s=5), backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        await client.prompt(session_id, "hello", idempotencyKey="k")
        await trio.sleep(5.5)
        await client.prompt(session_id, "hello", idempotencyKey="k")
        assert backend.turns == 2


async def test_table_is_bounded_oldest_first() -> None:
    backend = CountingEcho()
    async with running_server(Limits(max_idempotency_keys=3), backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        for i in range(4):
            await client.prompt(session_id, "x", idempotencyKey=f"k{i}")
        assert len(server.bridge._idempotency) == 3
        await client.prompt(session_id, "x", idempotencyKey="k0")  # forgotten: runs again
        await client.prompt(session_id, "x", idempotencyKey="k3")  # remembered: does not
        assert backend.turns == 5


async def test_cancelling_a_duplicate_does_not_cancel_the_prompt() -> None:
    backend = CountingEcho(delay_ms=200)
    async with running_server(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        first: list[Any] = []
        first_done = trio.Event()

        async def original() -> None:
            first.append(await client.prompt(session_id, "slow", idempotencyKey="d"))
            first_done.set()

        nursery.start_soon(original)
        await trio.testing.wait_all_tasks_blocked()
        dup_id, reply = client.start_request("session/prompt")
        await client.send({"jsonrpc": "2.0", "id": dup_id, "method": "session/prompt", "params": {
            "sessionId": session_id, "prompt": [{"type": "text", "text": "slow"}], "_meta": {"idempotencyKey": "d"}}})
        await trio.testing.wait_all_tasks_blocked()
        await client.notify("$/cancel_request", {"requestId": dup_id})
        answer = await reply.receive()
        assert answer["error"]["data"]["errorKind"] == "request_cancelled"
        with trio.fail_after(5):
            await first_done.wait()
        assert first[0]["stopReason"] == "end_turn" and backend.turns == 1
