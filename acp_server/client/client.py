"""The client: :func:`connect` to a server, typed methods for the ACP calls and our extensions.

Targets: ``tcp://HOST:PORT``, ``tls://HOST:PORT`` (verified against the system trust store or
``ca_file``), ``unix:/path``, a command to spawn and speak to over its stdin/stdout
(a list of strings, e.g. ``["acp-server", "serve", "--stdio"]``), or any connected trio stream
(in-process use and tests).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from .. import __version__
from ..auth import TOKEN_METHOD_ID
from ..auth.tls import open_tls_stream
from ..errors import MethodNotFoundError
from ..types.acp import PROTOCOL_VERSION, ListSessionsResult, SessionInfo
from .connection import RpcConnection
from .errors import ProtocolError, RpcError
from .hooks import Hooks
from .session import SessionClient, client_id_of
from .urls import parse_url

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "Client", "check_prompt_limit", "connect", "parse_url"]

log = logging.getLogger("acp_server.client")

#: The longest line accepted from the server by default (the server's own default bound).
DEFAULT_MAX_MESSAGE_BYTES = 50 * 1024 * 1024
_STOP_GRACE_S = 2.0

Target = str | Sequence[str] | trio.abc.Stream


def check_prompt_limit(value: Any, source: str) -> int | None:
    """A pending-prompt limit as the client uses it: a positive int, or ``None`` (disabled) for 0/None.

    Raises:
        ValueError: negative or fractional.
        TypeError: not a number.
    """
    if value is None:
        return None
    accepts = "must be a non-negative integer (0 or null disables the limit)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{source} {accepts}; got {value!r}")
    if isinstance(value, float) and (math.isnan(value) or not value.is_integer()):
        raise ValueError(f"{source} {accepts}; got the fraction {value!r}")
    if value < 0:
        raise ValueError(f"{source} {accepts}; got {value!r}")
    return int(value) or None


class Client:
    """One connection to an ACP server, initialized; made by :func:`connect`.

    Attributes:
        connection: the JSON-RPC connection underneath (raw calls: :meth:`request`, :meth:`notify`).
        init_result: the ``initialize`` result.
        limits: the server's advertised limits (``agentCapabilities._meta.limits``), if it gave them.
        max_pending_prompts: the local pending-prompt limit per session (``None``: disabled).
        on_self_heal: the default ``on_self_heal(old_id, new_id)`` of new :class:`SessionClient` objects.
    """

    def __init__(
        self,
        connection: RpcConnection,
        *,
        max_pending_prompts: int | None = None,
        on_self_heal: Callable[[str | None, str], None] | None = None,
        client_info: Mapping[str, Any] | None = None,
        tenant_id: str | None = None,
        turn_states: bool | None = None,
    ) -> None:
        if tenant_id is not None and (not isinstance(tenant_id, str) or not tenant_id):
            raise ValueError(f"tenant_id must be a non-empty string or None; got {tenant_id!r}")
        #: the tenant named at ``initialize`` (``_meta.tenantId``); ``None``: the server's ``default``
        self.tenant_id = tenant_id
        #: ``initialize`` ``_meta.turnStates`` (``None``: not sent, the server's ``--turn-states`` decides,
        #: off by default)
        self.turn_states = turn_states
        self.connection = connection
        self.init_result: dict[str, Any] = {}
        self.limits: dict[str, Any] | None = None
        # The caller's own limit (0 disables it) wins; without one, initialize takes the server's.
        self._limit_given = max_pending_prompts is not None
        self.max_pending_prompts = check_prompt_limit(max_pending_prompts, "max_pending_prompts")
        self.on_self_heal = on_self_heal
        self._client_info = dict(client_info or {"name": "acp-server-client", "version": __version__})

    # --- raw calls -----------------------------------------------------------------------------------

    async def request(self, method: str, params: Any = None) -> Any:
        """Any request; its result, or the error raised (cancelling the caller sends ``$/cancel_request``)."""
        return await self.connection.call(method, params)

    def notify(self, method: str, params: Any = None) -> None:
        """Any notification."""
        self.connection.notify(method, params)

    async def aclose(self) -> None:
        """Close the connection: unanswered calls fail with ``ConnectionLostError``, update streams end."""
        self.connection.close()
        await trio.lowlevel.checkpoint()

    @property
    def closed(self) -> bool:
        return self.connection.closed

    # --- lifecycle -----------------------------------------------------------------------------------

    async def initialize(self, *, protocol_version: int = PROTOCOL_VERSION) -> dict[str, Any]:
        """``initialize`` (``connect`` does it), then the local limit from the server's capabilities."""
        params = {
            "protocolVersion": protocol_version,
            "clientCapabilities": self.connection.hooks.capabilities(),
            "clientInfo": self._client_info,
        }
        asked: dict[str, Any] = {}
        if self.tenant_id is not None:
            asked["tenantId"] = self.tenant_id
        if self.turn_states is not None:
            asked["turnStates"] = self.turn_states
        if asked:
            params["_meta"] = asked
        result = await self.connection.call("initialize", params)
        if not isinstance(result, dict):
            raise ProtocolError(f"the initialize result is not an object: {result!r}")
        self.init_result = result
        caps = result.get("agentCapabilities")
        meta = caps.get("_meta") if isinstance(caps, dict) else None
        limits = meta.get("limits") if isinstance(meta, dict) else None
        if not isinstance(limits, dict):
            try:
                limits = (await self.capabilities()).get("limits")
            except RpcError as exc:
                if exc.kind != MethodNotFoundError.kind and exc.code != MethodNotFoundError.code:
                    raise
                limits = None  # not an acp-server: no advertised limit
        self.limits = limits if isinstance(limits, dict) else None
        if not self._limit_given:
            server_limit = self.limits.get("maxPendingPromptsPerSession") if self.limits else None
            self.max_pending_prompts = check_prompt_limit(server_limit, "the server's maxPendingPromptsPerSession")
        return result

    async def authenticate(self, method_id: str, meta: Mapping[str, Any] | None = None) -> Any:
        """``authenticate`` with one of ``init_result["authMethods"]``."""
        params: dict[str, Any] = {"methodId": method_id}
        if meta:
            params["_meta"] = dict(meta)
        return await self.connection.call("authenticate", params)

    async def logout(self) -> Any:
        """``logout``."""
        return await self.connection.call("logout")

    async def capabilities(self) -> dict[str, Any]:
        """``_acp_server/capabilities``: ``{"limits": {...}}``."""
        result = await self.connection.call("_acp_server/capabilities")
        return result if isinstance(result, dict) else {}

    async def stats(self) -> dict[str, Any]:
        """``_acp_server/stats``."""
        result = await self.connection.call("_acp_server/stats")
        return result if isinstance(result, dict) else {}

    # --- sessions ------------------------------------------------------------------------------------

    async def new_session(
        self,
        cwd: str | None = None,
        *,
        mcp_servers: Sequence[Mapping[str, Any]] = (),
        client_id: str | None = None,
        backend: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> SessionClient:
        """``session/new`` in ``cwd`` (default: the current directory).

        Args:
            client_id: an id to ask for (the server keeps it only if already registered there).
            backend: the server's backend for it (``_meta.backend``; default: the server's).
            meta: more ``_meta`` keys.
        """
        cwd = cwd if cwd is not None else os.getcwd()
        params: dict[str, Any] = {"cwd": cwd, "mcpServers": [dict(s) for s in mcp_servers]}
        extra = dict(meta or {})
        if client_id is not None:
            extra["clientId"] = client_id
        if backend is not None:
            extra["backend"] = backend
        if extra:
            params["_meta"] = extra
        result = await self.connection.call("session/new", params)
        session_id = result.get("sessionId") if isinstance(result, dict) else None
        if not isinstance(session_id, str):
            raise ProtocolError(f"the session/new result carries no sessionId: {result!r}")
        return SessionClient(self, session_id, cwd, client_id_of(result, "session/new"), result=result)

    async def _reattach(
        self,
        method: str,
        session_id: str,
        cwd: str | None,
        client_id: str | None,
        after_event_id: int | None,
        mcp_servers: Sequence[Mapping[str, Any]],
    ) -> SessionClient:
        cwd = cwd if cwd is not None else os.getcwd()
        params: dict[str, Any] = {"sessionId": session_id, "cwd": cwd, "mcpServers": [dict(s) for s in mcp_servers]}
        meta: dict[str, Any] = {}
        if client_id is not None:
            meta["clientId"] = client_id
        if after_event_id is not None:
            meta["afterEventId"] = after_event_id
        if meta:
            params["_meta"] = meta
        self.connection.updates(session_id)  # replayed updates arrive before the answer: keep them
        result = await self.connection.call(method, params)
        return SessionClient(self, session_id, cwd, client_id_of(result, method), result=result)

    async def load_session(
        self,
        session_id: str,
        cwd: str | None = None,
        *,
        client_id: str | None = None,
        after_event_id: int | None = None,
        mcp_servers: Sequence[Mapping[str, Any]] = (),
    ) -> SessionClient:
        """``session/load``: the history is replayed into the session's :attr:`~SessionClient.updates`
        (after ``after_event_id`` if given), then this client is registered (re-using ``client_id``
        when the server still knows it)."""
        return await self._reattach("session/load", session_id, cwd, client_id, after_event_id, mcp_servers)

    async def resume_session(
        self,
        session_id: str,
        cwd: str | None = None,
        *,
        client_id: str | None = None,
        after_event_id: int | None = None,
    ) -> SessionClient:
        """``session/resume``: register this client on the session (no replay unless ``after_event_id``)."""
        return await self._reattach("session/resume", session_id, cwd, client_id, after_event_id, ())

    def use_session(self, session_id: str, *, client_id: str | None, cwd: str | None = None) -> SessionClient:
        """Hold a session whose ids are already known, without a call; a stale ``client_id`` self-heals
        on the first prompt (``cwd`` is what that resume sends; default: the current directory)."""
        return SessionClient(self, session_id, cwd if cwd is not None else os.getcwd(), client_id)

    async def list_sessions(self, cwd: str | None = None) -> list[SessionInfo]:
        """``session/list``, every page."""
        sessions: list[SessionInfo] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {}
            if cwd is not None:
                params["cwd"] = cwd
            if cursor is not None:
                params["cursor"] = cursor
            result = await self.connection.call("session/list", params)
            try:
                page = msgspec.convert(result, ListSessionsResult)
            except msgspec.ValidationError as exc:
                raise ProtocolError(f"undecodable session/list result: {exc}") from None
            sessions.extend(page.sessions)
            if page.next_cursor is None:
                return sessions
            cursor = page.next_cursor


@asynccontextmanager
async def _open_stream(
    target: Target, ca_file: str | None = None, token: str | None = None
) -> AsyncIterator[trio.abc.Stream]:
    if isinstance(target, trio.abc.Stream):
        stream: trio.abc.Stream = target
        try:
            yield stream
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_STOP_GRACE_S):
                await stream.aclose()
        return
    if isinstance(target, str):
        kind, where, port = parse_url(target)
        if kind in ("http", "https", "ws", "wss"):
            from .remote import open_remote_stream

            async with open_remote_stream(where, ca_file, token=token) as remote:
                yield remote
            return
        if kind == "tcp":
            stream = await trio.open_tcp_stream(where, port)
        elif kind == "tls":
            stream = await open_tls_stream(where, port, ca_file)
        else:
            stream = await trio.open_unix_socket(where)
        async with _open_stream(stream) as opened:
            yield opened
        return
    async with _spawn(list(target)) as opened:
        yield opened


