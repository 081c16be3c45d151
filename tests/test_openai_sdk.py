"""The ``openai`` backend end to end: a real ``acp-server`` process fronting the scripted model server
(``tests/openai_server.py``, served by the test), driven by the official ACP SDK client
(``tests/openai_sdk_driver.py``): a two-turn conversation, cancel mid-stream, a tool round trip with a
permission, the loop cap, and a restart that continues the conversation. Every message the server
sent validates against the SDK's models (the driver reports any that does not)."""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from .openai_server import ScriptedModel, Step, ToolCallSpec, serve_model
from .test_e2e_sdk import server_process

DRIVER = pathlib.Path(__file__).with_name("openai_sdk_driver.py")
API_KEY = "sk-test-0123456789-do-not-log"
TIMEOUT_S = 60


@asynccontextmanager
async def model_server() -> AsyncIterator[tuple[ScriptedModel, str]]:
    model = ScriptedModel()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_model, model)
        yield model, url
        nursery.cancel_scope.cancel()


async def drive(url: str, scenario: str, *more: str) -> dict[str, Any]:
    done = await trio.run_process(
        [sys.executable, str(DRIVER), url, scenario, *more], capture_stdout=True, check=True
    )
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary["failures"] == [], summary["failures"]
    assert summary["sdkErrors"] == []
    return summary


def shorthand(model_url: str, *more: str) -> tuple[str, ...]:
    return (
        "--listen", "tcp://127.0.0.1:0", "--agent", f"local=openai:{model_url}#scripted",
        "--default-backend", "local", *more,
    )


