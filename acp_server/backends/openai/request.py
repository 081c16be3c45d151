"""A session's conversation with the model, and the chat-completions request body built from it.

The conversation is a list of *turns*; a turn is the messages one ``session/prompt`` added: the user's
message first, then the assistant's messages and the tool results of its tool rounds. The system
prompt is never part of it (it is put first in every request). Everything here is pure:

- :func:`user_message` turns a prompt's content blocks into a user message (images as ``image_url``
  parts when the model takes them, else :class:`~acp_server.errors.InvalidParamsError` naming the
  block);
- :func:`trim_turns` keeps the request inside the model's window by dropping the oldest whole turns
  (never the system prompt, never the running turn), so that a long conversation never fails forever;
- :func:`request_body` is the JSON body of one streamed call;
- :func:`turns_from_transcript` rebuilds the conversation from the session's transcript (the
  ``session/update`` payloads the backend emitted, with the ``_meta.openai`` it put on tool calls, and
  the terminal turn states that close each prompt), so that ``session/load`` after a restart and the
  next prompt continue the same conversation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec

from ...errors import InvalidParamsError
from ...types.acp import (
    AudioContent,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
)

__all__ = [
    "META_KEY",
    "Message",
    "TokenEstimate",
    "close_turn",
    "request_body",
    "trim_turns",
    "turns_from_transcript",
    "user_message",
]

Message = dict[str, Any]

#: the ``_meta`` key under which tool-call updates carry what the model needs back (name, arguments, result)
META_KEY: Final = "openai"
#: the result given to the model for a tool call that never ran (the turn ended first)
NOT_RUN: Final = "not run: the turn ended before this tool call ran"
#: tokens per character before the server reported any usage (about 4 characters a token)
DEFAULT_TOKENS_PER_CHAR: Final = 0.25
#: what each message costs beyond its text (role, separators), in tokens
MESSAGE_OVERHEAD_TOKENS: Final = 4

_TERMINAL_STATES: Final = frozenset({"completed", "failed", "cancelled"})
_encode = msgspec.json.Encoder().encode


def _block_text(block: ResourceLink | EmbeddedResource) -> str:
    if isinstance(block, ResourceLink):
        return f"[resource link {block.name}: {block.uri}]"
    resource = block.resource
    uri = resource.get("uri", "?")
    text = resource.get("text")
    if isinstance(text, str):
        return f"[resource {uri}]\n{text}"
    blob = resource.get("blob")
    size = len(blob) if isinstance(blob, str) else 0
    return f"[resource {uri}: binary, {size} base64 chars]"


def user_message(blocks: Sequence[ContentBlock], *, images: bool) -> Message:
    """The user message of one prompt.

    Text, resource links and embedded text resources become text; an image becomes an ``image_url``
    part with a ``data:`` URL when ``images`` is true.

    Raises:
        InvalidParamsError: an image when the model takes none, or any audio block (at ``prompt[i]``).
    """
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        if isinstance(block, TextContent):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageContent):
            if not images:
                raise InvalidParamsError(
                    path=f"prompt[{i}]",
                    detail="this backend's model takes no images (set images = true in its config if it does)",
                )
            parts.append({"type": "image_url", "image_url": {"url": f"data:{block.mime_type};base64,{block.data}"}})
        elif isinstance(block, AudioContent):
            raise InvalidParamsError(path=f"prompt[{i}]", detail="this backend's model takes no audio")
        else:
            parts.append({"type": "text", "text": _block_text(block)})
    return _user(parts)


def _user(parts: list[dict[str, Any]]) -> Message:
    if all(p["type"] == "text" for p in parts):
        return {"role": "user", "content": "".join(p["text"] for p in parts)}
    return {"role": "user", "content": parts}


def close_turn(turn: list[Message]) -> None:
    """Give every tool call of ``turn`` that has no result the result :data:`NOT_RUN` (a cancelled or
    failed round), so the conversation stays one the model accepts."""
    answered = {m.get("tool_call_id") for m in turn if m.get("role") == "tool"}
    for i in range(len(turn) - 1, -1, -1):
        message = turn[i]
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not calls:
            continue
        missing = [c["id"] for c in calls if c["id"] not in answered]
        for call_id in missing:
            turn.append({"role": "tool", "tool_call_id": call_id, "content": NOT_RUN})
        return


class TokenEstimate:
    """Tokens of messages, estimated from their characters and corrected by what the server reports.

    Attributes:
        per_char: the current tokens-per-character ratio.
    """

    __slots__ = ("per_char",)

    def __init__(self, per_char: float = DEFAULT_TOKENS_PER_CHAR) -> None:
        self.per_char = per_char

    @staticmethod
    def chars(messages: Iterable[Message]) -> int:
        """The characters of ``messages`` as sent (their JSON)."""
        return sum(len(_encode(m)) for m in messages)

    def tokens(self, messages: Iterable[Message]) -> int:
        """The estimated tokens of ``messages``."""
        count = 0
        chars = 0
        for m in messages:
            count += 1
            chars += len(_encode(m))
        return int(chars * self.per_char) + MESSAGE_OVERHEAD_TOKENS * count

    def observe(self, messages: Sequence[Message], prompt_tokens: int) -> None:
        """The server counted ``prompt_tokens`` for ``messages``: use its ratio from now on."""
        chars = self.chars(messages)
        if chars > 0 and prompt_tokens > 0:
            overhead = MESSAGE_OVERHEAD_TOKENS * len(messages)
            self.per_char = min(2.0, max(0.02, max(1, prompt_tokens - overhead) / chars))


def trim_turns(
    system: Sequence[Message], turns: Sequence[Sequence[Message]], budget: int | None, estimate: TokenEstimate
) -> tuple[list[Message], int]:
    """The messages of a request inside ``budget`` tokens, and how many of the oldest turns were dropped.

    Whole turns are dropped oldest first, never the system messages and never the last (running)
    turn: a running turn larger than the window is sent as it is, and the model server's answer says
    what it thinks of it (the next prompt then drops it like any old turn).

    Args:
        system: the system messages (kept first).
        turns: the conversation, oldest first; the last one is the running turn.
        budget: the most tokens the request may take (``None``: no window configured).
        estimate: how tokens are counted.
    """
    if budget is None or not turns:
        return [*system, *(m for t in turns for m in t)], 0
    sizes = [estimate.tokens(t) for t in turns]
    total = estimate.tokens(system) + sum(sizes)
    dropped = 0
    while total > budget and dropped < len(turns) - 1:
        total -= sizes[dropped]
        dropped += 1
    return [*system, *(m for t in turns[dropped:] for m in t)], dropped


def request_body(
    model: str, messages: list[Message], tools: list[dict[str, Any]], extra_body: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON body of one streamed chat-completions call.

    ``extra_body`` is passed through (``temperature``, ``max_tokens``, a server's own options); it
    cannot turn streaming off or replace the model and messages. ``stream_options`` asks for usage on
    the last chunk unless ``extra_body`` sets it (``null`` there leaves it out, for servers that
    reject it).
    """
    body: dict[str, Any] = {"stream_options": {"include_usage": True}, **extra_body}
    if body.get("stream_options") is None:
        body.pop("stream_options", None)
    body.update(model=model, messages=messages, stream=True)
    if tools:
        body["tools"] = tools
    return body


