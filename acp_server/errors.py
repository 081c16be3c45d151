"""Every error the server can send, as one tree of exception classes.

Each class binds an ``errorKind`` (the stable discriminator clients switch on) to its JSON-RPC code, a
message template, whether a retry can help, and the Struct of its ``data`` payload. The registry
``schemas/errors/codes.json`` is generated from :data:`REGISTRY`; a test checks classes, registry and
schemas agree. Blame is split as in h11: the peer's fault, overload, and our own bugs.

    AcpError (Exception)
    ├── RemoteProtocolError                 the peer broke JSON-RPC or ACP rules
    │   ├── ParseError                      -32700 parse_error
    │   ├── InvalidRequestError             -32600 invalid_request
    │   ├── NotInitializedError             -32600 not_initialized
    │   ├── MessageTooLargeError            -32600 message_too_large
    │   ├── MethodNotFoundError             -32601 method_not_found
    │   └── InvalidParamsError              -32602 invalid_params
    ├── RequestCancelledError               -32800 request_cancelled
    ├── SessionStateError                   the session cannot take this request
    │   ├── SessionNotFoundError            -32002 session_not_found
    │   ├── InvalidClientIdError            -32003 invalid_client_id
    │   ├── BranchWhilePromptActiveError    -32006 branch_while_prompt_active
    │   ├── IdempotencyKeyConflictError     -32008 idempotency_key_conflict
    │   └── DuplicateInFlightError          -32016 duplicate_in_flight (the key is claimed on another replica)
    ├── OverloadError                       refused for capacity; retryable
    │   ├── PromptQueueFullError            -32001 prompt_queue_full
    │   ├── CapacityExceededError           -32005 capacity_exceeded
    │   ├── AdmissionDeferredError          -32010 admission_deferred (tenant at its seat cap)
    │   ├── CapacityUnavailableError        -32011 capacity_unavailable (admission policy refused)
    │   └── RateLimitedError                -32014 rate_limited (--rate-limit-rps, or failed authentications)
    ├── PromptDeadlineExceededError         -32004 prompt_deadline_exceeded
    ├── LeaseLostError                      -32015 lease_lost (the shared lease could not be re-taken)
    ├── SessionLimitExceededError           -32009 session_limit_exceeded (--max-sessions live sessions)
    ├── BackendError                        the agent behind a session failed or refused
    │   ├── BackendUnavailableError         -32007 backend_unavailable
    │   ├── AuthRequiredError               -32000 auth_required
    │   │   └── TokenRequiredError                     (the gateway's own: authenticate acp-server-token)
    │   └── AgentError                      -32012 agent_error (the agent's own error, wrapped)
    ├── HttpError                           HTTP-only refusals of /acp (the body, never JSON-RPC)
    │   ├── RouteNotFoundError              -32600 route_not_found (404)
    │   ├── MethodNotAllowedError           -32600 method_not_allowed (405)
    │   ├── ForbiddenHostError              -32600 forbidden_host (403)
    │   ├── ForbiddenOriginError            -32600 forbidden_origin (403)
    │   ├── UnsupportedMediaTypeError       -32600 unsupported_media_type (415)
    │   ├── NotAcceptableError              -32600 not_acceptable (406)
    │   ├── MissingHeaderError              -32600 missing_header (400)
    │   ├── UnknownConnectionError          -32600 unknown_connection (404)
    │   ├── SessionNotEstablishedError      -32600 session_not_established (404)
    │   ├── BatchNotSupportedError          -32600 batch_not_supported (501)
    │   ├── SubscriberLimitExceededError    -32017 subscriber_limit_exceeded (429, Retry-After)
    │   ├── TooManyConnectionsError         -32011 too_many_connections (503, Retry-After)
    │   ├── UnauthorizedError               -32600 unauthorized (401: missing, malformed, wrong or expired token)
    │   ├── InsufficientScopeError          -32600 insufficient_scope (403: the token lacks admin/metrics)
    │   └── ConnectionEvictedError          -32600 connection_evicted (429: the connection was evicted)
    └── InternalError                       -32603 internal (bugs only: overload is never -32603)
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from .types import errors as data

__all__ = [
    "BatchNotSupportedError",
    "ConnectionEvictedError",
    "ForbiddenHostError",
    "ForbiddenOriginError",
    "HttpError",
    "MethodNotAllowedError",
    "MissingHeaderError",
    "NotAcceptableError",
    "RouteNotFoundError",
    "SessionNotEstablishedError",
    "SubscriberLimitExceededError",
    "TooManyConnectionsError",
    "UnauthorizedError",
    "UnknownConnectionError",
    "UnsupportedMediaTypeError",
    "REGISTRY",
    "AgentError",
    "AuthRequiredError",
    "BackendError",
    "BackendUnavailableError",
    "RETRY_AFTER_MS",
    "EVICTION_REASONS",
    "AcpError",
    "AdmissionDeferredError",
    "BranchWhilePromptActiveError",
    "CapacityExceededError",
    "CapacityUnavailableError",
    "DuplicateInFlightError",
    "IdempotencyKeyConflictError",
    "InsufficientScopeError",
    "InternalError",
    "InvalidClientIdError",
    "InvalidParamsError",
    "InvalidRequestError",
    "LeaseLostError",
    "MessageTooLargeError",
    "MethodNotFoundError",
    "NotInitializedError",
    "OverloadError",
    "ParseError",
    "PromptDeadlineExceededError",
    "PromptQueueFullError",
    "RateLimitedError",
    "RemoteProtocolError",
    "RequestCancelledError",
    "SessionLimitExceededError",
    "SessionNotFoundError",
    "SessionStateError",
    "TokenRequiredError",
]

#: The retry hint sent with ``prompt_queue_full``: long enough for a few echo-sized turns to drain.
RETRY_AFTER_MS = 5000

#: Why the server closes a connection: ``reason`` of ``_acp_server/evicted``, its last message
#: (:class:`~acp_server.types.ext.EvictedParams`, ``schemas/evicted.json``).
EVICTION_REASONS: dict[str, str] = {
    "queue_overflow": "the connection did not read: its outbound queue outgrew --max-outbound-bytes (limit, queuedBytes)",
    "too_many_connections": "the listeners hold --max-connections sockets already (limit)",
    "token_revoked": "the connection's token was revoked or expired",
    "ignored_retry_after": "the connection spent its refusal budget by re-sending what it was told to hold off "
    "(--refusal-budget-rps, --refusal-budget-burst; refusals, ignoredRetryAfter, inDebt, budgetRps, budgetBurst)",
}


class AcpError(Exception):
    """Base of every error sent on the wire.

    Subclasses set ``code``, ``kind``, ``template`` (``str.format`` over the payload's field names),
    ``retryable`` and ``data_type``. Construct with the payload's fields as keyword arguments;
    ``errorKind`` is added by the payload's tag.

    Attributes:
        code: the JSON-RPC error code; message: the error's text; data (also ``payload``): the
            ``data`` Struct. These are the members of a JSON-RPC error object, which the core's
            encoder writes in jsonrpcserver's error response shape.
    """

    code: int
    kind: ClassVar[str]
    template: ClassVar[str]
    retryable: ClassVar[bool] = False
    data_type: ClassVar[type[data.ErrorData]]

    def __init__(self, **fields: Any) -> None:
        self.payload = self.data = self.data_type(**fields)
        self.message = self.template.format(**fields)

    def __str__(self) -> str:
        return str(self.message)

    def for_prompt(self, prompt_id: str) -> AcpError:
        """This error naming the admitted prompt it ends in ``data.promptId`` (a copy; ``self`` when its
        payload has no such field or names one already)."""
        payload = self.payload
        if getattr(payload, "prompt_id", "") is not None:
            return self
        cls = type(self)
        named = cls.__new__(cls)  # not copy.copy: exceptions copy by re-calling __init__ with args
        named.__dict__.update(self.__dict__)
        named.args = self.args
        named.payload = named.data = msgspec.structs.replace(payload, prompt_id=prompt_id)
        return named

    def to_dict(self) -> dict[str, Any]:
        """The JSON-RPC error object, ``{"code", "message", "data"}``."""
        return {"code": self.code, "message": self.message, "data": msgspec.to_builtins(self.payload)}


class RemoteProtocolError(AcpError):
    """The peer sent something JSON-RPC 2.0 or ACP does not allow."""


class ParseError(RemoteProtocolError):
    code = -32700
    kind = "parse_error"
    template = "Parse error: the line is not valid UTF-8 JSON ({detail})"
    data_type = data.ParseErrorData


class InvalidRequestError(RemoteProtocolError):
    code = -32600
    kind = "invalid_request"
    template = "Invalid request: {detail}"
    data_type = data.InvalidRequestData


class NotInitializedError(RemoteProtocolError):
    code = -32600
    kind = "not_initialized"
    template = 'Call "initialize" before "{method}"'
    data_type = data.NotInitializedData


class MessageTooLargeError(RemoteProtocolError):
    code = -32600
    kind = "message_too_large"
    template = "Message larger than {limit} bytes; the connection will be closed"
    data_type = data.MessageTooLargeData


class MethodNotFoundError(RemoteProtocolError):
    code = -32601
    kind = "method_not_found"
    template = 'Method not found: "{method}"'
    data_type = data.MethodNotFoundData


class InvalidParamsError(RemoteProtocolError):
    code = -32602
    kind = "invalid_params"
    template = "Invalid params at {path}: {detail}"
    data_type = data.InvalidParamsData


class RequestCancelledError(AcpError):
    code = -32800
    kind = "request_cancelled"
    template = "Request cancelled"
    data_type = data.RequestCancelledData


class SessionStateError(AcpError):
    """The named session cannot take this request now."""


class SessionNotFoundError(SessionStateError):
    code = -32002
    kind = "session_not_found"
    template = 'Session "{session_id}" not found'
    data_type = data.SessionNotFoundData


class InvalidClientIdError(SessionStateError):
    code = -32003
    kind = "invalid_client_id"
    template = 'Client id "{client_id}" is not registered for session "{session_id}"; re-register with session/resume'
    data_type = data.InvalidClientIdData


class BranchWhilePromptActiveError(SessionStateError):
    code = -32006
    kind = "branch_while_prompt_active"
    template = 'Session "{session_id}" cannot be forked while its backend is still finishing an abandoned prompt'
    data_type = data.BranchWhilePromptActiveData


class IdempotencyKeyConflictError(SessionStateError):
    code = -32008
    kind = "idempotency_key_conflict"
    template = 'Idempotency key "{idempotency_key}" of session "{session_id}" was used for a different prompt'
    data_type = data.IdempotencyKeyConflictData


class DuplicateInFlightError(SessionStateError):
    code = -32016
    kind = "duplicate_in_flight"
    template = (
        'Idempotency key "{idempotency_key}" of session "{session_id}" is held by replica "{replica_id}";'
        " retry after {retry_after_ms} ms"
    )
    retryable = True
    data_type = data.DuplicateInFlightData


class OverloadError(AcpError):
    """Refused for capacity: nothing ran, nothing was counted, a later retry may succeed."""

    retryable = True


class PromptQueueFullError(OverloadError):
    code = -32001
    kind = "prompt_queue_full"
    template = 'Prompt queue full for session "{session_id}" ({pending_count}/{limit} pending)'
    data_type = data.PromptQueueFullData


class CapacityExceededError(OverloadError):
    code = -32005
    kind = "capacity_exceeded"
    template = (
        'Backend "{backend_id}" is at capacity ({active_count} running, {waiting_count} waiting, limit {limit});'
        ' prompt for session "{session_id}" refused, retry after {retry_after_ms} ms'
    )
    data_type = data.CapacityExceededData


class AdmissionDeferredError(OverloadError):
    code = -32010
    kind = "admission_deferred"
    template = 'Tenant "{tenant_id}" already runs its limit of prompts at once ({reason}); retry after {retry_after_ms} ms'
    data_type = data.AdmissionDeferredData


class CapacityUnavailableError(OverloadError):
    code = -32011
    kind = "capacity_unavailable"
    template = "No capacity for this prompt ({reason}); retry after {retry_after_ms} ms (request {request_id})"
    data_type = data.CapacityUnavailableData


class RateLimitedError(OverloadError):
    code = -32014
    kind = "rate_limited"
    template = "Rate limited ({reason}); retry after {retry_after_ms} ms"
    data_type = data.RateLimitedData


class PromptDeadlineExceededError(AcpError):
    code = -32004
    kind = "prompt_deadline_exceeded"
    template = 'Prompt deadline of {deadline_ms} ms exceeded for session "{session_id}" after {elapsed_ms} ms'
    data_type = data.PromptDeadlineExceededData


class LeaseLostError(AcpError):
    code = -32015
    kind = "lease_lost"
    template = (
        'The shared lease "{lease_id}" (fencing token {fencing_token}) expired in the coordinator and could'
        " not be taken again within the cluster's limit; the prompt was stopped"
    )
    retryable = True
    data_type = data.LeaseLostData


class SessionLimitExceededError(AcpError):
    code = -32009
    kind = "session_limit_exceeded"
    template = "The server holds its limit of {limit} live sessions; close one (session/close) or raise --max-sessions"
    data_type = data.SessionLimitExceededData


class BackendError(AcpError):
    """The agent behind the session failed or refused; never passes for one of ours."""


class BackendUnavailableError(BackendError):
    code = -32007
    kind = "backend_unavailable"
    template = 'Backend "{backend_id}" is unavailable ({reason}, exit code {exit_code})'
    #: the message of a model endpoint's failure (``attempts`` given instead of ``exit_code``)
    model_template: ClassVar[str] = 'Backend "{backend_id}" is unavailable ({reason} after {attempts} attempt(s){more})'
    retryable = True
    data_type = data.BackendUnavailableData

    def __init__(self, **fields: Any) -> None:
        if "attempts" not in fields:
            super().__init__(**fields)
            return
        self.payload = self.data = self.data_type(**fields)
        status, detail = fields.get("status"), fields.get("detail")
        more = (f", last status {status}" if status is not None else "") + (f": {detail}" if detail else "")
        self.message = self.model_template.format(more=more, **fields)


class AuthRequiredError(BackendError):
    code = -32000
    kind = "auth_required"
    template = 'Backend "{backend_id}" requires authentication; call "authenticate" first'
    data_type = data.AuthRequiredData


class TokenRequiredError(AuthRequiredError):
    """``auth_required`` from the gateway itself: the connection has not proved a token yet.

    The same kind and code as the agent's (``data.methodId`` and ``data.detail`` instead of
    ``data.backendId``); every failed ``authenticate`` gets this same error.
    """

    template = 'This server requires a token; call "authenticate" with methodId "{method_id}" ({detail})'


class AgentError(BackendError):
    code = -32012
    kind = "agent_error"
    template = 'Backend "{backend_id}" answered with error {agent_code}: {agent_message}'
    data_type = data.AgentErrorData


class HttpError(AcpError):
    """A refusal of the HTTP layer of ``/acp``, sent as the body of a non-2xx answer (never on JSON-RPC).

    ``status`` is the HTTP status it goes with.
    """

    code = -32600
    status: ClassVar[int] = 400


class RouteNotFoundError(HttpError):
    kind = "route_not_found"
    status = 404
    template = "No route {path}; ACP is served at /acp (and GET /health)"
    data_type = data.RouteNotFoundData


class MethodNotAllowedError(HttpError):
    kind = "method_not_allowed"
    status = 405
    template = "{path} does not take {method} (the Allow header and data.allowed list what it takes)"
    data_type = data.MethodNotAllowedData


class ForbiddenHostError(HttpError):
    kind = "forbidden_host"
    status = 403
    template = (
        'Host "{host}" is not this server\'s (127.0.0.1, localhost, [::1] or the bound address); '
        "allow a remote name with --http-allow-host NAME"
    )
    data_type = data.ForbiddenHostData


class ForbiddenOriginError(HttpError):
    kind = "forbidden_origin"
    status = 403
    template = 'Origin "{origin}" is not allowed; list it with --http-allow-origin'
    data_type = data.ForbiddenOriginData


class UnsupportedMediaTypeError(HttpError):
    kind = "unsupported_media_type"
    status = 415
    template = 'POST /acp takes Content-Type application/json; got "{content_type}"'
    data_type = data.UnsupportedMediaTypeData


class NotAcceptableError(HttpError):
    kind = "not_acceptable"
    status = 406
    template = 'GET /acp opens an event stream: send Accept: text/event-stream (or Upgrade: websocket); got "{accept}"'
    data_type = data.NotAcceptableData


class MissingHeaderError(HttpError):
    kind = "missing_header"
    status = 400
    template = "This request needs the {header} header"
    data_type = data.MissingHeaderData


class UnknownConnectionError(HttpError):
    kind = "unknown_connection"
    status = 404
    template = 'No connection "{connection_id}" (closed, expired, or the server restarted): initialize again'
    data_type = data.UnknownConnectionData


class SessionNotEstablishedError(HttpError):
    kind = "session_not_established"
    status = 404
    template = (
        'Session "{session_id}" is not established on this connection; '
        "session/new, session/load, session/resume or _acp_server/fork it first"
    )
    data_type = data.SessionNotEstablishedData


class BatchNotSupportedError(HttpError):
    kind = "batch_not_supported"
    status = 501
    template = "POST /acp takes one JSON-RPC message, not a batch"
    data_type = data.BatchNotSupportedData


class SubscriberLimitExceededError(HttpError):
    code = -32017
    kind = "subscriber_limit_exceeded"
    status = 429
    template = 'Session "{session_id}" has its limit of {limit} event subscribers; retry after {retry_after_ms} ms'
    retryable = True
    data_type = data.SubscriberLimitExceededData


class TooManyConnectionsError(HttpError):
    code = -32011
    kind = "too_many_connections"
    status = 503
    template = "The HTTP listener holds its limit of {limit} connections; retry after {retry_after_ms} ms"
    retryable = True
    data_type = data.TooManyConnectionsData


class UnauthorizedError(HttpError):
    """The one 401 of the HTTP listener: the same body for a missing, malformed, wrong or expired token."""

    kind = "unauthorized"
    status = 401
    template = (
        "A valid token is required: send Authorization: {scheme} <secret> (a browser's WebSocket: the "
        "subprotocols acp.v1 and acp-bearer.<base64url(secret), no padding>)"
    )
    data_type = data.UnauthorizedData


class InsufficientScopeError(HttpError):
    kind = "insufficient_scope"
    status = 403
    template = "This route needs a token with one of the scopes {scopes}"
    data_type = data.InsufficientScopeData


class ConnectionEvictedError(HttpError):
    kind = "connection_evicted"
    status = 429
    template = 'Connection "{connection_id}" was evicted ({reason}); initialize a new one'
    data_type = data.ConnectionEvictedData


class InternalError(AcpError):
    code = -32603
    kind = "internal"
    template = "Internal error; the server log has the details"
    data_type = data.InternalData


def _leaves(cls: type[AcpError]) -> list[type[AcpError]]:
    out: list[type[AcpError]] = []
    for sub in cls.__subclasses__():
        if "kind" in sub.__dict__:
            out.append(sub)
        out.extend(_leaves(sub))
    return out


#: ``errorKind`` -> error class, for every kind the server can emit.
REGISTRY: dict[str, type[AcpError]] = {cls.kind: cls for cls in _leaves(AcpError)}
