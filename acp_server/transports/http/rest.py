"""qwen serve's REST + SSE session API on the HTTP listener, translated into the handlers' own calls.

Routes (every non-2xx body is :func:`~.rules.error_body`'s ``{error, code, ...data}``):

- ``GET /health`` (``?deep=1`` adds sessions, active prompts and connections), ``GET /capabilities``.
- ``POST /session`` ``{cwd?, sessionScope?}``: ``single`` (default) attaches to the oldest live session
  of that cwd, ``thread`` always creates one (``session/new``).
- ``POST /session/:id/load`` and ``/resume`` (``session/load``, ``session/resume``), ``/heartbeat``,
  ``/detach`` (204), ``/prompt`` (202 ``{promptId, lastEventId}``), ``/cancel`` (204),
  ``/permission/:requestId`` (200 ``{}``); ``DELETE /session/:id`` (``session/close``, 204);
  ``POST /sessions/delete``; ``GET /workspace/:cwd/sessions`` (``session/list``, cursor paging).
- ``GET /session/:id/events``: see :mod:`.rest_events`.

A REST request acts for its caller's tenant (its token's; ``default`` without tokens; an admin's
``X-Acp-Tenant``, see :mod:`.auth`) with the client id of its ``X-Qwen-Client-Id`` header. It
runs the ACP handler of the same method with a :class:`RestContext`, whose peer (:class:`RestCaller`)
is never attached to a session: a REST caller sees events only on its SSE subscription.

Prompt checks, in this order: route (404, 405), content type (415, only for a body that is there),
size (413), JSON (400 ``parse_error``), body shape and ``deadlineMs`` (400 ``invalid_params``),
client-id header syntax (400 ``invalid_params``), session (404 ``session_not_found``), client id
(400 ``invalid_client_id``), then the bridge's synchronous admission: 503 for ``prompt_queue_full``,
``capacity_exceeded``, ``capacity_unavailable`` and ``session_limit_exceeded``, 429 for
``admission_deferred``, 409 for ``idempotency_key_conflict``, each with ``Retry-After`` when retryable.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

import msgspec
import trio

from ...bridge import Session
from ...bridge.settlement import PromptWaiter
from ...bridge.shared_admit import SharedAdmit
from ...errors import (
    AcpError,
    AdmissionDeferredError,
    CapacityExceededError,
    CapacityUnavailableError,
    HttpError,
    IdempotencyKeyConflictError,
    InternalError,
    InvalidParamsError,
    MessageTooLargeError,
    MethodNotAllowedError,
    ParseError,
    PromptQueueFullError,
    RouteNotFoundError,
    SessionLimitExceededError,
    SessionNotFoundError,
    UnsupportedMediaTypeError,
)
from ...handlers import ConnContext
from ...handlers import prompt as prompt_handler
from ...handlers import session as session_handler
from ...handlers.meta import meta_deadline_ms
from ...types.acp import (
    CloseSessionParams,
    ListSessionsParams,
    LoadSessionParams,
    NewSessionParams,
    PromptParams,
)
from .auth import current_caller
from .rest_events import EVENT_TYPES, PermissionBoard, RestChannel, SseSubscriber, control_event
from .rules import error_body, header

if TYPE_CHECKING:
    from ...server import Server
    from .streams import Receive, Send

__all__ = ["FEATURES", "RestApi", "RestCaller", "RestContext", "http_status"]

log = logging.getLogger("acp_server.http")

CLIENT_HEADER = b"x-qwen-client-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_JSON = (b"content-type", b"application/json")
#: The tags of what this API serves (``GET /capabilities`` ``features``).
FEATURES = ["health", "capabilities", "session_create", "session_load", "session_resume", "session_heartbeat",
            "session_detach", "session_close", "sessions_delete", "session_list", "prompt", "cancel",
            "permissions", "events", "event_replay"]
MAX_SUBSCRIBERS = 64
HEARTBEAT_S = 15.0
_decoder = msgspec.json.Decoder()


def http_status(exc: AcpError) -> int:
    """The HTTP status a refusal is sent with."""
    if isinstance(exc, HttpError):
        return exc.status
    if isinstance(exc, (PromptQueueFullError, CapacityExceededError, CapacityUnavailableError, SessionLimitExceededError)):
        return 503
    if isinstance(exc, AdmissionDeferredError):
        return 429
    if isinstance(exc, IdempotencyKeyConflictError):
        return 409
    if isinstance(exc, SessionNotFoundError):
        return 404
    if isinstance(exc, MessageTooLargeError):
        return 413
    if isinstance(exc, InternalError):
        return 500
    return 400


class RestCaller:
    """A REST request as the bridge's ``Peer``: it registers client ids but is never attached (closed)."""

    peer_id = -1
    closed = True

    def send(self, data: bytes) -> None:
        """Dropped: a REST caller reads events on its SSE subscription."""

    async def send_reliably(self, data: bytes) -> None:
        """Dropped, as :meth:`send`."""

    async def request(self, method: str, params: Any = None) -> Any:
        """Never asked: a REST prompt's questions go through :class:`~.rest_events.RestChannel`."""
        raise trio.EndOfChannel


