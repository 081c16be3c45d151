"""The ACP subprocess backend driven directly, against a fake agent written with the official SDK.

Each test spawns ``tests/agents/fake_agent.py`` (``python -m tests.agents.fake_agent``) behind an
:class:`AcpAgentBackend` and plays the clients with :class:`FakeClient`, a scripted ``ClientChannel``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.backends import AcpAgentBackend, ClientGoneError, ClientRequestError, Turn
from acp_server.backends.acp_agent import restart_delay
from acp_server.errors import AgentError, AuthRequiredError, BackendUnavailableError
from acp_server.types.acp import ClientCapabilities, FileSystemCapability, TextContent

from .helpers import ROOT, assert_error_valid

NAME = "fake"
#: generous: a spawn imports the SDK (about a second of CPU on a busy 2-core machine)
TIMEOUT_S = 30
PERMISSION = "session/request_permission"
ALLOW = {"outcome": {"outcome": "selected", "optionId": "allow"}}
DENY = {"outcome": {"outcome": "selected", "optionId": "deny"}}

Responder = Callable[[str, Any], Awaitable[Any]]


def agent_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "tests.agents.fake_agent", *flags]


@asynccontextmanager
async def running(
    *flags: str, command: list[str] | None = None, **kwargs: Any
) -> AsyncIterator[AcpAgentBackend]:
    """An AcpAgentBackend over the fake agent with ``flags``, its ``run()`` hosted in a nursery."""
    backend = AcpAgentBackend(NAME, command or agent_command(*flags), cwd=str(ROOT), **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        yield backend
        nursery.cancel_scope.cancel()


class FakeClient:
    """A ClientChannel: records each relayed request and answers it with ``respond(method, params)``."""

    def __init__(self, *, fs: bool = False, terminal: bool = False, respond: Responder | None = None) -> None:
        self.capabilities = ClientCapabilities(
            fs=FileSystemCapability(read_text_file=fs, write_text_file=fs), terminal=terminal
        )
        self.respond = respond
        self.requests: list[tuple[str, Any]] = []
        self.asked = trio.Event()
        self.cancelled = False

    async def request(self, method: str, params: Any) -> Any:
        self.requests.append((method, params))
        self.asked.set()
        assert self.respond is not None, f"unexpected relayed request {method}"
        try:
            return await self.respond(method, params)
        except trio.Cancelled:
            self.cancelled = True
            raise


def answer(result: Any) -> Responder:
    async def respond(method: str, params: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return result

    return respond


def fail_with(exc: Exception) -> Responder:
    async def respond(method: str, params: Any) -> Any:
        await trio.lowlevel.checkpoint()
        raise exc

    return respond


async def never_answer(method: str, params: Any) -> Any:
    await trio.sleep_forever()


class Recorder:
    """An ``emit``: collects updates; ``seen(text)`` waits until a chunk containing ``text`` arrived."""

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []
        self._changed = trio.Event()

    def __call__(self, update: dict[str, Any]) -> None:
        self.updates.append(update)
        self._changed.set()
        self._changed = trio.Event()

    @property
    def text(self) -> str:
        return "".join(
            u["content"]["text"] for u in self.updates if u.get("sessionUpdate") == "agent_message_chunk"
        )

    async def seen(self, text: str) -> None:
        while text not in self.text:
            await self._changed.wait()


def make_turn(
    session_id: str, text: str, client: FakeClient | None = None, meta: dict[str, Any] | None = None
) -> Turn:
    return Turn(session_id, f"prompt_{session_id}", [TextContent(text=text)], Recorder(), client, meta)


def recorder(turn: Turn) -> Recorder:
    assert isinstance(turn.emit, Recorder)
    return turn.emit


async def open_session(backend: AcpAgentBackend, session_id: str) -> tuple[Recorder, Any]:
    emit = Recorder()
    setup = await backend.open_session(session_id, str(ROOT), [], emit)
    return emit, setup


class LineWatcher(logging.Handler):
    """Sets an event when a log record containing ``needle`` is emitted (the agent's stderr, drained)."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.INFO)
        self.needle = needle
        self.found = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.found.set()


# --- multiplexing, updates, lifecycle calls ----------------------------------------------------------


async def test_acp_agent_multiplexes_two_clients_on_one_child() -> None:
    """Two sessions of two clients share one child: each turn gets its own echo, meta passes both ways."""
    with trio.fail_after(TIMEOUT_S):
        async with running() as backend:
            await backend.ensure_started()
            offered = backend.agent_capabilities["_meta"]["clientCapabilities"]
            assert offered["fs"] == {"readTextFile": True, "writeTextFile": True}
            assert offered["terminal"] is True
            assert backend.auth_methods == []

            _, setup1 = await open_session(backend, "s1")
            _, setup2 = await open_session(backend, "s2")
            assert setup1.meta["fake"]["pid"] == setup2.meta["fake"]["pid"]  # one child
            assert setup1.modes["currentModeId"] == "ask"
            assert [m["id"] for m in setup1.modes["availableModes"]] == ["ask", "code"]

            turn1 = make_turn("s1", "hello  from one", FakeClient(), meta={"trace": "t-1"})
            turn2 = make_turn("s2", "and two\tthere ", FakeClient())
            stops: dict[str, str] = {}

            async def run(turn: Turn) -> None:
                stops[turn.session_id] = await backend.prompt(turn)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, turn1)
                nursery.start_soon(run, turn2)
            assert stops == {"s1": "end_turn", "s2": "end_turn"}
            assert recorder(turn1).text == 'meta:{"trace": "t-1"} hello  from one'
            assert recorder(turn2).text == "and two\tthere "
            # The child's _meta on an update passes through inside the update.
            first_word = recorder(turn2).updates[0]
            assert first_word["content"]["text"] == "and " and first_word["_meta"] == {"fake": {"chunk": 0}}


