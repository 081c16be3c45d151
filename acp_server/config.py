"""The typed configuration file (``--config acp-server.toml``) and the backend table it describes.

    default_backend = "claude"
    max_connections = 1000            # sockets of every listener together (0: from the fd limit)
    turn_states = false               # _acp_server/turn_state for clients that do not ask (--turn-states)
    max_history_events = 10000        # recent events of a session kept in memory (older: from the store)
    drain_timeout_s = 30              # accepted requests may run this long after their input ends
    connection_idle_timeout_s = 300   # a socket holding nothing is closed after this long (0: off)
    refusal_budget_rps = 200          # each connection's hold-off refusals a second (0: no budget)
    refusal_budget_burst = 500        # ... and at once; past it: evicted (ignored_retry_after)

    [backends.claude]
    command = ["claude-code-acp"]     # program and arguments
    env = { ANTHROPIC_LOG = "info" }
    cwd = "/srv/agents"
    max_active = 4                    # backend calls at once (absent: unlimited)
    max_waiting = 16                  # admitted prompts waiting for a call (0: no waiting room)

    [backends.echo]
    kind = "echo"
    delay_ms = 0

    [backends.local]                  # an OpenAI-compatible chat-completions endpoint
    kind = "openai"
    base_url = "http://127.0.0.1:8000/v1"
    model = "my-model"
    api_key_env = "OPENAI_API_KEY"    # the variable holding the key (never the key itself)
    max_active = 2
    request_timeout_s = 300           # the longest silence: connect, first byte, between bytes
    max_attempts = 3                  # HTTP attempts per model call
    system_prompt = "You are a careful coding assistant."
    extra_body = { temperature = 0.2 }
    context_tokens = 32768            # the window: older turns are left out beyond it
    images = false                    # the model takes image parts
    max_tool_rounds = 16              # model calls per prompt

    [admission]                       # the admission policy; every limit off unless set
    max_running_prompts = 20          # prompts running at once across the server (0: no limit)
    max_queued_prompts = 200          # prompts waiting for a seat (0: no waiting room)
    tenant_max_running = 8            # seats one tenant holds (0: no cap)
    tenant_overrides = { tenantA = 4 }
    class_shares = { critical = 10, interactive = 60, background = 25, bulk = 5 }
    interactive_max_wait_ms = 2000
    aging_s = 30                      # 0: no aging
    mode = "enforce"                  # or "observe": admit everything, count what would happen

    [metrics]
    listen = "tcp://127.0.0.1:9464"   # GET /metrics (Prometheus)
    tenant_labels = false

    [auth]
    tokens = "/etc/acp-server/tokens.toml"   # mode 0600; see acp-server token add
    audit_log = "/var/log/acp-server/audit.log"
    rate_limit_rps = 20               # per token, bursts of 40

    [tls]
    cert = "/etc/acp-server/cert.pem"
    key = "/etc/acp-server/key.pem"
    handshake_timeout_s = 5

    [coordinator]                     # limits shared by replicas (see acp_server.coordinator.settings)
    url = "redis://127.0.0.1:6379/0"
    prefix = "acp-server"

    [http]                            # ACP over HTTP and WebSocket at /acp, GET /health
    listen = ["http://127.0.0.1:4171"]
    max_connections = 256             # /acp connections and WebSockets at once
    connection_grace_s = 10           # a connection with no stream open is kept this long
    allow_origin = ["https://editor.example"]   # foreign origins allowed besides the listener's own
    allow_host = ["acp.example.com"]  # remote Host names answered (besides loopback and the bound address)
    trusted_proxy = ["10.0.0.0/8"]    # peers whose X-Forwarded-For / X-Forwarded-Proto count
    workspace = "/srv/project"        # the REST API's primary workspace (default: the working directory)

An unknown key or a bad value is a :class:`ConfigError` naming the key (``backends.claude.max_active``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from .admission.policy import PolicyLimits
from .coordinator.settings import FLAGS as COORDINATOR_FLAGS
from .coordinator.settings import CoordinatorSettings
from .types.base import validation_location

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "BackendConfig",
    "ConfigError",
    "CoordinatorConfig",
    "FileConfig",
    "HttpConfig",
    "MetricsConfig",
    "TlsConfig",
    "load_config",
    "openai_shorthand",
    "parse_config",
]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ConfigError(ValueError):
    """The configuration is not of the accepted form; the message names the key."""


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[backends.NAME]`` table."""

    kind: Literal["acp", "echo", "openai"] = "acp"
    command: list[str] | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    max_active: int | None = None
    max_waiting: int | None = None
    delay_ms: int = 0
    # kind = "openai" only
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    request_timeout_s: float = 300.0
    max_attempts: int = 3
    system_prompt: str | None = None
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)
    context_tokens: int | None = None
    images: bool = False
    max_tool_rounds: int = 16


