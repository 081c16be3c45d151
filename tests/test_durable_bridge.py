"""Durable sessions in process: a server on a state directory, "restarted" by opening a new server on
the same directory. Load replays what was sent, close unloads, delete removes, stored sessions come
back silently, --max-sessions refuses, and a prompt left unfinished replays as a turn_state."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from acp_server.admission import Limits
from acp_server.server import Server
from acp_server.store import TURN_STATE, SessionStore, StoredEvent, StoredSession

from .helpers import RawClient, RpcError, connect, rows_of, stored_events


@asynccontextmanager
async def durable_server(directory: pathlib.Path, limits: Limits | None = None) -> AsyncIterator[tuple[Server, trio.Nursery]]:
    """A server whose store lives in ``directory``; the store is closed (flushed, unlocked) on exit."""
    server = Server(limits, store=SessionStore(directory))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.bridge.run)
            yield server, nursery
            nursery.cancel_scope.cancel()
    finally:
        assert server.store is not None
        server.store.close()


def seen(client: RawClient, session_id: str) -> list[tuple[str, Any, int]]:
    """(kind, content, eventId) of every update of the session the client received."""
    return [
        (u["update"]["sessionUpdate"], u["update"].get("content"), u["_meta"]["eventId"])
        for u in client.updates(session_id)
    ]


def update_ids_after(server: Server, session_id: str, after: int) -> list[int]:
    """The eventIds of the session's ``session/update`` history entries after ``after`` (terminal turn
    states share the history and live-only ones take ids too, so ids are increasing, not adjacent)."""
    return [e for e, u in server.bridge.sessions[session_id].history if e > after and not isinstance(u, StoredEvent)]


def load_params(session_id: str, **meta: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []}
    if meta:
        params["_meta"] = meta
    return params


async def test_restart_lists_and_replays_what_was_sent(tmp_path: pathlib.Path) -> None:
    """After a restart the session is listed, load replays exactly what an attached client saw live
    (user prompts included, same eventIds), prompting continues and afterEventId gives the tail."""
    with trio.fail_after(20):
        async with durable_server(tmp_path) as (server, nursery):
            a = await connect(server, nursery)
            session_id, old_client = await a.new_session("/tmp")
            watcher = await connect(server, nursery)
            await watcher.call("session/load", load_params(session_id))
            for text in ("one two", "three"):
                await a.prompt(session_id, text)
            await a.call("_acp_server/stats")  # the watcher's updates were queued before this answer
            await watcher.call("_acp_server/stats")
            live = seen(watcher, session_id)
        assert [k for k, _, _ in live].count("user_message_chunk") == 2

        async with durable_server(tmp_path) as (server, nursery):
            b = await connect(server, nursery)
            listed = await b.call("session/list", {})
            assert [s["sessionId"] for s in listed["sessions"]] == [session_id]
            assert listed["sessions"][0]["cwd"] == "/tmp"
            result = await b.call("session/load", load_params(session_id))
            assert seen(b, session_id) == live
            assert all("originatorClientId" not in u["_meta"] for u in b.updates(session_id))
            new_client = result["_meta"]["clientId"]
            assert new_client != old_client
            with pytest.raises(RpcError) as info:
                await b.prompt(session_id, "stale", clientId=old_client)
            assert info.value.kind == "invalid_client_id"
            assert (await b.prompt(session_id, "four", clientId=new_client))["stopReason"] == "end_turn"
            last = live[-1][2]
            user_id, echo_id = update_ids_after(server, session_id, last)
            # the sender is not sent its own prompt, only the echo
            assert [e for _, _, e in seen(b, session_id)][len(live):] == [echo_id]
            assert user_id < echo_id

            tail = await connect(server, nursery)
            await tail.call("session/resume", load_params(session_id, afterEventId=last))
            assert [(k, c) for k, c, _ in seen(tail, session_id)] == [
                ("user_message_chunk", {"type": "text", "text": "four"}),
                ("agent_message_chunk", {"type": "text", "text": "four"}),
            ]
            assert [e for _, _, e in seen(tail, session_id)] == [user_id, echo_id]
            # the tail carries the terminal turn states after ``last`` too: "three"'s and "four"'s
            assert [t["state"] for t in tail.turn_states] == ["completed", "completed"]
            assert all(t["_meta"]["eventId"] > last for t in tail.turn_states)


async def test_close_unloads_and_delete_removes(tmp_path: pathlib.Path) -> None:
    """session/close keeps the history (listed, loadable); session/delete removes it from disk too."""
    with trio.fail_after(20):
        async with durable_server(tmp_path) as (server, nursery):
            a = await connect(server, nursery)
            kept, _ = await a.new_session("/tmp")
            gone, _ = await a.new_session("/var")
            await a.prompt(kept, "kept words")
            await a.prompt(gone, "gone words")
            await a.call("session/close", {"sessionId": kept})
            assert kept not in server.bridge.sessions
            listed = await a.call("session/list", {"cwd": "/tmp"})
            assert [s["sessionId"] for s in listed["sessions"]] == [kept]
            b = await connect(server, nursery)
            await b.call("session/load", load_params(kept))
            assert b.agent_text(kept) == "kept words"

            await a.call("session/delete", {"sessionId": gone})
            listed = await a.call("session/list", {})
            assert [s["sessionId"] for s in listed["sessions"]] == [kept]
            with pytest.raises(RpcError) as info:
                await a.call("session/load", load_params(gone))
            assert info.value.kind == "session_not_found"
            caps = (await a.initialize())["agentCapabilities"]
            assert caps["loadSession"] is True
            assert set(caps["sessionCapabilities"]) == {"list", "close", "resume", "delete"}
        assert stored_events(tmp_path, gone) == [] and stored_events(tmp_path, kept) != []
        assert rows_of(tmp_path, "SELECT id FROM sessions") == [(kept,)]


async def test_stored_session_comes_back_silently_on_any_request(tmp_path: pathlib.Path) -> None:
    """A prompt naming a stored session that is not live makes it live (no replay) and runs; event ids continue."""
    with trio.fail_after(20):
        async with durable_server(tmp_path) as (server, nursery):
            a = await connect(server, nursery)
            session_id, _ = await a.new_session()
            await a.prompt(session_id, "before")
            last = a.updates(session_id)[-1]["_meta"]["eventId"]
        async with durable_server(tmp_path) as (server, nursery):
            b = await connect(server, nursery)
            assert session_id not in server.bridge.sessions
            assert (await b.prompt(session_id, "after"))["stopReason"] == "end_turn"
            _, echo_id = update_ids_after(server, session_id, last)
            assert [u["_meta"]["eventId"] for u in b.updates(session_id)] == [echo_id]  # no replay
            forked = await b.call("_acp_server/fork", {"sessionId": session_id})
            c = await connect(server, nursery)
            await c.call("session/load", load_params(forked["sessionId"]))
            assert c.agent_text(forked["sessionId"]) == "beforeafter"


async def test_max_sessions_refuses_new_and_restored_sessions(tmp_path: pathlib.Path) -> None:
    """Over --max-sessions live sessions, session/new and a restore get session_limit_exceeded {limit}."""
    with trio.fail_after(20):
        async with durable_server(tmp_path, Limits(max_sessions=2)) as (server, nursery):
            a = await connect(server, nursery)
            first, _ = await a.new_session()
            await a.new_session()
            with pytest.raises(RpcError) as info:
                await a.new_session()
            assert info.value.code == -32009
            assert info.value.data == {"errorKind": "session_limit_exceeded", "limit": 2}
            await a.call("session/close", {"sessionId": first})
            third, _ = await a.new_session()
            with pytest.raises(RpcError) as info:
                await a.prompt(first, "restore me")  # would be a third live session
            assert info.value.kind == "session_limit_exceeded"
            await a.call("session/close", {"sessionId": third})
            assert (await a.prompt(first, "restore me"))["stopReason"] == "end_turn"


async def test_unfinished_prompt_replays_as_turn_state_at_its_place(tmp_path: pathlib.Path) -> None:
    """A prompt admitted but unfinished when the process died replays as _acp_server/turn_state
    (failed, server_restarted) right after its partial updates, with its own eventId."""
    store = SessionStore(tmp_path)
    store.open()
    store.save_session(StoredSession("sess_x", "/tmp", "echo", 1, 1))
    store.admit(7, "prompt_7", "sess_x")
    store.add_event("sess_x", 1, {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "q"}})
    store.add_event("sess_x", 2, {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "a"}})
    store.flush_sync()
    assert store._writer is not None
    store._writer.close()  # the process "dies": no clean close
    store._writer = None
    store.close()
    with trio.fail_after(20):
        async with durable_server(tmp_path) as (server, nursery):
            b = await connect(server, nursery)
            await b.call("session/load", load_params("sess_x"))
            notes = [(n["method"], n["params"]["_meta"]["eventId"]) for n in b.messages if "method" in n]
            assert notes == [("session/update", 1), ("session/update", 2), (TURN_STATE, 3)]
            state = b.turn_states[0]
            assert state["sessionId"] == "sess_x" and state["promptId"] == "prompt_7"
            assert state["state"] == "failed" and state["reason"] == "server_restarted" and state["at"]
            result = await b.prompt("sess_x", "next")
            assert result["_meta"]["promptId"] == "prompt_8"  # prompt numbers continue past the stored ones
            # accepted 4, running 5, its user chunk 6 (not sent to its sender), the echo 7, completed 8
            assert [u["_meta"]["eventId"] for u in b.updates("sess_x")][-1] == 7
            assert [(t["state"], t["_meta"]["eventId"]) for t in b.turn_states[1:]] == [
                ("accepted", 4), ("running", 5), ("completed", 8)
            ]


async def test_delete_of_a_stored_session_does_not_restore_it(tmp_path: pathlib.Path) -> None:
    """Deleting (or closing) a stored session that is not live works at the --max-sessions limit: it is
    not made live for that; an old client id is refused."""
    with trio.fail_after(20):
        async with durable_server(tmp_path) as (server, nursery):
            a = await connect(server, nursery)
            stored, old = await a.new_session()
        async with durable_server(tmp_path, Limits(max_sessions=1)) as (server, nursery):
            b = await connect(server, nursery)
            await b.new_session()  # the one live session allowed
            with pytest.raises(RpcError) as info:
                await b.call("session/delete", {"sessionId": stored, "_meta": {"clientId": old}})
            assert info.value.kind == "invalid_client_id"
            assert await b.call("session/close", {"sessionId": stored}) == {}
            assert await b.call("session/delete", {"sessionId": stored}) == {}
            assert stored not in server.bridge.sessions and stored not in server.bridge.stored
            with pytest.raises(RpcError) as info:
                await b.call("session/delete", {"sessionId": stored})
            assert info.value.kind == "session_not_found"
        assert stored_events(tmp_path, stored) == []
