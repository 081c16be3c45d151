"""The ``prompt`` and ``sessions`` command line: their flags, argument types and defaults.

:mod:`acp_server.client.cli` runs them; this module imports neither the client nor trio, so that
``acp-server --help`` lists them without loading what only a connection needs.
"""

from __future__ import annotations

import argparse
import os

from .urls import parse_url

__all__ = ["COMMANDS", "DEFAULT_ATTEMPTS", "DEFAULT_URL", "ENV_URL", "add_commands", "default_url"]

#: The subcommands this module owns.
COMMANDS = ("prompt", "sessions")
#: Where ``--connect`` points when neither it nor ``$ACP_SERVER_URL`` is given: ``make run``'s address.
DEFAULT_URL = "tcp://127.0.0.1:4170"
#: The environment variable naming the server when ``--connect`` is not given.
ENV_URL = "ACP_SERVER_URL"
#: Attempts of one prompt when the server refuses it for capacity (the first included).
DEFAULT_ATTEMPTS = 5


def default_url() -> str:
    """``$ACP_SERVER_URL``, else :data:`DEFAULT_URL`."""
    return os.environ.get(ENV_URL) or DEFAULT_URL


def _url(text: str) -> str:
    try:
        parse_url(text)
    except ValueError as exc:
        source = f" (from ${ENV_URL})" if text == os.environ.get(ENV_URL) else ""
        raise argparse.ArgumentTypeError(f"--connect {exc}{source}") from None
    return text


def _attempts(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--max-attempts must be a positive integer (1: no retry); got {text!r}")
    return int(text)


def _connect_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect",
        type=_url,
        default=default_url(),
        metavar="URL",
        help=f"tcp://HOST:PORT, tls://HOST:PORT, unix:/path, http(s)://HOST:PORT/acp or ws(s)://HOST:PORT/acp of a running acp-server (default: ${ENV_URL}, else {DEFAULT_URL})",
    )


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``prompt`` and ``sessions`` on an ``add_subparsers()`` result."""
    p = subparsers.add_parser(
        "prompt",
        help="send one prompt to a running acp-server and stream the answer",
        description="Send one prompt; the agent's text goes to stdout, the session, tool call, retry and "
        "stop lines to stderr. Exit codes: 0 the turn ended, 1 an error, 2 a bad command line, 3 refused "
        "(for capacity after every retry, or stop reason refusal), 130 interrupted or cancelled.",
    )
    _connect_flag(p)
    _add_auth_flags(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="prompt this existing session")
    which.add_argument("--new", action="store_true", help="open a new session (the default)")
    p.add_argument("--cwd", metavar="DIR", help="the session's working directory (default: the current one)")
    p.add_argument(
        "--client-id",
        metavar="ID",
        help="act as this client id (with --session: used as is, re-registered if stale; with --new: requested)",
    )
    p.add_argument("--backend", metavar="NAME", help="the server's backend for a new session (_meta.backend)")
    answer = p.add_mutually_exclusive_group()
    answer.add_argument(
        "--yes", action="store_true", help="allow every permission the agent asks (each answer is printed)"
    )
    answer.add_argument(
        "--deny", action="store_true", help="reject every permission the agent asks (each answer is printed)"
    )
    p.add_argument(
        "--max-attempts",
        type=_attempts,
        default=DEFAULT_ATTEMPTS,
        metavar="N",
        help=f"attempts when the server refuses the prompt for capacity, honouring retryAfterMs "
        f"(default {DEFAULT_ATTEMPTS}; 1: no retry)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout (nothing on stderr)")
    p.add_argument("text", nargs="+", metavar="TEXT", help="the prompt (several words are joined by spaces)")
    s = subparsers.add_parser(
        "sessions",
        help="list the sessions of a running acp-server",
        description="List sessions as a table (id, title, cwd, updated, pending prompts).",
    )
    _connect_flag(s)
    _add_auth_flags(s)
    s.add_argument("--cwd", metavar="DIR", help="only the sessions in this working directory")
    s.add_argument("--json", action="store_true", help="one JSON object per session and line")


def _add_auth_flags(p: argparse.ArgumentParser) -> None:
    from ..auth.cli import add_connect_flags

    add_connect_flags(p)