@asynccontextmanager
async def _spawn(command: list[str]) -> AsyncIterator[trio.abc.Stream]:
    """A server spawned to speak over its stdin/stdout (its stderr is ours); stopped on exit."""
    if not command:
        raise ValueError("the command to spawn is empty")
    proc = await trio.lowlevel.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield trio.StapledStream(proc.stdin, proc.stdout)
    finally:
        with trio.CancelScope(shield=True):
            await proc.stdin.aclose()  # an ACP server ends at the end of its input
            with trio.move_on_after(_STOP_GRACE_S):
                await proc.wait()
            if proc.returncode is None:
                proc.terminate()
                with trio.move_on_after(_STOP_GRACE_S):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.stdout.aclose()


@asynccontextmanager
async def connect(
    target: Target,
    *,
    hooks: Hooks | None = None,
    max_pending_prompts: int | None = None,
    on_self_heal: Callable[[str | None, str], None] | None = None,
    client_info: Mapping[str, Any] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_updates: int = 10_000,
    initialize: bool = True,
    tenant_id: str | None = None,
    turn_states: bool | None = None,
    token: str | None = None,
    ca_file: str | None = None,
) -> AsyncIterator[Client]:
    """Connect to a server and ``initialize``; the connection closes when the block ends.

    Args:
        target: ``tcp://HOST:PORT``, ``tls://HOST:PORT``, ``unix:/path``, ``http(s)://HOST:PORT/acp``,
            ``ws(s)://HOST:PORT/acp``, a command (list of strings) or a trio stream.
        hooks: answers to the server's requests (default: permission ``cancelled``, fs refused).
        max_pending_prompts: the local pending-prompt limit per session; ``None`` (default) takes the
            server's ``maxPendingPromptsPerSession``, ``0`` disables it.
        on_self_heal: ``on_self_heal(old_id, new_id)`` whenever a session re-registers a stale client id.
        client_info: ``clientInfo`` for ``initialize`` (``name``, ``version``).
        max_message_bytes: the longest line accepted from the server.
        max_buffered_updates: unread updates kept per session before the oldest is dropped.
        initialize: send ``initialize`` before handing the client out.
        tenant_id: the tenant this connection acts for (``initialize`` ``_meta.tenantId``); sessions
            belong to their tenant, and the server's admission policy caps and shares seats by it.
        turn_states: ask for ``_acp_server/turn_state`` notifications (``True``: they reach
            ``hooks.on_notification``) or not (``False``) at ``initialize``; ``None`` (default) leaves it
            to the server's ``--turn-states``, off by default. The client's own logic (prompts, retries,
            self-heal, cancellation) does not use them.
        token: the secret of an ``acp-server token``: after ``initialize``, ``authenticate`` with
            ``acp-server-token`` (a wrong one raises the server's ``auth_required``); over ``http(s)://``
            and ``ws(s)://`` it is also sent as ``Authorization: Bearer`` on every request.
        ca_file: PEM file of the CAs a ``tls://``, ``https://`` or ``wss://`` server's certificate is
            checked against (default: the system trust store).

    Raises:
        ValueError, TypeError: a bad argument (a limit negative or fractional, a malformed URL).
        OSError: the connection could not be made (``ConnectionError`` naming the fix when the
            server's certificate is not trusted).
    """
    if max_pending_prompts is not None:
        check_prompt_limit(max_pending_prompts, "max_pending_prompts")
    async with _open_stream(target, ca_file, token) as stream:
        conn = RpcConnection(
            stream, hooks=hooks or Hooks(), max_message_bytes=max_message_bytes, max_buffered_updates=max_buffered_updates
        )
        client = Client(
            conn,
            max_pending_prompts=max_pending_prompts,
            on_self_heal=on_self_heal,
            client_info=client_info,
            tenant_id=tenant_id,
            turn_states=turn_states,
        )
        raised: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(conn.run)
                try:
                    if initialize:
                        await client.initialize()
                        if token is not None:
                            await client.authenticate(TOKEN_METHOD_ID, {"token": token})
                    yield client
                except BaseException as exc:
                    raised = exc
                    raise
                finally:
                    conn.close()
        except BaseExceptionGroup as group:
            # The caller's own error, wrapped by our nursery on its way out: hand it back as raised
            # (`except RpcError` around the block must work). Anything else stays grouped.
            if raised is None or len(group.exceptions) != 1 or group.exceptions[0] is not raised:
                raise
        else:
            return
        raise raised
