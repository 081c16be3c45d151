"""``session/set_config_option``: forwarded to the session's backend."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from ..backends import Backend
from ..types.acp import SetConfigOptionParams
from .context import ConnContext
from .meta import meta_client_id

__all__ = ["set_config_option"]


def set_config_option(ctx: ConnContext, params: SetConfigOptionParams) -> Coroutine[Any, Any, dict[str, Any]]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id, ctx.tenant)
    bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    backend: Backend = session.backend
    return backend.set_config_option(session.session_id, params.config_id, params.value)


