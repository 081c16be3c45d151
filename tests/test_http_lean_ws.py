"""The WebSocket's own frames (``transports/http/lean_ws.py``): the codec against wsproto's, and a live
``/acp`` WebSocket fed by hand: frames split anywhere, every kind of frame the shortcut leaves to
wsproto (ping, fragments, bad UTF-8, too long, close), ``permessage-deflate`` declined.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Pong,
    TextMessage,
)
from wsproto.events import Request as WsRequest
from wsproto.frame_protocol import FrameProtocol, Opcode

from acp_server.admission import Limits
from acp_server.transports.http.lean_ws import frame_text, parse_text_frames

from .http_helpers import INIT, TIMEOUT_S, http_server

#: texts whose frames take each length form: 7-bit, 16-bit (126..65535 bytes) and 64-bit (more)
_texts = st.lists(
    st.builds(lambda t, n: t * n, st.text(min_size=1, max_size=4), st.sampled_from([1, 30, 70_000])),
    max_size=4,
)


def _client_frames(texts: list[str]) -> bytes:
    proto = FrameProtocol(client=True, extensions=[])  # masked, as a client sends
    return b"".join(proto.send_data(t, fin=True) for t in texts)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.text(max_size=400), max_size=5), cuts=st.lists(st.integers(0, 4000), max_size=6))
def test_masked_text_frames_split_anywhere_read_as_wsproto_reads_them(
    texts: list[str], cuts: list[int]
) -> None:
    wire = _client_frames(texts)
    got: list[str] = []
    partial = b""
    points = sorted({c % (len(wire) + 1) for c in cuts}) + [len(wire)]
    start = 0
    for point in points:
        buf = partial + wire[start:point]
        start = point
        found, taken, other = parse_text_frames(buf, 1 << 20)
        assert not other
        got += found
        partial = buf[taken:]
    assert got == texts and partial == b""


@settings(max_examples=30, deadline=None)
@given(texts=_texts)
def test_the_three_length_forms_both_ways(texts: list[str]) -> None:
    """7-bit, 16-bit and 64-bit lengths: our server frames read back by a wsproto client, a wsproto
    client's frames read by us."""
    found, taken, other = parse_text_frames(_client_frames(texts), 1 << 24)
    assert (found, other) == (texts, False)
    client = WSConnection(ConnectionType.CLIENT)
    proto = client._proto = FrameProtocol(client=True, extensions=[])
    data = b"".join(frame_text(t.encode()) for t in texts)
    proto.receive_bytes(data)
    assert [f.payload for f in proto.received_frames()] == texts


def test_what_is_not_a_plain_text_frame_is_left_where_it_starts() -> None:
    proto = FrameProtocol(client=True, extensions=[])
    first = proto.send_data("first", fin=True)
    limit = 100
    cases = {
        "ping": proto.ping(b"p"),
        "close": proto.close(1000),
        "binary": proto.send_data(b"\x00\x01", fin=True),
        "a fragment": proto.send_data("par", fin=False),
        "not UTF-8": _masked_frame(0x81, b"\xff\xfe"),
        "too long": proto.send_data("x" * (limit + 1), fin=True),
        "unmasked": bytes((0x81, 2)) + b"hi",
        "a reserved bit": _masked_frame(0xC1, b"hi"),
    }
    for name, frame in cases.items():
        found, taken, other = parse_text_frames(first + frame + first, limit)
        assert (found, taken, other) == (["first"], len(first), True), name
    # a head not all in yet is kept, whatever its length form
    for head in (b"\x81", b"\x81\xfe\x00", b"\x81\xff" + b"\x00" * 7):
        assert parse_text_frames(first + head, limit) == (["first"], len(first), False)
    assert parse_text_frames(_masked_frame(0x81, b""), limit) == ([""], 6, False)  # empty text


