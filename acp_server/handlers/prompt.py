"""``session/prompt``: synchronous admission, then waiting for the turn's outcome."""

from __future__ import annotations

from typing import Any

from ..bridge.session import PromptTicket
from ..bridge.settlement import PromptWaiter
from ..bridge.shared_admit import admit_shared
from ..jsonrpc import Deferred
from ..types.acp import PromptParams, PromptResult
from .context import ConnContext
from .meta import meta_client_id, meta_deadline_ms, meta_priority, meta_str, passthrough_meta

__all__ = ["prompt", "prompt_request"]


def prompt(ctx: ConnContext, params: PromptParams) -> Deferred:
    """``session/prompt``'s admission: what waits for the outcome (REST takes the prompt's id from it)."""
    return _prompt(ctx, params, False)  # type: ignore[return-value]


def prompt_request(ctx: ConnContext, params: PromptParams) -> Deferred | PromptResult:
    """``session/prompt`` as a JSON-RPC request: as :func:`prompt`, but a prompt answered already (its
    turn ended in the step that admitted it, see :meth:`~acp_server.bridge.runner.SessionRunner.enqueue`,
    or an idempotent duplicate of one that ended) is answered now, with no waiter.

    Raises:
        AcpError: the admission's refusal, or the answered prompt's error.
    """
    bridge = ctx.server.bridge
    if params.meta or bridge.shared is not None:
        return _prompt(ctx, params, True)
    # _prompt's usual case, inline (this runs for every prompt): none of our _meta keys to read
    ticket, duplicate = bridge.admit(
        params.session_id, params.prompt, ctx.peer, None, None, ctx.cancelled, ctx._channel or ctx.channel(), None,
        None, ctx.tenant,
    )
    if ticket.answered:
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]
    return PromptWaiter(bridge.settlement, ticket, not duplicate)


def _answered(ticket: PromptTicket) -> PromptResult:
    if ticket.error is not None:
        raise ticket.error
    assert ticket.result is not None
    return ticket.result


def _prompt(ctx: ConnContext, params: PromptParams, now: bool) -> Deferred | PromptResult:
    bridge = ctx.server.bridge
    meta = params.meta
    if bridge.shared is None and (not meta or (len(meta) == 1 and "clientId" in meta)):
        # the usual prompt: no _meta, or only a client id (a REST prompt's): nothing else to read
        ticket, duplicate = bridge.admit(  # positional (a call with keywords costs more): no deadline,
            # _meta or idempotency key
            params.session_id, params.prompt, ctx.peer, meta_client_id(meta) if meta else None, None, ctx.cancelled,
            ctx.channel(), None, None, ctx.tenant,
        )
        if now and ticket.answered:
            return _answered(ticket)
        return PromptWaiter(bridge.settlement, ticket, not duplicate)  # bridge.waiter's, without the call
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
    if now and ticket.answered:
        return _answered(ticket)
    return bridge.waiter(ticket, owner=not duplicate)
