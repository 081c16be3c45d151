"""The client SDK against the real server: sessions, prompts and their update streams, the server's
requests answered by hooks, cancelling one's own prompt only, and every transport the client speaks.

The other ``test_client_*`` files import :func:`client_for` and :class:`Recorder` from here.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends.base import BaseBackend, ClientRequestError, Turn
from acp_server.client import Client, Hooks, RpcError, SessionClient, Update, connect
from acp_server.client.client import Target
from acp_server.errors import AcpError, InvalidParamsError
from acp_server.server import Server
from acp_server.transports import serve_tcp, serve_unix
from acp_server.types.acp import AgentMessageChunk, StopReason, TextContent

from .fakes import FakeBackend
from .helpers import connect as raw_connect
from .helpers import running_server

TIMEOUT_S = 10


@asynccontextmanager
async def client_for(server: Server, nursery: trio.Nursery, **options: Any) -> AsyncIterator[Client]:
    """An SDK client connected to ``server`` over an in-memory stream pair."""
    client_end, server_end = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle_stream, server_end, "sdk")
    async with connect(client_end, **options) as client:
        yield client


class Recorder:
    """Wraps entries of the server's method table to record what each request arrived with (the
    server stays real: the wrapped handler runs as before unless a test injects a failure).

    Attributes:
        seen: method -> the decoded params of every request, in arrival order.
        times: method -> the trio time each arrived.
    """

    def __init__(self, server: Server, *methods: str) -> None:
        self.seen: dict[str, list[Any]] = {m: [] for m in methods}
        self.times: dict[str, list[float]] = {m: [] for m in methods}
        self.arrived = trio.Event()
        self._fail: dict[str, list[AcpError]] = {}
        self._hold: dict[str, trio.Event] = {}
        table = server.dispatcher.requests
        for name in methods:
            table[name] = table[name]._replace(handler=self._wrap(name, table[name].handler))

    def fail_next(self, method: str, error: AcpError) -> None:
        """The next request of ``method`` is refused with ``error`` (after being recorded)."""
        self._fail.setdefault(method, []).append(error)

    def hold_next(self, method: str) -> trio.Event:
        """The next request of ``method`` waits for the returned event before it is handled."""
        gate = self._hold[method] = trio.Event()
        return gate

    def _wrap(self, name: str, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def wrapped(ctx: Any, params: Any) -> Any:
            self.seen[name].append(params)
            self.times[name].append(trio.current_time())
            self.arrived.set()
            self.arrived = trio.Event()
            failures = self._fail.get(name)
            if failures:
                raise failures.pop(0)
            gate = self._hold.pop(name, None)
            if gate is not None:
                return _after(gate, handler, ctx, params)
            return handler(ctx, params)

        return wrapped

    def count(self, method: str) -> int:
        return len(self.seen[method])

    def metas(self, method: str) -> list[dict[str, Any]]:
        """The ``_meta`` of every request of ``method`` (``{}`` when it had none)."""
        return [dict(p.meta or {}) for p in self.seen[method]]

    async def wait_for(self, method: str, count: int) -> None:
        while self.count(method) < count:
            await self.arrived.wait()


async def _after(gate: trio.Event, handler: Callable[[Any, Any], Any], ctx: Any, params: Any) -> Any:
    await gate.wait()
    out = handler(ctx, params)
    return (await out) if hasattr(out, "__await__") else out


async def collect_text(updates: Any, into: list[str], done: trio.Event, until: str) -> None:
    """Read agent text from an update stream until it ends with ``until``."""
    async for update in updates:
        if update.kind == "agent_message_chunk" and update.text:
            into.append(update.text)
            if "".join(into).endswith(until):
                done.set()


# --- sessions and prompts --------------------------------------------------------------------------


async def test_new_session_prompt_streams_updates_and_carries_client_id() -> None:
    """``session/new`` gives the client id; a prompt carries it (and an idempotency key) and its text
    streams through the session's async iterator of updates."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            rec = Recorder(server, "session/prompt")
            async with client_for(server, nursery) as client:
                session = await client.new_session("/tmp")
                assert session.client_id and session.client_id.startswith("client_")
                assert session.cwd == "/tmp"
                text: list[str] = []
                done = trio.Event()
                async with trio.open_nursery() as readers:
                    readers.start_soon(collect_text, session.updates, text, done, "hello world")
                    result = await session.prompt("hello world")
                    await done.wait()
                    readers.cancel_scope.cancel()
                assert result.stop_reason == "end_turn"
                assert "".join(text) == "hello world"
                (meta,) = rec.metas("session/prompt")
                assert meta["clientId"] == session.client_id
                assert meta["idempotencyKey"].startswith("idem_")
                # The enclosing trio deadline is the caller's: its remainder goes as the budget.
                assert 0 < meta["deadlineMs"] <= TIMEOUT_S * 1000
                await session.prompt("again", meta={"extra": 1})
                assert rec.metas("session/prompt")[1]["idempotencyKey"] != meta["idempotencyKey"]
                assert rec.metas("session/prompt")[1]["extra"] == 1


