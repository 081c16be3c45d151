"""JSON-RPC 2.0 and ACP conformance of the server, in process over memory streams.

Every error a test sees is validated against ``schemas/`` by :class:`~tests.helpers.RawClient`; the tests
also assert codes and ``errorKind`` explicitly. "Nothing was answered" is shown by sending the input
followed by a probe request: replies leave in order, so once the probe's answer is in, any answer to
the input would have arrived before it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.errors import REGISTRY
from acp_server.handlers import NOTIFICATIONS, REQUESTS
from acp_server.jsonrpc import Dispatcher, LineBuffer, Method
from acp_server.server import Server
from acp_server.transports import ConnectionShell

from .fakes import FakeBackend, connect_shell, send_prompt
from .helpers import RawClient, connect, running_server

PROBE = "_acp_server/capabilities"
MiB = 1024 * 1024

#: the standard kinds: code and errorKind, as the wire must carry them
STANDARD_KINDS = {
    "parse_error": -32700,
    "invalid_request": -32600,
    "method_not_found": -32601,
    "invalid_params": -32602,
    "request_cancelled": -32800,
    "not_initialized": -32600,
    "internal": -32603,
    "message_too_large": -32600,
}


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def request(id: Any, method: str, params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def notification(method: str, params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def prompt_params(session_id: str, text: str = "hello") -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


def check_error(msg: dict[str, Any], code: int, kind: str, *, id: Any = ...) -> dict[str, Any]:
    """Assert ``msg`` is an error response with this code and errorKind (and id); return ``error.data``."""
    assert "result" not in msg, msg
    error = msg["error"]
    assert error["code"] == code, error
    assert error["data"]["errorKind"] == kind, error
    if id is not ...:
        assert msg["id"] == id and type(msg["id"]) is type(id), msg
    return error["data"]  # type: ignore[no-any-return]


async def exchange(client: RawClient, data: bytes, *, probe: str = PROBE) -> list[Any]:
    """Send raw bytes, then a probe request; return what the server sent in between.

    The probe's success shows the connection still works after ``data``.
    """
    before = len(client.messages)
    await client.send_raw(data)
    with trio.fail_after(10):
        answer = await client.call_raw(probe)
    assert "result" in answer, answer
    got = [m for m in client.messages[before:] if not _is_turn_state(m)]  # prompts' own notifications
    assert got[-1] is answer
    return got[:-1]


def _is_turn_state(msg: Any) -> bool:
    return isinstance(msg, dict) and msg.get("method") == "_acp_server/turn_state"


async def exchange_one(client: RawClient, data: bytes) -> dict[str, Any]:
    """:func:`exchange` for input that gets exactly one reply."""
    got = await exchange(client, data)
    assert len(got) == 1, got
    return got[0]  # type: ignore[no-any-return]


async def assert_untouched(client: RawClient) -> None:
    """An observer connection saw nothing but answers to its own requests, and still gets answers."""
    before = len(client.messages)
    assert client.errors == [] and client.notifications == []
    assert "result" in await client.call_raw(PROBE)
    assert len(client.messages) == before + 1


def crash_dispatcher(server: Server) -> None:
    """Give ``server`` extra methods whose handlers crash (sync and async)."""

    def crash(ctx: Any, params: Any) -> Any:
        raise RuntimeError("sync handler secret 1234")

    async def acrash() -> Any:
        await trio.lowlevel.checkpoint()
        raise RuntimeError("async handler secret 5678")

    server.dispatcher = Dispatcher(
        {**REQUESTS, "_test/crash": Method(None, crash), "_test/acrash": Method(None, lambda ctx, p: acrash())},
        NOTIFICATIONS,
    )


# --- every standard errorKind on the wire ----------------------------------------------------------


async def _parse_error(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    return await exchange_one(await connect(server, nursery), b"{this is not json\n")


async def _invalid_request(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    return await exchange_one(await connect(server, nursery), b'{"jsonrpc":"2.0","id":"r"}\n')


async def _method_not_found(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    return await (await connect(server, nursery)).call_raw("no/such_method")


async def _invalid_params(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    return await (await connect(server, nursery)).call_raw("session/new", {"cwd": 7})


async def _request_cancelled(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    client = await connect(server, nursery)
    session_id, _ = await client.new_session()
    pending = await send_prompt(client, nursery, session_id, "slow", id="c1")
    await client.notify("$/cancel_request", {"requestId": "c1"})
    return await pending.wait()


async def _not_initialized(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    return await (await connect(server, nursery, initialize=False)).call_raw("session/new", {"cwd": "/tmp"})


async def _internal(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    crash_dispatcher(server)
    return await (await connect(server, nursery)).call_raw("_test/crash")


async def _message_too_large(server: Server, nursery: trio.Nursery) -> dict[str, Any]:
    client = await connect(server, nursery)
    await client.send_raw(line(request("big", "session/new", {"cwd": "/" + "x" * 5000})))
    with trio.fail_after(10):
        await client.eof.wait()
    [msg] = client.messages[1:]
    return msg


_TRIGGERS: dict[str, Callable[[Server, trio.Nursery], Awaitable[dict[str, Any]]]] = {
    "parse_error": _parse_error,
    "invalid_request": _invalid_request,
    "method_not_found": _method_not_found,
    "invalid_params": _invalid_params,
    "request_cancelled": _request_cancelled,
    "not_initialized": _not_initialized,
    "internal": _internal,
    "message_too_large": _message_too_large,
}


@pytest.mark.parametrize("kind", list(STANDARD_KINDS))
async def test_conformance_standard_error_kinds(kind: str) -> None:
    """Each standard error reaches the wire with its code and ``data.errorKind`` (and validates against
    the schemas); the registry agrees on the code."""
    backend = FakeBackend()
    backend.hold("slow")
    limits = Limits(max_message_bytes=4096)
    async with running_server(limits, backend) as (server, nursery):
        msg = await _TRIGGERS[kind](server, nursery)
    check_error(msg, STANDARD_KINDS[kind], kind)
    assert REGISTRY[kind].code == STANDARD_KINDS[kind]
    assert isinstance(msg["error"]["message"], str) and msg["error"]["message"]


# --- parse errors and invalid requests ---------------------------------------------------------------


async def test_conformance_parse_error_keeps_connection_open() -> None:
    """An unparseable line gets -32700, addressed to its id when the id is readable (a truncated line),
    else null; the same connection then works normally."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        for bad, id in ((b"{oops\n", None), (b'{"jsonrpc":"2.0","id":1,"method":"x"\n', 1), (b"]\n", None)):
            msg = await exchange_one(client, bad)
            check_error(msg, -32700, "parse_error", id=id)
        session_id, _ = await client.new_session()
        assert (await client.prompt(session_id, "still here"))["stopReason"] == "end_turn"


