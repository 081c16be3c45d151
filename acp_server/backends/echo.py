"""The built-in echo agent: the reference backend.

It streams the prompt's text back as ``agent_message_chunk`` updates, one chunk per word with its
whitespace kept, so the chunks joined equal the input text. Other content blocks are described in
text. ``delay_ms`` makes each turn take at least that long (so backpressure can be seen by hand); a
cancel ends the wait at once.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable

import trio

from ..types.acp import (
    AgentMessageChunk,
    AudioContent,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    StopReason,
    TextContent,
)
from .base import BaseBackend, Turn

__all__ = ["EchoBackend", "describe_block", "split_words"]

_WORD = re.compile(r"\s*\S+\s*|\s+")


def split_words(text: str) -> list[str]:
    """``text`` in chunks of one word each, whitespace kept: ``"".join(split_words(t)) == t``."""
    # One word and no whitespace, the commonest prompt of all, without the expression: what ``\s``
    # matches is the space or a character ``isprintable`` rejects (a control or a separator).
    if " " not in text and text.isprintable() and text:
        return [text]
    return _WORD.findall(text)


def describe_block(block: ContentBlock) -> str:
    """The text the echo agent sends back for one content block."""
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, ImageContent):
        return f"[image {block.mime_type}, {len(block.data)} base64 chars]"
    if isinstance(block, AudioContent):
        return f"[audio {block.mime_type}, {len(block.data)} base64 chars]"
    if isinstance(block, ResourceLink):
        return f"[resource link {block.name}: {block.uri}]"
    assert isinstance(block, EmbeddedResource)
    uri = block.resource.get("uri", "?")
    return f"[embedded resource {uri}]"


class EchoBackend(BaseBackend):
    """Echoes prompts back word by word.

    Args:
        delay_ms: the least time each turn takes, in milliseconds (0: no wait).
    """

    def __init__(self, *, delay_ms: int = 0, name: str = "echo") -> None:
        self.name = name
        self.delay_ms = delay_ms
        #: a subclass with its own :meth:`prompt` gets that from :meth:`start_prompt` (found once: the
        #: two class attribute reads cost ~500 instructions a prompt)
        self._own_prompt = type(self).prompt is not EchoBackend.prompt

    def start_prompt(self, turn: Turn) -> StopReason | Awaitable[StopReason]:
        """Without a delay the whole turn: its updates and ``end_turn``, in the admitting step (a
        subclass with its own :meth:`prompt` gets that instead)."""
        if self.delay_ms or self._own_prompt:
            return self.prompt(turn)
        for block in turn.prompt:
            text = block.text if type(block) is TextContent else describe_block(block)
            if " " not in text and text.isprintable() and text:  # split_words' one-word case, inline
                turn.emit(AgentMessageChunk(content=TextContent(text=text)))  # (no bound method made)
                continue
            emit = turn.emit
            for chunk in split_words(text):
                emit(AgentMessageChunk(content=TextContent(text=chunk)))
        return "end_turn"

    async def prompt(self, turn: Turn) -> StopReason:
        start = trio.current_time() if self.delay_ms else 0.0
        emit = turn.emit
        for block in turn.prompt:
            for chunk in split_words(describe_block(block)):
                emit(AgentMessageChunk(content=TextContent(text=chunk)))
        if self.delay_ms:
            await trio.sleep_until(start + self.delay_ms / 1000)
        # Without a delay the turn ends here, without yielding: its updates and its answer are then
        # queued in one step of the runner and leave in one write (a yield here split them in two
        # writes half the time, and cost the runner a second scheduler pass). The runner yields as it
        # parks, so a loop of prompts still lets everything else run.
        return "end_turn"
