"""The ``openai`` backend in one process with the server and the scripted model server (real HTTP on
loopback): retries and the pool's permits, stop reasons, images, usage in metrics, the context window,
and the API key kept out of logs and errors. Errors are checked against ``schemas/`` (by
:class:`~tests.helpers.RawClient`) and, with results and updates, against the official SDK's models."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from acp import schema

from acp_server.admission import Limits
from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.backends.openai import OpenAIBackend
from acp_server.metrics import render_metrics
from acp_server.server import Server
from acp_server.store import SessionStore

from .helpers import RawClient, RpcError, connect
from .openai_server import ScriptedModel, Step, ToolCallSpec, serve_model

API_KEY = "sk-test-key-4f1c9b2e-never-in-logs"
TIMEOUT_S = 30


@dataclass
class Stack:
    model: ScriptedModel
    backend: OpenAIBackend
    server: Server
    nursery: trio.Nursery

    async def client(self) -> RawClient:
        return await connect(self.server, self.nursery)


@asynccontextmanager
async def stack(
    *,
    max_active: int | None = None,
    limits: Limits | None = None,
    state_dir: pathlib.Path | None = None,
    model: ScriptedModel | None = None,
    **backend_kw: Any,
) -> AsyncIterator[Stack]:
    """The scripted model, an openai backend on it (key ``API_KEY``) and a server with its bridge (and
    its store in ``state_dir``, closed on exit)."""
    model = model or ScriptedModel()
    store = SessionStore(state_dir) if state_dir is not None else None
    try:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_model, model)
            backend = OpenAIBackend("local", base_url=url, model="scripted", api_key=API_KEY, **backend_kw)
            await nursery.start(backend.run)
            capacity = CapacityManager({"local": PoolLimits(max_active=max_active)})
            server = Server(limits, {"local": backend}, default_backend="local", capacity=capacity, store=store)
            await nursery.start(server.bridge.run)
            yield Stack(model, backend, server, nursery)
            nursery.cancel_scope.cancel()
    finally:
        if store is not None:
            store.close()


def checked_result(result: Any) -> dict[str, Any]:
    """``result`` after checking it against the SDK's PromptResponse (nothing dropped)."""
    parsed = schema.PromptResponse.model_validate(result)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == result
    return dict(result)


def checked_updates(client: RawClient, session_id: str) -> list[dict[str, Any]]:
    """The session's updates after checking each against the SDK's SessionNotification (nothing dropped)."""
    out = []
    for params in client.updates(session_id):
        parsed = schema.SessionNotification.model_validate(params)
        assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == params
        out.append(params["update"])
    return out


def checked_error(exc: RpcError) -> dict[str, Any]:
    """The error's data after checking the error against the SDK's error model (schemas: RawClient)."""
    schema.Error.model_validate(exc.error)
    return exc.data


# --- retries and permits ---------------------------------------------------------------------------


async def test_429_with_retry_after_is_retried_after_about_that_long() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(status=429, headers={"retry-after": "1"}))
            client = await s.client()
            sid, _ = await client.new_session()
            result = checked_result(await client.prompt(sid, "hello"))
            assert result["stopReason"] == "end_turn"
            assert client.agent_text(sid) == "you said: hello"
            waited = s.model.started_at[1] - s.model.started_at[0]
            assert 1.0 <= waited < 2.5  # the hint plus at most 10% jitter (and a loaded machine's delay)
            assert s.backend.stats.retries == 1


async def test_three_500s_end_in_one_backend_unavailable_listing_3_attempts() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(*(Step(status=500) for _ in range(3)))
            client = await s.client()
            sid, _ = await client.new_session()
            with pytest.raises(RpcError) as info:
                await client.prompt(sid, "hello")
            data = checked_error(info.value)
            assert info.value.code == -32007
            assert data["reason"] == "model_error" and data["attempts"] == 3 and data["status"] == 500
            assert "exitCode" not in data and data["promptId"]
            assert len(s.model.requests) == 3
            assert len(client.errors) == 1


async def test_a_deadline_shorter_than_retry_after_fails_at_once() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack(limits=Limits(prompt_deadline_ms=3000)) as s:
            s.model.push(Step(status=429, headers={"retry-after": "5"}))
            client = await s.client()
            sid, _ = await client.new_session()
            start = trio.current_time()
            with pytest.raises(RpcError) as info:
                await client.prompt(sid, "hello")
            assert trio.current_time() - start < 2.0  # not the 3 s deadline, not the 5 s hint
            data = checked_error(info.value)
            assert data["errorKind"] == "backend_unavailable" and data["attempts"] == 1 and data["status"] == 429
            assert len(s.model.requests) == 1