async def test_load_replays_history_into_the_update_stream() -> None:
    """``session/load`` from a second connection replays the history, with event ids, before it
    answers; the loading client gets a client id of its own."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            async with client_for(server, nursery) as first, client_for(server, nursery) as second:
                session = await first.new_session("/tmp")
                await session.prompt("one two")
                loaded = await second.load_session(session.session_id, "/tmp")
                assert loaded.client_id != session.client_id
                replay: list[Update] = loaded.updates.drain_nowait()
                kinds = [u.kind for u in replay]
                assert kinds[0] == "user_message_chunk"
                assert "".join(u.text or "" for u in replay if u.kind == "agent_message_chunk") == "one two"
                ids = [u.event_id for u in replay]
                assert ids == sorted(ids) and None not in ids


async def test_list_fork_heartbeat_detach_and_close() -> None:
    """The session calls beyond prompting: list, fork (a new session held by this client),
    heartbeat, detach, and close (which ends the session's update stream)."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            async with client_for(server, nursery) as client:
                session = await client.new_session("/tmp")
                await session.prompt("seed")
                branch = await session.fork()
                assert branch.session_id != session.session_id and branch.client_id
                listed = {info.session_id for info in await client.list_sessions()}
                assert {session.session_id, branch.session_id} <= listed
                beat = await session.heartbeat()
                assert beat["clientId"] == session.client_id
                await branch.detach()
                assert branch.client_id not in server.bridge.get(branch.session_id).clients
                await session.close()
                leftover = [u.kind async for u in session.updates]  # ends: the session is closed
                assert "agent_message_chunk" in leftover and session.updates.closed
                assert session.session_id not in {info.session_id for info in await client.list_sessions()}


async def test_cancelling_the_caller_cancels_only_that_request() -> None:
    """A cancelled caller sends ``$/cancel_request`` for its own prompt: another client's prompt queued
    behind it in the same session still runs (``session/cancel`` would have ended it too)."""
    backend = FakeBackend()
    backend.hold("mine")
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=backend) as (server, nursery):
            cancels: list[Any] = []
            table = server.dispatcher.notifications
            original = table["session/cancel"].handler
            table["session/cancel"] = table["session/cancel"]._replace(
                handler=lambda ctx, params: (cancels.append(params), original(ctx, params))
            )
            async with client_for(server, nursery) as me, client_for(server, nursery) as other:
                mine = await me.new_session("/tmp")
                theirs = await other.resume_session(mine.session_id, "/tmp")
                outcome: dict[str, Any] = {}

                async def their_prompt() -> None:
                    outcome["theirs"] = await theirs.prompt("theirs")

                async with trio.open_nursery() as tasks:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(mine.prompt, "mine")
                        await backend.started("mine")
                        tasks.start_soon(their_prompt)  # queued behind mine in the session's FIFO
                        await trio.testing.wait_all_tasks_blocked()
                        assert server.bridge.get(mine.session_id).pending_count == 2
                        inner.cancel_scope.cancel()
                assert outcome["theirs"].stop_reason == "end_turn"
                (call,) = backend.calls_of("mine")
                assert call.outcome == "cancelled"
                assert cancels == []
                assert mine.pending_prompts == 0


