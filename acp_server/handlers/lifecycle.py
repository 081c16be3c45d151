"""``initialize`` and ``authenticate``."""

from __future__ import annotations

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

__all__ = ["authenticate", "initialize"]


def initialize(ctx: ConnContext, params: InitializeParams) -> InitializeResult:
    """Answer protocol version 1 whatever the client asks, with capabilities true to what is built."""
    ctx.client_capabilities = params.client_capabilities
    ctx.client_info = params.client_info
    ctx.initialized = True
    server = ctx.server
    return InitializeResult(
        protocol_version=PROTOCOL_VERSION,
        agent_capabilities=AgentCapabilities(
            load_session=False,
            # The echo agent takes every content block (it describes what is not text).
            prompt_capabilities=PromptCapabilities(image=True, audio=True, embedded_context=True),
            session_capabilities=SessionCapabilities(list={}, close={}),
            meta={"limits": server.limits_capability()},
        ),
        agent_info=Implementation(name="acp-server", version=server.version),
        auth_methods=[],
    )


def authenticate(ctx: ConnContext, params: AuthenticateParams) -> dict[str, object]:
    """No authentication methods are offered yet, so every ``authenticate`` succeeds."""
    return {}
