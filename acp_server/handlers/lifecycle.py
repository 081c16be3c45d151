"""``initialize`` and ``authenticate``."""

from __future__ import annotations

from typing import Any

from ..auth import TOKEN_METHOD_ID
from ..errors import InvalidParamsError
from ..types.acp import (
    PROTOCOL_VERSION,
    AgentCapabilities,
    AuthenticateParams,
    Implementation,
    InitializeParams,
    InitializeResult,
    PromptCapabilities,
    SessionCapabilities,
)
from .context import ConnContext
from .gate import TOKEN_AUTH_METHOD, authenticate_token, token_required
from .meta import meta_bool, meta_tenant, passthrough_meta

__all__ = ["authenticate", "initialize", "logout"]


def initialize(ctx: ConnContext, params: InitializeParams) -> InitializeResult:
    """Answer protocol version 1 whatever the client asks, with capabilities true to what is built."""
    tenant = meta_tenant(params.meta)
    named = tenant if params.meta and params.meta.get("tenantId") is not None else None
    identity = ctx.identity
    if identity is not None and identity.token_id is not None:  # a token is proved already
        if named is None:
            tenant = ctx.tenant  # bound by the token (at authenticate, or by HTTP's bearer)
        elif named != ctx.tenant and not ctx.initialized:
            _act_for(ctx, named)
    ctx.tenant_named = named
    if ctx.initialized and tenant != ctx.tenant:
        raise InvalidParamsError(
            path="_meta.tenantId", detail=f"this connection is already initialized as tenant {ctx.tenant!r}"
        )
    ctx.tenant = tenant
    # The client's word wins; else the server's --turn-states (off by default: turn states are an extension,
    # and a client that does not know them still pays to read each one).
    ctx.bridge.clients.set_turn_states(ctx.peer, meta_bool(params.meta, "turnStates", ctx.server.turn_states))
    ctx.client_capabilities = params.client_capabilities
    ctx.client_info = params.client_info
    ctx.initialized = True
    server = ctx.server
    auth_methods = list(getattr(ctx.bridge.backend, "auth_methods", None) or [])
    if server.auth is not None and ctx.identity is None:
        auth_methods.insert(0, TOKEN_AUTH_METHOD)
    return InitializeResult(
        protocol_version=PROTOCOL_VERSION,
        agent_capabilities=AgentCapabilities(
            # session/load replays a session kept in the store; without one nothing outlives the process.
            load_session=server.store is not None,
            # The echo agent takes every content block (it describes what is not text).
            prompt_capabilities=PromptCapabilities(image=True, audio=True, embedded_context=True),
            session_capabilities=SessionCapabilities(list={}, close={}, resume={}, delete={}),
            meta={"limits": server.limits_capability()},
        ),
        agent_info=Implementation(name="acp-server", version=server.version),
        auth_methods=auth_methods,
    )


def _act_for(ctx: ConnContext, named: str) -> None:
    """``initialize`` names a tenant other than the proved token's: only an ``admin`` token may (audited)."""
    identity = ctx.identity
    assert identity is not None
    if not identity.admin:
        raise InvalidParamsError(
            path="_meta.tenantId",
            detail=f"initialize named tenant {named!r}, but this token acts for {ctx.tenant!r} "
            "(only an admin token may name another tenant)",
        )
    auth = ctx.server.auth
    if auth is not None:
        auth.audit.admin_act(token_id=identity.token_id, action="act_for_tenant", tenant=named)


def authenticate(ctx: ConnContext, params: AuthenticateParams) -> Any:
    """The gateway's token (``acp-server-token``, with ``--auth-tokens``); any other method is forwarded to
    the default backend when it is an agent with authentication (after the gateway's), else it succeeds."""
    if ctx.server.auth is not None:
        if params.method_id == TOKEN_METHOD_ID:
            return authenticate_token(ctx, params)
        if ctx.identity is None:
            raise token_required()
    forward = getattr(ctx.bridge.backend, "authenticate", None)
    if forward is None:
        return {}
    return forward(params.method_id, passthrough_meta(params.meta))


def logout(ctx: ConnContext, params: None) -> Any:
    """Forwarded to the default backend when it supports it; else it succeeds."""
    forward = getattr(ctx.bridge.backend, "logout", None)
    if forward is None:
        return {}
    return forward()