# --- hooks -------------------------------------------------------------------------------------------


class AskingBackend(BaseBackend):
    """Asks its client for a permission and a file mid-turn, and says what it got."""

    name = "asking"

    async def prompt(self, turn: Turn) -> StopReason:
        assert turn.client is not None
        answers: list[str] = []
        permission = await turn.client.request(
            "session/request_permission",
            {"sessionId": turn.session_id, "toolCall": {"toolCallId": "t1"}, "options": [
                {"optionId": "yes", "name": "Allow", "kind": "allow_once"}]},
        )
        answers.append(f"permission={permission['outcome']}")
        answers.append(f"fs-advertised={turn.client.capabilities.fs.read_text_file}")
        try:
            read = await turn.client.request("fs/read_text_file", {"sessionId": turn.session_id, "path": "/etc/x"})
            answers.append(f"read={read['content']}")
        except ClientRequestError as exc:
            answers.append(f"read-error={exc.error['code']}")
        turn.emit(AgentMessageChunk(content=TextContent(text="; ".join(answers))))
        return "end_turn"


async def _agent_text(session: SessionClient) -> str:
    return "".join(u.text or "" for u in session.updates.drain_nowait() if u.kind == "agent_message_chunk")


async def test_hooks_default_to_cancelled_permission_and_refused_fs() -> None:
    """Without hooks a permission is answered ``cancelled`` and file access is neither advertised nor
    granted (refused as an unknown method)."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=AskingBackend()) as (server, nursery):
            async with client_for(server, nursery) as client:
                session = await client.new_session("/tmp")
                await session.prompt("go")
                text = await _agent_text(session)
                assert text == "permission={'outcome': 'cancelled'}; fs-advertised=False; read-error=-32601"


async def test_hooks_answer_the_servers_requests() -> None:
    """Given hooks, the client advertises file access and answers with what the hooks return; a hook
    raising an ``AcpError`` answers that error."""
    seen: list[dict[str, Any]] = []

    async def allow(params: dict[str, Any]) -> Any:
        seen.append(params)
        return {"outcome": {"outcome": "selected", "optionId": params["options"][0]["optionId"]}}

    async def read(params: dict[str, Any]) -> Any:
        return {"content": f"contents of {params['path']}"}

    async def refuse(params: dict[str, Any]) -> Any:
        raise InvalidParamsError(path="path", detail="not allowed here")

    with trio.fail_after(TIMEOUT_S):
        async with running_server(backend=AskingBackend()) as (server, nursery):
            async with client_for(server, nursery, hooks=Hooks(request_permission=allow, read_text_file=read)) as client:
                session = await client.new_session("/tmp")
                await session.prompt("go")
                text = await _agent_text(session)
                assert text == (
                    "permission={'outcome': 'selected', 'optionId': 'yes'}; fs-advertised=True; read=contents of /etc/x"
                )
                assert seen[0]["sessionId"] == session.session_id
            async with client_for(server, nursery, hooks=Hooks(read_text_file=refuse)) as client:
                session = await client.new_session("/tmp")
                await session.prompt("go")
                assert (await _agent_text(session)).endswith("read-error=-32602")


# --- limits from the server, checked -------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_limit", "requested", "expected"),
    [(2, None, 2), (0, None, None), (2, 0, None), (2, 7, 7), (0, 3, 3)],
)
async def test_local_limit_defaults_to_the_servers(server_limit: int, requested: int | None, expected: int | None) -> None:
    """The local limit is the server's ``maxPendingPromptsPerSession`` (``null``: disabled) unless the
    caller gives one (0 disables it)."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server(Limits(max_pending_prompts_per_session=server_limit)) as (server, nursery):
            async with client_for(server, nursery, max_pending_prompts=requested) as client:
                assert client.max_pending_prompts == expected
                assert (await client.new_session("/tmp")).prompt_limit == expected


