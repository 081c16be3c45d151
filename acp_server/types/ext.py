"""Our extension messages (``_acp_server/...``)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .base import Wire, meta_field

__all__ = [
    "TERMINAL_TURN_STATES",
    "TURN_STATES",
    "BackendCapability",
    "CapabilitiesResult",
    "EvictedParams",
    "LimitsCapability",
    "TurnStateBody",
    "ReplayTruncatedParams",
    "TurnStateParams",
]


class LimitsCapability(msgspec.Struct, rename="camel", kw_only=True):
    """The server's limits as advertised (``null``: disabled); also in ``initialize`` at
    ``agentCapabilities._meta.limits``."""

    max_pending_prompts_per_session: int | None
    prompt_deadline_ms: int | None
    max_message_bytes: int
    max_outbound_bytes: int
    max_inflight_requests: int
    client_idle_timeout_s: float
    session_idle_timeout_s: float


class BackendCapability(msgspec.Struct, rename="camel", kw_only=True):
    """One backend as advertised: its kind and its capacity pool's bounds (``null``: unlimited)."""

    kind: str
    max_active: int | None
    max_waiting: int | None


class CapabilitiesResult(msgspec.Struct, rename="camel", kw_only=True):
    limits: LimitsCapability
    backends: dict[str, BackendCapability]
    default_backend: str


#: The states of ``_acp_server/turn_state``, in the order a prompt can pass through them.
TURN_STATES = (
    "accepted",
    "queued",
    "waiting_for_dependency",
    "running",
    "paused_for_approval",
    "completed",
    "failed",
    "cancelled",
)
#: The states that end a prompt: recorded in the transcript (the others are live only).
TERMINAL_TURN_STATES = frozenset({"completed", "failed", "cancelled"})


class TurnStateBody(Wire):
    """``_acp_server/turn_state`` params as the transcript stores them (without sessionId and _meta)."""

    prompt_id: str
    state: str
    at: int
    reason: str | None = None
    position_hint: int | None = None


class TurnStateParams(Wire):
    """``_acp_server/turn_state``: where a prompt stands, sent to every connection attached to its session.

    ``at`` is Unix epoch milliseconds; ``_meta.eventId`` places it in the session's event stream.
    """

    session_id: str
    prompt_id: str
    state: str
    at: int
    reason: str | None = None
    position_hint: int | None = None
    meta: dict[str, Any] | None = meta_field()


class ReplayTruncatedParams(Wire):
    """``_acp_server/replay_truncated``: the first message of a replay whose first events are gone (a
    session without a store keeps only its last ``--max-history-events``); the replay goes on from
    ``firstEventId``."""

    session_id: str
    #: the first event the replay has (what follows this notification)
    first_event_id: int
    #: where the replay was asked to begin after (0: from the start)
    requested_after_event_id: int


class EvictedParams(Wire):
    """``_acp_server/evicted``: the last message of a connection the server closes (see
    :data:`acp_server.errors.EVICTION_REASONS` for each ``reason``); the fields besides ``reason`` are
    those of that reason."""

    reason: Literal["queue_overflow", "too_many_connections", "token_revoked", "ignored_retry_after"]
    #: queue_overflow: --max-outbound-bytes; too_many_connections: --max-connections
    limit: int | None = None
    #: queue_overflow: what was queued to the connection
    queued_bytes: int | None = None
    #: ignored_retry_after: hold-off refusals charged, those that ignored a retryAfterMs, those that
    #: found the budget in debt (each paused the connection's reads), the budget's rate and burst
    refusals: int | None = None
    ignored_retry_after: int | None = None
    in_debt: int | None = None
    budget_rps: float | None = None
    budget_burst: float | None = None
