"""The pure rules of ``/acp``: what a request may be, what a message is, and the answer's shape.

No I/O here: the ASGI app asks these functions and obeys. Each check returns the
:class:`~acp_server.errors.HttpError` that refuses the request (or ``None``), so the order of checks
the RFD's server keeps (route and method, Host and Origin, content type, size, JSON, batch, connection
id, session id) is written once, in :mod:`.app`, and each rule is testable without a network.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...errors import (
    AcpError,
    BatchNotSupportedError,
    ForbiddenHostError,
    ForbiddenOriginError,
    HttpError,
    InvalidRequestError,
    NotAcceptableError,
    ParseError,
    UnsupportedMediaTypeError,
)

__all__ = [
    "ACP_PATH",
    "CONNECTION_HEADER",
    "ESTABLISHING_METHODS",
    "HEALTH_PATH",
    "SESSION_HEADER",
    "SESSION_SCOPED_METHODS",
    "Envelope",
    "HostRules",
    "decode_inbound",
    "decode_outbound",
    "error_body",
    "header",
    "sse_frame",
]

ACP_PATH = "/acp"
HEALTH_PATH = "/health"
CONNECTION_HEADER = "Acp-Connection-Id"
SESSION_HEADER = "Acp-Session-Id"
#: Methods that act on a session already established on the connection: their POST names it in
#: ``Acp-Session-Id`` and their answers go on that session's stream (as the SDK's server routes them).
SESSION_SCOPED_METHODS = frozenset(
    {"session/prompt", "session/cancel", "session/set_mode", "session/set_config_option", "session/close"}
)
#: Methods whose success establishes a session on the connection; their answers go on the
#: connection stream (the client has no session stream open yet).
ESTABLISHING_METHODS = frozenset({"session/new", "session/load", "session/resume", "_acp_server/fork"})
#: Methods whose session is the one in the result (``session/new``) or a new one (a fork's).
RESULT_SESSION_METHODS = frozenset({"session/new", "_acp_server/fork"})


class _SessionRef(msgspec.Struct):
    sessionId: Any = None  # noqa: N815 - the wire name


_NULL = msgspec.Raw(b"null")


class Envelope(msgspec.Struct):
    """What routing needs of one JSON-RPC message; every other field is skipped unread.

    ``params`` and ``result`` stay raw JSON (``null`` when absent) and are decoded only as far as
    their ``sessionId``, when routing asks.
    """

    id: Any = msgspec.UNSET
    method: Any = None
    params: msgspec.Raw = _NULL
    result: msgspec.Raw = _NULL

    @property
    def is_request(self) -> bool:
        return self.id is not msgspec.UNSET and isinstance(self.method, str)

    @property
    def is_response(self) -> bool:
        return self.id is not msgspec.UNSET and self.method is None

    def params_session(self) -> str | None:
        return _session_in(self.params)

    def result_session(self) -> str | None:
        return _session_in(self.result)


_decode_envelope = msgspec.json.Decoder(Envelope).decode
_decode_ref = msgspec.json.Decoder(_SessionRef).decode
_decode_any = msgspec.json.Decoder().decode


def _session_in(raw: msgspec.Raw) -> str | None:
    if bytes(raw)[:1] != b"{":
        return None
    try:
        sid = _decode_ref(raw).sessionId
    except msgspec.DecodeError:
        return None
    return sid if isinstance(sid, str) else None


def decode_outbound(line: bytes) -> Envelope | None:
    """The envelope of a message the server sends (``None``: not a JSON object, e.g. a batch reply)."""
    try:
        return _decode_envelope(line)
    except msgspec.DecodeError:
        return None


def decode_inbound(body: bytes) -> Envelope:
    """The envelope of a POSTed message, or the error that refuses it.

    Raises:
        ParseError: not JSON (400 ``parse_error``).
        BatchNotSupportedError: a JSON array (501).
        InvalidRequestError: JSON, but not an object (400).
    """
    stripped = body.lstrip()
    if stripped[:1] == b"[":
        try:
            _decode_any(body)
        except msgspec.DecodeError as exc:
            raise ParseError(detail=str(exc)) from None
        raise BatchNotSupportedError()
    try:
        return _decode_envelope(body)
    except msgspec.ValidationError:
        raise InvalidRequestError(detail="a JSON-RPC message is a JSON object") from None
    except msgspec.DecodeError as exc:
        raise ParseError(detail=str(exc)) from None


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), decoded as latin-1; ``None`` if absent."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def error_body(exc: AcpError) -> bytes:
    """``{"error": message, "code": errorKind, ...data}``: the body of every non-2xx answer."""
    fields = msgspec.to_builtins(exc.payload)
    kind = fields.pop("errorKind", exc.kind)
    return msgspec.json.encode({"error": str(exc.message), "code": kind, **fields})


def sse_frame(lines: Sequence[bytes]) -> bytes:
    """One SSE ``data:`` event per JSON-RPC message (a message never holds a raw newline)."""
    return b"".join(b"data: " + line + b"\n\n" for line in lines)


def check_content_type(content_type: str | None) -> HttpError | None:
    """415 unless the POST says ``application/json`` (parameters such as ``charset`` allowed)."""
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json":
        return None
    return UnsupportedMediaTypeError(content_type=content_type or "")


def check_accept(accept: str | None) -> HttpError | None:
    """406 unless a GET accepts ``text/event-stream``."""
    if accept is not None:
        for part in accept.split(","):
            if part.split(";", 1)[0].strip().lower() in ("text/event-stream", "*/*", "text/*"):
                return None
    return NotAcceptableError(accept=accept or "")


@dataclass
class HostRules:
    """Who may talk to a listener: ``Host`` against DNS rebinding, ``Origin`` against cross-site use.

    A ``Host`` is accepted when it names a loopback name or the bound address (with the bound port,
    when it has one), or an ``--http-allow-host`` name (with any port: a reverse proxy presents its
    own). An ``Origin`` is accepted when it is the page's own (``scheme://Host`` of the request, or a
    loopback origin of this port), an ``--http-allow-origin`` entry (exact strings), or anything when
    that list holds ``*`` (allowed with tokens on only; the command line checks it).

    Args:
        port: the bound port (``None`` on a Unix socket, where any ``Host`` port is accepted).
        bound_host: the address bound, as a ``Host`` header would spell it (``[::1]``, ``127.0.0.1``);
            an unspecified one (``0.0.0.0``, ``[::]``) names nothing a client should send.
        allow_origins: foreign origins allowed besides the listener's own (exact strings; ``*``: any).
        allow_hosts: ``--http-allow-host`` names (lower case, IPv6 in brackets, no port).
        scheme: ``http`` or ``https``: the listener's own.
    """

    port: int | None
    bound_host: str = "127.0.0.1"
    allow_origins: frozenset[str] = field(default_factory=frozenset)
    allow_hosts: frozenset[str] = field(default_factory=frozenset)
    scheme: str = "http"
    #: ``Host`` values accepted so far (at most 64 kept): the check is a set lookup after the first
    _accepted: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def _bound_names(self) -> set[str]:
        names = {"127.0.0.1", "localhost", "[::1]"}
        bound = self.bound_host.lower()
        if bound not in ("0.0.0.0", "[::]", "::"):
            names.add(bound)
        return names

    def own_origins(self) -> set[str]:
        if self.port is None:
            return {f"{self.scheme}://{h}" for h in ("127.0.0.1", "localhost", "[::1]")}
        return {f"{self.scheme}://{h}:{self.port}" for h in self._bound_names()}

    def check_host(self, host: str | None) -> HttpError | None:
        """403 unless ``Host`` names this server: a loopback name, the bound address, or an allowed name."""
        if host is None:
            return ForbiddenHostError(host="")
        if host in self._accepted:  # a client sends the same Host on every request
            return None
        refusal = self._check_host(host)
        if refusal is None and len(self._accepted) < 64:
            self._accepted.add(host)
        return refusal

    def _check_host(self, host: str) -> HttpError | None:
        name, port = _split_host(host.strip().lower())
        if name in self.allow_hosts and (port is None or (port.isdigit() and 0 < int(port) < 65536)):
            return None
        if name not in self._bound_names():
            return ForbiddenHostError(host=host)
        if port is not None and self.port is not None and port != str(self.port):
            return ForbiddenHostError(host=host)
        return None

    def check_origin(self, origin: str | None, *, host: str | None = None, scheme: str | None = None) -> HttpError | None:
        """403 when an ``Origin`` is sent and is neither ours nor allowed (no ``Origin``: not a browser).

        Args:
            origin: the request's ``Origin``.
            host: its ``Host`` (already accepted by :meth:`check_host`): ``scheme://host`` is the page's own.
            scheme: the request's scheme as the client used it (``http``/``https``; ``ws``/``wss`` count as these).
        """
        if origin is None or self.origin_allowed(origin, host=host, scheme=scheme):
            return None
        return ForbiddenOriginError(origin=origin)

    def origin_allowed(self, origin: str, *, host: str | None = None, scheme: str | None = None) -> bool:
        """Whether ``origin`` may use this listener (``host``, ``scheme``: as for :meth:`check_origin`)."""
        if origin in self.allow_origins or "*" in self.allow_origins or origin.lower() in self.own_origins():
            return True
        if host is None or scheme is None:
            return False
        page = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        return origin.lower() == f"{page}://{host.strip().lower()}"


def _split_host(host: str) -> tuple[str, str | None]:
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host, None
        rest = host[end + 1 :]
        return host[: end + 1], rest[1:] if rest.startswith(":") else None
    name, sep, port = host.partition(":")
    return name, port if sep else None


def cors_headers(
    origin: str | None, rules: HostRules, *, preflight: bool = False, host: str | None = None, scheme: str | None = None
) -> list[tuple[bytes, bytes]]:
    """The CORS answer headers for an allowed ``origin`` (none without one); ``host`` and ``scheme`` as
    for :meth:`HostRules.check_origin`."""
    if origin is None or not rules.origin_allowed(origin, host=host, scheme=scheme):
        return []
    out = [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", b"Acp-Connection-Id, Acp-Session-Id"),
    ]
    if preflight:
        out += [
            (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
            (b"access-control-allow-headers", b"Content-Type, Accept, Authorization, Acp-Connection-Id, Acp-Session-Id, X-Acp-Tenant"),
            (b"access-control-max-age", b"600"),
        ]
    return out
