"""Pure tests of the sans-I/O JSON-RPC connection, h11-style: feed bytes, read events, check the bytes
``send_*`` produce. No event loop."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from acp_server.errors import InvalidParamsError, MethodNotFoundError
from acp_server.jsonrpc import (
    NEED_DATA,
    Batch,
    Connection,
    ErrorReply,
    Notification,
    Request,
    Response,
    TooLarge,
    encode_error,
    encode_result,
)

from .helpers import assert_error_valid

_receive_by = {"mode": "next_event"}


@pytest.fixture(autouse=True, params=["next_event", "receive"])
def receive_by(request: pytest.FixtureRequest) -> str:
    """Every test that reads events through :func:`events` runs twice: with ``receive_data`` and
    ``next_event``, and with ``receive``, which returns the events of a whole read at once."""
    _receive_by["mode"] = request.param
    return str(request.param)


def events(conn: Connection, data: bytes = b"") -> list[Any]:
    """Feed ``data`` and return every event it completes."""
    if _receive_by["mode"] == "receive":
        return conn.receive(data)
    if data:
        conn.receive_data(data)
    out: list[Any] = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def one(conn: Connection, data: bytes) -> Any:
    [event] = events(conn, data)
    return event


def wire(data: bytes) -> Any:
    """Parse bytes we produced: exactly one newline-terminated JSON value."""
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    return json.loads(data)


def error_of(event: Any) -> dict[str, Any]:
    """The error response an ErrorReply/TooLarge carries, checked against the schemas."""
    msg = wire(event.data)
    assert msg["jsonrpc"] == "2.0" and "result" not in msg
    assert_error_valid(msg["error"])
    return msg  # type: ignore[no-any-return]


class ConnectionPair:
    """Two connections wired back to back (h11's ``ConnectionPair``): what one sends, the other receives."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.client = Connection(max_message_bytes=limit)
        self.server = Connection(max_message_bytes=limit)

    def to_server(self, data: bytes) -> list[Any]:
        return events(self.server, data)

    def to_client(self, data: bytes) -> list[Any]:
        return events(self.client, data)


@pytest.fixture
def conn() -> Connection:
    return Connection(max_message_bytes=1 << 16)


# --- requests and notifications ---------------------------------------------------------------------


@pytest.mark.parametrize("id", [0, 1, -5, 2**53, "", "abc", "0"])
def test_connection_request_ids(conn: Connection, id: int | str) -> None:
    """Integer ids (0 and negatives included) and string ids (empty included) are taken as they are."""
    ev = one(conn, json.dumps({"jsonrpc": "2.0", "id": id, "method": "m", "params": {"a": 1}}).encode() + b"\n")
    assert isinstance(ev, Request)
    assert ev.id == id and type(ev.id) is type(id)
    assert ev.method == "m"
    assert ev.params is not None and json.loads(bytes(ev.params)) == {"a": 1}


@pytest.mark.parametrize("params", ['"params": null, ', ""])
def test_connection_request_null_or_absent_params(conn: Connection, params: str) -> None:
    """``"params": null`` and no params at all both reach dispatch as ``None``."""
    ev = one(conn, f'{{"jsonrpc": "2.0", {params}"id": 3, "method": "m"}}\n'.encode())
    assert isinstance(ev, Request) and ev.params is None


def test_connection_array_params_are_passed_on(conn: Connection) -> None:
    """By-position params are structurally valid JSON-RPC; dispatch decides whether a method takes them."""
    ev = one(conn, b'{"jsonrpc":"2.0","id":1,"method":"m","params":[1,2]}\n')
    assert isinstance(ev, Request) and ev.params is not None and bytes(ev.params) == b"[1,2]"


def test_connection_notification(conn: Connection) -> None:
    """A message with a method and no id is a notification."""
    ev = one(conn, b'{"jsonrpc":"2.0","method":"session/cancel","params":{"sessionId":"s"}}\n')
    assert isinstance(ev, Notification)
    assert ev.method == "session/cancel"
    assert ev.params is not None and json.loads(bytes(ev.params)) == {"sessionId": "s"}


def test_connection_blank_lines_and_crlf(conn: Connection) -> None:
    """Blank lines, lone CRs and surrounding whitespace are skipped; CRLF-terminated messages parse."""
    evs = events(conn, b'\n\r\n  \n{"jsonrpc":"2.0","id":1,"method":"a"}\r\n\n  {"jsonrpc":"2.0","method":"b"}  \n')
    assert [type(e) for e in evs] == [Request, Notification]


def test_connection_events_wait_for_the_whole_line(conn: Connection) -> None:
    """A message split anywhere only becomes an event once its newline arrives."""
    data = b'{"jsonrpc":"2.0","id":"x","method":"m"}\n'
    for i in range(len(data) - 1):
        assert events(conn, data[i : i + 1]) == []
    assert isinstance(one(conn, data[-1:]), Request)
    assert conn.buffered_bytes == 0


# --- malformed input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "reply_id"),
    [
        (b"{not json", None),
        (b'{"jsonrpc":"2.0","id":1,"method":"m"', 1),
        (b"\xff\xfe\x00\x01", None),
        (b'{"jsonrpc":"2.0","id":1,"method":"\xc3\x28"}', 1),
        (b'{"jsonrpc":"2.0","method":"m","params":{"t":"\\ud800"},"id":"x"}', "x"),
        (b"[", None),
        (b"[1,", None),
    ],
    ids=["garbage", "truncated", "binary", "bad-utf8-in-string", "lone-surrogate", "open-bracket", "truncated-batch"],
)
def test_connection_parse_error(conn: Connection, line: bytes, reply_id: object) -> None:
    """Bytes that are not UTF-8 JSON get -32700 parse_error, addressed to the id when it can be read,
    and the next line still parses."""
    ev = one(conn, line + b"\n")
    assert isinstance(ev, ErrorReply)
    msg = error_of(ev)
    assert msg["id"] == reply_id
    assert msg["error"]["code"] == -32700 and msg["error"]["data"]["errorKind"] == "parse_error"
    assert isinstance(one(conn, b'{"jsonrpc":"2.0","id":1,"method":"m"}\n'), Request)


