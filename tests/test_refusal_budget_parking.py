"""The refusal budget's pacing parks only what the peer was told to hold off: a connection in debt keeps
its sessions busy (their room goes to its parked requests at once), its requests on other sessions run
at once, and a session's parked requests start in order, each answered once.

The scope rules are tested without I/O; the shell against the real server over memory streams on
trio's autojump clock, where CPU is free: what a goodput figure measures there is only where the server
sits idle (the cause of the overload scenario's drop with clients that re-send at once).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.errors import CapacityExceededError
from acp_server.server import Server
from acp_server.transports.refusal_budget import (
    DEFAULT_REFUSAL_BUDGET,
    RefusalBudget,
    session_of,
)

from .fakes import FakeBackend
from .test_refusal_budget import budget_server, paced_peer, prompt_msg, queue_full

# --- the scopes, without I/O ----------------------------------------------------------------------


def test_a_session_hold_covers_that_session_only_until_it_ends() -> None:
    budget = RefusalBudget(DEFAULT_REFUSAL_BUDGET, now=0.0)
    budget.charge(queue_full("s1", retry_after_ms=5000), 0.0)
    assert budget.holds_off("s1", 0.1)
    assert not budget.holds_off("s2", 0.1), "another session's requests are not held"
    assert not budget.holds_off(None, 0.1), "nor requests that name no session"
    assert not budget.holds_off("s1", 5.0), "the hold ends after retryAfterMs"


def test_a_kind_hold_covers_every_request_and_no_session_id_can_collide_with_it() -> None:
    budget = RefusalBudget(DEFAULT_REFUSAL_BUDGET, now=0.0)
    refused = CapacityExceededError(
        backend_id="b", session_id="s1", limit=1, active_count=1, waiting_count=0, retry_after_ms=2000
    )
    budget.charge(refused, 0.0)
    assert budget.holds_off("s9", 1.0) and budget.holds_off(None, 1.0)
    assert not budget.holds_off("s9", 2.0) and not budget.holds_off(None, 2.0)
    # a session named as the kind is its own scope
    budget.charge(queue_full("capacity_exceeded", retry_after_ms=1000), 10.0)
    assert budget.holds_off("capacity_exceeded", 10.5)
    assert not budget.holds_off("s9", 10.5)


@pytest.mark.parametrize(
    ("params", "session"),
    [
        (b'{"sessionId":"s1","prompt":[]}', "s1"),
        (b'{"prompt":[],"sessionId":"s2"}', "s2"),
        (b'{"cwd":"/tmp"}', None),
        (b'{"sessionId":7}', None),
        (b"[1,2]", None),
        (b"not json", None),
        (None, None),
    ],
)
def test_session_of_reads_the_params_session_id(params: bytes | None, session: str | None) -> None:
    assert session_of(params) == session


# --- the shell ------------------------------------------------------------------------------------


class LineClient:
    """One connection to ``server`` over a memory stream, speaking JSON lines: requests numbered from 1,
    answers read as whole lines (what ``bench/run.py``'s load generator does over TCP)."""

    def __init__(self, server: Server, nursery: trio.Nursery, name: str) -> None:
        self.stream, server_end = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_stream, server_end, name)
        self._buf = b""
        self._ids = iter(range(1, 1 << 30))

    async def lines(self) -> list[dict[str, Any]]:
        """The complete lines that have arrived, waiting for at least one."""
        while b"\n" not in self._buf:
            data = await self.stream.receive_some(1 << 18)
            assert data, "the server closed the connection"
            self._buf += data
        *complete, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in complete]

    async def call(self, method: str, params: Any) -> Any:
        """Send one request and return its result, skipping other lines."""
        id = next(self._ids)
        await self.stream.send_all(json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode() + b"\n")
        while True:
            for msg in await self.lines():
                if msg.get("id") == id and "method" not in msg:
                    return msg["result"]

    async def open_session(self) -> str:
        return str((await self.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["sessionId"])

    def prompts(self, targets: list[str], text: str = "hello", pending: dict[int, str] | None = None) -> bytes:
        """One prompt line for each session of ``targets``, joined; their ids go into ``pending``."""
        out = []
        for session_id in targets:
            id = next(self._ids)
            if pending is not None:
                pending[id] = session_id
            out.append(json.dumps(prompt_msg(id, session_id, text)).encode() + b"\n")
        return b"".join(out)


async def pipelined_goodput(server: Server, nursery: trio.Nursery, *, sessions: int, depth: int, seconds: float) -> tuple[float, int]:
    """Keep ``depth`` prompts in flight on each of ``sessions`` sessions of one connection for
    ``seconds``, re-sending each refused prompt at once (a client ignoring ``retryAfterMs``); the
    admitted prompts answered per second, and the refusals."""
    client = LineClient(server, nursery, "pipelined")
    await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    session_ids = [await client.open_session() for _ in range(sessions)]
    pending: dict[int, str] = {}
    ok = refused = 0
    started = trio.current_time()
    stop_at = started + seconds
    await client.stream.send_all(client.prompts([s for _ in range(depth) for s in session_ids], pending=pending))
    while trio.current_time() < stop_at:
        again = []
        for msg in await client.lines():
            if "method" in msg:
                continue
            session_id = pending.pop(msg["id"])
            if "result" in msg:
                ok += 1
            else:
                assert msg["error"]["data"]["errorKind"] == "prompt_queue_full"
                refused += 1
            again.append(session_id)
        await client.stream.send_all(client.prompts(again, pending=pending))
    return ok / (trio.current_time() - started), refused


async def test_a_peer_in_debt_keeps_its_sessions_busy(autojump_clock: trio.testing.MockClock) -> None:
    """3x the pending limit in flight, refused prompts re-sent at once, 1 ms turns: the peer goes into
    debt (it is paced) yet its goodput stays that of 1x, because a session's room goes to its parked
    prompts as soon as a turn ends (with the whole connection waiting for the refill, its sessions
    drained and sat idle: 0.29 of 1x in this run)."""
    limits = Limits(max_pending_prompts_per_session=5)
    figures = {}
    with trio.fail_after(60):
        for factor in (1, 3):
            async with budget_server(DEFAULT_REFUSAL_BUDGET, EchoBackend(delay_ms=1), limits) as (server, nursery):
                figures[factor] = await pipelined_goodput(server, nursery, sessions=4, depth=5 * factor, seconds=1.0)
                budget = next(iter(server.connections)).refusal_budget
                if factor == 3:
                    assert budget is not None and budget.in_debt > 0, "the peer was paced"
                    assert server.evictions == 0
    (one, none_refused), (three, refused) = figures[1], figures[3]
    assert none_refused == 0
    # the full bucket, then about rate / ignored_cost refusals a second in debt
    assert refused < DEFAULT_REFUSAL_BUDGET.burst + 100
    assert three >= 0.9 * one, figures


async def test_a_peer_in_debt_runs_its_requests_on_other_sessions_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """In debt after hammering a held session, the peer's re-send there waits for the refill, while its
    prompt on another session (and a request naming none) is answered at once."""
    backend = FakeBackend()
    with trio.fail_after(60):
        async with paced_peer(backend) as paced:
            rude, shell, held_session = paced.client, paced.shell, paced.session_id
            sent = trio.current_time()
            other_session, _ = await rude.new_session()
            id, again = rude.start_request("session/prompt")
            await rude.send(prompt_msg(id, held_session, "again"))
            assert (await rude.prompt(other_session, "elsewhere"))["stopReason"] == "end_turn"
            assert "bridge" in await rude.call("_acp_server/stats")
            assert trio.current_time() == sent, "nothing it sent elsewhere waited for the refill"
            assert shell._parked_count == 1
            later = await again.receive()
            assert later["error"]["data"]["errorKind"] == "prompt_queue_full"
            assert trio.current_time() >= shell.refusal_budget.stamp > sent, "the held re-send waited"  # type: ignore[union-attr]
            assert [c.text for c in backend.calls] == ["held", "elsewhere"]
            backend.release_all()


async def test_parked_requests_of_a_session_start_in_order_each_answered_once(autojump_clock: trio.testing.MockClock) -> None:
    """Three prompts parked on a held session start one by one as the room opens, in the order sent,
    before the refill; each is answered exactly once, in that order."""
    backend = FakeBackend()
    with trio.fail_after(60):
        async with paced_peer(backend) as paced:
            rude, shell, session_id, held_answer = paced.client, paced.shell, paced.session_id, paced.held_answer
            sent = trio.current_time()
            ids = []
            for text in ("p1", "p2", "p3"):
                id, _ = rude.start_request("session/prompt")
                ids.append(id)
                await rude.send(prompt_msg(id, session_id, text))
            await trio.testing.wait_all_tasks_blocked()
            assert shell._parked_count == 3 and shell._resume_at > sent
            backend.release("held")
            assert (await held_answer.receive())["result"]["stopReason"] == "end_turn"
            await trio.testing.wait_all_tasks_blocked()
            assert trio.current_time() == sent, "the room, not the refill, started them"
            answers = [m for m in rude.messages if m.get("id") in ids]
            assert [m["id"] for m in answers] == ids
            assert all(m["result"]["stopReason"] == "end_turn" for m in answers)
            assert [c.text for c in backend.calls] == ["held", "p1", "p2", "p3"]
            assert shell._parked_count == 0


async def test_a_session_cancel_ends_the_sessions_parked_prompts_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """``session/cancel`` of a held session: its running prompt ends ``cancelled`` (the bridge) and the
    prompts parked on it, sent before the cancel, are answered ``stopReason: "cancelled"`` at once, in
    the order sent, without waiting for the refill and without ever running; the peer's parked request
    on the session that is not a prompt keeps its place: the room the cancel opened starts it next."""
    backend = FakeBackend()
    with trio.fail_after(60):
        async with paced_peer(backend) as paced:
            rude, shell, session_id, held_answer = paced.client, paced.shell, paced.session_id, paced.held_answer
            sent = trio.current_time()
            ids = []
            for text in ("p1", "p2"):
                id, _ = rude.start_request("session/prompt")
                ids.append(id)
                await rude.send(prompt_msg(id, session_id, text))
            mode_id, mode_answer = rude.start_request("session/set_mode")
            await rude.send({"jsonrpc": "2.0", "id": mode_id, "method": "session/set_mode", "params": {"sessionId": session_id, "modeId": "default"}})
            await trio.testing.wait_all_tasks_blocked()
            assert shell._parked_count == 3
            await rude.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": session_id}})
            held = await held_answer.receive()
            assert held["result"]["stopReason"] == "cancelled"
            await trio.testing.wait_all_tasks_blocked()
            assert trio.current_time() == sent, "answered at the cancel, not at the refill"
            answers = [m for m in rude.messages if m.get("id") in ids]
            assert [m["id"] for m in answers] == ids
            assert all(m["result"] == {"stopReason": "cancelled"} for m in answers), answers
            mode = await mode_answer.receive()
            assert "result" in mode, mode
            assert trio.current_time() == sent, "the room the cancel opened started the set_mode request"
            order = [m["id"] for m in rude.messages if m.get("id") in (held["id"], *ids, mode_id)]
            assert order == [held["id"], *ids, mode_id], "answered in the order sent"
            await trio.testing.wait_all_tasks_blocked()
            assert [c.text for c in backend.calls] == ["held"], "the cancelled prompts never ran"
            assert len([m for m in rude.messages if m.get("id") in ids]) == 2, "each answered once"
            assert shell._parked_count == 0 and not shell._slots
            assert server_pending(paced) == 0


def server_pending(paced: Any) -> int:
    """The bridge's pending prompts on the paced peer's server."""
    return int(paced.server.bridge.statistics().pending_prompts)


async def test_a_paced_peer_is_refused_in_batches_a_few_times_a_second(autojump_clock: trio.testing.MockClock) -> None:
    """240 re-sends kept in flight on a held session, each re-sent as soon as it is refused (what
    ``bench/run.py``'s hammer does): once its bucket is in debt the peer is refused about
    rate / ignored_cost times a second, in batches that each leave in one scheduling pass, at most
    1 / MIN_PAUSE_S batches a second (one every 20 ms, one refusal each, before batching): its
    neighbours share the server with a few of its wake-ups a second, not fifty."""
    backend = FakeBackend()
    backend.hold("held")
    settings = DEFAULT_REFUSAL_BUDGET
    with trio.fail_after(60):
        async with budget_server(settings, backend) as (server, nursery):
            client = LineClient(server, nursery, "rude")
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            session_id = await client.open_session()
            await client.stream.send_all(client.prompts([session_id], "held"))
            await backend.started("held")
            await client.stream.send_all(client.prompts([session_id] * 240, "again"))
            started = trio.current_time()
            batches: list[tuple[float, int]] = []  # (when, refusals) from one second in: paced
            while trio.current_time() < started + 6:
                refused = [m for m in await client.lines() if "error" in m]
                assert all(m["error"]["data"]["errorKind"] == "prompt_queue_full" for m in refused)
                if trio.current_time() >= started + 1:
                    batches.append((trio.current_time(), len(refused)))
                await client.stream.send_all(client.prompts([session_id] * len(refused), "again"))
            assert server.evictions == 0, "paced, not yet evicted (that takes about ten seconds)"
            seconds = batches[-1][0] - batches[0][0]
            times = {t for t, _ in batches}
            assert len(times) == len(batches), "each batch is written at once"
            assert len(batches) <= 5 * seconds + 1, "five batches a second at the defaults"
            rate = sum(n for _, n in batches[1:]) / seconds
            assert settings.rate_per_s / 5 < rate < settings.rate_per_s / 3
            backend.release_all()
