"""The per-peer refusal budget: a client that re-sends what it was told to hold off is evicted
(``ignored_retry_after``) while its neighbours and polite clients (our SDK) never are.

The bucket itself is tested without I/O; the shell's hook against the real server over memory
streams (rude and polite raw clients, the SDK on trio's autojump clock, a WebSocket peer), and the
flags and config keys through the CLI's own parsing.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import jsonschema
import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import Backend, EchoBackend
from acp_server.cli import _build, _parse, server_config
from acp_server.client import Client, RetryPolicy
from acp_server.client.websocket import open_websocket
from acp_server.errors import (
    EVICTION_REASONS,
    RETRY_AFTER_MS,
    AdmissionDeferredError,
    CapacityExceededError,
    PromptQueueFullError,
    RateLimitedError,
)
from acp_server.server import Server
from acp_server.transports.refusal_budget import (
    DEFAULT_REFUSAL_BUDGET,
    EVICTION_REASON,
    MAX_PAUSE_S,
    MIN_PAUSE_S,
    RefusalBudget,
    RefusalBudgetSettings,
)

from .fakes import FakeBackend
from .helpers import ROOT, SCHEMAS, RawClient, scaled
from .http_helpers import TIMEOUT_S, check_error_body, eventually, http_peer, http_server
from .test_client_session import client_for

EVICTED = "_acp_server/evicted"


def queue_full(session_id: str = "s1", retry_after_ms: int = RETRY_AFTER_MS) -> PromptQueueFullError:
    return PromptQueueFullError(session_id=session_id, limit=1, pending_count=1, retry_after_ms=retry_after_ms)


# --- the bucket, without I/O ----------------------------------------------------------------------


def test_a_refusal_costs_one_and_the_bucket_refills_at_its_rate() -> None:
    budget = RefusalBudget(RefusalBudgetSettings(rate_per_s=10, burst=5), now=0.0)
    # five sessions refused once each: separate holds, one token each
    assert not any(budget.charge(queue_full(f"s{i}"), 0.0) for i in range(5))
    assert budget.tokens == 0
    # the sixth refusal at once overdraws the bucket by one token: its next requests wait for the
    # refill to pay it back (0.1 s), and at least MIN_PAUSE_S
    assert MIN_PAUSE_S > 0.1
    assert budget.charge(queue_full("s5"), 0.0) == pytest.approx(MIN_PAUSE_S)
    # three more overdraw it by four: the refill takes 0.4 s
    assert [budget.charge(queue_full(f"s{i}"), 0.0) for i in (6, 7, 8)] == pytest.approx([0.2, 0.3, 0.4])
    budget = RefusalBudget(RefusalBudgetSettings(rate_per_s=10, burst=5), now=0.0)
    for i in range(5):
        budget.charge(queue_full(f"s{i}"), 0.0)
    assert not budget.charge(queue_full("s9"), 0.1), "0.1 s at 10/s gave one token back"
    assert budget.tokens == 0
    budget.charge(queue_full("s10"), 100.0)
    assert budget.tokens == 4, "the refill stops at burst"


def test_a_resend_inside_the_hold_after_the_grace_costs_more_and_does_not_extend_it() -> None:
    settings = RefusalBudgetSettings(rate_per_s=0.001, burst=100, ignored_cost=4, grace_s=0.05)
    budget = RefusalBudget(settings, now=0.0)
    budget.charge(queue_full(), 0.0)  # opens the hold until 5 s
    budget.charge(queue_full(), 0.01)  # pipelined behind the first: within the grace
    assert (budget.refusals, budget.ignored) == (2, 0)
    assert budget.tokens == pytest.approx(98, abs=0.01)
    budget.charge(queue_full(), 1.0)  # re-sent long before retryAfterMs
    budget.charge(queue_full(), 4.9)
    assert budget.ignored == 2
    assert budget.tokens == pytest.approx(90, abs=0.01)
    budget.charge(queue_full(), 5.0)  # the hold is over (not pushed on by the ignoring refusals)
    assert budget.ignored == 2
    assert budget.tokens == pytest.approx(89, abs=0.01)
    budget.charge(queue_full("other"), 5.5)  # another session's hold is its own
    assert budget.ignored == 2


def test_holds_of_server_wide_refusals_cover_their_kind() -> None:
    """capacity_exceeded, admission_deferred, rate_limited hold for a backend, a tenant, a token: a
    prompt of any session inside the hold ignored it; kinds hold apart."""
    budget = RefusalBudget(RefusalBudgetSettings(rate_per_s=0.001, burst=100), now=0.0)
    cap = CapacityExceededError(backend_id="b", session_id="s1", limit=1, active_count=1, waiting_count=0, retry_after_ms=1000)
    budget.charge(cap, 0.0)
    budget.charge(
        CapacityExceededError(backend_id="b", session_id="s2", limit=1, active_count=1, waiting_count=0, retry_after_ms=1000), 0.5
    )
    assert budget.ignored == 1
    budget.charge(AdmissionDeferredError(tenant_id="t", reason="tenant_limit", retry_after_ms=1000, safe_to_retry=True), 0.5)
    budget.charge(RateLimitedError(reason="request_rate", retry_after_ms=1000), 0.5)
    assert budget.ignored == 1
    assert budget.refusals == 4


def test_a_polite_client_never_overdraws_the_default_budget() -> None:
    """The worst a polite client does: every call it can have in flight (256, --max-inflight-requests)
    refused at once, each re-sent exactly retryAfterMs later and refused again, for ten minutes."""
    budget = RefusalBudget(DEFAULT_REFUSAL_BUDGET, now=0.0)
    calls = 256
    hold_s = RETRY_AFTER_MS / 1000
    now = 0.0
    for _ in range(int(600 / hold_s)):
        for i in range(calls):
            assert not budget.charge(queue_full(f"s{i % 16}"), now + i * 1e-5)
        now += hold_s + 0.01
    assert budget.ignored == 0


def test_a_rude_client_is_paced_then_evicted() -> None:
    """Re-sent at once (a refusal every 30 us): the burst is spent within 0.1 s; then a refusal into
    debt makes the next requests wait for the debt to be paid back and at least MIN_PAUSE_S (at most
    1 s); what refilled beyond the debt meanwhile pays for the first refusals after the wait, so the
    client is refused in batches, a few times a second, at about rate / 4 refusals a second; after a
    burst of refusals from the first in debt on it is evicted."""
    settings = DEFAULT_REFUSAL_BUDGET
    budget = RefusalBudget(settings, now=0.0)
    now = 0.0
    while not (pause := budget.charge(queue_full(f"s{budget.refusals % 16}"), now)):
        now += 30e-6
    assert now < 0.1 and budget.refusals >= settings.burst
    paced_from, refused_from = now, budget.refusals
    pauses, batches = [], []
    batch = 0
    while pause < math.inf:
        if pause:
            assert MIN_PAUSE_S <= pause <= MAX_PAUSE_S
            pauses.append(pause)
            batches.append(batch)
            batch = 0
            now += pause  # the next requests start then, and are refused at once
        batch += 1
        pause = budget.charge(queue_full(f"s{budget.refusals % 16}"), now)
    assert budget.refusals - refused_from == settings.burst, "a burst of refusals in the run, then the eviction"
    assert len(pauses) == budget.in_debt - 1 < settings.burst / 5, "most of them paid by what refilled during a wait"
    # ten re-sends of four tokens each per wait (forty when holds expire and the re-sends cost one)
    assert batches[1:] and all(8 <= b <= MIN_PAUSE_S * settings.rate_per_s for b in batches[1:]), batches
    rate = (budget.refusals - refused_from) / (now - paced_from)
    assert settings.rate_per_s / 5 < rate < settings.rate_per_s / 3
    assert len(pauses) / (now - paced_from) <= 1.01 / MIN_PAUSE_S, "a few wake-ups a second, not one per refusal"
    assert budget.ignored > 0
    params = budget.evicted_params()
    assert params["reason"] == EVICTION_REASON == "ignored_retry_after"
    assert params["refusals"] == budget.refusals


def test_the_run_of_refusals_in_debt_ends_once_the_bucket_is_full_again() -> None:
    """A client rude for a while, then polite long enough for its bucket to fill, starts afresh: it is
    not evicted for the sum of two separate episodes."""
    settings = RefusalBudgetSettings(rate_per_s=10, burst=5)
    budget = RefusalBudget(settings, now=0.0)
    now = 0.0
    for _ in range(5 + 4):  # the burst, then four refusals in debt
        pause = budget.charge(queue_full(), now)
        now += pause
    assert budget.in_debt == 4
    now += 10  # polite for ten seconds: the bucket is full again
    for _ in range(5 + 4):
        pause = budget.charge(queue_full(), now)
        assert pause < math.inf
        now += pause
    assert budget.in_debt == 8
    for _ in range(2):
        pause = budget.charge(queue_full(), now)
        now += pause
    assert pause == math.inf, "the sixth refusal in one run of debt evicts"


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        RefusalBudgetSettings(rate_per_s=-1)
    with pytest.raises(ValueError, match="burst must be positive"):
        RefusalBudgetSettings(rate_per_s=1, burst=0)
    assert not RefusalBudgetSettings(rate_per_s=0, burst=0).enabled


# --- the registry and the schema --------------------------------------------------------------------


def evicted_schema() -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / "evicted.json").read_text()))


def test_every_eviction_reason_is_in_the_registry_the_schema_and_the_readme() -> None:
    schema = json.loads((SCHEMAS / "evicted.json").read_text())
    assert sorted(schema["properties"]["reason"]["enum"]) == sorted(EVICTION_REASONS)
    assert EVICTION_REASON in EVICTION_REASONS
    readme = (ROOT / "README.md").read_text()
    for reason in EVICTION_REASONS:
        assert f"| `{reason}` |" in readme, f"the README's table of eviction reasons lacks {reason}"
    evicted_schema().validate({"reason": "queue_overflow", "limit": 4096, "queuedBytes": 5000})
    with pytest.raises(jsonschema.ValidationError):
        evicted_schema().validate({"reason": "ignored_retry_after", "surprise": 1})
    with pytest.raises(jsonschema.ValidationError):
        evicted_schema().validate({"reason": "no_such_reason"})


# --- the shell's hook, against the real server ----------------------------------------------------


@asynccontextmanager
async def budget_server(
    settings: RefusalBudgetSettings, backend: Backend, limits: Limits | None = None
) -> AsyncIterator[tuple[Server, trio.Nursery]]:
    server = Server(limits or Limits(max_pending_prompts_per_session=1), backend, drain_timeout_s=0, refusal_budget=settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        yield server, nursery
        nursery.cancel_scope.cancel()


async def raw_client(server: Server, nursery: trio.Nursery, name: str = "test") -> RawClient:
    client_end, server_end = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle_stream, server_end, name)
    client = RawClient(client_end)
    nursery.start_soon(client.pump)
    await client.initialize()
    return client


def prompt_msg(id: int, session_id: str, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "session/prompt", "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}}


async def hammer(client: RawClient, session_id: str, *, most: int) -> int:
    """Re-send a refused prompt at once, as a client ignoring retryAfterMs does, until the connection
    ends or ``most`` refusals came back; returns the refusals seen."""
    refused = 0
    while refused < most and not client.eof.is_set():
        id, answer = client.start_request("session/prompt")
        try:
            await client.send(prompt_msg(id, session_id, "again"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            break
        if await _answer_or_eof(client, answer):
            refused += 1
    return refused


@dataclass
class PacedPeer:
    """A connection in debt: its prompt ``held`` runs (held by the backend) on ``session_id``, which it
    then hammered until the budget (1 a second, burst 10) ran out."""

    server: Server
    client: RawClient
    shell: Any  # the server's ConnectionShell of ``client``
    session_id: str
    held_answer: trio.MemoryReceiveChannel[dict[str, Any]]


@asynccontextmanager
async def paced_peer(backend: FakeBackend) -> AsyncIterator[PacedPeer]:
    """A budget server with one :class:`PacedPeer` on it (``backend`` holds its prompt ``held``)."""
    backend.hold("held")
    async with budget_server(RefusalBudgetSettings(rate_per_s=1, burst=10), backend) as (server, nursery):
        rude = await raw_client(server, nursery)
        session_id, _ = await rude.new_session()
        held_id, held_answer = rude.start_request("session/prompt")
        await rude.send(prompt_msg(held_id, session_id, "held"))
        await backend.started("held")
        assert await hammer(rude, session_id, most=11) == 11
        shell = next(iter(server.connections))
        assert shell._resume_at > trio.current_time(), "in debt: its next request on the session waits"
        yield PacedPeer(server, rude, shell, session_id, held_answer)


def most_refusals(settings: RefusalBudgetSettings, window: int, elapsed_s: float) -> float:
    """The most refusals a peer flooding ``window`` at a time can get before its eviction, ``elapsed_s``
    after its first: the full bucket (one token each at least), what refilled meanwhile, the run of
    ``burst`` refusals in debt that ends in the eviction, and one window already on its way. The bound
    grows with the time the flood took, so a slow machine (which refills more tokens per refusal) does
    not fail it; a peer that is never evicted does."""
    return 2 * settings.burst + window + settings.rate_per_s * elapsed_s


async def flood(client: RawClient, session_id: str, *, window: int, most: int) -> int:
    """Re-send ``window`` refused prompts at once, again as soon as their refusals are in, until the
    connection ends or ``most`` refusals came back; returns the refusals seen."""
    refused = 0
    while refused < most and not client.eof.is_set():
        answers = []
        try:
            for _ in range(window):
                id, answer = client.start_request("session/prompt")
                answers.append(answer)
                await client.send(prompt_msg(id, session_id, "again"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            break
        for answer in answers:
            if not await _answer_or_eof(client, answer):
                return refused
            refused += 1
    return refused


async def _answer_or_eof(client: RawClient, answer: trio.MemoryReceiveChannel[dict[str, Any]]) -> bool:
    """Wait for the refusal (``True``) or the end of the connection (``False``)."""
    got = False
    with trio.fail_after(5):
        async with trio.open_nursery() as race:

            async def wait_answer() -> None:
                nonlocal got
                msg = await answer.receive()
                assert msg["error"]["data"]["errorKind"] == "prompt_queue_full"
                got = True
                race.cancel_scope.cancel()

            async def wait_eof() -> None:
                await client.eof.wait()
                race.cancel_scope.cancel()

            race.start_soon(wait_answer)
            race.start_soon(wait_eof)
    return got


async def test_a_rude_peer_is_paced_then_evicted_and_its_accepted_prompt_ends_once(autojump_clock: trio.testing.MockClock) -> None:
    """A client keeps re-sending a prompt its full session refused: once its budget is spent each of its
    requests waits for the refill, and after a burst of refusals in debt it is sent
    ``_acp_server/evicted {reason: "ignored_retry_after"}`` and closed; its admitted prompt ends exactly once (the observer attached to
    the session sees one terminal turn state), and a polite neighbour on another connection keeps being
    served, never waiting on the rude one's pauses."""
    backend = FakeBackend()
    backend.hold("held")
    settings = RefusalBudgetSettings(rate_per_s=1, burst=20)
    with trio.fail_after(120):
        async with budget_server(settings, backend) as (server, nursery):
            rude = await raw_client(server, nursery, "rude")
            session_id, _ = await rude.new_session()
            observer = await raw_client(server, nursery, "observer")
            await observer.call("session/resume", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
            neighbour = await raw_client(server, nursery, "neighbour")
            own, _ = await neighbour.new_session()

            held_id, held_answer = rude.start_request("session/prompt")
            await rude.send(prompt_msg(held_id, session_id, "held"))
            await backend.started("held")
            started = trio.current_time()
            async with trio.open_nursery() as both:

                async def rude_one() -> None:
                    nonlocal refused
                    refused = await hammer(rude, session_id, most=1000)

                async def neighbour_meanwhile() -> None:
                    while not rude.eof.is_set():
                        before = trio.current_time()
                        assert (await neighbour.prompt(own, "meanwhile"))["stopReason"] == "end_turn"
                        assert trio.current_time() - before < 0.01, "the neighbour never waits on the pauses"
                        await trio.sleep(0.05)

                refused = 0
                both.start_soon(rude_one)
                both.start_soon(neighbour_meanwhile)
            await rude.eof.wait()

            evicted = [n for n in rude.notifications if n["method"] == EVICTED]
            assert [n["params"]["reason"] for n in evicted] == ["ignored_retry_after"]
            params = evicted[0]["params"]
            assert params["refusals"] == refused
            # the burst of 20 spent at once, then 21 refusals in debt, each at least a second apart
            # (four tokens each, one refilled a second)
            assert params["inDebt"] == 21
            assert params["ignoredRetryAfter"] >= 10  # a hold lasts retryAfterMs (5 s), then a new one opens
            assert trio.current_time() - started >= 20
            assert (params["budgetRps"], params["budgetBurst"]) == (1, 20)
            evicted_schema().validate(params)
            assert rude.messages[-1]["method"] == EVICTED, "the eviction is the last thing it is sent"
            shells = [s for s in server.connections if s.name == "rude"]
            assert shells == []
            assert server.evictions == 1

            # Its admitted prompt runs on for the observer still attached (as at any disconnect) and
            # ends once.
            held = backend.calls_of("held")[0]
            assert held.outcome is None
            backend.release("held")
            await held.ended.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert held.outcome == "end_turn"
            assert server.bridge.pending_total() == 0
            ends = [t["state"] for t in observer.turn_states if t["promptId"] == held.prompt_id and t["state"] in ("completed", "failed", "cancelled")]
            assert ends == ["completed"]
            assert held_answer.statistics().current_buffer_used == 0, "nothing is answered to a closed peer"

            for i in range(3):
                assert (await neighbour.prompt(own, f"fine {i}"))["stopReason"] == "end_turn"
            assert (await observer.call("_acp_server/stats"))["connections"]["evictionsTotal"] == 1


async def test_an_evicted_peer_alone_on_its_session_has_its_prompt_cancelled_once(autojump_clock: trio.testing.MockClock) -> None:
    """Nobody else attached: the evicted peer's admitted prompt is cancelled, as at any disconnect."""
    backend = FakeBackend()
    backend.hold("held")
    with trio.fail_after(120):
        async with budget_server(RefusalBudgetSettings(rate_per_s=1, burst=5), backend) as (server, nursery):
            rude = await raw_client(server, nursery)
            session_id, _ = await rude.new_session()
            held_id, _ = rude.start_request("session/prompt")
            await rude.send(prompt_msg(held_id, session_id, "held"))
            await backend.started("held")
            await hammer(rude, session_id, most=1000)
            await rude.eof.wait()
            held = backend.calls_of("held")[0]
            await held.ended.wait()
            assert held.outcome == "cancelled"
            assert [c.text for c in backend.calls] == ["held"], "no refused prompt ever ran"
            assert server.bridge.pending_total() == 0
            session = server.bridge.sessions[session_id]
            assert session.pending_count == 0


async def test_session_cancel_of_a_paced_peer_is_honoured_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """A peer whose budget is in debt (its next request on the held session waits unstarted) still has
    its session/cancel run at once: its running prompt ends cancelled, and so does the parked re-send,
    sent before the cancel (as a queued prompt would), answered at once and never run."""
    backend = FakeBackend()
    with trio.fail_after(60):
        async with paced_peer(backend) as paced:
            rude, shell, session_id, held_answer = paced.client, paced.shell, paced.session_id, paced.held_answer
            sent = trio.current_time()
            # a re-send (it waits unstarted) and the cancel behind it (it runs at once)
            id, again = rude.start_request("session/prompt")
            await rude.send(prompt_msg(id, session_id, "again"))
            await trio.testing.wait_all_tasks_blocked()
            assert shell._parked_count == 1, "the re-send on the held session waits unstarted"
            await rude.notify("session/cancel", {"sessionId": session_id})
            answer = await held_answer.receive()
            assert answer["result"]["stopReason"] == "cancelled"
            assert trio.current_time() == sent, "the cancel did not wait for the refill"
            assert backend.calls_of("held")[0].outcome == "cancelled"
            later = await again.receive()
            assert later["result"] == {"stopReason": "cancelled"}
            assert trio.current_time() == sent, "the cancel answered it, not the refill"
            assert backend.calls_of("again") == [], "it never ran"
            assert shell._parked_count == 0
            assert not rude.eof.is_set()


async def test_a_zero_rate_turns_the_budget_off(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.hold("held")
    with trio.fail_after(30):
        async with budget_server(RefusalBudgetSettings(rate_per_s=0, burst=0), backend) as (server, nursery):
            rude = await raw_client(server, nursery)
            session_id, _ = await rude.new_session()
            held_id, _ = rude.start_request("session/prompt")
            await rude.send(prompt_msg(held_id, session_id, "held"))
            await backend.started("held")
            # more than any budget of a positive burst this small would let through
            assert await hammer(rude, session_id, most=scaled(600, 100)) == scaled(600, 100)
            assert not rude.eof.is_set()
            assert [s.refusal_budget for s in server.connections] == [None]
            backend.release_all()


async def test_stdio_has_no_budget(autojump_clock: trio.testing.MockClock) -> None:
    """The editor's own pipe (``socket=False``, what ``--stdio`` serves) is never paced nor evicted."""
    backend = FakeBackend()
    backend.hold("held")
    with trio.fail_after(30):
        async with budget_server(RefusalBudgetSettings(rate_per_s=1, burst=5), backend) as (server, nursery):
            client_end, server_end = trio.testing.memory_stream_pair()
            nursery.start_soon(partial(server.handle_stream, server_end, "stdio", trusted=True, socket=False))
            editor = RawClient(client_end)
            nursery.start_soon(editor.pump)
            await editor.initialize()
            session_id, _ = await editor.new_session()
            held_id, _ = editor.start_request("session/prompt")
            await editor.send(prompt_msg(held_id, session_id, "held"))
            await backend.started("held")
            started = trio.current_time()
            assert await hammer(editor, session_id, most=40) == 40
            assert trio.current_time() == started, "never paced"
            assert not editor.eof.is_set()
            assert [s.refusal_budget for s in server.connections] == [None]
            backend.release_all()


async def test_other_errors_cost_nothing() -> None:
    """Only hold-off refusals spend: a flood of session_not_found answers does not evict."""
    with trio.fail_after(20):
        async with budget_server(RefusalBudgetSettings(rate_per_s=1, burst=2), FakeBackend()) as (server, nursery):
            client = await raw_client(server, nursery)
            for _ in range(50):
                answer = await client.call_raw("session/prompt", {"sessionId": "nope", "prompt": [{"type": "text", "text": "x"}]})
                assert answer["error"]["data"]["errorKind"] == "session_not_found"
            assert not client.eof.is_set()
            assert [s.refusal_budget for s in server.connections] == [None]


async def test_our_sdk_at_overload_is_never_evicted(autojump_clock: trio.testing.MockClock) -> None:
    """acp-server's SDK honours retryAfterMs: 8 SDK clients (8 connections) share two sessions whose
    queues hold 1 prompt each; each client prompts both sessions from a caller of its own, again as
    soon as a prompt ends, with retries; every turn takes 0.5 s; five minutes of (virtual) time (30 in
    make test-full).
    Hundreds of refusals on each connection, no eviction, every call ends ``end_turn``, and no budget
    got near empty."""
    backend = FakeBackend()
    backend.latency_s = 0.5
    settings = DEFAULT_REFUSAL_BUDGET
    minutes = scaled(30, 5)
    with trio.fail_after(minutes * 60 + 60):
        async with budget_server(settings, backend) as (server, nursery), AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(client_for(server, nursery)) for _ in range(8)]
            ids = [(await clients[0].new_session("/tmp")).session_id for _ in range(2)]
            done = 0
            stop_at = trio.current_time() + minutes * 60

            async def caller(client: Client, session_id: str) -> None:
                nonlocal done
                session = await client.resume_session(session_id, "/tmp")
                while trio.current_time() < stop_at:
                    result = await session.prompt("again", retry=RetryPolicy(max_attempts=10_000))
                    assert result.stop_reason == "end_turn"
                    done += 1

            async with trio.open_nursery() as callers:
                for client in clients:
                    for session_id in ids:
                        callers.start_soon(caller, client, session_id)
            assert [c.connection.evicted for c in clients] == [None] * 8
            assert server.evictions == 0
            budgets = [s.refusal_budget for s in server.connections if s.name == "sdk"]
            assert len(budgets) == 8 and all(b is not None for b in budgets)
            refusals = sum(b.refusals for b in budgets if b is not None)
            assert refusals > 150 * minutes
            now = trio.current_time()
            for budget in budgets:
                assert budget is not None
                assert budget.in_debt == 0, "its reads were never paused"
                assert budget.charge(queue_full("probe"), now) == 0
                assert budget.tokens > settings.burst / 2
            assert done >= 0.9 * minutes * 60 / 0.5 * 2, "both sessions were kept busy"


# --- flags and config keys ------------------------------------------------------------------------


def test_the_flags_and_their_config_keys(tmp_path: Any) -> None:
    """``--refusal-budget-rps``/``--refusal-budget-burst`` and the config keys ``refusal_budget_rps``/
    ``refusal_budget_burst``; the command line wins; bad values exit 2 naming the flag."""

    def config(*argv: str) -> Any:
        parser, serve = _build()
        return server_config(_parse(parser, ["serve", "--ephemeral", *argv]), serve)

    assert config().refusal_budget == DEFAULT_REFUSAL_BUDGET == RefusalBudgetSettings(rate_per_s=200, burst=500)
    toml = tmp_path / "c.toml"
    toml.write_text("refusal_budget_rps = 5\nrefusal_budget_burst = 50\n")
    from_file = config("--config", str(toml)).refusal_budget
    assert (from_file.rate_per_s, from_file.burst) == (5, 50)
    given = config("--config", str(toml), "--refusal-budget-rps", "0").refusal_budget
    assert (given.rate_per_s, given.burst, given.enabled) == (0, 50, False)
    assert config("--refusal-budget-burst", "7.5").refusal_budget.burst == 7.5


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--refusal-budget-rps", "-1"], "--refusal-budget-rps must be a non-negative number"),
        (["--refusal-budget-rps", "nan"], "--refusal-budget-rps must be a non-negative number"),
        (["--refusal-budget-burst", "x"], "--refusal-budget-burst must be a non-negative number"),
        (["--refusal-budget-burst", "0"], "--refusal-budget-burst must be positive while --refusal-budget-rps is"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_flag(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser, serve = _build()
    with pytest.raises(SystemExit) as info:
        server_config(_parse(parser, ["serve", "--ephemeral", *argv]), serve)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_bad_config_value_names_its_key(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("refusal_budget_rps = -3\n")
    parser, serve = _build()
    with pytest.raises(SystemExit):
        server_config(_parse(parser, ["serve", "--ephemeral", "--config", str(toml)]), serve)
    assert "refusal_budget_rps" in capsys.readouterr().err


# --- over HTTP: WebSocket and HTTP+SSE ------------------------------------------------------------


async def test_a_rude_websocket_peer_gets_the_eviction_then_the_socket_closes() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_pending_prompts_per_session=1), EchoBackend(delay_ms=60_000)) as (server, nursery, url):
            server.refusal_budget = budget = RefusalBudgetSettings(rate_per_s=100, burst=10)
            async with open_websocket(url.replace("http", "ws") + "/acp") as ws:
                client = RawClient(ws)
                nursery.start_soon(client.pump)
                await client.initialize()
                session_id, _ = await client.new_session()
                held_id, _ = client.start_request("session/prompt")
                await client.send(prompt_msg(held_id, session_id, "held"))
                await eventually(lambda: server.bridge.pending_total() == 1)
                started = trio.current_time()
                refused = await flood(client, session_id, window=10, most=1000)
                await client.eof.wait()
                elapsed = trio.current_time() - started
            last = client.messages[-1]
            assert last["method"] == EVICTED and last["params"]["reason"] == "ignored_retry_after"
            assert 0 < refused <= last["params"]["refusals"] <= most_refusals(budget, 10, elapsed)
            evicted_schema().validate(last["params"])
            await eventually(lambda: not server.connections and server.bridge.pending_total() == 0)
            assert server.evictions == 1


async def test_a_rude_http_peer_gets_the_eviction_on_its_stream_then_429() -> None:
    """HTTP+SSE: refusals come on the session's stream; the eviction ends the connection's stream, and
    every later POST on that connection is answered 429 ``connection_evicted`` with
    ``Connection: close``; a new connection is served."""
    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server(Limits(max_pending_prompts_per_session=1), EchoBackend(delay_ms=60_000)) as (server, nursery, url):
            server.refusal_budget = budget = RefusalBudgetSettings(rate_per_s=100, burst=10)
            async with http_peer(url, nursery) as peer:
                await peer.initialize()
                sid = await peer.new_session()
                _, r = await peer.post("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "held"}]}, session_id=sid)
                assert r.status_code == 202
                await eventually(lambda: server.bridge.pending_total() == 1)
                assert peer.conn_stream is not None
                statuses = []
                started = trio.current_time()
                stream, conn_stream = peer.session_streams[sid], peer.conn_stream
                while not conn_stream.ended.is_set() and len(statuses) < 200:
                    ids = []
                    for _ in range(10):  # a window of re-sends at once, then the next
                        id, r = await peer.post("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "again"}]}, session_id=sid)
                        statuses.append(r.status_code)
                        if r.status_code != 202:
                            break
                        ids.append(id)
                    for id in ids:
                        await eventually(lambda id=id: conn_stream.ended.is_set() or any(m.get("id") == id for m in stream.messages), 5)
                    for m in stream.messages:
                        if m.get("id") in ids:
                            assert m["error"]["data"]["errorKind"] == "prompt_queue_full"
                await peer.conn_stream.ended.wait()
                elapsed = trio.current_time() - started
                evicted = [m for m in peer.conn_stream.messages if m.get("method") == EVICTED]
                assert [m["params"]["reason"] for m in evicted] == ["ignored_retry_after"]
                _, r = await peer.post("_acp_server/stats", {})
                assert r.status_code == 429
                assert r.headers["connection"] == "close"
                body = check_error_body(r)
                assert (body["code"], body["reason"], body["connectionId"]) == ("connection_evicted", "ignored_retry_after", peer.connection_id)
                assert 10 <= statuses.count(202) <= most_refusals(budget, 10, elapsed)
            async with http_peer(url, nursery) as fresh:
                await fresh.initialize()
                _, r = await fresh.post("_acp_server/capabilities", {})
                assert r.status_code == 202
            assert server.evictions == 1
