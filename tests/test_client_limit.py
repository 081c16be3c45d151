"""The client's local pending-prompt guard against the real server: a full guard fails fast and sends
nothing, and the slot comes back on every path by which a prompt's outcome becomes known."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.client import (
    ClientError,
    ConnectionLostError,
    PendingPromptLimitError,
    ProtocolError,
    RpcError,
    SessionClient,
    connect,
)
from acp_server.errors import AgentError

from .fakes import FakeBackend
from .helpers import running_server
from .test_client_session import TIMEOUT_S, Recorder, client_for


async def _hold_one(session: SessionClient, backend: FakeBackend, nursery: trio.Nursery, text: str) -> dict[str, Any]:
    """Start a prompt the backend holds; returns where its outcome lands."""
    box: dict[str, Any] = {}

    async def run() -> None:
        try:
            box["result"] = await session.prompt(text)
        except ClientError as exc:
            box["error"] = exc

    nursery.start_soon(run)
    await backend.started(text)
    return box


async def test_full_guard_fails_locally_and_sends_nothing() -> None:
    """With limit 1, a second concurrent prompt raises ``PendingPromptLimitError`` at once and only
    the first ``session/prompt`` reaches the server; once the first ends, the slot is back."""
    backend = FakeBackend()
    backend.hold("first")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=backend) as (server, nursery):
            rec = Recorder(server, "session/prompt")
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                box = await _hold_one(session, backend, nursery, "first")
                with pytest.raises(PendingPromptLimitError) as info:
                    await session.prompt("second")
                err = info.value
                assert (err.session_id, err.limit, err.pending_count, err.local) == (session.session_id, 1, 1, True)
                assert err.kind == "prompt_queue_full" and err.retry_after_ms is None
                assert rec.count("session/prompt") == 1
                assert server.bridge.get(session.session_id).pending_count == 1
                backend.release("first")
                await trio.testing.wait_all_tasks_blocked()
                assert box["result"].stop_reason == "end_turn"
                assert session.pending_prompts == 0  # released by the result
                assert (await session.prompt("third")).stop_reason == "end_turn"
                assert rec.count("session/prompt") == 2


async def test_slot_is_released_by_an_error_answer() -> None:
    """A prompt that ends in an error answer gives its slot back."""
    backend = FakeBackend()
    backend.fail("bad", AgentError(backend_id="fake", agent_code=1, agent_message="boom", agent_data=None))
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=backend) as (server, nursery):
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                with pytest.raises(RpcError) as info:
                    await session.prompt("bad")
                assert info.value.kind == "agent_error"
                assert session.pending_prompts == 0
                assert (await session.prompt("fine")).stop_reason == "end_turn"


async def test_slot_is_held_until_the_cancel_is_answered() -> None:
    """A cancelled caller leaves at once, but its slot stays reserved until the server answers the
    ``$/cancel_request`` (the server counts the prompt until then); then it is released."""
    backend = FakeBackend()
    backend.hold("held")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=backend) as (server, nursery):
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(session.prompt, "held")
                        await backend.started("held")
                        scope.cancel()
                assert scope.cancelled_caught
                assert session.pending_prompts == 1  # the answer to the cancel has not been read yet
                with pytest.raises(PendingPromptLimitError):
                    await session.prompt("too soon")
                await trio.testing.wait_all_tasks_blocked()
                assert session.pending_prompts == 0
                (call,) = backend.calls_of("held")
                assert call.outcome == "cancelled"
                assert server.bridge.get(session.session_id).pending_count == 0
                assert (await session.prompt("after")).stop_reason == "end_turn"


async def test_a_call_cancelled_before_sending_takes_no_slot_and_sends_nothing() -> None:
    """A prompt whose caller is already cancelled neither reserves a slot nor reaches the server."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            rec = Recorder(server, "session/prompt")
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await session.prompt("never")
                assert scope.cancelled_caught
                assert session.pending_prompts == 0
                await trio.testing.wait_all_tasks_blocked()
                assert rec.count("session/prompt") == 0


