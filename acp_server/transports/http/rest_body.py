"""How a REST route reads its request: the body's bytes (415, then 413), decoded (400 ``parse_error``),
as the route's type (400 ``invalid_params``), and the ``X-Qwen-Client-Id`` header's client id (400 for
one of another syntax), in the order the API checks them (see :mod:`.rest`). :class:`RestBodies` is
the part of :class:`~.rest.RestApi` that does it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from ...errors import InvalidParamsError, MessageTooLargeError, ParseError, UnsupportedMediaTypeError
from .lean import LeanStream
from .rest_types import PromptRequest
from .rules import header

if TYPE_CHECKING:
    from .streams import Receive

__all__ = ["CLIENT_HEADER", "NO_BODY", "RestBodies"]

CLIENT_HEADER = b"x-qwen-client-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_decoder = msgspec.json.Decoder()
#: client id headers of the right syntax seen already, as their value (a client sends its own on every
#: request: the same ``str`` for each, whose hash the bridge's lookups then find made); cleared when full
_client_ids: dict[bytes, str] = {}
_CLIENT_IDS_KEPT = 1024


class ClientGone(Exception):
    """The client left while its request body was being read."""


#: What :meth:`RestBodies._body` returns for a request without a body (JSON ``null`` is a body).
NO_BODY: Any = object()


def _parse(raw: Any) -> Any:
    """A body's bytes decoded (:data:`NO_BODY` as it is); 400 ``parse_error``."""
    if raw is NO_BODY:
        return raw
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ParseError(detail=str(exc)) from None


#: the bodies :meth:`RestBodies._typed_body` decodes straight into their type
_typed_decoders = {PromptRequest: msgspec.json.Decoder(PromptRequest)}


def _typed(raw: Any, kind: type[Any]) -> Any:
    """A body's bytes (or :data:`NO_BODY`) as ``kind``: :func:`_parse` then :func:`_convert`, in one
    decoding when it is valid."""
    if raw is not NO_BODY:
        try:
            return _typed_decoders[kind].decode(raw)
        except msgspec.DecodeError:
            pass  # decoded again as _parse would, for its errors in their order (400 parse_error first)
    return _convert(_parse(raw), kind)


def _convert(obj: Any, kind: type[Any]) -> Any:
    try:
        return msgspec.convert({} if obj is NO_BODY else obj, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else "body"
        raise InvalidParamsError(path=path, detail=text) from None


class RestBodies:
    """A REST route's reading of its request's body and client id (see the module docstring); the
    largest body taken is :attr:`max_message_bytes` (413 past it)."""

    max_message_bytes: int

    async def _body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> Any:
        """The decoded JSON body (:data:`NO_BODY` when there is none); 415, 413, 400 ``parse_error`` in order."""
        return _parse(await self._raw_body(headers, receive))

    async def _typed_body(self, headers: list[tuple[bytes, bytes]], receive: Receive, kind: type[Any]) -> Any:
        """The body as ``kind``: :meth:`_body` then :func:`_convert`, in one decoding when it is valid."""
        stream = getattr(receive, "__self__", None)
        whole = stream.body_nowait() if type(stream) is LeanStream else None
        return _typed(self._checked_body(headers, whole) if whole is not None else await self._raw_body(headers, receive), kind)

    async def _raw_body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> Any:
        """The body's bytes (:data:`NO_BODY` when there is none); 415 and 413 in order."""
        stream = getattr(receive, "__self__", None)
        if type(stream) is LeanStream:
            whole = stream.body_nowait()
            if whole is not None:  # (all in already: taken without a message or a coroutine per part)
                return self._checked_body(headers, whole)
        limit = self.max_message_bytes
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            body += message.get("body", b"")
            if len(body) > limit:
                break
            if not message.get("more_body", False):
                break
        return self._checked_body(headers, body)

    def _checked_body(
        self, headers: list[tuple[bytes, bytes]], body: bytes | bytearray, fields: dict[bytes, bytes] | None = None
    ) -> Any:
        """:meth:`_raw_body`'s checks of the body read (415, then 413); ``fields``: the headers' first
        values by name (``SimpleRequest.fields``), whose usual content type is read there."""
        limit = self.max_message_bytes
        if body and fields is not None and fields.get(b"content-type") == b"application/json":
            if len(body) > limit:
                raise MessageTooLargeError(limit=limit)
            return body
        if not body:
            declared = header(headers, b"content-length")
            if not (declared and declared.strip() not in ("", "0")):
                return NO_BODY
        content_type = header(headers, b"content-type")
        if content_type != "application/json" and (
            content_type is None or content_type.split(";")[0].strip().lower() != "application/json"
        ):
            raise UnsupportedMediaTypeError(content_type=(content_type or "")[:128])
        if len(body) > limit:
            raise MessageTooLargeError(limit=limit)
        return body

    @staticmethod
    def _client_id(headers: list[tuple[bytes, bytes]], fields: dict[bytes, bytes] | None = None) -> str | None:
        """The ``X-Qwen-Client-Id`` header's client id (its first; ``None``: none), 400 for one of another
        syntax; ``fields``: the headers' first values by name, read instead of the headers."""
        if fields is not None:
            raw = fields.get(CLIENT_HEADER)
        else:
            raw = None
            for name, value in headers:
                if name == CLIENT_HEADER:
                    raw = value
                    break
        if raw is None:
            return None
        client_id = _client_ids.get(raw)
        if client_id is not None:
            return client_id
        client_id = raw.decode("latin-1")
        if not _CLIENT_ID.fullmatch(client_id):
            raise InvalidParamsError(path="X-Qwen-Client-Id", detail="must match [A-Za-z0-9._:-]{1,128}")
        if len(_client_ids) >= _CLIENT_IDS_KEPT:
            _client_ids.clear()
        _client_ids[bytes(raw)] = client_id
        return client_id
