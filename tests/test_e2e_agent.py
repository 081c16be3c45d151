"""The ACP subprocess backend end to end, through the server: clients speak JSON-RPC to an in-process
:class:`~acp_server.server.Server` whose backend spawns ``tests/agents/fake_agent.py`` (the official SDK
on the other side), or to a real ``python -m acp_server serve -- python -m tests.agents.fake_agent``.

The backend's own unit tests are in ``test_backend_acp_agent.py``; these show what a client sees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.backends import AcpAgentBackend, Backend, EchoBackend
from acp_server.server import Server

from .fakes import responses_by_id, send_prompt
from .helpers import ROOT, RawClient, RpcError, assert_error_valid

AGENT = "agent"
#: generous: each spawn imports the SDK (about a second of CPU on a busy 2-core machine)
TIMEOUT_S = 40
CWD = str(ROOT)
PERMISSION = "session/request_permission"
FS_CAPS = {"fs": {"readTextFile": True}}


def agent_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "tests.agents.fake_agent", *flags]


class Client(RawClient):
    """A :class:`RawClient` that wakes waiters on every message and takes the server's requests in order."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream)
        self.changed = trio.Event()
        self._taken = 0

    def _dispatch(self, msg: Any) -> None:
        super()._dispatch(msg)
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self.changed.wait()

    async def next_request(self, method: str) -> dict[str, Any]:
        """The next request the server sent us (it must be a ``method``)."""
        await self.wait_until(lambda: len(self.requests_from_server) > self._taken)
        request = self.requests_from_server[self._taken]
        self._taken += 1
        assert request["method"] == method, request
        return request

    async def answer(self, request: dict[str, Any], result: Any) -> None:
        await self.send({"jsonrpc": "2.0", "id": request["id"], "result": result})

    def text_from(self, session_id: str, start: int) -> str:
        """The agent's text in the session's updates from index ``start`` on."""
        return "".join(
            u["update"]["content"]["text"]
            for u in self.updates(session_id)[start:]
            if u["update"]["sessionUpdate"] == "agent_message_chunk"
        )


async def connect(
    server: Server, nursery: trio.Nursery, capabilities: dict[str, Any] | None = None
) -> Client:
    """An initialized in-memory connection advertising ``capabilities``."""
    client_end, server_end = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle_stream, server_end, "test")
    client = Client(client_end)
    nursery.start_soon(client.pump)
    await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": capabilities or {}})
    return client


@asynccontextmanager
async def agent_server(
    *flags: str,
    limits: Limits | None = None,
    others: Mapping[str, Backend] | None = None,
    capacity: CapacityManager | None = None,
) -> AsyncIterator[tuple[Server, trio.Nursery]]:
    """A server whose default backend ``agent`` is the fake agent with ``flags``, run as ``serve()`` does:
    every backend's ``run`` and the bridge in a nursery, the default agent started before any client."""
    agent = AcpAgentBackend(AGENT, agent_command(*flags), cwd=CWD)
    backends: dict[str, Backend] = {AGENT: agent, **(others or {})}
    server = Server(limits, backends, default_backend=AGENT, capacity=capacity)
    async with trio.open_nursery() as nursery:
        for backend in backends.values():
            if isinstance(backend, AcpAgentBackend):
                await nursery.start(backend.run)
        await nursery.start(server.bridge.run)
        await agent.ensure_started()
        yield server, nursery
        nursery.cancel_scope.cancel()


async def stats(client: RawClient) -> dict[str, Any]:
    result: dict[str, Any] = await client.call("_acp_server/stats")
    return result


# --- prompts and updates ----------------------------------------------------------------------------