async def test_local_limit_falls_back_to_capabilities_and_refuses_a_fraction() -> None:
    """Without limits in ``initialize`` the client asks ``_acp_server/capabilities``; a negative or
    fractional limit, from the caller or the server, is a ``ValueError``."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server(Limits(max_pending_prompts_per_session=3)) as (server, nursery):
            rec = Recorder(server, "_acp_server/capabilities")
            table = server.dispatcher.requests
            initialize = table["initialize"].handler

            def bare(ctx: Any, params: Any) -> Any:
                result = initialize(ctx, params)
                result.agent_capabilities.meta = None
                return result

            table["initialize"] = table["initialize"]._replace(handler=bare)
            async with client_for(server, nursery) as client:
                assert client.max_pending_prompts == 3
                assert rec.count("_acp_server/capabilities") == 1
            for bad in (-1, 1.5):
                with pytest.raises(ValueError, match="non-negative integer"):
                    async with client_for(server, nursery, max_pending_prompts=bad):
                        pass  # pragma: no cover

            def fractional(ctx: Any, params: Any) -> Any:
                result = initialize(ctx, params)
                result.agent_capabilities.meta = {"limits": {"maxPendingPromptsPerSession": 2.5}}
                return result

            table["initialize"] = table["initialize"]._replace(handler=fractional)
            with pytest.raises(ValueError, match="maxPendingPromptsPerSession"):
                async with client_for(server, nursery):
                    pass  # pragma: no cover


async def test_a_server_error_is_raised_with_its_kind_outside_the_client_block() -> None:
    """A server error leaves ``async with connect(...)`` as itself (not wrapped in an exception group)."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            with pytest.raises(RpcError) as info:
                async with client_for(server, nursery) as client:
                    await client.use_session("sess_missing", client_id=None, cwd="/tmp").prompt("x")
            assert info.value.kind == "session_not_found" and info.value.code == -32002
            assert not info.value.local


# --- transports ----------------------------------------------------------------------------------


@pytest.fixture
def sock_dir() -> Any:
    path = Path(tempfile.mkdtemp(prefix="acpc-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("transport", ["tcp", "unix", "command"])
async def test_every_transport_carries_a_prompt(transport: str, sock_dir: Path) -> None:
    """``tcp://``, ``unix:`` and a spawned ``acp-server serve --stdio`` all carry a whole exchange."""
    with trio.fail_after(TIMEOUT_S * 2):
        async with running_server() as (server, nursery):
            target: Target
            if transport == "tcp":
                (listener, *_) = await nursery.start(partial(serve_tcp, host="127.0.0.1"), server.handle_stream, 0)
                target = f"tcp://127.0.0.1:{listener.socket.getsockname()[1]}"
            elif transport == "unix":
                path = str(sock_dir / "s.sock")
                await nursery.start(serve_unix, server.handle_stream, path)
                target = f"unix:{path}"
            else:
                target = [sys.executable, "-m", "acp_server", "serve", "--stdio"]
            async with connect(target) as client:
                session = await client.new_session("/tmp")
                result = await session.prompt("over the wire")
                assert result.stop_reason == "end_turn"
                assert await _agent_text(session) == "over the wire"


async def test_raw_client_sees_the_same_server() -> None:
    """The SDK and a raw JSON-RPC client share sessions on one server (the SDK speaks plain ACP)."""
    with trio.fail_after(TIMEOUT_S):
        async with running_server() as (server, nursery):
            raw = await raw_connect(server, nursery)
            session_id, _ = await raw.new_session("/tmp")
            async with client_for(server, nursery) as client:
                session = await client.resume_session(session_id, "/tmp")
                assert (await session.prompt("shared")).stop_reason == "end_turn"
            assert raw.agent_text(session_id) == "shared"
