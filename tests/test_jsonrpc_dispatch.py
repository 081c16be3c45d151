"""Pure tests of dispatch: the method table, params decoding with dotted error paths, init gating and
crash handling. Handlers and their coroutines are driven by hand, with no event loop."""

from __future__ import annotations

import json
import logging
from collections.abc import Coroutine
from typing import Any

import msgspec
import pytest

from acp_server.errors import InvalidParamsError, SessionNotFoundError
from acp_server.jsonrpc import Dispatcher, HandlerContext, Method, Notification, Request, invalid_params_from
from acp_server.types.acp import InitializeParams, NewSessionParams, PromptParams

from .helpers import assert_error_valid


class Ctx(HandlerContext):
    def __init__(self, initialized: bool = True) -> None:
        self.initialized = initialized
        self.calls: list[tuple[str, Any]] = []


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine that never suspends to its end, synchronously."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the coroutine suspended")


def reply(data: Any) -> dict[str, Any]:
    assert isinstance(data, bytes) and data.endswith(b"\n")
    msg: dict[str, Any] = json.loads(data)
    assert msg["jsonrpc"] == "2.0"
    if "error" in msg:
        assert_error_valid(msg["error"])
    return msg


def req(method: str, params: Any = None, id: int | str = 1) -> Request:
    raw = None if params is None else msgspec.Raw(json.dumps(params).encode())
    return Request(id, method, raw)


async def _async_echo(value: Any) -> Any:
    return value


async def _async_crash() -> Any:
    raise RuntimeError("async secret 42")


async def _async_refuse() -> Any:
    raise SessionNotFoundError(session_id="gone")


def _crash(ctx: Ctx, params: Any) -> Any:
    raise RuntimeError("sync secret 42")


def _record(ctx: Ctx, params: Any) -> Any:
    ctx.calls.append(("record", params))
    return {"ok": True}


@pytest.fixture
def dispatcher() -> Dispatcher:
    return Dispatcher(
        {
            "initialize": Method(InitializeParams, lambda ctx, p: {"version": p.protocol_version}, requires_init=False),
            "session/prompt": Method(PromptParams, lambda ctx, p: {"n": len(p.prompt)}),
            "session/new": Method(NewSessionParams, lambda ctx, p: {"mcp": p.mcp_servers}),
            "plain": Method(None, lambda ctx, p: {"params": p}),
            "record": Method(None, _record),
            "async": Method(None, lambda ctx, p: _async_echo({"late": True})),
            "async_crash": Method(None, lambda ctx, p: _async_crash()),
            "async_refuse": Method(None, lambda ctx, p: _async_refuse()),
            "crash": Method(None, _crash),
            "refuse": Method(None, lambda ctx, p: (_ for _ in ()).throw(SessionNotFoundError(session_id="s1"))),
        },
        {
            "note": Method(NewSessionParams, lambda ctx, p: ctx.calls.append(("note", p.cwd))),
            "note_crash": Method(None, _crash),
            "note_any": Method(None, _record, requires_init=False),
        },
    )


# --- requests ---------------------------------------------------------------------------------------


def test_dispatch_sync_result(dispatcher: Dispatcher) -> None:
    """A synchronous handler's result comes back as the encoded response, with the request's id."""
    assert reply(dispatcher.call(Ctx(), req("plain", id=0))) == {"jsonrpc": "2.0", "id": 0, "result": {"params": None}}


def test_dispatch_async_result(dispatcher: Dispatcher) -> None:
    """A handler returning a coroutine is handed back unawaited; finish() shapes its result."""
    pending = dispatcher.call(Ctx(), req("async", id="a"))
    assert not isinstance(pending, bytes)
    out = run(dispatcher.finish("a", "async", pending))
    assert reply(out) == {"jsonrpc": "2.0", "id": "a", "result": {"late": True}}


def test_dispatch_method_not_found(dispatcher: Dispatcher) -> None:
    """An unknown method is -32601 method_not_found naming the method, checked before initialization."""
    msg = reply(dispatcher.call(Ctx(initialized=False), req("_unknown/thing", {"x": 1}, id=9)))
    assert msg["id"] == 9
    assert msg["error"]["code"] == -32601
    assert msg["error"]["data"] == {"errorKind": "method_not_found", "method": "_unknown/thing"}


def test_dispatch_not_initialized(dispatcher: Dispatcher) -> None:
    """Before initialize, methods that require it answer -32600 not_initialized and do not run."""
    ctx = Ctx(initialized=False)
    msg = reply(dispatcher.call(ctx, req("record", id=2)))
    assert msg["error"]["code"] == -32600
    assert msg["error"]["data"] == {"errorKind": "not_initialized", "method": "record"}
    assert ctx.calls == []
    assert "result" in reply(dispatcher.call(ctx, req("initialize", {"protocolVersion": 1})))


