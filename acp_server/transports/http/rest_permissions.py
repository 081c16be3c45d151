"""The channel a REST prompt's agent asks its permission questions on: the session's SSE subscribers
are sent ``permission_request``, and the first ``POST /session/:id/permission/:requestId`` answers it."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ...types.acp import ClientCapabilities
from .rest_envelope import _event
from .rest_events import SseSubscriber

if TYPE_CHECKING:
    from ...bridge import Session

__all__ = ["PermissionBoard", "RestChannel"]


class _Question:
    __slots__ = ("answer", "done", "session_id")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.done = trio.Event()
        self.answer: Any = None


class PermissionBoard:
    """The permission questions REST prompts' agents asked and nobody has answered yet (first answer wins)."""

    def __init__(self) -> None:
        self.open: dict[str, _Question] = {}

    def ask(self, session_id: str) -> tuple[str, _Question]:
        """A new open question on ``session_id``: its request id and the question to wait on."""
        request_id = f"perm_{secrets.token_hex(8)}"
        question = self.open[request_id] = _Question(session_id)
        return request_id, question

    def answer(self, session_id: str, request_id: str, outcome: Any) -> bool:
        """Answer an open question; ``False`` if there is none (unknown, other session, already answered)."""
        question = self.open.get(request_id)
        if question is None or question.session_id != session_id:
            return False
        del self.open[request_id]
        question.answer = outcome
        question.done.set()
        return True


class RestChannel:
    """A REST prompt as its backend addresses the client: questions go to the session's subscribers.

    ``session/request_permission`` becomes a ``permission_request`` event on every subscriber of the
    session; the first ``POST /session/:id/permission/:requestId`` answers it. With no subscriber the
    answer is ``cancelled`` at once. Other requests (``fs/*``, ``terminal/*``) are refused as a client
    without those capabilities would.
    """

    def __init__(self, session: Session, board: PermissionBoard) -> None:
        self._session = session
        self._board = board

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities()

    def _subscribers(self) -> list[SseSubscriber]:
        return [p for p in self._session.attached if isinstance(p, SseSubscriber) and not p.closed]

    async def request(self, method: str, params: Any) -> Any:
        """Ask the session's subscribers (see the class docstring)."""
        cancelled = {"outcome": {"outcome": "cancelled"}}
        if method != "session/request_permission":
            from ...backends.base import ClientGoneError

            raise ClientGoneError(f"a REST client cannot answer {method}")
        subscribers = self._subscribers()
        if not subscribers:
            return cancelled
        session_id = self._session.session_id
        request_id, question = self._board.ask(session_id)
        p = params if isinstance(params, dict) else msgspec.to_builtins(params)
        data = {"requestId": request_id, "sessionId": session_id, "toolCall": p.get("toolCall") or {}, "options": p.get("options", [])}
        for sub in subscribers:
            sub.push_event(_event("permission_request", data))
        try:
            await question.done.wait()
        finally:
            self._board.open.pop(request_id, None)
        outcome = question.answer if question.answer is not None else cancelled
        for sub in self._subscribers():
            sub.push_event(_event("permission_resolved", {
                "requestId": request_id, "sessionId": session_id, "outcome": outcome["outcome"],
            }))
        return outcome
