"""Property tests over every method's params: wrong types, missing and unknown fields, huge and negative
numbers, NUL, lone surrogates, long strings, deep nesting. Whatever the params, the request is answered
(never ``internal``), every error is valid against ``schemas/`` (the raw client checks each one), and
the connection keeps working (a ``_acp_server/capabilities`` call after it succeeds).

Counts: ``max_examples`` :data:`EXAMPLES` per method (30 in ``make test``, 300 with ``ACP_SERVER_FULL=1``).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acp_server.handlers import NOTIFICATIONS, REQUESTS
from acp_server.handlers.meta import OUR_META_KEYS

from .helpers import connect, running_server, scaled

EXAMPLES = scaled(300, 30)

SID = "$SID"  # replaced by a live session's id
TEXT = {"type": "text", "text": "hello"}
TEMPLATES: dict[str, dict[str, Any] | None] = {
    "initialize": {"protocolVersion": 1, "clientCapabilities": {"fs": {"readTextFile": True}}, "_meta": {}},
    "authenticate": {"methodId": "x"},
    "logout": None,
    "session/new": {"cwd": "/tmp", "mcpServers": [], "additionalDirectories": ["/srv"], "_meta": {}},
    "session/list": {"cursor": "0", "cwd": "/tmp"},
    "session/load": {"sessionId": SID, "cwd": "/tmp", "mcpServers": [], "_meta": {"afterEventId": 0}},
    "session/resume": {"sessionId": SID, "cwd": "/tmp", "_meta": {"afterEventId": 0}},
    "session/close": {"sessionId": SID, "_meta": {}},
    "session/delete": {"sessionId": SID},
    "session/set_mode": {"sessionId": SID, "modeId": "default"},
    "session/set_config_option": {"sessionId": SID, "configId": "c", "value": "v"},
    "session/prompt": {
        "sessionId": SID,
        "prompt": [TEXT, {"type": "resource_link", "uri": "file:///a", "name": "a", "size": 1}],
        "_meta": {"deadlineMs": 5000},
    },
    "_acp_server/capabilities": None,
    "_acp_server/stats": None,
    "_acp_server/stats/subscribe": None,
    "_acp_server/stats/unsubscribe": None,
    "_acp_server/heartbeat": {"sessionId": SID},
    "_acp_server/detach": {"sessionId": SID},
    "_acp_server/fork": {"sessionId": SID},
    "session/cancel": {"sessionId": SID},
    "$/cancel_request": {"requestId": 1},
}
assert set(TEMPLATES) == set(REQUESTS) | set(NOTIFICATIONS) | {"$/cancel_request"}, "a method without a template"


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_hostile = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**64), 2**80, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        ["", "\x00", "/tmp/\x00x", "\ud800", "a\udfffb", "²", "٣", "-1", "9" * 5000, "/" + "a" * 5000,
         "x" * 1_000_000, "/tmp", "default", "text", "🙂"]
    ),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.sampled_from([_deep(450), _deep(800)]),
)


@st.composite
def _mutated(draw: st.DrawFn, method: str) -> Any:
    template = TEMPLATES[method]
    if template is None or draw(st.integers(0, 9)) == 0:
        return draw(_hostile | st.just({}))  # params of the wrong kind altogether (or none at all)
    params = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["drop", "unknown", "replace", "meta", "block"]))
        keys = sorted(params)
        if where == "drop" and keys:
            params.pop(draw(st.sampled_from(keys)))
        elif where == "unknown":
            params[draw(st.text(max_size=8))] = draw(_hostile)
        elif where == "replace" and keys:
            params[draw(st.sampled_from(keys))] = draw(_hostile)
        elif where == "meta":
            meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
            meta[draw(st.sampled_from(sorted(OUR_META_KEYS)))] = draw(_hostile)
            params["_meta"] = meta
        elif where == "block" and isinstance(params.get("prompt"), list) and params["prompt"]:
            block = dict(params["prompt"][0]) if isinstance(params["prompt"][0], dict) else {}
            key = draw(st.sampled_from(["type", "text", "uri", "name", "size", "mimeType", "data", "annotations"]))
            block[key] = draw(_hostile)
            params["prompt"][0] = block
    return params


@contextmanager
def _deep_room() -> Iterator[None]:
    """Room for this test's own ``json`` calls on the 800-deep params: they need ~800 levels on top of
    pytest's, Hypothesis's and trio's frames (~190), near the default limit of 1,000, and a slightly
    deeper stack turned them into a ``RecursionError`` (or json's "Circular reference detected") in the
    test's encoding, not the server's. Only around those calls: the server runs with the limit it has."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _dumps(value: Any) -> str:
    with _deep_room():
        return json.dumps(value)


def _with_session(params: Any, session_id: str) -> Any:
    with _deep_room():
        return json.loads(json.dumps(params).replace(json.dumps(SID)[1:-1], session_id))


async def _exercise(method: str, params: Any) -> None:
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            client = await connect(server, nursery)
            session_id, _ = await client.new_session()
            params = _with_session(params, session_id)
            if method in NOTIFICATIONS or method == "$/cancel_request":
                msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
                await client.send_raw(_dumps(msg).encode() + b"\n")
            else:
                id, receive = client.start_request(method)
                msg = {"jsonrpc": "2.0", "id": id, "method": method, "params": params}
                await client.send_raw(_dumps(msg).encode() + b"\n")
                reply = await receive.receive()
                if "error" in reply:
                    kind = reply["error"]["data"]["errorKind"]
                    assert kind != "internal", (method, _dumps(params)[:300], reply)
            # the connection still works, and so does the server
            assert "limits" in await client.call("_acp_server/capabilities")
            assert all(e["data"]["errorKind"] != "internal" for e in client.errors), client.errors
            other = await connect(server, nursery)
            assert "limits" in await other.call("_acp_server/capabilities")
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("method", sorted(TEMPLATES))
def test_fuzz_params_never_internal_never_a_dropped_connection(method: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_mutated(method))
    def run(params: Any) -> None:
        trio.run(_exercise, method, params)

    run()


_PROMPT = TEMPLATES["session/prompt"]
assert _PROMPT is not None

#: The inputs the issue names, each with the field its ``invalid_params`` must name.
KNOWN: list[tuple[str, dict[str, Any], str]] = [
    ("session/list", {"cursor": "²"}, "cursor"),
    ("session/list", {"cursor": "٣"}, "cursor"),
    ("session/list", {"cursor": "9" * 5000}, "cursor"),
    ("session/list", {"cwd": "/tmp/\x00"}, "cwd"),
    ("session/prompt", {"sessionId": SID, "prompt": []}, "prompt"),
    ("session/prompt", {**_PROMPT, "_meta": {"deadlineMs": 2**64}}, "_meta.deadlineMs"),
    ("session/prompt", {**_PROMPT, "_meta": {"deadlineMs": -5}}, "_meta.deadlineMs"),
    ("session/prompt", {**_PROMPT, "prompt": [{"type": "resource_link", "uri": "u", "name": "n", "size": -1}]}, "prompt[0].size"),
    ("session/prompt", {**_PROMPT, "prompt": [{"type": "resource_link", "uri": "u", "name": "n", "size": 2**64}]}, "prompt[0].size"),
    ("session/prompt", {**_PROMPT, "_meta": {"clientId": "c" * 1_000_000}}, "_meta.clientId"),
    ("session/prompt", {**_PROMPT, "_meta": {"idempotencyKey": "k" * 100_000}}, "_meta.idempotencyKey"),
    ("session/prompt", {**_PROMPT, "sessionId": "s" * 100_000}, "sessionId"),
    ("session/new", {"cwd": "/tmp/a\x00b"}, "cwd"),
    ("session/new", {"cwd": "/" + "a" * 1_000_000}, "cwd"),
    ("session/new", {"cwd": "/tmp", "additionalDirectories": ["/a\x00"]}, "additionalDirectories[0]"),
    ("session/load", {"sessionId": SID, "cwd": "/tmp", "_meta": {"afterEventId": 2**70}}, "_meta.afterEventId"),
    ("session/resume", {"sessionId": SID, "cwd": "/tmp\x00"}, "cwd"),
    ("initialize", {"protocolVersion": 2**80}, "protocolVersion"),
]


@pytest.mark.parametrize(("method", "params", "path"), KNOWN, ids=[f"{m}-{p}" for m, _, p in KNOWN])
async def test_known_hostile_params_get_invalid_params_naming_the_field(method: str, params: dict[str, Any], path: str) -> None:
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        reply = await client.call_raw(method, _with_session(params, session_id))
        error = reply["error"]
        assert error["data"]["errorKind"] == "invalid_params" and error["data"]["path"] == path, error
        assert len(json.dumps(error)) < 2000  # a long value is never echoed back whole
        assert "limits" in await client.call("_acp_server/capabilities")


async def test_a_1mb_client_id_is_cut_in_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """A notification refused for a 1 MB ``clientId`` logs a line of bounded length (and so does one
    with a 1 MB method name)."""
    caplog.set_level(logging.DEBUG, logger="acp_server")
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        await client.notify("session/cancel", {"sessionId": session_id, "_meta": {"clientId": "c" * 1_000_000}})
        await client.notify("c" * 1_000_000, {})
        assert "limits" in await client.call("_acp_server/capabilities")
        nursery.cancel_scope.cancel()
    refused = [r for r in caplog.records if "session/cancel refused" in r.getMessage()]
    assert refused and "_meta.clientId" in refused[0].getMessage()
    assert max(len(r.getMessage()) for r in caplog.records) < 1000


async def test_params_nested_to_max_depth_are_served() -> None:
    """``data.maxDepth`` is a depth that decodes: a prompt whose block nests that deep is answered."""
    from acp_server.jsonrpc import MAX_DEPTH

    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        # params -> prompt -> [0] -> annotations -> ... : MAX_DEPTH levels in all, the line one more
        block = {"type": "text", "text": "deep", "annotations": {"a": _deep(MAX_DEPTH - 5)}}
        result = await client.call("session/prompt", {"sessionId": session_id, "prompt": [block]})
        assert result["stopReason"] == "end_turn"
        nursery.cancel_scope.cancel()


def test_max_connections_config_key() -> None:
    from acp_server.config import ConfigError, parse_config

    assert parse_config("max_connections = 12").max_connections == 12
    with pytest.raises(ConfigError, match="max_connections"):
        parse_config("max_connections = -1")
