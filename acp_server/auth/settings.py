"""The ``serve`` flags of tokens and TLS, their ``[auth]``/``[tls]`` config tables, and what they build.

``--auth-tokens FILE`` (``[auth] tokens``), ``--audit-log FILE`` (``[auth] audit_log``),
``--rate-limit-rps N`` (``[auth] rate_limit_rps``), ``--tls-cert FILE`` / ``--tls-key FILE``
(``[tls] cert`` / ``key``), ``--tls-handshake-timeout-s S`` (``[tls] handshake_timeout_s``); flags
override the file. :func:`settings_from` checks them together and loads the files once, so a tokens
file that is not private, a certificate that does not load, or a flag that needs another, is reported
before anything listens: a bad combination exits 2 naming the flag, a file that cannot be used exits 1
naming the file and the fix.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # settings_from imports them: the flags alone need neither TLS (trio) nor the tokens file
    from .audit import AuditLog
    from .tls import ServerTls
    from .tokens import TokenStore

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT_S", "AuthSettings", "add_serve_flags", "positive_arg", "settings_from"]

EXIT_FILE = 1
#: ``--tls-handshake-timeout-s`` unless given.
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AuthSettings:
    """What the auth and TLS flags built.

    Attributes:
        tokens: the tokens in force (``None``: no tokens; every connection is the owner's).
        audit: where audit lines go (``--audit-log FILE``, else stderr); set with tokens.
        rate_limit_rps: requests a second per token (``None``: no limit).
        tls: the server's TLS (``None``: no ``tls://`` listener possible).
    """

    tokens: TokenStore | None = None
    audit: AuditLog | None = None
    rate_limit_rps: float | None = None
    tls: ServerTls | None = None


def positive_arg(flag: str, meaning: str) -> Any:
    """An argparse type: a finite number above 0, else the flag's message naming ``meaning``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or math.isinf(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be {meaning}; got {text!r}")
        return value

    return parse


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Add the tokens and TLS flags to the ``serve`` parser (their defaults are "not given")."""
    g = serve.add_argument_group(
        "tokens and TLS",
        "With --auth-tokens, TCP and TLS clients authenticate (methodId acp-server-token, _meta.token) and act "
        "for their token's tenant; Unix sockets and stdio stay the owner's. In --config: [auth] tokens, "
        "audit_log, rate_limit_rps and [tls] cert, key, handshake_timeout_s; flags override the file. "
        "SIGHUP reloads the tokens file and the certificates.",
    )
    g.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="the tokens file (TOML, mode 0600; managed with 'acp-server token'); default: no tokens",
    )
    g.add_argument("--audit-log", metavar="FILE", help="append audit lines (JSON) to FILE (default: stderr)")
    g.add_argument(
        "--rate-limit-rps",
        type=positive_arg("--rate-limit-rps", "a positive number (requests a second per token)"),
        metavar="N",
        help="requests a second per token, bursts of 2N; more get rate_limited (default: no limit)",
    )
    g.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain for tls:// listeners")
    g.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-handshake-timeout-s",
        type=positive_arg("--tls-handshake-timeout-s", "a positive number of seconds"),
        metavar="S",
        help=f"a TLS client that has not completed its handshake by then is closed "
        f"(default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
    )


def _file_failure(message: str) -> NoReturn:
    print(f"acp-server: {message}", file=sys.stderr)
    raise SystemExit(EXIT_FILE)


def settings_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, auth_table: Any, tls_table: Any, *, tls_listeners: bool
) -> AuthSettings:
    """Merge the flags over the ``[auth]`` and ``[tls]`` tables, check them, load the files.

    ``args.auth_tokens`` is left holding the effective tokens file (the flag's or the file's).

    Args:
        args: the parsed ``serve`` command line.
        parser: for exit-2 errors naming the flag.
        auth_table: the config's ``[auth]`` table (``tokens``, ``audit_log``, ``rate_limit_rps``).
        tls_table: the config's ``[tls]`` table (``cert``, ``key``, ``handshake_timeout_s``).
        tls_listeners: a ``tls://`` listener was asked for.
    """
    tokens_path = args.auth_tokens or auth_table.tokens
    audit_log = args.audit_log or auth_table.audit_log
    rps = args.rate_limit_rps if args.rate_limit_rps is not None else auth_table.rate_limit_rps
    cert = args.tls_cert or tls_table.cert
    key = args.tls_key or tls_table.key
    timeout = args.tls_handshake_timeout_s or tls_table.handshake_timeout_s or DEFAULT_HANDSHAKE_TIMEOUT_S
    args.auth_tokens = tokens_path
    if rps is not None and not (isinstance(rps, int | float) and rps > 0 and math.isfinite(rps)):
        parser.error(f"--config: auth.rate_limit_rps must be a positive number; got {rps!r}")
    if tls_table.handshake_timeout_s is not None and not tls_table.handshake_timeout_s > 0:
        parser.error("--config: tls.handshake_timeout_s must be a positive number of seconds")
    if tokens_path is None:
        if rps is not None:
            parser.error("--rate-limit-rps limits requests per token: it needs --auth-tokens FILE")
        if audit_log is not None:
            parser.error("--audit-log records authentications: it needs --auth-tokens FILE")
    if (cert is None) != (key is None):
        parser.error("--tls-cert and --tls-key go together: give both (PEM certificate chain and its key)")
    if tls_listeners and cert is None:
        parser.error("a tls:// --listen needs --tls-cert FILE and --tls-key FILE")
    store = None
    if tokens_path is not None:
        from .tokens import TokenFileError, TokenStore  # each file's module loads only when it is used

        try:
            store = TokenStore.from_file(tokens_path)
        except TokenFileError as exc:
            _file_failure(str(exc))
    tls = None
    if cert is not None and key is not None:
        from .tls import ServerTls, TlsConfigError

        try:
            tls = ServerTls(cert, key, handshake_timeout_s=timeout)
        except TlsConfigError as exc:
            _file_failure(str(exc))
    audit = None
    if store is not None:
        from .audit import AuditLog

        try:
            audit = AuditLog(audit_log)
        except OSError as exc:
            _file_failure(f"--audit-log {audit_log}: cannot append to it: {exc.strerror}")
    return AuthSettings(tokens=store, audit=audit, rate_limit_rps=rps, tls=tls)
