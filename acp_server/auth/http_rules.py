"""Who may talk to an HTTP listener: Host and Origin rules, bearer credentials, trusted proxies.

Pure functions and small value objects. The HTTP transport checks ``Host`` and ``Origin`` first
(:class:`~acp_server.transports.http.rules.HostRules`, with :func:`split_host` and
:func:`normalize_origin` from here), then the credentials (:func:`http_identity`), answering every
credential failure with the same 401 (:data:`UNAUTHORIZED_BODY`), so that a prober learns nothing from
which one it was.

Credentials come as ``Authorization: Bearer <secret>``, or, for browsers' WebSockets (which cannot set
headers), as the subprotocols ``acp.v1`` and ``acp-bearer.<base64url(secret), no padding>``; the server
then answers with ``acp.v1`` only, never echoing the secret. Behind a reverse proxy, ``X-Forwarded-For``
and ``X-Forwarded-Proto`` count only when the peer is a ``--trusted-proxy``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

import msgspec

from ..errors import UnauthorizedError
from .tokens import MAX_SECRET_CHARS, Identity, TokenStore

__all__ = [
    "UNAUTHORIZED_BODY",
    "UNAUTHORIZED_HEADERS",
    "UNAUTHORIZED_STATUS",
    "WS_BEARER_PREFIX",
    "WS_SUBPROTOCOL",
    "ClientView",
    "HttpAuth",
    "TrustedProxies",
    "WsOffer",
    "bearer_subprotocol",
    "http_identity",
    "normalize_origin",
    "parse_bearer",
    "parse_ws_subprotocols",
    "retry_after_seconds",
    "split_host",
]

WS_SUBPROTOCOL = "acp.v1"
WS_BEARER_PREFIX = "acp-bearer."
UNAUTHORIZED_STATUS = 401
_UNAUTHORIZED = UnauthorizedError(scheme="Bearer")
#: The one body of every 401: missing, malformed, wrong and expired credentials alike (the registry's
#: ``{error, code, ...data}`` shape, kind ``unauthorized``).
UNAUTHORIZED_BODY = msgspec.json.encode(
    {"error": _UNAUTHORIZED.message, "code": _UNAUTHORIZED.kind, "scheme": "Bearer"}
)
UNAUTHORIZED_HEADERS = (
    (b"content-type", b"application/json"),
    (b"www-authenticate", b'Bearer realm="acp-server"'),
    (b"cache-control", b"no-store"),
)
# RFC 6750 b64token: the characters a bearer credential may hold.
_B64TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or ``:authority``) as ``(name, port)``: lowercase, IPv6 without brackets.

    Returns:
        ``None`` when it is not ``name``, ``name:port``, ``[v6]`` or ``[v6]:port`` (port 1-65535).
    """
    text = value.strip().lower()
    port_text: str | None = None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        name, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                return None
            port_text = rest[1:]
        ip = _ip(name)
        if ip is None or ip.version != 6:
            return None
    else:
        name, sep, port_text_raw = text.partition(":")
        port_text = port_text_raw if sep else None
        if not (_HOST_NAME.match(name) or _ip(name) is not None):
            return None
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    return name, port


def normalize_origin(value: str) -> str | None:
    """An origin as ``scheme://host[:port]`` (lowercase, default port dropped), or ``None`` if it is not one.

    ``null`` (sandboxed frames, files) is kept as ``null``: it matches only an exact ``null`` entry.
    """
    text = value.strip()
    if text == "null":
        return "null"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    if parts.username is not None or parts.password is not None or not parts.hostname:
        return None
    host = parts.hostname.lower()
    if split_host(f"[{host}]" if ":" in host else host) is None:
        return None
    shown = f"[{host}]" if ":" in host else host
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


