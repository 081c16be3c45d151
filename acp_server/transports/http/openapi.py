"""The REST API's OpenAPI 3.1 document and the JSON Schemas of its error bodies, generated from code.

- Request and response bodies are the msgspec Structs of :mod:`.rest_types`, the very types the
  handlers decode and encode (``msgspec.json.schema_components``).
- Every non-2xx body is ``{error, code, ...data}`` (:func:`~.rules.error_body`): its schema is built
  from the error registry (:data:`acp_server.errors.REGISTRY`), one per ``errorKind``, with the status
  :func:`~.rest.status_of` sends it with. ``schemas/http/<kind>.json`` hold them one by one and
  ``schemas/http/error.json`` as one ``oneOf``; the document carries them as components.
- :data:`ROUTES` says, for each operation, its body, its answer and the error kinds it can send;
  :data:`LISTENER_KINDS` are the ones any request can meet (Host and Origin checks, the connection
  gate, a bug).

``make schemas`` writes ``schemas/http/`` (with ``openapi.json``); a test regenerates and compares.
``GET /openapi.json`` serves the same document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from ...errors import REGISTRY
from . import rest_types as t
from .rest import status_of

__all__ = ["LISTENER_KINDS", "ROUTES", "Route", "error_body_schema", "files", "generate", "openapi_json"]

BASE_ID = "https://acp-server.dev/schemas/http/"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
_REF = "#/components/schemas/{name}"

#: Kinds any request can be refused with, whatever its route (``unauthorized`` and ``rate_limited``
#: with ``--auth-tokens``).
LISTENER_KINDS = (
    "forbidden_host", "forbidden_origin", "too_many_connections", "internal", "method_not_allowed", "unauthorized",
    "rate_limited",
)
_BODY = ("unsupported_media_type", "message_too_large", "parse_error", "invalid_params")
_SESSION = ("session_not_found", "invalid_params")
_ADMISSION = (
    "prompt_queue_full", "capacity_exceeded", "capacity_unavailable", "session_limit_exceeded", "admission_deferred",
    "rate_limited", "idempotency_key_conflict", "duplicate_in_flight", "invalid_client_id", "backend_unavailable",
    "lease_lost",
)


@dataclass(frozen=True)
class Route:
    """One operation of the REST API.

    Attributes:
        method: the HTTP method; path: the OpenAPI path template.
        operation_id: its ``operationId``; summary: one line on what it does.
        request: the body Struct (``None``: no body).
        status: the success status; response: its body Struct (``None``: no body; ``"sse"``: an event
            stream).
        kinds: the error kinds it can send besides :data:`LISTENER_KINDS`.
        client_id: it reads the ``X-Qwen-Client-Id`` header.
        query: its query parameters, name -> JSON Schema.
    """

    method: str
    path: str
    operation_id: str
    summary: str
    request: type[Any] | None
    status: int
    response: type[Any] | str | None
    kinds: tuple[str, ...] = ()
    client_id: bool = True
    query: tuple[tuple[str, dict[str, Any]], ...] = ()


ROUTES = (
    Route("GET", "/health", "health",
          "Liveness; ?deep=1 adds sessions, active prompts and connections; ?ready=1 is 503 while this replica "
          "would refuse new prompts (its coordinator down in closed mode, or draining)",
          None, 200, t.HealthBody, ("capacity_unavailable", "insufficient_scope"), client_id=False,
          query=(("deep", {"type": "string"}), ("ready", {"type": "string"}))),
    Route("GET", "/capabilities", "capabilities", "Version, feature tags, limits and the primary workspace",
          None, 200, t.CapabilitiesBody, client_id=False),
    Route("GET", "/openapi.json", "openapi", "This document", None, 200, dict, client_id=False),
    Route("POST", "/session", "createSession", "Create a session, or attach to the cwd's default one (single)",
          t.CreateSessionRequest, 200, t.SessionAttached,
          (*_BODY, "session_limit_exceeded", "backend_unavailable", "agent_error", "invalid_client_id")),
    Route("POST", "/session/{sessionId}/load", "loadSession", "Load a session (session/load)",
          t.RestoreSessionRequest, 200, t.SessionRestored,
          (*_BODY, *_SESSION, "backend_unavailable", "agent_error", "invalid_client_id", "session_limit_exceeded")),
    Route("POST", "/session/{sessionId}/resume", "resumeSession", "Resume a session (session/resume)",
          t.RestoreSessionRequest, 200, t.SessionRestored,
          (*_BODY, *_SESSION, "backend_unavailable", "agent_error", "invalid_client_id", "session_limit_exceeded")),
    Route("POST", "/session/{sessionId}/heartbeat", "heartbeat", "Mark the client id (or the session) active",
          None, 200, t.HeartbeatResult, (*_BODY, *_SESSION, "invalid_client_id")),
    Route("POST", "/session/{sessionId}/detach", "detach", "Release the client id this caller holds",
          None, 204, None, (*_BODY, *_SESSION)),
    Route("POST", "/session/{sessionId}/prompt", "prompt", "Admit a prompt (202); its events follow on /events",
          t.PromptRequest, 202, t.PromptAccepted, (*_BODY, *_SESSION, *_ADMISSION)),
    Route("POST", "/session/{sessionId}/cancel", "cancel", "Cancel the running prompt",
          None, 204, None, (*_BODY, *_SESSION, "invalid_client_id")),
    Route("POST", "/session/{sessionId}/permission/{requestId}", "answerPermission",
          "Answer an open permission request (the first answer wins; later ones 404)",
          t.PermissionVote, 200, t.PermissionAnswered, (*_BODY, *_SESSION, "route_not_found")),
    Route("GET", "/session/{sessionId}/events", "events", "The session's events (SSE), replayed after Last-Event-ID",
          None, 200, "sse", (*_SESSION, "subscriber_limit_exceeded"),
          query=(("lastEventId", {"type": "string"}), ("maxQueued", {"type": "string"}),
                 ("connectReason", {"type": "string"}), ("previousStreamId", {"type": "string"}))),
    Route("DELETE", "/session/{sessionId}", "closeSession", "Close the session (session/close); the transcript stays",
          None, 204, None, (*_SESSION, "invalid_client_id")),
    Route("POST", "/sessions/delete", "deleteSessions", "Delete sessions and their transcripts",
          t.DeleteSessionsRequest, 200, t.DeleteSessionsResult, _BODY, client_id=False),
    Route("GET", "/workspace/{cwd}/sessions", "listSessions", "The sessions of a cwd (url-encoded, absolute), paged",
          None, 200, "ListSessionsResult", ("invalid_params", "route_not_found"), client_id=False,
          query=(("cursor", {"type": "string"}),)),
)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _component(kind: str) -> str:
    return REGISTRY[kind].__name__ + "Body"


def error_body_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of the HTTP body of ``kind``: ``error`` (the message), ``code`` (the kind) and
    the payload's fields beside them (no ``errorKind``: ``code`` is it)."""
    cls = REGISTRY[kind]
    payload = msgspec.json.schema(cls.data_type)
    defs = payload.get("$defs", {})
    ref = payload.get("$ref", "")
    inner = defs[ref.rsplit("/", 1)[-1]] if ref else payload
    if set(defs) - {ref.rsplit("/", 1)[-1]}:
        raise ValueError(f"{kind}: a payload with nested types needs their schemas here too")
    props = {k: v for k, v in inner.get("properties", {}).items() if k != "errorKind"}
    required = [k for k in inner.get("required", []) if k != "errorKind"]
    return {
        "type": "object",
        "title": f"{kind} (HTTP {status_of(cls)})",
        "description": f"{cls.__name__}: {cls.template}",
        "properties": {"error": {"type": "string", "minLength": 1}, "code": {"const": kind}, **props},
        "required": ["error", "code", *required],
        "additionalProperties": False,
    }