async def test_retry_after_ms_wins_and_an_http_date_is_understood() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(
                Step(status=503, headers={"retry-after-ms": "300", "retry-after": "30"}),
                Step(status=429, headers={"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"}),
            )
            client = await s.client()
            sid, _ = await client.new_session()
            assert (await client.prompt(sid, "hi"))["stopReason"] == "end_turn"
            first, second, third = s.model.started_at
            assert 0.3 <= second - first < 1.5 and third - second < 1.0  # a date in the past: no wait


async def test_a_cut_after_output_is_not_retried_but_one_before_it_is() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(cut_after=1), Step(text=["partial ", "answer ", "more"], cut_after=3))
            client = await s.client()
            sid, _ = await client.new_session()
            with pytest.raises(RpcError) as info:
                await client.prompt(sid, "hello")
            data = checked_error(info.value)
            assert data["reason"] == "model_unreachable" and data["attempts"] == 2 and data["status"] == 200
            assert "after output" in data["detail"]
            assert client.agent_text(sid) == "partial answer "  # the role chunk, then two deltas
            assert len(s.model.requests) == 2


async def test_a_stall_before_the_first_byte_times_out_and_is_retried() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack(request_timeout_s=0.5) as s:
            s.model.push(Step(stall_s=3))
            client = await s.client()
            sid, _ = await client.new_session()
            assert (await client.prompt(sid, "hi"))["stopReason"] == "end_turn"
            assert len(s.model.requests) == 2


async def test_a_slow_trickle_is_not_a_timeout() -> None:
    """The timeout bounds silence, not the whole answer: deltas every 0.1 s outlast a 0.5 s timeout."""
    with trio.fail_after(TIMEOUT_S):
        async with stack(request_timeout_s=0.5) as s:
            s.model.push(Step(text=[f"w{i} " for i in range(8)], trickle_s=0.1))
            client = await s.client()
            sid, _ = await client.new_session()
            assert (await client.prompt(sid, "hi"))["stopReason"] == "end_turn"
            assert client.agent_text(sid) == "".join(f"w{i} " for i in range(8))
            assert len(s.model.requests) == 1


async def test_a_4xx_is_an_agent_error_with_the_servers_message_and_no_key() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(
                Step(status=400, error_message="This model's maximum context length is 8 tokens"),
                Step(status=401, error_message=f"Incorrect API key provided: {API_KEY}"),
            )
            client = await s.client()
            sid, _ = await client.new_session()
            for status in (400, 401):
                with pytest.raises(RpcError) as info:
                    await client.prompt(sid, "hello")
                data = checked_error(info.value)
                assert data["errorKind"] == "agent_error" and data["agentCode"] == status
            assert "maximum context length" in client.errors[0]["data"]["agentMessage"]
            assert API_KEY not in str(client.errors[1]) and "[redacted]" in client.errors[1]["data"]["agentMessage"]
            assert len(s.model.requests) == 2  # neither was retried


async def test_max_active_2_bounds_the_model_server_with_10_sessions_during_backoffs() -> None:
    """With max_active = 2, ten sessions prompting at once, and a burst of 429s whose backoffs overlap
    the others' calls: never more than 2 requests at the model server, counted there."""
    with trio.fail_after(TIMEOUT_S):
        async with stack(max_active=2, max_attempts=5) as s:
            s.model.push(*(Step(status=429, headers={"retry-after-ms": "100"}) for _ in range(6)))
            for _ in range(30):
                s.model.push(Step(text=["slow ", "answer"], trickle_s=0.02))
            clients = [await s.client() for _ in range(10)]
            sids = [(await c.new_session())[0] for c in clients]
            results: list[Any] = []

            async def one(client: RawClient, sid: str) -> None:
                results.append(await client.prompt(sid, "go"))

            async with trio.open_nursery() as nursery:
                for client, sid in zip(clients, sids, strict=True):
                    nursery.start_soon(one, client, sid)
            assert [r["stopReason"] for r in results] == ["end_turn"] * 10
            assert s.model.peak == 2
            assert len(s.model.requests) == 16
            assert s.server.stats_snapshot()["pools"]["local"]["active"] == 0