async def test_acp_agent_lifecycle_calls_reach_the_child(caplog: pytest.LogCaptureFixture) -> None:
    """set_mode's update outside a turn goes to the session's emit; cancelling a turn (as the bridge
    does: trio cancellation) sends session/cancel and the agent's answer ends it within the grace;
    close is sent."""
    watcher = LineWatcher("fake-agent closed")
    agent_log = logging.getLogger(f"acp_server.agent.{NAME}")
    agent_log.addHandler(watcher)
    caplog.set_level(logging.INFO, logger=agent_log.name)
    try:
        with trio.fail_after(TIMEOUT_S):
            async with running("--close-session") as backend:
                emit, _ = await open_session(backend, "s1")
                await backend.set_mode("s1", "code")
                assert emit.updates == [{"sessionUpdate": "current_mode_update", "currentModeId": "code"}]

                turn = make_turn("s1", "hold on", FakeClient())
                stop: list[str] = []
                async with trio.open_nursery() as nursery:
                    scope = trio.CancelScope()

                    async def run() -> None:
                        with scope:
                            stop.append(await backend.prompt(turn))

                    nursery.start_soon(run)
                    await recorder(turn).seen("holding")
                    started = trio.current_time()
                    scope.cancel()
                assert stop == [] and scope.cancelled_caught
                assert trio.current_time() - started < backend.cancel_grace_s
                assert not [r for r in caplog.records if "did not answer the cancelled prompt" in r.getMessage()]

                await backend.close_session("s1")
                await watcher.found.wait()
    finally:
        agent_log.removeHandler(watcher)


# --- relaying the child's requests ---------------------------------------------------------------------


