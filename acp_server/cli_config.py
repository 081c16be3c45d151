"""From parsed ``serve`` flags and the ``--config`` file to the :class:`~.server.ServerConfig` it runs.

A flag given on the command line wins over its config-file key, which wins over the default; a bad
combination exits 2 through the subcommand's parser, naming the flags (and the file's keys) at fault.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import socket
from typing import Any

import msgspec

from . import cluster_cli
from .admission import Limits
from .admission.policy import PolicyLimits
from .auth.binds import RemoteBindError, check_remote_bind
from .auth.hosts import access_from
from .auth.settings import settings_from
from .cli_flags import (
    DEFAULT_LISTEN,
    POLICY_FLAGS,
    origin_arg,
    parse_http_listen,
    parse_listen,
    parse_metrics_listen,
)
from .config import BackendConfig, ConfigError, FileConfig, check_backend, load_config, openai_shorthand
from .server import CONNECTION_IDLE_TIMEOUT_S, ListenAddress, ServerConfig
from .transports.refusal_budget import DEFAULT_REFUSAL_BUDGET, RefusalBudgetSettings

__all__ = ["backends_from", "http_from", "metrics_from", "policy_from", "server_config"]


def http_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig | None = None
) -> tuple[list[ListenAddress], Any]:
    """The HTTP listeners and their options (an ``HttpOptions``): the ``[http]`` table, then the flags."""
    if file_config is None:
        file_config = _file_config(args, parser)
    table = file_config.http
    listen: list[ListenAddress] = args.http_listen or []
    if not listen:
        try:
            listen = [parse_http_listen(u, f"--config {args.config}: http.listen") for u in table.listen]
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    origins = args.http_allow_origin or []
    if not origins:
        try:
            origins = [origin_arg(o) for o in table.allow_origin]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--config {args.config}: http.allow_origin: {exc}")
    tokens = bool(getattr(args, "auth_tokens", None))  # server_config has merged [auth] tokens in by now
    hosts, proxies = access_from(args, parser, table, origins=origins, tokens=tokens)
    max_connections = args.http_max_connections or table.max_connections
    grace = args.http_connection_grace_s if args.http_connection_grace_s is not None else table.connection_grace_s
    if max_connections is not None and max_connections < 1:
        parser.error(f"--config {args.config}: http.max_connections must be a positive integer; got {max_connections}")
    if grace is not None and not (0 <= grace < math.inf):
        parser.error(f"--config {args.config}: http.connection_grace_s must be a non-negative number; got {grace}")
    for addr in listen:
        if addr.kind in ("tcp", "https"):
            _check_loopback(parser, addr, "--http-listen", tokens=tokens)
    if not listen:
        return [], None
    from .transports.http import HttpLimits, HttpOptions  # hypercorn loads only when asked

    base = HttpLimits()
    limits = HttpLimits(
        max_connections=max_connections if max_connections is not None else base.max_connections,
        connection_grace_s=grace if grace is not None else base.connection_grace_s,
    )
    workspace = args.workspace or table.workspace
    if workspace is not None:
        workspace = str(pathlib.Path(workspace).absolute())
    return listen, HttpOptions(
        limits=limits,
        allow_origins=frozenset(origins),
        allow_hosts=hosts,
        trusted_proxies=proxies,
        workspace=workspace,
    )


def _file_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FileConfig:
    if not args.config:
        return FileConfig()
    try:
        return load_config(args.config)
    except ConfigError as exc:
        parser.error(str(exc))


def policy_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig | None = None
) -> PolicyLimits:
    """The admission policy: the config file's ``[admission]`` table, then the command line over it."""
    if file_config is None:
        file_config = _file_config(args, parser)
    values = file_config.admission.given()
    flagged = {field: value for field in POLICY_FLAGS if (value := getattr(args, _dest(field))) is not None}
    values.update(flagged)
    try:
        return PolicyLimits(**values)
    except (TypeError, ValueError) as exc:
        text = str(exc)  # starts with the field's name
        for field in flagged:
            if text.startswith(field):
                parser.error(POLICY_FLAGS[field] + text[len(field) :])
        parser.error(f"--config {args.config}: admission.{text}")


