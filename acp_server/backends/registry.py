"""Build the named backends of a server from their configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config import BackendConfig
from .base import Backend
from .echo import EchoBackend

__all__ = ["build_backends"]


def build_backends(configs: Mapping[str, BackendConfig]) -> dict[str, Backend]:
    """One backend per configured name (``echo`` is built in unless configured otherwise); an
    ``openai`` backend reads its API key from the environment variable its config names."""
    backends: dict[str, Backend] = {}
    for name, cfg in configs.items():
        if cfg.kind == "echo":
            backends[name] = EchoBackend(delay_ms=cfg.delay_ms, name=name)
        elif cfg.kind == "openai":
            from .openai import OpenAIBackend

            assert cfg.base_url and cfg.model
            backends[name] = OpenAIBackend(
                name,
                base_url=cfg.base_url,
                model=cfg.model,
                api_key=os.environ.get(cfg.api_key_env) if cfg.api_key_env else None,
                request_timeout_s=cfg.request_timeout_s,
                max_attempts=cfg.max_attempts,
                system_prompt=cfg.system_prompt,
                extra_body=cfg.extra_body,
                context_tokens=cfg.context_tokens,
                images=cfg.images,
                max_tool_rounds=cfg.max_tool_rounds,
            )
        else:
            from .acp_agent import AcpAgentBackend

            assert cfg.command
            backends[name] = AcpAgentBackend(name, list(cfg.command), env=dict(cfg.env) or None, cwd=cfg.cwd)
    return backends
