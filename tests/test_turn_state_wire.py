"""``_acp_server/turn_state`` on the wire: the bridge builds it as text on the hot path, so check that
what it sends is exactly what the wire type :class:`TurnStateParams` encodes, escaping included."""

from __future__ import annotations

import msgspec
import trio

from acp_server.admission import Limits
from acp_server.store import TURN_STATE, StoredEvent
from acp_server.types.ext import TurnStateBody, TurnStateParams

from .fakes import FakeBackend, send_prompt, serving
from .helpers import connect


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
        server.bridge.turn_state(ticket, "queued", reason=odd, position=3)
        server.bridge.turn_state(ticket, "failed", reason=odd)  # terminal: kept in the history too
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