class RestContext(ConnContext):
    """The handlers' context for one REST request: its caller's identity and tenant, the
    :class:`RestCaller` peer, and a channel that asks the session's SSE subscribers."""

    __slots__ = ("rest_channel",)

    def __init__(self, server: Server, peer: RestCaller, rest_channel: RestChannel | None = None) -> None:
        super().__init__(server, peer)
        caller = current_caller.get()
        self.identity = caller.identity
        self.tenant = caller.tenant
        self.initialized = True
        self.rest_channel = rest_channel

    def channel(self) -> Any:
        return self.rest_channel if self.rest_channel is not None else super().channel()


class _Prompt(msgspec.Struct, kw_only=True):
    prompt: list[Any]
    deadlineMs: int | None = None  # noqa: N815 - the wire name
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class _NewSession(msgspec.Struct, kw_only=True):
    cwd: str | None = None
    sessionScope: str = "single"  # noqa: N815 - the wire name


class _Restore(msgspec.Struct, kw_only=True):
    cwd: str | None = None
    lastEventId: int | None = None  # noqa: N815 - the wire name


class _Delete(msgspec.Struct, kw_only=True):
    sessionIds: list[str]  # noqa: N815 - the wire name


class _ClientGone(Exception):
    """The client left while its request body was being read."""