def _masked_frame(first_byte: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    assert len(payload) < 126
    return (
        bytes((first_byte, 0x80 | len(payload)))
        + mask
        + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    )


class _Ws:
    """A WebSocket client of ``/acp`` by hand: wsproto for the handshake and for reading, raw bytes out."""

    def __init__(self, sock: trio.SocketStream, ws: WSConnection, accept: AcceptConnection) -> None:
        self.sock, self.ws, self.accept = sock, ws, accept
        self.events: list[Any] = []

    @classmethod
    async def open(cls, url: str, extensions: list[Any] | None = None) -> _Ws:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = await trio.open_tcp_stream(host, int(port))
        ws = WSConnection(ConnectionType.CLIENT)
        await sock.send_all(
            ws.send(WsRequest(host=f"{host}:{port}", target="/acp", extensions=extensions or []))
        )
        while True:
            data = await sock.receive_some(65536)
            assert data, "closed during the handshake"
            ws.receive_data(data)
            for event in ws.events():
                assert isinstance(event, AcceptConnection), event
                return cls(sock, ws, event)

    async def next_event(self) -> Any:
        while not self.events:
            data = await self.sock.receive_some(65536)
            self.ws.receive_data(data if data else None)
            self.events += list(self.ws.events())
            if not data and not self.events:
                raise AssertionError("the server closed the socket without a close frame")
        return self.events.pop(0)

    async def message(self) -> dict[str, Any]:
        text = ""
        while True:
            event = await self.next_event()
            if isinstance(event, TextMessage):
                text += event.data
                if event.message_finished:
                    return dict(json.loads(text))
            elif not isinstance(event, Pong):
                raise AssertionError(f"expected a message, got {event!r}")

    async def answer(self, request_id: int) -> dict[str, Any]:
        while True:
            message = await self.message()
            if message.get("id") == request_id and "method" not in message:
                return message


@asynccontextmanager
async def _ws(url: str, extensions: list[Any] | None = None) -> AsyncIterator[_Ws]:
    ws = await _Ws.open(url, extensions)
    async with ws.sock:
        yield ws


def _request(request_id: int, method: str, **params: Any) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})


async def _session(ws: _Ws) -> str:
    await ws.sock.send_all(_client_frames([json.dumps(INIT)]))
    assert "result" in await ws.answer(0)
    await ws.sock.send_all(_client_frames([_request(1, "session/new", cwd="/tmp", mcpServers=[])]))
    return str((await ws.answer(1))["result"]["sessionId"])


def _prompt(request_id: int, sid: str, text: str) -> str:
    return _request(request_id, "session/prompt", sessionId=sid, prompt=[{"type": "text", "text": text}])


async def test_deflate_is_declined_and_frames_split_byte_by_byte_are_read_whole(monkeypatch: Any) -> None:
    from wsproto.extensions import PerMessageDeflate

    from acp_server.transports.http import lean_ws

    calls = {"receive_frames": 0, "send_texts_nowait": 0, "wsproto_reads": 0}
    for name in ("receive_frames", "send_texts_nowait"):
        original = getattr(lean_ws.LeanWSStream, name)

        def counted(self: Any, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(lean_ws.LeanWSStream, name, counted)
    original_handle = lean_ws.WSStream.handle

    async def handle(self: Any, event: Any) -> None:
        calls["wsproto_reads"] += isinstance(event, lean_ws.Data)
        await original_handle(self, event)

    monkeypatch.setattr(lean_ws.WSStream, "handle", handle)
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_, _, url), _ws(url, extensions=[PerMessageDeflate()]) as ws:
            assert ws.accept.extensions == []  # answered without permessage-deflate: frames go uncompressed
            sid = await _session(ws)
            wire = _client_frames([_prompt(2, sid, "one two"), _prompt(3, sid, "three")])
            for i in range(
                len(wire)
            ):  # every byte its own write: the frames' heads and bodies split everywhere
                await ws.sock.send_all(wire[i : i + 1])
                await trio.sleep(0.001)  # (each read of the server then holds one byte)
            words: list[str] = []
            answers = {}
            while len(answers) < 2:
                message = await ws.message()
                if message.get("method") == "session/update":
                    update = message["params"]["update"]
                    if update["sessionUpdate"] == "agent_message_chunk":
                        words.append(update["content"]["text"])
                elif message.get("id") in (2, 3):
                    answers[message["id"]] = message["result"]["stopReason"]
            assert answers == {2: "end_turn", 3: "end_turn"} and "".join(words) == "one twothree"
        # the shortcut carried it all: every read, every batch of answers; wsproto read nothing
        assert calls["receive_frames"] >= len(wire) and calls["send_texts_nowait"] >= 3
        assert calls["wsproto_reads"] == 0


async def test_after_a_ping_and_a_fragmented_message_wsproto_reads_on_and_answers_them() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_, _, url), _ws(url) as ws:
            sid = await _session(ws)
            proto = FrameProtocol(client=True, extensions=[])
            text = _prompt(2, sid, "after ping")
            # a ping between two plain frames, in one write: the first is ours, the ping and all after it wsproto's
            await ws.sock.send_all(
                proto.send_data(_prompt(3, sid, "before"), fin=True)
                + proto.ping(b"hi")
                + proto.send_data(text, fin=True)
            )
            got_pong = False
            answers = set()
            while len(answers) < 2 or not got_pong:
                event = await ws.next_event()
                if isinstance(event, Pong):
                    got_pong = got_pong or event.payload == b"hi"
                elif isinstance(event, TextMessage):
                    message = json.loads(event.data)
                    if message.get("id") in (2, 3) and "result" in message:
                        answers.add(message["id"])
            fragmented = _prompt(4, sid, "in parts")
            await ws.sock.send_all(proto.send_data(fragmented[:10], fin=False))
            await trio.sleep(0.05)
            await ws.sock.send_all(proto.send_data(fragmented[10:], fin=True))
            assert (await ws.answer(4))["result"]["stopReason"] == "end_turn"
            await ws.sock.send_all(ws.ws.send(Ping(b"again")))
            while not isinstance(await ws.next_event(), Pong):
                pass