# --- ACP semantics ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "stop"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal"), (None, "end_turn"),
     ("something_new", "end_turn")],
)
async def test_finish_reason_maps_to_stop_reason(finish: str | None, stop: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(finish_reason=finish, done=finish is not None))
            client = await s.client()
            sid, _ = await client.new_session()
            assert checked_result(await client.prompt(sid, "hi"))["stopReason"] == stop


async def test_reasoning_streams_as_thoughts_and_updates_validate() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(reasoning=["let me ", "think"], text=["answer"]))
            client = await s.client()
            sid, _ = await client.new_session()
            await client.prompt(sid, "why?")
            updates = checked_updates(client, sid)
            assert [u["sessionUpdate"] for u in updates] == [
                "agent_thought_chunk", "agent_thought_chunk", "agent_message_chunk"
            ]
            assert "".join(u["content"]["text"] for u in updates[:2]) == "let me think"
            # the reasoning is shown, never sent back
            await client.prompt(sid, "and?")
            assert s.model.requests[1]["messages"][1] == {"role": "assistant", "content": "answer"}


async def test_an_image_is_refused_for_a_text_only_model_and_sent_for_one_that_takes_them() -> None:
    image = {"type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo="}
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            client = await s.client()
            sid, _ = await client.new_session()
            params = {"sessionId": sid, "prompt": [{"type": "text", "text": "look"}, image]}
            with pytest.raises(RpcError) as info:
                await client.call("session/prompt", params)
            data = checked_error(info.value)
            assert data["errorKind"] == "invalid_params" and data["path"] == "prompt[1]"
            assert s.model.requests == []
        async with stack(images=True) as s:
            client = await s.client()
            sid, _ = await client.new_session()
            params = {"sessionId": sid, "prompt": [{"type": "text", "text": "look"}, image]}
            await client.call("session/prompt", params)
            assert s.model.requests[0]["messages"][0]["content"] == [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ]


async def test_usage_is_in_the_result_and_counted_in_metrics() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(usage=(100, 20)), Step(usage=(150, 30)))
            client = await s.client()
            sid, _ = await client.new_session()
            first = await client.prompt(sid, "one")
            await client.prompt(sid, "two")
            assert first["_meta"]["usage"] == {"inputTokens": 100, "outputTokens": 20, "totalTokens": 120}
            text = render_metrics(s.server.stats_snapshot()).decode()
            assert 'acp_server_model_tokens_total{backend="local",kind="prompt"} 250.0' in text
            assert 'acp_server_model_tokens_total{backend="local",kind="completion"} 50.0' in text
            assert 'acp_server_model_requests_total{backend="local"} 2.0' in text


async def test_a_long_conversation_is_trimmed_to_the_window_by_whole_turns() -> None:
    """context_tokens = 400: each turn is ~150 tokens (600 characters), so older turns are left out,
    the system prompt never, and the result says how many; no prompt fails."""
    word = "x" * 590
    with trio.fail_after(TIMEOUT_S):
        async with stack(context_tokens=400, system_prompt="Be brief.") as s:
            client = await s.client()
            sid, _ = await client.new_session()
            dropped = []
            for i in range(6):
                s.model.push(Step(text=[f"reply {i}"], usage=None))
                result = checked_result(await client.prompt(sid, f"{i} {word}"))
                dropped.append(result["_meta"]["droppedTurns"])
            assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped)
            last = s.model.requests[-1]["messages"]
            assert last[0] == {"role": "system", "content": "Be brief."}
            assert last[-1]["content"].startswith("5 ")
            assert last[1]["role"] == "user"  # whole turns: never an assistant message without its question
            assert len(last) == 1 + 2 * (6 - dropped[-1]) - 1
            assert s.backend.stats.dropped_turns == sum(dropped)


async def test_the_api_key_is_in_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(status=429, headers={"retry-after-ms": "10"}), Step(), Step(status=500),
                         Step(status=500), Step(status=500), Step(status=403, error_message=f"bad key {API_KEY}"))
            client = await s.client()
            sid, _ = await client.new_session()
            await client.prompt(sid, "one")
            for _ in range(2):
                with pytest.raises(RpcError):
                    await client.prompt(sid, "two")
            assert s.model.headers[0]["authorization"] == f"Bearer {API_KEY}"
    messages = [r.getMessage() for r in caplog.records]
    assert any("attempt 1/3 failed: status 429" in m for m in messages)
    assert all(API_KEY not in m for m in messages)
    assert all(API_KEY not in str(e) for e in client.errors)
    assert API_KEY not in repr(s.backend)


