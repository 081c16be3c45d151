"""The connection shell times overload refusals, read to written, and nothing else."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from jsonrpcserver.response import ErrorResponse, serialize_error

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.errors import InternalError, PromptQueueFullError, SessionNotFoundError
from acp_server.jsonrpc import EncodedError, encode_error
from acp_server.server import Server
from acp_server.transports.timing import LatencyHistogram

from .helpers import RawClient, connect, running_server


def open_connection(
    server: Server, nursery: trio.Nursery, pair: Callable[[], tuple[Any, Any]] = trio.testing.memory_stream_pair
) -> tuple[RawClient, LatencyHistogram]:
    """A connection served by ``server.handle_stream`` over ``pair``, and the server's refusal histogram
    (each test's server is fresh: only this connection's refusals land in it)."""
    client_end, server_end = pair()
    nursery.start_soon(server.handle_stream, server_end, "test")
    return RawClient(client_end), server.refusal_latency


@asynccontextmanager
async def shell_with_histogram(server: Server, nursery: trio.Nursery) -> AsyncIterator[tuple[RawClient, LatencyHistogram]]:
    client, histogram = open_connection(server, nursery)
    nursery.start_soon(client.pump)
    await client.initialize()
    yield client, histogram


def prompt_params(session_id: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": "hi"}]}


async def test_a_real_prompt_queue_full_is_timed_from_read_to_written() -> None:
    """A session held full refuses the next prompt; its time lands in the histogram, positive and
    no longer than the client's own round trip."""
    limits = Limits(max_pending_prompts_per_session=1)
    with trio.fail_after(10):
        async with running_server(limits, EchoBackend(delay_ms=60_000)) as (server, nursery):
            async with shell_with_histogram(server, nursery) as (client, histogram):
                session_id, _ = await client.new_session()
                held_id, _held = client.start_request("session/prompt")
                await client.send({"jsonrpc": "2.0", "id": held_id, "method": "session/prompt", "params": prompt_params(session_id)})
                await trio.testing.wait_all_tasks_blocked()
                assert histogram.count == 0

                refusals = 3
                started = time.perf_counter()
                for _ in range(refusals):
                    answer = await client.call_raw("session/prompt", prompt_params(session_id))
                    assert answer["error"]["data"]["errorKind"] == "prompt_queue_full"
                await trio.testing.wait_all_tasks_blocked()  # the writer records after its send_all
                round_trips_us = (time.perf_counter() - started) * 1e6

                assert histogram.count == refusals
                snap = histogram.snapshot()
                assert 0 < snap["p50Us"] <= snap["p99Us"] <= snap["maxUs"]
                assert histogram.sum_ns / 1000 <= round_trips_us
            nursery.cancel_scope.cancel()


async def test_a_refusal_queued_while_another_write_blocks_is_counted_once() -> None:
    """The writer is stuck writing an answer when a refusal is queued: that refusal is recorded once,
    after the write that carries it (not when the earlier write returns)."""
    limits = Limits(max_pending_prompts_per_session=1)
    with trio.fail_after(10):
        async with running_server(limits, EchoBackend(delay_ms=60_000)) as (server, nursery):
            client, histogram = open_connection(server, nursery, trio.testing.lockstep_stream_pair)  # writes block
            reading = trio.CancelScope()

            async def pump_until_stopped() -> None:
                with reading:
                    await client.pump()

            nursery.start_soon(pump_until_stopped)
            await client.initialize()
            session_id, _ = await client.new_session()
            held_id, _held = client.start_request("session/prompt")
            await client.send({"jsonrpc": "2.0", "id": held_id, "method": "session/prompt", "params": prompt_params(session_id)})
            await trio.testing.wait_all_tasks_blocked()

            reading.cancel()  # the client stops reading: the writer's next send_all blocks
            await trio.testing.wait_all_tasks_blocked()
            caps_id, caps = client.start_request("_acp_server/capabilities")
            await client.send({"jsonrpc": "2.0", "id": caps_id, "method": "_acp_server/capabilities"})
            await trio.testing.wait_all_tasks_blocked()  # the writer is stuck on that answer
            refused_id, refused = client.start_request("session/prompt")
            await client.send({"jsonrpc": "2.0", "id": refused_id, "method": "session/prompt", "params": prompt_params(session_id)})
            await trio.testing.wait_all_tasks_blocked()
            assert histogram.count == 0  # queued, not written yet

            nursery.start_soon(client.pump)  # reading again: both answers come out
            assert "result" in await caps.receive()
            assert (await refused.receive())["error"]["data"]["errorKind"] == "prompt_queue_full"
            await trio.testing.wait_all_tasks_blocked()
            assert histogram.count == 1
            nursery.cancel_scope.cancel()