# --- the conversation from the transcript ---------------------------------------------------------


def _content_part(content: Any, images: bool) -> dict[str, Any] | None:
    if not isinstance(content, dict):
        return None
    kind = content.get("type")
    if kind == "text" and isinstance(content.get("text"), str):
        return {"type": "text", "text": content["text"]}
    if kind == "image" and isinstance(content.get("data"), str):
        mime = content.get("mimeType", "image/png")
        if images:
            return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{content['data']}"}}
        return {"type": "text", "text": f"[image {mime}]"}
    if kind == "resource_link":
        return {"type": "text", "text": f"[resource link {content.get('name', '?')}: {content.get('uri', '?')}]"}
    if kind == "resource" and isinstance(content.get("resource"), dict):
        block = EmbeddedResource(resource=content["resource"])
        return {"type": "text", "text": _block_text(block)}
    return None


class _Rebuild:
    """The state of :func:`turns_from_transcript` as it walks the entries."""

    def __init__(self, images: bool) -> None:
        self.images = images
        self.turns: list[list[Message]] = []
        self.user_parts: list[dict[str, Any]] | None = None  # the user message being gathered
        self.open = False  # a turn is open (its terminal turn state not seen yet)
        self.calls: dict[str, dict[str, Any]] = {}  # tool call id -> its entry in an assistant message

    def _turn(self) -> list[Message]:
        if self.user_parts is not None:
            self.turns.append([_user(self.user_parts)])
            self.user_parts = None
            self.open = True
        if not self.turns:
            self.turns.append([])
            self.open = True
        return self.turns[-1]

    def _assistant(self, *, for_tools: bool) -> Message:
        turn = self._turn()
        last = turn[-1] if turn else None
        if last is None or last.get("role") != "assistant" or (not for_tools and last.get("tool_calls")):
            last = {"role": "assistant", "content": None}
            turn.append(last)
        return last

    def user(self, content: Any) -> None:
        """A ``user_message_chunk``: a new user message unless one is being gathered."""
        part = _content_part(content, self.images)
        if part is None:
            return
        if self.user_parts is None:
            self.end()
            self.user_parts = []
        self.user_parts.append(part)

    def text(self, content: Any) -> None:
        """An ``agent_message_chunk``: text of the current assistant message."""
        if isinstance(content, dict) and content.get("type") == "text" and isinstance(content.get("text"), str):
            message = self._assistant(for_tools=False)
            message["content"] = (message["content"] or "") + content["text"]

    def tool_call(self, update: Mapping[str, Any]) -> None:
        """A ``tool_call`` the backend announced (its ``_meta.openai.name``): a call of the assistant."""
        call_id = update.get("toolCallId")
        meta = (update.get("_meta") or {}).get(META_KEY) if isinstance(update.get("_meta"), dict) else None
        if not isinstance(call_id, str) or not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            return
        message = self._assistant(for_tools=True)
        # arguments None until the update that carries them: a call cut before it is dropped at the end
        entry = {"id": call_id, "type": "function", "function": {"name": meta["name"], "arguments": None}}
        message.setdefault("tool_calls", []).append(entry)
        self.calls[call_id] = entry

    def tool_update(self, update: Mapping[str, Any]) -> None:
        """A ``tool_call_update``: the call's arguments, or its result (a tool message)."""
        call_id = update.get("toolCallId")
        meta = (update.get("_meta") or {}).get(META_KEY) if isinstance(update.get("_meta"), dict) else None
        if not isinstance(call_id, str) or not isinstance(meta, dict) or call_id not in self.calls:
            return
        if isinstance(meta.get("arguments"), str):
            self.calls[call_id]["function"]["arguments"] = meta["arguments"]
        if isinstance(meta.get("result"), str):
            self._turn().append({"role": "tool", "tool_call_id": call_id, "content": meta["result"]})

    def end(self) -> None:
        """A prompt ended (its terminal turn state), or a new user message begins."""
        if self.user_parts is not None:
            self._turn()
        if self.open and self.turns:
            turn = self.turns[-1]
            for message in turn:
                calls = message.get("tool_calls")
                if calls:
                    calls[:] = [c for c in calls if c["function"]["arguments"] is not None]
                    if not calls:
                        del message["tool_calls"]
            turn[:] = [m for m in turn if m.get("role") != "assistant" or m.get("content") or m.get("tool_calls")]
            close_turn(turn)
        self.open = False
        self.calls = {}


def turns_from_transcript(entries: Iterable[tuple[str | None, Any]], *, images: bool) -> list[list[Message]]:
    """The conversation a transcript records, turn by turn.

    Args:
        entries: the transcript in order: ``(None, update)`` for a ``session/update`` payload,
            ``(method, params)`` for an extension notification (the terminal turn states close turns).
        images: the model takes images (else an image in the transcript is named in text).
    """
    state = _Rebuild(images)
    for method, payload in entries:
        if not isinstance(payload, dict):
            continue
        if method is not None:
            if payload.get("state") in _TERMINAL_STATES:
                state.end()
            continue
        kind = payload.get("sessionUpdate")
        if kind == "user_message_chunk":
            state.user(payload.get("content"))
        elif kind == "agent_message_chunk":
            state.text(payload.get("content"))
        elif kind == "tool_call":
            state.tool_call(payload)
        elif kind == "tool_call_update":
            state.tool_update(payload)
    state.end()
    return [t for t in state.turns if t]
