"""Whole reads at once (:meth:`LineBuffer.lines`, :meth:`Connection.receive`) against line by line
(``feed``/``next_line``, ``receive_data``/``next_event``): the same lines and events for any stream,
however it is cut into reads. No event loop."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from acp_server.jsonrpc import NEED_DATA, Connection, LineBuffer

from .test_jsonrpc_framing import drain


def _chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


_pieces = st.sampled_from([b"{}", b"x" * 7, b"y" * 8, b"z" * 9, b"", b"\r", b" ", b"ab\r"])


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(_pieces, max_size=30).map(lambda ps: b"\n".join(ps) + b"\n"),
    cuts=st.lists(st.integers(0, 300), max_size=12),
)
def test_lines_equals_next_line_for_any_chunking(stream: bytes, cuts: list[int]) -> None:
    """``lines`` yields what ``feed`` then ``next_line`` yield, chunk by chunk (the limit of 8 makes some
    lines too large, complete in a chunk or held across chunks), and holds as many bytes after each."""
    one, other = LineBuffer(8), LineBuffer(8)
    for chunk in _chunks(stream, cuts):
        one.feed(chunk)
        assert other.lines(chunk) == drain(one)
        assert other.buffered == one.buffered


_messages = st.sampled_from(
    [
        b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":1}}',
        b' {"jsonrpc":"2.0","method":"n"}\r',
        b'{"jsonrpc":"2.0","id":"s","method":"m","params":[1]}',
        b'[{"jsonrpc":"2.0","id":2,"method":"m"},{"jsonrpc":"2.0","method":"n"},3]',
        b"[]",
        b"",
        b"\r",
        b"{not json",
        b'{"jsonrpc":"1.0","id":3,"method":"m"}',
        b'{"jsonrpc":"2.0","id":4,"method":"m","params":5}',
        b'{"jsonrpc":"2.0","id":1,"result":{"ok":true}}',
        b'{"jsonrpc":"2.0","id":9,"result":null}',
        b'{"jsonrpc":"2.0","id":"x' + b"y" * 80 + b'","method":"m"}',
    ]
)


def _shape(event: Any) -> tuple[Any, ...]:
    """What an event says, comparable across two connections (events have no ``__eq__``)."""
    name = type(event).__name__
    if name == "Batch":
        return (name, tuple(_shape(item) for item in event.items))
    said: list[Any] = [name]
    for field in ("id", "method", "params", "result", "error", "data", "limit", "malformed"):
        value = getattr(event, field, "-")
        if field == "params" and value is not None and value != "-":
            value = bytes(value)
        elif field == "error" and isinstance(value, Exception):
            value = (type(value).__name__, str(value))
        said.append(value)
    return tuple(said)


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(_messages, max_size=20).map(lambda ms: b"\n".join(ms) + b"\n"),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_receive_equals_next_event_for_any_chunking(stream: bytes, cuts: list[int]) -> None:
    """``receive`` returns, read by read, the events ``next_event`` returns one by one: requests,
    notifications, batches, responses to our own requests, errors and a line over the limit (which
    ends the read's events: the connection is to close)."""
    one, other = Connection(max_message_bytes=100), Connection(max_message_bytes=100)
    for conn in (one, other):
        assert conn.send_request("ours")[0] == 1  # the response with id 1 is routed, id 9 is dropped
    for chunk in _chunks(stream, cuts):
        one.receive_data(chunk)
        expected = []
        while (event := one.next_event()) is not NEED_DATA:
            expected.append(event)
            if type(event).__name__ == "TooLarge":
                break
        got = other.receive(chunk)
        assert [_shape(e) for e in got] == [_shape(e) for e in expected]
        if got and type(got[-1]).__name__ == "TooLarge":
            return