async def test_e2e_agent_two_connections_prompt_and_share_updates() -> None:
    """Two connections prompt two sessions of one agent at once; a second connection on a session gets
    every update of the other's turns (and its prompt), with the same ``_meta.eventId``."""
    with trio.fail_after(TIMEOUT_S):
        async with agent_server() as (server, nursery):
            alice = await connect(server, nursery)
            bob = await connect(server, nursery)
            s1, alice_id = await alice.new_session(CWD)
            s2, _ = await bob.new_session(CWD)

            results: dict[str, Any] = {}

            async def run(client: Client, session_id: str, text: str) -> None:
                results[session_id] = await client.prompt(session_id, text)

            async with trio.open_nursery() as both:
                both.start_soon(run, alice, s1, "hello from alice")
                both.start_soon(run, bob, s2, "and bob  here")
            assert results[s1]["stopReason"] == results[s2]["stopReason"] == "end_turn"
            assert alice.agent_text(s1) == "hello from alice"
            assert bob.agent_text(s2) == "and bob  here"
            assert alice.updates(s2) == [] and bob.updates(s1) == []
            # The agent's own _meta stays inside the update; ours is on the notification.
            first = alice.updates(s1)[0]
            assert first["update"]["_meta"] == {"fake": {"chunk": 0}}
            assert first["_meta"]["originatorClientId"] == alice_id

            joined = await bob.call("session/resume", {"sessionId": s1, "cwd": CWD})
            bob_id = joined["_meta"]["clientId"]
            a0, b0 = len(alice.updates(s1)), len(bob.updates(s1))
            assert b0 == 0  # resume without afterEventId replays nothing

            assert (await alice.prompt(s1, "second turn"))["stopReason"] == "end_turn"
            await bob.wait_until(lambda: bob.text_from(s1, b0) == "second turn")
            bob_turn = bob.updates(s1)[b0:]
            alice_turn = alice.updates(s1)[a0:]
            assert bob_turn[0]["update"] == {
                "sessionUpdate": "user_message_chunk",
                "content": {"type": "text", "text": "second turn"},
            }
            assert all(u["_meta"]["originatorClientId"] == alice_id for u in bob_turn)
            # Alice is not echoed her own prompt; the agent's chunks are the same messages for both.
            assert [u["update"]["sessionUpdate"] for u in alice_turn] == ["agent_message_chunk"] * 2
            assert bob_turn[1:] == alice_turn
            ids = [u["_meta"]["eventId"] for u in bob_turn]
            assert ids == list(range(ids[0], ids[0] + len(ids)))
            assert ids[0] > max(u["_meta"]["eventId"] for u in alice.updates(s1)[:a0])

            a1 = len(alice.updates(s1))
            assert (await bob.prompt(s1, "bob on one"))["stopReason"] == "end_turn"
            await alice.wait_until(lambda: alice.text_from(s1, a1) == "bob on one")
            assert alice.updates(s1)[a1]["update"]["content"]["text"] == "bob on one"
            assert all(u["_meta"]["originatorClientId"] == bob_id for u in alice.updates(s1)[a1:])
            assert alice.errors == [] and bob.errors == []


async def test_e2e_agent_permission_and_fs_go_to_the_prompting_connection() -> None:
    """The agent's permission request reaches the connection whose prompt runs (never the other attached
    one), with our session id; its answer reaches the agent. fs is relayed only to a client that
    advertised it, else refused to the agent (-32601)."""
    path = "/work/notes.txt"
    with trio.fail_after(TIMEOUT_S):
        async with agent_server("--ask-permission", "--read-file", path) as (server, nursery):
            capable = await connect(server, nursery, FS_CAPS)
            plain = await connect(server, nursery)
            sid, _ = await capable.new_session(CWD)
            await plain.call("session/resume", {"sessionId": sid, "cwd": CWD})

            pending = await send_prompt(capable, nursery, sid, "from capable")
            ask = await capable.next_request(PERMISSION)
            assert ask["params"]["sessionId"] == sid
            assert ask["params"]["toolCall"]["toolCallId"] == "call-1"
            assert [o["optionId"] for o in ask["params"]["options"]] == ["allow", "deny"]
            await capable.answer(ask, {"outcome": {"outcome": "selected", "optionId": "allow"}})
            read = await capable.next_request("fs/read_text_file")
            assert read["params"] == {"sessionId": sid, "path": path}
            await capable.answer(read, {"content": "hello"})
            assert (await pending.wait())["result"]["stopReason"] == "end_turn"
            assert capable.agent_text(sid) == "permission:allow file:hello from capable"
            assert plain.requests_from_server == []

            start = len(plain.updates(sid))
            pending = await send_prompt(plain, nursery, sid, "from plain")
            ask = await plain.next_request(PERMISSION)
            assert ask["params"]["sessionId"] == sid
            await plain.answer(ask, {"outcome": {"outcome": "selected", "optionId": "deny"}})
            assert (await pending.wait())["result"]["stopReason"] == "end_turn"
            assert plain.text_from(sid, start) == "permission:deny read-error:-32601 from plain"
            # Nothing of the second turn was asked of the first connection; nobody was asked fs for it.
            assert [r["method"] for r in capable.requests_from_server] == [PERMISSION, "fs/read_text_file"]
            assert [r["method"] for r in plain.requests_from_server] == [PERMISSION]
            assert capable.errors == [] and plain.errors == []