@pytest.mark.parametrize(
    ("line", "reply_id"),
    [
        (b"42", None),
        (b'"a string"', None),
        (b"null", None),
        (b"true", None),
        (b"{}", None),
        (b'{"jsonrpc":"2.0"}', None),
        (b'{"jsonrpc":"2.0","id":4}', 4),
        (b'{"id":1,"method":"m"}', 1),
        (b'{"jsonrpc":"1.0","id":1,"method":"m"}', 1),
        (b'{"jsonrpc":2.0,"id":1,"method":"m"}', 1),
        (b'{"jsonrpc":"2.0","id":5,"method":7}', 5),
        (b'{"jsonrpc":"2.0","id":"s","method":"m","params":5}', "s"),
        (b'{"jsonrpc":"2.0","method":"m","params":"x"}', None),
        (b'{"jsonrpc":"2.0","id":null,"method":"m"}', None),
        (b'{"jsonrpc":"2.0","id":true,"method":"m"}', None),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"m"}', None),
        (b'{"jsonrpc":"2.0","id":1.0,"method":"m"}', None),
        (b'{"jsonrpc":"2.0","id":{"a":1},"method":"m"}', None),
        (b'{"jsonrpc":"2.0","id":[1],"method":"m"}', None),
    ],
)
def test_connection_invalid_request(conn: Connection, line: bytes, reply_id: Any) -> None:
    """Valid JSON that is not a JSON-RPC 2.0 message gets -32600 invalid_request, addressed to its id
    when one can be read (bool, float, object and array ids cannot: they are answered with id null)."""
    ev = one(conn, line + b"\n")
    assert isinstance(ev, ErrorReply)
    msg = error_of(ev)
    assert msg["id"] == reply_id and type(msg["id"]) is type(reply_id)
    assert msg["error"]["code"] == -32600 and msg["error"]["data"]["errorKind"] == "invalid_request"
    assert ev.error.kind == "invalid_request"


# --- batches ----------------------------------------------------------------------------------------


def test_connection_batch_items(conn: Connection) -> None:
    """A batch becomes one Batch event with one item per message, invalid items as ErrorReplies."""
    ev = one(
        conn,
        b'[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","method":"b"},42,'
        b'{"jsonrpc":"2.0","id":2,"method":"c","params":{}}]\n',
    )
    assert isinstance(ev, Batch)
    assert [type(item) for item in ev.items] == [Request, Notification, ErrorReply, Request]
    bad = ev.items[2]
    assert isinstance(bad, ErrorReply)
    assert error_of(bad)["error"]["data"]["errorKind"] == "invalid_request"


def test_connection_empty_batch_is_one_invalid_request(conn: Connection) -> None:
    """``[]`` is answered by a single -32600 error, not by an array."""
    ev = one(conn, b" [ ] \n")
    assert isinstance(ev, ErrorReply)
    msg = error_of(ev)
    assert msg["id"] is None and msg["error"]["code"] == -32600


