"""A prompt that nothing precedes starts in the step that admits it (``SessionRunner._start_now``):
the backend's synchronous start (``start_prompt``) runs there, a turn it ends settles at once, and one
still under way is awaited by the session's runner, cancellable and in FIFO order."""

from __future__ import annotations

import json
from collections.abc import Awaitable

import trio
import trio.testing

from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.backends.base import Turn
from acp_server.backends.echo import EchoBackend
from acp_server.bridge import SessionBridge
from acp_server.types.acp import AgentMessageChunk, StopReason, TextContent

from .fakes import (
    FakeBackend,
    FakePeer,
    admit_ticket,
    hang_guard,
    open_session,
    prompt_outcome,
    running_bridge,
    text_blocks,
)


class SplitBackend(FakeBackend):
    """A backend whose turn has a synchronous start (it records it and emits one update) and an
    awaited rest that waits for :attr:`go` (or its cancellation)."""

    def __init__(self) -> None:
        super().__init__("split")
        self.starts: list[str] = []
        self.ends: list[str] = []
        self.go = trio.Event()

    def start_prompt(self, turn: Turn) -> StopReason | Awaitable[StopReason]:
        text = "".join(b.text for b in turn.prompt if isinstance(b, TextContent))
        self.starts.append(text)
        turn.emit(AgentMessageChunk(content=TextContent(text="started")))
        return self._rest(text)

    async def _rest(self, text: str) -> StopReason:
        try:
            await self.go.wait()
        except trio.Cancelled:
            self.ends.append(f"cancelled {text}")
            raise
        self.ends.append(text)
        return "end_turn"


def _methods(peer: FakePeer) -> list[str]:
    out = []
    for message in peer.messages():
        params = message.get("params", {})
        out.append(params.get("state") or params.get("update", {}).get("sessionUpdate") or message.get("method"))
    return out


async def test_an_echo_turn_on_an_idle_session_ends_in_the_admitting_step() -> None:
    bridge = SessionBridge(EchoBackend())
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        bridge.clients.peers[peer].turn_states = 2  # every turn state (TURN_STATES_ALL)
        for word in ("one", "two"):
            ticket = admit_ticket(bridge, session.session_id, text_blocks(word), peer=peer)
            # no checkpoint since admit: no runner ran, and none was started
            assert ticket.settled and ticket.result is not None and ticket.result.stop_reason == "end_turn"
            assert not session.fifo and session.pending_count == 0 and not session.runner_active
        assert _methods(peer) == ["accepted", "running", "agent_message_chunk", "completed"] * 2
        texts = [json.loads(d)["params"]["update"]["content"]["text"] for d in peer.sent if b"agent_message_chunk" in d]
        assert texts == ["one", "two"]
        nursery.cancel_scope.cancel()


async def test_a_started_turn_is_awaited_by_the_runner_and_the_next_one_waits_for_it() -> None:
    backend = SplitBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        first = admit_ticket(bridge, session.session_id, text_blocks("first"), peer=peer)
        assert backend.starts == ["first"] and first.running and not first.settled  # started, not ended
        second = admit_ticket(bridge, session.session_id, text_blocks("second"), peer=peer)
        assert backend.starts == ["first"], "a prompt behind another is not started at admission"
        await trio.testing.wait_all_tasks_blocked()
        assert not first.settled and backend.ends == []
        backend.go.set()
        assert (await prompt_outcome(bridge, first)).stop_reason == "end_turn"
        assert (await prompt_outcome(bridge, second)).stop_reason == "end_turn"
        assert backend.starts == ["first"] and backend.calls[-1].text == "second"  # the runner's call
        assert backend.ends == ["first"]


async def test_a_turn_cancelled_before_the_runner_takes_it_is_cancelled_and_abandoned() -> None:
    backend = SplitBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        first = admit_ticket(bridge, session.session_id, text_blocks("first"), peer=peer)
        bridge.cancel_session(session.session_id, peer)  # in the same step: the runner has not run
        assert first.settled and first.result is not None and first.result.stop_reason == "cancelled"
        assert session.abandoned is not None and session.fifo == [first]  # the call still ends first
        second = admit_ticket(bridge, session.session_id, text_blocks("second"), peer=peer)
        assert (await prompt_outcome(bridge, second)).stop_reason == "end_turn"
        assert backend.ends == ["cancelled first"] and backend.calls[-1].text == "second"
        assert session.abandoned is None


async def test_a_busy_pool_sends_the_turn_through_the_runner() -> None:
    backend = SplitBackend()
    capacity = CapacityManager({"split": PoolLimits(max_active=1, max_waiting=4)})
    bridge = SessionBridge(backend, capacity=capacity)
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        a_peer, b_peer = FakePeer(), FakePeer()
        a, _ = await open_session(bridge, a_peer)
        b, _ = await open_session(bridge, b_peer)
        bridge.clients.peers[b_peer].turn_states = 2  # every turn state (TURN_STATES_ALL)
        first = admit_ticket(bridge, a.session_id, text_blocks("one"), peer=a_peer)  # holds the one permit
        assert backend.starts == ["one"]
        other = admit_ticket(bridge, b.session_id, text_blocks("two"), peer=b_peer)
        assert backend.starts == ["one"] and not other.running  # no permit: it waits in the runner
        await trio.testing.wait_all_tasks_blocked()
        assert "waiting_for_dependency" in _methods(b_peer)
        backend.go.set()
        assert (await prompt_outcome(bridge, first)).stop_reason == "end_turn"
        assert (await prompt_outcome(bridge, other)).stop_reason == "end_turn"
        assert backend.calls[-1].text == "two"
        nursery.cancel_scope.cancel()