# --- failures ---------------------------------------------------------------------------------------


async def test_e2e_agent_crash_fails_each_affected_prompt_once_then_restarts() -> None:
    """The agent dying mid-prompt answers each running and queued prompt on it with one schema-valid
    backend_unavailable (reason exited, exit code 3); pending counts and leases return to 0; the next
    prompts restart the agent and work."""
    capacity = CapacityManager({AGENT: PoolLimits(max_active=2, max_waiting=2)})
    with trio.fail_after(TIMEOUT_S):
        async with agent_server("--crash-on-prompt", capacity=capacity) as (server, nursery):
            alice = await connect(server, nursery)
            bob = await connect(server, nursery)
            s1, _ = await alice.new_session(CWD)
            first = await bob.call("session/new", {"cwd": CWD, "mcpServers": []})
            s2 = first["sessionId"]

            held = await send_prompt(bob, nursery, s2, "hold on")
            await bob.wait_until(lambda: "holding" in bob.agent_text(s2))
            queued2 = await send_prompt(bob, nursery, s2, "queued behind the hold")
            # The crash and a prompt queued behind it on the same session arrive in one read.
            crash_id, crash_rx = alice.start_request("session/prompt")
            queued_id, queued_rx = alice.start_request("session/prompt")
            lines = b"".join(
                json.dumps(
                    {
                        "jsonrpc": "2.0",
                        "id": rid,
                        "method": "session/prompt",
                        "params": {"sessionId": s1, "prompt": [{"type": "text", "text": text}]},
                    }
                ).encode()
                + b"\n"
                for rid, text in ((crash_id, "crash now"), (queued_id, "queued behind the crash"))
            )
            await alice.send_raw(lines)

            answers = {
                (s1, "running"): (await crash_rx.receive())["error"],
                (s1, "queued"): (await queued_rx.receive())["error"],
                (s2, "running"): (await held.wait())["error"],
                (s2, "queued"): (await queued2.wait())["error"],
            }
            prompt_ids = set()
            for (session_id, _), error in answers.items():
                assert error["code"] == -32007
                prompt_ids.add(error["data"].pop("promptId"))  # each names the prompt it ends
                assert error["data"] == {
                    "errorKind": "backend_unavailable",
                    "backendId": AGENT,
                    "sessionId": session_id,
                    "reason": "exited",
                    "exitCode": 3,
                }
            assert len(prompt_ids) == 4 and all(p.startswith("prompt_") for p in prompt_ids)
            assert (await stats(alice))["bridge"]["pendingPrompts"] == 0
            assert all(s.pending_count == 0 for s in server.bridge.sessions.values())

            # The next prompts restart the agent (a new process) and run.
            assert (await alice.prompt(s1, "after the crash"))["stopReason"] == "end_turn"
            assert (await bob.prompt(s2, "me too"))["stopReason"] == "end_turn"
            assert alice.agent_text(s1).endswith("after the crash")
            assert bob.agent_text(s2).endswith("me too")
            again = await bob.call("session/new", {"cwd": CWD, "mcpServers": []})
            assert again["_meta"]["fake"]["pid"] != first["_meta"]["fake"]["pid"]

            # Exactly one answer per prompt; every count back to zero.
            for client in (alice, bob):
                assert all(len(replies) == 1 for replies in responses_by_id(client).values())
            assert len(alice.errors) == 2 and len(bob.errors) == 2
            now = await stats(alice)
            assert now["bridge"]["pendingPrompts"] == 0
            pool = now["pools"][AGENT]
            assert (pool["active"], pool["waiting"], pool["leased"]) == (0, 0, 0)


