"""The :class:`~acp_server.backends.base.Turn` a backend gets for an admitted prompt, and its client channel.

:class:`PromptTurn` is what the runner hands a backend: the prompt's ids, content and ``_meta``, an
``emit`` that records and sends the prompt's updates through the fan-out (dropped once the prompt
settled), and, made only when a backend first reads them, its client channel
(:class:`TurnChannel`, which reports ``paused_for_approval`` while a permission request is open),
its transcript reader and its result ``_meta``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec

from ..backends.base import ClientChannel, TranscriptEntry, Turn
from .fanout import _UPDATE, _UPDATE_FROM, FanOut
from .session import PromptTicket
from .sessions import SessionTable

__all__ = ["PromptTurn", "TurnChannel"]

_encoder = msgspec.json.Encoder()

#: a lazily made member of a turn not made yet
_UNSET: Any = object()


class TurnChannel:
    """A prompt's client channel that reports ``paused_for_approval`` while a permission request is open."""

    __slots__ = ("_fanout", "_inner", "_open", "_ticket")

    def __init__(self, fanout: FanOut, inner: ClientChannel, ticket: PromptTicket) -> None:
        self._fanout = fanout
        self._inner = inner
        self._ticket = ticket
        self._open = 0

    @property
    def capabilities(self) -> Any:
        """The sender's capabilities."""
        return self._inner.capabilities

    async def request(self, method: str, params: Any) -> Any:
        """Relay the agent's request to the prompt's sender, after the updates it sent before it."""
        if method != "session/request_permission":
            await self._fanout.sent()
            return await self._inner.request(method, params)
        ticket = self._ticket
        self._open += 1
        if self._open == 1 and not ticket.settled:
            self._fanout.turn_state(ticket, "paused_for_approval")
        try:
            await self._fanout.sent()
            return await self._inner.request(method, params)
        finally:
            self._open -= 1
            if not self._open and not ticket.settled:
                self._fanout.turn_state(ticket, "running")


class PromptTurn(Turn):
    """The :class:`~acp_server.backends.base.Turn` of a prompt the runner calls.

    Its ``emit`` is the fan-out's for its ticket (:meth:`FanOut.emit`'s steps inline, without
    ``exclude``): a method, not a ``partial`` made per prompt. Its ``client`` (the prompt's channel
    as a :class:`TurnChannel`, which reports ``paused_for_approval``), its ``transcript`` reader and
    its ``result_meta`` are made when a backend first reads them: most turns never do, and each was
    an object per prompt."""

    __slots__ = ("_client", "_fanout", "_result_meta", "_table", "_ticket", "_transcript", "_upto")

    def __init__(self, ticket: PromptTicket, fanout: FanOut, table: SessionTable, meta: dict[str, Any] | None) -> None:
        session = ticket.session
        self.session_id = session.session_id
        self.prompt_id = ticket.prompt_id
        self.prompt = ticket.prompt
        self.meta = meta
        self.permit = ticket.lease  # a pool lease or a shared hold: a backend may hand it back between calls
        self.deadline = ticket.deadline if ticket.deadline_ms else None
        self._ticket = ticket
        self._fanout = fanout
        self._table = table
        self._upto = session.next_event_id - 1  # the transcript before this prompt
        self._client: Any = _UNSET
        self._transcript: Any = _UNSET
        self._result_meta: dict[str, Any] | None = None

    def emit(self, update: Any) -> None:
        """Record and send one of the running prompt's updates (dropped once the prompt settled)."""
        ticket = self._ticket
        if ticket.settled:
            return
        fanout = self._fanout
        session = ticket.session
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        history = session.history
        history.append((event_id, update))
        if len(history) > fanout._trim_at:
            fanout._trim(session)
        attached = session.attached
        add_event = fanout._add_event
        if not attached:
            if add_event is not None:
                add_event(session.session_id, event_id, update)
            return
        body = _encoder.encode(update)  # once, for the wire and the store
        if add_event is not None:
            add_event(session.session_id, event_id, body)
        originator = ticket.client_id
        sinks = fanout.update_sinks
        if sinks and fanout._direct and len(attached) == 1:
            for peer in attached:
                sink = sinks.get(peer)
                if sink is not None:
                    sink(event_id, body, originator)
                    return
        if originator is None:
            data = _UPDATE % (session.session_id.encode(), body, event_id)
        else:
            data = _UPDATE_FROM % (session.session_id.encode(), body, event_id, originator.encode())
        if fanout._direct and len(attached) == 1:
            for peer in attached:
                peer.send(data)
            return
        fanout.send(session, data, None)

    @property
    def result_meta(self) -> dict[str, Any]:
        """Keys the backend adds to the result's ``_meta`` (made on first use and kept)."""
        extra = self._result_meta
        if extra is None:
            extra = self._result_meta = {}
        return extra

    @result_meta.setter
    def result_meta(self, value: dict[str, Any]) -> None:
        self._result_meta = value

    @property
    def client(self) -> ClientChannel | None:
        """The prompt's sender (``None`` once it is gone), made on first use and kept."""
        client = self._client
        if client is _UNSET:
            ticket = self._ticket
            channel = ticket.channel
            client = self._client = TurnChannel(self._fanout, channel, ticket) if channel is not None else None
        return client  # type: ignore[no-any-return]

    @client.setter
    def client(self, value: ClientChannel | None) -> None:
        self._client = value

    @property
    def transcript(self) -> Callable[[], Awaitable[list[TranscriptEntry]]] | None:
        """Reads the session's transcript before this prompt."""
        transcript = self._transcript
        if transcript is _UNSET:
            transcript = self._transcript = partial(self._table.transcript, self._ticket.session, self._upto)
        return transcript  # type: ignore[no-any-return]

    @transcript.setter
    def transcript(self, value: Callable[[], Awaitable[list[TranscriptEntry]]] | None) -> None:
        self._transcript = value