async def test_acp_agent_permission_goes_to_the_prompting_client() -> None:
    """A permission request reaches the client whose turn it is, with our session id; its answer returns."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--ask-permission") as backend:
            await open_session(backend, "s1")
            await open_session(backend, "s2")
            alice = FakeClient(respond=answer(ALLOW))
            bob = FakeClient(respond=answer(DENY))
            turn1 = make_turn("s1", "one", alice)
            turn2 = make_turn("s2", "two", bob)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(backend.prompt, turn1)
                nursery.start_soon(backend.prompt, turn2)
            assert recorder(turn1).text == "permission:allow one"
            assert recorder(turn2).text == "permission:deny two"
            assert [(m, p["sessionId"]) for m, p in alice.requests] == [(PERMISSION, "s1")]
            assert [(m, p["sessionId"]) for m, p in bob.requests] == [(PERMISSION, "s2")]
            assert alice.requests[0][1]["toolCall"]["toolCallId"] == "call-1"


async def test_acp_agent_fs_request_relayed_only_when_advertised() -> None:
    """fs/read_text_file: refused to the child at once for a client without fs, else relayed (errors too).

    A request of a method we do not relay (``_fake/ping``) is refused with -32601 every time.
    """
    path = "/work/notes.txt"
    with trio.fail_after(TIMEOUT_S):
        async with running("--ext-request", "--read-file", path) as backend:
            await open_session(backend, "s1")

            no_fs = FakeClient(respond=answer({"content": "never"}))
            turn = make_turn("s1", "go", no_fs)
            assert await backend.prompt(turn) == "end_turn"
            assert recorder(turn).text == "ext-error:-32601 read-error:-32601 go"
            assert no_fs.requests == []

            with_fs = FakeClient(fs=True, respond=answer({"content": "hello"}))
            turn = make_turn("s1", "again", with_fs)
            assert await backend.prompt(turn) == "end_turn"
            assert recorder(turn).text == "ext-error:-32601 file:hello again"
            assert with_fs.requests == [("fs/read_text_file", {"sessionId": "s1", "path": path})]

            not_found = ClientRequestError({"code": -32002, "message": "no such file"})
            refusing = FakeClient(fs=True, respond=fail_with(not_found))
            turn = make_turn("s1", "third", refusing)
            assert await backend.prompt(turn) == "end_turn"
            assert recorder(turn).text == "ext-error:-32601 read-error:-32002 third"


async def test_acp_agent_open_requests_answered_when_client_leaves_or_prompt_ends() -> None:
    """A permission is answered ``cancelled`` if its client left or its prompt ended; no client: refused."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--ask-permission", cancel_grace_s=10.0) as backend:
            await open_session(backend, "s1")

            gone = FakeClient(respond=fail_with(ClientGoneError()))
            turn = make_turn("s1", "one", gone)
            assert await backend.prompt(turn) == "cancelled"
            assert recorder(turn).text == "permission:cancelled "

            silent = FakeClient(respond=never_answer)
            turn = make_turn("s1", "two", silent)
            start = trio.current_time()
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_once_asked() -> None:
                        await silent.asked.wait()
                        scope.cancel()

                    nursery.start_soon(cancel_once_asked)
                    await backend.prompt(turn)
            assert scope.cancelled_caught
            assert silent.cancelled
            # The child got the cancelled outcome and answered within the grace (well before 10 s).
            assert recorder(turn).text == "permission:cancelled "
            assert trio.current_time() - start < 8

            turn = make_turn("s1", "three", None)
            with pytest.raises(AgentError) as info:
                await backend.prompt(turn)
            assert info.value.payload.agent_code == -32603  # the child's prompt failed on our refusal


# --- the child's death, restarts, backoff ----------------------------------------------------------------


async def test_acp_agent_crash_fails_each_running_prompt_once_and_restarts() -> None:
    """A crash fails each running prompt once (exited, code 3), on_exit once; the next prompt restarts it."""
    exits: list[tuple[str, int | None]] = []
    with trio.fail_after(TIMEOUT_S):
        async with running("--crash-on-prompt") as backend:
            backend.on_exit = lambda name, code: exits.append((name, code))
            _, setup = await open_session(backend, "s1")
            await open_session(backend, "s2")
            errors: dict[str, list[BaseException]] = {"s1": [], "s2": []}

            async def run(turn: Turn) -> None:
                try:
                    await backend.prompt(turn)
                except BackendUnavailableError as exc:
                    errors[turn.session_id].append(exc)

            holder = make_turn("s2", "hold it", FakeClient())
            crasher = make_turn("s1", "crash now", FakeClient())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, holder)
                await recorder(holder).seen("holding")
                nursery.start_soon(run, crasher)
            assert recorder(crasher).text == "crashing "
            for session_id in ("s1", "s2"):
                [exc] = errors[session_id]
                assert isinstance(exc, BackendUnavailableError)
                data = exc.to_dict()["data"]
                assert data == {
                    "errorKind": "backend_unavailable",
                    "backendId": NAME,
                    "sessionId": session_id,
                    "reason": "exited",
                    "exitCode": 3,
                }
                assert_error_valid(exc.to_dict())
            assert exits == [(NAME, 3)]

            turn = make_turn("s1", "after restart", FakeClient())
            assert await backend.prompt(turn) == "end_turn"
            assert recorder(turn).text == "after restart"
            _, setup3 = await open_session(backend, "s3")
            assert setup3.meta["fake"]["pid"] != setup.meta["fake"]["pid"]
            assert exits == [(NAME, 3)]