async def test_e2e_agent_ignoring_cancel_is_freed_by_the_deadline() -> None:
    """A prompt whose agent ignores session/cancel answers prompt_deadline_exceeded at its deadline and
    frees its slot at once; the session's next prompt waits for the abandoned call only as long as the
    backend's cancel grace (2 s), then completes."""
    deadline_s = 1.0
    grace_s = AcpAgentBackend(AGENT, ["unused"]).cancel_grace_s
    assert grace_s == 2.0
    limits = Limits(max_pending_prompts_per_session=1, prompt_deadline_ms=30_000)
    with trio.fail_after(TIMEOUT_S):
        async with agent_server("--ignore-cancel", limits=limits) as (server, nursery):
            client = await connect(server, nursery)
            sid, _ = await client.new_session(CWD)
            start = trio.current_time()
            params = {
                "sessionId": sid,
                "prompt": [{"type": "text", "text": "hold forever"}],
                "_meta": {"deadlineMs": int(deadline_s * 1000)},  # shortens the server's 30 s
            }
            reply = await client.call_raw("session/prompt", params)
            expired = trio.current_time() - start
            error = reply["error"]
            assert error["code"] == -32004
            assert error["data"]["errorKind"] == "prompt_deadline_exceeded"
            assert error["data"]["sessionId"] == sid and error["data"]["deadlineMs"] == 1000
            assert error["data"]["elapsedMs"] >= 1000
            assert deadline_s <= expired < deadline_s + 2.0
            # Its slot is free: with one slot per session the next prompt is admitted, not refused.
            assert server.bridge.sessions[sid].pending_count == 0
            assert (await stats(client))["bridge"]["pendingPrompts"] == 0
            assert (await client.prompt(sid, "next one"))["stopReason"] == "end_turn"
            done = trio.current_time() - start
            assert client.agent_text(sid).endswith("next one")
            assert deadline_s + grace_s * 0.9 <= done < deadline_s + grace_s + 5
            assert (await stats(client))["bridge"]["pendingPrompts"] == 0


async def test_e2e_agent_stderr_flood_does_not_stall() -> None:
    """An agent writing 1 MiB to stderr at start and during each prompt still serves two clients."""
    with trio.fail_after(TIMEOUT_S):
        async with agent_server("--stderr-bytes", str(1024 * 1024)) as (server, nursery):
            alice = await connect(server, nursery)
            bob = await connect(server, nursery)
            s1, _ = await alice.new_session(CWD)
            s2, _ = await bob.new_session(CWD)
            async with trio.open_nursery() as both:
                for client, sid in ((alice, s1), (bob, s2), (alice, s1)):
                    both.start_soon(client.prompt, sid, f"through the flood {sid[-4:]}")
            assert alice.agent_text(s1) == f"through the flood {s1[-4:]}" * 2
            assert bob.agent_text(s2) == f"through the flood {s2[-4:]}"


# --- backends, authentication, errors, _meta ---------------------------------------------------------


async def test_e2e_agent_backend_choice_auth_errors_and_meta() -> None:
    """``_meta.backend`` picks the backend (an unknown one is -32602 naming the known ones);
    initialize advertises the default agent's authMethods and authenticate is forwarded; an agent's
    error is agent_error; our own ``_meta`` keys never reach the agent while others pass through."""
    failing = AcpAgentBackend("failing", agent_command("--prompt-error"), cwd=CWD)
    others: dict[str, Backend] = {"echo": EchoBackend(), "failing": failing}
    with trio.fail_after(TIMEOUT_S):
        async with agent_server("--require-auth", others=others) as (server, nursery):
            client_end, server_end = trio.testing.memory_stream_pair()
            nursery.start_soon(server.handle_stream, server_end, "test")
            client = Client(client_end)
            nursery.start_soon(client.pump)
            init = await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            assert init["authMethods"] == [{"id": "fake-login", "name": "Fake login"}]

            try:
                await client.new_session(CWD)
            except RpcError as exc:
                assert exc.code == -32000
                assert exc.data == {"errorKind": "auth_required", "backendId": AGENT}
            else:
                raise AssertionError("session/new before authenticate succeeded")

            try:
                await client.new_session(CWD, backend="nope")
            except RpcError as exc:
                assert exc.code == -32602 and exc.kind == "invalid_params"
                assert exc.data["path"] == "_meta.backend"
                assert "'nope'" in exc.data["detail"] and "agent, echo, failing" in exc.data["detail"]
                assert "agent, echo, failing" in exc.error["message"]
            else:
                raise AssertionError("an unknown backend was accepted")

            echo_session = await client.call(
                "session/new", {"cwd": CWD, "mcpServers": [], "_meta": {"backend": "echo"}}
            )
            assert echo_session["_meta"]["backend"] == "echo"
            assert (await client.prompt(echo_session["sessionId"], "plain echo"))["stopReason"] == "end_turn"
            assert client.agent_text(echo_session["sessionId"]) == "plain echo"

            try:
                await client.call("authenticate", {"methodId": "no-such-method"})
            except RpcError as exc:
                assert exc.code == -32012 and exc.data["agentCode"] == -32602
            else:
                raise AssertionError("the agent accepted an unknown auth method")
            assert await client.call("authenticate", {"methodId": "fake-login"}) == {}
            created = await client.call("session/new", {"cwd": CWD, "mcpServers": []})
            assert created["_meta"]["backend"] == AGENT and created["_meta"]["fake"]["pid"] > 0
            sid, client_id = created["sessionId"], created["_meta"]["clientId"]

            ours = {"clientId": client_id, "deadlineMs": 20_000, "backend": "echo", "idempotencyKey": "key-1"}
            theirs = {"trace": "t-1", "nested": {"a": [1, 2]}}
            assert (await client.prompt(sid, "with meta", **ours, **theirs))["stopReason"] == "end_turn"
            assert client.agent_text(sid) == f"meta:{json.dumps(theirs, sort_keys=True)} with meta"

            failing_sid, _ = await client.new_session(CWD, backend="failing")
            try:
                await client.prompt(failing_sid, "boom")
            except RpcError as exc:
                assert exc.code == -32012 and exc.kind == "agent_error"
                assert exc.data["backendId"] == "failing"
                assert exc.data["agentCode"] == -32042
                assert exc.data["agentMessage"] == "fake prompt failure"
                assert exc.data["agentData"]["flag"] == "prompt-error"
                assert exc.data["agentData"]["sessionId"].startswith("fake-")  # the agent's own id
                assert_error_valid(exc.error)
            else:
                raise AssertionError("the failing agent's prompt succeeded")
            assert (await stats(client))["bridge"]["pendingPrompts"] == 0


