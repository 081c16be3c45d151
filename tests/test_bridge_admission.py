"""Admission of prompts by the session bridge: the pending limit, the order of admission checks, the
per-session FIFO, the single release of each prompt's slot, session/cancel, session/close and
deadlines counted from admission."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from acp_server.admission import Limits
from acp_server.bridge import SessionBridge
from acp_server.errors import (
    RETRY_AFTER_MS,
    InvalidClientIdError,
    InvalidParamsError,
    PromptQueueFullError,
    RequestCancelledError,
    SessionNotFoundError,
)
from acp_server.server import Server

from .fakes import (
    FakeBackend,
    FakePeer,
    Pending,
    admit_ticket,
    open_session,
    prompt_outcome,
    responses_by_id,
    running_bridge,
    send_prompt,
    serving,
    text_blocks,
)
from .helpers import RawClient, RpcError, assert_error_valid, connect

# --- the pending-prompt limit ----------------------------------------------------------------------


async def test_sixth_prompt_refused_then_admitted_after_one_finishes() -> None:
    """With the default limit of 5, a sixth pending prompt is refused with -32001 and the documented,
    schema-valid data; once one prompt finishes, a new one is admitted."""
    backend = FakeBackend()
    backend.hold("p0", "p1", "p2", "p3", "p4", "p5")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        pending = [await send_prompt(client, nursery, sid, f"p{i}") for i in range(5)]
        await wait_all_tasks_blocked()

        with pytest.raises(RpcError) as info:
            await client.prompt(sid, "sixth")
        err = info.value
        assert err.code == -32001
        assert err.data == {
            "errorKind": "prompt_queue_full",
            "sessionId": sid,
            "limit": 5,
            "pendingCount": 5,
            "retryAfterMs": RETRY_AFTER_MS,
        }
        assert RETRY_AFTER_MS > 0
        assert_error_valid(err.error)
        assert "sixth" not in backend.texts_started()

        backend.release("p0")
        assert (await pending[0].wait())["result"]["stopReason"] == "end_turn"
        late = await send_prompt(client, nursery, sid, "p5")
        await wait_all_tasks_blocked()
        assert not late.done.is_set(), "the prompt admitted after p0 finished must be queued, not refused"
        assert server.bridge.sessions[sid].pending_count == 5

        backend.release_all()
        for p in [*pending, late]:
            assert (await p.wait())["result"]["stopReason"] == "end_turn"
        assert backend.texts_started() == ["p0", "p1", "p2", "p3", "p4", "p5"]
        assert server.bridge.sessions[sid].pending_count == 0


async def test_limit_zero_admits_100_concurrent_prompts_and_advertises_null() -> None:
    """``max_pending_prompts_per_session=0`` disables the limit: 100 concurrent prompts are all
    admitted, and both capabilities and initialize advertise ``null``."""
    backend = FakeBackend()
    backend.hold("held")
    async with serving(Limits(max_pending_prompts_per_session=0), backend) as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        init = await client.initialize()
        assert init["agentCapabilities"]["_meta"]["limits"]["maxPendingPromptsPerSession"] is None
        caps = await client.call("_acp_server/capabilities")
        assert caps["limits"]["maxPendingPromptsPerSession"] is None

        sid, _ = await client.new_session()
        pending = [await send_prompt(client, nursery, sid, "held") for _ in range(100)]
        await wait_all_tasks_blocked()
        stats = (await client.call("_acp_server/stats"))["bridge"]
        assert stats["pendingPrompts"] == 100
        assert stats["refusedTotal"] == 0
        assert not any(p.done.is_set() for p in pending)

        backend.release("held")
        for p in pending:
            assert (await p.wait())["result"]["stopReason"] == "end_turn"
        assert len(backend.calls) == 100
        assert server.bridge.sessions[sid].pending_count == 0


async def test_default_limit_is_advertised_as_five() -> None:
    """The default limit is 5 in both places it is advertised."""
    async with serving() as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        init = await client.initialize()
        assert init["agentCapabilities"]["_meta"]["limits"]["maxPendingPromptsPerSession"] == 5
        assert (await client.call("_acp_server/capabilities"))["limits"]["maxPendingPromptsPerSession"] == 5


@pytest.mark.parametrize("bad", [-1, 1.5, math.nan, "5", True, 5.0])
def test_invalid_limit_fails_boot(bad: Any) -> None:
    """A limit that is not a non-negative integer fails construction, naming the setting."""
    with pytest.raises((ValueError, TypeError), match="max_pending_prompts_per_session"):
        SessionBridge(FakeBackend(), max_pending_prompts_per_session=bad)
    with pytest.raises((ValueError, TypeError), match="max_pending_prompts_per_session"):
        Limits(max_pending_prompts_per_session=bad)


def test_valid_limit_override() -> None:
    """The keyword override replaces the limit of ``limits`` and keeps its other fields."""
    bridge = SessionBridge(FakeBackend(), Limits(prompt_deadline_ms=7), max_pending_prompts_per_session=0)
    assert bridge.limits.max_pending_prompts_per_session == 0
    assert bridge.limits.prompt_deadline_ms == 7


# --- the order of admission checks -----------------------------------------------------------------


def _trace(bridge: SessionBridge, peer: FakePeer, backend: FakeBackend) -> tuple[Any, ...]:
    """Everything an admission could leave behind."""
    stats = bridge.statistics()
    return (
        tuple((s.session_id, s.pending_count, len(s.fifo), len(s.history), s.next_event_id) for s in bridge.sessions.values()),
        len(peer.sent),
        len(backend.calls),
        stats.admitted_total,
        stats.settled_total,
    )


async def test_admission_checks_run_in_documented_order() -> None:
    """Session lookup, then client id, then an earlier cancel, then the limit: each refusal is the
    first check that fails, and none of them leaves a trace."""
    backend = FakeBackend()
    backend.hold("running")
    async with running_bridge(backend, Limits(max_pending_prompts_per_session=1)) as bridge:
        peer, other = FakePeer(), FakePeer()
        session, client_id = await open_session(bridge, peer)
        bridge.register(session, other)
        sid = session.session_id
        admit_ticket(bridge, sid, text_blocks("running"), peer=peer)
        await backend.started("running")
        trace = _trace(bridge, peer, backend)
        refused = bridge.statistics().refused_total

        def admit(session_id: str, client: str | None, cancelled: bool) -> None:
            admit_ticket(bridge, session_id, text_blocks("refused"), peer=peer, client_id=client, cancelled=cancelled)

        with pytest.raises(SessionNotFoundError) as nf:
            admit("sess_missing", "client_forged", True)
        assert nf.value.payload.session_id == "sess_missing"
        with pytest.raises(InvalidClientIdError) as bad:
            admit(sid, "client_forged", True)
        assert bad.value.payload.client_id == "client_forged"
        with pytest.raises(RequestCancelledError):
            admit(sid, client_id, True)
        assert bridge.statistics().refused_total == refused
        with pytest.raises(PromptQueueFullError) as full:
            admit(sid, client_id, False)
        assert (full.value.payload.limit, full.value.payload.pending_count) == (1, 1)
        assert bridge.statistics().refused_total == refused + 1

        await wait_all_tasks_blocked()
        assert _trace(bridge, peer, backend) == trace
        assert all(b"refused" not in data for data in other.sent)
        assert "refused" not in backend.texts_started()
        backend.release_all()


async def test_cancelled_prompt_takes_no_slot() -> None:
    """A prompt cancelled before admission gets -32800 without counting: the slot stays free."""
    backend = FakeBackend()
    async with running_bridge(backend, Limits(max_pending_prompts_per_session=1)) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        with pytest.raises(RequestCancelledError):
            admit_ticket(bridge, session.session_id, text_blocks("x"), peer=peer, cancelled=True)
        assert session.pending_count == 0
        ticket = admit_ticket(bridge, session.session_id, text_blocks("y"), peer=peer)
        assert (await prompt_outcome(bridge, ticket)).stop_reason == "end_turn"
        assert backend.texts_started() == ["y"]


@pytest.mark.parametrize(
    ("target", "meta", "kind", "code"),
    [
        ("missing", None, "session_not_found", -32002),
        ("own", {"clientId": "client_forged"}, "invalid_client_id", -32003),
        ("own", None, "request_cancelled", -32800),
    ],
)
async def test_cancelled_before_start_over_the_wire(target: str, meta: dict[str, Any] | None, kind: str, code: int) -> None:
    """A prompt cancelled by ``$/cancel_request`` while waiting for a free request slot of its
    connection still goes through the admission order: a wrong session or client id wins over the
    cancel, and a cancelled prompt never reaches the backend nor takes a pending slot."""
    backend = FakeBackend()
    backend.hold("blocker")
    limits = Limits(max_inflight_requests=1)
    async with serving(limits, backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        blocker = await send_prompt(client, nursery, sid, "blocker")
        await backend.started("blocker")
        session_id = sid if target == "own" else "sess_missing"
        late = await send_prompt(client, nursery, session_id, "late", id="late", **(meta or {}))
        await client.notify("$/cancel_request", {"requestId": "late"})
        await wait_all_tasks_blocked()
        assert not late.done.is_set(), "the late request waits for the connection's only request slot"
        backend.release("blocker")
        assert (await blocker.wait())["result"]["stopReason"] == "end_turn"
        err = (await late.wait())["error"]
        assert (err["code"], err["data"]["errorKind"]) == (code, kind)
        assert backend.texts_started() == ["blocker"]
        stats = server.bridge.statistics()
        assert (stats.admitted_total, stats.settled_total, stats.pending_prompts) == (1, 1, 0)


async def test_refused_prompt_leaves_no_trace() -> None:
    """A prompt refused for a full queue starts no turn, sends no update to any connection and adds
    nothing to the session's history."""
    backend = FakeBackend()
    backend.hold("running")
    async with serving(Limits(max_pending_prompts_per_session=1), backend) as (server, nursery):
        owner = await connect(server, nursery)
        sid, owner_id = await owner.new_session()
        watcher = await connect(server, nursery)
        running = await send_prompt(owner, nursery, sid, "running")
        await backend.started("running")
        session = server.bridge.sessions[sid]
        history = list(session.history)
        seen = (len(owner.notifications), len(watcher.notifications))

        with pytest.raises(RpcError) as info:
            await watcher.prompt(sid, "refused")
        assert info.value.kind == "prompt_queue_full"
        with pytest.raises(RpcError):
            await owner.prompt(sid, "refused", clientId=owner_id)
        await wait_all_tasks_blocked()

        assert session.history == history
        assert (len(owner.notifications), len(watcher.notifications)) == seen
        assert backend.texts_started() == ["running"]
        assert session.pending_count == 1
        backend.release("running")
        assert (await running.wait())["result"]["stopReason"] == "end_turn"