_OPENAI_ONLY = ("base_url", "model", "api_key_env", "system_prompt", "context_tokens")
_OPENAI_PREFIX = "openai:"


def openai_shorthand(argv: list[str]) -> BackendConfig | None:
    """The backend of ``--agent NAME=openai:BASE_URL#MODEL`` (``argv`` the split command), else ``None``.

    The key is read from ``OPENAI_API_KEY`` when it is set; without it no key is sent.

    Raises:
        ConfigError: it starts with ``openai:`` but names no URL or no model.
    """
    if len(argv) != 1 or not argv[0].startswith(_OPENAI_PREFIX):
        return None
    url, sep, model = argv[0][len(_OPENAI_PREFIX) :].rpartition("#")
    if not sep or not url or not model:
        raise ConfigError(f"--agent: {argv[0]!r}: write openai:BASE_URL#MODEL (e.g. openai:http://127.0.0.1:8000/v1#my-model)")
    return BackendConfig(kind="openai", base_url=url, model=model, api_key_env="OPENAI_API_KEY")


class AdmissionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[admission]`` table: fields of :class:`~acp_server.admission.policy.PolicyLimits`.

    ``None`` is "not in the file" (the flag or the built-in default decides). ``class_shares`` replaces
    the default shares as a whole: a class left out gets no share and only borrows idle seats.
    """

    max_running_prompts: int | None = None
    max_queued_prompts: int | None = None
    tenant_max_running: int | None = None
    tenant_overrides: dict[str, int] | None = None
    class_shares: dict[str, float] | None = None
    interactive_max_wait_ms: int | None = None
    aging_s: float | None = None
    min_deadline_left_ms: int | None = None
    mode: Literal["enforce", "observe"] | None = None

    def given(self) -> dict[str, Any]:
        """The keys the file sets, by their ``PolicyLimits`` field name."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[metrics]`` table: the Prometheus endpoint."""

    listen: str | None = None
    tenant_labels: bool | None = None


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[auth]`` table: ``--auth-tokens``, ``--audit-log``, ``--rate-limit-rps``."""

    tokens: str | None = None
    audit_log: str | None = None
    rate_limit_rps: float | None = None


class TlsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[tls]`` table: ``--tls-cert``, ``--tls-key``, ``--tls-handshake-timeout-s``."""

    cert: str | None = None
    key: str | None = None
    handshake_timeout_s: float | None = None


class CoordinatorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[coordinator]`` table: fields of :class:`~acp_server.coordinator.settings.CoordinatorSettings`
    (``None``: not in the file)."""

    url: str | None = None
    prefix: str | None = None
    replica_id: str | None = None
    failure: Literal["closed", "local"] | None = None
    expected_replicas: int | None = None
    lease_ttl_s: float | None = None
    timeout_ms: int | None = None

    def given(self) -> dict[str, Any]:
        """The keys the file sets."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[http]`` table: the ``/acp`` listeners (``None``/empty: not in the file)."""

    listen: list[str] = msgspec.field(default_factory=list)
    max_connections: int | None = None
    connection_grace_s: float | None = None
    allow_origin: list[str] = msgspec.field(default_factory=list)
    #: ``--http-allow-host``: remote ``Host`` names the HTTP listeners answer to
    allow_host: list[str] = msgspec.field(default_factory=list)
    #: ``--trusted-proxy``: networks whose ``X-Forwarded-For``/``X-Forwarded-Proto`` count
    trusted_proxy: list[str] = msgspec.field(default_factory=list)
    #: the REST API's primary workspace (``workspaceCwd``, the default ``cwd``)
    workspace: str | None = None


class FileConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    default_backend: str | None = None
    #: ``--max-connections`` (0: from the fd limit)
    max_connections: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: ``--turn-states``: send ``_acp_server/turn_state`` to clients whose ``initialize`` does not say
    #: (an extension: by default only a client that asks, ``_meta.turnStates: true``, gets them)
    turn_states: bool = False
    #: ``--max-history-events``
    max_history_events: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: ``--connection-idle-timeout-s`` (0: off)
    connection_idle_timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    backends: dict[str, BackendConfig] = msgspec.field(default_factory=dict)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    coordinator: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)
    #: ``--drain-timeout-s``: after a connection's input ends, seconds its accepted requests may run in
    #: (absent: 30); when set, also on SIGTERM, seconds running prompts may finish in (0: cancel them)
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    #: ``--refusal-budget-rps`` (0: no budget) and ``--refusal-budget-burst``
    refusal_budget_rps: Annotated[float, msgspec.Meta(ge=0)] | None = None
    refusal_budget_burst: Annotated[float, msgspec.Meta(ge=0)] | None = None


def _path_of(exc: msgspec.ValidationError, prefix: str) -> tuple[str, str]:
    path, detail = validation_location(exc)
    if detail.startswith("Object contains unknown field"):
        detail = "unknown key"
    detail = detail.replace(" | null", "")  # TOML has no null: an optional key is simply left out
    if detail.startswith("Invalid enum value") and path == "admission.mode":
        detail += ' (accepted: "enforce", "observe")'
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
        raise ConfigError(f"{key}.command: not used by kind = \"{cfg.kind}\"")
    if cfg.kind == "openai":
        _check_openai(key, cfg)
    else:
        for field in _OPENAI_ONLY:
            if getattr(cfg, field) is not None:
                raise ConfigError(f"{key}.{field}: only used by kind = \"openai\"")
    for field in ("max_active", "max_waiting", "delay_ms"):
        value = getattr(cfg, field)
        if value is not None and value < 0:
            raise ConfigError(f"{key}.{field}: must be a non-negative integer; got {value}")
    if cfg.max_waiting is not None and cfg.max_active is None:
        raise ConfigError(f"{key}.max_waiting: needs max_active (with unlimited active calls nothing waits)")
    if cfg.max_active == 0:
        raise ConfigError(f"{key}.max_active: must be at least 1 (leave it out for no limit)")
    return cfg


def _check_openai(key: str, cfg: BackendConfig) -> None:
    for field in ("base_url", "model"):
        if not getattr(cfg, field):
            raise ConfigError(f"{key}.{field}: required for kind = \"openai\"")
    assert cfg.base_url is not None
    if not cfg.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{key}.base_url: must be an http:// or https:// URL; got {cfg.base_url!r}")
    if cfg.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.api_key_env):
        raise ConfigError(f"{key}.api_key_env: the name of an environment variable (the key itself never goes in the file)")
    if not cfg.request_timeout_s > 0:
        raise ConfigError(f"{key}.request_timeout_s: must be a positive number of seconds; got {cfg.request_timeout_s}")
    for field in ("max_attempts", "max_tool_rounds", "context_tokens"):
        value = getattr(cfg, field)
        if value is not None and value < 1:
            raise ConfigError(f"{key}.{field}: must be at least 1; got {value}")
    for field in ("stream", "messages", "model"):
        if field in cfg.extra_body:
            raise ConfigError(f"{key}.extra_body.{field}: set by the backend itself; leave it out")


def parse_config(text: str, source: str = "config") -> FileConfig:
    """Parse and check a TOML configuration.

    Raises:
        ConfigError: TOML syntax, an unknown key, a value of the wrong type or out of range.
    """
    import tomllib  # only when a file is read: serving without --config never needs it

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
    try:
        PolicyLimits(**top.admission.given())
    except (TypeError, ValueError) as exc:  # the message starts with the field's name
        raise ConfigError(f"{source}: admission.{exc}") from None
    try:
        CoordinatorSettings(**top.coordinator.given())
    except ValueError as exc:  # the message starts with the setting's flag
        flag, _, rest = str(exc).partition(" ")
        key = next((k for k, f in COORDINATOR_FLAGS.items() if f == flag), flag)
        raise ConfigError(f"{source}: coordinator.{key} {rest}") from None
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