async def test_slot_is_released_when_the_connection_is_lost() -> None:
    """The server closing the connection ends the prompt with ``ConnectionLostError`` and frees its slot."""
    backend = FakeBackend()
    backend.hold("held")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=backend) as (server, nursery):
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                outcome: dict[str, BaseException] = {}

                async def prompt() -> None:
                    try:
                        await session.prompt("held")
                    except ConnectionLostError as exc:
                        outcome["error"] = exc

                nursery.start_soon(prompt)
                await backend.started("held")
                (shell,) = server.connections
                shell.close()
                await trio.testing.wait_all_tasks_blocked()
                assert isinstance(outcome["error"], ConnectionLostError)
                assert session.pending_prompts == 0
                async for _ in session.updates:
                    pass  # the update stream ended with the connection
                with pytest.raises(ConnectionLostError):
                    await session.prompt("no connection")


async def test_slot_is_released_by_an_undecodable_result() -> None:
    """A result that is not a prompt result raises ``ProtocolError`` and frees the slot."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            table = server.dispatcher.requests
            table["session/prompt"] = table["session/prompt"]._replace(handler=lambda ctx, params: {"bogus": True})
            async with client_for(server, nursery, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                with pytest.raises(ProtocolError, match="undecodable session/prompt result"):
                    await session.prompt("x")
                assert session.pending_prompts == 0


class _Corrupting(trio.abc.Stream):
    """The server's end of the connection, breaking the JSON-RPC version of lines that answer prompts."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        lines = bytes(data).split(b"\n")
        out = [line.replace(b'"jsonrpc":"2.0"', b'"jsonrpc":"1.0"') if b"stopReason" in line else line for line in lines]
        await self.inner.send_all(b"\n".join(out))

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_slot_is_released_by_an_undecodable_answer_line() -> None:
    """An answer line the core cannot take (wrong ``jsonrpc`` version) fails its call with
    ``ProtocolError`` and frees the slot; the connection goes on."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            client_end, server_end = trio.testing.memory_stream_pair()
            nursery.start_soon(server.handle_stream, _Corrupting(server_end), "corrupting")
            async with connect(client_end, max_pending_prompts=1) as client:
                session = await client.new_session("/tmp")
                with pytest.raises(ProtocolError, match="undecodable answer to session/prompt"):
                    await session.prompt("x")
                assert session.pending_prompts == 0
                assert client.connection.calls_in_flight == 0
                assert (await client.list_sessions())[0].session_id == session.session_id


async def test_servers_queue_full_surfaces_as_the_same_error_with_its_figures() -> None:
    """With the local guard off, the server's ``prompt_queue_full`` is raised as
    ``PendingPromptLimitError`` carrying the server's limit, count and ``retryAfterMs``."""
    backend = FakeBackend()
    backend.hold("first")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(Limits(max_pending_prompts_per_session=1), backend=backend) as (server, nursery):
            async with client_for(server, nursery, max_pending_prompts=0) as client:
                session = await client.new_session("/tmp")
                assert session.prompt_limit is None
                await _hold_one(session, backend, nursery, "first")
                with pytest.raises(PendingPromptLimitError) as info:
                    await session.prompt("second")
                err = info.value
                assert not err.local and err.code == -32001
                assert (err.limit, err.pending_count, err.retry_after_ms) == (1, 1, 5000)
                assert session.pending_prompts == 1
                backend.release("first")
                await trio.testing.wait_all_tasks_blocked()
                assert session.pending_prompts == 0


async def test_disabled_guard_lets_every_prompt_through() -> None:
    """With the server advertising no limit (``null``) the guard is off: concurrent prompts all go out."""
    backend = FakeBackend()
    backend.hold("a", "b", "c")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(Limits(max_pending_prompts_per_session=0), backend=backend) as (server, nursery):
            rec = Recorder(server, "session/prompt")
            async with client_for(server, nursery) as client:
                session = await client.new_session("/tmp")
                for text in "abc":
                    nursery.start_soon(session.prompt, text)
                await rec.wait_for("session/prompt", 3)
                assert session.pending_prompts == 3
                backend.release("a", "b", "c")
                await trio.testing.wait_all_tasks_blocked()
                assert session.pending_prompts == 0
