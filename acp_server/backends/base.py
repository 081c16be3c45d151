"""What the session bridge needs of an agent backend, as a small Protocol.

A backend never learns who the client is: it gets a :class:`Turn` with the session id, the prompt's
content blocks and ``emit`` to stream ``session/update`` payloads, and returns a stop reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..types.acp import ContentBlock, StopReason

__all__ = ["Backend", "Turn"]


class Turn:
    """One prompt as a backend sees it.

    Attributes:
        session_id: the bridge's session id.
        prompt: the content blocks sent by the client.
        emit: call with a session update (a Struct such as ``AgentMessageChunk``, or a dict) to stream it
            to every attached client; updates emitted after the prompt settled are dropped.
    """

    __slots__ = ("emit", "prompt", "prompt_id", "session_id")

    def __init__(
        self, session_id: str, prompt_id: str, prompt: Sequence[ContentBlock], emit: Callable[[Any], None]
    ) -> None:
        self.session_id = session_id
        self.prompt_id = prompt_id
        self.prompt = prompt
        self.emit = emit


@runtime_checkable
class Backend(Protocol):
    """An agent the bridge can put turns on."""

    name: str

    async def prompt(self, turn: Turn) -> StopReason:
        """Run one turn to its end; cancellation (trio's) means the client cancelled it."""
        ...

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        """Make ``new_session_id`` a branch of ``source_session_id`` (the bridge copies the history)."""
        ...
