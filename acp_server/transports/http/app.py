"""The ASGI app of the HTTP listener: ``GET /health`` and ``/acp`` (the RFD's Streamable HTTP and
WebSocket transport, routed as the official Python SDK 0.12.1's own server routes it).

The app translates and holds no session state: each ``/acp`` connection id (and each WebSocket) is a
:class:`~.peer.MessagePeer` served by the server's per-connection shell, exactly as a socket is, so
admission, errors, client ids, turn states, ``$/cancel_request`` and fan-out are the NDJSON ones.

Checks, in this order (the first that fails answers, with :func:`~.rules.error_body`): credentials
(401, 429, with ``--auth-tokens``: see :mod:`.auth`), route and method (404, 405), ``Host`` and
``Origin`` (403), content type (415; 406 for a GET without ``Accept: text/event-stream``), size (413),
JSON (400 ``parse_error``), batch (501), the token's request rate (429), connection id (400, 404;
another token's connection is unknown; 429 ``connection_evicted`` for one the server evicted), session
id (400, 404). ``initialize`` opens a connection (503 with ``Retry-After`` at
``max_connections``) and answers 200 with ``Acp-Connection-Id``; every other POST answers 202 and its
response comes on an event stream.

A connection with no stream open is kept ``connection_grace_s`` seconds, then its input ends as a
closed socket's would. Each connection runs in the listener's nursery, isolated: its failure is
logged and ends it alone.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from ...errors import (
    AcpError,
    ConnectionEvictedError,
    HttpError,
    InternalError,
    MessageTooLargeError,
    MethodNotAllowedError,
    MissingHeaderError,
    RouteNotFoundError,
    SessionNotEstablishedError,
    TooManyConnectionsError,
    UnknownConnectionError,
)
from .auth import TENANT_HEADER, HttpCaller, HttpGuard, HttpRefusal, current_caller
from .console import CONSOLE_PREFIX, serve_console
from .lean_ws import FRAMES_EXTENSION
from .peer import MessagePeer
from .rules import (
    ACP_PATH,
    CONNECTION_HEADER,
    HEALTH_PATH,
    SESSION_HEADER,
    SESSION_SCOPED_METHODS,
    HostRules,
    check_accept,
    check_content_type,
    cors_headers,
    decode_inbound,
    error_body,
    header,
)
from .streams import Receive, Send, pump_sse, pump_websocket

__all__ = ["AcpHttpApp", "HttpLimits", "HttpOptions"]

log = logging.getLogger("acp_server.http")

StreamHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]

_ACP_METHODS = ["GET", "POST", "DELETE", "OPTIONS"]
_JSON = (b"content-type", b"application/json")
_HEALTH_BODY = b'{"status":"ok"}'
#: The WebSocket subprotocol a browser names (it cannot send headers; a token rides beside it).
ACP_SUBPROTOCOL = "acp.v1"
_CONNECTION_KEY = CONNECTION_HEADER.lower().encode()
#: evicted connection ids remembered for their 429 answers
_EVICTED_KEPT = 1024
_SESSION_KEY = SESSION_HEADER.lower().encode()
#: the most answers :meth:`AcpHttpApp.inline_request` keeps, and the longest path kept
_INLINE_KEPT = 1024
_INLINE_PATH_KEPT = 512
_HOSTS_KEPT = 256


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of one HTTP listener (flags in parentheses).

    Attributes:
        max_connections: live ``/acp`` connections and WebSockets (``--http-max-connections``).
        connection_grace_s: how long a connection without a stream is kept (``--http-connection-grace-s``).
        max_message_bytes: the largest POST body or text frame (``--max-message-bytes``).
        max_outbound_bytes: what one stream's queue holds before the connection stalls and, past the
            shell's own bound, is evicted (``--max-outbound-bytes``).
        initialize_timeout_s: how long an ``initialize`` POST waits for its answer.
        retry_after_s: the ``Retry-After`` of a 503.
    """

    max_connections: int = 256
    connection_grace_s: float = 10.0
    max_message_bytes: int = 50 * 1024 * 1024
    max_outbound_bytes: int = 100 * 1024 * 1024
    initialize_timeout_s: float = 30.0
    retry_after_s: int = 1


