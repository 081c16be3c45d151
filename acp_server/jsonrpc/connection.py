"""The sans-I/O JSON-RPC 2.0 connection: bytes in, events out; messages in, bytes out.

Modelled on h11's ``Connection``: :meth:`Connection.receive_data` feeds bytes, :meth:`Connection.next_event`
returns one event at a time (or :data:`NEED_DATA`), and the ``send_*`` methods return the bytes to
write. It allocates ids for our own requests to the peer and keeps the table of those still pending,
so responses are routed by id; a response to an id we never sent is logged and dropped. It never
touches a socket and imports no event loop, so plain synchronous tests drive it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec
from msgspec import UNSET, UnsetType

from ..errors import AcpError, InvalidRequestError, MessageTooLargeError
from ..logtext import clip
from .framing import TOO_LARGE, LineBuffer
from .guard import DecodeFailure, decode_failure, error_of, safe_decode, scan_top_level

__all__ = [
    "NEED_DATA",
    "Batch",
    "Connection",
    "EncodedError",
    "ErrorReply",
    "Event",
    "Notification",
    "Request",
    "Response",
    "TooLarge",
    "encode_error",
    "encode_result",
]

log = logging.getLogger("acp_server.jsonrpc")

Id = int | str


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


class Request(msgspec.Struct, eq=False):
    """A request from the peer; ``params`` is undecoded until the method (and so its type) is known.

    A Struct (built by C code, one per request on the hot path), compared by identity.
    """

    id: Id
    method: str
    params: msgspec.Raw | None

    def __repr__(self) -> str:
        return f"Request(id={self.id!r}, method={self.method!r})"


class Notification(msgspec.Struct, eq=False):
    """A notification from the peer; ``params`` undecoded, as a request's."""

    method: str
    params: msgspec.Raw | None

    def __repr__(self) -> str:
        return f"Notification(method={self.method!r})"


class Response(msgspec.Struct, eq=False):
    """The peer's answer to one of our requests; ``method`` is the method we called.

    ``malformed`` is set (with ``error`` filled in for callers that only look there) when the answer
    carried our id but was not a valid JSON-RPC 2.0 response.
    """

    id: Id
    method: str
    result: Any
    error: dict[str, Any] | None
    malformed: str | None = None

    def __repr__(self) -> str:
        return f"Response(id={self.id!r}, method={self.method!r}, error={self.error is not None})"


class ErrorReply(msgspec.Struct, eq=False):
    """A message that could not be taken: ``data`` is the ready-made error response to send."""

    data: bytes
    error: AcpError


class TooLarge(msgspec.Struct, eq=False):
    """A line over the limit; ``data`` is the error response to send before closing the connection."""

    data: bytes
    limit: int


class Batch(msgspec.Struct, eq=False):
    """A JSON-RPC batch: its items, each a Request, Notification, Response or ErrorReply."""

    items: list[Request | Notification | Response | ErrorReply]


Event = Request | Notification | Response | ErrorReply | TooLarge | Batch


class _Envelope(msgspec.Struct):
    jsonrpc: str | UnsetType = UNSET
    id: int | str | None | UnsetType = UNSET
    method: str | UnsetType = UNSET
    params: msgspec.Raw = msgspec.Raw(b"")
    result: msgspec.Raw = msgspec.Raw(b"")
    error: dict[str, Any] | None | UnsetType = UNSET


class _ResultMsg(msgspec.Struct):
    jsonrpc: str
    id: Id | None
    result: Any


class _RequestMsg(msgspec.Struct, omit_defaults=True):
    jsonrpc: str
    id: Id
    method: str
    params: Any = None


class _ErrorObject(msgspec.Struct):
    code: int
    message: str
    data: Any


class _ErrorMsg(msgspec.Struct):
    """Field for field the dict of jsonrpcserver's ``serialize_error(ErrorResponse(...))`` (a test
    holds the bytes equal), without building the dicts: a refusal is on the hot path under overload."""

    jsonrpc: str
    error: _ErrorObject
    id: Id | None


class _NotificationMsg(msgspec.Struct, omit_defaults=True):
    jsonrpc: str
    method: str
    params: Any = None


