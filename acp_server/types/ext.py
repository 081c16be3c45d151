"""Our extension messages (``_acp_server/...``)."""

from __future__ import annotations

import msgspec

__all__ = ["BackendCapability", "CapabilitiesResult", "LimitsCapability"]


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
