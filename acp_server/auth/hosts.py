"""Who may reach the HTTP listeners by name and through which proxies: the ``serve`` flags
``--http-allow-host NAME`` and ``--trusted-proxy CIDR`` (``[http] allow_host`` / ``trusted_proxy`` in
``--config``), and the rule that ``--http-allow-origin '*'`` needs tokens.

What they build is enforced by the HTTP listener: the names by its ``Host`` check
(:class:`~acp_server.transports.http.rules.HostRules`, DNS-rebinding defence), the networks by
:class:`~acp_server.transports.http.addresses.ForwardedFor` (``X-Forwarded-For``/``X-Forwarded-Proto``
believed from those peers only).
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from typing import Any

__all__ = ["access_from", "add_access_flags", "cidr_arg", "host_arg"]


def host_arg(text: str) -> str:
    """One ``--http-allow-host`` name: lower case, an IPv6 address in brackets, no port.

    Raises:
        argparse.ArgumentTypeError: not a host name or address, or one with a port.
    """
    from .http_rules import split_host  # the HTTP rules load when the flag is given, not for --help

    stripped = text.strip()
    parsed = split_host(stripped)
    if parsed is None or parsed[1] is not None or (":" in stripped and not stripped.startswith("[")):
        raise argparse.ArgumentTypeError(
            f"--http-allow-host {text!r}: a host name or address, without a port (e.g. acp.example.com, "
            "10.0.0.5, [2001:db8::1])"
        )
    name = parsed[0]
    return f"[{name}]" if ":" in name else name


def cidr_arg(text: str) -> str:
    """One ``--trusted-proxy`` network, normalized (an address alone is a /32 or /128).

    Raises:
        argparse.ArgumentTypeError: not an address or a network.
    """
    try:
        return str(ipaddress.ip_network(text.strip(), strict=False))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--trusted-proxy {text!r}: an IP address or network in CIDR form (e.g. 10.0.0.0/8, ::1/128)"
        ) from None


def add_access_flags(group: Any) -> None:
    """Add ``--http-allow-host`` and ``--trusted-proxy`` to the HTTP flags' argument group."""
    group.add_argument(
        "--http-allow-host",
        action="append",
        type=host_arg,
        default=None,
        metavar="NAME",
        help="a remote Host name (or address) the HTTP listeners answer to besides loopback names and the "
        "bound address (DNS-rebinding defence: any other gets 403 forbidden_host); repeatable",
    )
    group.add_argument(
        "--trusted-proxy",
        action="append",
        type=cidr_arg,
        default=None,
        metavar="CIDR",
        help="a reverse proxy (address or network) whose X-Forwarded-For / X-Forwarded-Proto headers count; "
        "from any other peer they are ignored; repeatable",
    )


def access_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, table: Any, *, origins: Sequence[str], tokens: bool
) -> tuple[frozenset[str], tuple[str, ...]]:
    """The allowed host names and trusted proxies: the flags, else the ``[http]`` table; exit 2 on a bad
    entry (naming the flag or key) or on ``--http-allow-origin '*'`` without tokens.

    Args:
        args: the parsed ``serve`` command line.
        parser: for exit-2 errors.
        table: the config's ``[http]`` table (``allow_host``, ``trusted_proxy``).
        origins: the ``--http-allow-origin`` entries in force.
        tokens: ``--auth-tokens`` (or ``[auth] tokens``) is given.
    """
    hosts = args.http_allow_host or []
    if not hosts:
        try:
            hosts = [host_arg(h) for h in table.allow_host]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--config {args.config}: http.allow_host: {exc}")
    proxies = args.trusted_proxy or []
    if not proxies:
        try:
            proxies = [cidr_arg(c) for c in table.trusted_proxy]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--config {args.config}: http.trusted_proxy: {exc}")
    if "*" in origins and not tokens:
        parser.error(
            "--http-allow-origin '*' needs --auth-tokens: without tokens any web page could drive the "
            "server from a visitor's browser; list exact origins instead (e.g. https://console.example.com)"
        )
    return frozenset(hosts), tuple(proxies)
