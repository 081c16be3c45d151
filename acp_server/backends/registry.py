"""Build the named backends of a server from their configuration."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import BackendConfig
from .base import Backend
from .echo import EchoBackend

__all__ = ["build_backends"]


def build_backends(configs: Mapping[str, BackendConfig]) -> dict[str, Backend]:
    """One backend per configured name (``echo`` is built in unless configured otherwise)."""
    backends: dict[str, Backend] = {}
    for name, cfg in configs.items():
        if cfg.kind == "echo":
            backends[name] = EchoBackend(delay_ms=cfg.delay_ms, name=name)
        else:
            from .acp_agent import AcpAgentBackend

            assert cfg.command
            backends[name] = AcpAgentBackend(name, list(cfg.command), env=dict(cfg.env) or None, cwd=cfg.cwd)
    return backends