@dataclass(frozen=True)
class HttpOptions:
    """What every HTTP listener of a server shares: its bounds, the foreign origins and remote host
    names it allows (``--http-allow-origin``, ``--http-allow-host``), and the reverse proxies whose
    ``X-Forwarded-*`` headers count (``--trusted-proxy``, CIDR strings)."""

    limits: HttpLimits = field(default_factory=HttpLimits)
    allow_origins: frozenset[str] = field(default_factory=frozenset)
    allow_hosts: frozenset[str] = field(default_factory=frozenset)
    trusted_proxies: tuple[str, ...] = ()
    #: the REST API's primary workspace (``workspaceCwd``; ``None``: the server's working directory)
    workspace: str | None = None


class _Connection:
    __slots__ = ("caller", "id", "peer")

    def __init__(self, id: str, peer: MessagePeer, caller: HttpCaller) -> None:
        self.id = id
        self.peer = peer
        #: who opened it: every later request on it must be the same token's
        self.caller = caller


def _status(exc: AcpError) -> int:
    if isinstance(exc, HttpError):
        return exc.status
    if isinstance(exc, MessageTooLargeError):
        return 413
    if isinstance(exc, InternalError):
        return 500
    return 400


class AcpHttpApp:
    """The ASGI 3 application (see the module docstring).

    Args:
        handle_stream: serves one connection's byte stream until it ends (the server's shell).
        nursery: where connections run (they outlive the request that opened them).
        rules: the ``Host``/``Origin`` rules of this listener.
        limits: its bounds.
        rest: the REST API (``None``: only ``/acp`` and ``/health``).
        guard: the credential checks (default: none, every caller is the owner).
    """

    def __init__(
        self,
        handle_stream: StreamHandler,
        nursery: trio.Nursery,
        rules: HostRules,
        limits: HttpLimits,
        rest: Any = None,
        guard: HttpGuard | None = None,
    ) -> None:
        self.handle_stream = handle_stream
        self.nursery = nursery
        self.rules = rules
        self.limits = limits
        self.connections: dict[str, _Connection] = {}
        #: evicted connection id -> why (its later POSTs are answered 429 ``connection_evicted``)
        self._evicted: dict[str, str] = {}
        #: qwen serve's REST + SSE API (a :class:`~.rest.RestApi`; ``None``: only ``/acp`` and ``/health``)
        self.rest = rest
        self.guard = guard or HttpGuard(None)
        #: why the server should get no new prompts now (``/health?ready=1`` answers 503 with it), or
        #: ``None`` when it is ready; unset: always ready
        self.readiness: Callable[[], AcpError | None] | None = None
        #: :meth:`inline_request`'s answers by method and path (a client asks the same few); cleared when full
        self._inline: dict[tuple[bytes, bytes], bool] = {}
        #: :meth:`_prompt_path`'s answers for POST paths (``None``: not a prompt's); cleared when full
        self._prompt_paths: dict[bytes, str | None] = {}
        #: ``Host`` values :meth:`direct_request` found ours (``rules.check_host``'s answer is fixed), and
        #: the owner's caller by client address; each cleared when full
        self._hosts_ok: set[bytes | None] = set()
        self._owners: dict[Any, HttpCaller] = {}

    def inline_request(self, method: bytes, path: bytes) -> bool:
        """Whether a whole request may be served in its connection's reading task (no task of its own;
        see :mod:`.lean`): a REST ``POST`` or ``DELETE``, whose handler reads its body and answers,
        and never waits on anything the same connection brings later (its client waits for the answer)."""
        key = (method, path)
        try:
            return self._inline[key]
        except KeyError:
            pass
        inline = method in (b"POST", b"DELETE") and self.rest is not None and self.rest.handles(path.decode("latin-1"))
        if len(key[1]) <= _INLINE_PATH_KEPT:
            if len(self._inline) >= _INLINE_KEPT:
                self._inline.clear()
            self._inline[key] = inline
        return inline

    def direct_request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, client: Any,
        fields: dict[bytes, bytes] | None = None,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """A whole plain request answered from its parsed head, without a scope, a stream or the ASGI
        calls (:mod:`.lean` asks it of an inline request): the answer's status, headers and body, or
        ``None`` (nothing done) for any request whose checks this does not make as :meth:`__call__`
        would, which then takes that path. Only a REST prompt is answered here, and only when the
        request is the owner's (no tokens), is not a browser's (no ``Origin``: no CORS), names no
        tenant, and its ``Host`` is ours (else the refusal is the general path's): a request that
        :meth:`inline_request` takes inline, as its answer must be. ``fields``: each header's first value
        by its name (``SimpleRequest.fields``), read instead of the headers when given."""
        rest = self.rest
        if rest is None or self.guard.auth is not None:
            return None
        session_id = self._prompt_paths.get(path, "")
        if session_id == "":
            session_id = self._prompt_path(method, path)
        if session_id is None or method != b"POST":
            return None
        if fields is None:
            host = None
            for name, value in headers:  # (the fields the general path reads before the REST API's own)
                if name == b"host":
                    if host is None:
                        host = value
                elif name == b"origin" or name == TENANT_HEADER:
                    return None
        elif b"origin" in fields or TENANT_HEADER in fields:
            return None
        else:
            host = fields.get(b"host")
        if host not in self._hosts_ok:
            if host is None or self.rules.check_host(host.decode("latin-1")) is not None:
                return None
            if len(self._hosts_ok) >= _HOSTS_KEPT:
                self._hosts_ok.clear()
            self._hosts_ok.add(host)
        owner = self._owners.get(client)
        if owner is None:
            owner = self._owner_of(client)
        answer: tuple[int, list[tuple[bytes, bytes]], bytes] | None = rest.direct_prompt(session_id, headers, body, owner, fields)
        return answer

    def _owner_of(self, client: Any) -> HttpCaller:
        """The owner's caller from the address ``client`` (a connection's: asked once per request), kept."""
        source = str(client[0]) if client and client[0] else None  # (what client_address reads)
        owner = self.guard.owner("default", source)
        if len(self._owners) >= _HOSTS_KEPT:
            self._owners.clear()
        self._owners[client] = owner
        return owner

    def _prompt_path(self, method: bytes, path: bytes) -> str | None:
        """The session id of a ``POST /session/:id/prompt`` path (``None``: another path, or one with a
        percent sign, which the general path decodes), kept in :attr:`_prompt_paths` (a client prompts
        the same few sessions)."""
        if method != b"POST" or not path.startswith(b"/session/") or not path.endswith(b"/prompt") or b"%" in path:
            return None  # (not kept: a path of another method may be a prompt's later)
        parts = path.decode("ascii").strip("/").split("/")  # (RestApi's own split of the path)
        session_id = parts[1] if len(parts) == 3 and parts[0] == "session" else None
        if len(path) <= _INLINE_PATH_KEPT:
            if len(self._prompt_paths) >= _INLINE_KEPT:
                self._prompt_paths.clear()
            self._prompt_paths[path] = session_id
        return session_id

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind in ("http", "websocket"):
            caller = self.guard.admit(scope)  # first of the checks: who the request is
            if isinstance(caller, HttpRefusal):
                await self._unadmitted(scope, receive, send, caller)
                return
            token = current_caller.set(caller)
            try:
                if kind == "http":
                    await self._http(scope, receive, send)
                else:
                    await self._websocket(scope, receive, send)
            finally:
                current_caller.reset(token)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # --- answers --------------------------------------------------------------------------------------

    async def _unadmitted(self, scope: dict[str, Any], receive: Receive, send: Send, refusal: HttpRefusal) -> None:
        """Answer a request the guard refused (a WebSocket's before its upgrade, when the server can)."""
        if scope["type"] == "http":
            await self._answer(send, refusal.status, refusal.body, refusal.headers, json=False)
            return
        if (await receive())["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": refusal.status, "headers": refusal.headers})
            await send({"type": "websocket.http.response.body", "body": refusal.body})
        else:
            await send({"type": "websocket.close", "code": 1008})

    async def _answer(
        self, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]], *, json: bool = True
    ) -> None:
        out = [_JSON, *headers] if json and body else list(headers)
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, send: Send, exc: AcpError, headers: list[tuple[bytes, bytes]]) -> None:
        extra = list(headers)
        if isinstance(exc, MethodNotAllowedError):
            extra.append((b"allow", ", ".join(exc.payload.allowed).encode()))  # type: ignore[attr-defined]
        if isinstance(exc, TooManyConnectionsError):
            extra.append((b"retry-after", str(self.limits.retry_after_s).encode()))
        if isinstance(exc, ConnectionEvictedError):
            extra.append((b"connection", b"close"))
        await self._answer(send, _status(exc), error_body(exc), extra)

    async def _refused(self, send: Send, refusal: HttpRefusal, cors: list[tuple[bytes, bytes]]) -> None:
        await self._answer(send, refusal.status, refusal.body, [*refusal.headers, *cors], json=False)

    # --- HTTP -----------------------------------------------------------------------------------------

    def _route(self, path: str, method: str, rest: bool) -> AcpError | None:
        if rest:
            return None  # the REST API routes its own paths
        if path == HEALTH_PATH:
            return None if method in ("GET", "HEAD") else MethodNotAllowedError(path=path, method=method, allowed=["GET"])
        if path != ACP_PATH:
            return RouteNotFoundError(path=path)
        if method not in _ACP_METHODS:
            return MethodNotAllowedError(path=path, method=method, allowed=_ACP_METHODS)
        return None

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope["path"]
        if (path == "/" or path.startswith(CONSOLE_PREFIX)) and await serve_console(scope, send, self.rules):
            return
        headers = scope["headers"]
        method = scope["method"]
        origin = host = None
        for name, value in headers:  # (both in one pass: what header() gives of each, the first one)
            if name == b"host":
                if host is None:
                    host = value.decode("latin-1")
            elif name == b"origin" and origin is None:
                origin = value.decode("latin-1")
        scheme = scope.get("scheme")
        cors = cors_headers(origin, self.rules, preflight=method == "OPTIONS", host=host, scheme=scheme) if origin is not None else []
        rest = self.rest is not None and self.rest.handles(path)
        refusal = (
            (None if rest else self._route(path, method, rest))  # (the REST API routes its own paths)
            or self.rules.check_host(host)
            or (None if origin is None else self.rules.check_origin(origin, host=host, scheme=scheme))  # (None: no browser)
        )
        if refusal is not None:
            await self._refuse(send, refusal, cors)
            return
        if rest:
            await self.rest(scope, receive, send, cors)
            return
        try:
            if scope["path"] == HEALTH_PATH:
                not_ready = self._not_ready(scope.get("query_string", b""))
                if not_ready is not None:
                    await self._answer(send, 503, error_body(not_ready) if method == "GET" else b"", cors)
                    return
                body = _HEALTH_BODY
                if self.rest is not None and b"deep=1" in scope.get("query_string", b""):
                    body = msgspec.json.encode(self.rest.health(deep=True))
                await self._answer(send, 200, body if method == "GET" else b"", cors)
            elif method == "OPTIONS":
                await self._answer(send, 204, b"", [*cors, (b"allow", ", ".join(_ACP_METHODS).encode())])
            elif method == "POST":
                await self._post(headers, receive, send, cors)
            elif method == "GET":
                await self._get(headers, receive, send, cors)
            else:
                await self._delete(headers, send, cors)
        except AcpError as exc:
            await self._refuse(send, exc, cors)

    def _not_ready(self, query: bytes) -> AcpError | None:
        """With ``ready=1`` in the query: the reason the server is not ready, if it is not."""
        if self.readiness is None or b"ready=1" not in query:
            return None
        return self.readiness()

    def _connection(self, headers: list[tuple[bytes, bytes]]) -> _Connection:
        connection_id = header(headers, _CONNECTION_KEY)
        if connection_id is None:
            raise MissingHeaderError(header=CONNECTION_HEADER)
        conn = self.connections.get(connection_id)
        reason = self._evicted.get(connection_id) if conn is None else conn.peer.evicted
        if conn is not None and conn.caller.identity.token_id != current_caller.get().identity.token_id:
            conn, reason = None, None  # another token's connection is unknown to this one
        if reason is not None:
            raise ConnectionEvictedError(connection_id=connection_id[:128], reason=reason)
        if conn is None:
            raise UnknownConnectionError(connection_id=connection_id[:128])
        return conn

    def _forget(self, conn: _Connection) -> None:
        """``conn`` is gone; an evicted one is remembered (the last :data:`_EVICTED_KEPT`) for its 429s."""
        self.connections.pop(conn.id, None)
        if conn.peer.evicted is not None:
            self._evicted[conn.id] = conn.peer.evicted
            if len(self._evicted) > _EVICTED_KEPT:
                del self._evicted[next(iter(self._evicted))]

    async def _read_body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> bytes | None:
        limit = self.limits.max_message_bytes
        declared = header(headers, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise MessageTooLargeError(limit=limit)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                raise MessageTooLargeError(limit=limit)
            if not message.get("more_body", False):
                return bytes(body)

    async def _post(self, headers: list[tuple[bytes, bytes]], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        refusal = check_content_type(header(headers, b"content-type"))
        if refusal is not None:
            raise refusal
        body = await self._read_body(headers, receive)
        if body is None:
            return  # the client left before its body was in
        env = decode_inbound(body)
        limited = self.guard.meter(current_caller.get(), env.method)
        if limited is not None:
            await self._refused(send, limited, cors)
            return
        if env.is_request and env.method == "initialize":
            await self._initialize(env.id, body, send, cors)
            return
        conn = self._connection(headers)
        session_id = header(headers, _SESSION_KEY)
        if session_id is None and env.method in SESSION_SCOPED_METHODS:
            raise MissingHeaderError(header=SESSION_HEADER)
        if session_id is not None and not conn.peer.has_session(session_id):
            raise SessionNotEstablishedError(session_id=session_id[:128])
        if env.is_request:
            conn.peer.note_request(env, session_id)
        await conn.peer.feed_when_room(body, self.limits.max_message_bytes)
        await self._answer(send, 202, b"", cors)

    async def _initialize(self, id: Any, body: bytes, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        limits = self.limits
        if len(self.connections) >= limits.max_connections:
            raise TooManyConnectionsError(limit=limits.max_connections, retry_after_ms=limits.retry_after_s * 1000)
        conn = self._open(multiplex=False)
        waiter = conn.peer.expect_response(id)
        conn.peer.feed(body)
        with trio.move_on_after(limits.initialize_timeout_s):
            await waiter.done.wait()
        if not waiter.data:
            conn.peer.end_input()
            self.connections.pop(conn.id, None)
            log.warning("http: initialize got no answer in %.0f s; connection dropped", limits.initialize_timeout_s)
            raise InternalError()
        await self._answer(send, 200, waiter.data, [*cors, (_CONNECTION_KEY, conn.id.encode())])

    async def _get(self, headers: list[tuple[bytes, bytes]], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        refusal = check_accept(header(headers, b"accept"))
        if refusal is not None:
            raise refusal
        conn = self._connection(headers)
        session_id = header(headers, _SESSION_KEY)
        if session_id is not None and not conn.peer.may_stream(session_id):
            raise SessionNotEstablishedError(session_id=session_id[:128])
        peer = conn.peer
        queue = peer.connection if session_id is None else peer.session_queue(session_id)
        extra = [*cors, (_CONNECTION_KEY, conn.id.encode())]
        if session_id is not None:
            extra.append((_SESSION_KEY, session_id.encode()))
        await pump_sse(peer, queue, send, receive, extra)

    async def _delete(self, headers: list[tuple[bytes, bytes]], send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        conn = self._connection(headers)
        self.connections.pop(conn.id, None)
        conn.peer.end_input()
        await self._answer(send, 202, b"", cors)

    # --- connections ---------------------------------------------------------------------------------

    def _open(self, *, multiplex: bool) -> _Connection:
        conn_id = secrets.token_hex(16)
        caller = current_caller.get()
        peer = MessagePeer(limit=self.limits.max_outbound_bytes, multiplex=multiplex)
        peer.peer_info = caller.peer_info(metered=not multiplex)  # the shell's identity and tenant
        conn = self.connections[conn_id] = _Connection(conn_id, peer, caller)
        if not multiplex:
            self.nursery.start_soon(self._run, conn)
        return conn

    async def _run(self, conn: _Connection) -> None:
        """Serve one HTTP connection until its shell ends; its failure is its own."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._grace, conn.peer)
                await self.handle_stream(conn.peer, f"http {conn.id[:8]}")
                nursery.cancel_scope.cancel()
        except Exception:
            log.exception("http %s: connection failed; closing it", conn.id[:8])
        finally:
            self._forget(conn)
            with trio.CancelScope(shield=True):
                await conn.peer.aclose()

    async def _grace(self, peer: MessagePeer) -> None:
        """End the connection's input once it has had no stream open for the grace period."""
        grace = self.limits.connection_grace_s
        while True:
            while peer.streams_open:
                await peer.wait_streams_change()
            with trio.move_on_after(grace) as idle:
                while not peer.streams_open:
                    await peer.wait_streams_change()
            if idle.cancelled_caught:
                log.info("http: a connection had no stream for %.1f s; closing it", grace)
                peer.end_input()
                return

    # --- WebSocket ----------------------------------------------------------------------------------

    async def _websocket(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        headers = scope["headers"]
        limits = self.limits
        refusal: AcpError | None = (
            RouteNotFoundError(path=scope["path"])
            if scope["path"] != ACP_PATH
            else self.rules.check_host(host := header(headers, b"host"))
            or self.rules.check_origin(header(headers, b"origin"), host=host, scheme=scope.get("scheme"))
        )
        if refusal is None and len(self.connections) >= limits.max_connections:
            refusal = TooManyConnectionsError(limit=limits.max_connections, retry_after_ms=limits.retry_after_s * 1000)
        if refusal is not None:
            await self._deny(scope, send, refusal)
            return
        conn = self._open(multiplex=True)
        accept: dict[str, Any] = {"type": "websocket.accept", "headers": [(_CONNECTION_KEY, conn.id.encode())]}
        if ACP_SUBPROTOCOL in scope.get("subprotocols", ()):  # a browser offers it (and maybe a token)
            accept["subprotocol"] = ACP_SUBPROTOCOL
        await send(accept)
        shell_done = trio.Event()
        try:
            async with trio.open_nursery() as nursery:

                async def shell() -> None:
                    try:
                        await self.handle_stream(conn.peer, f"ws {conn.id[:8]}")
                    except Exception:
                        log.exception("ws %s: connection failed; closing it", conn.id[:8])
                    finally:
                        with trio.CancelScope(shield=True):
                            await conn.peer.aclose()
                        shell_done.set()

                nursery.start_soon(shell)
                frames = scope.get("extensions", {}).get(FRAMES_EXTENSION)  # (offered at the accept)
                writer = frames["send_texts_nowait"] if frames else None
                conn.peer.frames = writer
                if frames:
                    peer, most = conn.peer, limits.max_message_bytes
                    frames["set_feed"](lambda text: peer.feed_when_room(text, most))
                await pump_websocket(conn.peer, send, receive, shell_done, limits.max_message_bytes, writer)
        finally:
            self.connections.pop(conn.id, None)

    async def _deny(self, scope: dict[str, Any], send: Send, exc: AcpError) -> None:
        """Refuse a WebSocket handshake with an HTTP answer (before the upgrade), else a close."""
        if "websocket.http.response" in scope.get("extensions", {}):
            headers = [_JSON]
            if isinstance(exc, TooManyConnectionsError):
                headers.append((b"retry-after", str(self.limits.retry_after_s).encode()))
            await send({"type": "websocket.http.response.start", "status": _status(exc), "headers": headers})
            await send({"type": "websocket.http.response.body", "body": error_body(exc)})
        else:
            await send({"type": "websocket.close", "code": 1008})

