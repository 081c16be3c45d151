"""Self-heal of a stale client id against the real server.

The stale id is provoked for real: another connection detaches the client's id with
``_acp_server/detach`` and ``_meta.clientId``, so the server answers the next prompt with
``invalid_client_id``. What the client sends is observed by wrapping the server's method table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.client import Client, RpcError, SessionClient
from acp_server.errors import AgentError, InternalError
from acp_server.server import Server

from .fakes import FakeBackend
from .helpers import RawClient, connect, running_server
from .test_client_session import TIMEOUT_S, Recorder, client_for


class Setup:
    def __init__(self, server: Server, nursery: trio.Nursery, client: Client, session: SessionClient, other: RawClient) -> None:
        self.server = server
        self.nursery = nursery
        self.client = client
        self.session = session
        self.other = other
        self.rec = Recorder(server, "session/prompt", "session/resume")
        self.heals: list[tuple[str | None, str]] = []
        session.on_self_heal = lambda old, new: self.heals.append((old, new))

    async def make_stale(self) -> str:
        """Detach the session's client id from another connection; returns the now stale id."""
        stale = self.session.client_id
        assert stale is not None
        await self.other.call("_acp_server/detach", {"sessionId": self.session.session_id, "_meta": {"clientId": stale}})
        assert stale not in self.server.bridge.get(self.session.session_id).clients
        return stale


@asynccontextmanager
async def stale_setup(backend: FakeBackend | None = None) -> AsyncIterator[Setup]:
    async with running_server(backend=backend) as (server, nursery):
        async with client_for(server, nursery) as client:
            session = await client.new_session("/tmp")
            other = await connect(server, nursery)
            yield Setup(server, nursery, client, session, other)


async def test_stale_id_is_replaced_and_the_prompt_retried_with_the_new_one() -> None:
    """``invalid_client_id`` -> ``session/resume`` without a client id -> the prompt again with the new
    id (same idempotency key) succeeds; only the client id changed, and ``on_self_heal`` was told."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            stale = await s.make_stale()
            result = await s.session.prompt("healed")
            assert result.stop_reason == "end_turn"
            new = s.session.client_id
            assert new is not None and new != stale
            assert new in s.server.bridge.get(s.session.session_id).clients
            assert s.heals == [(stale, new)]
            assert (s.session.session_id, s.session.cwd, s.session.self_heals) == (s.session.session_id, "/tmp", 1)
            (resume,) = s.rec.seen["session/resume"]
            assert resume.meta is None or "clientId" not in resume.meta  # asked for a fresh id
            assert (resume.session_id, resume.cwd) == (s.session.session_id, "/tmp")
            first, second = s.rec.metas("session/prompt")
            assert (first["clientId"], second["clientId"]) == (stale, new)
            assert first["idempotencyKey"] == second["idempotencyKey"]


async def test_concurrent_prompts_share_one_resume() -> None:
    """Two prompts that both meet the stale id cause exactly one ``session/resume``; both succeed."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            stale = await s.make_stale()
            results: list[Any] = []

            async def prompt(text: str) -> None:
                results.append(await s.session.prompt(text))

            async with trio.open_nursery() as tasks:
                tasks.start_soon(prompt, "one")
                tasks.start_soon(prompt, "two")
            assert [r.stop_reason for r in results] == ["end_turn", "end_turn"]
            assert s.rec.count("session/resume") == 1
            metas = s.rec.metas("session/prompt")
            assert [m["clientId"] for m in metas[:2]] == [stale, stale]
            assert [m["clientId"] for m in metas[2:]] == [s.session.client_id] * 2
            assert len(s.heals) == 1


