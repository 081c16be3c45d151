"""A backend that fronts an ACP agent run as a subprocess, many of our sessions on one child.

The child is spawned lazily (or by :meth:`AcpAgentBackend.ensure_started`) and initialized once,
advertising the client capabilities we can relay (fs, terminal, elicitation). Each of our sessions
maps to one session of the child; ``session/update`` from the child goes to the running turn's
``emit``, or to the session's own ``emit`` outside a turn. The child's own requests
(``session/request_permission``, ``fs/*``, ``terminal/*``, ``elicitation/create``) are relayed to the
client that sent the running prompt, only when it advertised the capability; anything else is refused
to the child at once, and whatever is still open when the prompt ends or its client leaves is answered
for it (``cancelled`` for a permission, ``-32800`` otherwise), so the child never waits forever.

When the child dies, each running prompt fails with ``backend_unavailable`` (``reason="exited"``),
:attr:`AcpAgentBackend.on_exit` runs once, and the next call restarts it; sessions re-open on the new
child at their next use (``session/load`` when the agent supports it, else ``session/new``). Restarts
back off after repeated failures (0 s, then 0.5 s doubling to 30 s; reset once a child stayed up 60 s):
inside that window calls fail at once with the last failure's reason (``spawn_failed``,
``initialize_failed`` or ``exited``). Errors the child answers never pass for ours: ``-32000`` becomes
``auth_required``, anything else ``agent_error`` with the agent's code, message and data.

This module is the backend's calls to the child and its lifecycle; what the child sends us (its updates
and requests, routed to our sessions) is :mod:`.agent_inbound`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, cast, get_args

import msgspec
import trio

from ..errors import (
    AgentError,
    AuthRequiredError,
    BackendError,
    BackendUnavailableError,
    SessionNotFoundError,
)
from ..types.acp import StopReason
from .agent_inbound import AgentSession, ChildMessages
from .agent_process import AgentProcess, AgentRpcError, ChildExitedError, PendingCall
from .agent_relay import TurnRelay
from .agent_start import (
    BACKOFF_RESET_S,
    FailureReason,
    StartAttempt,
    StartFailed,
    initialize_child,
    restart_delay,
)
from .base import BaseBackend, SessionSetup, Turn

__all__ = ["AcpAgentBackend", "restart_delay"]

log = logging.getLogger("acp_server.backends.acp_agent")

_STOP_REASONS: Final = frozenset(get_args(StopReason))


class AcpAgentBackend(BaseBackend, ChildMessages):
    """Runs an ACP agent as a child process and multiplexes our sessions onto it.

    Args:
        name: the backend's id (in errors, and the logger ``acp_server.agent.<name>`` of its stderr).
        command: the agent's program and arguments.
        env: variables added to (or replacing) our environment for the child.
        cwd: the child's working directory (``None``: ours).
        cancel_grace_s: after a prompt is cancelled, how long to wait for the child's answer to it.
        initialize_timeout_s: how long the child may take to answer ``initialize``.
        max_message_bytes: the longest line accepted from the child.

    :meth:`run` must be running (``await nursery.start(backend.run)``) for any other call.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        cancel_grace_s: float = 2.0,
        initialize_timeout_s: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if not command:
            raise ValueError(f"backend {name!r}: the agent command must not be empty")
        self.name = name
        self.command = list(command)
        self.env = dict(env or {})
        self.cwd = cwd
        self.cancel_grace_s = cancel_grace_s
        self.initialize_timeout_s = initialize_timeout_s
        self.max_message_bytes = max_message_bytes
        #: set by the server to the clients' ``--max-message-bytes``: an update or a request of the
        #: agent's longer than this fails its prompt (``agent_error``, reason ``message_too_large``) and
        #: is not relayed, so no client is ever sent a line it would refuse itself (``None``: no bound)
        self.relay_max_bytes: int | None = None
        #: set by the bridge: ``on_exit(backend_name, exit_code)``, once per death of an initialized child
        self.on_exit: Callable[[str, int | None], None] | None = None
        self._stderr_log = logging.getLogger(f"acp_server.agent.{name}")
        self._nursery: trio.Nursery | None = None
        self._child: AgentProcess | None = None
        self._starting: StartAttempt | None = None
        self._init_result: dict[str, Any] = {}
        self._sessions: dict[str, AgentSession] = {}
        self._routes: dict[str, AgentSession] = {}  # the current child's session id -> our session
        self._failures = 0
        self._retry_at = 0.0
        self._last_failure: tuple[FailureReason, int | None] = ("spawn_failed", None)
        self._auth: tuple[str, dict[str, Any] | None] | None = None

    # --- what the child advertised -----------------------------------------------------------------

    @property
    def auth_methods(self) -> list[dict[str, Any]]:
        """The child's ``authMethods`` from its last ``initialize`` (empty before any)."""
        methods = self._init_result.get("authMethods")
        return list(methods) if isinstance(methods, list) else []

    @property
    def agent_capabilities(self) -> dict[str, Any]:
        """The child's ``agentCapabilities`` from its last ``initialize`` (empty before any)."""
        caps = self._init_result.get("agentCapabilities")
        return dict(caps) if isinstance(caps, dict) else {}

    def _can_load(self) -> bool:
        return self.agent_capabilities.get("loadSession") is True

    def _can_close(self) -> bool:
        session_caps = self.agent_capabilities.get("sessionCapabilities")
        return isinstance(session_caps, dict) and session_caps.get("close") is not None

    # --- the child's lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the child process and its tasks until cancelled (which stops the child)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def ensure_started(self) -> None:
        """Spawn and initialize the child unless it is running.

        Raises:
            BackendUnavailableError: it cannot start (``spawn_failed``, ``initialize_failed``), or is
                inside its restart backoff after failures.
        """
        await self._ensure_child(None)

    async def _ensure_child(self, session_id: str | None) -> AgentProcess:
        while True:
            child = self._child
            if child is not None and child.alive:
                return child
            attempt = self._starting
            if attempt is None:
                if self._nursery is None:
                    raise RuntimeError(f"backend {self.name!r}: run() must be running before it is used")
                if trio.current_time() < self._retry_at:
                    reason, exit_code = self._last_failure
                    raise BackendUnavailableError(
                        backend_id=self.name, session_id=session_id, reason=reason, exit_code=exit_code
                    )
                attempt = self._starting = StartAttempt()
                self._nursery.start_soon(self._start, attempt)
            await attempt.done.wait()
            if attempt.failure is not None:
                reason, exit_code = attempt.failure
                raise BackendUnavailableError(
                    backend_id=self.name, session_id=session_id, reason=reason, exit_code=exit_code
                )

    async def _start(self, attempt: StartAttempt) -> None:
        try:
            child = await self._spawn_and_initialize()
        except StartFailed as exc:
            attempt.failure = (exc.reason, exc.exit_code)
            self._note_failure(exc.reason, exc.exit_code)
        except Exception:
            log.exception("backend %s: starting the agent failed", self.name)
            attempt.failure = ("spawn_failed", None)
            self._note_failure("spawn_failed", None)
        else:
            if child.alive:
                attempt.failure = None
                self._child = child
                self._routes.clear()
            else:  # exited right after initialize (its on_exit was not ours to handle yet)
                attempt.failure = ("initialize_failed", child.exit_code)
                self._note_failure("initialize_failed", child.exit_code)
        finally:
            self._starting = None
            attempt.done.set()

    async def _spawn_and_initialize(self) -> AgentProcess:
        assert self._nursery is not None
        child = AgentProcess(
            self.command,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            stderr_log=self._stderr_log,
            max_message_bytes=self.max_message_bytes,
            on_request=self._on_child_request,
            on_notification=self._on_child_notification,
            on_exit=self._on_child_exit,
        )
        log.info("backend %s: starting agent %r", self.name, self.command)
        try:
            await self._nursery.start(child.serve)
        except OSError as exc:
            log.warning("backend %s: cannot start agent %r: %s", self.name, self.command, exc)
            raise StartFailed("spawn_failed", None) from exc
        result = await initialize_child(child, self.name, self.initialize_timeout_s)
        child.init_result = result
        self._init_result = result
        log.info("backend %s: agent pid %s ready", self.name, child.pid)
        if self._auth is not None:
            await self._reauthenticate(child, *self._auth)
        return child

    async def _reauthenticate(self, child: AgentProcess, method_id: str, meta: dict[str, Any] | None) -> None:
        """A restarted child forgets a login done through us: repeat it (failures are only logged)."""
        try:
            await child.request("authenticate", _with_meta({"methodId": method_id}, meta))
        except (ChildExitedError, AgentRpcError) as exc:
            log.warning("backend %s: repeating authenticate %r failed: %s", self.name, method_id, exc)

    def _note_failure(self, reason: FailureReason, exit_code: int | None) -> None:
        self._failures += 1
        self._last_failure = (reason, exit_code)
        self._retry_at = trio.current_time() + restart_delay(self._failures)

    def _on_child_exit(self, child: AgentProcess, exit_code: int | None) -> None:
        if child is not self._child:
            return  # died before it was ready: its starter reports that
        self._child = None
        self._routes.clear()
        if trio.current_time() - child.started_at >= BACKOFF_RESET_S:
            self._failures = 0
        self._note_failure("exited", exit_code)
        log.warning("backend %s: agent pid %s exited with code %s", self.name, child.pid, exit_code)
        for session in self._sessions.values():
            if session.run is not None and session.run.child is child:
                session.run.end()
        if self.on_exit is not None:
            try:
                self.on_exit(self.name, exit_code)
            except Exception:
                log.exception("backend %s: on_exit hook failed", self.name)

    # --- calls to the child ------------------------------------------------------------------------

    def _agent_error(self, error: dict[str, Any]) -> BackendError:
        code = error.get("code")
        if code == -32000:
            return AuthRequiredError(backend_id=self.name)
        return AgentError(
            backend_id=self.name,
            agent_code=code if isinstance(code, int) and not isinstance(code, bool) else -32603,
            agent_message=str(error.get("message", "")),
            agent_data=error.get("data"),
        )

    async def _call(
        self,
        child: AgentProcess,
        session_id: str | None,
        method: str,
        params: Any,
        on_result: Callable[[Any], None] | None = None,
    ) -> Any:
        try:
            return await child.request(method, params, on_result)
        except ChildExitedError as exc:
            raise BackendUnavailableError(
                backend_id=self.name, session_id=session_id, reason="exited", exit_code=exc.exit_code
            ) from None
        except AgentRpcError as exc:
            raise self._agent_error(exc.error) from None

    def _malformed(self, method: str, what: str) -> AgentError:
        return AgentError(
            backend_id=self.name, agent_code=-32603, agent_message=f"malformed {method} result: {what}"
        )

    def _bind(self, session: AgentSession, child: AgentProcess, child_sid: str) -> None:
        session.child = child
        session.child_sid = child_sid
        if child is self._child:
            self._routes[child_sid] = session

    def _unbind(self, session: AgentSession) -> None:
        if session.child_sid is not None and self._routes.get(session.child_sid) is session:
            del self._routes[session.child_sid]
        session.child = None

    def _bind_on_result(self, session: AgentSession, child: AgentProcess) -> Callable[[Any], None]:
        def bind(result: Any) -> None:
            if isinstance(result, dict) and isinstance(result.get("sessionId"), str):
                self._bind(session, child, result["sessionId"])

        return bind

    async def _new_child_session(
        self, session: AgentSession, child: AgentProcess, meta: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"cwd": session.cwd, "mcpServers": session.mcp_servers}
        if meta:
            params["_meta"] = meta
        try:
            result = await self._call(
                child, session.id, "session/new", params, self._bind_on_result(session, child)
            )
            if session.child is not child or not isinstance(result, dict):
                raise self._malformed("session/new", "no sessionId")
        except BaseException:
            self._unbind(session)
            raise
        return result

    async def _attach(self, session: AgentSession) -> tuple[AgentProcess, str]:
        """The child and its session id for ``session``, re-opening it on a restarted child."""
        child = await self._ensure_child(session.id)
        if session.child is child and session.child_sid is not None:
            return child, session.child_sid
        async with session.attach_lock:
            child = await self._ensure_child(session.id)
            if session.child is child and session.child_sid is not None:
                return child, session.child_sid
            if session.child_sid is not None and self._can_load():
                try:
                    await self._load(session, child)
                    return child, session.child_sid
                except AgentError as exc:
                    log.warning(
                        "backend %s: session/load of %s failed (%s); opening anew", self.name, session.id, exc
                    )
            await self._new_child_session(session, child)
            assert session.child_sid is not None
            return child, session.child_sid

    async def _load(self, session: AgentSession, child: AgentProcess) -> None:
        assert session.child_sid is not None
        params = {"sessionId": session.child_sid, "cwd": session.cwd, "mcpServers": session.mcp_servers}
        self._bind(session, child, session.child_sid)
        session.loading = True
        try:
            await self._call(child, session.id, "session/load", params)
        except BaseException:
            self._unbind(session)
            raise
        finally:
            session.loading = False
        log.info("backend %s: re-opened %s on agent pid %s (session/load)", self.name, session.id, child.pid)

    def _session(self, session_id: str) -> AgentSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(session_id=session_id)
        return session

    # --- the Backend protocol ----------------------------------------------------------------------

    async def open_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        meta: dict[str, Any] | None = None,
    ) -> SessionSetup:
        session = AgentSession(session_id, cwd, list(mcp_servers), emit)
        child = await self._ensure_child(session_id)
        result = await self._new_child_session(session, child, meta)
        self._sessions[session_id] = session
        return SessionSetup(
            modes=result.get("modes"), config_options=result.get("configOptions"), meta=result.get("_meta")
        )

    def session_state(self, session_id: str) -> dict[str, Any] | None:
        """What the durable store keeps to re-open the session in a later process: the agent's own id."""
        session = self._sessions.get(session_id)
        if session is None or session.child_sid is None:
            return None
        return {"agentSessionId": session.child_sid}

    def restore_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        state: dict[str, Any] | None,
    ) -> None:
        """Know a stored session again, synchronously; its first use re-opens it in the agent
        (``session/load`` of its old agent session id when the agent supports it, else ``session/new``;
        the agent's own replay is not forwarded)."""
        if session_id in self._sessions:
            return
        session = AgentSession(session_id, cwd, list(mcp_servers), emit)
        agent_sid = (state or {}).get("agentSessionId")
        if isinstance(agent_sid, str):
            session.child_sid = agent_sid  # child None: _attach re-opens it
        self._sessions[session_id] = session

    def start_prompt(self, turn: Turn) -> Awaitable[StopReason]:
        """The turn's synchronous start (see :class:`~.base.Backend`): with the session open on a live
        child, its ``session/prompt`` request is queued for the child's stdin now, and what is awaited
        is the answer; otherwise all of :meth:`prompt`."""
        session = self._sessions.get(turn.session_id)
        child = self._child
        child_sid = session.child_sid if session is not None else None
        if session is None or child is None or not child.alive or session.child is not child or child_sid is None:
            return self.prompt(turn)
        run, call = self._send_prompt(session, turn, child, child_sid)
        return self._prompt_answer(session, turn, child, child_sid, run, call)

    async def prompt(self, turn: Turn) -> StopReason:
        session = self._session(turn.session_id)
        child, child_sid = await self._attach(session)
        run, call = self._send_prompt(session, turn, child, child_sid)
        return await self._prompt_answer(session, turn, child, child_sid, run, call)

    def _send_prompt(
        self, session: AgentSession, turn: Turn, child: AgentProcess, child_sid: str
    ) -> tuple[TurnRelay, PendingCall]:
        """Queue the turn's ``session/prompt`` for the child, with the relay of what it asks meanwhile."""
        assert self._nursery is not None
        run = TurnRelay(turn, child, self._nursery)
        session.run = run
        params: dict[str, Any] = {"sessionId": child_sid, "prompt": msgspec.to_builtins(list(turn.prompt))}
        if turn.meta:
            params["_meta"] = turn.meta
        return run, child.start_request("session/prompt", params)

    async def _prompt_answer(
        self, session: AgentSession, turn: Turn, child: AgentProcess, child_sid: str, run: TurnRelay, call: PendingCall
    ) -> StopReason:
        """Wait for the child's answer to the turn's ``session/prompt`` (a cancel asks the child to stop)."""
        try:
            try:
                with run.waiting:
                    await call.done.wait()
                if run.failure is not None:
                    # The agent sent what cannot be relayed: the turn fails; the agent is asked to
                    # stop, with the same short grace as a cancel, so it is idle before the next prompt.
                    child.notify("session/cancel", {"sessionId": child_sid})
                    run.end()
                    with trio.move_on_after(self.cancel_grace_s):
                        await call.done.wait()
                    raise run.failure
            except trio.Cancelled:
                # Ask the child to stop, answer what it still asks of the client, and give it a short
                # grace to settle the prompt, so it is idle before the next one; never longer.
                child.notify("session/cancel", {"sessionId": child_sid})
                run.end()
                with trio.CancelScope(shield=True), trio.move_on_after(self.cancel_grace_s):
                    await call.done.wait()
                if not call.done.is_set():
                    log.warning(
                        "backend %s: agent did not answer the cancelled prompt of %s within %s s",
                        self.name,
                        turn.session_id,
                        self.cancel_grace_s,
                    )
                raise
            result = call.outcome()
        except ChildExitedError as exc:
            raise BackendUnavailableError(
                backend_id=self.name, session_id=turn.session_id, reason="exited", exit_code=exc.exit_code
            ) from None
        except AgentRpcError as exc:
            raise self._agent_error(exc.error) from None
        finally:
            child.forget(call)
            run.end()
            if session.run is run:
                session.run = None
        stop_reason = result.get("stopReason") if isinstance(result, dict) else None
        if stop_reason not in _STOP_REASONS:
            raise self._malformed("session/prompt", f"stopReason {stop_reason!r}")
        return cast(StopReason, stop_reason)

    async def set_mode(self, session_id: str, mode_id: str) -> None:
        session = self._session(session_id)
        child, child_sid = await self._attach(session)
        await self._call(child, session_id, "session/set_mode", {"sessionId": child_sid, "modeId": mode_id})

    async def set_config_option(self, session_id: str, config_id: str, value: Any) -> dict[str, Any]:
        session = self._session(session_id)
        child, child_sid = await self._attach(session)
        params: dict[str, Any] = {"sessionId": child_sid, "configId": config_id, "value": value}
        if isinstance(value, bool):
            params["type"] = "boolean"
        result = await self._call(child, session_id, "session/set_config_option", params)
        return result if isinstance(result, dict) else {}

    async def close_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            await trio.lowlevel.checkpoint()
            return
        child, child_sid = session.child, session.child_sid
        self._unbind(session)
        if child is None or child is not self._child or child_sid is None or not self._can_close():
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._call(child, session_id, "session/close", {"sessionId": child_sid})
        except BackendError as exc:
            log.info("backend %s: session/close of %s failed: %s", self.name, session_id, exc)

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        """The branch gets a fresh session of the child at its first prompt (the bridge keeps the history)."""
        source = self._session(source_session_id)
        if new_session_id not in self._sessions:
            branch = AgentSession(new_session_id, source.cwd, list(source.mcp_servers), None)
            self._sessions[new_session_id] = branch
        await trio.lowlevel.checkpoint()

    async def authenticate(self, method_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Forward ``authenticate`` to the child (and repeat it on the child's restarts).

        Raises:
            BackendUnavailableError: the child cannot start or died.
            AuthRequiredError, AgentError: the child refused.
        """
        child = await self._ensure_child(None)
        result = await self._call(child, None, "authenticate", _with_meta({"methodId": method_id}, meta))
        self._auth = (method_id, meta)
        return result if isinstance(result, dict) else {}

    async def logout(self) -> None:
        """Forward ``logout`` to the child, and stop repeating an earlier ``authenticate``."""
        self._auth = None
        child = await self._ensure_child(None)
        await self._call(child, None, "logout", {})


def _with_meta(params: dict[str, Any], meta: dict[str, Any] | None) -> dict[str, Any]:
    if meta:
        params["_meta"] = meta
    return params