@pytest.mark.parametrize("params", [None, {}])
def test_dispatch_null_params_for_methods_without_params(dispatcher: Dispatcher, params: Any) -> None:
    """Methods that read no params accept absent/null params; initialize takes null as all defaults."""
    assert "result" in reply(dispatcher.call(Ctx(), req("plain", params)))
    assert reply(dispatcher.call(Ctx(), req("initialize", params)))["result"] == {"version": 1}


def test_dispatch_lenient_defaults(dispatcher: Dispatcher) -> None:
    """Absent optional fields take their defaults: no mcpServers means []."""
    assert reply(dispatcher.call(Ctx(), req("session/new", {"cwd": "/tmp"})))["result"] == {"mcp": []}


def _prompt(*blocks: Any, **extra: Any) -> dict[str, Any]:
    return {"sessionId": "s", "prompt": list(blocks), **extra}


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("session/prompt", _prompt({"type": "text", "text": 5}), "prompt[0].text"),
        ("session/prompt", _prompt({"type": "text"}), "prompt[0].text"),
        ("session/prompt", _prompt({"type": "bogus"}), "prompt[0].type"),
        ("session/prompt", _prompt({"text": "no type"}), "prompt[0].type"),
        ("session/prompt", _prompt({"type": "text", "text": "a"}, {"type": "image", "data": "x"}), "prompt[1].mimeType"),
        ("session/prompt", _prompt({"type": "text", "text": "a"}, 7), "prompt[1]"),
        ("session/prompt", {"sessionId": "s", "prompt": "hello"}, "prompt"),
        ("session/prompt", {"prompt": [{"type": "text", "text": "x"}]}, "sessionId"),
        ("session/prompt", {"sessionId": "s", "prompt": []}, "prompt"),
        ("session/prompt", None, "sessionId"),
        ("session/prompt", {"sessionId": 3, "prompt": []}, "sessionId"),
        ("session/new", {"cwd": "/", "mcpServers": [{}, 5]}, "mcpServers[1]"),
        ("initialize", {"clientCapabilities": {"fs": {"readTextFile": "yes"}}}, "clientCapabilities.fs.readTextFile"),
        ("initialize", {"protocolVersion": "1"}, "protocolVersion"),
        ("session/new", ["/tmp"], "params"),
    ],
)
def test_dispatch_invalid_params_path(dispatcher: Dispatcher, method: str, params: Any, path: str) -> None:
    """Params that do not decode give -32602 invalid_params with the dotted path of the offending field
    (``[i]`` for list items; a missing field is named in the path) and a detail; the handler does not run."""
    msg = reply(dispatcher.call(Ctx(), req(method, params, id="p")))
    assert msg["id"] == "p"
    assert msg["error"]["code"] == -32602
    data = msg["error"]["data"]
    assert data["errorKind"] == "invalid_params"
    assert data["path"] == path
    assert isinstance(data["detail"], str) and data["detail"]
    assert path in msg["error"]["message"]


def test_dispatch_handler_refusal_keeps_its_code(dispatcher: Dispatcher) -> None:
    """An AcpError raised by a handler (sync or async) is sent as is, not turned into -32603."""
    msg = reply(dispatcher.call(Ctx(), req("refuse")))
    assert msg["error"]["code"] == -32002 and msg["error"]["data"]["sessionId"] == "s1"
    pending = dispatcher.call(Ctx(), req("async_refuse"))
    assert not isinstance(pending, bytes)
    msg = reply(run(dispatcher.finish(1, "async_refuse", pending)))
    assert msg["error"]["code"] == -32002 and msg["error"]["data"]["sessionId"] == "gone"


def test_dispatch_sync_crash_is_internal_and_logged(dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture) -> None:
    """A handler crash is -32603 internal with nothing of the exception on the wire; the log has the traceback."""
    with caplog.at_level(logging.ERROR, logger="acp_server.dispatch"):
        data = dispatcher.call(Ctx(), req("crash", id=5))
    msg = reply(data)
    assert msg["id"] == 5
    assert msg["error"]["code"] == -32603 and msg["error"]["data"] == {"errorKind": "internal"}
    assert isinstance(data, bytes)
    assert b"secret" not in data and b"Traceback" not in data and b"RuntimeError" not in data
    [record] = caplog.records
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert "Traceback" in caplog.text and "sync secret 42" in caplog.text and "crash" in record.getMessage()


def test_dispatch_async_crash_is_internal_and_logged(dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture) -> None:
    """A crash in a handler's coroutine is -32603 too, logged with its traceback."""
    pending = dispatcher.call(Ctx(), req("async_crash", id="c"))
    assert not isinstance(pending, bytes)
    with caplog.at_level(logging.ERROR, logger="acp_server.dispatch"):
        data = run(dispatcher.finish("c", "async_crash", pending))
    msg = reply(data)
    assert msg["id"] == "c" and msg["error"]["code"] == -32603
    assert b"secret" not in data and b"Traceback" not in data
    assert "Traceback" in caplog.text and "async secret 42" in caplog.text


