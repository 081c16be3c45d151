"""One ACP agent child process: its pipes, a JSON-RPC client connection over them, and its tasks.

:class:`AgentProcess` spawns the command with three pipes and speaks JSON-RPC 2.0 to it as a client,
through the sans-I/O :class:`~acp_server.jsonrpc.Connection`. Three tasks serve it: a reader feeding
stdout to the connection and routing its events (responses to our waiting calls, the agent's own
requests and notifications to the owner's callbacks, run synchronously and in arrival order), one
writer that owns stdin and joins whatever is queued into one ``send_all``, and a drain that logs
stderr line by line, so an agent that logs a lot never blocks on a full pipe.

Writes never wait: :meth:`AgentProcess.send` queues and returns, so the reader can answer the agent
at once without ever blocking on stdin while the agent blocks on stdout. When the process exits, what
it wrote before exiting is read first, then every call still waiting fails with
:class:`ChildExitedError` and ``on_exit`` runs once. It knows no ACP method beyond what its owner asks.
"""

from __future__ import annotations

import logging
import math
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import trio

from ..jsonrpc import (
    Batch,
    Connection,
    DecodeFailure,
    ErrorReply,
    Event,
    Notification,
    Request,
    Response,
    TooLarge,
    safe_decode,
)
from ..logtext import clip

__all__ = ["AgentProcess", "AgentRpcError", "ChildExitedError", "PendingCall"]

log = logging.getLogger("acp_server.backends.agent_process")

Id = int | str

_READ_SIZE = 65536
#: the longest stderr line logged as is; longer ones are cut and marked
_MAX_LOG_LINE = 4096
#: after the process exits, how long its pipes may still be read (what it wrote before dying)
_DRAIN_AFTER_EXIT_S = 1.0
#: a child that closed its stdout but lives on is killed after this long
_MUTE_GRACE_S = 2.0
#: on shutdown: wait this long after closing stdin, then SIGTERM and wait as long again, then SIGKILL
_STOP_GRACE_S = 0.5

_encoder = msgspec.json.Encoder()


class ChildExitedError(Exception):
    """The agent process exited (or was never reachable) before it answered."""

    def __init__(self, exit_code: int | None) -> None:
        super().__init__(f"agent process exited with code {exit_code}")
        self.exit_code = exit_code


class AgentRpcError(Exception):
    """The agent answered one of our requests with a JSON-RPC error (``.error`` is its error object)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "agent error")))
        self.error = error


class PendingCall:
    """One request of ours to the agent, until its response (or the process's exit)."""

    __slots__ = ("done", "error", "exit_code", "exited", "id", "method", "on_result", "result")

    def __init__(self, id: Id, method: str, on_result: Callable[[Any], None] | None) -> None:
        self.id = id
        self.method = method
        self.on_result = on_result
        self.done = trio.Event()
        self.result: Any = None
        self.error: dict[str, Any] | None = None
        self.exited = False
        self.exit_code: int | None = None

    def outcome(self) -> Any:
        """The result once :attr:`done` is set.

        Raises:
            ChildExitedError: the process exited first.
            AgentRpcError: the agent answered with an error.
        """
        if self.exited:
            raise ChildExitedError(self.exit_code)
        if self.error is not None:
            raise AgentRpcError(self.error)
        return self.result


def encode_error_object(id: Id | None, error: Mapping[str, Any]) -> bytes:
    """One error response carrying an error object as given (a client's, relayed), newline-terminated."""
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "error": dict(error)}) + b"\n"


def _decode_line(data: bytes, limit: int) -> str:
    text = data[:limit].decode("utf-8", "replace").rstrip("\r")
    return text + " [truncated]" if len(data) > limit else text


