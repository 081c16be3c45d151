"""qwen serve's REST + SSE session API on the HTTP listener, translated into the handlers' own calls.

Routes (bodies are the Structs of :mod:`.rest_types`; every non-2xx body is
:func:`~.rules.error_body`'s ``{error, code, ...data}``; :mod:`.openapi` documents them all):

- ``GET /health`` (``?deep=1`` adds sessions, active prompts and connections), ``GET /capabilities``,
  ``GET /openapi.json``.
- ``POST /session`` ``{cwd?, sessionScope?}``: ``single`` (default) attaches to that cwd's default
  session (:class:`~.rest_state.RestState`), ``thread`` always creates one (``session/new``).
- ``POST /session/:id/load`` and ``/resume`` (``session/load``, ``session/resume``), ``/heartbeat``,
  ``/detach`` (204), ``/prompt`` (202 ``{promptId, lastEventId, eventEpoch}``), ``/cancel`` (204),
  ``/permission/:requestId`` (200 ``{}``); ``DELETE /session/:id`` (``session/close``, 204);
  ``POST /sessions/delete``; ``GET /workspace/:cwd/sessions`` (``session/list``, cursor paging).
- ``GET /session/:id/events``: see :mod:`.rest_stream` and :mod:`.rest_events`.

How a route reads its request's body and client id header is :mod:`.rest_body` (:class:`RestApi` is a
:class:`~.rest_body.RestBodies`).

A REST request acts for its caller's tenant (its token's; ``default`` without tokens; an admin's
``X-Acp-Tenant``, see :mod:`.auth`) with the client id of its ``X-Qwen-Client-Id`` header. It
runs the ACP handler of the same method with a :class:`RestContext`, whose peer (:class:`RestCaller`)
is never attached to a session: a REST caller sees events only on its SSE subscription. (A prompt whose
body has no ``_meta`` or deadline takes the handler's usual case inline: the bridge's own ``admit``.)

Prompt checks, in this order: route (404, 405), content type (415, only for a body that is there),
size (413), JSON (400 ``parse_error``), body shape and ``deadlineMs`` (400 ``invalid_params``),
client-id header syntax (400 ``invalid_params``), session (404 ``session_not_found``), client id
(400 ``invalid_client_id``), then the bridge's synchronous admission: 503 for ``prompt_queue_full``,
``capacity_exceeded``, ``capacity_unavailable`` and ``session_limit_exceeded``, 429 for
``admission_deferred`` and ``rate_limited``, 409 for ``idempotency_key_conflict``, each with
``Retry-After`` when retryable (:func:`status_of` maps every kind).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

import msgspec

from ...bridge import Session
from ...bridge.settlement import PromptWaiter
from ...bridge.shared_admit import SharedAdmit
from ...errors import (
    AcpError,
    InternalError,
    InvalidParamsError,
    MethodNotAllowedError,
    RouteNotFoundError,
    SessionNotFoundError,
)
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
from .auth import HttpCaller, current_caller
from .lean import LeanStream
from .rest_body import ClientGone, RestBodies, _convert, _typed
from .rest_events import EVENT_TYPES, SseSubscriber
from .rest_permissions import PermissionBoard, RestChannel
from .rest_request import RestCaller, RestContext, http_status, refusal, status_of
from .rest_state import RestState
from .rest_stream import MAX_SUBSCRIBERS, serve_events
from .rest_types import (
    CapabilitiesBody,
    CreateSessionRequest,
    DeleteSessionsRequest,
    DeleteSessionsResult,
    HealthBody,
    HeartbeatResult,
    PermissionAnswered,
    PermissionVote,
    PromptAccepted,
    PromptRequest,
    RestLimits,
    RestoreSessionRequest,
    SessionAttached,
    SessionRestored,
)

if TYPE_CHECKING:
    from ...server import Server
    from .streams import Receive, Send

__all__ = ["EPOCH_HEADER", "FEATURES", "RestApi", "RestCaller", "RestContext", "http_status", "status_of"]

log = logging.getLogger("acp_server.http")

#: The event epoch (a response header of ``GET /session/:id/events``, sent back with ``Last-Event-ID``).
EPOCH_HEADER = b"x-qwen-event-epoch"
_JSON = (b"content-type", b"application/json")
#: The tags of what this API serves (``GET /capabilities`` ``features``), in qwen serve's own names
#: (its capability registry): no tag is listed for a route or behaviour this API does not have.
FEATURES = (
    "health", "capabilities", "session_create", "session_scope_override", "session_load", "session_resume",
    "session_list", "session_prompt", "non_blocking_prompt", "prompt_absolute_deadline", "session_cancel",
    "session_close", "session_events", "slow_client_warning", "typed_event_schema", "client_identity",
    "client_heartbeat", "session_permission_vote",
)


class RestApi(RestBodies):
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
        store = getattr(server, "store", None)
        self.state = RestState(store.directory if store is not None else None)
        self._openapi: bytes | None = None
        #: default sessions that were live in this process (see :meth:`_default_session`)
        self._defaults_seen_live: set[str] = set()

    @staticmethod
    def handles(path: str) -> bool:
        """Whether ``path`` is one of this API's."""
        return path in ("/openapi.json", "/capabilities", "/session", "/sessions/delete") or path.startswith(("/session/", "/workspace/"))

    # --- answers --------------------------------------------------------------------------------------

    async def _json(self, send: Send, status: int, obj: Any, cors: list[tuple[bytes, bytes]]) -> None:
        body = msgspec.json.encode(obj) if obj is not None else b""
        headers = [_JSON, *cors] if obj is not None else list(cors)
        stream = getattr(send, "__self__", None)
        if type(stream) is LeanStream:  # (its whole answer in one call)
            await stream.respond(status, headers, body)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _raw_json(self, send: Send, status: int, body: bytes, cors: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [_JSON, *cors]})
        await send({"type": "http.response.body", "body": body})

    async def refuse(self, send: Send, exc: AcpError, cors: list[tuple[bytes, bytes]]) -> None:
        """Answer with :func:`refusal`'s status, headers and body."""
        status, headers, body = refusal(exc, cors)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


    def _ctx(self, channel: RestChannel | None = None) -> RestContext:
        return RestContext(self.server, self.caller, channel)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        """Serve one REST request (Host and Origin are checked already)."""
        try:
            path: str = scope["path"]
            if path.endswith("/prompt") and scope["method"] == "POST":  # (the hot route: found first)
                parts = path.strip("/").split("/")
                if len(parts) == 3 and parts[0] == "session":
                    await self._prompt_route(parts[1], scope["headers"], receive, send, cors)
                    return
            await self._dispatch(scope, receive, send, cors)
        except AcpError as exc:
            await self.refuse(send, exc, cors)
        except ClientGone:
            pass  # the client left before its body was in
        except Exception:
            log.exception("rest: %s %s failed", scope["method"], scope["path"][:256])
            await self.refuse(send, InternalError(), cors)

    async def _dispatch(self, scope: dict[str, Any], receive: Receive, send: Send, cors: list[tuple[bytes, bytes]]) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers = scope["headers"]
        parts = path.strip("/").split("/")
        raw_query = scope.get("query_string", b"")
        query = parse_qs(raw_query.decode("latin-1")) if raw_query else {}

        def need(*allowed: str) -> None:
            if method not in allowed:
                raise MethodNotAllowedError(path=path[:256], method=method, allowed=list(allowed))

        if path == "/openapi.json":
            need("GET")
            await self._raw_json(send, 200, self.openapi(), cors)
        elif path == "/capabilities":
            need("GET")
            await self._json(send, 200, self.capabilities(), cors)
        elif path == "/session":
            need("POST")
            body = _convert(await self._body(headers, receive), CreateSessionRequest)
            await self._json(send, 200, await self.create(body, self._client_id(headers)), cors)
        elif path == "/sessions/delete":
            need("POST")
            body = _convert(await self._body(headers, receive), DeleteSessionsRequest)
            await self._json(send, 200, self.delete_many(body.session_ids), cors)
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
            self.server.bridge.get(parts[1], _tenant())
            session_handler.close(self._ctx(), CloseSessionParams(session_id=parts[1], meta=meta))
            self.state.forget_session(parts[1])  # its subscribers were sent session_closed by the bridge
            await self._json(send, 204, None, cors)
        elif parts[0] == "session" and len(parts) == 3:
            await self._session_route(parts[1], parts[2], method, path, headers, query, receive, send, cors)
        elif parts[0] == "session" and len(parts) == 4 and parts[2] == "permission":
            need("POST")
            body = await self._body(headers, receive)
            self.server.bridge.get(parts[1], _tenant())
            if not self.board.answer(parts[1], parts[3], _permission_outcome(_convert(body, PermissionVote))):
                raise RouteNotFoundError(path=path[:256])
            await self._json(send, 200, PermissionAnswered(), cors)
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
            session = self.server.bridge.get(session_id, _tenant())
            await serve_events(self, session, headers, query, receive, send, cors)
            return
        if action == "prompt":
            await self._prompt_route(session_id, headers, receive, send, cors)
            return
        body = await self._body(headers, receive)
        if action in ("load", "resume"):
            await self._json(send, 200, await self.restore(session_id, action, _convert(body, RestoreSessionRequest), headers), cors)
        elif action == "heartbeat":
            meta = self._meta(headers)
            session = self.server.bridge.get(session_id, _tenant())
            client = self.server.bridge.resolve_client(session, self.caller, (meta or {}).get("clientId"))
            last_seen = self.server.bridge.heartbeat(session, client)
            await self._json(send, 200, HeartbeatResult(session_id=session_id, client_id=client, last_seen_at=last_seen), cors)
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

    async def _prompt_route(
        self, session_id: str, headers: list[tuple[bytes, bytes]], receive: Receive, send: Send,
        cors: list[tuple[bytes, bytes]],
    ) -> None:
        """``POST /session/:id/prompt``, past its route and method: its body, its checks and its 202."""
        body = await self._typed_body(headers, receive, PromptRequest)
        admitted = self._admit(session_id, body, headers)
        if not isinstance(admitted, PromptAccepted):
            admitted = await self._shared_admit(*admitted)
        await self._json(send, 202, admitted, cors)

    def direct_prompt(
        self, session_id: str, headers: list[tuple[bytes, bytes]], body: bytes, caller: HttpCaller,
        fields: dict[bytes, bytes] | None = None,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """``POST /session/:id/prompt`` of ``caller`` with its whole ``body``, past its route and the
        listener's checks (``AcpHttpApp.direct_request``): what :meth:`_prompt_route` answers, as its
        status, headers and body, when the admission is this process's (``None``: a coordinator's,
        which is waited for on the general path). ``fields``: the headers' first values by name."""
        if self.server.bridge.shared is not None:
            return None
        try:
            request = _typed(self._checked_body(headers, body, fields), PromptRequest)
            admitted = self._admit(session_id, request, headers, caller, fields)
            return 202, [_JSON], msgspec.json.encode(admitted)
        except AcpError as exc:
            return refusal(exc, [])
        except Exception:
            log.exception("rest: %s %s failed", "POST", f"/session/{session_id}/prompt"[:256])
            return refusal(InternalError(), [])

    # --- the routes -----------------------------------------------------------------------------------

    def capabilities(self) -> CapabilitiesBody:
        """``GET /capabilities``: the version, features, limits and primary workspace."""
        limits = self.server.limits
        return CapabilitiesBody(
            v=1,
            protocol_versions=[1],
            mode="acp-server",
            features=list(FEATURES),
            event_types=list(EVENT_TYPES),
            limits=RestLimits(
                max_pending_prompts_per_session=limits.max_pending_prompts_per_session or None,
                max_message_bytes=self.max_message_bytes,
                max_subscribers_per_session=MAX_SUBSCRIBERS,
                prompt_deadline_ms=limits.prompt_deadline_ms or None,
            ),
            workspace_cwd=self.workspace,
        )

    def openapi(self) -> bytes:
        """``GET /openapi.json``: the document :mod:`.openapi` generates (built once)."""
        if self._openapi is None:
            from .openapi import openapi_json

            self._openapi = openapi_json()
        return self._openapi

    def health(self, deep: bool) -> HealthBody:
        """``GET /health``: ``{"status": "ok"}``; deep adds sessions, active prompts and connections."""
        if not deep:
            return HealthBody(status="ok")
        bridge = self.server.bridge
        sessions = list(bridge.sessions.values()) if hasattr(bridge, "sessions") else []
        return HealthBody(
            status="ok",
            sessions=len(sessions),
            active_prompts=sum(s.pending_count for s in sessions),
            self_heal_resumes_total=bridge.self_heal_resumes,
            connected_clients=len(self.server.connections) + sum(
                sum(isinstance(p, SseSubscriber) for p in s.attached) for s in sessions
            ),
        )

    async def create(self, body: CreateSessionRequest, client_id: str | None) -> SessionAttached:
        """``POST /session``: ``single`` attaches to the cwd's default session (made the first time, and
        again once it ended), ``thread`` always makes one."""
        cwd = body.cwd or self.workspace
        if body.session_scope == "single":
            session_handler._check_cwd(cwd)
            session = self._default_session(cwd)
            if session is not None:
                got = self.server.bridge.register(session, self.caller, client_id)
                return _created(session, got, attached=True)
        meta = {"clientId": client_id} if client_id else None
        params = NewSessionParams(cwd=cwd, mcp_servers=[], meta=meta)
        result = await session_handler.new(self._ctx(), params)
        session = self.server.bridge.get(result["sessionId"], _tenant())
        if body.session_scope == "single":
            self.state.set_default(_default_key(cwd), session.session_id)
            self._defaults_seen_live.add(session.session_id)
        return _created(session, result["_meta"]["clientId"], attached=False)

    def _default_session(self, cwd: str) -> Session | None:
        """The default session of ``cwd`` when it still exists: live, or stored from before a restart
        (restored here). One that was live in this process and is no longer was closed (``DELETE``,
        an ACP ``session/close``): it is not the default any more."""
        session_id = self.state.default_session(_default_key(cwd))
        if session_id is None:
            return None
        bridge = self.server.bridge
        if session_id in self._defaults_seen_live and session_id not in bridge.sessions:
            self.state.forget_session(session_id)
            return None
        try:
            session = bridge.get(session_id, _tenant())
        except SessionNotFoundError:
            self.state.forget_session(session_id)
            return None
        self._defaults_seen_live.add(session_id)
        return session

    async def restore(
        self, session_id: str, action: str, body: RestoreSessionRequest, headers: list[tuple[bytes, bytes]]
    ) -> SessionRestored:
        """``POST /session/:id/load`` and ``/resume``: register the caller (a fresh id unless its header's is)."""
        bridge = self.server.bridge
        meta = self._meta(headers) or {}
        session = bridge.get(session_id, _tenant())
        params = LoadSessionParams(session_id=session_id, cwd=body.cwd or session.cwd, mcp_servers=[], meta=meta)
        handler = session_handler.load if action == "load" else session_handler.resume
        result = await _maybe_await(handler(self._ctx(), params))
        return SessionRestored(
            session_id=session_id, workspace_cwd=session.cwd, attached=True, client_id=result["_meta"]["clientId"],
            last_event_id=session.next_event_id - 1, created_at=session.created_ms, event_epoch=self.state.epoch,
        )

    def delete_many(self, session_ids: list[str]) -> DeleteSessionsResult:
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
                self.state.forget_session(session_id)
        return DeleteSessionsResult(removed=removed, not_found=missing)

    async def prompt(self, session_id: str, body: PromptRequest, headers: list[tuple[bytes, bytes]]) -> PromptAccepted:
        """``POST /session/:id/prompt``: ``session/prompt``'s admission (synchronous, or with a coordinator
        its shared part's one call); 202 once admitted."""
        admitted = self._admit(session_id, body, headers)
        return admitted if isinstance(admitted, PromptAccepted) else await self._shared_admit(*admitted)

    def _admit(
        self, session_id: str, body: PromptRequest, headers: list[tuple[bytes, bytes]], caller: HttpCaller | None = None,
        fields: dict[bytes, bytes] | None = None,
    ) -> PromptAccepted | tuple[SharedAdmit, int]:
        """:meth:`prompt`'s synchronous part for ``caller`` (default: the request's): the 202's body once
        admitted here, or the coordinator's admission to wait for, with the session's last event id at
        admission (``fields``: the headers' first values by name, when the request has them)."""
        if body.meta or body.deadline_ms is not None:
            meta = dict(body.meta or {})
            if body.deadline_ms is not None:
                meta["deadlineMs"] = body.deadline_ms
            meta_deadline_ms(meta)
            meta = self._meta(headers, meta) or {}
        else:  # the usual body: _meta is the header's client id alone, if any
            client_id = self._client_id(headers, fields)
            bridge = self.server.bridge
            if bridge.shared is None:
                return self._admit_plain(session_id, body, client_id, caller or current_caller.get())
            meta = {"clientId": client_id} if client_id is not None else {}
        params = PromptParams(session_id=session_id, prompt=body.prompt, meta=meta)
        if caller is None:
            caller = current_caller.get()
        session = self.server.bridge.get(session_id, caller.tenant)
        last_event_id = session.next_event_id - 1
        waiter = prompt_handler.prompt(RestContext(self.server, self.caller, RestChannel(session, self.board), caller), params)
        if isinstance(waiter, SharedAdmit):  # the limits are a cluster's: wait for the coordinator's answer
            return waiter, last_event_id
        assert isinstance(waiter, PromptWaiter)
        waiter.subscribe(_ignore)
        return PromptAccepted(prompt_id=waiter.ticket.prompt_id, last_event_id=last_event_id, event_epoch=self.state.epoch)

    def _admit_plain(self, session_id: str, body: PromptRequest, client_id: str | None, caller: HttpCaller) -> PromptAccepted:
        """:meth:`_admit` of a body with no ``_meta`` or deadline, admitted in this process: what
        ``session/prompt``'s handler does for it (``handlers.prompt._prompt``'s usual case), with the
        bridge's admission called positionally, as TCP's ``prompt_request`` calls it (no context, no
        ``PromptParams``, no ``_meta`` dict to read back)."""
        bridge = self.server.bridge
        session = bridge.get(session_id, caller.tenant)
        last_event_id = session.next_event_id - 1
        ticket, _ = bridge.admit(
            session_id, body.prompt, self.caller, client_id, None, False, RestChannel(session, self.board), None, None,
            caller.tenant,
        )
        # no waiter: its only part would be a callback that ignores the outcome (the caller reads the
        # turn on its SSE subscription), and a ticket without waiters settles exactly as one with it
        return PromptAccepted(prompt_id=ticket.prompt_id, last_event_id=last_event_id, event_epoch=self.state.epoch)

    async def _shared_admit(self, waiter: SharedAdmit, last_event_id: int) -> PromptAccepted:
        """The 202's body once the coordinator admitted ``waiter`` (its refusal raised)."""
        refusal: list[AcpError] = []
        waiter.subscribe(lambda result, error: refusal.append(error) if error is not None else None)
        await waiter.decided.wait()
        if waiter.ticket is None:
            raise refusal[0] if refusal else InternalError()
        return PromptAccepted(prompt_id=waiter.ticket.prompt_id, last_event_id=last_event_id, event_epoch=self.state.epoch)


def _tenant() -> str:
    """The tenant the request being served acts for."""
    return current_caller.get().tenant


def _default_key(cwd: str) -> str:
    """The default-session map's key of ``cwd`` for the caller's tenant (each tenant has its own)."""
    tenant = _tenant()
    return cwd if tenant == "default" else f"{tenant}\n{cwd}"


def _created(session: Session, client_id: str, *, attached: bool) -> SessionAttached:
    return SessionAttached(session_id=session.session_id, workspace_cwd=session.cwd, attached=attached,
                           client_id=client_id, created_at=session.created_ms)


def _cancel_params(session_id: str, meta: dict[str, Any] | None) -> Any:
    from ...types.acp import CancelParams

    return CancelParams(session_id=session_id, meta=meta)


def _permission_outcome(vote: PermissionVote) -> Any:
    if vote.outcome is not None:
        return {"outcome": vote.outcome}
    if vote.option_id is not None:
        return {"outcome": {"outcome": "selected", "optionId": vote.option_id}}
    raise InvalidParamsError(path="outcome", detail='give {"outcome": {...}} or {"optionId": "..."}')


def _ignore(result: Any, error: AcpError | None) -> None:
    """A REST prompt's outcome reaches its caller as ``turn_complete`` / ``turn_error`` events."""


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value