def test_connection_batch_of_non_objects(conn: Connection) -> None:
    """``[1,2,3]`` is a batch of three invalid requests (the JSON-RPC 2.0 spec's own example)."""
    ev = one(conn, b"[1,2,3]\n")
    assert isinstance(ev, Batch) and len(ev.items) == 3
    assert all(isinstance(item, ErrorReply) and item.error.code == -32600 for item in ev.items)


def test_connection_batch_with_only_unknown_responses_is_empty(conn: Connection, caplog: pytest.LogCaptureFixture) -> None:
    """Responses in a batch that match nothing we sent are dropped (and logged), leaving nothing to answer."""
    with caplog.at_level(logging.WARNING, logger="acp_server.jsonrpc"):
        ev = one(conn, b'[{"jsonrpc":"2.0","id":99,"result":1}]\n')
    assert isinstance(ev, Batch) and ev.items == []
    assert "unknown request id 99" in caplog.text


# --- our requests to the peer and their responses -------------------------------------------------


def test_connection_send_request_allocates_ids_and_tracks_pending() -> None:
    """Ids are allocated in sequence from 1, the bytes are a valid request, and each is pending until answered."""
    conn = Connection(max_message_bytes=1000)
    id1, data1 = conn.send_request("fs/read_text_file", {"path": "/x"})
    id2, data2 = conn.send_request("session/request_permission")
    assert (id1, id2) == (1, 2)
    assert wire(data1) == {"jsonrpc": "2.0", "id": 1, "method": "fs/read_text_file", "params": {"path": "/x"}}
    assert wire(data2) == {"jsonrpc": "2.0", "id": 2, "method": "session/request_permission"}
    assert conn.pending_requests == {1: "fs/read_text_file", 2: "session/request_permission"}


def test_connection_routes_responses_by_id() -> None:
    """Responses are matched to our requests by id, in any order, and leave the pending table."""
    pair = ConnectionPair()
    id1, req1 = pair.client.send_request("first", {"n": 1})
    id2, req2 = pair.client.send_request("second")
    [r1, r2] = pair.to_server(req1 + req2)
    assert isinstance(r1, Request) and isinstance(r2, Request)
    assert (r1.id, r1.method, r2.id, r2.method) == (id1, "first", id2, "second")

    [resp2] = pair.to_client(pair.server.send_error(r2.id, MethodNotFoundError(method="second")))
    assert isinstance(resp2, Response)
    assert (resp2.id, resp2.method, resp2.result) == (id2, "second", None)
    assert resp2.error is not None and resp2.error["code"] == -32601
    assert resp2.error["data"] == {"errorKind": "method_not_found", "method": "second"}
    assert pair.client.pending_requests == {id1: "first"}

    [resp1] = pair.to_client(pair.server.send_result(r1.id, {"ok": [1, 2]}))
    assert isinstance(resp1, Response)
    assert (resp1.id, resp1.method, resp1.result, resp1.error) == (id1, "first", {"ok": [1, 2]}, None)
    assert pair.client.pending_requests == {}


def test_connection_null_result_is_a_response() -> None:
    """``"result": null`` is a success response carrying None, not a malformed message."""
    pair = ConnectionPair()
    id, _ = pair.client.send_request("m")
    [resp] = pair.to_client(encode_result(id, None))
    assert isinstance(resp, Response) and resp.result is None and resp.error is None


def test_connection_unknown_response_id_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A response to an id we never sent (or already got) is logged and dropped: no event, no reply."""
    conn = Connection(max_message_bytes=1000)
    id, _ = conn.send_request("m")
    with caplog.at_level(logging.WARNING, logger="acp_server.jsonrpc"):
        assert events(conn, b'{"jsonrpc":"2.0","id":77,"result":{}}\n') == []
        assert events(conn, b'{"jsonrpc":"2.0","id":"1","result":{}}\n') == []  # "1" is not 1
        assert conn.pending_requests == {id: "m"}
        [resp] = events(conn, b'{"jsonrpc":"2.0","id":1,"result":{}}\n')
        assert isinstance(resp, Response)
        assert events(conn, b'{"jsonrpc":"2.0","id":1,"result":{}}\n') == []  # a second answer
    assert caplog.text.count("unknown request id") == 3


def test_connection_error_without_id_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """The peer's error with id null (it could not parse something of ours) is logged, never answered."""
    conn = Connection(max_message_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="acp_server.jsonrpc"):
        assert events(conn, b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}\n') == []
    assert "without an id" in caplog.text


