"""The ``data`` payload of every error the server sends, one Struct per ``errorKind``.

Each payload is a tagged Struct: the tag is ``errorKind``, so encoding a payload always carries its
discriminator and the JSON Schemas in ``schemas/errors/`` (generated from these types) pin it with
``const``. ``acp_server.errors`` binds each payload to its JSON-RPC code, message and retry policy.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "BatchNotSupportedData",
    "ConnectionEvictedData",
    "ForbiddenHostData",
    "ForbiddenOriginData",
    "MethodNotAllowedData",
    "MissingHeaderData",
    "NotAcceptableData",
    "RouteNotFoundData",
    "SessionNotEstablishedData",
    "SubscriberLimitExceededData",
    "TooManyConnectionsData",
    "UnknownConnectionData",
    "UnsupportedMediaTypeData",
    "AdmissionDeferredData",
    "IdempotencyKeyConflictData",
    "AgentErrorData",
    "AuthRequiredData",
    "BackendUnavailableData",
    "BranchWhilePromptActiveData",
    "CapacityExceededData",
    "CapacityUnavailableData",
    "ErrorData",
    "DuplicateInFlightData",
    "InternalData",
    "LeaseLostData",
    "InvalidClientIdData",
    "InsufficientScopeData",
    "InvalidParamsData",
    "InvalidRequestData",
    "MessageTooLargeData",
    "MethodNotFoundData",
    "NotInitializedData",
    "ParseErrorData",
    "PromptDeadlineExceededData",
    "PromptQueueFullData",
    "RateLimitedData",
    "RequestCancelledData",
    "SessionLimitExceededData",
    "SessionNotFoundData",
    "UnauthorizedData",
]


class ErrorData(msgspec.Struct, rename="camel", kw_only=True, tag_field="errorKind"):
    """Base of every error payload; subclasses set ``tag`` to their ``errorKind``."""


class ParseErrorData(ErrorData, tag="parse_error"):
    detail: str


class InvalidRequestData(ErrorData, tag="invalid_request", omit_defaults=True):
    detail: str
    #: set when the message nests deeper than this: a depth of arrays and objects that always decodes
    max_depth: int | None = None


class MethodNotFoundData(ErrorData, tag="method_not_found"):
    method: str


class InvalidParamsData(ErrorData, tag="invalid_params"):
    path: str
    detail: str


class InternalData(ErrorData, tag="internal"):
    pass


class RequestCancelledData(ErrorData, tag="request_cancelled"):
    pass


class NotInitializedData(ErrorData, tag="not_initialized"):
    method: str


class MessageTooLargeData(ErrorData, tag="message_too_large"):
    limit: int


class PromptQueueFullData(ErrorData, tag="prompt_queue_full"):
    session_id: str
    limit: int
    pending_count: int
    retry_after_ms: int


class CapacityExceededData(ErrorData, tag="capacity_exceeded"):
    # limit is the pool's max_active + max_waiting; waiting_count counts every admitted prompt not
    # running a backend call (queued in its session, waiting for a permit, or between retries).
    backend_id: str
    session_id: str
    limit: int
    active_count: int
    waiting_count: int
    retry_after_ms: int


class AdmissionDeferredData(ErrorData, tag="admission_deferred"):
    # The tenant holds its cap of running prompts; nothing was queued or counted.
    reason: Literal["tenant_limit"]
    tenant_id: str
    retry_after_ms: int
    safe_to_retry: bool


class CapacityUnavailableData(ErrorData, tag="capacity_unavailable"):
    # The admission policy refused the prompt; request_id is also in the server's log line.
    # coordinator_unavailable: the shared limits' coordinator (Redis) does not answer; draining: the
    # replica is shutting down (rolling restart) and admits nothing new.
    reason: Literal["queue_full", "deadline_unreachable", "wait_too_long", "coordinator_unavailable", "draining"]
    retry_after_ms: int
    request_id: str
    safe_to_retry: bool


class SessionNotFoundData(ErrorData, tag="session_not_found"):
    session_id: str


class InvalidClientIdData(ErrorData, tag="invalid_client_id"):
    session_id: str
    client_id: str


class PromptDeadlineExceededData(ErrorData, tag="prompt_deadline_exceeded", omit_defaults=True):
    session_id: str
    deadline_ms: int
    elapsed_ms: int
    #: the admitted prompt this error ends (its result's ``_meta.promptId``)
    prompt_id: str | None = None


class BranchWhilePromptActiveData(ErrorData, tag="branch_while_prompt_active"):
    session_id: str


class IdempotencyKeyConflictData(ErrorData, tag="idempotency_key_conflict"):
    session_id: str
    idempotency_key: str


class BackendUnavailableData(ErrorData, tag="backend_unavailable", omit_defaults=True):
    # An agent process failed (spawn_failed, exited, initialize_failed: exit_code is set, null when the
    # process gave none), or a model endpoint did (model_unreachable: no HTTP answer or a broken
    # stream; model_error: an HTTP error status), after ``attempts`` attempts, ``status`` the last
    # HTTP status when there was one.
    backend_id: str
    session_id: str | None
    reason: Literal["spawn_failed", "exited", "initialize_failed", "model_unreachable", "model_error"]
    exit_code: int | None | msgspec.UnsetType = msgspec.UNSET
    attempts: int | None = None
    status: int | None = None
    #: what went wrong, in a few words (model endpoints)
    detail: str | None = None
    #: set when the error ends an admitted prompt
    prompt_id: str | None = None


class AuthRequiredData(ErrorData, tag="auth_required", omit_defaults=True):
    #: the agent that asks for ``authenticate`` (absent when the gateway itself asks)
    backend_id: str | None = None
    #: the auth method to call ``authenticate`` with (the gateway's: ``acp-server-token``)
    method_id: str | None = None
    #: what to do, in words
    detail: str | None = None


class RateLimitedData(ErrorData, tag="rate_limited"):
    #: ``request_rate``: the token's ``--rate-limit-rps``; ``auth_failures``: too many failed
    #: authentications from this address in a minute (the secret was not checked)
    reason: Literal["request_rate", "auth_failures"]
    retry_after_ms: int


class AgentErrorData(ErrorData, tag="agent_error", omit_defaults=True):
    backend_id: str
    agent_code: int
    agent_message: str
    agent_data: Any = None
    #: set when the error ends an admitted prompt
    prompt_id: str | None = None
    #: why the server failed the prompt itself (absent: the agent's own error): ``message_too_large``
    #: (the agent sent an update or request over ``--max-message-bytes``; it was not relayed)
    reason: Literal["message_too_large"] | None = None


class SessionLimitExceededData(ErrorData, tag="session_limit_exceeded"):
    limit: int


class LeaseLostData(ErrorData, tag="lease_lost", omit_defaults=True):
    # The prompt's shared lease expired in the coordinator (an outage longer than its TTL) and could not
    # be taken again within the cluster's limit; the backend call was stopped.
    lease_id: str
    fencing_token: int
    prompt_id: str | None = None


class DuplicateInFlightData(ErrorData, tag="duplicate_in_flight"):
    # The idempotency key is claimed by a prompt on another replica (running, or ended there with the
    # outcome): ask that replica, or retry after retry_after_ms.
    session_id: str
    idempotency_key: str
    replica_id: str
    retry_after_ms: int


class RouteNotFoundData(ErrorData, tag="route_not_found"):
    path: str


class MethodNotAllowedData(ErrorData, tag="method_not_allowed"):
    path: str
    method: str
    allowed: list[str]


class ForbiddenHostData(ErrorData, tag="forbidden_host"):
    host: str


class ForbiddenOriginData(ErrorData, tag="forbidden_origin"):
    origin: str


class UnsupportedMediaTypeData(ErrorData, tag="unsupported_media_type"):
    content_type: str


class NotAcceptableData(ErrorData, tag="not_acceptable"):
    accept: str


class MissingHeaderData(ErrorData, tag="missing_header"):
    header: str


class UnknownConnectionData(ErrorData, tag="unknown_connection"):
    connection_id: str


class SessionNotEstablishedData(ErrorData, tag="session_not_established"):
    session_id: str


class BatchNotSupportedData(ErrorData, tag="batch_not_supported"):
    pass


class SubscriberLimitExceededData(ErrorData, tag="subscriber_limit_exceeded"):
    session_id: str
    limit: int
    retry_after_ms: int


class TooManyConnectionsData(ErrorData, tag="too_many_connections"):
    limit: int
    retry_after_ms: int


class UnauthorizedData(ErrorData, tag="unauthorized"):
    #: the credential scheme to send (``Bearer``); the body is the same whatever was wrong
    scheme: str


class InsufficientScopeData(ErrorData, tag="insufficient_scope"):
    #: the scopes any one of which the route needs (``admin``, ``metrics``)
    scopes: list[str]
class ConnectionEvictedData(ErrorData, tag="connection_evicted"):
    # reason: the _acp_server/evicted reason the connection was closed for (schemas/evicted.json)
    connection_id: str
    reason: str
