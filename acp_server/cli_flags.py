"""The ``serve`` (and ``doctor``) command line: its flags, their argument types and defaults.

Every flag's value is checked as it is parsed (a bad one exits 2 naming the flag and what it accepts);
what the parsed flags mean together, with the config file, is :mod:`.cli_config`'s.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from urllib.parse import urlsplit

from . import cluster_cli
from .admission import Limits
from .admission.policy_limits import PolicyLimits
from .auth.hosts import add_access_flags
from .auth.settings import add_serve_flags, positive_arg
from .listen_address import ListenAddress

__all__ = [
    "DEFAULT_LISTEN",
    "LOG_LEVELS",
    "POLICY_FLAGS",
    "add_serve_arguments",
    "origin_arg",
    "parse_http_listen",
    "parse_listen",
    "parse_metrics_listen",
]


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
    parse: Callable[[str], float] = positive_arg(flag, "a positive number of seconds")
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


def origin_arg(text: str) -> str:
    if text.strip() == "*":
        return "*"  # any origin: with tokens on only (http_from checks)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or text.endswith("/"):
        raise argparse.ArgumentTypeError(
            f"--http-allow-origin {text!r} is not an origin: scheme://host[:port], no path (e.g. https://app.example)"
        )
    from .auth.http_rules import normalize_origin

    return normalize_origin(text) or text  # as a browser sends it: lower case, no default port


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
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
        "_meta.turnStates overrides it per connection; default off: only clients that ask get them)",
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
        type=origin_arg,
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
    import shlex  # only an --agent flag splits a command line

    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--agent {name}: cannot split the command: {exc}") from None
    return name, argv