def test_connection_send_failed_forgets_the_request() -> None:
    """send_failed drops a request of ours from the pending table: a late response to it is dropped."""
    conn = Connection(max_message_bytes=1000)
    id, _ = conn.send_request("m")
    conn.send_failed(id)
    conn.send_failed(12345)  # unknown ids are fine
    assert conn.pending_requests == {}
    assert events(conn, b'{"jsonrpc":"2.0","id":1,"result":{}}\n') == []
    id2, _ = conn.send_request("m")
    assert id2 == 2  # ids are never reused


def test_connection_pending_requests_is_a_copy() -> None:
    """The pending table handed out cannot corrupt the connection's own."""
    conn = Connection(max_message_bytes=1000)
    conn.send_request("m")
    conn.pending_requests.clear()
    assert conn.pending_requests == {1: "m"}


# --- too large ----------------------------------------------------------------------------------------


def test_connection_too_large() -> None:
    """An over-limit line yields TooLarge carrying -32600 message_too_large with the limit."""
    conn = Connection(max_message_bytes=64)
    ev = one(conn, b'{"jsonrpc":"2.0","id":1,"method":"' + b"x" * 100 + b'"}\n')
    assert isinstance(ev, TooLarge) and ev.limit == 64
    msg = error_of(ev)
    assert msg["id"] is None
    assert msg["error"]["code"] == -32600
    assert msg["error"]["data"] == {"errorKind": "message_too_large", "limit": 64}


def test_connection_too_large_streamed_is_not_buffered() -> None:
    """A line streamed past the limit is reported once, held no longer, and the next line parses."""
    conn = Connection(max_message_bytes=1024)
    got: list[Any] = []
    for _ in range(64):
        got += events(conn, b"y" * 256)
        assert conn.buffered_bytes <= 1024 + 256
    assert [type(e) for e in got] == [TooLarge]
    assert conn.buffered_bytes == 0
    assert [type(e) for e in events(conn, b'y"}\n{"jsonrpc":"2.0","id":1,"method":"m"}\n')] == [Request]


# --- bytes we produce ---------------------------------------------------------------------------------


def test_connection_send_notification_bytes() -> None:
    """Notifications carry no id; params are omitted when there are none."""
    assert wire(Connection.send_notification("a/b", {"x": [1]})) == {"jsonrpc": "2.0", "method": "a/b", "params": {"x": [1]}}
    assert wire(Connection.send_notification("a/b")) == {"jsonrpc": "2.0", "method": "a/b"}


@pytest.mark.parametrize("id", [0, 7, "abc", None])
def test_connection_send_result_bytes(id: Any) -> None:
    """A result response always has ``result`` (even null) and echoes the id exactly."""
    assert wire(encode_result(id, None)) == {"jsonrpc": "2.0", "id": id, "result": None}
    assert wire(Connection.send_result(id, {"a": 1})) == {"jsonrpc": "2.0", "id": id, "result": {"a": 1}}


def test_connection_send_error_bytes() -> None:
    """An error response has code, message and data with errorKind, and no result."""
    msg = wire(encode_error("r1", InvalidParamsError(path="prompt[0].type", detail="bad")))
    assert msg == {
        "jsonrpc": "2.0",
        "id": "r1",
        "error": {
            "code": -32602,
            "message": "Invalid params at prompt[0].type: bad",
            "data": {"errorKind": "invalid_params", "path": "prompt[0].type", "detail": "bad"},
        },
    }
    assert_error_valid(msg["error"])
    assert wire(Connection.send_error(None, MethodNotFoundError(method="x")))["id"] is None


def test_connection_pair_round_trip_with_notifications() -> None:
    """Both directions at once: the server's notifications and result interleave with the client's traffic."""
    pair = ConnectionPair()
    id, req = pair.client.send_request("session/prompt", {"sessionId": "s", "prompt": []})
    [request] = pair.to_server(req + Connection.send_notification("$/cancel_request", {"requestId": id}))[:1]
    assert isinstance(request, Request)
    out = pair.to_client(
        Connection.send_notification("session/update", {"sessionId": "s"})
        + pair.server.send_result(request.id, {"stopReason": "cancelled"})
    )
    assert [type(e) for e in out] == [Notification, Response]
    assert out[1].result == {"stopReason": "cancelled"} and out[1].method == "session/prompt"
