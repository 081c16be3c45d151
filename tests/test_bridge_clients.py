"""Client ids, attached connections and what the bridge sends them: registration, detach,
reconnection, idle expiry, the session reaper, update fan-out with event ids, fork, and the eviction
of a connection that stops reading."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from acp_server.admission import Limits
from acp_server.errors import InvalidClientIdError
from acp_server.server import Server
from acp_server.store import StoredEvent

from .fakes import (
    FakeBackend,
    FakePeer,
    admit_ticket,
    connect_shell,
    open_session,
    running_bridge,
    send_prompt,
    send_request,
    serving,
    text_blocks,
)
from .helpers import RawClient, RpcError, connect

FORGED = "client_00000000-0000-0000-0000-000000000000"


def _kinds(updates: list[dict[str, Any]]) -> list[str]:
    return [u["update"]["sessionUpdate"] for u in updates]


# --- client ids ------------------------------------------------------------------------------------


async def test_invalid_client_id_is_synchronous_and_nothing_runs() -> None:
    """A forged ``_meta.clientId`` is refused at once with -32003 (while the session is busy, not
    after its queue), and nothing runs: no turn, no slot, no cancel, no fork, no detach."""
    backend = FakeBackend()
    backend.hold("busy")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session()
        busy = await send_prompt(client, nursery, sid, "busy")
        await backend.started("busy")
        session = server.bridge.sessions[sid]

        with pytest.raises(RpcError) as info:
            await client.prompt(sid, "forged", clientId=FORGED)
        assert info.value.code == -32003
        assert info.value.data == {"errorKind": "invalid_client_id", "sessionId": sid, "clientId": FORGED}
        assert not busy.done.is_set()

        for method in ("_acp_server/heartbeat", "_acp_server/detach", "_acp_server/fork", "session/close"):
            with pytest.raises(RpcError) as info:
                await client.call(method, {"sessionId": sid, "_meta": {"clientId": FORGED}})
            assert info.value.kind == "invalid_client_id", method
        await client.notify("session/cancel", {"sessionId": sid, "_meta": {"clientId": FORGED}})
        await wait_all_tasks_blocked()

        assert backend.texts_started() == ["busy"]
        assert backend.fork_calls == []
        assert session.pending_count == 1
        assert client_id in session.clients
        assert sid in server.bridge.sessions
        assert not busy.done.is_set(), "a forged session/cancel must not cancel anything"
        backend.release("busy")
        assert (await busy.wait())["result"]["stopReason"] == "end_turn"


async def test_invalid_client_id_raised_by_admission_itself() -> None:
    """``admit`` raises ``InvalidClientIdError`` from the call itself, before any await."""
    backend = FakeBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        with pytest.raises(InvalidClientIdError):
            admit_ticket(bridge, session.session_id, text_blocks("x"), peer=peer, client_id=FORGED)
        assert session.pending_count == 0 and not session.fifo
        await wait_all_tasks_blocked()
        assert backend.calls == []


async def test_forged_heartbeat_moves_no_timestamp(mock_clock: trio.testing.MockClock) -> None:
    """A heartbeat with a forged client id is refused and refreshes nothing; a real one does."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session()
        session = server.bridge.sessions[sid]
        reg = session.clients[client_id]
        before = (reg.last_seen, session.last_activity)
        mock_clock.jump(10)
        with pytest.raises(RpcError) as info:
            await client.call("_acp_server/heartbeat", {"sessionId": sid, "_meta": {"clientId": FORGED}})
        assert info.value.data == {"errorKind": "invalid_client_id", "sessionId": sid, "clientId": FORGED}
        assert (reg.last_seen, session.last_activity) == before

        result = await client.call("_acp_server/heartbeat", {"sessionId": sid, "_meta": {"clientId": client_id}})
        assert result["clientId"] == client_id and result["sessionId"] == sid
        assert reg.last_seen == before[0] + 10
        assert session.last_activity == before[1] + 10


