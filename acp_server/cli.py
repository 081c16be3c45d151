"""The ``acp-server`` command line.

Exit codes: 0 clean exit, 1 a runtime failure (port in use, a live Unix socket), 2 a bad command line
(the message names the flag and what it accepts, under the subcommand's own usage).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import pathlib
import shlex
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from . import __version__, cluster_cli
from .admission import Limits
from .admission.policy import PolicyLimits
from .auth import cli as auth_cli
from .auth.binds import RemoteBindError, check_remote_bind
from .auth.hosts import access_from, add_access_flags
from .auth.settings import add_serve_flags, settings_from
from .client import cli as client_cli
from .config import BackendConfig, ConfigError, FileConfig, check_backend, load_config, openai_shorthand
from .server import CONNECTION_IDLE_TIMEOUT_S, ListenAddress, ServerConfig, serve
from .transports.refusal_budget import DEFAULT_REFUSAL_BUDGET, RefusalBudgetSettings

__all__ = ["build_parser", "main", "parse_listen", "policy_from"]

DEFAULT_LISTEN = "tcp://127.0.0.1:4170"
LOG_LEVELS = ("debug", "info", "warning", "error")
#: ``PolicyLimits`` field -> the ``serve`` flag that sets it (the ``[admission]`` key is the field name).
POLICY_FLAGS = {
    "max_running_prompts": "--max-running-prompts",
    "max_queued_prompts": "--max-queued-prompts",
    "tenant_max_running": "--tenant-max-running",
    "interactive_max_wait_ms": "--interactive-max-wait-ms",
    "aging_s": "--aging-s",
    "mode": "--admission-mode",
}
_POLICY_DEFAULTS = PolicyLimits()


def _int_arg(flag: str, *, minimum: int, meaning: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text) if text.strip().lstrip("+-").isdigit() else None
        except ValueError:  # "+-5"
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be {meaning}; got {text!r}")
        return value

    parse.__name__ = flag
    return parse


def _seconds_arg(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or math.isinf(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number of seconds; got {text!r}")
        return value

    return parse


def _non_negative_seconds_arg(flag: str, zero: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or math.isinf(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a non-negative number of seconds ({zero}); got {text!r}")
        return value

    return parse


def _non_negative_number_arg(flag: str, zero: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or math.isinf(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a non-negative number ({zero}); got {text!r}")
        return value

    return parse


def parse_listen(text: str, flag: str = "--listen") -> ListenAddress:
    """``tcp://HOST:PORT`` or ``tls://HOST:PORT`` (port 0: any free port) or ``unix:/path`` (also ``unix:///path``).

    ``flag`` names the flag (or config key) in the error message.
    """
    accepted = "tcp://HOST:PORT or tls://HOST:PORT (PORT 0-65535, 0 = any free port) or unix:/absolute/path"
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a Unix socket needs an absolute path; accepted: {accepted}")
        return ListenAddress("unix", path=path)
    if text.startswith(("tcp://", "tls://")):
        parts = urlsplit(text)
        try:
            port = parts.port
        except ValueError:
            port = None
        host = parts.hostname
        if not host or port is None or parts.path not in ("", "/"):
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not of the form {accepted}")
        return ListenAddress(parts.scheme, host=host, port=port)
    raise argparse.ArgumentTypeError(f"{flag} {text!r}: unknown scheme; accepted: {accepted}")


def _http_address(text: str, flag: str, accepted: str) -> ListenAddress:
    """``http://``/``tcp://`` (kind ``tcp``) or ``https://`` (kind ``https``) ``HOST:PORT``, or ``unix:/path``."""
    given = text
    if text.startswith("https://"):
        text = "tcp://" + text[len("https://") :]
    elif text.startswith("http://"):
        text = "tcp://" + text[len("http://") :]
    try:
        addr = parse_listen(text, flag)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{flag} {given!r} is not of the form {accepted}") from None
    if addr.kind == "tls":
        raise argparse.ArgumentTypeError(f"{flag} {given!r}: HTTP over TLS is https://HOST:PORT; accepted: {accepted}")
    if given.startswith("https://"):
        return ListenAddress("https", host=addr.host, port=addr.port)
    return addr