def parse_bearer(value: str | Sequence[str] | None) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header, or ``None`` when absent or malformed.

    Several ``Authorization`` headers (a sequence of more than one) are malformed.
    """
    if value is not None and not isinstance(value, str):
        if len(value) != 1:
            return None
        value = value[0]
    if not value:
        return None
    scheme, sep, credential = value.strip().partition(" ")
    credential = credential.strip(" ")
    if not sep or scheme.lower() != "bearer" or not credential or len(credential) > MAX_SECRET_CHARS:
        return None
    if not _B64TOKEN.match(credential):
        return None
    return credential


def bearer_subprotocol(secret: str) -> str:
    """The WebSocket subprotocol carrying ``secret``: ``acp-bearer.<base64url, no padding>``."""
    return WS_BEARER_PREFIX + base64.urlsafe_b64encode(secret.encode("utf-8")).rstrip(b"=").decode("ascii")


@dataclass(frozen=True, slots=True)
class WsOffer:
    """What a WebSocket handshake's ``Sec-WebSocket-Protocol`` offers.

    Attributes:
        acp: ``acp.v1`` is offered (the server answers with it, and only it).
        secret: the secret of an ``acp-bearer.`` entry, or ``None``.
        malformed: an ``acp-bearer.`` entry was present but did not decode (or there were several).
    """

    acp: bool = False
    secret: str | None = None
    malformed: bool = False


def parse_ws_subprotocols(values: str | Sequence[str] | None) -> WsOffer:
    """Read the subprotocols a client offers (the header's values, comma-separated, possibly repeated)."""
    if values is None:
        return WsOffer()
    if isinstance(values, str):
        values = [values]
    entries = [e.strip() for v in values for e in v.split(",") if e.strip()]
    acp = WS_SUBPROTOCOL in entries
    bearers = [e[len(WS_BEARER_PREFIX) :] for e in entries if e.startswith(WS_BEARER_PREFIX)]
    if not bearers:
        return WsOffer(acp=acp)
    if len(bearers) > 1:
        return WsOffer(acp=acp, malformed=True)
    encoded = bearers[0]
    if not encoded or len(encoded) > MAX_SECRET_CHARS * 2 or not re.fullmatch(r"[A-Za-z0-9_-]+", encoded):
        return WsOffer(acp=acp, malformed=True)
    try:
        secret = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
    except (binascii.Error, ValueError):
        return WsOffer(acp=acp, malformed=True)
    if not secret:
        return WsOffer(acp=acp, malformed=True)
    return WsOffer(acp=acp, secret=secret)


@dataclass(frozen=True, slots=True)
class HttpAuth:
    """The outcome of :func:`http_identity`.

    Attributes:
        identity: who the request is, or ``None``: answer :data:`UNAUTHORIZED_STATUS` with
            :data:`UNAUTHORIZED_BODY` and :data:`UNAUTHORIZED_HEADERS`, whatever the reason.
        subprotocol: for a WebSocket handshake, the subprotocol to answer with (``acp.v1``) or ``None``.
        presented: a credential was presented (a failure to count against the source address).
    """

    identity: Identity | None
    subprotocol: str | None = None
    presented: bool = False


def http_identity(
    store: TokenStore,
    *,
    authorization: str | Sequence[str] | None,
    ws_protocols: str | Sequence[str] | None = None,
    now: datetime | None = None,
) -> HttpAuth:
    """Check a request's credentials: the ``Authorization`` header, else (WebSocket) the subprotocols.

    Args:
        store: the tokens in force.
        authorization: the ``Authorization`` header value(s), or ``None``.
        ws_protocols: the ``Sec-WebSocket-Protocol`` value(s) of a WebSocket handshake, else ``None``.
        now: the wall-clock instant for expiry (default: the store's clock).
    """
    offer = parse_ws_subprotocols(ws_protocols) if ws_protocols is not None else WsOffer()
    answer = WS_SUBPROTOCOL if offer.acp else None
    presented = authorization is not None or offer.secret is not None or offer.malformed
    if authorization is not None:
        secret = parse_bearer(authorization)
    elif offer.malformed:
        secret = None
    else:
        secret = offer.secret
    identity = store.authenticate(secret, now) if secret is not None else None
    return HttpAuth(identity=identity, subprotocol=answer if identity is not None else None, presented=presented)


def retry_after_seconds(retry_after_ms: int) -> str:
    """The ``Retry-After`` header of a 429 for a ``retryAfterMs`` hint (whole seconds, at least 1)."""
    return str(max(1, math.ceil(retry_after_ms / 1000)))


@dataclass(frozen=True, slots=True)
class ClientView:
    """The client behind a request, as far as the trusted proxies vouch.

    Attributes:
        address: the client's IP address (the peer's when no trusted proxy stands before us).
        scheme: ``http`` or ``https``, as the client used it.
    """

    address: str
    scheme: str


class TrustedProxies:
    """``--trusted-proxy CIDR`` entries: the peers whose ``X-Forwarded-*`` headers are believed.

    Raises:
        ValueError: an entry is not an address or a network (the message names the flag).
    """

    def __init__(self, cidrs: Iterable[str] = ()) -> None:
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in cidrs:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ValueError(
                    f"--trusted-proxy {entry!r}: an IP address or network in CIDR form (e.g. 10.0.0.0/8, ::1/128)"
                ) from None
        self.networks = tuple(networks)

    def trusts(self, address: str) -> bool:
        """Whether ``address`` is one of the trusted proxies."""
        ip = _ip(address.split("%", 1)[0])
        if ip is None:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in self.networks)

    def client(
        self,
        peer: str,
        *,
        scheme: str,
        forwarded_for: str | Sequence[str] | None = None,
        forwarded_proto: str | Sequence[str] | None = None,
    ) -> ClientView:
        """The client of a request that came from ``peer`` over ``scheme``.

        From a trusted peer, ``X-Forwarded-For`` is read from the right, skipping trusted proxies: the
        first address not trusted is the client (an entry that is not an address stops the walk at the
        last good one), and ``X-Forwarded-Proto`` (its last value, ``http`` or ``https``) the scheme.
        From any other peer both headers are ignored.
        """
        if not self.networks or not self.trusts(peer):
            return ClientView(peer, scheme)
        client = peer
        if forwarded_for is not None:
            joined = forwarded_for if isinstance(forwarded_for, str) else ",".join(forwarded_for)
            for hop in reversed([h.strip() for h in joined.split(",")]):
                if _ip(hop.split("%", 1)[0]) is None:
                    break
                client = hop
                if not self.trusts(hop):
                    break
        if forwarded_proto is not None:
            joined = forwarded_proto if isinstance(forwarded_proto, str) else ",".join(forwarded_proto)
            proto = joined.split(",")[-1].strip().lower()
            if proto in ("http", "https"):
                scheme = proto
        return ClientView(client, scheme)
