"""The remote-bind rule: a listener beyond loopback needs TLS and tokens, both.

Without TLS a token crosses the network in clear; without tokens anyone who reaches the port is in.
So a non-loopback ``--listen``, ``--http-listen`` or ``--metrics-listen`` is accepted only when that
listener speaks TLS (``tls://`` or ``https://`` with ``--tls-cert``/``--tls-key``) and ``--auth-tokens``
is given; otherwise the command line is refused (exit 2) naming the flag and what is missing. Unix
sockets are the owner's (mode 0600) and need neither.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

__all__ = ["RemoteBindError", "check_remote_bind", "non_loopback"]


class RemoteBindError(ValueError):
    """A listener would be reachable beyond loopback without TLS or tokens; the message says which."""


def non_loopback(addresses: Iterable[str]) -> list[str]:
    """The addresses (as resolved for the bind) that are not loopback; unspecified ones count (``0.0.0.0``)."""
    out: list[str] = []
    for text in addresses:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            out.append(str(ip))
    return out


def check_remote_bind(flag: str, url: str, addresses: Iterable[str], *, tls: bool, tokens: bool) -> None:
    """Refuse a bind beyond loopback unless the listener has TLS and the server has tokens.

    Args:
        flag: the flag (or config key) that asked for the listener, for the message.
        url: the listener as given, for the message.
        addresses: the IP addresses the host resolves to (what would be bound).
        tls: this listener speaks TLS.
        tokens: ``--auth-tokens`` is given.

    Raises:
        RemoteBindError: the message names the flag, the address and each missing piece with its flag.
    """
    remote = non_loopback(addresses)
    if not remote or (tls and tokens):
        return
    missing = []
    if not tls:
        scheme = "https://" if flag in ("--http-listen", "--metrics-listen") else "tls://"
        missing.append(f"TLS (the {scheme} scheme with --tls-cert FILE and --tls-key FILE)")
    if not tokens:
        missing.append("tokens (--auth-tokens FILE)")
    raise RemoteBindError(
        f"{flag} {url}: {remote[0]} is not a loopback address; a listener reachable from other machines "
        f"needs TLS and tokens, and this one lacks {' and '.join(missing)}; "
        "or listen on loopback (127.0.0.1, ::1, localhost) or a Unix socket"
    )