@pytest.mark.parametrize(
    ("data", "reply_id"),
    [
        (b"42", None),
        (b'"text"', None),
        (b"null", None),
        (b"{}", None),
        (b'{"jsonrpc":"2.0"}', None),
        (b'{"id":"a","method":"' + PROBE.encode() + b'"}', "a"),
        (b'{"jsonrpc":"1.0","id":"b","method":"' + PROBE.encode() + b'"}', "b"),
        (b'{"jsonrpc":"2.0","id":"c","method":42}', "c"),
        (b'{"jsonrpc":"2.0","id":"d","method":"' + PROBE.encode() + b'","params":"x"}', "d"),
        (b'{"jsonrpc":"2.0","id":"e"}', "e"),
    ],
)
async def test_conformance_not_a_request_is_invalid_request(data: bytes, reply_id: Any) -> None:
    """Valid JSON that is not a request gets -32600 invalid_request (addressed to its id when readable)."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        check_error(await exchange_one(client, data + b"\n"), -32600, "invalid_request", id=reply_id)


async def test_conformance_unknown_method() -> None:
    """An unknown method gets -32601 with ``data.method`` naming it, `_`-prefixed ones included."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        for method in ("session/teleport", "_vendor/thing", "_acp_server/nope", ""):
            data = check_error(await client.call_raw(method, {"a": 1}), -32601, "method_not_found")
            assert data["method"] == method


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("session/prompt", {"prompt": [{"type": "text", "text": 5}]}, "prompt[0].text"),
        ("session/prompt", {"prompt": [{"type": "text"}]}, "prompt[0].text"),
        ("session/prompt", {"prompt": [{"type": "video", "url": "x"}]}, "prompt[0].type"),
        ("session/prompt", {"prompt": [{"type": "text", "text": "ok"}, {"type": "image", "data": "x"}]}, "prompt[1].mimeType"),
        ("session/prompt", {"prompt": "hello"}, "prompt"),
        ("session/prompt", {"sessionId": None}, "sessionId"),
        ("session/new", {}, "cwd"),
        ("session/new", {"cwd": "/tmp", "mcpServers": {}}, "mcpServers"),
        ("session/new", {"cwd": "relative/dir"}, "cwd"),
        ("session/new", ["/tmp"], "params"),
        ("initialize", {"clientCapabilities": {"fs": {"readTextFile": "yes"}}}, "clientCapabilities.fs.readTextFile"),
        ("session/set_mode", {"modeId": 3}, "modeId"),
    ],
)
async def test_conformance_invalid_params_path(method: str, params: Any, path: str) -> None:
    """Bad params get -32602 with ``data.path`` the dotted path (``[i]`` for items; a missing field is
    named) and a ``detail``; nothing is created."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        if isinstance(params, dict) and method in ("session/prompt", "session/set_mode"):
            params = {"sessionId": session_id, **params}
        msg = await client.call_raw(method, params, id="bad")
        data = check_error(msg, -32602, "invalid_params", id="bad")
        assert data["path"] == path
        assert isinstance(data["detail"], str) and data["detail"]
        assert list(server.bridge.sessions) == [session_id]
        assert client.updates(session_id) == []


async def test_conformance_handler_crash_is_internal(caplog: pytest.LogCaptureFixture) -> None:
    """A crashing handler (sync or async) answers -32603 with no traceback or exception text on the wire;
    the log has the full traceback. The connection goes on working."""
    async with running_server() as (server, nursery):
        crash_dispatcher(server)
        client = await connect(server, nursery)
        with caplog.at_level(logging.ERROR, logger="acp_server"):
            sync = await client.call_raw("_test/crash", id=1)
            late = await client.call_raw("_test/acrash", id=2)
        for msg, secret in ((sync, "1234"), (late, "5678")):
            assert check_error(msg, -32603, "internal") == {"errorKind": "internal"}
            text = json.dumps(msg)
            assert "Traceback" not in text and "RuntimeError" not in text and secret not in text
            assert f"handler secret {secret}" in caplog.text
        assert caplog.text.count("Traceback (most recent call last)") == 2
        assert "result" in await client.call_raw(PROBE)


async def test_conformance_backend_crash_is_internal(caplog: pytest.LogCaptureFixture) -> None:
    """A backend whose prompt raises RuntimeError: the prompt answers -32603, the log has the traceback,
    the session's slot is released and the next prompt runs."""
    backend = FakeBackend()
    backend.crash("boom", RuntimeError("backend secret 999"))
    async with running_server(None, backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        with caplog.at_level(logging.ERROR, logger="acp_server"):
            msg = await client.call_raw("session/prompt", prompt_params(session_id, "boom"))
        check_error(msg, -32603, "internal")
        assert "secret" not in json.dumps(msg) and "Traceback" not in json.dumps(msg)
        assert "backend secret 999" in caplog.text and "Traceback (most recent call last)" in caplog.text
        assert server.bridge.statistics().pending_prompts == 0
        assert (await client.prompt(session_id, "fine"))["stopReason"] == "end_turn"


async def test_conformance_request_before_initialize() -> None:
    """Before ``initialize`` every other request gets -32600 not_initialized naming the method, and does
    nothing; unknown methods are still -32601; after ``initialize`` the same requests work."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        for method, params in (("session/new", {"cwd": "/tmp"}), (PROBE, None), ("session/list", {})):
            data = check_error(await client.call_raw(method, params), -32600, "not_initialized")
            assert data["method"] == method
        check_error(await client.call_raw("no/such"), -32601, "method_not_found")
        assert server.bridge.sessions == {}
        await client.initialize()
        session_id, _ = await client.new_session()
        assert list(server.bridge.sessions) == [session_id]


# --- ids and params -------------------------------------------------------------------------------------


@pytest.mark.parametrize("id", [0, 1, -3, 2**40, "abc", "", "0"])
async def test_conformance_ids_are_echoed(id: Any) -> None:
    """Integer ids (0 included) and string ids (empty included) come back exactly, on sync and async
    methods alike."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        resp = await client.call_raw(PROBE, id=id)
        assert resp["id"] == id and type(resp["id"]) is type(id) and "result" in resp
        session_id, _ = await client.new_session()
        resp = await client.call_raw("session/prompt", prompt_params(session_id), id=id)
        assert resp["id"] == id and resp["result"]["stopReason"] == "end_turn"


@pytest.mark.parametrize("bad_id", ["true", "false", "1.5", "2.0", "{}", '{"id":1}', "[1]"])
async def test_conformance_bad_ids_are_invalid_request(bad_id: str) -> None:
    """Bool, float, object and array ids are refused with -32600 (id null); nothing runs."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        data = f'{{"jsonrpc":"2.0","id":{bad_id},"method":"session/new","params":{{"cwd":"/tmp"}}}}\n'.encode()
        check_error(await exchange_one(client, data), -32600, "invalid_request", id=None)
        assert server.bridge.sessions == {}


async def test_conformance_null_params_tolerated() -> None:
    """``"params": null`` (and absent params) are accepted by methods that need none: initialize and
    ``_acp_server/capabilities``."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        [init] = await exchange(client, b'{"jsonrpc":"2.0","id":"i","method":"initialize","params":null}\n')
        assert init["id"] == "i" and init["result"]["protocolVersion"] == 1
        [caps] = await exchange(client, b'{"jsonrpc":"2.0","id":"c","method":"' + PROBE.encode() + b'","params":null}\n')
        assert caps["id"] == "c" and "limits" in caps["result"]


async def test_conformance_duplicate_inflight_id_refused() -> None:
    """A request reusing the id of one still in flight is refused with -32600; the first is unaffected."""
    backend = FakeBackend()
    backend.hold("held")
    async with running_server(None, backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        client.start_request("session/prompt", id=5)  # the refusal below is routed here by the client
        await client.send(request(5, "session/prompt", prompt_params(session_id, "held")))
        await backend.started("held")
        check_error(await exchange_one(client, line(request(5, PROBE))), -32600, "invalid_request", id=5)
        _, first = client.start_request("session/prompt", id=5)
        backend.release("held")
        with trio.fail_after(10):
            assert (await first.receive())["result"]["stopReason"] == "end_turn"


async def test_conformance_lenient_input() -> None:
    """Absent ``clientCapabilities`` means all false; absent ``mcpServers`` means []."""
    async with running_server() as (server, nursery):
        client, shell = await connect_shell(server, nursery, initialize=False)
        await client.call("initialize", {"protocolVersion": 1})
        caps = shell.ctx.client_capabilities  # type: ignore[attr-defined]
        assert (caps.fs.read_text_file, caps.fs.write_text_file, caps.terminal) == (False, False, False)
        result = await client.call("session/new", {"cwd": "/tmp"})
        assert server.bridge.sessions[result["sessionId"]].mcp_servers == []


# --- notifications ---------------------------------------------------------------------------------------


async def test_conformance_notifications_never_answered() -> None:
    """No notification is ever answered: unknown ones, unknown `_`-prefixed ones, request methods sent as
    notifications, known ones with invalid params, cancels of nothing. The only reply is the probe's."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        notes = [
            notification("foo/bar", {"x": 1}),
            notification("_vendor/unknown"),
            notification("_acp_server/nope", {"a": [1]}),
            notification("session/new", {"cwd": "/tmp"}),
            notification("initialize", {"protocolVersion": 1}),
            notification("session/cancel", {"sessionId": 5}),
            notification("session/cancel"),
            notification("session/cancel", {"sessionId": "sess_unknown"}),
            notification("session/cancel", ["sess_unknown"]),
            notification("$/cancel_request", {"requestId": "not-in-flight"}),
            notification("$/cancel_request", {"requestId": True}),
            notification("$/cancel_request"),
        ]
        assert await exchange(client, b"".join(line(n) for n in notes)) == []
        assert server.bridge.sessions == {}


async def test_conformance_notifications_before_initialize_never_answered() -> None:
    """Notifications before ``initialize`` are not answered either."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery, initialize=False)
        await client.send(notification("session/cancel", {"sessionId": "s"}))
        await client.send(notification("_vendor/ping"))
        await client.initialize()
        assert len(client.messages) == 1 and client.errors == []


# --- batches ---------------------------------------------------------------------------------------------


async def test_conformance_batch_of_requests() -> None:
    """A batch of requests is answered by one array with a response per request."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        [answer] = await exchange(client, line([request("b1", PROBE), request("b2", "no/such"), request(0, PROBE)]))
        assert isinstance(answer, list) and len(answer) == 3
        by_id = {item["id"]: item for item in answer}
        assert set(by_id) == {"b1", "b2", 0}
        assert "limits" in by_id["b1"]["result"] and "limits" in by_id[0]["result"]
        check_error(by_id["b2"], -32601, "method_not_found")


async def test_conformance_empty_batch() -> None:
    """``[]`` is answered with a single -32600 error object, not an array."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        msg = await exchange_one(client, b"[]\n")
        assert isinstance(msg, dict)
        check_error(msg, -32600, "invalid_request", id=None)


async def test_conformance_batch_of_notifications_is_not_answered() -> None:
    """A batch of only notifications (and responses to nothing) gets no answer at all."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        batch = [notification("foo/bar"), notification("session/cancel", {"sessionId": "x"}), {"jsonrpc": "2.0", "id": 99, "result": {}}]
        assert await exchange(client, line(batch)) == []


async def test_conformance_batch_mixed_valid_and_invalid() -> None:
    """Mixed batches: each request and each invalid item gets its response in one array; notifications
    and stray responses get none."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        batch = [
            request("ok", PROBE),
            notification("foo/bar"),
            42,
            request("nf", "no/such"),
            request("ip", "session/new", {"cwd": 1}),
            {"jsonrpc": "2.0", "id": "stray", "result": 1},
            {"jsonrpc": "2.0", "method": 1},
        ]
        [answer] = await exchange(client, line(batch))
        assert isinstance(answer, list) and len(answer) == 5
        by_id: dict[Any, list[dict[str, Any]]] = {}
        for item in answer:
            assert item["jsonrpc"] == "2.0"
            by_id.setdefault(item["id"], []).append(item)
        assert set(by_id) == {"ok", "nf", "ip", None}
        assert "result" in by_id["ok"][0]
        check_error(by_id["nf"][0], -32601, "method_not_found")
        assert check_error(by_id["ip"][0], -32602, "invalid_params")["path"] == "cwd"
        assert len(by_id[None]) == 2
        for item in by_id[None]:
            check_error(item, -32600, "invalid_request")


async def test_conformance_batch_of_non_objects_and_broken_batch() -> None:
    """``[1,2,3]`` gets an array of three -32600 errors; a batch that is not valid JSON gets one -32700."""
    async with running_server() as (server, nursery):
        client = await connect(server, nursery)
        [answer] = await exchange(client, b"[1,2,3]\n")
        assert isinstance(answer, list) and len(answer) == 3
        for item in answer:
            check_error(item, -32600, "invalid_request", id=None)
        check_error(await exchange_one(client, b'[{"jsonrpc":"2.0","id":1,"method":"x"},\n'), -32700, "parse_error", id=None)


async def test_conformance_batch_waits_for_async_items() -> None:
    """A batch with a prompt in it is answered once, when every item is done, as one array."""
    backend = FakeBackend()
    backend.hold("held")
    async with running_server(None, backend) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        await client.send_raw(line([request("p", "session/prompt", prompt_params(session_id, "held")), request("c", PROBE)]))
        await backend.started("held")
        await trio.testing.wait_all_tasks_blocked()
        assert not any(isinstance(m, list) for m in list[Any](client.messages))
        backend.release("held")
        with trio.fail_after(10):
            while not any(isinstance(m, list) for m in list[Any](client.messages)):
                await trio.testing.wait_all_tasks_blocked()
        received: list[Any] = list(client.messages)  # RawClient types messages as objects; batches are lists
        [answer] = [m for m in received if isinstance(m, list)]
        by_id = {item["id"]: item for item in answer}
        assert by_id["p"]["result"]["stopReason"] == "end_turn" and "limits" in by_id["c"]["result"]


# --- $/cancel_request ----------------------------------------------------------------------------------


@pytest.mark.parametrize("id", [0, "p-1"])
async def test_conformance_cancel_request_running(id: Any) -> None:
    """``$/cancel_request`` cancels a running prompt's handler: it answers -32800 request_cancelled and
    its slot is released (a prompt on an echo backend that would take a minute)."""
    async with running_server(None, EchoBackend(delay_ms=60_000)) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        pending = await send_prompt(client, nursery, session_id, "long wait", id=id)
        with trio.fail_after(10):
            while not client.updates(session_id):
                await client.notified.wait()
            await client.notify("$/cancel_request", {"requestId": id})
            msg = await pending.wait()
        check_error(msg, -32800, "request_cancelled", id=id)
        assert server.bridge.statistics().pending_prompts == 0


async def test_conformance_cancel_in_same_chunk_wins(autojump_clock: trio.testing.MockClock) -> None:
    """A cancel read in the same chunk as its prompt (before the handler's task ever ran) wins: the prompt
    answers -32800 and does nothing: no session/update, nothing left pending. Repeated, since it
    depends on scheduling order."""
    async with running_server(None, EchoBackend(delay_ms=60_000)) as (server, nursery):
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        for i in range(20):
            id, receive = client.start_request("session/prompt")
            prompt = request(id, "session/prompt", prompt_params(session_id, f"never said {i}"))
            await client.send_raw(line(prompt) + line(notification("$/cancel_request", {"requestId": id})))
            check_error(await receive.receive(), -32800, "request_cancelled", id=id)
            assert server.bridge.statistics().pending_prompts == 0
        assert client.updates(session_id) == []
        assert (await client.prompt(session_id, "said"))["stopReason"] == "end_turn"
        assert client.agent_text(session_id) == "said"


async def test_conformance_cancel_of_waiting_request_wins() -> None:
    """A request waiting unstarted behind max-inflight and then cancelled answers -32800 when its turn
    comes, without ever being admitted: no backend call, no update, nothing pending."""
    backend = FakeBackend()
    backend.hold("first")
    async with running_server(Limits(max_inflight_requests=1), backend) as (server, nursery):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        first = await send_prompt(client, nursery, s1, "first")
        await backend.started("first")
        waiting = await send_prompt(client, nursery, s2, "second", id="w")
        await trio.testing.wait_all_tasks_blocked()
        assert server.bridge.statistics().admitted_total == 1
        await client.notify("$/cancel_request", {"requestId": "w"})
        await trio.testing.wait_all_tasks_blocked()  # the server has read the cancel
        backend.release("first")
        with trio.fail_after(10):
            check_error(await waiting.wait(), -32800, "request_cancelled", id="w")
            assert (await first.wait())["result"]["stopReason"] == "end_turn"
        assert backend.calls_of("second") == []
        stats = server.bridge.statistics()
        assert (stats.admitted_total, stats.pending_prompts) == (1, 0)
        assert client.updates(s2) == []


async def test_conformance_session_cancel_ends_its_waiting_prompts() -> None:
    """A session's prompt waiting unstarted behind max-inflight when ``session/cancel`` names the session
    is answered ``stopReason: "cancelled"`` at once (it was sent before the cancel, as the bridge's queued
    prompts were) and never runs; a waiting prompt of another session keeps its place and runs."""
    backend = FakeBackend()
    backend.hold("first", "second")
    async with running_server(Limits(max_inflight_requests=1), backend) as (server, nursery):
        client, shell = await connect_shell(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        first = await send_prompt(client, nursery, s1, "first")
        await backend.started("first")
        second = await send_prompt(client, nursery, s1, "second", id="w1")
        other = await send_prompt(client, nursery, s2, "other", id="w2")
        await trio.testing.wait_all_tasks_blocked()
        assert len(shell._waiting) == 2
        await client.notify("session/cancel", {"sessionId": s1})
        with trio.fail_after(10):
            assert (await first.wait())["result"]["stopReason"] == "cancelled"
            assert (await second.wait())["result"] == {"stopReason": "cancelled"}
            await backend.started("other")
        backend.release("other")
        with trio.fail_after(10):
            assert (await other.wait())["result"]["stopReason"] == "end_turn"
        assert backend.calls_of("second") == []
        assert backend.texts_started() == ["first", "other"]
        assert server.bridge.statistics().pending_prompts == 0


# --- max-inflight and backpressure ------------------------------------------------------------------


async def test_conformance_max_inflight_third_waits() -> None:
    """With max_inflight_requests=2 a third request waits unstarted; notifications and responses are
    still handled meanwhile (a session/cancel ends a running prompt, which lets the third start), and
    a $/cancel_request for a waiting request is honoured."""
    backend = FakeBackend()
    backend.hold("a", "b", "c", "d")
    async with running_server(Limits(max_inflight_requests=2), backend) as (server, nursery):
        client, shell = await connect_shell(server, nursery)
        sa, sb, sc, sd = [(await client.new_session())[0] for _ in range(4)]
        a = await send_prompt(client, nursery, sa, "a")
        b = await send_prompt(client, nursery, sb, "b")
        await backend.started("a")
        await backend.started("b")
        c = await send_prompt(client, nursery, sc, "c")
        await trio.testing.wait_all_tasks_blocked()
        assert backend.texts_started() == ["a", "b"]
        assert shell.inflight == 2
        assert server.bridge.statistics().admitted_total == 2

        # Handled while c waits: a stray response (dropped, unanswered) and a session/cancel for a.
        await client.send({"jsonrpc": "2.0", "id": 4242, "result": {}})
        await client.notify("session/cancel", {"sessionId": sa})
        with trio.fail_after(10):
            assert (await a.wait())["result"]["stopReason"] == "cancelled"
            await backend.started("c")

        d = await send_prompt(client, nursery, sd, "d", id="d")
        await trio.testing.wait_all_tasks_blocked()
        assert backend.texts_started() == ["a", "b", "c"]
        await client.notify("$/cancel_request", {"requestId": "d"})
        backend.release("b", "c", "d")
        with trio.fail_after(10):
            assert (await b.wait())["result"]["stopReason"] == "end_turn"
            assert (await c.wait())["result"]["stopReason"] == "end_turn"
            check_error(await d.wait(), -32800, "request_cancelled", id="d")
        assert backend.texts_started() == ["a", "b", "c"]
        assert server.bridge.statistics().pending_prompts == 0
        assert 4242 not in {m.get("id") for m in client.messages if isinstance(m, dict)}


async def _connect_lockstep(server: Server, nursery: trio.Nursery) -> tuple[RawClient, ConnectionShell]:
    """A connection whose ``send_all`` returns only once the server has read the data."""
    client_end, server_end = trio.testing.lockstep_stream_pair()
    before = set(server.connections)
    nursery.start_soon(server.handle_stream, server_end, "lockstep")
    client = RawClient(client_end)
    nursery.start_soon(client.pump)
    await trio.testing.wait_all_tasks_blocked()
    (shell,) = set(server.connections) - before
    await client.initialize()
    return client, shell


async def test_conformance_reading_pauses_at_four_times_inflight() -> None:
    """With max_inflight_requests=1 and the one running prompt held, the server reads until exactly four
    requests wait unstarted, then stops reading (the client's send_all blocks: backpressure, no error);
    once the prompt finishes it resumes and every request is answered."""
    backend = FakeBackend()
    backend.hold("held")
    async with running_server(Limits(max_inflight_requests=1), backend) as (server, nursery):
        client, shell = await _connect_lockstep(server, nursery)
        session_id, _ = await client.new_session()
        held = await send_prompt(client, nursery, session_id, "held")
        await backend.started("held")

        total = 10
        receivers: list[trio.MemoryReceiveChannel[dict[str, Any]]] = []
        sent = 0
        all_sent = trio.Event()

        async def sender() -> None:
            nonlocal sent
            for i in range(total):
                id, receive = client.start_request(PROBE, id=f"q{i}")
                receivers.append(receive)
                await client.send(request(id, PROBE))
                sent += 1
            all_sent.set()

        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == 4  # four read and waiting; the fifth write blocks because nothing reads it
        assert shell.inflight == 1
        answers_so_far = [m for m in client.messages if not _is_turn_state(m)]
        assert len(answers_so_far) == 2 and client.errors == []  # only initialize and session/new

        backend.release("held")
        with trio.fail_after(10):
            assert (await held.wait())["result"]["stopReason"] == "end_turn"
            await all_sent.wait()
            answers = [await receive.receive() for receive in receivers]
        assert [a["id"] for a in answers] == [f"q{i}" for i in range(total)]
        assert all("limits" in a["result"] for a in answers)
        assert client.errors == []


# --- too large ------------------------------------------------------------------------------------------


async def test_conformance_too_large_closes_connection() -> None:
    """A line over max-message-bytes gets -32600 message_too_large with the limit, then the connection
    closes; other connections do not notice and new ones work."""
    async with running_server(Limits(max_message_bytes=1024)) as (server, nursery):
        observer = await connect(server, nursery)
        client = await connect(server, nursery)
        await client.send_raw(line(request("big", "session/new", {"cwd": "/" + "x" * 4000})))
        with trio.fail_after(10):
            await client.eof.wait()
        [msg] = client.messages[1:]
        data = check_error(msg, -32600, "message_too_large", id=None)
        assert data == {"errorKind": "message_too_large", "limit": 1024}
        assert server.bridge.sessions == {}
        await assert_untouched(observer)
        fresh = await connect(server, nursery)
        assert "result" in await fresh.call_raw(PROBE)


async def test_conformance_60_mib_line_memory_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 MiB line streamed in chunks against the default 50 MiB limit: the server's line buffer never
    holds more than the limit plus one read, the sender gets message_too_large and is disconnected,
    another connection keeps getting answers throughout, and a new connection works afterwards."""
    peak = 0
    feed = LineBuffer.feed

    def tracking_feed(self: LineBuffer, data: bytes | bytearray) -> None:
        nonlocal peak
        feed(self, data)
        peak = max(peak, self.buffered)

    monkeypatch.setattr(LineBuffer, "feed", tracking_feed)
    limits = Limits()
    assert limits.max_message_bytes == 50 * MiB
    async with running_server(limits) as (server, nursery):
        observer = await connect(server, nursery)
        client = await connect(server, nursery)
        chunk = b"x" * MiB
        sent = 0
        answered = 0
        try:
            await client.send_raw(b'{"jsonrpc":"2.0","id":"huge","method":"session/new","params":{"cwd":"/')
            for i in range(60):
                await client.send_raw(chunk)
                sent += 1
                await trio.testing.wait_all_tasks_blocked()  # let the server consume it
                if i % 8 == 0:
                    assert "result" in await observer.call_raw(PROBE)
                    answered += 1
            await client.send_raw(b'"}}\n')
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        with trio.fail_after(10):
            await client.eof.wait()
        assert 50 <= sent <= 52  # the server stopped taking bytes just past the limit
        assert answered >= 6
        assert 50 * MiB < peak <= 50 * MiB + 65536
        [msg] = client.messages[1:]
        assert check_error(msg, -32600, "message_too_large", id=None)["limit"] == 50 * MiB
        assert server.bridge.sessions == {}
        await assert_untouched(observer)
        fresh = await connect(server, nursery)
        session_id, _ = await fresh.new_session()
        assert (await fresh.prompt(session_id, "after"))["stopReason"] == "end_turn"


# --- garbage ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("garbage", "expected"),
    [
        (b"\xff\xfe\xfd\x00\x01\x02", [(-32700, "parse_error")]),
        (b"\x80\x81 not utf-8 \xc3\x28", [(-32700, "parse_error")]),
        (b'{"jsonrpc":"2.0","id":"g","method":"\xc3\x28"}', [(-32700, "parse_error")]),
        (b'{"jsonrpc":"2.0","id":"g","method":"session/new","params":{"cwd":"/tm', [(-32700, "parse_error")]),
        (b"\x00" * 100, [(-32700, "parse_error")]),
        (b'{"jsonrpc":"2.0","id":"g","method":"session/new","params":{"cwd":["/"]}}', [(-32602, "invalid_params")]),
        (b'{"jsonrpc":"2.0","id":"g","method":true}', [(-32600, "invalid_request")]),
        (b'{"jsonrpc":["2.0"],"id":"g","method":"x"}', [(-32600, "invalid_request")]),
        (b'{"jsonrpc":"2.0","id":"g","method":"../../etc/passwd"}', [(-32601, "method_not_found")]),
        (b'{"jsonrpc":"2.0","id":"g","method":"session/prompt","params":{"sessionId":"nope","prompt":[{"type":"text","text":"x"}]}}', [(-32002, "session_not_found")]),
        (b'{"jsonrpc":"2.0","id":"g","result":{"ok":true}}', []),
        (b'{"jsonrpc":"2.0","id":123456,"error":{"code":-1,"message":"x"}}', []),
        (b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}', []),
        (b"\r", []),
        (b"   \t ", []),
    ],
    ids=[
        "binary", "invalid-utf8", "invalid-utf8-in-string", "truncated-json", "nul-bytes", "wrong-param-type",
        "method-not-a-string", "jsonrpc-not-a-string", "unknown-method", "unknown-session", "response-unknown-id",
        "error-response-unknown-id", "error-response-null-id", "lone-cr", "whitespace",
    ],
)
async def test_conformance_garbage_is_contained(
    garbage: bytes, expected: list[tuple[int, str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Binary bytes, invalid UTF-8, truncated JSON, wrong types, unknown methods and responses to unknown
    ids each get their one proper answer (or none, for responses: they are logged and dropped); the
    same connection then still works and another connection never notices."""
    async with running_server() as (server, nursery):
        observer = await connect(server, nursery)
        client = await connect(server, nursery)
        with caplog.at_level(logging.WARNING, logger="acp_server"):
            got = await exchange(client, garbage + b"\n")
        assert [(m["error"]["code"], m["error"]["data"]["errorKind"]) for m in got] == expected
        if b'"result"' in garbage or b'"error"' in garbage:
            assert "dropping a response" in caplog.text or "without an id" in caplog.text
        session_id, _ = await client.new_session()
        assert (await client.prompt(session_id, "ok"))["stopReason"] == "end_turn"
        await assert_untouched(observer)


async def test_conformance_garbage_stream_then_normal_use() -> None:
    """A long mixed stream of garbage lines in one write gets one answer per bad message, in order, and
    the connection (and a neighbour) carry on."""
    async with running_server() as (server, nursery):
        observer = await connect(server, nursery)
        client = await connect(server, nursery)
        lines = [b"\xff" * 10, b"{", b"[]", b"7", b'{"jsonrpc":"2.0","id":"x","result":1}', b"", b"{}"] * 20
        got = await exchange(client, b"\n".join(lines) + b"\n")
        assert [m["error"]["code"] for m in got] == [-32700, -32700, -32600, -32600, -32600] * 20
        assert all(m["id"] is None for m in got)
        await assert_untouched(observer)


async def test_conformance_client_request_responses_routed() -> None:
    """A response from the client is routed to the server's request that asked (by id), while stray
    ones are dropped: the shell's own request waits for exactly its answer."""
    async with running_server() as (server, nursery):
        client, shell = await connect_shell(server, nursery)
        result: list[Any] = []

        async def ask() -> None:
            result.append(await shell.request("fs/read_text_file", {"path": "/x"}))

        nursery.start_soon(ask)
        with trio.fail_after(10):
            while not client.requests_from_server:
                await trio.testing.wait_all_tasks_blocked()
        [req] = client.requests_from_server
        assert req["method"] == "fs/read_text_file" and req["params"] == {"path": "/x"}
        assert await exchange(client, line({"jsonrpc": "2.0", "id": "not-ours", "result": {}})) == []
        await client.send({"jsonrpc": "2.0", "id": req["id"], "result": {"content": "hi"}})
        with trio.fail_after(10):
            while not result:
                await trio.testing.wait_all_tasks_blocked()
        assert result[0].result == {"content": "hi"} and result[0].method == "fs/read_text_file"
        assert shell.core.pending_requests == {}
