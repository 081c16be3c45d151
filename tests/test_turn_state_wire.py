"""``_acp_server/turn_state`` on the wire: the bridge builds it as text on the hot path, so check that
what it sends is exactly what the wire type :class:`TurnStateParams` encodes, escaping included."""

from __future__ import annotations

import msgspec
import pytest
import trio

from acp_server.admission import Limits
from acp_server.store import TURN_STATE, StoredEvent
from acp_server.types.ext import TurnStateBody, TurnStateParams

from .fakes import FakeBackend, send_prompt, serving
from .helpers import RpcError, connect, running_server


async def test_turn_state_text_matches_the_wire_type_and_escapes_the_reason() -> None:
    backend = FakeBackend()
    backend.hold("held")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        other = await connect(server, nursery)
        sid, _ = await client.new_session()
        await other.call("session/resume", {"sessionId": sid, "cwd": "/tmp"})
        pending = await send_prompt(client, nursery, sid, "held")
        await backend.started("held")
        ticket = server.bridge.sessions[sid].fifo[0]
        odd = 'a "quoted" \\ reason\n with é and \u2028'
        server.bridge.fanout.turn_state(ticket, "queued", reason=odd, position=3)
        server.bridge.fanout.turn_state(ticket, "failed", reason=odd)  # terminal: kept in the history too
        with trio.fail_after(5):
            while len(mine := [t for t in other.turn_states if t.get("reason") == odd]) < 2:
                await other.notified.wait()
        queued, failed = mine
        for got, state in ((queued, "queued"), (failed, "failed")):
            typed = msgspec.convert(got, TurnStateParams)
            assert typed.session_id == sid and typed.prompt_id == ticket.prompt_id
            assert typed.state == state and typed.reason == odd
            # the same bytes the wire type encodes, field for field
            assert msgspec.json.decode(msgspec.json.encode(typed)) == got
        assert queued["positionHint"] == 3 and "positionHint" not in failed
        assert failed["_meta"]["eventId"] == queued["_meta"]["eventId"] + 1
        event_id, stored = server.bridge.sessions[sid].history[-1]
        assert isinstance(stored, StoredEvent) and stored.method == TURN_STATE
        assert event_id == failed["_meta"]["eventId"]
        body = msgspec.json.decode(stored.body, type=TurnStateBody)
        assert (body.prompt_id, body.state, body.reason, body.at) == (ticket.prompt_id, "failed", odd, failed["at"])
        backend.release("held")
        with trio.fail_after(5):
            await pending.wait()


async def test_a_connection_may_opt_out_of_turn_states() -> None:
    """``initialize`` ``_meta.turnStates: false``: that connection gets no turn state, live or replayed;
    the others still do; a non-boolean is invalid_params naming the key."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        quiet = await connect(server, nursery, initialize=False)
        with pytest.raises(RpcError) as info:
            await quiet.call("initialize", {"protocolVersion": 1, "_meta": {"turnStates": "no"}})
        assert info.value.kind == "invalid_params" and info.value.data["path"] == "_meta.turnStates"
        await quiet.call("initialize", {"protocolVersion": 1, "_meta": {"turnStates": False}})
        loud = await connect(server, nursery)
        sid, _ = await quiet.new_session()
        await loud.call("session/resume", {"sessionId": sid, "cwd": "/tmp"})
        assert (await quiet.prompt(sid, "hello"))["stopReason"] == "end_turn"
        await quiet.call("_acp_server/stats")
        await loud.call("_acp_server/stats")
        assert quiet.turn_states == [] and quiet.updates(sid)
        assert [t["state"] for t in loud.turn_states] == ["accepted", "running", "completed"]
        # a replay skips them too (the completed state is in the transcript)
        await quiet.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        assert quiet.turn_states == []
        later = await connect(server, nursery)
        await later.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        assert [t["state"] for t in later.turn_states] == ["completed"]


async def test_only_a_connection_that_asks_gets_turn_states_by_default() -> None:
    """Turn states are an extension: an ``initialize`` without ``_meta.turnStates`` gets none, live or
    replayed (``session/load``), while one that asks gets all three and the replayed terminal one; the
    server's ``turn_states`` (``--turn-states on``) gives them to the silent ones, and ``false`` still
    wins for a connection that says so."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        assert server.turn_states is False
        silent = await connect(server, nursery, initialize=False)
        await silent.initialize(turn_states=None)
        asker = await connect(server, nursery)  # the test client asks (_meta.turnStates: true)
        sid, _ = await silent.new_session()
        await asker.call("session/resume", {"sessionId": sid, "cwd": "/tmp"})
        assert (await silent.prompt(sid, "hello"))["stopReason"] == "end_turn"
        await silent.call("_acp_server/stats")  # every notification before these answers has arrived
        await asker.call("_acp_server/stats")
        assert silent.turn_states == [] and silent.agent_text(sid) == "hello"
        assert [t["state"] for t in asker.turn_states] == ["accepted", "running", "completed"]
        load = {"sessionId": sid, "cwd": "/tmp", "mcpServers": []}
        replayed_silent = await connect(server, nursery, initialize=False)
        await replayed_silent.initialize(turn_states=None)
        await replayed_silent.call("session/load", load)
        assert replayed_silent.turn_states == [] and replayed_silent.agent_text(sid) == "hello"
        replayed_asker = await connect(server, nursery)
        await replayed_asker.call("session/load", load)
        assert [t["state"] for t in replayed_asker.turn_states] == ["completed"]

        server.turn_states = True  # what --turn-states on / turn_states = true set
        loud = await connect(server, nursery, initialize=False)
        await loud.initialize(turn_states=None)
        quiet = await connect(server, nursery, initialize=False)
        await quiet.initialize(turn_states=False)
        for peer in (loud, quiet):
            await peer.call("session/load", load)
        assert [t["state"] for t in loud.turn_states] == ["completed"] and quiet.turn_states == []
        assert (await loud.prompt(sid, "again"))["stopReason"] == "end_turn"
        await loud.call("_acp_server/stats")
        await quiet.call("_acp_server/stats")
        assert [t["state"] for t in loud.turn_states] == ["completed", "accepted", "running", "completed"]
        assert quiet.turn_states == [] and quiet.agent_text(sid) == "helloagain"
        # the connections initialized before keep what they were given
        await silent.call("_acp_server/stats")
        assert silent.turn_states == [] and silent.agent_text(sid) == "helloagain"