async def test_a_late_refusal_reuses_the_finished_resume() -> None:
    """A prompt refused for the stale id after another prompt's resume already finished resends with
    the new id at once: still one resume (no second id minted)."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            stale = await s.make_stale()
            gate = s.rec.hold_next("session/prompt")  # the late one's admission waits for the gate
            late: list[Any] = []

            async def late_prompt() -> None:
                late.append(await s.session.prompt("late"))

            async with trio.open_nursery() as tasks:
                tasks.start_soon(late_prompt)
                await s.rec.wait_for("session/prompt", 1)
                assert (await s.session.prompt("early")).stop_reason == "end_turn"
                healed_id = s.session.client_id
                assert healed_id != stale and s.rec.count("session/resume") == 1
                gate.set()
            assert late[0].stop_reason == "end_turn"
            assert s.rec.count("session/resume") == 1
            assert s.session.client_id == healed_id
            assert [m["clientId"] for m in s.rec.metas("session/prompt")] == [stale, stale, healed_id, healed_id]


async def test_self_heal_retries_once_only() -> None:
    """When the id is stale again by the time of the resend, the second ``invalid_client_id`` is
    raised: one resume, two sends, no loop."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            await s.make_stale()
            bridge = s.server.bridge
            session_state = bridge.get(s.session.session_id)

            def detach_again(old: str | None, new: str) -> None:
                # What another connection's _acp_server/detach does, done before our resend leaves.
                bridge.release_client(session_state, None, new)

            s.session.on_self_heal = detach_again
            with pytest.raises(RpcError) as info:
                await s.session.prompt("stale twice")
            assert info.value.kind == "invalid_client_id"
            assert s.rec.count("session/resume") == 1
            assert s.rec.count("session/prompt") == 2
            assert s.session.pending_prompts == 0


async def test_other_errors_cause_no_resume() -> None:
    """Errors other than ``invalid_client_id`` (a missing session, the agent's own error) propagate
    untouched, with no resume."""
    backend = FakeBackend()
    backend.fail("bad", AgentError(backend_id="fake", agent_code=7, agent_message="no", agent_data=None))
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup(backend) as s:
            with pytest.raises(RpcError) as info:
                await s.session.prompt("bad")
            assert info.value.kind == "agent_error"
            ghost = s.client.use_session("sess_gone", client_id=s.session.client_id, cwd="/tmp")
            with pytest.raises(RpcError) as info:
                await ghost.prompt("anyone?")
            assert info.value.kind == "session_not_found"
            assert s.rec.count("session/resume") == 0
            assert s.heals == []


async def test_failed_resume_propagates_and_a_later_prompt_resumes_again() -> None:
    """A resume that fails raises its own error (the id stays as it was) and is forgotten: the next
    prompt resumes again and succeeds."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            stale = await s.make_stale()
            s.rec.fail_next("session/resume", InternalError())
            with pytest.raises(RpcError) as info:
                await s.session.prompt("first try")
            assert info.value.kind == "internal" and info.value.method == "session/resume"
            assert s.session.client_id == stale and s.session.pending_prompts == 0
            assert (await s.session.prompt("second try")).stop_reason == "end_turn"
            assert s.rec.count("session/resume") == 2
            assert s.session.client_id != stale
            assert s.heals == [(stale, s.session.client_id)]


async def test_cancellation_is_respected_while_the_resume_runs() -> None:
    """A caller cancelled during the resume leaves without resending (its slot is freed); the shared
    resume still completes for whoever prompts next."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            stale = await s.make_stale()
            gate = s.rec.hold_next("session/resume")
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as inner:
                    inner.start_soon(s.session.prompt, "cancelled midway")
                    await s.rec.wait_for("session/resume", 1)
                    scope.cancel()
            assert s.session.pending_prompts == 0
            assert s.rec.count("session/prompt") == 1
            gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert s.session.client_id != stale  # the resume finished in the background
            assert s.rec.count("session/prompt") == 1
            assert (await s.session.prompt("next")).stop_reason == "end_turn"
            assert s.rec.count("session/resume") == 1


async def test_prompt_call_cancel_during_resume_raises_local_request_cancelled() -> None:
    """``PromptCall.cancel()`` while nothing is in flight (the resume runs) ends the call with a local
    ``request_cancelled``: no resend."""
    with trio.fail_after(TIMEOUT_S):
        async with stale_setup() as s:
            await s.make_stale()
            gate = s.rec.hold_next("session/resume")
            call = s.session.prompt_call("stop me")
            outcome: dict[str, Any] = {}

            async def run() -> None:
                try:
                    await call.run()
                except RpcError as exc:
                    outcome["error"] = exc

            async with trio.open_nursery() as inner:
                inner.start_soon(run)
                await s.rec.wait_for("session/resume", 1)
                assert call.request_id is None
                call.cancel()
            err = outcome["error"]
            assert (err.kind, err.code, err.local) == ("request_cancelled", -32800, True)
            gate.set()
            assert s.rec.count("session/prompt") == 1 and call.attempts == 1