def _responses(route: Route, components: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if route.response is None:
        out[str(route.status)] = {"description": "done (no body)"}
    elif route.response == "sse":
        out[str(route.status)] = {
            "description": "an SSE stream of qwen's event envelopes",
            "headers": {"X-Qwen-Event-Epoch": {"schema": {"type": "string"}}},
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    else:
        if route.response is dict:
            schema: dict[str, Any] = {"type": "object"}
        else:
            name = route.response if isinstance(route.response, str) else route.response.__name__
            schema = {"$ref": _REF.format(name=name)}
        out[str(route.status)] = {"description": "OK", "content": {"application/json": {"schema": schema}}}
        if route.response is t.SessionAttached:
            out[str(route.status)]["links"] = _session_links()
    by_status: dict[int, list[str]] = {}
    for kind in sorted(set(route.kinds) | set(LISTENER_KINDS)):
        by_status.setdefault(status_of(REGISTRY[kind]), []).append(kind)
    for status, kinds in sorted(by_status.items()):
        refs = [{"$ref": _REF.format(name=_component(k))} for k in kinds]
        response: dict[str, Any] = {
            "description": "refused: " + ", ".join(kinds),
            "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}},
        }
        if any(REGISTRY[k].retryable for k in kinds):
            response["headers"] = {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}
        out[str(status)] = response
    return out


def _session_links() -> dict[str, Any]:
    """OpenAPI links from a new session to the operations on it (what stateful testing follows); not
    to ``events``, whose stream never ends by itself."""
    return {
        r.operation_id: {"operationId": r.operation_id, "parameters": {"sessionId": "$response.body#/sessionId"}}
        for r in ROUTES
        if r.path.startswith("/session/{sessionId}") and "{requestId}" not in r.path and r.operation_id != "events"
    }


def _required(struct: Any) -> bool:
    """The body Struct has a field without a default (so a request without a body is refused)."""
    fields = msgspec.structs.fields(struct)
    return any(f.required for f in fields) or struct is t.PermissionVote


#: What a body's Struct cannot say: ``PermissionVote`` needs ``outcome`` or ``optionId``.
_AMENDMENTS: dict[str, dict[str, Any]] = {
    "PermissionVote": {"anyOf": [
        {"required": ["outcome"], "properties": {"outcome": {"type": "object"}}},
        {"required": ["optionId"], "properties": {"optionId": {"type": "string"}}},
    ]},
}


def _operation(route: Route, components: dict[str, Any]) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for name in route.path.split("/") if name.startswith("{")
    ]
    if route.client_id:
        params.append({"name": "X-Qwen-Client-Id", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}})
    params += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in route.query]
    op: dict[str, Any] = {"operationId": route.operation_id, "summary": route.summary}
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {
            "required": _required(route.request),
            "content": {"application/json": {"schema": {"$ref": _REF.format(name=route.request.__name__)}}},
        }
    op["responses"] = _responses(route, components)
    return op