async def test_acp_agent_reopens_with_session_load_without_replaying_history() -> None:
    """After a crash, an agent with loadSession gets session/load; its history replay reaches no one."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--crash-on-prompt", "--load-session") as backend:
            emit, _ = await open_session(backend, "s1")
            with pytest.raises(BackendUnavailableError):
                await backend.prompt(make_turn("s1", "crash", FakeClient()))
            turn = make_turn("s1", "back again", FakeClient())
            assert await backend.prompt(turn) == "end_turn"
            assert recorder(turn).text == "back again"
            everything = emit.updates + recorder(turn).updates
            assert not [u for u in everything if u.get("sessionUpdate") == "user_message_chunk"]


def test_acp_agent_restart_delay_doubles_to_a_cap() -> None:
    """The restart backoff: 0 s after one failure, then 0.5 s doubling, capped at 30 s."""
    assert [restart_delay(n) for n in range(1, 9)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert restart_delay(100) == 30.0


async def test_acp_agent_missing_binary_is_spawn_failed_with_backoff(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A missing binary is spawn_failed; retried at once, then refused unspawned until the backoff passed."""
    caplog.set_level(logging.INFO, logger="acp_server.backends.acp_agent")

    def spawns() -> int:
        return sum("starting agent" in r.getMessage() for r in caplog.records)

    with trio.fail_after(TIMEOUT_S):
        async with running(command=["/nonexistent/acp-agent-binary"]) as backend:
            with pytest.raises(BackendUnavailableError) as info:
                await backend.ensure_started()
            assert info.value.to_dict()["data"] == {
                "errorKind": "backend_unavailable",
                "backendId": NAME,
                "sessionId": None,
                "reason": "spawn_failed",
                "exitCode": None,
            }
            with pytest.raises(BackendUnavailableError) as info:
                await backend.open_session("s1", str(ROOT), [], Recorder())
            assert info.value.payload.session_id == "s1" and info.value.payload.reason == "spawn_failed"
            assert spawns() == 2
            with pytest.raises(BackendUnavailableError) as info:
                await backend.ensure_started()  # inside the 0.5 s backoff: refused at once
            assert info.value.payload.reason == "spawn_failed"
            assert spawns() == 2
            mock_clock.jump(0.5)
            with pytest.raises(BackendUnavailableError):
                await backend.ensure_started()
            assert spawns() == 3