async def test_detach_of_one_client_leaves_the_other_working() -> None:
    """Two clients on one session over two connections: when A detaches, B keeps prompting and
    receiving updates, A receives nothing more and its id is gone."""
    backend = FakeBackend()
    async with serving(Limits(), backend) as (server, nursery):
        a = await connect(server, nursery)
        sid, id_a = await a.new_session()
        b, shell_b = await connect_shell(server, nursery)
        session = server.bridge.sessions[sid]
        id_b = server.bridge.register(session, shell_b)
        assert id_b != id_a

        assert (await b.prompt(sid, "before detach", clientId=id_b))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert a.agent_text(sid) == "before detach"

        assert await a.call("_acp_server/detach", {"sessionId": sid}) == {}
        assert id_a not in session.clients and id_b in session.clients
        seen_by_a = len(a.updates(sid))

        assert (await b.prompt(sid, "after detach", clientId=id_b))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert b.agent_text(sid) == "before detachafter detach"
        assert len(a.updates(sid)) == seen_by_a
        with pytest.raises(RpcError) as info:
            await a.prompt(sid, "again", clientId=id_a)
        assert info.value.kind == "invalid_client_id"
        assert backend.texts_started() == ["before detach", "after detach"]


async def test_reconnecting_client_keeps_its_id() -> None:
    """A client whose connection closed keeps its id: a new connection passing ``_meta.clientId``
    prompts as that client and receives the session's updates."""
    backend = FakeBackend()
    async with serving(Limits(), backend) as (server, nursery):
        first = await connect(server, nursery)
        sid, client_id = await first.new_session()
        await first.stream.aclose()
        await wait_all_tasks_blocked()
        session = server.bridge.sessions[sid]
        assert client_id in session.clients
        assert not any(not p.closed for p in session.attached)

        second, shell = await connect_shell(server, nursery)
        result = await second.call("_acp_server/heartbeat", {"sessionId": sid, "_meta": {"clientId": client_id}})
        assert result["clientId"] == client_id
        assert (await second.prompt(sid, "welcome back", clientId=client_id))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert shell in session.attached
        assert second.agent_text(sid) == "welcome back"
        assert {u["_meta"]["originatorClientId"] for u in second.updates(sid)} == {client_id}


async def test_registration_is_refcounted() -> None:
    """Registering a known id again re-uses it and counts a holder; the id goes away with its last
    holder, and each detaching connection stops receiving updates."""
    async with running_bridge(FakeBackend()) as bridge:
        p1, p2 = FakePeer(), FakePeer()
        session, client_id = await open_session(bridge, p1)
        assert bridge.register(session, p2, client_id) == client_id
        assert session.clients[client_id].refcount == 2
        assert session.attached == {p1, p2}

        bridge.release_client(session, p1, client_id)
        assert session.clients[client_id].refcount == 1
        assert session.attached == {p2}
        assert bridge.clients.registration(p1, session.session_id) is None

        bridge.release_client(session, p2, client_id)
        assert client_id not in session.clients
        assert session.attached == set()


