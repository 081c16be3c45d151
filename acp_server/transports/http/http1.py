"""The HTTP/1.1 wire text :mod:`.lean` reads and writes without h11: a plain request's head (a strict
grammar, heads kept parsed), the scope's method and target, and a response's head (checked with h11's
field grammar, heads kept rendered) with hypercorn's per-response headers.

Clients and apps repeat themselves (the same ``Host``, ``User-Agent`` and route on every request; the
same status and headers on every answer), so each cache here turns most requests into dictionary
lookups; each is bounded and cleared when full.
"""

from __future__ import annotations

import re
from time import time
from typing import Any
from urllib.parse import unquote

__all__ = ["PARTIAL_MAX", "SimpleRequest", "simple_request"]

#: RFC 9110's field-name (a token) and field-value (no control characters but tab), as h11 checks them
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")
#: statuses whose response has no body (and no framing header)
_NO_BODY = frozenset((204, 304))

class _Date:
    """hypercorn's per-response headers (``date``, ``server``, ``alt-svc``), built once per second."""

    __slots__ = ("headers", "key")

    def __init__(self) -> None:
        self.key: tuple[int, int] = (-1, 0)
        self.headers = b""

    def get(self, config: Any) -> bytes:
        key = (int(time()), id(config))
        if key != self.key:
            self.key = key
            self.headers = b"".join(b"%s: %s\r\n" % pair for pair in config.response_headers("h11"))
        return self.headers


_date = _Date()


#: the most heads :data:`_heads` and :data:`_heads_out` keep
_HEADS_KEPT = 512
#: response heads read already (see :func:`_head`), by status and headers; cleared when full
_heads_out: dict[tuple[int, tuple[Any, ...]], tuple[bytes, int]] = {}
#: what :func:`_head` reports of the app's headers
_LENGTH, _CHUNKED, _CONNECTION, _CLOSE = 1, 2, 4, 8


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, int]:
    """The status line and header lines, and which framing and connection headers the app gave
    (:data:`_LENGTH`, ...); raises ``ValueError`` for a header h11 would refuse. An app answers with the
    same few heads again and again: they are read once (:data:`_heads_out`)."""
    key: tuple[int, tuple[Any, ...]] | None = (status, tuple(headers))
    try:
        return _heads_out[key]  # type: ignore[index]
    except KeyError:
        pass
    except TypeError:  # (a header given as a list is read each time)
        key = None
    lines = [b"HTTP/1.1 %d \r\n" % status]
    seen = 0
    for name, value in headers:
        name, value = bytes(name).strip(), bytes(value).strip()
        if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"illegal response header {name!r}: {value!r}")
        lines.append(b"%s: %s\r\n" % (name, value))
        lower = name.lower()
        if lower in _FRAMING:
            seen |= _FRAMING[lower]
            if lower == b"connection" and b"close" in _tokens(value):
                seen |= _CLOSE
    out = b"".join(lines), seen
    if key is not None:
        if len(_heads_out) >= _HEADS_KEPT:
            _heads_out.clear()
        _heads_out[key] = out
    return out


_FRAMING = {b"content-length": _LENGTH, b"transfer-encoding": _CHUNKED, b"connection": _CONNECTION}


def _tokens(value: bytes) -> list[bytes]:
    """A comma-separated header's tokens, lowercased."""
    return [token.strip() for token in value.lower().split(b",")]


#: a request line this module parses itself (any other goes to h11): an upper-case method, a target of
#: visible ASCII, HTTP/1.1
_REQUEST_LINE = re.compile(rb"([A-Z]{1,20}) ([\x21-\x7e]+) HTTP/1\.1")
#: a field line (no obs-fold: a line that starts with a space or tab does not match)
_FIELD_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):([^\x00-\x08\x0a-\x1f\x7f]*)")
#: headers that send a request to h11 (its framing or its protocol is not a plain request's)
_NOT_PLAIN = frozenset((b"transfer-encoding", b"upgrade", b"expect", b"http2-settings"))
#: the largest plain request kept whole while its body comes in (a larger one goes to h11, which streams it)
PARTIAL_MAX = 64 * 1024