_OBJECT, _ARRAY, _NULL = b"{[n"
_encoder = msgspec.json.Encoder()
_decode_envelope = msgspec.json.Decoder(_Envelope).decode
_decode_batch = msgspec.json.Decoder(list[msgspec.Raw]).decode


class EncodedError(bytes):
    """An error response ready to write that still carries its :class:`~acp_server.errors.AcpError`.

    It is ``bytes`` everywhere; a transport that wants to treat some errors apart (time refusals,
    count kinds) checks ``type(data) is not bytes`` and reads ``error``, with no cost on the path
    of results. Build one with :meth:`of`.
    """

    error: AcpError

    @classmethod
    def of(cls, id: Id | None, error: AcpError) -> EncodedError:
        """The response :func:`encode_error` writes, keeping ``error``."""
        data = cls(encode_error(id, error))
        data.error = error  # set here rather than in a Python __new__: half the cost
        return data


def encode_result(id: Id | None, result: Any) -> bytes:
    """One success response, newline-terminated."""
    return _encoder.encode(_ResultMsg("2.0", id, result)) + b"\n"


def encode_error(id: Id | None, error: AcpError) -> bytes:
    """One error response, newline-terminated (``data`` always carries ``errorKind``).

    The shape of jsonrpcserver's ``serialize_error(ErrorResponse(...))``; msgspec encodes the payload Struct.
    """
    return _encoder.encode(_ErrorMsg("2.0", _ErrorObject(error.code, error.message, error.payload), id)) + b"\n"