async def test_unknown_requested_id_gets_a_fresh_one() -> None:
    """An id the session does not know, asked for at session/new or at registration, is silently
    replaced by a fresh one."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session(clientId=FORGED)
        assert client_id != FORGED and client_id.startswith("client_")
        session = server.bridge.sessions[sid]
        fresh = server.bridge.register(session, FakePeer(), "client_never_issued")
        assert fresh not in (client_id, "client_never_issued") and fresh in session.clients
        assert "client_never_issued" not in session.clients


async def test_idle_client_id_expires(autojump_clock: trio.testing.MockClock) -> None:
    """A client id unused for ``client_idle_timeout_s`` expires and is then refused with
    ``invalid_client_id``; requests and heartbeats keep it alive until then."""
    limits = Limits(client_idle_timeout_s=10, session_idle_timeout_s=1000)
    async with serving(limits, FakeBackend()) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session()
        hb = {"sessionId": sid, "_meta": {"clientId": client_id}}
        await trio.sleep(8)
        await client.call("_acp_server/heartbeat", hb)
        await trio.sleep(8)
        assert (await client.prompt(sid, "still here", clientId=client_id))["stopReason"] == "end_turn"
        await trio.sleep(8)
        assert client_id in server.bridge.sessions[sid].clients
        await trio.sleep(4)
        assert client_id not in server.bridge.sessions[sid].clients
        for method, params in [
            ("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "x"}], "_meta": {"clientId": client_id}}),
            ("_acp_server/heartbeat", hb),
        ]:
            with pytest.raises(RpcError) as info:
                await client.call(method, params)
            assert info.value.data == {"errorKind": "invalid_client_id", "sessionId": sid, "clientId": client_id}
        assert sid in server.bridge.sessions, "a session with a live attached connection stays"


async def test_reaper_closes_only_idle_unattached_clientless_sessions(autojump_clock: trio.testing.MockClock) -> None:
    """The reaper closes a session once it is idle, has no client ids and no live attached
    connection; never one with a running prompt (nor one whose backend still runs an abandoned one)."""
    backend = FakeBackend()
    backend.hold("running")
    backend.ignore_cancel("abandoned")
    limits = Limits(client_idle_timeout_s=5, session_idle_timeout_s=10)
    async with running_bridge(backend, limits) as bridge:
        idle, _ = await open_session(bridge, None)
        busy, _ = await open_session(bridge, None)
        admit_ticket(bridge, busy.session_id, text_blocks("running"), peer=None)
        stuck, _ = await open_session(bridge, None)
        admit_ticket(bridge, stuck.session_id, text_blocks("abandoned"), peer=None)
        await backend.started("abandoned")
        bridge.cancel_session(stuck.session_id, None)
        live_peer = FakePeer()
        watched, _ = await open_session(bridge, live_peer)
        dead_peer = FakePeer()
        left, _ = await open_session(bridge, dead_peer)
        dead_peer.closed = True  # closed, but the bridge was not told: it must not count as live

        await trio.sleep(12)
        assert set(bridge.sessions) == {busy.session_id, stuck.session_id, watched.session_id}
        assert ("close_session", idle.session_id) in backend.lifecycle
        assert ("close_session", left.session_id) in backend.lifecycle
        await trio.sleep(100)
        assert set(bridge.sessions) == {busy.session_id, stuck.session_id, watched.session_id}
        assert not busy.clients and not watched.clients, "client ids expire even where sessions stay"
        assert backend.calls_of("running")[0].outcome is None

        backend.release("running", "abandoned")
        live_peer.closed = True
        bridge.peer_closed(live_peer)
        await trio.sleep(5)
        assert busy.session_id in bridge.sessions, "its prompt just ended: not idle yet"
        await trio.sleep(7)
        assert bridge.sessions == {}
        assert backend.calls_of("running")[0].outcome == "end_turn"


# --- fan-out ---------------------------------------------------------------------------------------


def _event_ids(updates: list[dict[str, Any]]) -> list[int]:
    return [u["_meta"]["eventId"] for u in updates]


def _check_event_stream(session: Any, *clients: RawClient) -> None:
    """History ids strictly increase, and with the live-only turn states the clients saw they cover
    every id the session handed out: no id is lost or used twice."""
    history_ids = [event_id for event_id, _ in session.history]
    assert history_ids == sorted(set(history_ids)), "history eventIds strictly increase"
    live_only = {
        t["_meta"]["eventId"]
        for c in clients
        for t in c.turn_states
        if t["sessionId"] == session.session_id and t["state"] not in ("completed", "failed", "cancelled")
    }
    assert not live_only & set(history_ids)
    assert sorted(live_only | set(history_ids)) == list(range(1, session.next_event_id))


def _update_ids(session: Any) -> list[int]:
    """The history's ``session/update`` ids (without the terminal turn states it also keeps)."""
    return [event_id for event_id, update in session.history if not isinstance(update, StoredEvent)]


