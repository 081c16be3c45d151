"""The typed configuration file (``--config acp-server.toml``) and the backend table it describes.

    default_backend = "claude"

    [backends.claude]
    command = ["claude-code-acp"]     # program and arguments
    env = { ANTHROPIC_LOG = "info" }
    cwd = "/srv/agents"
    max_active = 4                    # backend calls at once (absent: unlimited)
    max_waiting = 16                  # admitted prompts waiting for a call (0: no waiting room)

    [backends.echo]
    kind = "echo"
    delay_ms = 0

An unknown key or a bad value is a :class:`ConfigError` naming the key (``backends.claude.max_active``).
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, Literal

import msgspec

from .types.base import validation_location

__all__ = ["BackendConfig", "ConfigError", "FileConfig", "load_config", "parse_config"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ConfigError(ValueError):
    """The configuration is not of the accepted form; the message names the key."""


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[backends.NAME]`` table."""

    kind: Literal["acp", "echo"] = "acp"
    command: list[str] | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    max_active: int | None = None
    max_waiting: int | None = None
    delay_ms: int = 0


class FileConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    default_backend: str | None = None
    backends: dict[str, BackendConfig] = msgspec.field(default_factory=dict)


def _path_of(exc: msgspec.ValidationError, prefix: str) -> tuple[str, str]:
    path, detail = validation_location(exc)
    if detail.startswith("Object contains unknown field"):
        detail = "unknown key"
    return ".".join(p for p in (prefix, path) if p), detail


def check_backend(name: str, cfg: BackendConfig) -> BackendConfig:
    """Check one backend's values (beyond their types); returns it unchanged."""
    key = f"backends.{name}"
    if not _NAME.match(name):
        raise ConfigError(f"{key}: a backend name is 1-64 letters, digits, '_', '-' or '.'")
    if cfg.kind == "acp":
        if not cfg.command:
            raise ConfigError(f"{key}.command: required for an ACP agent (a list: program and arguments)")
    elif cfg.command is not None:
        raise ConfigError(f"{key}.command: not used by kind = \"echo\"")
    for field in ("max_active", "max_waiting", "delay_ms"):
        value = getattr(cfg, field)
        if value is not None and value < 0:
            raise ConfigError(f"{key}.{field}: must be a non-negative integer; got {value}")
    if cfg.max_waiting is not None and cfg.max_active is None:
        raise ConfigError(f"{key}.max_waiting: needs max_active (with unlimited active calls nothing waits)")
    if cfg.max_active == 0:
        raise ConfigError(f"{key}.max_active: must be at least 1 (leave it out for no limit)")
    return cfg


def parse_config(text: str, source: str = "config") -> FileConfig:
    """Parse and check a TOML configuration.

    Raises:
        ConfigError: TOML syntax, an unknown key, a value of the wrong type or out of range.
    """
    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    backends_raw = raw.pop("backends", {})
    try:
        top = msgspec.convert(raw, FileConfig)
    except msgspec.ValidationError as exc:
        path, detail = _path_of(exc, "")
        raise ConfigError(f"{source}: {path or 'top level'}: {detail}") from None
    if not isinstance(backends_raw, dict):
        raise ConfigError(f"{source}: backends: must be a table of [backends.NAME] tables")
    backends: dict[str, BackendConfig] = {}
    for name, table in backends_raw.items():
        try:
            cfg = msgspec.convert(table, BackendConfig)
        except msgspec.ValidationError as exc:
            path, detail = _path_of(exc, f"backends.{name}")
            raise ConfigError(f"{source}: {path}: {detail}") from None
        try:
            backends[name] = check_backend(name, cfg)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    top.backends = backends
    if top.default_backend is not None and top.default_backend not in backends and top.default_backend != "echo":
        known = ", ".join(sorted({"echo", *backends}))
        raise ConfigError(f"{source}: default_backend: no backend named {top.default_backend!r} (known: {known})")
    return top


def load_config(path: str) -> FileConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    return parse_config(text, f"--config {path}")