class Connection:
    """One side of a JSON-RPC 2.0 connection over NDJSON.

    Args:
        max_message_bytes: the largest line accepted from the peer.
    """

    def __init__(self, *, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._lines = LineBuffer(max_message_bytes)
        self._next_id = 1
        self._pending: dict[Id, str] = {}

    # --- receiving ---------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> None:
        """Feed bytes read from the peer."""
        self._lines.feed(data)

    @property
    def buffered_bytes(self) -> int:
        return self._lines.buffered

    def next_event(self) -> Event | _NeedData:
        """The next event from the bytes received so far, or :data:`NEED_DATA`."""
        while True:
            line = self._lines.next_line()
            if line is None:
                return NEED_DATA
            if line is TOO_LARGE:
                err = MessageTooLargeError(limit=self.max_message_bytes)
                return TooLarge(encode_error(None, err), self.max_message_bytes)
            assert isinstance(line, bytes)
            stripped = line.strip()
            if not stripped:
                continue  # blank lines (and a lone "\r") are keep-alives, not messages
            if stripped[:1] == b"[":
                return self._batch(stripped)
            event = self._one(stripped)
            if event is not None:
                return event

    def receive(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes read from the peer and return the events of every line they complete, in order.

        The same events :meth:`next_event` returns one by one, for all the lines of one read at once;
        a :data:`TooLarge` ends the list (the connection is to close). A line is decoded as a single
        message first: blank lines, batches and errors take the general path after that fails.
        """
        events: list[Event] = []
        for line in self._lines.lines(data):
            if type(line) is not bytes:  # TOO_LARGE
                err = MessageTooLargeError(limit=self.max_message_bytes)
                events.append(TooLarge(encode_error(None, err), self.max_message_bytes))
                return events
            try:
                env = _decode_envelope(line)
            except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
                stripped = line.strip()
                if not stripped:
                    continue
                event = self._batch(stripped) if stripped[:1] == b"[" else self._one(stripped)
            else:
                event = self._message(env)
            if event is not None:
                events.append(event)
        return events

    def _batch(self, line: bytes) -> Event:
        try:
            parts: list[bytes] = [bytes(raw) for raw in _decode_batch(line)]
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
            # One item cannot be decoded (too deep, a lone surrogate): split the array by the scan, so
            # that every other item is taken and the broken one is answered with its own id.
            scanned = scan_top_level(line)
            if scanned is None or not scanned[1] or not scanned[0]:
                return self._reply(None, error_of(exc, line))
            parts = [line[start:end].strip() for start, end in scanned[0]]
        if not parts:
            return self._reply(None, InvalidRequestError(detail="an empty batch is not a request"))
        items = [self._one(part) for part in parts]
        return Batch([item for item in items if item is not None])

    def _reply(self, id: Id | None, error: AcpError) -> ErrorReply:
        return ErrorReply(encode_error(id, error), error)

    def _one(self, line: bytes) -> Request | Notification | Response | ErrorReply | None:
        """Decode one message; ``None`` for a response that is logged and dropped."""
        try:
            env = _decode_envelope(line)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
            return self._undecodable(line, exc)
        return self._message(env)

    def _message(self, env: _Envelope) -> Request | Notification | Response | ErrorReply | None:
        """The event of one decoded message; ``None`` for a response that is logged and dropped."""
        method = env.method
        if method is not UNSET and env.jsonrpc == "2.0":
            # A request or a notification.
            params = env.params
            if not params:
                params_raw = None
            else:
                first = memoryview(params)[0]  # a byte as an int: no allocation
                if first == _OBJECT or first == _ARRAY:
                    params_raw = params
                elif first == _NULL:
                    params_raw = None
                else:
                    id = env.id
                    return self._reply(
                        None if id is UNSET else id,
                        InvalidRequestError(detail='"params" must be an object, an array or null'),
                    )
            id = env.id
            if id is UNSET:
                return Notification(method, params_raw)
            if id is None:
                return self._reply(None, InvalidRequestError(detail='"id" must not be null in a request'))
            return Request(id, method, params_raw)
        id = env.id
        if method is UNSET and id is not UNSET and id is not None and id in self._pending and env.jsonrpc != "2.0":
            # A malformed answer to one of our own requests still settles it, as an error.
            why = '"jsonrpc" must be "2.0"'
            return Response(id, self._pending.pop(id), None, {"code": -32600, "message": f"malformed response: {why}"}, why)
        if env.jsonrpc != "2.0":
            return self._reply(
                None if id is UNSET else id, InvalidRequestError(detail='"jsonrpc" must be "2.0"')
            )
        # From here on, a response (a request whose "jsonrpc" is wrong was answered just above).
        if id is UNSET or id is None or (not env.result and env.error is UNSET):
            if id is None and env.error is not UNSET:
                # The peer could not parse something we sent; nothing to route it to.
                log.warning("peer reported an error without an id: %s", clip(env.error))
                return None
            return self._reply(
                None if id is UNSET else id,
                InvalidRequestError(detail='a message needs "method" (a request) or "result"/"error" (a response)'),
            )
        method_called = self._pending.pop(id, None)
        if method_called is None:
            log.warning("dropping a response to unknown request id %s", clip(id))
            return None
        error = None if env.error is UNSET else env.error
        result = safe_decode(env.result) if env.result else None
        if isinstance(result, DecodeFailure):
            return _malformed_response(id, method_called, result.error)
        return Response(id, method_called, result, error)

    def _undecodable(self, line: bytes, exc: Exception) -> ErrorReply | Response:
        """A line that did not decode: the error, addressed to the id the scan finds; an answer to one
        of our own requests settles it, as a malformed response."""
        failure = decode_failure(line, exc)
        id = failure.id
        if not failure.has_method and id is not None and id in self._pending:
            return _malformed_response(id, self._pending.pop(id), failure.error)
        return self._reply(id, failure.error)

    # --- sending -----------------------------------------------------------------------------------

    def send_request(self, method: str, params: Any = None) -> tuple[Id, bytes]:
        """Allocate an id for our own request and return it with the bytes to write."""
        id = self._next_id
        self._next_id += 1
        self._pending[id] = method
        return id, _encoder.encode(_RequestMsg("2.0", id, method, params)) + b"\n"

    def send_failed(self, id: Id) -> None:
        """Forget a request of ours that will get no response (it could not be written)."""
        self._pending.pop(id, None)

    @property
    def pending_requests(self) -> dict[Id, str]:
        """Our requests still waiting for a response: id -> method."""
        return dict(self._pending)

    @staticmethod
    def send_notification(method: str, params: Any = None) -> bytes:
        return _encoder.encode(_NotificationMsg("2.0", method, params)) + b"\n"

    send_result = staticmethod(encode_result)
    send_error = staticmethod(encode_error)


def _malformed_response(id: Id, method: str, error: AcpError) -> Response:
    why = str(error)
    return Response(id, method, None, {"code": error.code, "message": f"malformed response: {why}"}, why)