def _convert(obj: Any, kind: type[Any]) -> Any:
    try:
        return msgspec.convert(obj if obj is not None else {}, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else "body"
        raise InvalidParamsError(path=path, detail=text) from None


class RestApi:
    """The REST routes of one HTTP listener (see the module docstring).

    Args:
        server: whose bridge and handlers the routes call.
        max_message_bytes: the largest body taken (413 past it).
        workspace: the primary workspace (``workspaceCwd``; the default ``cwd``).
    """

    def __init__(self, server: Server, *, max_message_bytes: int, workspace: str | None = None) -> None:
        self.server = server
        self.max_message_bytes = max_message_bytes
        self.workspace = workspace or os.getcwd()
        self.caller = RestCaller()
        self.board = PermissionBoard()

    @staticmethod
    def handles(path: str) -> bool:
        """Whether ``path`` is one of this API's."""
        return path in ("/capabilities", "/session", "/sessions/delete") or path.startswith(("/session/", "/workspace/"))

    # --- answers --------------------------------------------------------------------------------------

    async def _json(self, send: Send, status: int, obj: Any, cors: list[tuple[bytes, bytes]]) -> None:
        body = msgspec.json.encode(obj) if obj is not None else b""
        headers = [_JSON, *cors] if obj is not None else list(cors)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def refuse(self, send: Send, exc: AcpError, cors: list[tuple[bytes, bytes]]) -> None:
        """Answer with ``exc``'s status, ``Retry-After`` when it says when, and the error body."""
        headers = [_JSON, *cors]
        if isinstance(exc, MethodNotAllowedError):
            headers.append((b"allow", ", ".join(exc.payload.allowed).encode()))  # type: ignore[attr-defined]
        retry_ms = getattr(exc.payload, "retry_after_ms", None)
        if isinstance(retry_ms, int):
            headers.append((b"retry-after", str(max(1, math.ceil(retry_ms / 1000))).encode()))
        await send({"type": "http.response.start", "status": http_status(exc), "headers": headers})
        await send({"type": "http.response.body", "body": error_body(exc)})

    # --- requests -----------------------------------------------------------------------------------

    async def _body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> Any:
        """The decoded JSON body (``None`` when there is none); 415, 413, 400 ``parse_error`` in order."""
        limit = self.max_message_bytes
        declared = header(headers, b"content-length")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            body += message.get("body", b"")
            if len(body) > limit:
                break
            if not message.get("more_body", False):
                break
        if not body and not (declared and declared.strip() not in ("", "0")):
            return None
        content_type = header(headers, b"content-type")
        if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
            raise UnsupportedMediaTypeError(content_type=(content_type or "")[:128])
        if len(body) > limit:
            raise MessageTooLargeError(limit=limit)
        try:
            return _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ParseError(detail=str(exc)) from None

    @staticmethod
    def _client_id(headers: list[tuple[bytes, bytes]]) -> str | None:
        value = header(headers, CLIENT_HEADER)
        if value is None:
            return None
        if not _CLIENT_ID.fullmatch(value):
            raise InvalidParamsError(path="X-Qwen-Client-Id", detail="must match [A-Za-z0-9._:-]{1,128}")
        return value

    def _ctx(self, channel: RestChannel | None = None) -> RestContext:
        return RestContext(self.server, self.caller, channel)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        """Serve one REST request (Host and Origin are checked already)."""
        try:
            await self._dispatch(scope, receive, send, cors)
        except AcpError as exc:
            await self.refuse(send, exc, cors)
        except _ClientGone:
            pass  # the client left before its body was in
        except Exception:
            log.exception("rest: %s %s failed", scope["method"], scope["path"][:256])
            await self.refuse(send, InternalError(), cors)

    async def _dispatch(self, scope: dict[str, Any], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers = scope["headers"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        parts = path.strip("/").split("/")

        def need(*allowed: str) -> None:
            if method not in allowed:
                raise MethodNotAllowedError(path=path[:256], method=method, allowed=list(allowed))

        if path == "/capabilities":
            need("GET")
            await self._json(send, 200, self.capabilities(), cors)
        elif path == "/session":
            need("POST")
            body = _convert(await self._body(headers, receive), _NewSession)
            await self._json(send, 200, await self.create(body, self._client_id(headers)), cors)
        elif path == "/sessions/delete":
            need("POST")
            body = _convert(await self._body(headers, receive), _Delete)
            await self._json(send, 200, self.delete_many(body.sessionIds), cors)
        elif parts[0] == "workspace" and path.endswith("/sessions") and len(path) > len("/workspace//sessions"):
            need("GET")
            # the cwd is one url-encoded segment: read it from the raw path (``path`` is decoded)
            raw = scope.get("raw_path") or path.encode()
            raw_parts = raw.decode("latin-1").split("?", 1)[0].strip("/").split("/")
            if len(raw_parts) != 3:
                raise RouteNotFoundError(path=path[:256])
            cursor = query.get("cursor", [None])[0]
            params = ListSessionsParams(cwd=unquote(raw_parts[1]), cursor=cursor)
            result = session_handler.list_sessions(self._ctx(), params)
            await self._json(send, 200, msgspec.to_builtins(result), cors)
        elif parts[0] == "session" and len(parts) == 2:
            need("DELETE")
            meta = self._meta(headers)
            watching = _subscribers(self.server.bridge.get(parts[1], _tenant()))
            session_handler.close(self._ctx(), CloseSessionParams(session_id=parts[1], meta=meta))
            for sub in watching:
                sub.push_event(control_event("session_closed", {"sessionId": parts[1], "reason": "closed"}))
                sub.close()
            await self._json(send, 204, None, cors)
        elif parts[0] == "session" and len(parts) == 3:
            await self._session_route(parts[1], parts[2], method, path, headers, query, receive, send, cors)
        elif parts[0] == "session" and len(parts) == 4 and parts[2] == "permission":
            need("POST")
            body = await self._body(headers, receive)
            self.server.bridge.get(parts[1], _tenant())
            if not self.board.answer(parts[1], parts[3], _permission_outcome(body)):
                raise RouteNotFoundError(path=path[:256])
            await self._json(send, 200, {}, cors)
        else:
            raise RouteNotFoundError(path=path[:256])

    def _meta(self, headers: list[tuple[bytes, bytes]], meta: dict[str, Any] | None = None) -> dict[str, Any] | None:
        client_id = self._client_id(headers)
        if client_id is None:
            return meta
        return {**(meta or {}), "clientId": client_id}

    async def _session_route(
        self, session_id: str, action: str, method: str, path: str, headers: list[tuple[bytes, bytes]],
        query: dict[str, list[str]], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]],
    ) -> None:
        allowed = "GET" if action == "events" else "POST"
        if action not in ("events", "load", "resume", "heartbeat", "detach", "prompt", "cancel"):
            raise RouteNotFoundError(path=path[:256])
        if method != allowed:
            raise MethodNotAllowedError(path=path[:256], method=method, allowed=[allowed])
        if action == "events":
            await self.events(session_id, headers, query, receive, send, cors)
            return
        body = await self._body(headers, receive)
        if action == "prompt":
            await self._json(send, 202, await self.prompt(session_id, _convert(body, _Prompt), headers), cors)
        elif action in ("load", "resume"):
            await self._json(send, 200, await self.restore(session_id, action, _convert(body, _Restore), headers), cors)
        elif action == "heartbeat":
            meta = self._meta(headers)
            session = self.server.bridge.get(session_id, _tenant())
            client = self.server.bridge.resolve_client(session, self.caller, (meta or {}).get("clientId"))
            last_seen = self.server.bridge.heartbeat(session, client)
            await self._json(send, 200, {"sessionId": session_id, "clientId": client, "lastSeenAt": last_seen}, cors)
        elif action == "detach":
            client_id = self._client_id(headers)
            session = self.server.bridge.get(session_id, _tenant())
            if client_id is not None and client_id in session.clients:
                self.server.bridge.release_client(session, self.caller, client_id)
            await self._json(send, 204, None, cors)
        else:
            session_handler.cancel(self._ctx(), _cancel_params(session_id, self._meta(headers)))
            self.server.bridge.get(session_id, _tenant())
            await self._json(send, 204, None, cors)

    # --- the routes -----------------------------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """``GET /capabilities``: the version, features, limits and primary workspace."""
        server = self.server
        limits = server.limits
        pending = limits.max_pending_prompts_per_session or None
        return {
            "v": 1,
            "protocolVersions": [1],
            "mode": "acp-server",
            "features": FEATURES,
            "eventTypes": list(EVENT_TYPES),
            "limits": {
                "maxPendingPromptsPerSession": pending,
                "maxMessageBytes": self.max_message_bytes,
                "maxSubscribersPerSession": MAX_SUBSCRIBERS,
                "promptDeadlineMs": limits.prompt_deadline_ms or None,
            },
            "workspaceCwd": self.workspace,
        }

    def health(self, deep: bool) -> dict[str, Any]:
        """``GET /health``: ``{"status": "ok"}``; deep adds sessions, active prompts and connections."""
        out: dict[str, Any] = {"status": "ok"}
        if deep:
            bridge = self.server.bridge
            sessions = list(bridge.sessions.values()) if hasattr(bridge, "sessions") else []
            out["sessions"] = len(sessions)
            out["activePrompts"] = sum(s.pending_count for s in sessions)
            out["selfHealResumesTotal"] = bridge.self_heal_resumes
            out["connectedClients"] = len(self.server.connections) + sum(
                sum(isinstance(p, SseSubscriber) for p in s.attached) for s in sessions
            )
        return out

    async def create(self, body: _NewSession, client_id: str | None) -> dict[str, Any]:
        """``POST /session``."""
        if body.sessionScope not in ("single", "thread"):
            raise InvalidParamsError(path="sessionScope", detail='must be "single" or "thread"')
        cwd = body.cwd or self.workspace
        bridge = self.server.bridge
        if body.sessionScope == "single":
            session_handler._check_cwd(cwd)
            live = [s for s in bridge.list_sessions(cwd, _tenant()) if isinstance(s, Session)]
            if live:
                session = live[0]
                got = bridge.register(session, self.caller, client_id)
                return _created(session, got, attached=True)
        meta = {"clientId": client_id} if client_id else None
        params = NewSessionParams(cwd=cwd, mcp_servers=[], meta=meta)
        result = await session_handler.new(self._ctx(), params)
        session = bridge.get(result["sessionId"], _tenant())
        return _created(session, result["_meta"]["clientId"], attached=False)

    async def restore(self, session_id: str, action: str, body: _Restore, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        """``POST /session/:id/load`` and ``/resume``: register the caller (a fresh id unless its header's is)."""
        bridge = self.server.bridge
        meta = self._meta(headers) or {}
        session = bridge.get(session_id, _tenant())
        params = LoadSessionParams(session_id=session_id, cwd=body.cwd or session.cwd, mcp_servers=[], meta=meta)
        handler = session_handler.load if action == "load" else session_handler.resume
        result = await _maybe_await(handler(self._ctx(), params))
        return {
            "sessionId": session_id,
            "workspaceCwd": session.cwd,
            "attached": True,
            "clientId": result["_meta"]["clientId"],
            "lastEventId": session.next_event_id - 1,
            "createdAt": session.created_ms,
        }

    def delete_many(self, session_ids: list[str]) -> dict[str, Any]:
        """``POST /sessions/delete``: ``session/delete`` each one."""
        removed: list[str] = []
        missing: list[str] = []
        for session_id in session_ids:
            try:
                session_handler.delete(self._ctx(), CloseSessionParams(session_id=session_id))
            except SessionNotFoundError:
                missing.append(session_id)
            else:
                removed.append(session_id)
        return {"removed": removed, "notFound": missing}

    async def prompt(self, session_id: str, body: _Prompt, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        """``POST /session/:id/prompt``: ``session/prompt``'s admission (synchronous, or with a coordinator
        its shared part's one call); 202 once admitted."""
        meta = dict(body.meta or {})
        if body.deadlineMs is not None:
            meta["deadlineMs"] = body.deadlineMs
        meta_deadline_ms(meta)
        meta = self._meta(headers, meta) or {}
        params = _convert({"sessionId": session_id, "prompt": body.prompt, "_meta": meta}, PromptParams)
        bridge = self.server.bridge
        session = bridge.get(session_id, _tenant())
        last_event_id = session.next_event_id - 1
        waiter = prompt_handler.prompt(self._ctx(RestChannel(session, self.board)), params)
        if isinstance(waiter, SharedAdmit):  # the limits are a cluster's: wait for the coordinator's answer
            refusal: list[AcpError] = []
            waiter.subscribe(lambda result, error: refusal.append(error) if error is not None else None)
            await waiter.decided.wait()
            if waiter.ticket is None:
                raise refusal[0] if refusal else InternalError()
            return {"promptId": waiter.ticket.prompt_id, "lastEventId": last_event_id}
        assert isinstance(waiter, PromptWaiter)
        waiter.subscribe(_ignore)
        return {"promptId": waiter.ticket.prompt_id, "lastEventId": last_event_id}

    async def events(
        self, session_id: str, headers: list[tuple[bytes, bytes]], query: dict[str, list[str]],
        receive: Receive, send: Send, cors: list[tuple[bytes, bytes]],
    ) -> None:
        """``GET /session/:id/events``: replay after ``Last-Event-ID`` then stream live, until the client
        leaves, the session closes, or the subscriber is evicted."""
        bridge = self.server.bridge
        session = bridge.get(session_id, _tenant())
        if len(_subscribers(session)) >= MAX_SUBSCRIBERS:
            from ...errors import SubscriberLimitExceededError

            raise SubscriberLimitExceededError(session_id=session_id, limit=MAX_SUBSCRIBERS, retry_after_ms=1000)
        last = header(headers, b"last-event-id") or query.get("lastEventId", [None])[0]
        after: int | None = None
        if last is not None:
            if not last.isascii() or not last.isdigit() or len(last) > 18:
                raise InvalidParamsError(path="Last-Event-ID", detail="must be a non-negative integer event id")
            after = int(last)
        sub = SseSubscriber(session_id)
        sub.identity = current_caller.get().identity
        auth = self.server.auth
        base = sub.frames_queued

        def replayed() -> int:
            return sub.frames_queued - base
        start = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *cors]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        await send({"type": "http.response.body", "body": b"retry: 3000\n\n", "more_body": True})
        try:
            if auth is not None:
                auth.streams.add(sub)  # evicted with its token (SIGHUP revocation, expiry)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch, receive, nursery.cancel_scope)
                nursery.start_soon(_pump, sub, send, nursery.cancel_scope)
                if after is not None:
                    newest = session.next_event_id - 1
                    if after > newest:  # a cursor from another life of the session (or made up)
                        sub.push_event(control_event("state_resync_required", {
                            "sessionId": session_id, "reason": "epoch_reset", "lastDeliveredId": after,
                            "earliestAvailableId": 1, "lastEventId": newest,
                        }))
                        await bridge.replay(session, sub, newest)
                    else:
                        await bridge.replay(session, sub, after)
                    sub.push_event(control_event("replay_complete", {
                        "sessionId": session_id, "lastReplayedEventId": sub.last_event_id,
                        "lastEventId": session.next_event_id - 1, "replayedCount": replayed(),
                    }))
                else:
                    await bridge.replay(session, sub, session.next_event_id - 1)
        finally:
            sub.close()
            bridge.peer_closed(sub)
            if auth is not None:
                auth.streams.discard(sub)
        with trio.CancelScope(shield=True):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _tenant() -> str:
    """The tenant the request being served acts for."""
    return current_caller.get().tenant


def _subscribers(session: Session) -> list[SseSubscriber]:
    return [p for p in session.attached if isinstance(p, SseSubscriber)]


def _created(session: Session, client_id: str, *, attached: bool) -> dict[str, Any]:
    return {"sessionId": session.session_id, "workspaceCwd": session.cwd, "attached": attached,
            "clientId": client_id, "createdAt": session.created_ms}


def _cancel_params(session_id: str, meta: dict[str, Any] | None) -> Any:
    from ...types.acp import CancelParams

    return CancelParams(session_id=session_id, meta=meta)


def _permission_outcome(body: Any) -> Any:
    if isinstance(body, dict) and isinstance(body.get("outcome"), dict):
        return {"outcome": body["outcome"]}
    if isinstance(body, dict) and isinstance(body.get("optionId"), str):
        return {"outcome": {"outcome": "selected", "optionId": body["optionId"]}}
    raise InvalidParamsError(path="outcome", detail='give {"outcome": {...}} or {"optionId": "..."}')


def _ignore(result: Any, error: AcpError | None) -> None:
    """A REST prompt's outcome reaches its caller as ``turn_complete`` / ``turn_error`` events."""


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


async def _watch(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _pump(sub: SseSubscriber, send: Send, scope: trio.CancelScope) -> None:
    """Write the subscriber's frames, and ``: heartbeat`` when it has been idle for 15 s."""
    while True:
        with trio.move_on_after(HEARTBEAT_S) as idle:
            frames = await sub.take()
        if idle.cancelled_caught:
            await send({"type": "http.response.body", "body": b": heartbeat\n\n", "more_body": True})
            continue
        if frames is None:
            scope.cancel()
            return
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})

