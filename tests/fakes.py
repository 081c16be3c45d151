"""Test doubles for the session bridge: a scripted fake :class:`~acp_server.backends.Backend` and a
fake :class:`~acp_server.bridge.Peer`.

The backend is scripted by the prompt's text (the text of its first block): by default a turn
echoes its words as ``agent_message_chunk`` updates, passing a few checkpoints so that turns run in
parallel would interleave, and ends with ``end_turn``. A text can instead be told to hold until
released, to hold while ignoring cancellation (a shielded wait), to take a fixed time, to ask its
sender for permission, to raise an :class:`~acp_server.errors.AcpError`, or to crash with a plain
exception; ``latency_s`` makes every unscripted prompt slow. Every call is recorded, with
the order and (trio clock) time of its start and its end.

Also here: ways to drive a bridge or a server in tests (:func:`running_bridge`, :func:`serving`, both
under a real-time :func:`hang_guard`), to send requests in a known order and await their answers
later (:func:`send_request`, :func:`send_prompt`), and to reach the server's end of a connection
(:func:`connect_shell`).
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends.base import BaseBackend, SessionSetup, Turn
from acp_server.backends.echo import split_words
from acp_server.bridge import PromptTicket, Session, SessionBridge
from acp_server.errors import AcpError
from acp_server.server import Server
from acp_server.transports import ConnectionShell
from acp_server.types.acp import AgentMessageChunk, ContentBlock, PromptResult, StopReason, TextContent

from .helpers import RawClient, connect, running_server

__all__ = [
    "Behaviour",
    "Call",
    "FakeBackend",
    "FakePeer",
    "ForkCall",
    "HANG_GUARD_S",
    "Pending",
    "admit_ticket",
    "connect_shell",
    "hang_guard",
    "open_session",
    "prompt_outcome",
    "prompt_text",
    "responses_by_id",
    "running_bridge",
    "send_prompt",
    "send_request",
    "serving",
    "text_blocks",
]


class Behaviour(enum.Enum):
    ECHO = "echo"
    HOLD = "hold"
    IGNORE_CANCEL = "ignore_cancel"
    DELAY = "delay"
    FAIL = "fail"
    CRASH = "crash"
    ASK = "ask"


def text_blocks(text: str) -> list[ContentBlock]:
    """A prompt of one text block, as the bridge receives it."""
    return [TextContent(text=text)]


async def open_session(bridge: SessionBridge, peer: Any, cwd: str = "/tmp") -> tuple[Session, str]:
    """``session/new`` through the bridge's public API: the session and the caller's client id."""
    session, client_id, _ = await bridge.open_session(cwd, [], peer)
    return session, client_id


def admit_ticket(bridge: SessionBridge, session_id: str, prompt: list[ContentBlock], **kwargs: Any) -> PromptTicket:
    """:meth:`SessionBridge.admit` returning only the ticket."""
    return bridge.admit(session_id, prompt, **kwargs)[0]


async def prompt_outcome(bridge: SessionBridge, ticket: PromptTicket) -> PromptResult:
    """Wait for the prompt's outcome as ``session/prompt`` does, through ``bridge.waiter``: the result,
    or raise its error. Cancelling the wait is the request's ``$/cancel_request`` (it cancels the prompt
    unless the prompt runs on for other connections)."""
    waiter = bridge.waiter(ticket)
    answers: list[tuple[Any, AcpError | None]] = []
    answered = trio.Event()

    def done(result: Any, error: AcpError | None) -> None:
        answers.append((result, error))
        answered.set()

    waiter.subscribe(done)
    try:
        await answered.wait()
    except trio.Cancelled:
        waiter.cancel(connection_lost=False)
        raise
    result, error = answers[0]
    if error is not None:
        raise error
    assert isinstance(result, PromptResult)
    return result


def prompt_text(prompt: Sequence[ContentBlock]) -> str:
    first = prompt[0] if prompt else None
    return first.text if isinstance(first, TextContent) else ""


class Call:
    """One ``prompt`` call of the fake backend.

    Attributes:
        outcome: ``None`` while running, then the stop reason, ``"cancelled"`` (trio cancellation
            reached the backend), ``"error"`` or ``"crash"``.
    """

    def __init__(self, turn: Turn, started_at: float) -> None:
        self.turn = turn
        self.text = prompt_text(turn.prompt)
        self.session_id = turn.session_id
        self.prompt_id = turn.prompt_id
        self.started_at = started_at
        self.ended_at: float | None = None
        self.outcome: str | None = None
        self.ended = trio.Event()
        #: what the client answered to the permission requests of an ``ask_permission`` prompt
        self.answers: list[Any] = []


class ForkCall:
    def __init__(self, source: str, new: str) -> None:
        self.source = source
        self.new = new
        self.ended = trio.Event()


class FakeBackend(BaseBackend):
    """A scripted backend following the :class:`~acp_server.backends.Backend` protocol.

    Attributes:
        calls: every prompt call, in start order.
        order: ``("start" | "end", text)`` and ``("fork_start" | "fork_end", source id)`` in order.
        fork_calls: every fork call.
        lifecycle: ``(method, session id)`` of every other call (open_session, set_mode,
            close_session), in order.
        latency_s: trio seconds an unscripted (echo) prompt takes before it echoes, read when the call
            starts (0, the default: it echoes at once). Changing it models a dependency slowing down.
    """

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.latency_s = 0.0
        self.calls: list[Call] = []
        self.order: list[tuple[str, str]] = []
        self.fork_calls: list[ForkCall] = []
        self.lifecycle: list[tuple[str, str]] = []
        self._script: dict[str, tuple[Behaviour, Any]] = {}
        self._gates: dict[str, trio.Event] = {}
        self._started: dict[str, trio.Event] = {}
        self._fork_gate: trio.Event | None = None
        self._fork_started = trio.Event()
        self._fork_error: BaseException | None = None

    # --- scripting ---------------------------------------------------------------------------------

    def hold(self, *texts: str) -> None:
        """Prompts with these texts block (cancellably) until :meth:`release`."""
        for text in texts:
            self._script[text] = (Behaviour.HOLD, None)

    def ignore_cancel(self, *texts: str) -> None:
        """Prompts with these texts block until :meth:`release`, shielded from cancellation."""
        for text in texts:
            self._script[text] = (Behaviour.IGNORE_CANCEL, None)

    def delay(self, text: str, seconds: float) -> None:
        """The prompt takes ``seconds`` of trio time, then ends with ``end_turn``."""
        self._script[text] = (Behaviour.DELAY, seconds)

    def fail(self, text: str, error: AcpError) -> None:
        """The prompt raises ``error`` (an error the backend reports on purpose)."""
        self._script[text] = (Behaviour.FAIL, error)

    def crash(self, text: str, error: Exception | None = None) -> None:
        """The prompt raises an unexpected exception (a backend bug)."""
        self._script[text] = (Behaviour.CRASH, error or RuntimeError(f"backend crashed on {text!r}"))

    def ask_permission(self, text: str, params: Any = None) -> None:
        """The prompt sends ``session/request_permission`` to its sender, records the answer in
        :attr:`Call.answers`, then ends with ``end_turn``."""
        self._script[text] = (Behaviour.ASK, params)

    def release(self, *texts: str) -> None:
        """Let held prompts with these texts end with ``end_turn`` (now, or at once when they start)."""
        for text in texts:
            self._gate(text).set()

    def release_all(self) -> None:
        """Release every held prompt (scripted so far) and every held fork."""
        for text, (behaviour, _) in self._script.items():
            if behaviour in (Behaviour.HOLD, Behaviour.IGNORE_CANCEL):
                self._gate(text).set()
        self.release_forks()

    def hold_forks(self) -> None:
        """``fork`` blocks until :meth:`release_forks`."""
        self._fork_gate = trio.Event()

    def release_forks(self) -> None:
        if self._fork_gate is not None:
            self._fork_gate.set()

    def fail_forks(self, error: BaseException) -> None:
        self._fork_error = error

    # --- observing ---------------------------------------------------------------------------------

    async def started(self, text: str) -> None:
        """Wait until a prompt with this text has started."""
        await self._started_event(text).wait()

    async def fork_started(self) -> None:
        await self._fork_started.wait()

    def calls_of(self, text: str) -> list[Call]:
        return [c for c in self.calls if c.text == text]

    @property
    def running(self) -> list[Call]:
        return [c for c in self.calls if c.outcome is None]

    def texts_started(self) -> list[str]:
        return [text for kind, text in self.order if kind == "start"]

    # --- the Backend protocol ----------------------------------------------------------------------

    async def prompt(self, turn: Turn) -> StopReason:
        call = Call(turn, trio.current_time())
        self.calls.append(call)
        self.order.append(("start", call.text))
        self._started_event(call.text).set()
        behaviour, arg = self._script.get(call.text, (Behaviour.ECHO, None))
        try:
            if behaviour is Behaviour.ECHO:
                if self.latency_s:
                    await trio.sleep(self.latency_s)
                for word in split_words(call.text):
                    turn.emit(AgentMessageChunk(content=TextContent(text=word)))
                    await trio.lowlevel.checkpoint()
                for _ in range(3):
                    await trio.lowlevel.checkpoint()
            elif behaviour is Behaviour.HOLD:
                await self._gate(call.text).wait()
            elif behaviour is Behaviour.IGNORE_CANCEL:
                with trio.CancelScope(shield=True):
                    await self._gate(call.text).wait()
            elif behaviour is Behaviour.DELAY:
                await trio.sleep(arg)
            elif behaviour is Behaviour.FAIL:
                await trio.lowlevel.checkpoint()
                call.outcome = "error"
                raise arg
            elif behaviour is Behaviour.ASK:
                assert turn.client is not None, "an ask_permission prompt needs its sender's channel"
                params = arg if arg is not None else {"sessionId": turn.session_id, "toolCall": {"toolCallId": "t1"}}
                call.answers.append(await turn.client.request("session/request_permission", params))
            else:
                await trio.lowlevel.checkpoint()
                call.outcome = "crash"
                raise arg
            call.outcome = "end_turn"
            return "end_turn"
        except trio.Cancelled:
            call.outcome = "cancelled"
            raise
        finally:
            call.ended_at = trio.current_time()
            self.order.append(("end", call.text))
            call.ended.set()

    async def open_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        meta: dict[str, Any] | None = None,
    ) -> SessionSetup:
        self.lifecycle.append(("open_session", session_id))
        await trio.lowlevel.checkpoint()
        return SessionSetup()

    async def set_mode(self, session_id: str, mode_id: str) -> None:
        self.lifecycle.append(("set_mode", session_id))
        await trio.lowlevel.checkpoint()

    async def close_session(self, session_id: str) -> None:
        self.lifecycle.append(("close_session", session_id))
        await trio.lowlevel.checkpoint()

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        call = ForkCall(source_session_id, new_session_id)
        self.fork_calls.append(call)
        self.order.append(("fork_start", source_session_id))
        self._fork_started.set()
        try:
            if self._fork_gate is not None:
                await self._fork_gate.wait()
            else:
                await trio.lowlevel.checkpoint()
            if self._fork_error is not None:
                raise self._fork_error
        finally:
            self.order.append(("fork_end", source_session_id))
            call.ended.set()

    # --- internals ---------------------------------------------------------------------------------

    def _gate(self, text: str) -> trio.Event:
        gate = self._gates.get(text)
        if gate is None:
            gate = self._gates[text] = trio.Event()
        return gate

    def _started_event(self, text: str) -> trio.Event:
        event = self._started.get(text)
        if event is None:
            event = self._started[text] = trio.Event()
        return event


class FakePeer:
    """A connection as the bridge sees it (:class:`~acp_server.bridge.Peer`), recording what it is sent."""

    _next_id = 1000

    def __init__(self) -> None:
        FakePeer._next_id += 1
        self.peer_id = FakePeer._next_id
        self.sent: list[bytes] = []
        self.closed = False

    async def request(self, method: str, params: Any = None) -> Any:
        """The bridge's peers are never asked anything in these tests."""
        raise trio.EndOfChannel

    def send(self, data: bytes) -> None:
        if not self.closed:  # like ConnectionShell.send: a closed connection drops what it is sent
            self.sent.append(data)

    async def send_reliably(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.send(data)

    def messages(self) -> list[dict[str, Any]]:
        """What the peer was sent, decoded."""
        return [json.loads(line) for data in self.sent for line in data.splitlines() if line.strip()]

    def __repr__(self) -> str:
        return f"<FakePeer {self.peer_id}{' closed' if self.closed else ''}>"


# --- driving a bridge or a server in tests ---------------------------------------------------------


#: Real seconds a test may run before it is failed instead of left hanging.
HANG_GUARD_S = 30.0


@asynccontextmanager
async def hang_guard(seconds: float = HANG_GUARD_S) -> AsyncIterator[None]:
    """Fail with ``trio.TooSlowError`` after ``seconds`` of real time, whatever clock the run uses.

    A regression that leaves a response unanswered would otherwise hang the suite (a mock clock that
    does not move never fires ``fail_after``).
    """
    stop = threading.Event()
    fired = False
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as body:

            async def watchdog() -> None:
                nonlocal fired
                if not await trio.to_thread.run_sync(stop.wait, seconds, abandon_on_cancel=True):
                    fired = True
                    body.cancel()

            nursery.start_soon(watchdog)
            try:
                yield
            finally:
                stop.set()
                nursery.cancel_scope.cancel()
    if fired:
        raise trio.TooSlowError(f"the test did not finish within {seconds} s")


@asynccontextmanager
async def running_bridge(backend: FakeBackend, limits: Limits | None = None) -> AsyncIterator[SessionBridge]:
    """A :class:`SessionBridge` over ``backend`` with its tasks running; cancelled on exit."""
    bridge = SessionBridge(backend, limits)
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        try:
            yield bridge
        finally:
            backend.release_all()  # calls that ignore cancellation must end for the nursery to close
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def serving(
    limits: Limits | None = None, backend: FakeBackend | None = None
) -> AsyncIterator[tuple[Server, trio.Nursery]]:
    """:func:`tests.helpers.running_server` over a fake backend, with a hang guard."""
    backend = backend or FakeBackend()
    async with hang_guard(), running_server(limits, backend) as (server, nursery):
        try:
            yield server, nursery
        finally:
            backend.release_all()


async def connect_shell(server: Server, nursery: trio.Nursery, *, initialize: bool = True) -> tuple[RawClient, ConnectionShell]:
    """Like :func:`tests.helpers.connect`, also returning the server's end of the connection."""
    before = set(server.connections)
    client = await connect(server, nursery, initialize=False)
    await trio.testing.wait_all_tasks_blocked()
    (shell,) = set(server.connections) - before
    if initialize:
        await client.initialize()
    return client, shell


class Pending:
    """A request sent in order on the wire whose response is awaited in the background."""

    def __init__(self, id: Any) -> None:
        self.id = id
        self.response: dict[str, Any] | None = None
        self.done = trio.Event()

    async def _wait(self, receive: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
        self.response = await receive.receive()
        self.done.set()

    async def wait(self) -> dict[str, Any]:
        await self.done.wait()
        assert self.response is not None
        return self.response

    @property
    def result(self) -> Any:
        assert self.response is not None, f"request {self.id!r} has no response yet"
        assert "result" in self.response, f"request {self.id!r} failed: {self.response.get('error')}"
        return self.response["result"]

    @property
    def error(self) -> dict[str, Any]:
        assert self.response is not None, f"request {self.id!r} has no response yet"
        assert "error" in self.response, f"request {self.id!r} succeeded: {self.response.get('result')}"
        return self.response["error"]  # type: ignore[no-any-return]


async def send_request(
    client: RawClient, nursery: trio.Nursery, method: str, params: Any, *, id: Any = None
) -> Pending:
    """Send a request now (so requests reach the server in the order of these calls); answer later."""
    rid, receive = client.start_request(method, params, id=id)
    pending = Pending(rid)
    nursery.start_soon(pending._wait, receive)
    await client.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
    return pending


async def send_prompt(
    client: RawClient, nursery: trio.Nursery, session_id: str, text: str, *, id: Any = None, **meta: Any
) -> Pending:
    """Send ``session/prompt`` with one text block; ``meta`` goes to ``_meta``."""
    params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    if meta:
        params["_meta"] = meta
    return await send_request(client, nursery, "session/prompt", params, id=id)


def responses_by_id(client: RawClient) -> dict[Any, list[dict[str, Any]]]:
    """Every response the client received, grouped by request id."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for msg in client.messages:
        for item in msg if isinstance(msg, list) else [msg]:
            if "method" not in item and "id" in item:
                out.setdefault(item["id"], []).append(item)
    return out
