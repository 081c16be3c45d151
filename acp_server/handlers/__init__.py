"""ACP method handlers, one small module per method group, and the explicit method table."""

from ..jsonrpc import Method
from ..types.acp import (
    AuthenticateParams,
    CancelParams,
    CloseSessionParams,
    InitializeParams,
    ListSessionsParams,
    LoadSessionParams,
    NewSessionParams,
    PromptParams,
    SessionIdParams,
    SetConfigOptionParams,
    SetSessionModeParams,
)
from . import config_option, ext, lifecycle, prompt, session
from .context import ConnContext

__all__ = ["NOTIFICATIONS", "REQUESTS", "ConnContext"]

REQUESTS: dict[str, Method] = {
    "initialize": Method(InitializeParams, lifecycle.initialize, requires_init=False),
    "authenticate": Method(AuthenticateParams, lifecycle.authenticate),
    "logout": Method(None, lifecycle.logout),
    "session/new": Method(NewSessionParams, session.new),
    "session/list": Method(ListSessionsParams, session.list_sessions),
    "session/load": Method(LoadSessionParams, session.load),
    "session/resume": Method(LoadSessionParams, session.resume),
    "session/close": Method(CloseSessionParams, session.close),
    "session/delete": Method(CloseSessionParams, session.delete),
    "session/set_mode": Method(SetSessionModeParams, session.set_mode),
    "session/set_config_option": Method(SetConfigOptionParams, config_option.set_config_option),
    "session/prompt": Method(PromptParams, prompt.prompt_request, sees_cancel=True),
    "_acp_server/capabilities": Method(None, ext.capabilities),
    "_acp_server/stats": Method(None, ext.stats),
    "_acp_server/stats/subscribe": Method(None, ext.stats_subscribe),
    "_acp_server/stats/unsubscribe": Method(None, ext.stats_unsubscribe),
    "_acp_server/heartbeat": Method(SessionIdParams, ext.heartbeat),
    "_acp_server/detach": Method(SessionIdParams, ext.detach),
    "_acp_server/fork": Method(SessionIdParams, ext.fork),
}

NOTIFICATIONS: dict[str, Method] = {
    "session/cancel": Method(CancelParams, session.cancel),
}
