"""``acp-server token add|revoke|list``: manage the tokens file without ever storing a secret.

``add`` draws a 256-bit random secret, appends its SHA-256 record and prints the secret once, alone on
the last line of stdout (the lines before it describe the token); it cannot be shown again. ``revoke``
removes a record; a running server drops it on its next reload. ``list`` shows ids, tenants, scopes and
expiry, never a secret or a digest. Every write replaces the file atomically at mode 0600.

Exit codes: 0 done, 1 the file cannot be used (unreadable, not private, not of the accepted form, no
such token), 2 a bad command line. ``acp_server/cli.py`` mounts these with :func:`add_commands` and
:func:`run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from .identity import SCOPES

if TYPE_CHECKING:
    from datetime import datetime

    from .tokens import TokenRecord

# The tokens file's module (with hashlib, secrets and datetime) loads when a ``token`` command runs or
# parses its --id or --expires, not for building the parser: ``acp-server --help`` and ``serve`` skip it.

__all__ = ["COMMANDS", "add_commands", "add_connect_flags", "main", "run"]

#: The subcommands this module owns.
COMMANDS = ("token",)
EXIT_ERROR = 1


def _id_arg(text: str) -> str:
    from .tokens import is_token_id

    if not is_token_id(text):
        raise argparse.ArgumentTypeError(f"--id must be 1-64 letters, digits, '_' or '-'; got {text!r}")
    return text


def _tenant_arg(text: str) -> str:
    if not text or len(text) > 128 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"--tenant must be 1-128 printable characters; got {text!r}")
    return text


def _expires_arg(text: str) -> datetime:
    from datetime import UTC, datetime

    from .tokens import TokenFileError, parse_expires

    try:
        when = parse_expires(text, "--expires")
    except TokenFileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if when <= datetime.now(UTC):
        raise argparse.ArgumentTypeError(f"--expires {text!r} is in the past")
    return when


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``token`` (with ``add``, ``revoke``, ``list``) on an ``add_subparsers()`` result."""
    t = subparsers.add_parser(
        "token",
        help="add, revoke or list the tokens of a tokens file (--auth-tokens)",
        description="Manage a tokens file: SHA-256 records of secrets, each bound to a tenant.",
    )
    actions = t.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "add",
        help="create a token and print its secret once",
        description="Append a new token to FILE (created 0600 if absent) and print its secret, alone on the last "
        "line of stdout. Only its SHA-256 is stored: the secret cannot be shown again.",
    )
    a.add_argument("--tenant", required=True, type=_tenant_arg, help="the tenant the token acts for")
    a.add_argument("--file", required=True, metavar="FILE", help="the tokens file")
    a.add_argument(
        "--scope",
        action="append",
        choices=SCOPES,
        default=[],
        help="admin: act for any tenant and read all stats; metrics: scrape /metrics (repeatable)",
    )
    a.add_argument(
        "--expires", type=_expires_arg, metavar="TIME", help="RFC 3339 instant, e.g. 2027-01-01T00:00:00Z"
    )
    a.add_argument("--id", type=_id_arg, metavar="ID", help="the token's id (default: tok-<8 random hex digits>)")
    r = actions.add_parser("revoke", help="remove a token", description="Remove the token ID from FILE.")
    r.add_argument("id", metavar="ID", help="the token's id (as token list shows it)")
    r.add_argument("--file", required=True, metavar="FILE", help="the tokens file")
    ls = actions.add_parser(
        "list", help="list tokens (never secrets)", description="One line per token: id, tenant, scopes, expiry."
    )
    ls.add_argument("--file", required=True, metavar="FILE", help="the tokens file")


def add_connect_flags(p: argparse.ArgumentParser) -> None:
    """``--token`` (default ``$ACP_SERVER_TOKEN``) and ``--ca-file`` for a command that connects to a server."""
    p.add_argument(
        "--token",
        default=os.environ.get("ACP_SERVER_TOKEN"),
        metavar="SECRET",
        help="the secret of an acp-server token, sent with authenticate (default: $ACP_SERVER_TOKEN; prefer it: "
        "arguments show in ps)",
    )
    p.add_argument("--ca-file", metavar="FILE", help="PEM CAs to verify a tls:// server with (default: system store)")


def _existing(path: str) -> dict[str, TokenRecord]:
    from .tokens import load_tokens

    if not os.path.lexists(path):
        return {}
    return load_tokens(path)


def _add(args: argparse.Namespace, out: TextIO) -> int:
    import hashlib
    import secrets

    from .tokens import TokenRecord, new_secret, write_tokens

    records = _existing(args.file)
    token_id = args.id
    if token_id is None:
        token_id = f"tok-{secrets.token_hex(4)}"
        while token_id in records:
            token_id = f"tok-{secrets.token_hex(4)}"
    elif token_id in records:
        print(f"acp-server token: {args.file}: a token {token_id!r} exists already; revoke it first", file=sys.stderr)
        return EXIT_ERROR
    secret = new_secret()
    record = TokenRecord(
        id=token_id,
        sha256=hashlib.sha256(secret.encode()).digest(),
        tenant=args.tenant,
        scopes=frozenset(args.scope),
        expires=args.expires,
    )
    write_tokens(args.file, [*records.values(), record])
    print(f"token {_describe(record)}", file=out)
    print("the secret below is shown once; give it to the client (--token or ACP_SERVER_TOKEN):", file=out)
    print(secret, file=out)
    return 0


def _revoke(args: argparse.Namespace, out: TextIO) -> int:
    from .tokens import load_tokens, write_tokens

    records = load_tokens(args.file)
    if args.id not in records:
        known = ", ".join(sorted(records)) or "none"
        print(f"acp-server token: {args.file}: no token {args.id!r} (tokens: {known})", file=sys.stderr)
        return EXIT_ERROR
    del records[args.id]
    write_tokens(args.file, records.values())
    print(f"revoked {args.id}; a running server drops it on reload (SIGHUP)", file=out)
    return 0


def _describe(record: TokenRecord) -> str:
    from .tokens import format_expires

    scopes = ",".join(sorted(record.scopes)) or "-"
    expires = format_expires(record.expires) if record.expires else "never"
    return f"{record.id}\ttenant={record.tenant}\tscopes={scopes}\texpires={expires}"


def _list(args: argparse.Namespace, out: TextIO) -> int:
    from datetime import UTC, datetime

    from .tokens import load_tokens

    now = datetime.now(UTC)
    for record in load_tokens(args.file).values():
        print(_describe(record) + ("\t(expired)" if record.expired(now) else ""), file=out)
    return 0


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``token`` command; returns the exit code."""
    from .tokens import TokenFileError

    action = {"add": _add, "revoke": _revoke, "list": _list}[args.token_command]
    try:
        return action(args, out or sys.stdout)
    except TokenFileError as exc:
        print(f"acp-server token: {exc}", file=sys.stderr)
        return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """``token`` on its own (``python -m acp_server.auth.cli add ...``)."""
    parser = argparse.ArgumentParser(prog="acp-server")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["token", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