async def test_updates_fan_out_with_event_ids_and_originators() -> None:
    """Every attached connection gets every update; a prompt is echoed as ``user_message_chunk`` to
    the connections other than its sender; every update carries a per-session, strictly increasing
    ``_meta.eventId`` and ``_meta.originatorClientId`` when the sender is a known client."""
    backend = FakeBackend()
    async with serving(Limits(), backend) as (server, nursery):
        a = await connect(server, nursery)
        sid, id_a = await a.new_session()
        b, shell_b = await connect_shell(server, nursery)
        session = server.bridge.sessions[sid]
        id_b = server.bridge.register(session, shell_b)
        anon = await connect(server, nursery)

        assert (await a.prompt(sid, "hello big world"))["stopReason"] == "end_turn"
        assert (await b.prompt(sid, "from b", clientId=id_b))["stopReason"] == "end_turn"
        assert (await anon.prompt(sid, "anonymous"))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()

        ua, ub, uc = a.updates(sid), b.updates(sid), anon.updates(sid)
        # A sent "hello big world": B gets the user chunk, A does not; both get the agent's words.
        assert [u["update"]["content"]["text"] for u in ub if u["update"]["sessionUpdate"] == "user_message_chunk"] == [
            "hello big world",
            "anonymous",
        ]
        assert [u["update"]["content"]["text"] for u in ua if u["update"]["sessionUpdate"] == "user_message_chunk"] == [
            "from b",
            "anonymous",
        ]
        assert a.agent_text(sid) == b.agent_text(sid) == "hello big worldfrom banonymous"
        assert anon.agent_text(sid) == "anonymous", "anon was attached by its prompt"
        assert [u["update"]["content"]["text"] for u in uc if u["update"]["sessionUpdate"] == "user_message_chunk"] == []

        for updates in (ua, ub, uc):
            ids = _event_ids(updates)
            assert ids == sorted(set(ids)), "eventIds strictly increase"
        _check_event_stream(session, a, b)
        assert sorted(set(_event_ids(ua)) | set(_event_ids(ub))) == _update_ids(session)

        for updates in (ua, ub):
            assert _originators_by_text(updates) == {
                "hello big world": {id_a},
                "from b": {id_b},
                "anonymous": {None},
            }


def _originators_by_text(updates: list[dict[str, Any]]) -> dict[str, set[Any]]:
    """Group agent chunks by turn (the fake echoes a turn's words): turn text -> originators seen."""
    out: dict[str, set[Any]] = {}
    text = ""
    originators: set[Any] = set()
    for u in updates:
        if u["update"]["sessionUpdate"] != "agent_message_chunk":
            continue
        origin = u["_meta"].get("originatorClientId")
        if originators and origin not in originators:
            out[text] = originators
            text, originators = "", set()
        text += u["update"]["content"]["text"]
        originators.add(origin)
    if text:
        out[text] = originators
    return out


async def test_event_ids_are_per_session() -> None:
    """Each session numbers its own events from 1."""
    async with serving(Limits(), FakeBackend()) as (server, nursery):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        await client.prompt(s1, "one two three")
        await client.prompt(s2, "four five")
        await client.prompt(s1, "six")
        await wait_all_tasks_blocked()
        for sid, turns in ((s1, 2), (s2, 1)):
            session = server.bridge.sessions[sid]
            _check_event_stream(session, client)
            history_ids = _update_ids(session)
            received = _event_ids(client.updates(sid))
            assert received == sorted(set(received)) and set(received) <= set(history_ids)
            # The sender is not sent its own prompt back: one user chunk per turn is missing.
            assert len(received) == len(history_ids) - turns