async def test_live_turn_states_name_the_client_whose_prompt_it_is() -> None:
    """Two connections on one session: every live turn state carries the prompt's client id in
    ``_meta.originatorClientId`` (as its updates do), so each tells its own prompt from the other's;
    a replayed one carries none."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        alice = await connect(server, nursery)
        bob = await connect(server, nursery)
        sid, alice_id = await alice.new_session()
        bob_id = (await bob.call("session/resume", {"sessionId": sid, "cwd": "/tmp"}))["_meta"]["clientId"]
        assert alice_id != bob_id
        first = await alice.prompt(sid, "one")
        second = await bob.prompt(sid, "two")
        await alice.call("_acp_server/stats")  # every notification before this answer has arrived
        for client in (alice, bob):
            seen = [(t["promptId"], t["state"], t["_meta"].get("originatorClientId")) for t in client.turn_states]
            assert seen == [
                (first["_meta"]["promptId"], "accepted", alice_id),
                (first["_meta"]["promptId"], "running", alice_id),
                (first["_meta"]["promptId"], "completed", alice_id),
                (second["_meta"]["promptId"], "accepted", bob_id),
                (second["_meta"]["promptId"], "running", bob_id),
                (second["_meta"]["promptId"], "completed", bob_id),
            ]
            for t in client.turn_states:
                assert msgspec.json.decode(msgspec.json.encode(msgspec.convert(t, TurnStateParams))) == t
        later = await connect(server, nursery)
        await later.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        assert [t["state"] for t in later.turn_states] == ["completed", "completed"]
        assert all("originatorClientId" not in t["_meta"] for t in later.turn_states)


async def test_a_prompt_started_in_its_admitting_step_on_one_connection() -> None:
    """The echo agent's turn runs in the step that admits it (FanOut.start, FanOut.completed): on a
    connection that takes turn states its lines are accepted, running, the update, completed, in that
    order with consecutive event ids but the one of its own text (kept, not sent to its sender), each the
    bytes its wire type encodes; one that takes none gets the update with the same event id; both leave
    the same transcript."""
    from acp_server.backends.echo import EchoBackend

    seen: dict[bool, tuple[list[dict[str, object]], list[dict[str, object]], list[tuple[int, object]]]] = {}
    for asks in (True, False):
        async with running_server(Limits(), EchoBackend()) as (server, nursery):
            client = await connect(server, nursery, initialize=False)
            await client.initialize(turn_states=asks)
            sid, _ = await client.new_session()
            for text in ("hello", "again"):
                assert (await client.prompt(sid, text))["stopReason"] == "end_turn"
            await client.call("_acp_server/stats")  # every notification before this answer has arrived
            seen[asks] = (client.turn_states, client.updates(sid), server.bridge.sessions[sid].history)
    states, updates, history = seen[True]
    assert [t["state"] for t in states] == ["accepted", "running", "completed"] * 2
    for first in (0, 3):
        accepted, running, completed = states[first : first + 3]
        ids = [t["_meta"]["eventId"] for t in (accepted, running, completed)]
        update = updates[first // 3]
        assert ids[1] == ids[0] + 1 and update["_meta"]["eventId"] == ids[0] + 3 and ids[2] == ids[0] + 4
        assert accepted["at"] == running["at"] and completed["reason"] == "end_turn"
        assert len({t["promptId"] for t in (accepted, running, completed)}) == 1
        for got in (accepted, running, completed):
            assert msgspec.json.decode(msgspec.json.encode(msgspec.convert(got, TurnStateParams))) == got
        event_id, stored = next(e for e in history if e[0] == ids[2])
        assert isinstance(stored, StoredEvent) and stored.method == TURN_STATE
        body = msgspec.json.decode(stored.body, type=TurnStateBody)
        assert (body.prompt_id, body.state, body.reason, body.at) == (completed["promptId"], "completed", "end_turn", completed["at"])
        assert msgspec.json.decode(stored.body) == msgspec.json.decode(msgspec.json.encode(body))
    quiet_states, quiet_updates, quiet_history = seen[False]
    assert quiet_states == []
    assert [u["_meta"]["eventId"] for u in quiet_updates] == [u["_meta"]["eventId"] for u in updates]
    assert [e[0] for e in quiet_history] == [e[0] for e in history]
    assert [type(e[1]) for e in quiet_history] == [type(e[1]) for e in history]