def parse_metrics_listen(text: str, flag: str = "--metrics-listen") -> ListenAddress:
    """``tcp://HOST:PORT`` (also ``http://``) or ``https://HOST:PORT``: metrics are served over HTTP."""
    accepted = "tcp://HOST:PORT, http://HOST:PORT or https://HOST:PORT (PORT 0-65535, 0 = any free port)"
    if not text.startswith(("tcp://", "http://", "https://")):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: metrics are served over HTTP; accepted: {accepted}")
    return _http_address(text, flag, accepted)


def parse_http_listen(text: str, flag: str = "--http-listen") -> ListenAddress:
    """``http://HOST:PORT``, ``tcp://HOST:PORT`` or ``https://HOST:PORT`` (port 0: any free port) or ``unix:/path``."""
    accepted = (
        "http://HOST:PORT, https://HOST:PORT or tcp://HOST:PORT (PORT 0-65535, 0 = any free port) or unix:/absolute/path"
    )
    return _http_address(text, flag, accepted)


def _origin_arg(text: str) -> str:
    if text.strip() == "*":
        return "*"  # any origin: with tokens on only (http_from checks)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or text.endswith("/"):
        raise argparse.ArgumentTypeError(
            f"--http-allow-origin {text!r} is not an origin: scheme://host[:port], no path (e.g. https://app.example)"
        )
    from .auth.http_rules import normalize_origin

    return normalize_origin(text) or text  # as a browser sends it: lower case, no default port


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="acp-server", description="A gateway for the Agent Client Protocol.")
    parser.add_argument("--version", action="version", version=f"acp-server {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("serve", help="serve ACP over stdio, TCP and Unix sockets", description="Serve ACP clients.")
    _add_serve_arguments(s)
    client_cli.add_commands(sub)  # prompt, sessions: after serve, which --help lists first
    auth_cli.add_commands(sub)  # token
    cluster_cli.add_commands(sub)
    c = sub.add_parser(
        "connect",
        help="relay stdio to a running acp-server (for editors that spawn their agent)",
        description="Relay stdin/stdout to a running acp-server, byte for byte, until it closes the connection "
        "(with --token, an authenticate is sent after the client's initialize and its answer kept back).",
    )
    c.add_argument(
        "url",
        metavar="URL",
        help="tcp://HOST:PORT, tls://HOST:PORT, unix:/path, http(s)://HOST:PORT/acp or ws(s)://HOST:PORT/acp of a running acp-server",
    )
    auth_cli.add_connect_flags(c)
    d = sub.add_parser(
        "doctor",
        help="check what `serve` with these flags needs: the state directory, agent commands, ports",
        description="Check the setup `acp-server serve` would use with the same flags (state directory and "
        "who holds it, the configured agents' commands, the listeners' ports) and say what to do about each "
        "problem. Exit 0 when all is well, 1 when a check failed.",
    )
    _add_serve_arguments(d)
    return parser, s


def _add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of ``serve`` (``doctor`` takes the same ones, to check what ``serve`` would use)."""
    s.add_argument("--stdio", action="store_true", help="serve one client on stdin/stdout (logs go to stderr)")
    s.add_argument(
        "--listen",
        action="append",
        type=parse_listen,
        default=[],
        metavar="URL",
        help=f"tcp://HOST:PORT or tls://HOST:PORT (beyond loopback: tls:// with --auth-tokens only; port 0 = "
        f"any free port) or unix:/path; repeatable "
        f"(default without --stdio: {DEFAULT_LISTEN})",
    )
    s.add_argument(
        "--echo-delay-ms",
        type=_int_arg("--echo-delay-ms", minimum=0, meaning="a non-negative integer (milliseconds)"),
        default=None,  # None: not given, so a config file's delay_ms stands (an explicit 0 overrides it)
        metavar="N",
        help="each echo prompt takes at least N ms (default 0)",
    )
    s.add_argument(
        "--max-message-bytes",
        type=_int_arg("--max-message-bytes", minimum=1, meaning="a positive integer (bytes)"),
        default=Limits().max_message_bytes,
        metavar="N",
        help="the longest line accepted; longer ones close the connection (default 50 MiB)",
    )
    s.add_argument(
        "--max-pending-prompts-per-session",
        type=_int_arg(
            "--max-pending-prompts-per-session", minimum=0, meaning="a non-negative integer (0 disables the limit)"
        ),
        default=Limits().max_pending_prompts_per_session,
        metavar="N",
        help="queued + running prompts one session holds; 0 disables the limit (default 5)",
    )
    s.add_argument(
        "--prompt-deadline-ms",
        type=_int_arg("--prompt-deadline-ms", minimum=0, meaning="a non-negative integer (0 = no deadline)"),
        default=0,
        metavar="N",
        help="deadline of every prompt, counted from admission; _meta.deadlineMs may shorten it (default off)",
    )
    s.add_argument(
        "--max-inflight-requests",
        type=_int_arg("--max-inflight-requests", minimum=1, meaning="a positive integer"),
        default=Limits().max_inflight_requests,
        metavar="N",
        help="unanswered requests of one connection that run at once; later ones wait (default 256)",
    )
    s.add_argument(
        "--max-outbound-bytes",
        type=_int_arg("--max-outbound-bytes", minimum=0, meaning="a non-negative integer (0 = twice --max-message-bytes)"),
        default=0,
        metavar="N",
        help="bytes queued to one connection before it is evicted (default twice --max-message-bytes)",
    )
    s.add_argument(
        "--client-idle-timeout-s",
        type=_seconds_arg("--client-idle-timeout-s"),
        default=Limits().client_idle_timeout_s,
        metavar="S",
        help="a client id unused for S seconds expires (default 300)",
    )
    s.add_argument(
        "--session-idle-timeout-s",
        type=_seconds_arg("--session-idle-timeout-s"),
        default=Limits().session_idle_timeout_s,
        metavar="S",
        help="an idle session with no client and no connection is closed after S seconds (default 1800)",
    )
    s.add_argument(
        "--idempotency-ttl-s",
        type=_seconds_arg("--idempotency-ttl-s"),
        default=Limits().idempotency_ttl_s,
        metavar="S",
        help="how long an admitted _meta.idempotencyKey is remembered per session (default 600)",
    )
    s.add_argument(
        "--agent",
        action="append",
        type=_agent_arg,
        default=[],
        metavar="NAME=CMD",
        help="an ACP agent backend: NAME and the command that starts it (shell-quoted), or"
        " NAME=openai:BASE_URL#MODEL for an OpenAI-compatible endpoint; repeatable",
    )
    s.add_argument(
        "--default-backend",
        metavar="NAME",
        help="the backend of sessions that name none in _meta.backend (default: the agent after --, else echo)",
    )
    s.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file with default_backend and [backends.NAME] tables (the command line overrides it)",
    )
    s.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where durable sessions live (one SQLite database; one server per directory; default: one "
        "directory per --listen set and --config file under $XDG_STATE_HOME/acp-server, else "
        "~/.local/state/acp-server, e.g. .../tcp-127.0.0.1-4170; with --stdio: none unless given)",
    )
    s.add_argument(
        "--ephemeral", action="store_true", help="keep sessions in memory only: nothing is written to disk"
    )
    s.add_argument(
        "--max-sessions",
        type=_int_arg("--max-sessions", minimum=0, meaning="a non-negative integer (0 disables the limit)"),
        default=Limits().max_sessions,
        metavar="N",
        help="live (in-memory) sessions at once; more get session_limit_exceeded (default 1000)",
    )
    s.add_argument(
        "--max-history-events",
        type=_int_arg("--max-history-events", minimum=1, meaning="a positive integer"),
        default=None,
        metavar="N",
        help="recent events of a session kept in memory (late joiners, replays); older ones are read "
        "from the store in pages, or are gone with --ephemeral (default 10000)",
    )
    s.add_argument(
        "--max-connections",
        type=_int_arg("--max-connections", minimum=0, meaning="a non-negative integer (0: from the fd limit)"),
        default=None,
        metavar="N",
        help="sockets of every listener together; a later connection is sent _acp_server/evicted "
        "(too_many_connections) and closed (default: the fd limit less an eighth, at least 64, of head-room)",
    )
    s.add_argument(
        "--connection-idle-timeout-s",
        type=_non_negative_seconds_arg("--connection-idle-timeout-s", "0 turns it off"),
        default=None,
        metavar="S",
        help="close a socket connection that holds nothing (no request in flight, no attached session) "
        "after S seconds without input (default 300; not stdio)",
    )
    s.add_argument(
        "--refusal-budget-rps",
        type=_non_negative_number_arg("--refusal-budget-rps", "0 turns the budget off"),
        default=None,
        metavar="R",
        help="each connection's budget of hold-off refusals (prompt_queue_full, capacity_*, "
        "admission_deferred, rate_limited): R a second, one per refusal, 4 for a re-send inside the "
        "retryAfterMs it was given; a connection in debt has its next requests wait (up to 1 s at a time), "
        "one refused a burst's worth of times in debt is sent _acp_server/evicted (ignored_retry_after) "
        "and closed (default 200)",
    )
    s.add_argument(
        "--refusal-budget-burst",
        type=_non_negative_number_arg("--refusal-budget-burst", "a positive number while the rate is on"),
        default=None,
        metavar="N",
        help="the refusal budget's size: what a connection may spend at once (default 500)",
    )
    s.add_argument(
        "--turn-states",
        type=_on_off("--turn-states"),
        default=None,  # None: not given, so the config file's turn_states stands
        metavar="on|off",
        help="send _acp_server/turn_state notifications to clients that do not say (initialize "
        "_meta.turnStates overrides it per connection; default on)",
    )
    _add_policy_flags(s)
    _add_http_flags(s)
    add_serve_flags(s)
    s.add_argument(
        "--drain-timeout-s",
        type=_non_negative_seconds_arg("--drain-timeout-s", "0 cancels running prompts at once"),
        default=None,
        metavar="S",
        help="after a connection's input ends (stdin EOF, a socket's shutdown), how long its accepted requests "
        "may still run before they are cancelled (default 30); when given, also on SIGTERM: refuse new "
        "prompts (capacity_unavailable, draining) and let running ones finish for up to S seconds before "
        "shutting down (not given: SIGTERM cancels them at once)",
    )
    cluster_cli.add_flags(s, serve=True)
    s.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="stderr log level (default warning)")
    s.add_argument(
        "agent_command",
        nargs="*",
        metavar="-- CMD ARGS",
        help="after --: one ACP agent command, served as the backend named 'agent' (and the default)",
    )


def _add_policy_flags(s: argparse.ArgumentParser) -> None:
    # Defaults are None ("not given") so that an [admission] table in --config stands unless overridden.
    d = _POLICY_DEFAULTS
    g = s.add_argument_group(
        "admission policy and metrics",
        "Global seats shared by priority class (critical > interactive > background > bulk, _meta.priority) "
        "and tenant (initialize _meta.tenantId). Every limit is off by default. In --config, the [admission] "
        "table takes max_running_prompts, max_queued_prompts, tenant_max_running, interactive_max_wait_ms, "
        "aging_s, mode, min_deadline_left_ms, tenant_overrides and class_shares, the [metrics] table listen and "
        "tenant_labels; "
        "flags override the file.",
    )
    g.add_argument(
        "--max-running-prompts",
        type=_int_arg("--max-running-prompts", minimum=0, meaning="a non-negative integer (0 disables the limit)"),
        metavar="N",
        help="prompts running at once across the server; more wait or are refused (default 0: no limit)",
    )
    g.add_argument(
        "--max-queued-prompts",
        type=_int_arg("--max-queued-prompts", minimum=0, meaning="a non-negative integer (0 = no waiting room)"),
        metavar="M",
        help=f"prompts waiting for a seat once --max-running-prompts is set; 0 = no waiting room, "
        f"a prompt without a free seat is refused (default {d.max_queued_prompts})",
    )
    g.add_argument(
        "--tenant-max-running",
        type=_int_arg("--tenant-max-running", minimum=0, meaning="a non-negative integer (0 disables the limit)"),
        metavar="N",
        help="seats one tenant holds at once; more are deferred with retryAfterMs (default 0: no cap)",
    )
    g.add_argument(
        "--interactive-max-wait-ms",
        type=_int_arg("--interactive-max-wait-ms", minimum=0, meaning="a non-negative integer (0 = any wait)"),
        metavar="MS",
        help=f"an interactive prompt whose estimated wait is longer is refused wait_too_long (0 = any wait; "
        f"default {d.interactive_max_wait_ms})",
    )
    g.add_argument(
        "--aging-s",
        type=_non_negative_seconds_arg("--aging-s", "0 turns aging off"),
        metavar="S",
        help=f"background and bulk waiters move up one class every S seconds (0 = off; default {d.aging_s:g})",
    )
    g.add_argument(
        "--admission-mode",
        choices=("enforce", "observe"),
        help="enforce the policy, or observe: admit everything and count (metrics, logs) what enforce would "
        "have done (default enforce)",
    )
    g.add_argument(
        "--metrics-listen",
        type=parse_metrics_listen,
        metavar="URL",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (also tcp://HOST:PORT) or "
        "https://HOST:PORT/metrics (with --tls-cert/--tls-key); beyond loopback only https:// with "
        "--auth-tokens; port 0 = any free port (default: no metrics endpoint)",
    )
    g.add_argument(
        "--metrics-tenant-labels",
        action="store_true",
        default=None,
        help="add per-tenant series labelled with tenant ids (unbounded and possibly sensitive; default off)",
    )


def _add_http_flags(s: argparse.ArgumentParser) -> None:
    # Defaults are None ("not given") so that an [http] table in --config stands unless overridden.
    g = s.add_argument_group(
        "ACP over HTTP and WebSocket",
        "The remote transport of ACP at /acp (Streamable HTTP with SSE, and WebSocket) and GET /health. "
        "In --config, the [http] table takes listen, max_connections, connection_grace_s, allow_origin, "
        "allow_host and trusted_proxy; flags override the file.",
    )
    g.add_argument(
        "--http-listen",
        action="append",
        type=parse_http_listen,
        default=None,
        metavar="URL",
        help="serve /acp at http://HOST:PORT (also tcp://HOST:PORT), https://HOST:PORT (with --tls-cert/"
        "--tls-key; /acp as https:// and wss://) or unix:/path; beyond loopback only https:// with "
        "--auth-tokens; port 0 = any free port; repeatable (default: none)",
    )
    g.add_argument(
        "--http-max-connections",
        type=_int_arg("--http-max-connections", minimum=1, meaning="a positive integer"),
        metavar="N",
        help="/acp connections and WebSockets at once; the next initialize gets 503 (default 256)",
    )
    g.add_argument(
        "--http-connection-grace-s",
        type=_non_negative_seconds_arg("--http-connection-grace-s", "0 closes it at once"),
        metavar="S",
        help="a connection with no event stream open is kept S seconds, then closed (default 10)",
    )
    g.add_argument(
        "--http-allow-origin",
        action="append",
        type=_origin_arg,
        default=None,
        metavar="ORIGIN",
        help="a foreign origin (scheme://host[:port], exact) allowed besides the listener's own; '*' "
        "allows any and needs tokens on; repeatable",
    )
    add_access_flags(g)  # --http-allow-host, --trusted-proxy
    g.add_argument(
        "--workspace",
        default=None,
        metavar="DIR",
        help="the REST API's primary workspace: its workspaceCwd and default cwd (default: the working directory)",
    )


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
            origins = [_origin_arg(o) for o in table.allow_origin]
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


def _on_off(flag: str) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        value = {"on": True, "off": False}.get(text.strip().lower())
        if value is None:
            raise argparse.ArgumentTypeError(f"{flag} must be on or off; got {text!r}")
        return value

    return parse


def _agent_arg(text: str) -> tuple[str, list[str]]:
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise argparse.ArgumentTypeError(f"--agent must be NAME=COMMAND (e.g. claude='claude-code-acp --debug'); got {text!r}")
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--agent {name}: cannot split the command: {exc}") from None
    return name, argv


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


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, naming a stray flag under its subcommand's own usage (``serve --bogus`` shows serve's)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser, serve_parser = _build()
    args = _parse(parser, argv)
    if args.command in client_cli.COMMANDS:
        return client_cli.run(args)
    if args.command in auth_cli.COMMANDS:
        return auth_cli.run(args)
    if args.command == "connect":
        return _connect(args.url, args.token, args.ca_file)
    if args.command == "cluster":
        return cluster_cli.run(args)
    if args.command == "doctor":
        from .doctor import run_doctor  # only the doctor needs it

        doctor_parser = _subparser(parser, "doctor")
        return run_doctor(server_config(args, doctor_parser), args)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = server_config(args, serve_parser)
    if config.state_dir is not None and args.state_dir is None:
        from .statedir import adopt_legacy  # the store loads only when a state directory is used

        moved = adopt_legacy(pathlib.Path(config.state_dir))
        if moved is not None:
            print(f"acp-server: {moved}", file=sys.stderr, flush=True)
    tune_gc()
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        failure = _os_error(exc)
        if failure is None:
            raise
        print(f"acp-server: {failure.strerror or failure}", file=sys.stderr)
        return 1
    return 0


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices.get(name, parser)
    return sub


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


#: Allocations between young-generation collections for a serving process (CPython's default is 700).
GC_THRESHOLD = (50_000, 20, 20)


def tune_gc() -> None:
    """Collect garbage less often in a serving process.

    With CPython's defaults a loaded server collected every few prompts, and its full collections walk
    every live session's history: 21-26% of server CPU in the pipelined echo benchmark, with full
    collections of 60-80 ms each. Objects made at start-up are frozen out of collection, and the young
    generation is collected every 50,000 allocations instead of every 700.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a runtime failure, out of trio's nursery exception groups (else ``None``).

    A state directory that cannot be used (a newer schema, not a database) counts as one.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    sqlite3 = sys.modules.get("sqlite3")  # loaded only with a state directory: without one, no store error
    if sqlite3 is not None:
        from .store import StoreVersionError, StoreWriterError

        if isinstance(exc, StoreVersionError | StoreWriterError | sqlite3.DatabaseError):
            return OSError(str(exc))
    return exc if isinstance(exc, OSError) else None


def _connect(url: str, token: str | None = None, ca_file: str | None = None) -> int:
    from .transports.relay import relay_stdio

    try:
        trio.run(relay_stdio, url, token, ca_file)
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as exc:
        failure = _os_error(exc) or exc
        print(f"acp-server connect: cannot relay to {url}: {failure}", file=sys.stderr)
        return 1
    return 0
