"""``session/prompt``: synchronous admission, then waiting for the turn's outcome."""

from __future__ import annotations

from ..bridge.shared_admit import admit_shared
from ..jsonrpc import Deferred
from ..types.acp import PromptParams
from .context import ConnContext
from .meta import meta_client_id, meta_deadline_ms, meta_priority, meta_str, passthrough_meta

__all__ = ["prompt"]


def prompt(ctx: ConnContext, params: PromptParams) -> Deferred:
    bridge = ctx.bridge
    if not params.meta and bridge.shared is None:  # the usual prompt: none of our _meta keys to read
        ticket, duplicate = bridge.admit(
            params.session_id, params.prompt, peer=ctx.peer, cancelled=ctx.cancelled, channel=ctx.channel(),
            tenant=ctx.tenant,
        )
        return bridge.waiter(ticket, owner=not duplicate)
    key = meta_str(params.meta, "idempotencyKey")
    if bridge.shared is not None:  # the limits are a cluster's: the shared part is a coordinator call
        return admit_shared(
            bridge,
            params.session_id,
            params.prompt,
            peer=ctx.peer,
            client_id=meta_client_id(params.meta),
            deadline_ms=meta_deadline_ms(params.meta),
            cancelled=ctx.cancelled,
            channel=ctx.channel(),
            meta=passthrough_meta(params.meta),
            idempotency_key=key,
            tenant=ctx.tenant,
            priority=meta_priority(params.meta),
        )
    ticket, duplicate = bridge.admit(
        params.session_id,
        params.prompt,
        peer=ctx.peer,
        client_id=meta_client_id(params.meta),
        deadline_ms=meta_deadline_ms(params.meta),
        cancelled=ctx.cancelled,
        channel=ctx.channel(),
        meta=passthrough_meta(params.meta),
        idempotency_key=key,
        tenant=ctx.tenant,
        priority=meta_priority(params.meta),
    )
    return bridge.waiter(ticket, owner=not duplicate)