class SimpleRequest:
    """A whole plain request, read at once (see :func:`simple_request`)."""

    __slots__ = ("body", "fields", "headers", "keep_alive", "method", "missing", "target")

    def __init__(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool, missing: int,
        fields: dict[bytes, bytes] | None = None,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        #: the bytes of the body not in yet
        self.missing = missing
        #: each header's first value by its (lower-case) name, as ``rules.header`` finds it: one lookup
        #: instead of a walk of the headers (shared by the requests of the same head: never written)
        self.fields = fields if fields is not None else dict(reversed(headers))


#: a plain request's head, as :func:`_parse_head` reads it: method, target, headers, ``Content-Length``
#: (-1: none), whether the connection may be kept alive, and each header's first value by its name
_Head = tuple[bytes, bytes, tuple[tuple[bytes, bytes], ...], int, bool, dict[bytes, bytes]]
#: heads parsed already (``None``: not plain): a client sends the same head again and again (its
#: ``Host``, its ``User-Agent``, a session's route, a body of the same length), so that most heads are a
#: dictionary lookup; cleared when full
_heads: dict[bytes, _Head | None] = {}
#: the longest head kept there
_HEAD_KEPT_BYTES = 2048


def _parse_head(head: bytes) -> _Head | None:
    """A request's head (without its blank line) if it is plain (see :func:`simple_request`), else ``None``."""
    lines = head.split(b"\r\n")
    first = _REQUEST_LINE.fullmatch(lines[0])
    if first is None or first[1] == b"HEAD":
        return None
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length = -1
    keep_alive = True
    for line in lines[1:]:
        field = _FIELD_LINE.fullmatch(line)
        if field is None:
            return None
        name = field[1].lower()
        value = field[2].strip(b" \t")
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 18:
                return None
            length = int(value)
        elif name in _NOT_PLAIN:
            return None
        elif name == b"connection" and b"close" in _tokens(value):
            keep_alive = False
        headers.append((name, value))
    if hosts != 1:
        return None
    return first[1], first[2], tuple(headers), length, keep_alive, dict(reversed(headers))


def simple_request(data: bytes, limit: int) -> SimpleRequest | None:
    """``data`` as one plain HTTP/1.1 request, exactly, or its beginning when what is missing is the end
    of a body that fits in :data:`PARTIAL_MAX` (``missing`` says how much); ``None``: anything else, left to h11.

    Plain: the request line of :data:`_REQUEST_LINE` (not ``HEAD``), a head within ``limit`` bytes,
    field lines h11's grammar takes, exactly one ``Host``, at most one ``Content-Length`` (digits) and
    no ``Transfer-Encoding``, ``Upgrade``, ``Expect`` or ``HTTP2-Settings``, and nothing after the body
    (a pipelined request goes to h11). Names are lowercased and values stripped, as h11 gives them.
    """
    end = data.find(b"\r\n\r\n", 0, limit)
    if end < 0:
        return None
    head = data[:end]
    try:
        parsed = _heads[head]
    except KeyError:
        parsed = _parse_head(head)
        if end <= _HEAD_KEPT_BYTES:
            if len(_heads) >= _HEADS_KEPT:
                _heads.clear()
            _heads[head] = parsed
    if parsed is None:
        return None
    method, target, headers, length, keep_alive, fields = parsed
    body = data[end + 4:]
    missing = length - len(body)  # (length: -1 without Content-Length)
    if missing < 0 and (length >= 0 or body):
        return None
    if missing > 0 and end + 4 + length > PARTIAL_MAX:
        return None
    return SimpleRequest(method, target, list(headers), body, keep_alive, missing if missing > 0 else 0, fields)


#: a request's method and target as its scope gives them (:func:`_target`), by method and target:
#: a client asks the same few again and again; cleared when full
_targets: dict[tuple[bytes, bytes], tuple[str, str, bytes, bytes]] = {}


def _target(method: bytes, target: bytes) -> tuple[str, str, bytes, bytes]:
    """The scope's ``method``, ``path`` (percent-decoded), ``raw_path`` and ``query_string`` of a
    request line's method and target (kept in :data:`_targets` when short)."""
    path, _, query_string = target.partition(b"?")
    parts = (method.decode("ascii").upper(), unquote(path.decode("ascii")), path, query_string)
    if len(target) <= _HEAD_KEPT_BYTES:
        if len(_targets) >= _HEADS_KEPT:
            _targets.clear()
        _targets[method, target] = parts
    return parts