# --- fork ------------------------------------------------------------------------------------------


async def test_slow_fork_holds_the_fifo_head_without_a_slot() -> None:
    """With a limit of 1, a fork whose backend call is slow sits at the head of the FIFO without
    taking the slot: a prompt sent meanwhile is admitted and runs after the fork."""
    backend = FakeBackend()
    backend.hold_forks()
    async with serving(Limits(max_pending_prompts_per_session=1), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        fork = await send_request(client, nursery, "_acp_server/fork", {"sessionId": sid})
        await backend.fork_started()
        prompt = await send_prompt(client, nursery, sid, "after the fork")
        await wait_all_tasks_blocked()
        assert not prompt.done.is_set(), "admitted (not refused) and waiting behind the fork"
        assert backend.calls == []
        assert server.bridge.sessions[sid].pending_count == 1

        backend.release_forks()
        new_sid = (await fork.wait())["result"]["sessionId"]
        assert (await prompt.wait())["result"]["stopReason"] == "end_turn"
        assert backend.order[:3] == [("fork_start", sid), ("fork_end", sid), ("start", "after the fork")]
        assert new_sid in server.bridge.sessions and new_sid != sid


async def test_fork_waits_for_the_running_prompt() -> None:
    """A fork queues behind a running prompt (FIFO), and a later prompt queues behind the fork."""
    backend = FakeBackend()
    backend.hold("first")
    async with serving(Limits(max_pending_prompts_per_session=2), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        first = await send_prompt(client, nursery, sid, "first")
        fork = await send_request(client, nursery, "_acp_server/fork", {"sessionId": sid})
        second = await send_prompt(client, nursery, sid, "second")
        await wait_all_tasks_blocked()
        assert backend.fork_calls == [] and not fork.done.is_set()
        backend.release("first")
        for p in (first, fork, second):
            await p.wait()
        assert [kind for kind, _ in backend.order] == ["start", "end", "fork_start", "fork_end", "start", "end"]
        new_sid = fork.result["sessionId"]
        # The branch has the first turn and not the second.
        source, branch = server.bridge.sessions[sid], server.bridge.sessions[new_sid]
        assert branch.history and branch.history == source.history[: len(branch.history)]
        assert "second" not in repr(branch.history) and "second" in repr(source.history)


async def test_fork_copies_history_and_registers_the_caller() -> None:
    """The branch starts with the source's history and event numbering; the caller is registered on
    it with a fresh client id, under which it can prompt there."""
    backend = FakeBackend()
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, client_id = await client.new_session()
        await client.prompt(sid, "hello world")
        result = await client.call("_acp_server/fork", {"sessionId": sid})
        new_sid, new_id = result["sessionId"], result["_meta"]["clientId"]
        assert new_sid != sid
        assert new_id != client_id and new_id.startswith("client_")
        source, branch = server.bridge.sessions[sid], server.bridge.sessions[new_sid]
        assert branch.history == source.history and branch.history
        assert list(branch.clients) == [new_id]
        assert [(c.source, c.new) for c in backend.fork_calls] == [(sid, new_sid)]

        assert (await client.prompt(new_sid, "on the branch", clientId=new_id))["stopReason"] == "end_turn"
        with pytest.raises(RpcError) as info:
            await client.prompt(new_sid, "wrong id", clientId=client_id)
        assert info.value.kind == "invalid_client_id"
        await wait_all_tasks_blocked()
        copied = len(source.history)
        _check_event_stream(source, client)
        branch_ids = [event_id for event_id, _ in branch.history]
        assert branch_ids == sorted(set(branch_ids)) and branch_ids[copied] >= source.next_event_id
        assert branch.history[:copied] == source.history
        assert _event_ids(client.updates(new_sid))[0] > copied, "the branch numbers on from the source"
        assert "on the branch" not in repr(source.history)


@pytest.mark.parametrize("how", ["cancelled", "expired"])
async def test_fork_while_backend_finishes_abandoned_prompt(how: str, autojump_clock: trio.testing.MockClock) -> None:
    """A fork reaching the FIFO head while the backend still runs a prompt that was cancelled or
    expired (the backend ignoring cancellation) fails with ``branch_while_prompt_active``."""
    backend = FakeBackend()
    backend.ignore_cancel("stuck")
    async with serving(Limits(), backend) as (server, nursery):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        if how == "cancelled":
            stuck = await send_prompt(client, nursery, sid, "stuck")
            await backend.started("stuck")
            await client.notify("session/cancel", {"sessionId": sid})
            assert (await stuck.wait())["result"]["stopReason"] == "cancelled"
        else:
            stuck = await send_prompt(client, nursery, sid, "stuck", deadlineMs=1000)
            assert (await stuck.wait())["error"]["data"]["errorKind"] == "prompt_deadline_exceeded"
        assert backend.calls_of("stuck")[0].outcome is None

        with pytest.raises(RpcError) as info:
            await client.call("_acp_server/fork", {"sessionId": sid})
        assert info.value.code == -32006
        assert info.value.data == {"errorKind": "branch_while_prompt_active", "sessionId": sid}
        assert backend.fork_calls == []
        assert len(server.bridge.sessions) == 1

        backend.release("stuck")
        await wait_all_tasks_blocked()
        result = await client.call("_acp_server/fork", {"sessionId": sid})
        assert result["sessionId"] in server.bridge.sessions


# --- slow consumers --------------------------------------------------------------------------------


async def test_slow_consumer_is_evicted_without_delaying_others(mock_clock: trio.testing.MockClock) -> None:
    """A connection that stops reading is sent ``_acp_server/evicted`` (queue_overflow) and closed
    once its outbound queue overflows, while the other attached connection gets every update and its
    response without waiting (the clock never moves)."""
    backend = FakeBackend()
    limit = 4096
    async with serving(Limits(max_outbound_bytes=limit), backend) as (server, nursery):
        slow, slow_shell = await _lockstep_client(server, nursery)
        sid, _ = await slow.new_session()
        fast = await connect(server, nursery)
        assert (await fast.prompt(sid, "attach me"))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert slow.agent_text(sid) == "attach me"

        slow.reading.cancel()  # the slow client stops reading; its stream has no buffer at all
        await wait_all_tasks_blocked()
        slow.eof = trio.Event()
        text = " ".join(f"word{i}" for i in range(400))
        assert (await fast.prompt(sid, text))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert fast.agent_text(sid) == "attach me" + text
        assert slow_shell.evicted and slow_shell.closed
        assert slow_shell not in server.bridge.sessions[sid].attached
        assert not slow.eof.is_set(), "the slow client is still blocked"

        nursery.start_soon(slow.pump)  # it reads again: what was queued, the eviction, then EOF
        await slow.eof.wait()
        last = slow.notifications[-1]
        assert last["method"] == "_acp_server/evicted"
        assert last["params"]["reason"] == "queue_overflow"
        assert last["params"]["limit"] == limit
        assert last["params"]["queuedBytes"] > limit
        assert len(slow.updates(sid)) < len(fast.updates(sid))


class _PausableClient(RawClient):
    reading: trio.CancelScope


async def _lockstep_client(server: Server, nursery: trio.Nursery) -> tuple[_PausableClient, Any]:
    """A client over a stream with no buffering at all, whose reading can be stopped."""
    client_end, server_end = trio.testing.lockstep_stream_pair()
    before = set(server.connections)
    nursery.start_soon(server.handle_stream, server_end, "slow")
    client = _PausableClient(client_end)
    client.reading = trio.CancelScope()

    async def pump() -> None:
        with client.reading:
            await RawClient.pump(client)

    nursery.start_soon(pump)
    await client.initialize()
    (shell,) = set(server.connections) - before
    return client, shell