def generate() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the REST API."""
    from ...types.acp import ListSessionsResult

    structs: list[Any] = [ListSessionsResult]
    for route in ROUTES:
        for kind in (route.request, route.response):
            if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
                structs.append(kind)
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    for name, extra in _AMENDMENTS.items():
        components[name] = {**components[name], **extra}
    kinds = sorted({k for r in ROUTES for k in r.kinds} | set(LISTENER_KINDS))
    for kind in kinds:
        components[_component(kind)] = error_body_schema(kind)
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "acp-server REST + SSE session API",
            "version": "1",
            "description": "qwen serve's session API over acp-server's bridge. Generated from the handlers' "
            "msgspec types and the error registry (acp_server/transports/http/openapi.py); do not edit.",
        },
        "paths": paths,
        "components": {"schemas": dict(sorted(components.items()))},
    }


def openapi_json() -> bytes:
    """The document as served (compact JSON)."""
    return json.dumps(generate(), separators=(",", ":")).encode()


def files() -> dict[str, Any]:
    """``schemas/http/``: ``openapi.json``, ``error.json`` and one ``<kind>.json`` per error kind."""
    out: dict[str, Any] = {"http/openapi.json": generate()}
    for kind in sorted(REGISTRY):
        out[f"http/{kind}.json"] = {"$schema": DRAFT, "$id": f"{BASE_ID}{kind}.json", **error_body_schema(kind)}
    out["http/error.json"] = {
        "$schema": DRAFT,
        "$id": f"{BASE_ID}error.json",
        "title": "the body of every non-2xx HTTP answer of acp-server",
        "description": "{error, code, ...data}: code is the errorKind and selects the fields.",
        "oneOf": [{"$ref": f"{kind}.json"} for kind in sorted(REGISTRY)],
    }
    return out