async def test_two_turn_conversation_carries_the_first_turn(monkeypatch: Any) -> None:
    """The one-line shorthand: each reply streams as agent_message_chunk, the second request holds the
    first turn, the key goes as a Bearer header and into no log line, usage is in the result _meta."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    with trio.fail_after(TIMEOUT_S):
        async with model_server() as (model, model_url):
            async with server_process(*shorthand(model_url, "--log-level", "debug")) as (server, (url,)):
                summary = await drive(url, "conversation")
                server.proc.terminate()
                log = "\n".join(await trio.to_thread.run_sync(server.rest_of_stderr))
    assert summary["texts"] == ["you said: first question", "you said: second question"]
    assert [r["stopReason"] for r in summary["results"]] == ["end_turn", "end_turn"]
    assert summary["results"][0]["_meta"]["usage"] == {"inputTokens": 11, "outputTokens": 7, "totalTokens": 18}
    assert len(model.requests) == 2
    assert model.requests[1]["messages"] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "you said: first question"},
        {"role": "user", "content": "second question"},
    ]
    assert model.requests[0]["stream"] is True and model.requests[0]["model"] == "scripted"
    assert {h["authorization"] for h in model.headers} == {f"Bearer {API_KEY}"}
    assert "attempt 1/3: status 200" in log  # each attempt is logged ...
    assert API_KEY not in log  # ... and the key never is


async def test_cancel_mid_stream_closes_the_model_stream() -> None:
    """session/cancel while the model streams: the prompt answers cancelled and the model server sees
    its stream closed by the client."""
    with trio.fail_after(TIMEOUT_S):
        async with model_server() as (model, model_url):
            model.push(Step(text=["one ", "two ", "three "], hold_after=3))
            async with server_process(*shorthand(model_url)) as (_, (url,)):
                summary = await drive(url, "cancel")
                with trio.fail_after(5):
                    while 0 not in model.closed_at:
                        await model.closed.wait()
    assert summary["results"] == [{"stopReason": "cancelled", "_meta": summary["results"][0]["_meta"]}]
    assert summary["texts"][0].startswith("one ")
    assert model.in_flight == 0 and len(model.requests) == 1


async def test_tool_round_trip_asks_permission_for_the_write() -> None:
    """The model's tool calls (arguments split over deltas) stream as tool_call / tool_call_update,
    the write asks session/request_permission first, both run on the client through the relay, and
    the next model call carries their results."""
    with trio.fail_after(TIMEOUT_S):
        async with model_server() as (model, model_url):
            model.push(
                Step(
                    text=["Let me edit. "],
                    tool_calls=[
                        ToolCallSpec("call_w", "write_text_file", '{"path": "notes.txt", "content": "new notes"}', 4),
                        ToolCallSpec("call_r", "read_text_file", '{"path": "/work/notes.txt"}', 3),
                    ],
                    finish_reason="tool_calls",
                ),
                Step(text=["Done."]),
            )
            async with server_process(*shorthand(model_url)) as (_, (url,)):
                summary = await drive(url, "tools")
    assert summary["results"][0]["stopReason"] == "end_turn"
    assert summary["results"][0]["_meta"]["modelCalls"] == 2
    assert summary["texts"] == ["Let me edit. Done."]
    assert summary["permissions"] == [{"toolCallId": "call_w", "options": ["allow", "reject"]}]
    assert summary["writes"] == [["/work/notes.txt", "new notes"]]
    assert summary["reads"] == ["/work/notes.txt"]
    tools = {t["function"]["name"] for t in model.requests[0]["tools"]}
    assert tools == {"read_text_file", "write_text_file", "run_command"}
    by_call: dict[str, list[dict[str, Any]]] = {}
    for update in summary["toolUpdates"]:
        by_call.setdefault(update["toolCallId"], []).append(update)
    write = by_call["call_w"]
    assert write[0]["sessionUpdate"] == "tool_call" and write[0]["kind"] == "edit"
    assert write[1]["rawInput"] == {"path": "notes.txt", "content": "new notes"}  # stitched from 4 deltas
    assert [u.get("status") for u in write[2:]] == ["in_progress", "completed"]
    second = model.requests[1]["messages"]
    assert second[1]["tool_calls"][0]["function"]["arguments"] == '{"path": "notes.txt", "content": "new notes"}'
    assert second[2] == {"role": "tool", "tool_call_id": "call_w", "content": "wrote 9 characters to /work/notes.txt"}
    assert second[3] == {"role": "tool", "tool_call_id": "call_r", "content": "the file's text\nsecond line\n"}


async def test_tool_loop_stops_at_max_tool_rounds(tmp_path: pathlib.Path) -> None:
    """A model that never stops calling tools gets max_tool_rounds calls, then max_turn_requests."""
    config = tmp_path / "acp-server.toml"
    with trio.fail_after(TIMEOUT_S):
        async with model_server() as (model, model_url):
            config.write_text(
                'default_backend = "local"\n[backends.local]\nkind = "openai"\n'
                f'base_url = "{model_url}"\nmodel = "scripted"\nmax_tool_rounds = 3\n'
            )
            call = ToolCallSpec("c", "read_text_file", '{"path": "a.txt"}')
            model.push(*(Step(text=[], tool_calls=[call], finish_reason="tool_calls") for _ in range(5)))
            async with server_process("--listen", "tcp://127.0.0.1:0", "--config", str(config)) as (_, (url,)):
                summary = await drive(url, "loop")
    assert summary["results"][0]["stopReason"] == "max_turn_requests"
    assert summary["results"][0]["_meta"]["modelCalls"] == 3
    assert len(model.requests) == 3
    assert summary["reads"] == ["/work/a.txt", "/work/a.txt"]  # the third call's tool is not run
    assert summary["toolUpdates"][-1]["status"] == "failed"


async def test_restart_continues_the_conversation(tmp_path: pathlib.Path) -> None:
    """With --state-dir, a new server process replays the session on session/load and the next prompt
    sends the model the conversation from before the restart."""
    state = str(tmp_path / "state")
    with trio.fail_after(TIMEOUT_S):
        async with model_server() as (model, model_url):
            async with server_process(*shorthand(model_url, "--state-dir", state)) as (_, (url,)):
                first = await drive(url, "first")
            async with server_process(*shorthand(model_url, "--state-dir", state)) as (_, (url,)):
                later = await drive(url, "continue", "--session-id", first["sessionId"])
    assert later["replayedText"] == "you said: remember the word apricot"
    assert later["texts"] == ["you said: what was the word?"]
    assert model.requests[-1]["messages"] == [
        {"role": "user", "content": "remember the word apricot"},
        {"role": "assistant", "content": "you said: remember the word apricot"},
        {"role": "user", "content": "what was the word?"},
    ]

