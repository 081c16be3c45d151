"""Decoding that fails only with a structured error, and the scan that addresses it.

msgspec has no depth option and recurses even while it skips a ``msgspec.Raw`` value, so a line nested
some thousand levels deep raises ``RecursionError`` (how deep depends on the stack of the caller). Every
place that decodes peer input catches it with the decode errors and turns all of them into one
:class:`DecodeFailure`: ``parse_error`` for text that is not UTF-8 JSON, ``invalid_request`` for JSON of
the wrong shape or nested too deep (``data.maxDepth`` is :data:`MAX_DEPTH`, a nesting that decodes at
any call site).

The error should reach the request it is about, so the failure path runs :func:`scan_top_level`, a
bounded tokenizer that finds the members of the top-level object or array without building anything
nested: the request's ``id`` and whether it has a ``method`` are then read from their own small spans.
The scan runs only after a decode failed, never on lines that decode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from ..errors import AcpError, InvalidRequestError, ParseError

__all__ = [
    "MAX_DEPTH",
    "DecodeFailure",
    "decode_failure",
    "nesting_error",
    "safe_decode",
    "scan_top_level",
]

T = TypeVar("T")

#: A nesting depth of arrays and objects that every decoding site accepts (msgspec's own limit is
#: the interpreter's recursion limit less the caller's stack, about 950 from a connection's reader).
MAX_DEPTH: Final = 500

#: At most this many tokens are scanned to address an error (runs of brackets count as one token),
#: so a hostile line costs a bounded time; an id past that point is not found.
SCAN_TOKENS: Final = 20_000

_decode_any = msgspec.json.Decoder().decode

# A string (unterminated at the end of a truncated line too), a run of openers, a run of closers, or
# a run of anything else (numbers, literals, separators, white space).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[{]+|[\]}]+|[^"\[\]{}]+')
_KEY = re.compile(rb'\s*("[^"\\]*(?:\\.[^"\\]*)*")\s*:')
_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
_OPEN, _CLOSE, _QUOTE = frozenset(b"[{"), frozenset(b"]}"), ord('"')


class DecodeFailure:
    """Why a peer's message (or part of one) could not be decoded, and what the scan found.

    Attributes:
        error: ``parse_error`` or ``invalid_request``, ready to send.
        id: the message's ``id`` when it could be read (an int or a string), else ``None``.
        has_method: the message has a ``method`` member (a request or a notification, not a response).
    """

    __slots__ = ("error", "has_method", "id")

    def __init__(self, error: AcpError, id: int | str | None = None, has_method: bool = False) -> None:
        self.error = error
        self.id = id
        self.has_method = has_method

    def __repr__(self) -> str:
        return f"DecodeFailure({self.error.kind}, id={self.id!r})"


def nesting_error() -> InvalidRequestError:
    """``invalid_request`` for a message nested deeper than msgspec can decode."""
    return InvalidRequestError(
        detail=f"nesting too deep: arrays and objects may nest at most {MAX_DEPTH} levels", max_depth=MAX_DEPTH
    )


def error_of(exc: Exception, data: bytes | None = None) -> AcpError:
    """The structured error for a decode failure (``RecursionError``, msgspec's ``DecodeError`` or
    ``ValidationError``); ``data``, when given, lets a lone surrogate escape be named as such."""
    if isinstance(exc, RecursionError):
        return nesting_error()
    detail = str(exc).split("\n", 1)[0][:200]
    if isinstance(exc, msgspec.ValidationError):
        return InvalidRequestError(detail=detail)
    if data is not None and detail == "Input data was truncated" and _SURROGATE.search(data):
        # msgspec reports an unpaired UTF-16 surrogate escape (\ud800) as truncation
        detail = "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); it is not valid UTF-8 text"
    return ParseError(detail=detail)


def decode_failure(line: bytes, exc: Exception) -> DecodeFailure:
    """The failure of decoding ``line`` as one message, addressed by the id the scan finds."""
    failure = DecodeFailure(error_of(exc, line))
    scanned = scan_top_level(line)
    if scanned is None or line.lstrip()[:1] != b"{":
        return failure
    for start, end in scanned[0]:
        key = _KEY.match(line, start, end)
        if key is None:
            continue
        name = key.group(1)
        if name == b'"method"':
            failure.has_method = True
        elif name == b'"id"':
            value = _small_value(line[key.end() : end])
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                failure.id = value
    return failure


def _small_value(data: bytes) -> Any:
    try:
        return _decode_any(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def scan_top_level(line: bytes, max_tokens: int = SCAN_TOKENS) -> tuple[list[tuple[int, int]], bool] | None:
    """The ``(start, end)`` spans of the members of the object or array that ``line`` holds, and whether
    its closing bracket was found.

    An object's members are ``"key": value`` spans, an array's its items; nested values are skipped
    without being parsed. A line that ends early (truncated, or past ``max_tokens``) gets its last
    span cut at the end. ``None`` when the line does not start with ``{`` or ``[``.
    """
    depth = 0
    start = 0
    spans: list[tuple[int, int]] = []
    for count, m in enumerate(_TOKEN.finditer(line)):
        if count >= max_tokens:
            break
        tok = m.group()
        first = tok[0]
        if first in _OPEN:
            if depth == 0:
                start = m.start() + 1
            depth += len(tok)
        elif first in _CLOSE:
            if depth <= len(tok):
                end = m.start() + depth - 1  # the bracket that closes the top level
                if line[start:end].strip():
                    spans.append((start, end))
                return spans, True
            depth -= len(tok)
        elif depth == 0:
            if first == _QUOTE or tok.strip():
                return None  # a scalar, not a container
        elif depth == 1 and first != _QUOTE:
            base = m.start()
            comma = tok.find(b",")
            while comma >= 0:
                spans.append((start, base + comma))
                start = base + comma + 1
                comma = tok.find(b",", comma + 1)
    if depth == 0:
        return None
    if line[start:].strip():
        spans.append((start, len(line)))
    return spans, False


def safe_decode(data: bytes, decode: Callable[[bytes], T] | None = None) -> T | DecodeFailure:
    """``decode(data)`` (default: any JSON value), or a :class:`DecodeFailure` instead of any decode
    exception, ``RecursionError`` included. Nothing is scanned: the caller knows what ``data`` is."""
    try:
        if decode is None:
            return _decode_any(data)  # type: ignore[no-any-return]
        return decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        return DecodeFailure(error_of(exc, data))