def _dest(field: str) -> str:
    return POLICY_FLAGS[field].removeprefix("--").replace("-", "_")


def metrics_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig | None = None
) -> tuple[ListenAddress | None, bool]:
    """Where metrics are served (``None``: nowhere) and whether tenant ids label series: file, then flags."""
    if file_config is None:
        file_config = _file_config(args, parser)
    address: ListenAddress | None = args.metrics_listen
    if address is None and file_config.metrics.listen is not None:
        try:
            address = parse_metrics_listen(file_config.metrics.listen, f"--config {args.config}: metrics.listen")
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    tenant_labels = bool(args.metrics_tenant_labels or file_config.metrics.tenant_labels)
    if tenant_labels and address is None:
        parser.error("--metrics-tenant-labels needs --metrics-listen (or [metrics] listen in --config)")
    if address is not None:
        _check_loopback(parser, address, "--metrics-listen", tokens=bool(getattr(args, "auth_tokens", None)))
    return address, tenant_labels


def backends_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig | None = None
) -> tuple[dict[str, BackendConfig], str]:
    """The backend table: the config file, then the command line over it."""
    if file_config is None:
        file_config = _file_config(args, parser)
    backends: dict[str, BackendConfig] = {"echo": BackendConfig(kind="echo")}
    backends.update(file_config.backends)
    default = file_config.default_backend or "echo"
    for name, command in args.agent:
        base = backends.get(name)
        try:
            shorthand = openai_shorthand(command)
        except ConfigError as exc:
            parser.error(str(exc))
        if shorthand is not None and base is not None and base.kind == "openai":
            backends[name] = msgspec.structs.replace(base, base_url=shorthand.base_url, model=shorthand.model)
        elif shorthand is not None:
            backends[name] = shorthand
        elif base is not None and base.kind == "acp":
            backends[name] = msgspec.structs.replace(base, command=command)
        else:
            backends[name] = BackendConfig(kind="acp", command=command)
    if args.agent_command:
        backends["agent"] = BackendConfig(kind="acp", command=list(args.agent_command))
        default = "agent"
    echo = backends.get("echo")
    if echo is not None and echo.kind == "echo" and args.echo_delay_ms is not None:
        backends["echo"] = msgspec.structs.replace(echo, delay_ms=args.echo_delay_ms)
    if args.default_backend is not None:
        default = args.default_backend
    if default not in backends:
        known = ", ".join(sorted(backends))
        parser.error(f"--default-backend {default!r} is not a configured backend; known: {known}")
    for name, cfg in backends.items():
        try:
            check_backend(name, cfg)
        except ConfigError as exc:
            parser.error(str(exc))
    return backends, default


def _check_loopback(
    parser: argparse.ArgumentParser, addr: ListenAddress, flag: str = "--listen", *, tokens: bool = False
) -> None:
    """Refuse a bind beyond loopback unless the listener speaks TLS and tokens are on (exit 2)."""
    try:
        infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        parser.error(f"{flag} {addr}: cannot resolve {addr.host!r}: {exc.strerror}")
    try:
        tls = addr.kind in ("tls", "https")
        check_remote_bind(flag, str(addr), [str(i[4][0]) for i in infos], tls=tls, tokens=tokens)
    except RemoteBindError as exc:
        parser.error(str(exc))


