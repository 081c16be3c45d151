"""The fan-out: a session's updates and turn states, recorded in order and sent to its connections.

It owns the wire encoding of what the bridge sends on its own: ``session/update`` (live and replayed:
one encoder, :func:`encode_update`) and ``_acp_server/turn_state``, both built as text around the
update's JSON (our session, client and prompt ids need no escaping, and these run several times per
prompt). Every update takes the session's next ``eventId`` and goes to its history, and through the
persistence seam to the store.

Memory per session is bounded: ``history`` keeps the most recent ``max_history_events`` (what late
joiners and short replays need); older events are read back from the store in pages of
:data:`PAGE_EVENTS` ids (:meth:`FanOut.history_pages`), or, without a store, are gone: a replay that
cannot start where it was asked begins with ``_acp_server/replay_truncated`` naming the first event it
has. A replay is paced by the connection's writer (its ``send_reliably`` waits while a little is queued)
and yields between pages, so other connections stay responsive and a client that reads is never
evicted, whatever the transcript's size.

:class:`FanOut` sends at once. :class:`CommitFanOut` (with a store) holds what it sends, and the
answers of settled prompts, until the write round they follow is committed: durable before visible,
and a round's updates and answers leave a connection in one write. Consecutive messages for the same
connections are joined into one send.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from functools import partial
from time import time_ns
from typing import TYPE_CHECKING, Any, TypeAlias, get_args

import msgspec
import trio

from ..store import TURN_STATE, StoredEvent
from ..types.acp import StopReason, UserMessageChunk
from ..types.ext import TERMINAL_TURN_STATES, TURN_STATES
from .clients import TURN_STATES_ALL, TURN_STATES_TERMINAL, ClientRegistry
from .lines import UPDATE as _UPDATE
from .lines import UPDATE_FROM as _UPDATE_FROM
from .lines import encode_update
from .persistence import Persistence
from .session import Peer, PromptTicket, Session

if TYPE_CHECKING:
    from .sessions import SessionTable

__all__ = ["PAGE_EVENTS", "REPLAY_TRUNCATED", "CommitFanOut", "FanOut", "encode_update"]

log = logging.getLogger("acp_server.bridge")

#: event ids per read of a transcript from the store (one page of a replay, a fork or a rebuild)
PAGE_EVENTS = 512
#: the notification a replay begins with when its first events are gone (no store)
REPLAY_TRUNCATED = "_acp_server/replay_truncated"

_encoder = msgspec.json.Encoder()

#: what a write round's commit lets out, in order: consecutive messages for the same connections
#: (sent as one), a settled prompt to answer, or an event to set once what precedes it is sent
_HeldBack: TypeAlias = "tuple[tuple[Peer, ...], list[bytes]] | PromptTicket | trio.Event"


class _ExtMsg(msgspec.Struct):
    """An extension notification replayed from the transcript (a stored turn state)."""

    jsonrpc: str
    method: str
    params: dict[str, Any]


#: each turn state as the bytes its line carries, and the level a connection needs to receive it
#: (states met that are not listed here are encoded as met)
_STATES = {
    state: (state.encode(), TURN_STATES_TERMINAL if state in TERMINAL_TURN_STATES else TURN_STATES_ALL)
    for state in TURN_STATES
}
#: the stop reasons as the bytes a turn state line carries
_REASONS = {reason: b',"reason":"%s"' % reason.encode() for reason in get_args(StopReason)}


#: a ``_acp_server/turn_state`` line: the prompt's head (:func:`_turn_state_ends`), the state, ``at``, the
#: optional fields, the ``eventId`` and the prompt's tail
_TURN_STATE = b'%s%s","at":%s%s,"_meta":{"eventId":%d%s'
#: two of them (``accepted`` and ``running``) in one send, for a connection that takes joined lines
_TWO_TURN_STATES = _TURN_STATE + _TURN_STATE
#: a terminal turn state as the transcript keeps it (TurnStateBody): prompt id, state, ``at``, the rest
_TURN_STATE_BODY = b'{"promptId":"%s","state":"%s","at":%s%s}'
#: the same for ``completed``, its usual state
_COMPLETED_BODY = b'{"promptId":"%s","state":"completed","at":%s%s}'


def _turn_state_ends(session_id: str, prompt_id: str, client_id: str | None) -> tuple[bytes, bytes]:
    """The head and tail of one prompt's ``_acp_server/turn_state`` lines (:data:`_TURN_STATE`), built
    once per prompt.

    ``originatorClientId`` (as on the prompt's updates) tells each attached client which of the
    session's prompts is its own. The ids are of our own minting: none needs JSON escaping.
    """
    head = f'{{"jsonrpc":"2.0","method":"{TURN_STATE}","params":{{"sessionId":"{session_id}","promptId":"{prompt_id}","state":"'
    tail = "}}}\n" if client_id is None else f',"originatorClientId":"{client_id}"}}}}}}\n'
    return head.encode(), tail.encode()


def answer(ticket: PromptTicket) -> None:
    """Wake whoever waits on a settled prompt."""
    ticket.set()
    waiters = ticket.waiters
    if waiters:
        ticket.waiters = ()
        for waiter in waiters:
            waiter.notify(ticket.result, ticket.error)


class FanOut:
    """Records and sends a session's updates; this one sends at once (no store).

    Args:
        clients: who is attached, and who takes turn states.
        persistence: where updates are recorded.
        max_history_events: the most recent events kept in each session's ``history``.
    """

    def __init__(self, clients: ClientRegistry, persistence: Persistence, max_history_events: int = 10_000) -> None:
        self._clients = clients
        self._peer_states = clients.peers
        self._persistence = persistence
        #: where events are recorded (``None`` without a store: nothing to call)
        self._add_event = persistence.add_event if persistence.durable else None
        self._keep = max_history_events
        #: trimmed in steps (a quarter of the bound at a time), so appending stays O(1) amortized
        self._trim_at = max_history_events + max(1, max_history_events // 4)
        #: a line to one connection goes to its ``send`` at once (:class:`CommitFanOut` holds it instead)
        self._direct = True
        #: connections that take a live update as its parts (event id, the update's JSON, the originating
        #: client id) instead of its line, when it goes to them alone and at once: an SSE subscriber
        #: builds its frame from them, with no line to format and cut apart again
        self.update_sinks: dict[Peer, Callable[[int, bytes, str | None], None]] = {}
        #: connections that take a completed turn's state as its parts (prompt id, stop reason, event id,
        #: the originating client id) in :meth:`completed`'s usual case; ``False`` from one: send the line
        self.completed_sinks: dict[Peer, Callable[[str, str, int, str | None], bool]] = {}
        #: the live sessions (set by the bridge): a prompt's transcript reader reads through them
        self.table: SessionTable | None = None
        #: the last epoch millisecond a turn state carried, and its digits
        self._at_ms = -1
        self._at_digits = b""

    def _trim(self, session: Session) -> None:
        """Drop the oldest events of ``history`` beyond the bound (on disk with a store, else gone)."""
        history = session.history
        cut = len(history) - self._keep
        session.trimmed_upto = history[cut - 1][0]
        del history[:cut]

    def emit(self, session: Session, update: Any, originator: str | None, *, exclude: Peer | None = None) -> None:
        """Record ``update`` in the session's history and send it to every attached connection but
        ``exclude``; ``originator`` is the client id whose prompt caused it."""
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        history = session.history
        history.append((event_id, update))
        if len(history) > self._trim_at:
            self._trim(session)
        attached = session.attached
        add_event = self._add_event
        if not attached or (exclude is not None and len(attached) == 1 and exclude in attached):
            # nobody attached, or a prompt's own text to the one connection that sent it: nobody to
            # tell, and nothing to encode here (the store encodes it)
            if add_event is not None:
                add_event(session.session_id, event_id, update)
            return
        body = _encoder.encode(update)  # once, for the wire and the store
        if add_event is not None:
            add_event(session.session_id, event_id, body)
        sinks = self.update_sinks
        if sinks and self._direct and len(attached) == 1:  # (not ``exclude``: that returned above)
            for peer in attached:
                sink = sinks.get(peer)
                if sink is not None:
                    sink(event_id, body, originator)
                    return
        if originator is None:  # encode_update's lines, inline (this runs for every update)
            data = _UPDATE % (session.session_id.encode(), body, event_id)
        else:
            data = _UPDATE_FROM % (session.session_id.encode(), body, event_id, originator.encode())
        if self._direct and len(attached) == 1 and exclude is None:
            for peer in attached:  # the usual case: one connection, sent to at once
                peer.send(data)
            return
        self.send(session, data, exclude)

    def own_text(self, ticket: PromptTicket) -> None:
        """A starting prompt's own text (a ``user_message_chunk`` per content block), recorded and sent
        to the session's connections but its sender, as :meth:`emit` does for each."""
        session = ticket.session
        attached = session.attached
        sender = ticket.sender
        if self._add_event is None and (not attached or (len(attached) == 1 and sender in attached)):
            # the usual case: nobody else to tell and no store, so the history is all there is to do
            history = session.history
            event_id = session.next_event_id
            for block in ticket.prompt:
                history.append((event_id, UserMessageChunk(content=block)))
                event_id += 1
            session.next_event_id = event_id
            if len(history) > self._trim_at:
                self._trim(session)
            return
        for block in ticket.prompt:
            self.emit(session, UserMessageChunk(content=block), ticket.client_id, exclude=sender)

    def start(self, ticket: PromptTicket) -> None:
        """A prompt's backend call starts: its ``accepted`` turn state if it is still due
        (``ticket.accepted_due``: it starts in the step that admitted it), ``running``, then its own
        text, as :meth:`turn_state` twice and :meth:`own_text` would (one call for the three).

        Both states take their event ids and carry the same ``at``; nothing is built for a
        connection that takes no live turn states.
        """
        accepted = ticket.accepted_due
        ticket.accepted_due = False
        session = ticket.session
        attached = session.attached
        if len(attached) != 1 or not self._direct:
            if accepted:
                self.turn_state(ticket, "accepted")
            self.turn_state(ticket, "running")
            self.own_text(ticket)
            return
        (peer,) = attached
        event_id = session.next_event_id
        state = self._peer_states[peer]
        if state.turn_states < TURN_STATES_ALL:
            # Nobody takes them: they still take their event ids (updates count on from there).
            event_id += 1 if accepted else 0
        else:
            at = time_ns() // 1_000_000  # epoch ms, as in turn_state
            if at != self._at_ms:
                self._at_ms = at
                self._at_digits = b"%d" % at
            ends = ticket.state_ends
            if ends is None:  # _turn_state_ends', inline: a started prompt's first line is built here
                client_id = ticket.client_id
                ends = ticket.state_ends = (
                    f'{{"jsonrpc":"2.0","method":"{TURN_STATE}","params":{{"sessionId":"{session.session_id}",'
                    f'"promptId":"{ticket.prompt_id}","state":"'.encode(),
                    b"}}}\n" if client_id is None else f',"originatorClientId":"{client_id}"}}}}}}\n'.encode(),
                )
            if accepted and state.joins_lines:  # both lines in one format and one send
                digits = self._at_digits
                peer.send(
                    _TWO_TURN_STATES
                    % (ends[0], b"accepted", digits, b"", event_id, ends[1], ends[0], b"running", digits, b"", event_id + 1, ends[1])
                )
                event_id += 1
            else:
                if accepted:
                    peer.send(_TURN_STATE % (ends[0], b"accepted", self._at_digits, b"", event_id, ends[1]))
                    event_id += 1
                peer.send(_TURN_STATE % (ends[0], b"running", self._at_digits, b"", event_id, ends[1]))
        event_id += 1
        if self._add_event is not None or peer is not ticket.sender:
            session.next_event_id = event_id
            self.own_text(ticket)
            return
        # own_text's usual case, inline: nobody else to tell and no store, the history is all to do
        history = session.history
        for block in ticket.prompt:
            history.append((event_id, UserMessageChunk(content=block)))
            event_id += 1
        session.next_event_id = event_id
        if len(history) > self._trim_at:
            self._trim(session)

    def turn_state(self, ticket: PromptTicket, state: str, reason: str | None = None, position: int | None = None) -> None:
        """Send ``_acp_server/turn_state`` for ``ticket`` to every connection attached to its session
        that takes turn states.

        It takes the session's next ``eventId`` like an update. The terminal states (completed,
        failed, cancelled) are also kept in the transcript (replayed by load, stored with a store);
        the others are live only. Live ones carry the prompt's client id in ``_meta.originatorClientId``
        (replays carry none, as for updates).
        """
        session = ticket.session
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        known = _STATES.get(state)
        if known is None:
            known = (state.encode(), TURN_STATES_TERMINAL if state in TERMINAL_TURN_STATES else TURN_STATES_ALL)
        state_bytes, wanted = known  # wanted: the level a peer needs to receive this state
        # Who receives it, first: a live-only state that nobody takes costs nothing more.
        attached = session.attached
        peer: Peer | None = None
        peers: tuple[Peer, ...] | None = None
        if attached:
            states = self._peer_states
            if len(attached) == 1:  # the usual case, without a generator
                for peer in attached:
                    if states[peer].turn_states < wanted:
                        peer = None
            else:
                peers = tuple(p for p in attached if states[p].turn_states >= wanted) or None
        terminal = wanted == TURN_STATES_TERMINAL
        if peer is None and peers is None and not terminal:
            return
        # TurnStateParams' shape (tests decode every one into it); the reason (a stop reason may come
        # from an agent) is JSON-encoded.
        extra = b""
        if reason is not None:
            extra = _REASONS.get(reason) or b',"reason":' + _encoder.encode(reason)
        if position is not None:
            extra += b',"positionHint":%d' % position
        at = time_ns() // 1_000_000  # epoch ms, as now_ms()
        if at != self._at_ms:  # several turn states a millisecond under load: its digits made once
            self._at_ms = at
            self._at_digits = b"%d" % at
        if terminal:
            text = _TURN_STATE_BODY % (ticket.prompt_id.encode(), state_bytes, self._at_digits, extra)
            history = session.history
            history.append((event_id, StoredEvent(event_id, TURN_STATE, msgspec.Raw(text))))
            if len(history) > self._trim_at:
                self._trim(session)
            if self._add_event is not None:
                self._add_event(session.session_id, event_id, text, TURN_STATE)
            if peer is None and peers is None:
                return
        ends = ticket.state_ends
        if ends is None:
            ends = ticket.state_ends = _turn_state_ends(session.session_id, ticket.prompt_id, ticket.client_id)
        data = _TURN_STATE % (ends[0], state_bytes, self._at_digits, extra, event_id, ends[1])
        if peer is not None and self._direct:
            peer.send(data)
        else:
            self.send(session, data, None, peers or (peer,))  # type: ignore[arg-type]

    def completed(self, ticket: PromptTicket, reason: str) -> None:
        """``turn_state(ticket, "completed", reason)``, its usual case (one connection, no store) inline:
        the state is kept in the transcript whoever takes it, and sent if the connection takes turn
        states."""
        session = ticket.session
        attached = session.attached
        if len(attached) != 1 or not self._direct or self._add_event is not None:
            self.turn_state(ticket, "completed", reason)
            return
        (peer,) = attached
        event_id = session.next_event_id
        session.next_event_id = event_id + 1
        extra = _REASONS.get(reason) or b',"reason":' + _encoder.encode(reason)
        at = time_ns() // 1_000_000  # epoch ms, as in turn_state
        if at != self._at_ms:
            self._at_ms = at
            self._at_digits = b"%d" % at
        text = _COMPLETED_BODY % (ticket.prompt_id.encode(), self._at_digits, extra)
        history = session.history
        history.append((event_id, StoredEvent(event_id, TURN_STATE, msgspec.Raw(text))))
        if len(history) > self._trim_at:
            self._trim(session)
        if self._peer_states[peer].turn_states < TURN_STATES_TERMINAL:
            return
        sinks = self.completed_sinks
        if sinks:
            sink = sinks.get(peer)
            if sink is not None and sink(ticket.prompt_id, reason, event_id, ticket.client_id):
                return
        ends = ticket.state_ends
        if ends is None:
            ends = ticket.state_ends = _turn_state_ends(session.session_id, ticket.prompt_id, ticket.client_id)
        peer.send(_TURN_STATE % (ends[0], b"completed", self._at_digits, extra, event_id, ends[1]))

    def send(self, session: Session, data: bytes, exclude: Peer | None, peers: tuple[Peer, ...] | None = None) -> None:
        """Send ``data`` to ``peers`` (default: every connection attached to ``session``) but ``exclude``."""
        if peers is None:
            attached = session.attached
            if len(attached) == 1:  # the usual case, without a copy
                (peer,) = attached
                if peer is not exclude:
                    peer.send(data)
                return
            peers = tuple(attached)
        for peer in peers:
            if peer is not exclude:
                peer.send(data)

    async def sent(self) -> None:
        """Return once everything sent so far has left for its connections (here: at once).

        A message that does not go through the fan-out (an agent's request relayed to a client) waits
        for this first, so that it follows the updates the agent sent before it.
        """

    def hold_answer(self, ticket: PromptTicket) -> None:
        """A prompt settled: its waiters may be answered (:meth:`answer_waiters`)."""
        ticket.set()

    def answer_waiters(self, ticket: PromptTicket) -> None:
        """Answer the waiters of a settled prompt now."""
        waiters = ticket.waiters
        if waiters:
            ticket.waiters = ()
            for waiter in waiters:  # last: a callback may start the connection's next request
                waiter.notify(ticket.result, ticket.error)

    async def history_pages(
        self, session: Session, after_event_id: int, upto: int | None = None
    ) -> AsyncGenerator[list[tuple[int, Any]], None]:
        """The session's events after ``after_event_id`` (up to ``upto``, default all) in order, in
        pages: read from the store below
        what ``history`` holds, then from ``history``, including what is recorded meanwhile (each page
        picks up after the last event of the one before, so nothing repeats or goes missing even if
        ``history`` is trimmed in between). Without a store, events trimmed away are skipped (see
        :meth:`first_kept`)."""
        durable = self._persistence.durable
        last = after_event_id
        while True:
            history = session.history
            first = history[0][0] if history else session.next_event_id
            if upto is not None and last >= upto:
                return
            if durable and last < first - 1:
                end = min(first - 1, last + PAGE_EVENTS, upto if upto is not None else first - 1)
                events = await self._persistence.read_events(session.session_id, last, end)
                last = end
                if events:
                    yield [(e.event_id, e if e.method is not None else e.body) for e in events]
                continue
            index = bisect.bisect_right(history, last, key=_event_id)
            page = history[index : index + PAGE_EVENTS]
            if upto is not None and page and page[-1][0] > upto:
                page = page[: bisect.bisect_right(page, upto, key=_event_id)]
            if not page:
                return
            last = page[-1][0]
            yield page

    def first_kept(self, session: Session, after_event_id: int) -> int | None:
        """Without a store: the first event a replay after ``after_event_id`` can send, when events it
        should send first are gone (``None``: nothing is missing)."""
        if self._persistence.durable or session.trimmed_upto <= after_event_id:
            return None
        return session.history[0][0] if session.history else session.next_event_id

    async def replay(self, session: Session, peer: Peer, after_event_id: int) -> None:
        """Send the session's history after ``after_event_id`` to ``peer`` alone (the caller attaches it).

        Replayed updates keep their original ``eventId`` and carry no ``originatorClientId``. They are
        paced by the connection's writer (see the module docstring); entries recorded meanwhile are sent
        too, in order (no gap, no duplicate once the caller attaches the connection without an ``await``).
        When events it should begin with are gone (no store), it begins with ``_acp_server/replay_truncated``.
        """
        turn_states = self._clients.turn_states(peer)
        session_id = session.session_id
        first = self.first_kept(session, after_event_id)
        if first is not None:
            params = {"sessionId": session_id, "firstEventId": first, "requestedAfterEventId": after_event_id}
            await peer.send_reliably(_encoder.encode(_ExtMsg("2.0", REPLAY_TRUNCATED, params)) + b"\n")
        async with aclosing(self.history_pages(session, after_event_id)) as pages:
            async for page in pages:
                for event_id, update in page:
                    if isinstance(update, StoredEvent):
                        if not turn_states and (update.method or TURN_STATE) == TURN_STATE:
                            continue  # the connection opted out at initialize
                        params = msgspec.json.decode(update.body)
                        params.update(sessionId=session_id, _meta={"eventId": event_id})
                        line = _encoder.encode(_ExtMsg("2.0", update.method or TURN_STATE, params)) + b"\n"
                        await peer.send_reliably(line)
                        continue
                    await peer.send_reliably(encode_update(session_id, event_id, _encoder.encode(update)))
                await trio.lowlevel.checkpoint()  # between pages, whatever the writer's pace: others run


def _event_id(entry: tuple[int, Any]) -> int:
    return entry[0]


class CommitFanOut(FanOut):
    """With a store: messages and answers wait for the commit of the write round they follow."""

    def __init__(self, clients: ClientRegistry, persistence: Persistence, max_history_events: int = 10_000) -> None:
        super().__init__(clients, persistence, max_history_events)
        self._direct = False
        #: what the current write round's commit lets out, in order (see :meth:`_round`)
        self._held: list[_HeldBack] | None = None
        self._held_generation = 0

    def send(self, session: Session, data: bytes, exclude: Peer | None, peers: tuple[Peer, ...] | None = None) -> None:
        """Queue ``data`` for ``peers`` (default: every connection attached to ``session``) but
        ``exclude``, to be sent once the current write round is committed."""
        if peers is None:
            peers = tuple(session.attached)
        if exclude is not None:
            peers = tuple(p for p in peers if p is not exclude)
            if not peers:
                return
        held = self._held
        if held is None or self._held_generation != self._persistence.generation:
            held = self._round()
        if held:
            last = held[-1]
            if type(last) is tuple and last[0] == peers:
                last[1].append(data)  # the same connections as the message before: one send for both
                return
        held.append((peers, [data]))

    async def sent(self) -> None:
        """Wait until what is held so far has been committed and sent (nothing held: return at once)."""
        held = self._held
        if held:  # cleared by _committed once its round is out
            done = trio.Event()
            held.append(done)
            await done.wait()

    def hold_answer(self, ticket: PromptTicket) -> None:
        """The prompt's answer waits for the commit of its terminal record, in order with the updates."""
        self._round().append(ticket)

    def answer_waiters(self, ticket: PromptTicket) -> None:
        """The answer waits; its requests no longer count as running on their connections."""
        for waiter in list(ticket.waiters):  # last: a callback may start the connection's next request
            waiter.settled()

    def _round(self) -> list[_HeldBack]:
        """What waits for the commit of the current write round (one store callback per round)."""
        persistence = self._persistence
        held = self._held
        if held is None or self._held_generation != persistence.generation:
            held = self._held = []
            self._held_generation = persistence.generation
            persistence.after_round(partial(self._committed, held))  # also covers what is appended later
        return held

    def _committed(self, held: list[_HeldBack]) -> None:
        """A write round is committed: send its messages and answer its prompts, in order."""
        if held is self._held:
            self._held = None  # nothing is held any more: sent() returns at once
        for entry in held:
            try:
                if isinstance(entry, PromptTicket):
                    answer(entry)
                elif isinstance(entry, trio.Event):
                    entry.set()
                else:
                    peers, parts = entry
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    for peer in peers:
                        peer.send(data)  # a closed one drops it
            except Exception:
                log.exception("after a store commit: %r failed", entry)