async def test_acp_agent_failing_initialize_is_initialize_failed(mock_clock: trio.testing.MockClock) -> None:
    """An error answer to initialize, or an exit during it, is initialize_failed (with any exit code)."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--fail-initialize") as backend:
            for _ in range(2):
                with pytest.raises(BackendUnavailableError) as info:
                    await backend.ensure_started()
                assert info.value.payload.reason == "initialize_failed"
                assert info.value.payload.exit_code is None
            with pytest.raises(BackendUnavailableError) as info:
                await backend.open_session("s1", str(ROOT), [], Recorder())
            assert info.value.payload.reason == "initialize_failed" and info.value.payload.session_id == "s1"

        async with running(command=[sys.executable, "-c", "import sys; sys.exit(5)"]) as backend:
            with pytest.raises(BackendUnavailableError) as info:
                await backend.ensure_started()
            assert info.value.payload.reason == "initialize_failed"
            assert info.value.payload.exit_code == 5


# --- cancellation, stderr, errors ------------------------------------------------------------------------


async def test_acp_agent_ignored_cancel_does_not_hold_prompt_past_grace() -> None:
    """A trio-cancelled prompt re-raises after about the grace when the child ignores session/cancel."""
    grace = 0.5
    with trio.fail_after(TIMEOUT_S):
        async with running("--ignore-cancel", cancel_grace_s=grace) as backend:
            await open_session(backend, "s1")
            turn = make_turn("s1", "hold forever", FakeClient())
            cancelled_at: list[float] = []
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_once_holding() -> None:
                        await recorder(turn).seen("holding")
                        cancelled_at.append(trio.current_time())
                        scope.cancel()

                    nursery.start_soon(cancel_once_holding)
                    await backend.prompt(turn)
                    pytest.fail("prompt() returned from a held turn")
            held = trio.current_time() - cancelled_at[0]
            assert scope.cancelled_caught
            assert grace * 0.9 <= held < grace + 3
            # The child, still holding that turn, serves the other sessions.
            await open_session(backend, "s2")
            turn2 = make_turn("s2", "still here", FakeClient())
            assert await backend.prompt(turn2) == "end_turn"
            assert recorder(turn2).text == "still here"


async def test_acp_agent_stderr_flood_does_not_stall_prompts(caplog: pytest.LogCaptureFixture) -> None:
    """1 MiB of stderr at start and per prompt is drained into the log (long lines cut) without stalling."""
    logger = f"acp_server.agent.{NAME}"
    caplog.set_level(logging.INFO, logger=logger)
    with trio.fail_after(TIMEOUT_S):
        async with running("--stderr-bytes", str(1024 * 1024)) as backend:
            await open_session(backend, "s1")
            for text in ("first prompt", "second prompt"):
                turn = make_turn("s1", text, FakeClient())
                assert await backend.prompt(turn) == "end_turn"
                assert recorder(turn).text == text
    lines = [r.getMessage() for r in caplog.records if r.name == logger]
    assert sum(line == "x" * 99 for line in lines) > 10_000
    cut = [line for line in lines if line.startswith("LLLL")]
    assert cut and all(line.endswith(" [truncated]") and len(line) <= 4096 + 12 for line in cut)


async def test_acp_agent_auth_required_until_authenticate() -> None:
    """session/new answered -32000 becomes auth_required; authenticate is forwarded and then sessions open."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--require-auth") as backend:
            await backend.ensure_started()
            assert backend.auth_methods == [{"id": "fake-login", "name": "Fake login"}]
            with pytest.raises(AuthRequiredError) as info:
                await open_session(backend, "s1")
            assert info.value.to_dict()["data"] == {"errorKind": "auth_required", "backendId": NAME}
            assert_error_valid(info.value.to_dict())
            with pytest.raises(AgentError) as bad:
                await backend.authenticate("no-such-method", None)
            assert bad.value.payload.agent_code == -32602
            assert await backend.authenticate("fake-login", {"note": "hi"}) == {}
            _, setup = await open_session(backend, "s1")
            assert setup.meta["fake"]["pid"] > 0


async def test_acp_agent_error_maps_to_agent_error() -> None:
    """Any other error the child answers is agent_error carrying its code, message and data."""
    with trio.fail_after(TIMEOUT_S):
        async with running("--prompt-error") as backend:
            await open_session(backend, "s1")
            with pytest.raises(AgentError) as info:
                await backend.prompt(make_turn("s1", "boom", FakeClient()))
            error = info.value.to_dict()
            assert error["code"] == -32012
            assert error["data"]["errorKind"] == "agent_error"
            assert error["data"]["backendId"] == NAME
            assert error["data"]["agentCode"] == -32042
            assert error["data"]["agentMessage"] == "fake prompt failure"
            assert error["data"]["agentData"]["flag"] == "prompt-error"
            assert_error_valid(error)