def server_config(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> ServerConfig:
    """What ``serve`` runs with these parsed flags (bad values exit 2 through ``serve_parser``)."""
    listen = list(args.listen)
    if not args.stdio and not listen:
        listen = [parse_listen(DEFAULT_LISTEN)]
    limits = Limits(
        max_pending_prompts_per_session=args.max_pending_prompts_per_session,
        prompt_deadline_ms=args.prompt_deadline_ms,
        client_idle_timeout_s=args.client_idle_timeout_s,
        session_idle_timeout_s=args.session_idle_timeout_s,
        max_message_bytes=args.max_message_bytes,
        max_outbound_bytes=args.max_outbound_bytes,
        max_inflight_requests=args.max_inflight_requests,
        idempotency_ttl_s=args.idempotency_ttl_s,
        max_sessions=args.max_sessions,
        max_history_events=_history_events(args, serve_parser),
    )
    if args.ephemeral and args.state_dir is not None:
        serve_parser.error("--ephemeral and --state-dir exclude each other: choose memory only or a directory")
    state_dir: str | None = args.state_dir
    if state_dir is None and not args.ephemeral and not args.stdio:
        # One directory per address set (and config file); stdio alone is one editor window's own
        # process: ephemeral.
        from .statedir import keyed_state_dir

        state_dir = str(keyed_state_dir(listen, args.config))
    file_config = _file_config(args, serve_parser)
    auth = settings_from(
        args, serve_parser, file_config.auth, file_config.tls, tls_listeners=any(a.kind == "tls" for a in listen)
    )
    for addr in listen:
        if addr.kind in ("tcp", "tls"):
            _check_loopback(serve_parser, addr, tokens=auth.tokens is not None)
    backends, default_backend = backends_from(args, serve_parser, file_config)
    policy = policy_from(args, serve_parser, file_config)
    metrics_listen, metrics_tenant_labels = metrics_from(args, serve_parser, file_config)
    http_listen, http_options = http_from(args, serve_parser, file_config)
    if auth.tls is None:
        for flag, addr in [("--metrics-listen", metrics_listen), *(("--http-listen", a) for a in http_listen)]:
            if addr is not None and addr.kind == "https":
                serve_parser.error(f"an https:// {flag} needs --tls-cert FILE and --tls-key FILE")
    return ServerConfig(
        stdio=args.stdio,
        listen=listen,
        echo_delay_ms=args.echo_delay_ms or 0,
        limits=limits,
        backends=backends,
        default_backend=default_backend,
        state_dir=state_dir,
        policy=policy,
        metrics_listen=metrics_listen,
        metrics_tenant_labels=metrics_tenant_labels,
        http_listen=http_listen,
        http=http_options,
        max_connections=args.max_connections if args.max_connections is not None else file_config.max_connections or 0,
        turn_states=args.turn_states if args.turn_states is not None else file_config.turn_states,
        auth=auth,
        coordinator=cluster_cli.settings_from(args, serve_parser, file_config),
        drain_timeout_s=args.drain_timeout_s if args.drain_timeout_s is not None else file_config.drain_timeout_s,
        connection_idle_timeout_s=_given(
            args.connection_idle_timeout_s, file_config.connection_idle_timeout_s, CONNECTION_IDLE_TIMEOUT_S
        ),
        refusal_budget=_refusal_budget(args, serve_parser, file_config),
    )


def _refusal_budget(args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig) -> RefusalBudgetSettings:
    """``--refusal-budget-rps``/``-burst``, else the config file's ``refusal_budget_rps``/``_burst``, else the defaults."""
    rate = _given(args.refusal_budget_rps, file_config.refusal_budget_rps, DEFAULT_REFUSAL_BUDGET.rate_per_s)
    burst = _given(args.refusal_budget_burst, file_config.refusal_budget_burst, DEFAULT_REFUSAL_BUDGET.burst)
    try:
        return RefusalBudgetSettings(rate_per_s=rate, burst=burst)
    except ValueError:
        parser.error("--refusal-budget-burst must be positive while --refusal-budget-rps is (a rate of 0 turns the budget off)")


def _history_events(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--max-history-events``, else the config file's ``max_history_events``, else the default."""
    if args.max_history_events is not None:
        return int(args.max_history_events)
    value = _file_config(args, parser).max_history_events
    return value if value is not None else Limits().max_history_events


def _given(flag: float | None, key: float | None, default: float) -> float:
    """The command line's value, else the config file's, else the default."""
    return flag if flag is not None else key if key is not None else default


