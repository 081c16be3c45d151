"""Fuzzing the JSON-RPC core and the agent-line decode: whatever the bytes, ``next_event`` returns events
and never raises; a request-shaped line gets exactly one answer, addressed to its id when the id was
readable; a broken answer to one of our own requests settles it; every error is valid against ``schemas/``.

Counts: ``make test`` runs each property with the reduced ``max_examples`` of :data:`EXAMPLES` (150;
batches :data:`BATCH_EXAMPLES`, 60), ``ACP_SERVER_FULL=1`` the full ones (2000; 1000).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from acp_server.backends.agent_process import decode_params
from acp_server.jsonrpc import (
    MAX_DEPTH,
    NEED_DATA,
    Batch,
    Connection,
    DecodeFailure,
    ErrorReply,
    Notification,
    Request,
    Response,
    TooLarge,
    safe_decode,
)
from acp_server.jsonrpc.guard import SCAN_TOKENS, decode_failure, scan_top_level

from .helpers import assert_error_valid, scaled

EXAMPLES = scaled(2000, 150)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: batches are several lines each: fewer of them
BATCH_EXAMPLES = scaled(1000, 60)

# --- strategies ---------------------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "é", "\\", '"', "\n", "🙂", "x" * 300]
)
_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | _text
_json = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=20,
)
_ids = st.integers(-(2**63), 2**63 - 1) | st.text(st.characters(codec="ascii", exclude_characters='"\\'), max_size=8)


def _nest(value: Any, depth: int, kind: str) -> bytes:
    inner = json.dumps(value).encode()
    if kind == "array":
        return b"[" * depth + inner + b"]" * depth
    return b'{"a":' * depth + inner + b"}" * depth


_deep = st.builds(_nest, _json, st.integers(1, 3000), st.sampled_from(["array", "object"]))


def _encode(obj: Any) -> bytes:
    """JSON text of ``obj`` (lone surrogates become ``\\udXXX`` escapes, as a peer would write them)."""
    return json.dumps(obj, ensure_ascii=True).encode()


@st.composite
def _request_line(draw: st.DrawFn) -> tuple[bytes, Any]:
    """A request-shaped line (``jsonrpc``, ``id``, ``method``) whose params may be anything, deep, or
    cut; the id is readable by construction (it comes before the params, or after)."""
    id = draw(_ids)
    method = draw(_text)
    params = draw(_deep | _json.map(_encode))
    head = b'{"jsonrpc":"2.0","id":' + _encode(id) + b',"method":' + _encode(method)
    if draw(st.booleans()):
        line = head + b',"params":' + params + b"}"
    else:
        line = b'{"jsonrpc":"2.0","method":' + _encode(method) + b',"params":' + params + b',"id":' + _encode(id) + b"}"
    return line, id


def _events(conn: Connection, data: bytes) -> list[Any]:
    conn.receive_data(data)
    out = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def _flat(events: list[Any]) -> list[Any]:
    out: list[Any] = []
    for event in events:
        out.extend(event.items if isinstance(event, Batch) else [event])
    return out


def _check_reply(event: Any) -> dict[str, Any]:
    assert isinstance(event, ErrorReply | TooLarge)
    msg: dict[str, Any] = json.loads(event.data)
    assert_error_valid(msg["error"])
    return msg


# --- properties ---------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300) | _json.map(_encode) | _deep)
def test_fuzz_any_line_yields_events_and_never_raises(line: bytes) -> None:
    conn = Connection(max_message_bytes=1 << 20)
    for event in _flat(_events(conn, line.replace(b"\n", b" ") + b"\n")):
        assert isinstance(event, Request | Notification | Response | ErrorReply | TooLarge)
        if isinstance(event, ErrorReply | TooLarge):
            _check_reply(event)
    # the connection still reads the next line
    assert isinstance(_events(conn, b'{"jsonrpc":"2.0","id":"n","method":"m"}\n')[0], Request)


@FUZZ
@given(_request_line(), st.data())
def test_fuzz_request_line_gets_one_event_with_its_id(case: tuple[bytes, Any], data: st.DataObject) -> None:
    """Whole or cut anywhere after its id, a request-shaped line is one Request, or one error reply
    addressed to its id."""
    line, id = case
    cut = data.draw(st.sampled_from([len(line), *range(line.index(b'"method"'), len(line), max(1, len(line) // 7))]))
    if b',"id":' in line[len(b'{"jsonrpc":"2.0"') :] and not line.startswith(b'{"jsonrpc":"2.0","id"'):
        cut = len(line)  # the id is at the end: only the whole line has it
    conn = Connection(max_message_bytes=1 << 20)
    events = _events(conn, line[:cut] + b"\n")
    assert len(events) == 1, events
    event = events[0]
    if isinstance(event, Request):
        assert event.id == id and cut == len(line)
        return
    msg = _check_reply(event)
    assert msg["id"] == id, (msg, line[:200])


@settings(max_examples=BATCH_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_request_line(), min_size=1, max_size=4))
@example([(b'{"jsonrpc":"2.0","method":"","params":' + _nest(None, 6700, "object") + b',"id":0}', 0)])  # past the scan
@example([(b'{"jsonrpc":"2.0","method":"","params":' + _nest({}, 2000, "object") + b',"id":0}', 0)])
def test_fuzz_batch_answers_every_request_with_its_id(cases: list[tuple[bytes, Any]]) -> None:
    """A batch, deep items included: one item per request, each a Request or an error with its id.

    Only a batch whose end the bounded scan reaches can be split: past :data:`SCAN_TOKENS` tokens (an
    item nested thousands of levels deep) the whole line gets one error addressed to ``null``."""
    ids = [id for _, id in cases]
    conn = Connection(max_message_bytes=1 << 22)
    line = b"[" + b",".join(line for line, _ in cases) + b"]"
    events = _events(conn, line + b"\n")
    assert len(events) == 1
    scanned = scan_top_level(line)
    assert scanned is not None
    if not isinstance(events[0], Batch):
        assert not scanned[1] and len(line) > SCAN_TOKENS, line[:200]  # the scan gave up before the end
        msg = _check_reply(events[0])
        assert msg["id"] is None and msg["error"]["data"]["maxDepth"] == MAX_DEPTH
        return
    seen = []
    for item in events[0].items:
        if isinstance(item, Request):
            seen.append(item.id)
        else:
            seen.append(_check_reply(item)["id"])
    assert seen == ids


@FUZZ
@given(st.binary(max_size=200) | _deep | _json.map(_encode), st.booleans())
def test_fuzz_broken_answers_to_our_requests_settle_them(payload: bytes, as_error: bool) -> None:
    """The agent side: an answer to our pending request whose result (or the line) cannot be decoded
    settles that request, as a malformed response, and nothing else is affected."""
    conn = Connection(max_message_bytes=1 << 22)
    id, _ = conn.send_request("session/prompt", {})
    key = b'"error":' if as_error else b'"result":'
    line = b'{"jsonrpc":"2.0","id":' + _encode(id) + b"," + key + payload.replace(b"\n", b" ") + b"}\n"
    events = _flat(_events(conn, line))
    for event in events:
        if isinstance(event, ErrorReply):
            _check_reply(event)
    responses = [e for e in events if isinstance(e, Response)]
    if id in conn.pending_requests:
        assert responses == []  # never routed: only when the line is not even an object with our id
        assert events and all(isinstance(e, ErrorReply) for e in events)
    else:
        assert len(responses) == 1 and responses[0].id == id


@FUZZ
@given(st.binary(max_size=200) | _deep | _json.map(_encode))
def test_fuzz_agent_params_decode_never_raises(data: bytes) -> None:
    """``decode_params`` (what the ACP agent backend reads updates and requests with): a value or None."""
    value = decode_params(msgspec.Raw(data)) if data else decode_params(None)
    assert value is None or isinstance(value, (dict, list, str, int, float, bool))


@FUZZ
@given(st.binary(max_size=200) | _deep | _json.map(_encode))
def test_fuzz_safe_decode_and_scan_never_raise(data: bytes) -> None:
    result = safe_decode(data)
    if isinstance(result, DecodeFailure):
        assert_error_valid(result.error.to_dict())
    scan_top_level(data)
    failure = decode_failure(data, RecursionError())
    assert failure.error.payload.max_depth == MAX_DEPTH  # type: ignore[attr-defined]


def test_depth_of_max_depth_decodes_and_one_beyond_msgspec_fails_structured() -> None:
    """``maxDepth`` is a depth that decodes; a far deeper line is ``invalid_request`` naming it."""
    conn = Connection(max_message_bytes=1 << 22)
    ok = b'{"jsonrpc":"2.0","id":1,"method":"m","params":' + _nest(1, MAX_DEPTH - 1, "array") + b"}\n"
    event = _events(conn, ok)[0]
    assert isinstance(event, Request) and event.params is not None
    assert not isinstance(safe_decode(event.params), DecodeFailure)
    deep = b'{"jsonrpc":"2.0","id":2,"method":"m","params":' + _nest(1, 5000, "object") + b"}\n"
    msg = _check_reply(_events(conn, deep)[0])
    assert msg["id"] == 2
    assert msg["error"]["data"] == {
        "errorKind": "invalid_request",
        "detail": f"nesting too deep: arrays and objects may nest at most {MAX_DEPTH} levels",
        "maxDepth": MAX_DEPTH,
    }
