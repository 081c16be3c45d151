"""``initialize`` and ``authenticate``."""

from __future__ import annotations

from typing import Any

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
from .meta import meta_bool, meta_tenant, passthrough_meta

__all__ = ["authenticate", "initialize", "logout"]


def initialize(ctx: ConnContext, params: InitializeParams) -> InitializeResult:
    """Answer protocol version 1 whatever the client asks, with capabilities true to what is built."""
    tenant = meta_tenant(params.meta)
    if ctx.initialized and tenant != ctx.tenant:
        raise InvalidParamsError(
            path="_meta.tenantId", detail=f"this connection is already initialized as tenant {ctx.tenant!r}"
        )
    ctx.tenant = tenant
    # Turn states are on unless the client opts out (a client that cannot use them saves their cost).
    ctx.bridge.clients.set_turn_states(ctx.peer, meta_bool(params.meta, "turnStates", True))
    ctx.client_capabilities = params.client_capabilities
    ctx.client_info = params.client_info
    ctx.initialized = True
    server = ctx.server
    return InitializeResult(
        protocol_version=PROTOCOL_VERSION,
        agent_capabilities=AgentCapabilities(
            load_session=True,
            # The echo agent takes every content block (it describes what is not text).
            prompt_capabilities=PromptCapabilities(image=True, audio=True, embedded_context=True),
            session_capabilities=SessionCapabilities(list={}, close={}, resume={}, delete={}),
            meta={"limits": server.limits_capability()},
        ),
        agent_info=Implementation(name="acp-server", version=server.version),
        auth_methods=list(getattr(ctx.bridge.backend, "auth_methods", None) or []),
    )


def authenticate(ctx: ConnContext, params: AuthenticateParams) -> Any:
    """Forwarded to the default backend when it is an agent with authentication; else it succeeds."""
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