async def test_other_errors_and_results_are_not_timed() -> None:
    """session_not_found, method_not_found and a successful prompt leave the histogram empty."""
    with trio.fail_after(10):
        async with running_server(Limits(max_pending_prompts_per_session=1)) as (server, nursery):
            async with shell_with_histogram(server, nursery) as (client, histogram):
                session_id, _ = await client.new_session()
                assert (await client.prompt(session_id))["stopReason"] == "end_turn"
                missing = await client.call_raw("session/prompt", prompt_params("sess_missing"))
                assert missing["error"]["data"]["errorKind"] == "session_not_found"
                unknown = await client.call_raw("no/such_method")
                assert unknown["error"]["data"]["errorKind"] == "method_not_found"
                await trio.testing.wait_all_tasks_blocked()
                assert histogram.count == 0
            nursery.cancel_scope.cancel()


async def test_stats_report_the_servers_refusals() -> None:
    """Through Server.handle_stream: a refusal shows in ``_acp_server/stats`` under ``refusals``."""
    limits = Limits(max_pending_prompts_per_session=1)
    with trio.fail_after(10):
        async with running_server(limits, EchoBackend(delay_ms=60_000)) as (server, nursery):
            client = await connect(server, nursery)
            session_id, _ = await client.new_session()
            held_id, _held = client.start_request("session/prompt")
            await client.send({"jsonrpc": "2.0", "id": held_id, "method": "session/prompt", "params": prompt_params(session_id)})
            before = (await client.call("_acp_server/stats"))["refusals"]
            assert before == {"count": 0, "p50Us": 0.0, "p99Us": 0.0, "maxUs": 0.0, "byKind": {}}
            answer = await client.call_raw("session/prompt", prompt_params(session_id))
            assert answer["error"]["data"]["errorKind"] == "prompt_queue_full"
            await trio.testing.wait_all_tasks_blocked()
            after = (await client.call("_acp_server/stats"))["refusals"]
            assert after["count"] == 1 and 0 < after["p50Us"] <= after["maxUs"]
            assert after["byKind"] == {"prompt_queue_full": 1}
            nursery.cancel_scope.cancel()


def test_dispatch_errors_keep_their_error_and_stay_bytes() -> None:
    """What lets the shell tell a refusal apart without parsing: the encoded error carries it."""
    error = PromptQueueFullError(session_id="s", limit=1, pending_count=1, retry_after_ms=1000)
    data = EncodedError.of(3, error)
    assert isinstance(data, bytes) and data == encode_error(3, error)
    assert data.error is error and b"".join([b"a", data]) == b"a" + encode_error(3, error)
    shaped = Server().dispatcher.shape(7, None, SessionNotFoundError(session_id="s"))
    assert type(shaped) is EncodedError and isinstance(shaped.error, SessionNotFoundError)


@pytest.mark.parametrize("id", [0, 17, "req-1", None])
def test_error_responses_keep_jsonrpcservers_shape(id: int | str | None) -> None:
    """encode_error skips jsonrpcserver's dicts for speed; its bytes are still exactly what
    ``serialize_error(ErrorResponse(...))`` encodes to."""
    for error in (
        PromptQueueFullError(session_id="sess_1", limit=5, pending_count=5, retry_after_ms=5000),
        SessionNotFoundError(session_id='quo"ted'),
        InternalError(),
    ):
        expected = msgspec.json.encode(serialize_error(ErrorResponse(error.code, error.message, error.payload, id)))
        assert encode_error(id, error) == expected + b"\n"


def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_a_refusal_written_at_the_end_of_a_pass_is_timed() -> None:
    """Over a socket the refusal leaves as the scheduling pass ends (no writer task): still timed, once."""
    limits = Limits(max_pending_prompts_per_session=1)
    with trio.fail_after(10):
        async with running_server(limits, EchoBackend(delay_ms=60_000)) as (server, nursery):
            client, histogram = open_connection(server, nursery, _socket_pair)
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            held_id, _held = client.start_request("session/prompt")
            await client.send({"jsonrpc": "2.0", "id": held_id, "method": "session/prompt", "params": prompt_params(session_id)})
            await trio.testing.wait_all_tasks_blocked()
            started = time.perf_counter()
            answer = await client.call_raw("session/prompt", prompt_params(session_id))
            assert answer["error"]["data"]["errorKind"] == "prompt_queue_full"
            await trio.testing.wait_all_tasks_blocked()
            assert histogram.count == 1
            assert 0 < histogram.sum_ns / 1000 <= (time.perf_counter() - started) * 1e6
            await client.stream.aclose()
            nursery.cancel_scope.cancel()
