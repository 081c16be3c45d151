"""With a store, a prompt starts in the step that learns its admission record is committed
(``SessionRunner._committed``): the prompts at a parked runner's FIFO head that can start at once run
there one after the other, and the runner task is not woken for them. What they send and their
answers still wait for the commit of their outcome."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import trio
import trio.testing

from acp_server.backends.base import Turn
from acp_server.backends.echo import EchoBackend
from acp_server.bridge import SessionBridge
from acp_server.bridge.session import PromptTicket
from acp_server.store import SessionStore
from acp_server.types.acp import StopReason, TextContent

from .fakes import FakeBackend, FakePeer, admit_ticket, hang_guard, open_session, prompt_outcome, text_blocks
from .test_runner_start_now import SplitBackend, _methods


class _Steps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


@asynccontextmanager
async def durable_bridge(directory: pathlib.Path, backend: object) -> AsyncIterator[SessionBridge]:
    """A running bridge over ``backend`` whose store lives in ``directory`` (closed on exit)."""
    store = SessionStore(directory)
    stored, seq = store.open()
    bridge = SessionBridge(backend, store=store, stored=stored, prompt_seq=seq)  # type: ignore[arg-type]
    try:
        async with hang_guard(), trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            yield bridge
            nursery.cancel_scope.cancel()
    finally:
        store.close()


class _StartedSplit(SplitBackend):
    """:class:`SplitBackend` that sets :attr:`started` at its first synchronous start."""

    def __init__(self) -> None:
        super().__init__()
        self.started = trio.Event()

    def start_prompt(self, turn: Turn) -> StopReason | Awaitable[StopReason]:
        self.started.set()
        return super().start_prompt(turn)


class _SlowFirstEcho(EchoBackend):
    """The echo agent, but a prompt ``slow`` is not over at its synchronous start (the runner awaits it)."""

    def start_prompt(self, turn: Turn) -> StopReason | Awaitable[StopReason]:
        block = turn.prompt[0]
        if isinstance(block, TextContent) and block.text == "slow":
            return self.prompt(turn)
        return super().start_prompt(turn)


async def test_committed_prompts_run_in_the_commit_step_without_waking_the_runner(tmp_path: pathlib.Path) -> None:
    async with durable_bridge(tmp_path, _SlowFirstEcho()) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        bridge.clients.peers[peer].turn_states = 2  # every turn state (TURN_STATES_ALL)
        first = admit_ticket(bridge, session.session_id, text_blocks("slow"), peer=peer)  # makes a runner
        await prompt_outcome(bridge, first)
        await trio.testing.wait_all_tasks_blocked()
        assert session.runner.parked and not session.fifo
        steps = _Steps("._run")
        trio.lowlevel.add_instrument(steps)
        try:
            tickets = [admit_ticket(bridge, session.session_id, text_blocks(w), peer=peer) for w in ("one", "two")]
            assert not any(t.running for t in tickets)  # their admission records are not committed yet
            results = [await prompt_outcome(bridge, t) for t in tickets]
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert [r.stop_reason for r in results] == ["end_turn", "end_turn"]
        assert steps.steps == 0 and session.runner.parked and not session.fifo
        assert _methods(peer)[4:] == ["accepted", "accepted"] + ["running", "agent_message_chunk", "completed"] * 2


async def test_an_answer_waits_for_the_commit_of_its_outcome(tmp_path: pathlib.Path) -> None:
    async with durable_bridge(tmp_path, EchoBackend()) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        store = bridge.store
        assert store is not None
        record = bridge.settlement._record
        assert record is not None
        at_settle: list[tuple[int, bool]] = []

        def settle(ticket: PromptTicket) -> None:
            record(ticket)  # the outcome record is queued: the op it got, and whether its update left
            at_settle.append((store._op_seq, b"agent_message_chunk" in b"".join(peer.sent)))

        bridge.settlement._record = settle
        ticket = admit_ticket(bridge, session.session_id, text_blocks("one"), peer=peer)
        answered_at: list[int] = []
        bridge.waiter(ticket).subscribe(lambda result, error: answered_at.append(store.committed))
        await prompt_outcome(bridge, ticket)
        ((op, update_sent),) = at_settle
        assert not update_sent and answered_at[0] >= op and b"agent_message_chunk" in b"".join(peer.sent)


async def test_a_call_under_way_after_the_commit_step_goes_to_the_runner(tmp_path: pathlib.Path) -> None:
    backend = _StartedSplit()
    async with durable_bridge(tmp_path, backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        tickets = [admit_ticket(bridge, session.session_id, text_blocks(w), peer=peer) for w in ("one", "two")]
        await backend.started.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert backend.starts == ["one"] and session.fifo == tickets  # the second waits behind the first
        backend.go.set()
        results = [await prompt_outcome(bridge, t) for t in tickets]
        assert [r.stop_reason for r in results] == ["end_turn", "end_turn"]
        assert backend.ends == ["one"] and backend.calls[-1].text == "two"  # the runner's call, in FIFO order


async def test_a_session_without_a_runner_gets_none_for_prompts_that_start_at_once(tmp_path: pathlib.Path) -> None:
    async with durable_bridge(tmp_path, EchoBackend()) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        for words in (("one",), ("two", "three")):
            tickets = [admit_ticket(bridge, session.session_id, text_blocks(w), peer=peer) for w in words]
            results = [await prompt_outcome(bridge, t) for t in tickets]
            assert [r.stop_reason for r in results] == ["end_turn"] * len(words)
            await trio.testing.wait_all_tasks_blocked()
            assert not session.runner_active and session.runner.task is None and not session.fifo


async def test_a_prompt_that_cannot_start_at_once_gets_a_runner_at_its_commit(tmp_path: pathlib.Path) -> None:
    backend = FakeBackend()  # no synchronous start: every call is the runner's
    async with durable_bridge(tmp_path, backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        tickets = [admit_ticket(bridge, session.session_id, text_blocks(w), peer=peer) for w in ("one", "two")]
        assert not session.runner_active  # until the commit
        results = [await prompt_outcome(bridge, t) for t in tickets]
        assert [r.stop_reason for r in results] == ["end_turn", "end_turn"]
        assert backend.texts_started() == ["one", "two"] and session.runner_active