async def test_bad_utf8_and_a_message_too_long_end_their_connection_and_others_go_on() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_message_bytes=4096)) as (_, _, url), _ws(url) as other:
            sid = await _session(other)
            # too long: hypercorn's close 1009; not UTF-8: wsproto fails to parse it and hypercorn ends the
            # connection without a close frame (1006 to the client), as it did before the shortcut
            for frame, code in (
                (_masked_frame(0x81, b"\xff\xfe"), 1006),
                (FrameProtocol(client=True, extensions=[]).send_data("x" * 5000, fin=True), 1009),
            ):
                async with _ws(url) as ws:
                    await _session(ws)
                    await ws.sock.send_all(frame)
                    event = await ws.next_event()
                    while not isinstance(event, CloseConnection):
                        event = await ws.next_event()
                    assert event.code == code
            await other.sock.send_all(_client_frames([_prompt(9, sid, "still here")]))
            assert (await other.answer(9))["result"]["stopReason"] == "end_turn"


async def test_a_close_frame_is_answered_and_the_server_sends_nothing_after_it() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_, _, url), _ws(url) as ws:
            await _session(ws)
            await ws.sock.send_all(ws.ws.send(CloseConnection(code=1000)))
            event = await ws.next_event()
            while not isinstance(event, CloseConnection):
                assert isinstance(event, (TextMessage, Message)), event
                event = await ws.next_event()
            assert event.code == 1000
            tail = b""
            with trio.move_on_after(2):
                while data := await ws.sock.receive_some(65536):
                    tail += data
            # nothing but the end of the stream after the server's close frame
            proto = FrameProtocol(client=True, extensions=[])
            proto.receive_bytes(tail)
            assert [f.opcode for f in proto.received_frames()] in ([], [Opcode.CLOSE])


async def test_sequential_prompts_are_written_without_the_outboxs_writer_task(monkeypatch: Any) -> None:
    """A WebSocket's shell writes as a socket's does: what a pass queued leaves at its end, a pass's
    first answer at once, through the peer's ``write_nowait``; its outbox's writer task, and the
    peer's ``send_all`` behind it, are not used."""
    from acp_server.transports.http.peer import MessagePeer

    calls = {"send_all": 0, "write_nowait": 0}
    send_all, write_nowait = MessagePeer.send_all, MessagePeer.write_nowait

    async def counted_send_all(self: MessagePeer, data: Any) -> None:
        calls["send_all"] += 1
        await send_all(self, data)

    def counted_write_nowait(self: MessagePeer, data: bytes) -> int:
        calls["write_nowait"] += 1
        return write_nowait(self, data)

    monkeypatch.setattr(MessagePeer, "send_all", counted_send_all)
    monkeypatch.setattr(MessagePeer, "write_nowait", counted_write_nowait)
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_, _, url), _ws(url) as ws:
            sid = await _session(ws)
            for n in range(2, 12):
                await ws.sock.send_all(_client_frames([_prompt(n, sid, "one two three")]))
                assert (await ws.answer(n))["result"]["stopReason"] == "end_turn"
    assert calls["send_all"] == 0 and calls["write_nowait"] >= 10


