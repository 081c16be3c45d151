"""The pure parts of ``/acp``: the request rules, the error body, and the message peer's routing
(a :class:`MessagePeer` driven by hand, no network, no shell)."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest
import trio
import trio.testing

from acp_server.errors import (
    BatchNotSupportedError,
    InvalidRequestError,
    ParseError,
    SessionNotEstablishedError,
)
from acp_server.transports.http.peer import MessagePeer
from acp_server.transports.http.rules import (
    HostRules,
    check_accept,
    check_content_type,
    cors_headers,
    decode_inbound,
    error_body,
    sse_frame,
)


def test_host_rules() -> None:
    rules = HostRules(port=4171)
    for ok in ("127.0.0.1:4171", "localhost", "LOCALHOST:4171", "[::1]:4171", "127.0.0.1"):
        assert rules.check_host(ok) is None, ok
    for bad in ("evil.example", "127.0.0.1:80", "localhost.evil.example", "[::1", "", None):
        refusal = rules.check_host(bad)
        assert refusal is not None and refusal.kind == "forbidden_host" and refusal.status == 403, bad
    assert HostRules(port=None).check_host("localhost:1234") is None  # a Unix socket has no port


def test_origin_rules_and_cors() -> None:
    rules = HostRules(port=4171, allow_origins=frozenset({"https://app.example"}))
    assert rules.check_origin(None) is None  # not a browser
    assert rules.check_origin("http://localhost:4171") is None
    assert rules.check_origin("https://app.example") is None
    for bad in ("https://app.example.evil", "http://localhost:4172", "null", "https://APP.example:443"):
        refusal = rules.check_origin(bad)
        assert refusal is not None and refusal.kind == "forbidden_origin", bad
    headers = dict(cors_headers("https://app.example", rules, preflight=True))
    assert headers[b"access-control-allow-origin"] == b"https://app.example"
    assert b"Acp-Session-Id" in headers[b"access-control-expose-headers"]
    assert b"DELETE" in headers[b"access-control-allow-methods"]
    assert cors_headers("https://evil.example", rules) == [] and cors_headers(None, rules) == []


def test_content_negotiation() -> None:
    assert check_content_type("application/json") is None
    assert check_content_type("Application/JSON; charset=utf-8") is None
    assert check_content_type("text/plain") is not None and check_content_type(None) is not None
    assert check_accept("text/event-stream") is None
    assert check_accept("application/json, text/event-stream;q=0.9") is None
    assert check_accept("*/*") is None
    assert check_accept("text/html") is not None and check_accept(None) is not None


def test_decode_inbound() -> None:
    env = decode_inbound(b'{"jsonrpc":"2.0","id":3,"method":"session/prompt","params":{"sessionId":"s1","prompt":[]}}')
    assert (env.id, env.method, env.is_request, env.params_session()) == (3, "session/prompt", True, "s1")
    note = decode_inbound(b'{"jsonrpc":"2.0","method":"session/cancel","params":{"sessionId":"s1"}}')
    assert not note.is_request and not note.is_response
    answer = decode_inbound(b'{"jsonrpc":"2.0","id":"x","result":{"outcome":{}}}')
    assert answer.is_response and answer.result_session() is None
    assert decode_inbound(b'{"id":1,"method":"m","params":[1,2]}').params_session() is None
    with pytest.raises(ParseError):
        decode_inbound(b'{"id":')
    with pytest.raises(BatchNotSupportedError):
        decode_inbound(b' [{"id":1}]')
    with pytest.raises(ParseError):
        decode_inbound(b"[{")
    with pytest.raises(InvalidRequestError):
        decode_inbound(b'"text"')


def test_error_body_flattens_the_data() -> None:
    body = json.loads(error_body(SessionNotEstablishedError(session_id="s9")))
    assert body == {"error": body["error"], "code": "session_not_established", "sessionId": "s9"}
    assert "s9" in body["error"]


def test_sse_frame() -> None:
    assert sse_frame([b'{"a":1}', b'{"b":2}']) == b'data: {"a":1}\n\ndata: {"b":2}\n\n'


def _msg(**fields: object) -> bytes:
    return msgspec.json.encode({"jsonrpc": "2.0", **fields}) + b"\n"


async def test_peer_routes_by_request_and_session() -> None:
    """Answers follow their requests; notifications follow ``params.sessionId`` once the session is
    established here; everything else, and everything before, goes to the connection stream."""
    peer = MessagePeer(limit=1 << 20)
    new = decode_inbound(b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"cwd":"/"}}')
    peer.note_request(new, None)
    await peer.send_all(_msg(method="session/update", params={"sessionId": "s1", "n": 0}))  # before: a replay
    await peer.send_all(_msg(id=1, result={"sessionId": "s1"}))
    assert peer.has_session("s1") and peer.established == {"s1"}
    prompt = decode_inbound(b'{"jsonrpc":"2.0","id":2,"method":"session/prompt","params":{"sessionId":"s1"}}')
    peer.note_request(prompt, "s1")
    stats = decode_inbound(b'{"jsonrpc":"2.0","id":3,"method":"_acp_server/stats"}')
    peer.note_request(stats, None)
    await peer.send_all(
        _msg(method="session/update", params={"sessionId": "s1", "n": 1})
        + _msg(method="session/update", params={"sessionId": "other", "n": 2})
        + _msg(id=9, method="session/request_permission", params={"sessionId": "s1"})
        + _msg(id=2, result={"stopReason": "end_turn"})
        + _msg(id=3, result={})
        + b'[{"jsonrpc":"2.0","id":4,"result":{}}]\n'
    )
    session = [json.loads(line) for line in peer.session_queue("s1").lines]
    connection = [json.loads(line) for line in peer.connection.lines]
    assert [m.get("id", m.get("params", {}).get("n")) for m in session] == [1, 9, 2]
    assert [m.get("id", m.get("params", {}).get("n")) if isinstance(m, dict) else "batch" for m in connection] == [
        0, 1, 2, 3, "batch"
    ]


async def test_peer_load_lets_the_stream_open_early_and_failures_establish_nothing() -> None:
    peer = MessagePeer(limit=1 << 20)
    load = decode_inbound(b'{"jsonrpc":"2.0","id":1,"method":"session/load","params":{"sessionId":"s2"}}')
    peer.note_request(load, None)
    assert peer.may_stream("s2") and not peer.has_session("s2")
    await peer.send_all(_msg(id=1, error={"code": -32002, "message": "no"}))
    assert not peer.may_stream("s2") and not peer.has_session("s2")
    peer.note_request(load, None)
    await peer.send_all(_msg(id=1, result={}))
    assert peer.has_session("s2")


async def test_peer_send_all_waits_for_a_reader_and_input_reads_as_a_stream() -> None:
    """Past ``limit`` queued bytes, the shell's write waits until a reader hands them on; what the
    HTTP layer feeds comes out as NDJSON; the end of input is an empty read."""
    peer = MessagePeer(limit=64, multiplex=True)
    done = trio.Event()

    async def write() -> None:
        await peer.send_all(_msg(method="x", params={"pad": "p" * 100}))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set() and peer.connection.nbytes > 64
        lines = await peer.connection.take()
        assert lines is not None
        peer.connection.sent(lines)
        await done.wait()
    peer.feed(b'{"a":1}')
    peer.feed(b'{"b":2}')
    assert await peer.receive_some() == b'{"a":1}\n{"b":2}\n'
    peer.end_input()
    assert await peer.receive_some() == b""
    await peer.aclose()
    assert await peer.connection.take() is None
    with pytest.raises(trio.ClosedResourceError):
        await peer.send_all(b"{}\n")


class _FrameWriter:
    """A lean WebSocket's frame writer, by hand: what it took, and whether it takes more (its socket's bound)."""

    def __init__(self) -> None:
        self.written: list[list[bytes]] = []
        self.accept = True

    def __call__(self, lines: list[bytes]) -> bool:
        if self.accept:
            self.written.append(list(lines))
        return self.accept


async def test_a_websocket_peer_writes_through_its_frame_writer_only_when_nothing_waits_before() -> None:
    """With a frame writer (a lean WebSocket's), the shell's write goes straight to it while the queue
    is empty and no reader is handing lines on; otherwise, or when the writer says no (its socket's
    bound), the lines queue and count as before, so that nothing overtakes what is queued."""
    peer = MessagePeer(limit=1 << 20, multiplex=True)
    frames = peer.frames = _FrameWriter()
    written = frames.written
    queue = peer.connection
    await peer.send_all(b'{"a":1}\n{"b":2}\n')
    assert written == [[b'{"a":1}', b'{"b":2}']] and queue.lines == [] and queue.nbytes == 0

    frames.accept = False  # past the socket's bound: queued, counted
    await peer.send_all(b'{"c":3}\n')
    assert queue.lines == [b'{"c":3}'] and queue.nbytes == 7
    frames.accept = True  # lines wait in the queue: the next write queues behind them
    await peer.send_all(b'{"d":4}\n')
    assert queue.lines == [b'{"c":3}', b'{"d":4}'] and len(written) == 1
    lines = await queue.take()
    assert lines is not None
    queue.handing = True  # the reader still hands them on: a write may not pass them
    await peer.send_all(b'{"e":5}\n')
    assert queue.lines == [b'{"e":5}'] and len(written) == 1
    queue.handing = False
    queue.sent(lines)
    assert await queue.take() == [b'{"e":5}']
    await peer.send_all(b'{"f":' + b"6}\n{")  # a line not ended yet stays partial
    assert written[-1] == [b'{"f":6}']
    await peer.send_all(b'"g":7}\n')
    assert written[-1] == [b'{"g":7}']
    await peer.aclose()


async def test_a_websocket_peer_is_written_without_the_outboxs_writer_task() -> None:
    """With a frame writer the peer says it writes without a wait (the outbox then writes it at the end
    of each pass and a pass's first answer at once, as a socket); ``write_nowait`` takes whole lines or
    nothing, and nothing when lines wait before them, so the writer's ``send_all`` queues them in order."""
    from acp_server.transports.outbox import _writes_nowait

    assert not _writes_nowait(MessagePeer(limit=1 << 20, multiplex=False))  # HTTP+SSE: the writer task
    peer = MessagePeer(limit=1 << 20, multiplex=True)
    assert not _writes_nowait(peer)  # a WebSocket without a frame writer (not the lean stream)
    frames = peer.frames = _FrameWriter()
    written = frames.written
    assert _writes_nowait(peer)
    queue = peer.connection
    data = b'{"a":1}\n{"b":2}\n'
    assert peer.write_nowait(data) == len(data) and written == [[b'{"a":1}', b'{"b":2}']]
    assert peer.write_nowait(b'{"c":') == 0  # not a whole line: the writer's send_all keeps the part
    frames.accept = False  # past the socket's bound: nothing taken, nothing queued here
    assert peer.write_nowait(b'{"c":3}\n') == 0 and queue.lines == [] and len(written) == 1
    frames.accept = True
    queue.push(b'{"q":0}')  # lines wait for the pump: a write may not pass them
    assert peer.write_nowait(b'{"d":4}\n') == 0 and len(written) == 1
    assert await queue.take() == [b'{"q":0}']
    queue.handing = True
    assert peer.write_nowait(b'{"d":4}\n') == 0
    queue.handing = False
    await peer.send_all(b'{"e":')  # a part kept by send_all: the next whole lines go after it, there
    assert peer.write_nowait(b'{"f":6}\n') == 0
    await peer.send_all(b'5}\n')
    assert written[-1] == [b'{"e":5}']
    await peer.aclose()
    with pytest.raises(trio.ClosedResourceError):
        peer.write_nowait(b"{}\n")


async def test_a_read_that_waited_returns_in_the_step_it_wakes_in() -> None:
    """``receive_some`` yields once: in its wait, when it waited (no second pass for the shell to take
    what woke it), else at a schedule point of its own."""
    peer = MessagePeer(limit=1 << 20, multiplex=True)
    steps: dict[str, int] = {"reader": 0}
    got: list[bytes] = []

    class Steps(trio.abc.Instrument):
        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if task.name.endswith("reader"):
                steps["reader"] += 1

    async def reader() -> None:
        got.append(await peer.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.add_instrument(instrument := Steps())
        try:
            peer.feed(b'{"a":1}')
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(instrument)
    assert got == [b'{"a":1}\n'] and steps["reader"] == 1
    # Already there: a schedule point of its own all the same (this task's step ends in it, once).
    peer.feed(b'{"b":2}')
    me = trio.lowlevel.current_task()
    mine = {"steps": 0}

    class MySteps(trio.abc.Instrument):
        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            mine["steps"] += task is me

    trio.lowlevel.add_instrument(instrument := MySteps())
    try:
        assert await peer.receive_some() == b'{"b":2}\n'
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert mine["steps"] == 1


async def test_batched_writes_join_a_burst_and_report_a_broken_peer() -> None:
    """Writes made in one burst arrive in order, in one read; once the peer is gone, the next write
    fails with ``BrokenResourceError`` (as the socket's own would)."""
    from acp_server.transports.http.wire import BatchedWrites

    a, b = trio.socket.socketpair()
    ours, theirs = trio.SocketStream(a), trio.SocketStream(b)
    batched = BatchedWrites(ours)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batched.flusher)
        for part in (b"one ", b"two ", b"three"):
            await batched.send_all(part)
        assert await theirs.receive_some(100) == b"one two three"
        await theirs.aclose()
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):  # the first writes may still land in the kernel's buffer
                await batched.send_all(b"x" * 65536)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    await batched.aclose()


def test_http_flags_and_the_http_config_table(tmp_path: pathlib.Path) -> None:
    """``[http]`` in ``--config`` sets the listeners and bounds; flags override it; bad values name
    the flag or key."""
    from acp_server.cli import _build, http_from

    parser, serve = _build()
    config = tmp_path / "c.toml"
    config.write_text(
        '[http]\nlisten = ["http://127.0.0.1:0", "unix:/tmp/x.sock"]\nmax_connections = 7\n'
        'connection_grace_s = 2.5\nallow_origin = ["https://app.example"]\n'
    )
    args = parser.parse_args(["serve", "--config", str(config)])
    listen, options = http_from(args, serve)
    assert [str(a) for a in listen] == ["tcp://127.0.0.1:0", "unix:/tmp/x.sock"]
    assert (options.limits.max_connections, options.limits.connection_grace_s) == (7, 2.5)
    assert options.allow_origins == frozenset({"https://app.example"})
    args = parser.parse_args(
        ["serve", "--config", str(config), "--http-listen", "tcp://127.0.0.1:0", "--http-max-connections", "3",
         "--http-connection-grace-s", "0", "--http-allow-origin", "http://localhost:3000"]
    )
    listen, options = http_from(args, serve)
    assert [str(a) for a in listen] == ["tcp://127.0.0.1:0"]
    assert (options.limits.max_connections, options.limits.connection_grace_s) == (3, 0.0)
    assert options.allow_origins == frozenset({"http://localhost:3000"})
    assert http_from(parser.parse_args(["serve"]), serve) == ([], None)
    for bad in (["--http-listen", "ftp://x"], ["--http-max-connections", "0"], ["--http-allow-origin", "https://a.example/path"],
                ["--http-listen", "http://10.1.2.3:80"]):
        with pytest.raises(SystemExit):
            http_from(parser.parse_args(["serve", *bad]), serve)


async def test_peer_input_waits_while_the_shell_does_not_read() -> None:
    """What is fed past ``limit`` unread bytes waits (the POST or the WebSocket waits) until the shell
    reads; nothing is dropped."""
    peer = MessagePeer(limit=1 << 20)
    fed = trio.Event()

    async def feed_more() -> None:
        await peer.feed_when_room(b'{"n":2}', 8)
        fed.set()

    await peer.feed_when_room(b'{"n":1,"pad":"xxxxxxxx"}', 8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed_more)
        await trio.testing.wait_all_tasks_blocked()
        assert not fed.is_set()
        assert await peer.receive_some() == b'{"n":1,"pad":"xxxxxxxx"}\n'
        await fed.wait()
    assert await peer.receive_some() == b'{"n":2}\n'
