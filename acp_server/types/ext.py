"""Our extension messages (``_acp_server/...``)."""

from __future__ import annotations

import msgspec

__all__ = ["CapabilitiesResult", "LimitsCapability"]


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


class CapabilitiesResult(msgspec.Struct, rename="camel", kw_only=True):
    limits: LimitsCapability
