"""Durable sessions across real server processes on one state directory: a restart keeps sessions and
transcripts, old client ids are refused and healed (raw and with the client SDK), kill -9 in the middle
of 200 prompts leaves a clean database where each prompt the client saw has exactly one outcome, and a
second server on the directory (or a database from a newer version) is refused with exit 1."""

from __future__ import annotations

import json
import os
import pathlib
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from acp_server.client import connect as sdk_connect
from acp_server.store import DB_NAME, SCHEMA_VERSION, TURN_STATE

from .helpers import RawClient, RpcError, stored_events
from .test_e2e_sdk import ServerProcess, raw_clients, server_process, wait_for

LISTEN = ("--listen", "tcp://127.0.0.1:0")


def serve_args(state: pathlib.Path, *more: str) -> tuple[str, ...]:
    return (*LISTEN, "--state-dir", str(state), *more)


def seen(client: RawClient, session_id: str) -> list[tuple[str, Any, int]]:
    return [
        (u["update"]["sessionUpdate"], u["update"].get("content"), u["_meta"]["eventId"])
        for u in client.updates(session_id)
    ]


def load_params(session_id: str, **meta: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []}
    if meta:
        params["_meta"] = meta
    return params


def query(state: pathlib.Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(state / DB_NAME)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


async def test_restart_keeps_sessions_and_replays_them(tmp_path: pathlib.Path) -> None:
    """Kill the process, start another on the same directory: list shows the sessions, load replays
    the same (kind, content, eventId) in order, user prompts included; the old client id gets
    invalid_client_id, resume issues one that works, and afterEventId replays only the tail."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with server_process(*serve_args(state)) as (_, (url,)), raw_clients() as open_raw:
            a = await open_raw(url)
            watcher = await open_raw(url)
            session_id, old_client = await a.new_session("/tmp")
            other, _ = await a.new_session("/var")
            await watcher.call("session/load", load_params(session_id))
            for text in ("alpha beta", "gamma", "delta epsilon zeta"):
                await a.prompt(session_id, text)
            await wait_for(watcher, lambda: watcher.agent_text(session_id).endswith("zeta"))
            live = seen(watcher, session_id)
        assert [k for k, _, _ in live].count("user_message_chunk") == 3

        async with server_process(*serve_args(state)) as (_, (url,)), raw_clients() as open_raw:
            b = await open_raw(url)
            listed = await b.call("session/list", {})
            assert {s["sessionId"] for s in listed["sessions"]} == {session_id, other}
            assert [s["sessionId"] for s in (await b.call("session/list", {"cwd": "/var"}))["sessions"]] == [other]

            with pytest.raises(RpcError) as info:
                await b.prompt(session_id, "stale", clientId=old_client)
            assert info.value.kind == "invalid_client_id"
            assert b.updates(session_id) == []

            await b.call("session/load", load_params(session_id))
            assert seen(b, session_id) == live

            c = await open_raw(url)
            resumed = await c.call("session/resume", {"sessionId": session_id, "cwd": "/tmp"})
            new_client = resumed["_meta"]["clientId"]
            assert new_client != old_client and c.updates(session_id) == []
            result = await c.prompt(session_id, "after restart", clientId=new_client)
            assert result["stopReason"] == "end_turn"
            assert c.agent_text(session_id) == "after restart"

            last = live[-1][2]
            d = await open_raw(url)
            await d.call("session/load", load_params(session_id, afterEventId=last))
            first = seen(d, session_id)[0]
            assert first[:2] == ("user_message_chunk", {"type": "text", "text": "after restart"}) and first[2] > last
            # the turn states after ``last`` come back too (the terminal ones; live-only ones are not kept)
            assert [t["state"] for t in d.turn_states][-1] == "completed"
            assert d.agent_text(session_id) == "after restart"


async def test_client_sdk_self_heals_after_a_restart(tmp_path: pathlib.Path) -> None:
    """The client SDK's prompt with a client id from before the restart self-heals: one
    session/resume, on_self_heal(old, new), and the retry succeeds with the new id."""
    state = tmp_path / "state"
    heals: list[tuple[str | None, str]] = []
    with trio.fail_after(60):
        async with server_process(*serve_args(state)) as (_, (url,)):
            async with sdk_connect(url) as client:
                session = await client.new_session("/tmp")
                assert (await session.prompt("before")).stop_reason == "end_turn"
                session_id, old_id = session.session_id, session.client_id
        async with server_process(*serve_args(state)) as (_, (url,)):
            async with sdk_connect(url, on_self_heal=lambda old, new: heals.append((old, new))) as client:
                session = client.use_session(session_id, client_id=old_id, cwd="/tmp")
                result = await session.prompt("after")
                assert result.stop_reason == "end_turn"
                assert session.self_heals == 1
                assert len(heals) == 1 and heals[0][0] == old_id and heals[0][1] == session.client_id != old_id
                assert (await session.prompt("again")).stop_reason == "end_turn"
                assert session.self_heals == 1


async def test_kill_9_during_prompts_leaves_one_outcome_per_seen_prompt(tmp_path: pathlib.Path) -> None:
    """kill -9 while 200 prompts over 20 sessions run: after a restart the database passes
    integrity_check, every prompt the client saw an update or an answer for has exactly one terminal
    record (its stop reason when answered, else completed or server_restarted), nothing stays pending,
    and each server_restarted prompt has one turn_state in its transcript.

    A session runs its prompts one at a time and each echo turn holds for ``delay_ms`` after its chunk:
    the kill comes once the client saw, in every session, two prompts answered and the third's chunk
    (running), so each session still has eight turns (8 s) of work left: the kill lands with prompts
    running and queued however late the client reads (it does not wait for a fraction of answers, which
    a loaded machine could all deliver before the kill)."""
    state = tmp_path / "state"
    sessions, per_session, answered_first, delay_ms = 20, 10, 2, 1000
    args = serve_args(state, "--echo-delay-ms", str(delay_ms), "--max-pending-prompts-per-session", "0")
    with trio.fail_after(90):
        async with server_process(*args) as (server, (url,)), raw_clients() as open_raw:
            client = await open_raw(url)
            ids = [(await client.new_session())[0] for _ in range(sessions)]
            request_of: dict[int, tuple[int, int]] = {}
            for k in range(per_session):
                for i in range(sessions):
                    rid, _ = client.start_request("session/prompt")
                    request_of[rid] = (i, k)
                    prompt = [{"type": "text", "text": f"s{i}p{k}"}]
                    await client.send(
                        {"jsonrpc": "2.0", "id": rid, "method": "session/prompt", "params": {"sessionId": ids[i], "prompt": prompt}}
                    )

            def answered() -> dict[tuple[int, int], str]:
                return {
                    request_of[m["id"]]: m["result"]["stopReason"]
                    for m in client.messages
                    if isinstance(m, dict) and m.get("id") in request_of and "result" in m
                }

            def chunked() -> set[tuple[int, int]]:
                return {
                    (int(text[1 : text.index("p")]), int(text[text.index("p") + 1 :]))
                    for n in client.notifications
                    if n["method"] == "session/update"
                    and n["params"]["update"]["sessionUpdate"] == "agent_message_chunk"
                    and (text := n["params"]["update"]["content"]["text"]).startswith("s")
                }

            def mid_flight() -> bool:
                done, running = answered(), chunked()
                return all(
                    all((i, k) in done for k in range(answered_first)) and (i, answered_first) in running
                    for i in range(sessions)
                )

            total = sessions * per_session
            await wait_for(client, mid_flight)
            server.proc.kill()  # SIGKILL, mid-flight
            await trio.to_thread.run_sync(server.proc.wait)
            await client.eof.wait()
            responses = answered()
            updated = chunked()
        assert len(responses) < total, "every prompt finished before the kill: nothing was tested"
        saw = set(responses) | updated

        async with server_process(*serve_args(state)):  # opening marks the unfinished prompts
            assert query(state, "PRAGMA integrity_check") == [("ok",)]
            outcomes: dict[tuple[int, int], tuple[str, str | None]] = {}
            for i, sid in enumerate(ids):
                rows = query(state, "SELECT prompt_id, outcome FROM prompts WHERE session_id = ? ORDER BY seq", sid)
                for k, (prompt_id, outcome) in enumerate(rows):  # admitted in the order sent
                    outcomes[(i, k)] = (prompt_id, outcome)
            notes = [body for _, _, method, body in stored_events(state) if method == TURN_STATE]
    completed = [body["promptId"] for body in notes if body["state"] == "completed"]
    notes = [body for body in notes if body["reason"] == "server_restarted"]

    assert query(state, "SELECT COUNT(*) FROM prompts WHERE outcome IS NULL") == [(0,)]
    missing = saw - set(outcomes)
    assert not missing, f"prompts the client saw have no record: {sorted(missing)}"
    for key in saw:
        assert outcomes[key][1] in ("end_turn", "server_restarted"), (key, outcomes[key])
    for key, stop in responses.items():
        assert outcomes[key][1] == stop, (key, outcomes[key])  # answered: never marked restarted too
    restarted = [pid for pid, outcome in outcomes.values() if outcome == "server_restarted"]
    noted = [body["promptId"] for body in notes]
    assert sorted(noted) == sorted(restarted) and len(set(noted)) == len(noted)
    assert all(body["state"] == "failed" for body in notes)
    # every prompt ended with end_turn has its completed turn state in the transcript, and only those
    ended = [pid for pid, outcome in outcomes.values() if outcome == "end_turn"]
    assert not set(completed) - set(ended) and len(set(completed)) == len(completed)
    assert restarted, "no prompt was in flight at the kill"


async def test_second_server_on_the_state_dir_is_refused(tmp_path: pathlib.Path) -> None:
    """A second server on an owned directory exits 1 naming the owner's pid and the ways out; a
    database from a newer acp-server exits 1 too."""
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with server_process(*serve_args(state)) as (owner, _):
            run = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [sys.executable, "-m", "acp_server", "serve", *serve_args(state)],
                    capture_output=True, text=True, timeout=30,
                )
            )
            assert run.returncode == 1, run.stderr
            assert f"pid {owner.proc.pid}" in run.stderr
            for hint in ("--state-dir", "--ephemeral", "acp-server connect"):
                assert hint in run.stderr

    db = sqlite3.connect(state / DB_NAME)
    db.execute("INSERT INTO schema_migrations VALUES (?, 0)", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    run = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "acp_server", "serve", *serve_args(state)], capture_output=True, text=True, timeout=30
        )
    )
    assert run.returncode == 1
    assert "newer than this acp-server" in run.stderr and "Traceback" not in run.stderr


def test_stdio_without_state_dir_writes_nothing(tmp_path: pathlib.Path) -> None:
    """``serve --stdio`` alone is ephemeral: a whole session leaves no state directory behind."""
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
        {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}},
    ]
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_server", "serve", "--stdio"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for message in lines:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline())["id"] == message["id"]  # answered before the next
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert list(tmp_path.iterdir()) == []


async def test_agent_session_is_restored_in_the_agent_with_session_load(tmp_path: pathlib.Path) -> None:
    """With an ACP agent that advertises loadSession, a restored session's first prompt re-opens it in
    the new agent process with session/load of its old id; the agent's own replay is not forwarded,
    ours is."""
    state = tmp_path / "state"
    agent = ("--log-level", "info", "--", sys.executable, "-m", "tests.agents.fake_agent", "--load-session")
    with trio.fail_after(60):
        async with server_process(*serve_args(state, *agent)) as (_, (url,)), raw_clients() as open_raw:
            a = await open_raw(url)
            session_id, _ = await a.new_session("/tmp")
            assert (await a.prompt(session_id, "first words"))["stopReason"] == "end_turn"
        async with server_process(*serve_args(state, *agent)) as (server, (url,)), raw_clients() as open_raw:
            b = await open_raw(url)
            await b.call("session/load", load_params(session_id))
            assert [k for k, _, _ in seen(b, session_id)][0] == "user_message_chunk"
            assert b.agent_text(session_id) == "first words"
            count = len(b.updates(session_id))
            assert (await b.prompt(session_id, "second"))["stopReason"] == "end_turn"
            texts = [u["update"].get("content", {}).get("text") for u in b.updates(session_id)[count:]]
            assert "replayed history" not in texts and b.agent_text(session_id) == "first wordssecond"
            reopened = f"re-opened {session_id} on agent pid"
            await trio.to_thread.run_sync(wait_stderr, server, lambda line: reopened in line and "(session/load)" in line)


def wait_stderr(server: ServerProcess, match: Callable[[str], bool], timeout: float = 10.0) -> None:
    """Read the server's stderr until a line matches (AssertionError on timeout, with what was seen)."""
    deadline = time.monotonic() + timeout
    while not any(match(line) for line in server.stderr_lines):
        server.next_stderr_line(deadline, "the expected log line")