async def test_the_permit_is_not_held_across_a_backoff() -> None:
    """max_active = 1: while one prompt backs off after a 429, another prompt's call goes through."""
    with trio.fail_after(TIMEOUT_S):
        async with stack(max_active=1) as s:
            s.model.push(Step(status=429, headers={"retry-after-ms": "600"}))
            a, b = await s.client(), await s.client()
            sid_a, sid_b = (await a.new_session())[0], (await b.new_session())[0]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.prompt, sid_a, "first")
                await s.model.arrived.wait()
                await b.prompt(sid_b, "second")  # during a's backoff
                assert len(s.model.requests) == 2
            assert len(s.model.requests) == 3
            assert s.model.started_at[1] - s.model.started_at[0] < 0.6 <= s.model.started_at[2] - s.model.started_at[0]


async def test_the_permit_is_released_while_a_permission_is_asked() -> None:
    """max_active = 1: a prompt waiting on the client's answer to a permission holds no permit, so
    another session's prompt runs meanwhile; the answer (reject) goes back to the model."""
    with trio.fail_after(TIMEOUT_S):
        async with stack(max_active=1) as s:
            call = ToolCallSpec("call_1", "run_command", '{"command": "rm", "args": ["-rf", "build"]}')
            s.model.push(Step(text=[], tool_calls=[call], finish_reason="tool_calls"))
            a = await connect(s.server, s.nursery, initialize=False)
            await a.call("initialize", {"protocolVersion": 1, "clientCapabilities": {"terminal": True}})
            b = await s.client()
            sid_a, sid_b = (await a.new_session())[0], (await b.new_session())[0]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.prompt, sid_a, "clean up")
                while not a.requests_from_server:
                    await a.notified.wait()
                asked = a.requests_from_server[0]
                assert asked["method"] == "session/request_permission"
                schema.RequestPermissionRequest.model_validate(asked["params"])
                assert (await b.prompt(sid_b, "meanwhile"))["stopReason"] == "end_turn"
                outcome = {"outcome": {"outcome": "selected", "optionId": "reject"}}
                await a.send({"jsonrpc": "2.0", "id": asked["id"], "result": outcome})
            tool_result = s.model.requests[2]["messages"][2]
            assert tool_result == {"role": "tool", "tool_call_id": "call_1", "content": "the user rejected this tool call"}
            statuses = [u.get("status") for u in checked_updates(a, sid_a) if u["sessionUpdate"] == "tool_call_update"]
            assert statuses[-1] == "failed"


async def test_cancel_closes_the_model_stream_and_answers_cancelled() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(text=["a ", "b "], hold_after=2))
            client = await s.client()
            sid, _ = await client.new_session()
            async with trio.open_nursery() as nursery:
                results: list[Any] = []

                async def run() -> None:
                    results.append(await client.prompt(sid, "hold"))

                nursery.start_soon(run)
                while not client.agent_text(sid):
                    await client.notified.wait()
                await client.notify("session/cancel", {"sessionId": sid})
                while 0 not in s.model.closed_at:
                    await s.model.closed.wait()
            assert checked_result(results[0])["stopReason"] == "cancelled"
            assert s.model.in_flight == 0
            # the next prompt runs normally on the same session
            assert (await client.prompt(sid, "again"))["stopReason"] == "end_turn"
            assert s.model.requests[1]["messages"][1] == {"role": "assistant", "content": "a "}


