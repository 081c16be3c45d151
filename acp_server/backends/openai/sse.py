"""Reading a streamed chat completion: server-sent events, then the chunks they carry. No I/O here.

Two small state machines, fed bytes and fed events, in the manner of h11: :class:`SseParser` turns a
``text/event-stream`` body into the ``data`` of each event (lines end in ``\\n``, ``\\r\\n`` or ``\\r``;
``data:`` lines of one event are joined with ``\\n``; comments and other fields are skipped), and
:class:`ChunkReader` turns each event's JSON chunk into what the backend acts on:

- :class:`TextDelta` (``delta.content``) and :class:`ReasoningDelta` (``delta.reasoning_content``,
  or ``delta.reasoning`` as some servers name it);
- :class:`ToolCallDelta` for each fragment of a tool call: the first names the call's id and function,
  later ones carry pieces of its JSON arguments; the reader stitches them per ``index`` into
  :attr:`ChunkReader.tool_calls`;
- :class:`Finish` (``finish_reason``), :class:`Usage` (``usage``, usually on a final chunk with no
  choices), :class:`StreamFailed` (an ``error`` object sent in the stream) and :class:`Done` (the
  ``[DONE]`` sentinel).

Only the first choice is read: the backend never asks for more than one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgspec

__all__ = [
    "ChunkEvent",
    "ChunkReader",
    "Done",
    "Finish",
    "ReasoningDelta",
    "SseParser",
    "StreamFailed",
    "TextDelta",
    "ToolCallAcc",
    "ToolCallDelta",
    "Usage",
]

_decode = msgspec.json.Decoder().decode


class _TextDelta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: None = None


class _TextChoice(msgspec.Struct):
    delta: _TextDelta | None = None
    finish_reason: None = None


class _TextChunk(msgspec.Struct):
    """The common chunk, a text or reasoning delta and nothing else, decoded without building dicts."""

    choices: list[_TextChoice]
    usage: None = None
    error: None = None


_decode_text = msgspec.json.Decoder(_TextChunk).decode


class SseParser:
    """The ``data`` of each complete event in a ``text/event-stream`` body, fed as it arrives."""

    __slots__ = ("_buf", "_cr", "_data")

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._cr = False  # the last chunk ended in "\r": a "\n" opening the next one ends no new line

    def feed(self, text: str) -> list[str]:
        """Take the next piece of the body (decoded text); return the events it completed."""
        if (
            not self._buf and not self._data and not self._cr
            and text.startswith("data: ") and text.endswith("\n\n") and text.count("\n") == 2 and "\r" not in text
        ):
            return [text[6:-2]]  # the usual piece: one whole single-line event
        if self._cr and text.startswith("\n"):
            text = text[1:]
        self._cr = text.endswith("\r")
        buf = self._buf + text
        if "\r" in buf:
            buf = buf.replace("\r\n", "\n").replace("\r", "\n")
        *lines, self._buf = buf.split("\n")
        out: list[str] = []
        for line in lines:
            if not line:
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith("data"):
                name, sep, value = line.partition(":")
                if name != "data":
                    continue
                self._data.append(value[1:] if value.startswith(" ") else value)
            # comments (":...") and the event, id and retry fields mean nothing to a chat completion
        return out

    def close(self) -> list[str]:
        """The body ended: an event it left unterminated, if any (lenient: some servers omit the blank line)."""
        out = self.feed("\n\n") if (self._buf or self._data) else []
        self._buf = ""
        return out


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the assistant's message."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's reasoning (shown as a thought, never sent back to the model)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of tool call ``index``: its id and name when first seen, then argument text."""

    index: int
    call_id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The choice's ``finish_reason``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as the server reported them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """The server sent an error object inside an otherwise successful stream."""

    message: str
    code: Any = None


@dataclass(frozen=True, slots=True)
class Done:
    """The ``[DONE]`` sentinel: nothing more follows."""


ChunkEvent: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta | Finish | Usage | StreamFailed | Done


@dataclass(slots=True)
class ToolCallAcc:
    """One tool call stitched from its deltas."""

    index: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    #: set once the call was announced to the client (it has an id and a name)
    announced: bool = field(default=False)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class ChunkReader:
    """Chunks of a streamed chat completion in, :data:`ChunkEvent` values out.

    Attributes:
        tool_calls: the tool calls seen so far, by their ``index``, arguments stitched.
        finish_reason: the last ``finish_reason`` seen (``None``: none yet).
        usage: the last usage seen.
        done: the ``[DONE]`` sentinel arrived.
    """

    __slots__ = ("done", "finish_reason", "tool_calls", "usage")

    def __init__(self) -> None:
        self.tool_calls: dict[int, ToolCallAcc] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.done = False

    def feed(self, data: str) -> list[ChunkEvent]:
        """Interpret one event's data.

        Raises:
            ValueError: the data is neither ``[DONE]`` nor a JSON object.
        """
        if data.strip() == "[DONE]":
            self.done = True
            return [Done()]
        try:
            fast = _decode_text(data)
        except msgspec.DecodeError:  # anything else (tool calls, finish, usage): the general reading below
            pass
        else:
            if not fast.choices or fast.choices[0].delta is None:
                return []
            delta = fast.choices[0].delta
            text: list[ChunkEvent] = []
            reasoning = delta.reasoning_content or delta.reasoning
            if reasoning:
                text.append(ReasoningDelta(reasoning))
            if delta.content:
                text.append(TextDelta(delta.content))
            return text
        try:
            chunk = _decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"an event's data is not JSON: {exc}") from None
        if not isinstance(chunk, dict):
            raise ValueError("an event's data is not a JSON object")
        out: list[ChunkEvent] = []
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            out.append(StreamFailed(str(message), error.get("code") if isinstance(error, dict) else None))
            return out
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            self._choice(choices[0], out)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, completion = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
            total = _int(usage.get("total_tokens")) or prompt + completion
            self.usage = Usage(prompt, completion, total)
            out.append(self.usage)
        return out

    def _choice(self, choice: dict[str, Any], out: list[ChunkEvent]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out.append(ReasoningDelta(reasoning))
            content = delta.get("content")
            if isinstance(content, str) and content:
                out.append(TextDelta(content))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        out.append(self._tool_call(call))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.finish_reason = reason
            out.append(Finish(reason))

    def _tool_call(self, call: dict[str, Any]) -> ToolCallDelta:
        index = _int(call.get("index", len(self.tool_calls)))
        acc = self.tool_calls.get(index)
        if acc is None:
            acc = self.tool_calls[index] = ToolCallAcc(index)
        raw_id = call.get("id")
        call_id = raw_id if isinstance(raw_id, str) else None
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        raw_name, raw_args = function.get("name"), function.get("arguments")
        name = raw_name if isinstance(raw_name, str) else None
        arguments = raw_args if isinstance(raw_args, str) else ""
        if call_id:
            acc.call_id = call_id
        if name and not acc.name:
            acc.name = name
        acc.arguments += arguments
        return ToolCallDelta(index, call_id, name, arguments)