class AgentProcess:
    """A spawned agent and the JSON-RPC client connection to it.

    Args:
        command: the program and its arguments.
        env: the complete environment of the child.
        cwd: its working directory (``None``: ours).
        stderr_log: where its stderr lines go (at INFO).
        max_message_bytes: the longest line accepted from it; a longer one kills it (a protocol break).
        on_request: ``on_request(process, request)`` for each request the agent sends us; runs in the reader
            and must not block (answer with :meth:`respond`/:meth:`respond_error`, now or later).
        on_notification: ``on_notification(process, notification)``, likewise.
        on_exit: ``on_exit(process, exit_code)``, once, when the process exited by itself or was killed
            with :meth:`kill` (not when :meth:`serve` was cancelled, which stops it).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None,
        stderr_log: logging.Logger,
        max_message_bytes: int,
        on_request: Callable[[AgentProcess, Request], None],
        on_notification: Callable[[AgentProcess, Notification], None],
        on_exit: Callable[[AgentProcess, int | None], None],
    ) -> None:
        self.command = list(command)
        self._env = dict(env)
        self._cwd = cwd
        self._stderr_log = stderr_log
        self._on_request = on_request
        self._on_notification = on_notification
        self._on_exit = on_exit
        self._conn = Connection(max_message_bytes=max_message_bytes)
        self._outbox_send, self._outbox = trio.open_memory_channel[bytes](math.inf)
        self._calls: dict[Id, PendingCall] = {}
        self._proc: trio.Process | None = None
        self.pid: int | None = None
        self.exited = False
        self.exit_code: int | None = None
        #: the ``initialize`` result, once the owner has it
        self.init_result: dict[str, Any] = {}
        self.started_at = 0.0

    def __repr__(self) -> str:
        return f"AgentProcess(pid={self.pid}, exited={self.exited}, exit_code={self.exit_code})"

    # --- lifecycle ---------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Spawn the process and serve its pipes until it exits; cancelling this stops it.

        Raises:
            OSError: the command could not be started (before ``task_status.started()``).
        """
        proc = await trio.lowlevel.open_process(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            cwd=self._cwd,
        )
        self._proc = proc
        self.pid = proc.pid
        self.started_at = trio.current_time()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        exited_by_itself = False
        try:
            async with trio.open_nursery() as nursery:
                stdout_done = trio.Event()
                stderr_done = trio.Event()
                nursery.start_soon(self._write_loop, proc.stdin)
                nursery.start_soon(self._read_loop, proc.stdout, stdout_done)
                nursery.start_soon(self._drain_stderr, proc.stderr, stderr_done)
                nursery.start_soon(self._kill_if_mute, proc, stdout_done)
                task_status.started()
                await proc.wait()
                exited_by_itself = True
                # What it wrote before exiting (its last update, its dying words) is read first.
                with trio.move_on_after(_DRAIN_AFTER_EXIT_S):
                    await stdout_done.wait()
                    await stderr_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    await self._stop(proc)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    await stream.aclose()
            self._finish(proc.returncode, notify=exited_by_itself)

    def kill(self) -> None:
        """Kill the process now (``on_exit`` follows once it is reaped)."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self.exited

    async def _stop(self, proc: trio.Process) -> None:
        assert proc.stdin is not None
        await proc.stdin.aclose()  # an ACP agent is expected to exit at the end of its input
        with trio.move_on_after(_STOP_GRACE_S):
            await proc.wait()
            return
        proc.terminate()
        with trio.move_on_after(_STOP_GRACE_S):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()

    async def _kill_if_mute(self, proc: trio.Process, stdout_done: trio.Event) -> None:
        await stdout_done.wait()
        await trio.sleep(_MUTE_GRACE_S)
        if proc.returncode is None:
            log.warning("agent pid %s closed its stdout but lives on; killing it", proc.pid)
            proc.kill()

    def _finish(self, exit_code: int | None, *, notify: bool) -> None:
        self.exited = True
        self.exit_code = exit_code
        self._outbox_send.close()
        calls = list(self._calls.values())
        self._calls.clear()
        for call in calls:
            call.exited = True
            call.exit_code = exit_code
            call.done.set()
        if notify:
            try:
                self._on_exit(self, exit_code)
            except Exception:
                log.exception("on_exit of agent pid %s failed", self.pid)

    # --- sending -----------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue bytes for the agent's stdin; dropped once the process is gone."""
        try:
            self._outbox_send.send_nowait(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("agent pid %s is gone; dropping %d bytes", self.pid, len(data))

    def start_request(
        self, method: str, params: Any, on_result: Callable[[Any], None] | None = None
    ) -> PendingCall:
        """Send a request; the returned call completes when it is answered or the process exits.

        ``on_result(result)`` runs in the reader as the success response is taken, before any later
        message of the agent's is routed (so a new session's id is known before its first update).
        """
        if self.exited:
            call = PendingCall(0, method, None)
            call.exited = True
            call.exit_code = self.exit_code
            call.done.set()
            return call
        id, data = self._conn.send_request(method, params)
        call = PendingCall(id, method, on_result)
        self._calls[id] = call
        self.send(data)
        return call

    def forget(self, call: PendingCall) -> None:
        """Stop waiting for ``call``: a late response to it is logged and dropped."""
        if self._calls.pop(call.id, None) is not None:
            self._conn.send_failed(call.id)

    async def request(self, method: str, params: Any, on_result: Callable[[Any], None] | None = None) -> Any:
        """Send a request and return its result.

        Raises:
            ChildExitedError: the process exited before answering.
            AgentRpcError: the agent answered with an error.
        """
        call = self.start_request(method, params, on_result)
        try:
            await call.done.wait()
        finally:
            self.forget(call)
        return call.outcome()

    def notify(self, method: str, params: Any) -> None:
        self.send(self._conn.send_notification(method, params))

    def respond(self, id: Id, result: Any) -> None:
        """Answer one of the agent's requests with a result."""
        self.send(self._conn.send_result(id, result))

    def respond_error(self, id: Id, error: Mapping[str, Any]) -> None:
        """Answer one of the agent's requests with an error object (``code``, ``message``, ``data``)."""
        self.send(encode_error_object(id, error))

    # --- the tasks ---------------------------------------------------------------------------------

    async def _write_loop(self, stdin: trio.abc.SendStream) -> None:
        try:
            async for data in self._outbox:
                chunks = [data]
                while True:
                    try:
                        chunks.append(self._outbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                await stdin.send_all(b"".join(chunks))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("agent pid %s stopped reading its stdin: %r", self.pid, exc)
        finally:
            self._outbox.close()

    async def _read_loop(self, stdout: trio.abc.ReceiveStream, done: trio.Event) -> None:
        try:
            while True:
                data = await stdout.receive_some(_READ_SIZE)
                if not data:
                    return
                if not self._take_events(self._conn.receive(data)):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        except Exception:
            # A defect met while reading this agent ends this agent (its prompts fail as at any exit,
            # its sessions re-open on restart), never the backend's nursery and with it the server.
            log.exception("agent pid %s: unexpected error while reading its output; killing it", self.pid)
            self.kill()
        finally:
            done.set()

    def _take_events(self, events: list[Event]) -> bool:
        """Route the messages of one read (:meth:`Connection.receive`); ``False`` after a protocol break."""
        for event in events:
            if isinstance(event, TooLarge):
                log.error(
                    "agent pid %s sent a message over %d bytes; killing it (its sessions re-open on restart)",
                    self.pid,
                    event.limit,
                )
                self.kill()
                return False
            if isinstance(event, Batch):
                items = event.items
            else:
                items = [event]
            for item in items:
                try:
                    self._route(item)
                except Exception:
                    log.exception("routing %s from agent pid %s failed", clip(item), self.pid)
        return True

    def _route(self, event: Request | Notification | Response | ErrorReply) -> None:
        if isinstance(event, Response):
            call = self._calls.pop(event.id, None)
            if call is None:
                return  # abandoned by its caller (cancelled, timed out)
            if event.error is not None:
                call.error = event.error
            else:
                call.result = event.result
                if call.on_result is not None:
                    call.on_result(event.result)
            call.done.set()
        elif isinstance(event, Request):
            self._on_request(self, event)
        elif isinstance(event, Notification):
            self._on_notification(self, event)
        elif isinstance(event, ErrorReply):
            log.warning("agent pid %s sent an invalid message: %s", self.pid, event.error)
            self.send(event.data)

    async def _drain_stderr(self, stderr: trio.abc.ReceiveStream, done: trio.Event) -> None:
        logger = self._stderr_log
        buf = bytearray()
        cutting = False  # inside a line already logged (cut at _MAX_LOG_LINE)
        try:
            while True:
                data = await stderr.receive_some(_READ_SIZE)
                if not data:
                    break
                if not logger.isEnabledFor(logging.INFO):
                    continue  # drained all the same: the pipe must never fill up
                buf += data
                start = 0
                while (nl := buf.find(b"\n", start)) >= 0:
                    if cutting:
                        cutting = False
                    else:
                        logger.info("%s", _decode_line(bytes(buf[start:nl]), _MAX_LOG_LINE))
                    start = nl + 1
                del buf[:start]
                if len(buf) > _MAX_LOG_LINE:
                    if not cutting:
                        logger.info("%s", _decode_line(bytes(buf), _MAX_LOG_LINE))
                    cutting = True
                    buf.clear()
            if buf and not cutting:
                logger.info("%s", _decode_line(bytes(buf), _MAX_LOG_LINE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            done.set()


def decode_params(params: msgspec.Raw | None) -> Any:
    """A request's or notification's params as plain Python values (``None`` when absent or broken)."""
    if params is None:
        return None
    value = safe_decode(params)
    if isinstance(value, DecodeFailure):
        log.warning("agent params that cannot be decoded: %s", value.error)
        return None
    return value