async def test_a_reader_with_a_small_window_gets_every_message_in_order(monkeypatch: Any) -> None:
    """Bursts the kernel takes only part of are queued on the socket's writer (also when the outbox
    writes them at the end of a pass, just before trio waits for I/O: the run loop is woken for that
    writer); bursts past the writer's bound go through the peer's queue. A client that reads late,
    through a small receive window, gets every message of every turn, in order."""
    import socket as stdlib_socket

    from acp_server.transports.http import lean_ws

    queued = {"bursts": 0}
    original = lean_ws.LeanWSStream.send_texts_nowait

    def counted(self: Any, payloads: list[bytes]) -> bool:
        done = original(self, payloads)
        queued["bursts"] += bool(done and self.batched is not None and self.batched.queued)
        return done

    monkeypatch.setattr(lean_ws.LeanWSStream, "send_texts_nowait", counted)
    real_socket = trio.socket.socket

    def small_window(*args: Any, **kwargs: Any) -> Any:
        sock = real_socket(*args, **kwargs)
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVBUF, 4096)
        return sock

    words = [f"w{i:04d} " for i in range(600)]
    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (_, _, url):
            monkeypatch.setattr(trio.socket, "socket", small_window)  # the client's socket only
            async with _ws(url) as ws:
                monkeypatch.setattr(trio.socket, "socket", real_socket)
                sid = await _session(ws)
                prompts = [_prompt(n, sid, "".join(words[: 100 * n])) for n in (2, 3, 4, 5)]
                await ws.sock.send_all(_client_frames(prompts))
                await trio.sleep(0.3)  # not reading meanwhile
                seen: dict[str, list[str]] = {}
                order: list[int] = []
                while len(order) < 4:
                    message = await ws.message()
                    if message.get("method") == "session/update":
                        update = message["params"]["update"]
                        if update["sessionUpdate"] == "agent_message_chunk":
                            seen.setdefault(str(len(order) + 2), []).append(update["content"]["text"])
                    elif "id" in message:
                        assert message["result"]["stopReason"] == "end_turn"
                        order.append(message["id"])
    assert order == [2, 3, 4, 5]
    assert all(seen[str(n)] == words[: 100 * n] for n in order)
    assert queued["bursts"] >= 1  # (the kernel did take less than a burst: the case this is about)


def _blocking_turn(url: str, words: list[str], rcvbuf: int) -> tuple[list[str], float, str]:
    """In a thread (the server's run loop is not woken by this client's reads): a WebSocket client of
    ``/acp`` with stdlib blocking sockets and a small receive window; one prompt of ``words``. Returns
    the chunks read, how long after the prompt the last one came, and the answer's stop reason."""
    import socket as stdlib_socket
    import time

    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = stdlib_socket.socket()
    sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT_S)
    sock.connect((host, int(port)))
    ws = WSConnection(ConnectionType.CLIENT)
    events: list[Any] = []

    def event() -> Any:
        while not events:
            data = sock.recv(65536)
            ws.receive_data(data or None)
            events.extend(ws.events())
            assert data or events, "the server closed the socket"
        return events.pop(0)

    def message() -> dict[str, Any]:
        text = ""
        while True:
            got = event()
            if isinstance(got, TextMessage):
                text += got.data
                if got.message_finished:
                    return dict(json.loads(text))
            else:
                assert isinstance(got, (AcceptConnection, Pong)), got

    def answer(request_id: int) -> dict[str, Any]:
        while True:
            got = message()
            if got.get("id") == request_id and "method" not in got:
                return got

    try:
        sock.sendall(ws.send(WsRequest(host=f"{host}:{port}", target="/acp")))
        assert isinstance(event(), AcceptConnection)
        sock.sendall(_client_frames([json.dumps(INIT)]))
        answer(0)
        sock.sendall(_client_frames([_request(1, "session/new", cwd="/tmp", mcpServers=[])]))
        sid = str(answer(1)["result"]["sessionId"])
        sock.sendall(_client_frames([_prompt(2, sid, "".join(words))]))
        sent = time.monotonic()
        chunks: list[str] = []
        while len(chunks) < len(words):
            got = message()
            assert "id" not in got, "the answer came before the turn's updates"
            if got.get("method") == "session/update":
                update = got["params"]["update"]
                if update["sessionUpdate"] == "agent_message_chunk":
                    chunks.append(update["content"]["text"])
        took = time.monotonic() - sent
        return chunks, took, answer(2)["result"]["stopReason"]
    finally:
        sock.close()


async def test_a_burst_queued_at_the_end_of_a_pass_is_written_on_before_the_turn_ends() -> None:
    """A turn still under way (its answer seconds off) whose updates the kernel takes only part of: the
    rest is queued on the socket's writer by the outbox's write at the end of the pass, just before trio
    waits for I/O, and the run loop is woken for that writer then, so the updates arrive while the turn
    runs, not when some timer next wakes the loop. The client is a thread with blocking sockets: its
    reads do not wake the server's run loop, as an in-process trio client's would."""
    from acp_server.backends.echo import EchoBackend

    words = [f"w{i:04d} " for i in range(600)]
    delay_s = 3.0
    with trio.fail_after(TIMEOUT_S + delay_s):
        async with http_server(backend=EchoBackend(delay_ms=int(delay_s * 1000))) as (_, _, url):
            chunks, took, stop = await trio.to_thread.run_sync(_blocking_turn, url, words, 4096)
    assert chunks == words and stop == "end_turn"
    # ~0.02 s here; without the wake-up they wait for the loop's next timer (~1 s: a second's tick)
    assert took < 0.5, f"the updates waited {took:.2f} s for the run loop to come round"