# --- the command line -------------------------------------------------------------------------------


@asynccontextmanager
async def serve_process(*args: str) -> AsyncIterator[tuple[Client, trio.Process]]:
    """``python -m acp_server serve --listen tcp://127.0.0.1:0 ARGS`` (cwd: the repository, so that
    ``-m tests.agents.fake_agent`` resolves) and an initialized client over TCP; killed on exit."""
    command = [sys.executable, "-m", "acp_server", "serve", "--listen", "tcp://127.0.0.1:0", *args]
    proc = await trio.lowlevel.open_process(
        command, cwd=CWD, env=dict(os.environ), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        stderr = proc.stderr
        buf = b""
        prefix = b"acp-server: listening on tcp://"
        while prefix not in buf or not buf.endswith(b"\n"):
            data = await stderr.receive_some(65536)
            assert data, f"the server ended before listening: {buf.decode(errors='replace')}"
            buf += data
        host, port = buf[buf.index(prefix) + len(prefix) :].split(b"\n", 1)[0].decode().rsplit(":", 1)
        async with trio.open_nursery() as nursery:

            async def drain() -> None:  # the server's log must never fill its pipe
                while await stderr.receive_some(65536):
                    pass

            nursery.start_soon(drain)
            stream = await trio.open_tcp_stream(host, int(port))
            client = Client(stream)
            nursery.start_soon(client.pump)
            try:
                await client.initialize()
                yield client, proc
            finally:
                await stream.aclose()
                if proc.returncode is None:
                    proc.kill()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if proc.stderr is not None:
                await proc.stderr.aclose()


async def test_e2e_agent_cli_serves_an_agent_after_double_dash() -> None:
    """``acp-server serve --listen tcp://127.0.0.1:0 -- python -m tests.agents.fake_agent`` serves a
    prompt end to end over TCP, the agent being the default backend; SIGTERM exits 0."""
    with trio.fail_after(TIMEOUT_S):
        async with serve_process("--", *agent_command()) as (client, proc):
            caps = await client.call("_acp_server/capabilities")
            assert caps["defaultBackend"] == AGENT
            assert caps["backends"][AGENT] == {"kind": "acp", "maxActive": None, "maxWaiting": None}
            created = await client.call("session/new", {"cwd": CWD, "mcpServers": []})
            assert created["_meta"]["backend"] == AGENT and created["_meta"]["fake"]["pid"] > 0
            result = await client.prompt(created["sessionId"], "over tcp  and back")
            assert result["stopReason"] == "end_turn"
            assert client.agent_text(created["sessionId"]) == "over tcp  and back"
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
