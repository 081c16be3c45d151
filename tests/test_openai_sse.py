"""Reading a streamed chat completion without a network: SSE framing however the bytes are split,
chunk interpretation (text, reasoning, tool calls stitched from deltas, usage, errors), and the
conversation's requests: whole-turn trimming and the conversation rebuilt from a transcript."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from acp_server.backends.openai.request import (
    NOT_RUN,
    TokenEstimate,
    close_turn,
    request_body,
    trim_turns,
    turns_from_transcript,
    user_message,
)
from acp_server.backends.openai.sse import (
    ChunkReader,
    Done,
    Finish,
    ReasoningDelta,
    SseParser,
    StreamFailed,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from acp_server.errors import InvalidParamsError
from acp_server.types.acp import ImageContent, ResourceLink, TextContent

BODY = (
    ": keep-alive comment\n"
    'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
    "event: message\n"
    'data: {"choices":[{"delta":{"content":"lo"}}]}\r\n\r\n'
    "data: line one\ndata: line two\n\n"
    "data:no-space\r\rdata: [DONE]\n\n"
)
EVENTS = ['{"choices":[{"delta":{"content":"Hel"}}]}', '{"choices":[{"delta":{"content":"lo"}}]}',
          "line one\nline two", "no-space", "[DONE]"]


def test_sse_events_with_every_line_ending() -> None:
    parser = SseParser()
    assert parser.feed(BODY) + parser.close() == EVENTS


@given(st.lists(st.integers(0, len(BODY)), max_size=12))
def test_sse_events_do_not_depend_on_how_the_body_is_split(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(BODY)]
    parser = SseParser()
    events: list[str] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        events += parser.feed(BODY[start:end])
    assert events + parser.close() == EVENTS


def test_an_unterminated_last_event_is_kept_at_close() -> None:
    parser = SseParser()
    assert parser.feed('data: {"x": 1}') == []
    assert parser.close() == ['{"x": 1}']
    assert parser.close() == []


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **more: Any) -> str:
    choices = [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    return json.dumps({"choices": choices, **more})


def test_chunks_text_reasoning_finish_usage_done() -> None:
    reader = ChunkReader()
    assert reader.feed(chunk({"role": "assistant", "content": ""})) == []
    assert reader.feed(chunk({"reasoning_content": "hmm"})) == [ReasoningDelta("hmm")]
    assert reader.feed(chunk({"reasoning": "also"})) == [ReasoningDelta("also")]
    assert reader.feed(chunk({"content": "Hi"})) == [TextDelta("Hi")]
    assert reader.feed(chunk(finish="stop")) == [Finish("stop")]
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert reader.feed(chunk(usage=usage)) == [Usage(3, 2, 5)]
    assert reader.feed("[DONE]") == [Done()]
    assert reader.finish_reason == "stop" and reader.usage == Usage(3, 2, 5) and reader.done


def test_tool_calls_are_stitched_per_index() -> None:
    reader = ChunkReader()
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "read_text_file", "arguments": '{"pa'}}
    other = {"index": 1, "id": "call_b", "function": {"name": "run_command", "arguments": ""}}
    events = reader.feed(chunk({"tool_calls": [first, other]}))
    assert events == [ToolCallDelta(0, "call_a", "read_text_file", '{"pa'), ToolCallDelta(1, "call_b", "run_command", "")]
    reader.feed(chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"command": "ls"}'}}]}))
    reader.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th": "a"}'}}]}))
    calls = reader.tool_calls
    assert (calls[0].call_id, calls[0].name, calls[0].arguments) == ("call_a", "read_text_file", '{"path": "a"}')
    assert (calls[1].call_id, calls[1].name, calls[1].arguments) == ("call_b", "run_command", '{"command": "ls"}')


def test_an_error_in_the_stream_and_data_that_is_not_json() -> None:
    reader = ChunkReader()
    assert reader.feed('{"error": {"message": "overloaded", "code": 503}}') == [StreamFailed("overloaded", 503)]
    with pytest.raises(ValueError, match="not JSON"):
        reader.feed("{oops")
    with pytest.raises(ValueError, match="not a JSON object"):
        reader.feed("[1, 2]")


# --- requests ----------------------------------------------------------------------------------


def test_user_message_text_images_and_refusals() -> None:
    blocks = [TextContent(text="look "), ResourceLink(uri="file:///a.txt", name="a.txt")]
    assert user_message(blocks, images=False) == {"role": "user", "content": "look [resource link a.txt: file:///a.txt]"}
    image = ImageContent(data="AAAA", mime_type="image/png")
    with pytest.raises(InvalidParamsError) as info:
        user_message([TextContent(text="x"), image], images=False)
    assert info.value.payload.path == "prompt[1]"
    assert user_message([image], images=True)["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    ]


def test_request_body_streams_and_passes_extra_body_through() -> None:
    body = request_body("m", [{"role": "user", "content": "hi"}], [], {"temperature": 0.2, "stream": False})
    assert body["stream"] is True and body["temperature"] == 0.2 and body["model"] == "m"
    assert body["stream_options"] == {"include_usage": True} and "tools" not in body
    assert "stream_options" not in request_body("m", [], [], {"stream_options": None})


def turn(i: int, size: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"q{i} " + "x" * size}, {"role": "assistant", "content": f"a{i}"}]


def test_trim_drops_the_oldest_whole_turns_never_the_system_prompt_or_the_running_turn() -> None:
    system = [{"role": "system", "content": "be brief"}]
    turns = [turn(i, 400) for i in range(5)]
    estimate = TokenEstimate()
    messages, dropped = trim_turns(system, turns, 300, estimate)
    assert dropped == 3 and messages[0] == system[0] and messages[1]["content"].startswith("q3")
    assert estimate.tokens(messages) <= 300
    # a running turn larger than the window alone is still sent, with everything older dropped
    messages, dropped = trim_turns(system, [turn(0, 10), turn(1, 5000)], 300, estimate)
    assert dropped == 1 and len(messages) == 3
    assert trim_turns(system, turns, None, estimate) == ([*system, *(m for t in turns for m in t)], 0)


def test_the_estimate_follows_the_servers_count() -> None:
    estimate = TokenEstimate()
    messages = [{"role": "user", "content": "x" * 1000}]
    before = estimate.tokens(messages)
    estimate.observe(messages, 504)
    assert estimate.tokens(messages) == pytest.approx(504, abs=2) and before != estimate.tokens(messages)


def test_close_turn_answers_every_tool_call_left_open() -> None:
    t = [{"role": "user", "content": "go"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]},
         {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    close_turn(t)
    assert t[-1] == {"role": "tool", "tool_call_id": "b", "content": NOT_RUN}


def terminal(state: str = "completed") -> tuple[str, dict[str, Any]]:
    return ("_acp_server/turn_state", {"promptId": "p", "state": state, "at": 1})


def test_the_conversation_is_rebuilt_from_the_transcript() -> None:
    def text(kind: str, t: str) -> tuple[None, dict[str, Any]]:
        return (None, {"sessionUpdate": kind, "content": {"type": "text", "text": t}})

    entries = [
        text("user_message_chunk", "read "), text("user_message_chunk", "a.txt"),
        text("agent_thought_chunk", "thinking"),
        text("agent_message_chunk", "Sure. "),
        (None, {"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "read_text_file", "_meta": {"openai": {"name": "read_text_file"}}}),
        (None, {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "_meta": {"openai": {"arguments": '{"path": "a.txt"}'}}}),
        (None, {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "in_progress"}),
        (None, {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed", "_meta": {"openai": {"result": "body"}}}),
        text("agent_message_chunk", "It says body."),
        terminal(),
        text("user_message_chunk", "failed one"),
        terminal("failed"),
        text("user_message_chunk", "cut"),
        text("agent_message_chunk", "par"),
        (None, {"sessionUpdate": "tool_call", "toolCallId": "c2", "_meta": {"openai": {"name": "run_command"}}}),
        terminal("cancelled"),
    ]
    assert turns_from_transcript(entries, images=False) == [
        [
            {"role": "user", "content": "read a.txt"},
            {"role": "assistant", "content": "Sure. ", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_text_file", "arguments": '{"path": "a.txt"}'}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "body"},
            {"role": "assistant", "content": "It says body."},
        ],
        [{"role": "user", "content": "failed one"}],
        [{"role": "user", "content": "cut"}, {"role": "assistant", "content": "par"}],  # the half-streamed call dropped
    ]