# --- the FIFO --------------------------------------------------------------------------------------


async def test_fifo_is_strict_and_failures_stay_their_own() -> None:
    """Prompts of one session start and end strictly one after another, in arrival order; a prompt
    that fails (an error or a crash of the backend) does not affect the next."""
    backend = FakeBackend()
    backend.hold("p0")
    backend.fail("p1", InvalidParamsError(path="prompt[0]", detail="scripted refusal"))
    backend.crash("p3")
    texts = ["p0", "p1", "p2 has a few words", "p3", "p4", "p5"]
    async with serving(Limits(max_pending_prompts_per_session=0), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        pending = [await send_prompt(client, nursery, sid, t) for t in texts]
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["p0"]
        backend.release_all()
        responses = [await p.wait() for p in pending]

        assert responses[0]["result"]["stopReason"] == "end_turn"
        assert responses[1]["error"]["code"] == -32602
        assert responses[1]["error"]["data"]["path"] == "prompt[0]"
        assert responses[2]["result"]["stopReason"] == "end_turn"
        assert responses[3]["error"]["code"] == -32603
        assert responses[3]["error"]["data"] == {"errorKind": "internal"}
        assert [r["result"]["stopReason"] for r in responses[4:]] == ["end_turn", "end_turn"]

        expected: list[tuple[str, str]] = []
        for text in texts:
            expected += [("start", text), ("end", text)]
        assert backend.order == expected
        assert client.agent_text(sid) == "p2 has a few wordsp4p5"
        assert server.bridge.sessions[sid].pending_count == 0


async def test_sessions_run_in_parallel() -> None:
    """Prompts of different sessions do not wait for each other."""
    backend = FakeBackend()
    backend.hold("a", "b")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid_a, _ = await client.new_session()
        sid_b, _ = await client.new_session()
        pa = await send_prompt(client, nursery, sid_a, "a")
        pb = await send_prompt(client, nursery, sid_b, "b")
        await wait_all_tasks_blocked()
        assert sorted(c.text for c in backend.running) == ["a", "b"]
        backend.release("b")
        assert (await pb.wait())["result"]["stopReason"] == "end_turn"
        assert not pa.done.is_set()
        backend.release("a")
        assert (await pa.wait())["result"]["stopReason"] == "end_turn"


# --- one release of the slot per outcome -----------------------------------------------------------

LIMIT = 2


class _Case:
    """What a slot-release scenario has at hand."""

    def __init__(
        self, server: Server, nursery: trio.Nursery, client: RawClient, sid: str, backend: FakeBackend, clock: trio.testing.MockClock
    ) -> None:
        self.server = server
        self.nursery = nursery
        self.client = client
        self.sid = sid
        self.backend = backend
        self.clock = clock

    async def prompt(self, text: str, **meta: Any) -> Pending:
        return await send_prompt(self.client, self.nursery, self.sid, text, id=text, **meta)


async def _success(case: _Case) -> None:
    assert (await (await case.prompt("x")).wait())["result"]["stopReason"] == "end_turn"


async def _error(case: _Case) -> None:
    case.backend.fail("x", InvalidParamsError(path="prompt", detail="scripted"))
    assert (await (await case.prompt("x")).wait())["error"]["code"] == -32602


async def _crash(case: _Case) -> None:
    case.backend.crash("x")
    assert (await (await case.prompt("x")).wait())["error"]["code"] == -32603


async def _cancel_request_running(case: _Case) -> None:
    case.backend.hold("x")
    pending = await case.prompt("x")
    await case.backend.started("x")
    await case.client.notify("$/cancel_request", {"requestId": "x"})
    assert (await pending.wait())["error"]["code"] == -32800
    await wait_all_tasks_blocked()
    assert case.backend.calls_of("x")[0].outcome == "cancelled"


async def _cancel_request_queued(case: _Case) -> None:
    case.backend.hold("first", "x")
    first = await case.prompt("first")
    pending = await case.prompt("x")
    await wait_all_tasks_blocked()
    await case.client.notify("$/cancel_request", {"requestId": "x"})
    assert (await pending.wait())["error"]["code"] == -32800
    assert case.server.bridge.sessions[case.sid].pending_count == 1
    case.backend.release("first")
    assert (await first.wait())["result"]["stopReason"] == "end_turn"
    assert case.backend.texts_started() == ["first"]


async def _session_cancel(case: _Case) -> None:
    case.backend.hold("first", "x")
    first = await case.prompt("first")
    pending = await case.prompt("x")
    await case.backend.started("first")
    await case.client.notify("session/cancel", {"sessionId": case.sid})
    assert (await first.wait())["result"]["stopReason"] == "cancelled"
    assert (await pending.wait())["result"]["stopReason"] == "cancelled"
    assert case.backend.texts_started() == ["first"]


async def _deadline(case: _Case) -> None:
    case.backend.hold("x")
    pending = await case.prompt("x", deadlineMs=1000)
    await case.backend.started("x")
    case.clock.jump(1.0)
    err = (await pending.wait())["error"]
    assert err["code"] == -32004
    assert err["data"]["deadlineMs"] == 1000


async def _connection_lost(case: _Case) -> None:
    # The sender is the only connection attached to its session: its prompts are cancelled.
    case.backend.hold("first", "x")
    sender = await connect(case.server, case.nursery)
    case.sid, _ = await sender.new_session()
    await send_prompt(sender, case.nursery, case.sid, "first")
    await send_prompt(sender, case.nursery, case.sid, "x")
    await wait_all_tasks_blocked()
    assert case.backend.texts_started() == ["first"]
    assert case.server.bridge.sessions[case.sid].pending_count == 2
    await sender.stream.aclose()
    await wait_all_tasks_blocked()
    assert case.backend.calls_of("first")[0].outcome == "cancelled"
    assert case.backend.texts_started() == ["first"]


async def _backend_ignores_cancel(case: _Case) -> None:
    case.backend.ignore_cancel("x")
    pending = await case.prompt("x")
    await case.backend.started("x")
    await case.client.notify("session/cancel", {"sessionId": case.sid})
    assert (await pending.wait())["result"]["stopReason"] == "cancelled"
    assert case.server.bridge.sessions[case.sid].pending_count == 0
    case.backend.release("x")


OUTCOMES: dict[str, Callable[[_Case], Awaitable[None]]] = {
    "success": _success,
    "error": _error,
    "crash": _crash,
    "cancel_request_running": _cancel_request_running,
    "cancel_request_queued": _cancel_request_queued,
    "session_cancel_running_and_queued": _session_cancel,
    "deadline": _deadline,
    "connection_lost": _connection_lost,
    "backend_ignores_cancel": _backend_ignores_cancel,
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
async def test_slot_released_exactly_once(outcome: str, mock_clock: trio.testing.MockClock) -> None:
    """Whatever ends a prompt, its pending slot is released once: the count returns to 0, every
    admitted prompt is settled once, and the session again takes exactly ``limit`` prompts."""
    backend = FakeBackend()
    async with serving(Limits(max_pending_prompts_per_session=LIMIT), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        case = _Case(server, nursery, client, sid, backend, mock_clock)
        await OUTCOMES[outcome](case)
        await wait_all_tasks_blocked()
        bridge = server.bridge
        session = bridge.sessions[case.sid]
        assert session.pending_count == 0
        stats = bridge.statistics()
        assert stats.settled_total == stats.admitted_total > 0

        # The capacity is all back, and no more than that.
        backend.hold("refill")
        refill = [await send_prompt(client, nursery, case.sid, "refill") for _ in range(LIMIT)]
        await wait_all_tasks_blocked()
        with pytest.raises(RpcError) as info:
            await client.prompt(case.sid, "one too many")
        assert info.value.data["pendingCount"] == LIMIT
        backend.release("refill")
        for p in refill:
            assert (await p.wait())["result"]["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert session.pending_count == 0
        stats = bridge.statistics()
        assert stats.settled_total == stats.admitted_total
        assert all(len(r) == 1 for r in responses_by_id(client).values())


async def test_lost_sender_prompt_runs_on_for_other_connections() -> None:
    """When the sender's connection is lost but another live connection is attached, the prompt runs
    on, the other connection gets its updates, and its slot is released once when it ends."""
    backend = FakeBackend()
    backend.hold("shared work")
    async with serving(Limits(), backend) as (server, nursery):
        sender = await connect(server, nursery)
        sid, _ = await sender.new_session()
        watcher = await connect(server, nursery)
        # The watcher is attached by a prompt of its own first.
        assert (await watcher.prompt(sid, "hi"))["stopReason"] == "end_turn"
        await send_prompt(sender, nursery, sid, "shared work")
        await backend.started("shared work")
        await sender.stream.aclose()
        await wait_all_tasks_blocked()
        session = server.bridge.sessions[sid]
        assert session.pending_count == 1
        assert backend.calls_of("shared work")[0].outcome is None
        backend.release("shared work")
        await wait_all_tasks_blocked()
        assert session.pending_count == 0
        stats = server.bridge.statistics()
        assert stats.settled_total == stats.admitted_total == 2
        assert any(
            u["update"]["sessionUpdate"] == "user_message_chunk" and u["update"]["content"]["text"] == "shared work"
            for u in watcher.updates(sid)
        )


async def test_prompt_running_on_without_its_caller_still_expires(autojump_clock: trio.testing.MockClock) -> None:
    """A queued prompt whose sender left, and which runs on for another attached connection, still
    has its deadline enforced from admission: it does not hold its slot past the deadline."""
    backend = FakeBackend()
    backend.hold("first")
    async with serving(Limits(max_pending_prompts_per_session=2), backend) as (server, nursery):
        sender = await connect(server, nursery)
        sid, _ = await sender.new_session()
        watcher = await connect(server, nursery)
        assert (await watcher.prompt(sid, "attach"))["stopReason"] == "end_turn"
        t0 = trio.current_time()
        await send_prompt(sender, nursery, sid, "first")
        await send_prompt(sender, nursery, sid, "second", deadlineMs=1000)
        await backend.started("first")
        await sender.stream.aclose()
        await wait_all_tasks_blocked()
        session = server.bridge.sessions[sid]
        assert session.pending_count == 2, "both run on for the watcher"

        await trio.sleep(1.5)
        assert session.pending_count == 1, "the second prompt's deadline passed while it was queued"
        ticket = next(t for t in session.fifo if getattr(t, "prompt", None) and t.prompt[0].text == "second")
        assert ticket.error is not None and ticket.error.kind == "prompt_deadline_exceeded"
        assert ticket.error.payload.elapsed_ms == pytest.approx(1000, abs=20)
        assert trio.current_time() - t0 < 1.6
        backend.release("first")
        await wait_all_tasks_blocked()
        assert session.pending_count == 0
        assert backend.texts_started() == ["attach", "first"]


# --- session/cancel and session/close --------------------------------------------------------------


async def test_session_cancel_ends_running_and_queued_prompts_of_every_sender() -> None:
    """``session/cancel`` ends the running prompt and every queued one of that session with
    ``stopReason: "cancelled"`` (not errors), whichever connection sent them; other sessions go on."""
    backend = FakeBackend()
    backend.hold("a1", "b1", "a2", "other")
    async with serving(Limits(), backend) as (server, nursery):
        a = await connect(server, nursery)
        b = await connect(server, nursery)
        sid, _ = await a.new_session()
        other_sid, _ = await b.new_session()
        a1 = await send_prompt(a, nursery, sid, "a1")
        b1 = await send_prompt(b, nursery, sid, "b1")
        a2 = await send_prompt(a, nursery, sid, "a2")
        other = await send_prompt(b, nursery, other_sid, "other")
        await backend.started("a1")
        await backend.started("other")

        await b.notify("session/cancel", {"sessionId": sid})
        for p in (a1, b1, a2):
            assert (await p.wait())["result"]["stopReason"] == "cancelled"
        await wait_all_tasks_blocked()
        assert backend.calls_of("a1")[0].outcome == "cancelled"
        assert sorted(backend.texts_started()) == ["a1", "other"]
        assert not other.done.is_set()
        assert server.bridge.sessions[other_sid].pending_count == 1
        assert server.bridge.sessions[sid].pending_count == 0

        backend.release("other")
        assert (await other.wait())["result"]["stopReason"] == "end_turn"
        assert (await a.prompt(sid, "after"))["stopReason"] == "end_turn"


async def test_session_close_cancels_prompts_and_forgets_the_session() -> None:
    """``session/close`` ends the running and queued prompts with ``cancelled``; later requests on
    the session get ``session_not_found``."""
    backend = FakeBackend()
    backend.hold("running", "queued")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session()
        running = await send_prompt(client, nursery, sid, "running")
        queued = await send_prompt(client, nursery, sid, "queued")
        await backend.started("running")
        assert await client.call("session/close", {"sessionId": sid}) == {}
        assert (await running.wait())["result"]["stopReason"] == "cancelled"
        assert (await queued.wait())["result"]["stopReason"] == "cancelled"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["running"]
        assert backend.calls_of("running")[0].outcome == "cancelled"

        for method, params in [
            ("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "late"}]}),
            ("_acp_server/heartbeat", {"sessionId": sid, "_meta": {"clientId": client_id}}),
            ("_acp_server/fork", {"sessionId": sid}),
            ("session/close", {"sessionId": sid}),
        ]:
            with pytest.raises(RpcError) as info:
                await client.call(method, params)
            assert (info.value.code, info.value.data) == (-32002, {"errorKind": "session_not_found", "sessionId": sid})
        await client.notify("session/cancel", {"sessionId": sid})  # ignored, never answered
        assert sid not in server.bridge.sessions
        sessions = (await client.call("session/list", {}))["sessions"]
        assert sid not in [s["sessionId"] for s in sessions]


# --- deadlines -------------------------------------------------------------------------------------


async def test_deadline_counts_from_admission(autojump_clock: trio.testing.MockClock) -> None:
    """A prompt that waited 4 s of its 5 s deadline in the queue runs at most 1 s, then fails with
    ``prompt_deadline_exceeded`` (deadlineMs 5000, elapsedMs about 5000)."""
    backend = FakeBackend()
    backend.delay("first", 4.0)
    backend.hold("second")
    async with serving(Limits(prompt_deadline_ms=5000), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        t0 = trio.current_time()
        first = await send_prompt(client, nursery, sid, "first")
        second = await send_prompt(client, nursery, sid, "second")
        assert (await first.wait())["result"]["stopReason"] == "end_turn"
        err = (await second.wait())["error"]
        assert err["code"] == -32004
        assert err["data"]["errorKind"] == "prompt_deadline_exceeded"
        assert err["data"]["sessionId"] == sid
        assert err["data"]["deadlineMs"] == 5000
        assert 4990 <= err["data"]["elapsedMs"] <= 5050
        assert_error_valid(err)
        await wait_all_tasks_blocked()
        (call,) = backend.calls_of("second")
        assert call.outcome == "cancelled"
        assert call.started_at == pytest.approx(t0 + 4.0, abs=0.01)
        assert call.ended_at is not None and call.ended_at - call.started_at <= 1.0 + 1e-6
        assert server.bridge.sessions[sid].pending_count == 0


@pytest.mark.parametrize(
    ("server_ms", "meta_ms", "effective_ms"),
    [(5000, 1000, 1000), (5000, 10000, 5000), (5000, None, 5000), (0, 2000, 2000)],
)
async def test_meta_deadline_shortens_but_never_extends(
    server_ms: int, meta_ms: int | None, effective_ms: int, autojump_clock: trio.testing.MockClock
) -> None:
    """``_meta.deadlineMs`` may shorten ``--prompt-deadline-ms`` but never extend it."""
    backend = FakeBackend()
    backend.hold("x")
    async with serving(Limits(prompt_deadline_ms=server_ms), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        t0 = trio.current_time()
        meta = {"deadlineMs": meta_ms} if meta_ms is not None else {}
        err = (await (await send_prompt(client, nursery, sid, "x", **meta)).wait())["error"]
        assert err["data"]["errorKind"] == "prompt_deadline_exceeded"
        assert err["data"]["deadlineMs"] == effective_ms
        assert trio.current_time() - t0 == pytest.approx(effective_ms / 1000, abs=0.01)


@pytest.mark.parametrize("bad", [0, -5, "100", 1.5, True])
async def test_invalid_meta_deadline_is_invalid_params(bad: Any) -> None:
    """A ``_meta.deadlineMs`` that is not a positive integer is refused before admission."""
    backend = FakeBackend()
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        with pytest.raises(RpcError) as info:
            await client.prompt(sid, "x", deadlineMs=bad)
        assert info.value.code == -32602
        assert info.value.data["path"] == "_meta.deadlineMs"
        assert backend.calls == []
        assert server.bridge.statistics().admitted_total == 0


@pytest.mark.parametrize("released", [True, False])
async def test_deadline_frees_the_slot_of_a_backend_ignoring_cancel(
    released: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """A backend that ignores the cancel still has its prompt answered and its slot freed at the
    deadline; the next prompt waits for the backend to finish (or for its own deadline), and every
    admitted prompt gets exactly one response."""
    backend = FakeBackend()
    backend.ignore_cancel("stuck")
    limits = Limits(prompt_deadline_ms=5000, max_pending_prompts_per_session=1)
    async with serving(limits, backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        t0 = trio.current_time()
        stuck = await send_prompt(client, nursery, sid, "stuck")
        err = (await stuck.wait())["error"]
        assert err["data"]["errorKind"] == "prompt_deadline_exceeded"
        assert trio.current_time() - t0 == pytest.approx(5.0, abs=0.01)
        session = server.bridge.sessions[sid]
        assert session.pending_count == 0
        assert backend.calls_of("stuck")[0].outcome is None, "the backend is still running it"

        after = await send_prompt(client, nursery, sid, "after")
        await wait_all_tasks_blocked()
        assert session.pending_count == 1
        if released:
            await trio.sleep(2.0)
            assert backend.texts_started() == ["stuck"]
            backend.release("stuck")
            assert (await after.wait())["result"]["stopReason"] == "end_turn"
            (late,) = backend.calls_of("after")
            stuck_call = backend.calls_of("stuck")[0]
            assert stuck_call.ended_at is not None and late.started_at >= stuck_call.ended_at
        else:
            err = (await after.wait())["error"]
            assert err["data"]["errorKind"] == "prompt_deadline_exceeded"
            assert trio.current_time() - t0 == pytest.approx(10.0, abs=0.01)
            assert backend.texts_started() == ["stuck"]
            backend.release("stuck")
        await wait_all_tasks_blocked()
        assert session.pending_count == 0
        assert session.abandoned is None
        stats = server.bridge.statistics()
        assert stats.settled_total == stats.admitted_total == 2
        by_id = responses_by_id(client)
        assert len(by_id[stuck.id]) == 1 and len(by_id[after.id]) == 1


# --- the session's runner --------------------------------------------------------------------------


async def test_runner_parks_between_prompts_and_ends_once_idle(autojump_clock: trio.testing.MockClock) -> None:
    """A session's runner outlives its empty FIFO: the next prompt runs on the same task (no task per
    busy spell), and a runner left idle for a whole sweep period ends; a later prompt starts a new one."""
    from acp_server.bridge.runner import RUNNER_IDLE_S

    backend = FakeBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        sid = session.session_id
        first = admit_ticket(bridge, sid, text_blocks("one"), peer=peer)
        assert (await prompt_outcome(bridge, first)).stop_reason == "end_turn"
        await wait_all_tasks_blocked()
        runner = session.runner.task
        assert runner is not None and session.runner_active

        second = admit_ticket(bridge, sid, text_blocks("two"), peer=peer)
        assert (await prompt_outcome(bridge, second)).stop_reason == "end_turn"
        await wait_all_tasks_blocked()
        assert session.runner.task is runner, "the parked runner took the next prompt"

        await trio.sleep(RUNNER_IDLE_S / 2)
        assert session.runner.task is runner, "a runner idle for less than a sweep period stays"
        await trio.sleep(2 * RUNNER_IDLE_S)
        await wait_all_tasks_blocked()
        assert not session.runner_active and session.runner.task is None

        third = admit_ticket(bridge, sid, text_blocks("three"), peer=peer)
        assert (await prompt_outcome(bridge, third)).stop_reason == "end_turn"
        await wait_all_tasks_blocked()
        assert session.runner.task is not None and session.runner.task is not runner
        assert backend.texts_started() == ["one", "two", "three"]


async def test_close_ends_the_parked_runner_at_once() -> None:
    """session/close does not leave the closed session's runner parked until a sweep."""
    backend = FakeBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        ticket = admit_ticket(bridge, session.session_id, text_blocks("one"), peer=peer)
        assert (await prompt_outcome(bridge, ticket)).stop_reason == "end_turn"
        await wait_all_tasks_blocked()
        assert session.runner.task is not None
        bridge.close_session(session)
        await wait_all_tasks_blocked()
        assert not session.runner_active and session.runner.task is None


async def test_ticket_done_latch_behaves_like_an_event() -> None:
    """A ticket's ``done`` latch (the ticket itself): set before or after the wait, every waiter wakes,
    once set it stays."""
    from acp_server.backends import EchoBackend
    from acp_server.bridge.session import Session, new_ticket

    session = Session("s", "/", [], EchoBackend(), 0.0, 0)
    early = new_ticket(session, "prompt_1", [], None, None, 0.0, 0)
    assert early.done is early
    early.done.set()
    with trio.testing.assert_checkpoints():
        await early.done.wait()
    late = new_ticket(session, "prompt_2", [], None, None, 0.0, 0)
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await late.done.wait()
        woken.append(n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, 1)
        nursery.start_soon(waiter, 2)
        await wait_all_tasks_blocked()
        assert not late.done.is_set() and woken == []
        late.done.set()
    assert late.done.is_set() and sorted(woken) == [1, 2]
