"""``acp_server.bridge.fanout``: one encoder for live and replayed updates, turn-state filtering, and
the sends that wait for a write round's commit."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from acp_server.backends.echo import EchoBackend
from acp_server.bridge import SessionBridge
from acp_server.bridge.clients import ClientRegistry
from acp_server.bridge.fanout import CommitFanOut, encode_update
from acp_server.bridge.persistence import NullPersistence
from acp_server.bridge.sessions import SessionTable
from acp_server.types.acp import AgentMessageChunk, SessionNotification, TextContent

from .fakes import (
    FakeBackend,
    FakePeer,
    admit_ticket,
    open_session,
    prompt_outcome,
    running_bridge,
    text_blocks,
)


class _Notification(msgspec.Struct):
    jsonrpc: str
    method: str
    params: SessionNotification


def _lines(peer: FakePeer) -> list[dict[str, Any]]:
    return [json.loads(line) for data in peer.sent for line in data.splitlines()]


@pytest.mark.parametrize("update", [
    AgentMessageChunk(content=TextContent(text='quote " and \\ and é')),
    {"sessionUpdate": "tool_call", "toolCallId": "t1", "title": "from an agent"},
])
def test_encode_update_is_session_notifications_shape(update: Any) -> None:
    """The text-built line is byte for byte what msgspec makes of a SessionNotification."""
    body = msgspec.json.encode(update)
    expected = msgspec.json.encode(
        _Notification("2.0", "session/update", SessionNotification(session_id="sess_1", update=update, meta={"eventId": 7}))
    ) + b"\n"
    assert encode_update("sess_1", 7, body) == expected
    with_origin = encode_update("sess_1", 7, body, "client_x")
    assert json.loads(with_origin)["params"]["_meta"] == {"eventId": 7, "originatorClientId": "client_x"}


async def test_a_replayed_update_is_the_live_one_without_its_originator() -> None:
    backend = FakeBackend()
    async with running_bridge(backend) as bridge:
        live, late = FakePeer(), FakePeer()
        session, client_id = await open_session(bridge, live)
        ticket = admit_ticket(bridge, session.session_id, text_blocks("two words"), peer=live)
        assert (await prompt_outcome(bridge, ticket)).stop_reason == "end_turn"
        await bridge.replay(session, late, 0)
        live_updates = [m for m in _lines(live) if m["method"] == "session/update"]
        replayed = [m for m in _lines(late) if m["method"] == "session/update"]
        assert [m["params"]["update"]["content"]["text"] for m in live_updates] == ["two ", "words"]
        for message in live_updates:
            assert message["params"]["_meta"].pop("originatorClientId") == client_id
        # the sender's own text is not sent back to it, but is in the history: replayed first
        assert replayed[0]["params"]["update"]["sessionUpdate"] == "user_message_chunk"
        assert replayed[1:] == live_updates
        assert late in session.attached, "a replay attaches the connection"


async def test_turn_states_skip_connections_that_opted_out() -> None:
    async with running_bridge(FakeBackend()) as bridge:
        loud, quiet = FakePeer(), FakePeer()
        session, _ = await open_session(bridge, loud)
        bridge.register(session, quiet)
        bridge.clients.set_turn_states(quiet, False)
        assert not bridge.clients.turn_states(quiet) and bridge.clients.turn_states(FakePeer())
        ticket = admit_ticket(bridge, session.session_id, text_blocks("hi"), peer=loud)
        await prompt_outcome(bridge, ticket)
        assert [m["params"]["state"] for m in _lines(loud) if m["method"] == "_acp_server/turn_state"] == [
            "accepted", "running", "completed"
        ]
        assert [m["method"] for m in _lines(quiet)] == ["session/update", "session/update"]


async def test_a_terminal_only_connection_gets_the_terminal_turn_state_alone() -> None:
    """A REST event stream's setting: completed, failed or cancelled reach it, accepted and running
    (which it has no frame for) are not sent to it at all; the event ids are the session's as before."""
    async with running_bridge(FakeBackend()) as bridge:
        loud, terminal = FakePeer(), FakePeer()
        session, _ = await open_session(bridge, loud)
        bridge.register(session, terminal)
        bridge.clients.set_terminal_turn_states_only(terminal)
        assert bridge.clients.turn_states(terminal), "it takes turn states (replays keep the terminal ones)"
        for words in ("hi", "there"):
            ticket = admit_ticket(bridge, session.session_id, text_blocks(words), peer=loud)
            await prompt_outcome(bridge, ticket)
        loud_states = [m["params"] for m in _lines(loud) if m["method"] == "_acp_server/turn_state"]
        got = [m["params"] for m in _lines(terminal) if m["method"] == "_acp_server/turn_state"]
        assert [t["state"] for t in loud_states] == ["accepted", "running", "completed"] * 2
        assert [t["state"] for t in got] == ["completed", "completed"]
        assert [t["_meta"]["eventId"] for t in got] == [t["_meta"]["eventId"] for t in loud_states if t["state"] == "completed"]
        late = FakePeer()
        bridge.clients.set_terminal_turn_states_only(late)
        await bridge.replay(session, late, 0)
        assert [m["params"]["state"] for m in _lines(late) if m["method"] == "_acp_server/turn_state"] == ["completed"] * 2