async def test_a_restart_rebuilds_tool_rounds_from_the_store(tmp_path: pathlib.Path) -> None:
    """A tool round, then a new server on the same store: the next request carries the assistant's tool
    call (name and arguments) and its result, read back from the transcript on disk."""
    read = ToolCallSpec("call_r", "read_text_file", '{"path": "a.txt"}', 2)
    with trio.fail_after(TIMEOUT_S):
        async with stack(state_dir=tmp_path) as s:
            s.model.push(Step(text=["Reading. "], tool_calls=[read], finish_reason="tool_calls"), Step(text=["It is x."]))
            client = await connect(s.server, s.nursery, initialize=False)
            caps = {"fs": {"readTextFile": True}}
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": caps})
            sid, _ = await client.new_session("/work")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.prompt, sid, "what is in a.txt?")
                while not client.requests_from_server:
                    await client.notified.wait()
                asked = client.requests_from_server[0]
                assert asked["method"] == "fs/read_text_file" and asked["params"]["path"] == "/work/a.txt"
                await client.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"content": "x"}})
            before = s.model.requests[1]["messages"]
        model = ScriptedModel()
        async with stack(state_dir=tmp_path, model=model) as s:
            client = await s.client()
            await client.call("session/load", {"sessionId": sid, "cwd": "/work", "mcpServers": []})
            await client.prompt(sid, "thanks")
            assert model.requests[0]["messages"] == [
                *before,
                {"role": "assistant", "content": "It is x."},
                {"role": "user", "content": "thanks"},
            ]
            assert before[1]["tool_calls"][0]["function"] == {"name": "read_text_file", "arguments": '{"path": "a.txt"}'}
            assert before[2] == {"role": "tool", "tool_call_id": "call_r", "content": "x"}


async def test_a_fork_continues_the_same_conversation_on_its_own() -> None:
    """``_acp_server/fork``: the branch's first request carries the source's conversation, and the
    two go on separately."""
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            client = await s.client()
            sid, _ = await client.new_session()
            await client.prompt(sid, "one")
            branch = (await client.call("_acp_server/fork", {"sessionId": sid}))["sessionId"]
            await client.prompt(branch, "two on the branch")
            await client.prompt(sid, "two on the source")
            assert s.model.requests[1]["messages"] == [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "you said: one"},
                {"role": "user", "content": "two on the branch"},
            ]
            assert [m["content"] for m in s.model.requests[2]["messages"]] == [
                "one", "you said: one", "two on the source"
            ]


async def test_a_body_left_open_after_done_ends_the_turn_soon() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(text=["all ", "here"], hold_after=1000))
            client = await s.client()
            sid, _ = await client.new_session()
            start = trio.current_time()
            assert (await client.prompt(sid, "hi"))["stopReason"] == "end_turn"
            assert trio.current_time() - start < 5
            assert client.agent_text(sid) == "all here"
            while 0 not in s.model.closed_at:
                await s.model.closed.wait()


async def test_run_command_asks_then_runs_on_the_clients_terminal() -> None:
    """run_command: permission, terminal/create, wait_for_exit, output, release, in that order; the
    model is given the output and the exit status."""
    call = ToolCallSpec("call_t", "run_command", '{"command": "make", "args": ["test"], "cwd": "src"}', 5)
    answers: dict[str, Any] = {
        "session/request_permission": {"outcome": {"outcome": "selected", "optionId": "allow"}},
        "terminal/create": {"terminalId": "term-1"},
        "terminal/wait_for_exit": {"exitCode": 2, "signal": None},
        "terminal/output": {"output": "1 failed", "truncated": False},
        "terminal/release": {},
    }
    with trio.fail_after(TIMEOUT_S):
        async with stack() as s:
            s.model.push(Step(text=[], tool_calls=[call], finish_reason="tool_calls"), Step(text=["It failed."]))
            client = await connect(s.server, s.nursery, initialize=False)
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {"terminal": True}})
            sid, _ = await client.new_session("/repo")
            done: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def answer() -> None:
                    answered = 0
                    while True:
                        while answered < len(client.requests_from_server):
                            asked = client.requests_from_server[answered]
                            answered += 1
                            result = answers[asked["method"]]
                            await client.send({"jsonrpc": "2.0", "id": asked["id"], "result": result})
                        await client.notified.wait()

                nursery.start_soon(answer)
                done.append(await client.prompt(sid, "run the tests"))
                nursery.cancel_scope.cancel()
            methods = [r["method"] for r in client.requests_from_server]
            assert methods == list(answers)
            created = client.requests_from_server[1]["params"]
            assert (created["command"], created["args"], created["cwd"]) == ("make", ["test"], "/repo/src")
            assert s.model.requests[1]["messages"][2] == {
                "role": "tool", "tool_call_id": "call_t", "content": "1 failed\n[exit code 2]"
            }
            updates = [u for u in checked_updates(client, sid) if u["sessionUpdate"] == "tool_call_update"]
            assert updates[-1]["status"] == "failed"  # a non-zero exit
            assert done[0]["stopReason"] == "end_turn"