def test_dispatch_method_table_is_its_own(dispatcher: Dispatcher) -> None:
    """The dispatcher copies the tables it is given: later edits of the caller's dict change nothing."""
    table = {"plain": Method(None, lambda ctx, p: 1)}
    d = Dispatcher(table, {})
    table["other"] = Method(None, lambda ctx, p: 2)
    assert reply(d.call(Ctx(), req("other")))["error"]["code"] == -32601


def test_dispatch_builds_each_decoder_at_first_use(dispatcher: Dispatcher) -> None:
    """No params decoder exists before its method's first request (start-up builds none); the first
    request of a type answers as every later one does, array params included."""
    assert dict(dispatcher._decoders) == {} and dispatcher._eager == {}
    first = reply(dispatcher.call(Ctx(), req("session/new", {"cwd": "/w", "mcpServers": []}, id=1)))
    assert set(dispatcher._decoders) == {NewSessionParams} and set(dispatcher._eager) == {NewSessionParams}
    again = reply(dispatcher.call(Ctx(), req("session/new", {"cwd": "/w", "mcpServers": []}, id=1)))
    assert first == again == {"jsonrpc": "2.0", "id": 1, "result": {"mcp": []}}
    fresh = Dispatcher(dispatcher.requests, {})
    by_position = [reply(d.call(Ctx(), req("session/prompt", ["s1", []]))) for d in (fresh, fresh, dispatcher, dispatcher)]
    assert all(msg == by_position[0] for msg in by_position) and by_position[0]["error"]["code"] == -32602


@pytest.mark.parametrize("table", ["REQUESTS", "NOTIFICATIONS"])
def test_every_params_type_of_the_servers_tables_builds_its_decoder(table: str) -> None:
    """Decoders are built at first use, so a params type msgspec cannot decode into would fail only at
    its first request: every type of the server's own method tables is built here instead."""
    import acp_server.handlers as handlers

    methods = getattr(handlers, table)
    types = {m.params_type for m in methods.values() if m.params_type is not None}
    assert types, table
    for params_type in types:
        msgspec.json.Decoder(params_type)


# --- notifications ----------------------------------------------------------------------------------


def note(method: str, params: Any = None) -> Notification:
    return Notification(method, None if params is None else msgspec.Raw(json.dumps(params).encode()))


def test_dispatch_notification_runs_handler(dispatcher: Dispatcher) -> None:
    """A known notification runs its handler with decoded params and returns nothing."""
    ctx = Ctx()
    assert dispatcher.notify(ctx, note("note", {"cwd": "/w"})) is None  # type: ignore[func-returns-value]
    assert ctx.calls == [("note", "/w")]


@pytest.mark.parametrize(
    ("method", "params", "initialized", "logged"),
    [
        ("no/such", {"a": 1}, True, ""),
        ("_vendor/unknown", None, True, ""),
        ("note", {"cwd": 5}, True, "refused"),
        ("note", None, True, "refused"),
        ("note", {"cwd": "/w"}, False, "before initialize"),
        ("note_crash", None, True, "failed"),
    ],
)
def test_dispatch_notification_never_answers(
    dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture, method: str, params: Any, initialized: bool, logged: str
) -> None:
    """Unknown notifications, bad params, notifications before initialize and crashing handlers
    produce no reply and raise nothing; problems are logged."""
    ctx = Ctx(initialized=initialized)
    with caplog.at_level(logging.DEBUG):
        assert dispatcher.notify(ctx, note(method, params)) is None  # type: ignore[func-returns-value]
    assert [c for c in ctx.calls if c[0] == "note"] == []
    if logged:
        assert logged in caplog.text


def test_dispatch_notification_before_initialize_when_allowed(dispatcher: Dispatcher) -> None:
    """A notification that does not require initialize runs before it."""
    ctx = Ctx(initialized=False)
    dispatcher.notify(ctx, note("note_any"))
    assert ctx.calls == [("record", None)]


# --- invalid_params_from ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "path", "detail"),
    [
        ("Expected `str`, got `int` - at `$.prompt[0].text`", "prompt[0].text", "Expected `str`, got `int`"),
        ("Object missing required field `text` - at `$.prompt[0]`", "prompt[0].text", "Object missing required field `text`"),
        ("Object missing required field `sessionId`", "sessionId", "Object missing required field `sessionId`"),
        ("Invalid value 'bogus' - at `$.prompt[0].type`", "prompt[0].type", "Invalid value 'bogus'"),
        ("Expected `object`, got `array`", "params", "Expected `object`, got `array`"),
        ("Expected `int`, got `str` - at `$[2]`", "[2]", "Expected `int`, got `str`"),
    ],
)
def test_dispatch_invalid_params_from_messages(message: str, path: str, detail: str) -> None:
    """msgspec's messages map to a dotted path without the ``$.`` and a detail without the location."""
    err = invalid_params_from(msgspec.ValidationError(message))
    assert isinstance(err, InvalidParamsError)
    data = err.to_dict()["data"]
    assert (data["errorKind"], data["path"], data["detail"]) == ("invalid_params", path, detail)
