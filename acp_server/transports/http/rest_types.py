"""The bodies of qwen serve's REST API as msgspec Structs: what the handlers of :mod:`.rest` decode and
encode, and what :mod:`.openapi` documents (``GET /openapi.json`` is generated from these types).

Field names are the wire's (camelCase through ``rename="camel"``). Request bodies take unknown fields
and ignore them, as qwen's daemon does; response bodies are exactly these fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ...handlers.meta import MAX_DEADLINE_MS
from ...types.acp import ContentBlock

__all__ = [
    "CapabilitiesBody",
    "CreateSessionRequest",
    "DeleteSessionsRequest",
    "DeleteSessionsResult",
    "HealthBody",
    "HeartbeatResult",
    "PermissionAnswered",
    "PermissionVote",
    "PromptAccepted",
    "PromptRequest",
    "RestLimits",
    "RestoreSessionRequest",
    "SessionAttached",
    "SessionRestored",
]

#: An absolute directory (``session/new``'s check: absolute, no NUL).
Cwd = Annotated[str, msgspec.Meta(pattern="^/[^\\u0000]*$", description="an absolute directory")]
EventId = Annotated[int, msgspec.Meta(ge=0, le=2**53 - 1, description="a session event id (0: none yet)")]
EpochMs = Annotated[int, msgspec.Meta(ge=0, description="Unix epoch milliseconds")]


class _Body(msgspec.Struct, rename="camel", kw_only=True):
    """Base of every REST body."""


# --- requests -------------------------------------------------------------------------------------


class CreateSessionRequest(_Body):
    """``POST /session``: ``cwd`` defaults to the primary workspace; ``single`` attaches to that cwd's
    default session (creating it the first time), ``thread`` always creates one."""

    cwd: Cwd | None = None
    session_scope: Literal["single", "thread"] = "single"


class RestoreSessionRequest(_Body):
    """``POST /session/:id/load`` and ``/resume``."""

    cwd: Cwd | None = None
    last_event_id: int | None = None


class PromptRequest(_Body):
    """``POST /session/:id/prompt``: the ACP prompt's content blocks, an optional deadline and ``_meta``."""

    prompt: Annotated[list[ContentBlock], msgspec.Meta(min_length=1)]
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class DeleteSessionsRequest(_Body):
    """``POST /sessions/delete``."""

    session_ids: list[str]


class PermissionVote(_Body):
    """``POST /session/:id/permission/:requestId``: ``{outcome: {...}}`` (ACP's) or ``{optionId}``."""

    outcome: dict[str, Any] | None = None
    option_id: str | None = None


# --- responses ------------------------------------------------------------------------------------


class HealthBody(_Body, omit_defaults=True):
    """``GET /health``; ``?deep=1`` adds the counts."""

    status: Literal["ok"]
    sessions: int | None = None
    active_prompts: int | None = None
    self_heal_resumes_total: int | None = None
    connected_clients: int | None = None


class RestLimits(_Body):
    """``/capabilities`` ``limits``: ``null`` where a limit is off."""

    max_pending_prompts_per_session: int | None
    max_message_bytes: int
    max_subscribers_per_session: int
    prompt_deadline_ms: int | None


class CapabilitiesBody(_Body):
    """``GET /capabilities``."""

    v: Literal[1]
    protocol_versions: list[int]
    mode: str
    features: list[str]
    event_types: list[str]
    limits: RestLimits
    workspace_cwd: str


class SessionAttached(_Body):
    """``POST /session``: ``attached`` when ``single`` found the cwd's default session live."""

    session_id: str
    workspace_cwd: str
    attached: bool
    client_id: str
    created_at: EpochMs


class SessionRestored(_Body):
    """``POST /session/:id/load`` and ``/resume``."""

    session_id: str
    workspace_cwd: str
    attached: bool
    client_id: str
    last_event_id: EventId
    created_at: EpochMs
    event_epoch: str


class HeartbeatResult(_Body):
    """``POST /session/:id/heartbeat``."""

    session_id: str
    client_id: str | None
    last_seen_at: EpochMs


class PromptAccepted(_Body):
    """``POST /session/:id/prompt`` (202): the prompt is admitted; its events follow the session's
    ``lastEventId`` at admission."""

    prompt_id: str
    last_event_id: EventId
    event_epoch: str


class DeleteSessionsResult(_Body):
    """``POST /sessions/delete``."""

    removed: list[str]
    not_found: list[str]


class PermissionAnswered(_Body):
    """``POST /session/:id/permission/:requestId``: ``{}`` (qwen's SDK throws on a 204)."""
