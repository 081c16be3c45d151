"""``session/prompt``: synchronous admission, then waiting for the turn's outcome."""

from __future__ import annotations

from typing import Any

from ..bridge.settlement import PromptWaiter
from ..bridge.shared_admit import admit_shared
from ..jsonrpc import Deferred
from ..types.acp import PromptParams
from .context import ConnContext
from .meta import meta_client_id, meta_deadline_ms, meta_priority, meta_str, passthrough_meta

__all__ = ["prompt"]


def prompt(ctx: ConnContext, params: PromptParams) -> Deferred:
    bridge = ctx.server.bridge
    if not params.meta and bridge.shared is None:  # the usual prompt: none of our _meta keys to read
        ticket, duplicate = bridge.admit(
            params.session_id, params.prompt, peer=ctx.peer, cancelled=ctx.cancelled, channel=ctx.channel(),
            tenant=ctx.tenant,
        )
        return PromptWaiter(bridge.settlement, ticket, not duplicate)  # bridge.waiter's, without the call
    meta = params.meta
    terms: dict[str, Any] = {  # the admission's terms, the same for the local and the shared path
        "peer": ctx.peer,
        "client_id": meta_client_id(meta),
        "deadline_ms": meta_deadline_ms(meta),
        "cancelled": ctx.cancelled,
        "channel": ctx.channel(),
        "meta": passthrough_meta(meta),
        "idempotency_key": meta_str(meta, "idempotencyKey"),
        "tenant": ctx.tenant,
        "priority": meta_priority(meta),
    }
    if bridge.shared is not None:  # the limits are a cluster's: the shared part is a coordinator call
        return admit_shared(bridge, params.session_id, params.prompt, **terms)
    ticket, duplicate = bridge.admit(params.session_id, params.prompt, **terms)
    return bridge.waiter(ticket, owner=not duplicate)