class _Rounds:
    """A persistence stand-in for :class:`CommitFanOut`: rounds committed when the test says."""

    durable = True
    committed = 0

    def __init__(self) -> None:
        self.generation = 0
        self.callbacks: list[Callable[[], None]] = []

    def add_event(self, session_id: str, event_id: int, update: Any, method: str | None = None) -> None:
        pass

    def after_round(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

    def commit(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        self.generation += 1
        for callback in callbacks:
            callback()


class _BrokenPeer(FakePeer):
    def send(self, data: bytes) -> None:
        raise RuntimeError("broken")


async def test_commit_fanout_holds_sends_until_the_round_commits_and_joins_them() -> None:
    rounds = _Rounds()
    clients = ClientRegistry()
    fanout = CommitFanOut(clients, rounds)  # type: ignore[arg-type]
    a, b = FakePeer(), FakePeer()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    clients.attach(session, a)
    clients.attach(session, b)
    fanout.send(session, b"one\n", None)
    fanout.send(session, b"two\n", None)
    fanout.send(session, b"not for b\n", b)
    assert a.sent == [] and b.sent == [] and len(rounds.callbacks) == 1, "one callback per round"
    rounds.commit()
    assert a.sent == [b"one\ntwo\n", b"not for b\n"] and b.sent == [b"one\ntwo\n"]
    fanout.send(session, b"three\n", None)
    assert len(rounds.callbacks) == 1, "a new round after the commit"
    rounds.commit()
    assert a.sent[-1] == b"three\n"


async def test_commit_fanout_sends_nothing_when_every_connection_is_excluded() -> None:
    rounds = _Rounds()
    clients = ClientRegistry()
    fanout = CommitFanOut(clients, rounds)  # type: ignore[arg-type]
    only = FakePeer()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    clients.attach(session, only)
    fanout.send(session, b"own text\n", only)
    assert rounds.callbacks == [], "no round is opened for nobody"


async def test_a_failing_send_after_a_commit_is_logged_and_later_entries_go_out(caplog: pytest.LogCaptureFixture) -> None:
    rounds = _Rounds()
    clients = ClientRegistry()
    fanout = CommitFanOut(clients, rounds)  # type: ignore[arg-type]
    broken, fine = _BrokenPeer(), FakePeer()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    clients.attach(session, broken)
    fanout.send(session, b"first\n", None)
    clients.detach(session, broken)
    clients.attach(session, fine)
    fanout.send(session, b"second\n", None)
    with caplog.at_level(logging.ERROR, logger="acp_server.bridge"):
        rounds.commit()
    assert "after a store commit" in caplog.text
    assert fine.sent == [b"second\n"]


async def test_the_ephemeral_fanout_records_nothing() -> None:
    """Without a store the fan-out sends at once, and the null persistence has nothing to commit."""
    persistence = NullPersistence()
    assert persistence.committed == 0 and not persistence.durable
    async with running_bridge(FakeBackend()) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        bridge.fanout.emit(session, AgentMessageChunk(content=TextContent(text="now")), None)
        assert len(peer.sent) == 1, "sent at once"
        await trio.testing.wait_all_tasks_blocked()


class _JoiningPeer(FakePeer):
    """A connection whose one send may carry several lines (as an NDJSON connection's queue)."""

    joins_lines = True


async def test_a_joining_connection_gets_accepted_and_running_in_one_send() -> None:
    """A prompt that starts in the step that admits it sends ``accepted`` and ``running`` in one send to
    a connection that takes joined lines, in two to one that does not: the same lines, in the same order."""
    sent: dict[str, list[bytes]] = {}
    for name, peer in (("joined", _JoiningPeer()), ("apart", FakePeer())):
        bridge = SessionBridge(EchoBackend())  # its turn starts and ends in the admitting step
        async with trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            session, _ = await open_session(bridge, peer)
            ticket = admit_ticket(bridge, session.session_id, text_blocks("hello"), peer=peer)
            assert ticket.answered and ticket.result is not None and ticket.result.stop_reason == "end_turn"
            sent[name] = peer.sent
            nursery.cancel_scope.cancel()
    assert [len(data.splitlines()) for data in sent["joined"]] == [2, 1, 1]
    assert [len(data.splitlines()) for data in sent["apart"]] == [1, 1, 1, 1]

    def shape(data: list[bytes]) -> list[tuple[str, Any]]:
        out = []
        for line in b"".join(data).splitlines():
            params = json.loads(line)["params"]
            out.append((params.get("state") or params["update"]["sessionUpdate"], params["_meta"]["eventId"]))
        return out

    assert shape(sent["joined"]) == shape(sent["apart"]) == [
        ("accepted", 1), ("running", 2), ("agent_message_chunk", 4), ("completed", 5),
    ]
