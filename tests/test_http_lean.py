"""The HTTP/1.1 shortcuts of ``transports/http/lean.py``: which requests are read without h11, and that
every request, read either way, gets the answer hypercorn's own path gives (framing, keep-alive and
close, a head held until its body, a streamed body chunked, errors)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypercorn.config import Config

from acp_server.transports.http.http1 import _HEADS_KEPT, _head, _heads_out
from acp_server.transports.http.lean import PARTIAL_MAX, SimpleRequest, simple_request
from acp_server.transports.http.listener import serve_app
from acp_server.transports.listeners import bind_tcp_socket

LIMIT = 16 * 1024


def test_a_plain_request_is_read_whole() -> None:
    """Names lowercased, values stripped (as h11 gives them), the body, and whether it keeps alive."""
    got = simple_request(b"POST /s/1/prompt?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type:  application/json \r\n"
                         b"Content-Length: 2\r\nConnection: Close\r\n\r\n{}", LIMIT)
    assert isinstance(got, SimpleRequest) and not got.missing
    assert (got.method, got.target, got.body, got.keep_alive) == (b"POST", b"/s/1/prompt?x=1", b"{}", False)
    assert got.headers == [(b"host", b"a"), (b"content-type", b"application/json"), (b"content-length", b"2"),
                           (b"connection", b"Close")]


def test_a_head_whose_small_body_is_not_in_yet_says_what_is_missing() -> None:
    got = simple_request(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n1234", LIMIT)
    assert isinstance(got, SimpleRequest) and got.missing == 6 and got.body == b"1234"
    big = f"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: {PARTIAL_MAX}\r\n\r\n".encode()
    assert simple_request(big, LIMIT) is None  # h11 streams a large body


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\n",  # the head is not all in
        b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: a\r\n\r\n",
        b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\nx",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n  folded\r\n\r\n",  # obs-fold
        b"GET / HTTP/1.1\r\nHost: a\r\nBad Name: 1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\n",  # pipelined: h11 keeps the order
        b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
)
def test_anything_not_plain_goes_to_h11(data: bytes) -> None:
    assert simple_request(data, LIMIT) is None


# --- over a socket --------------------------------------------------------------------------------


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/echo`` answers its body in one part; ``/parts`` in three (no length: chunked); ``/start``
    sends its head, waits, then its body; ``/fail`` raises before answering; ``/length`` gives its own
    ``content-length``."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("the app failed")
    if path == "/bad-header":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"a\x01b")]})
    headers = [(b"x-path", path.encode())]
    if path == "/length":
        headers.append((b"content-length", b"5"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path == "/parts":
        for part in (b"a", b"bb", b"ccc"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/start":
        await trio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"late"})
    elif path == "/length":
        await send({"type": "http.response.body", "body": b"12345"})
    elif path == "/head-then-fail":
        raise RuntimeError("the app failed after its head")
    else:
        await send({"type": "http.response.body", "body": b"echo:" + body})


class _InlineApp:
    """:func:`_app`, its POSTs served in the connection's reading task (as the REST API's are)."""

    def __init__(self) -> None:
        self.inline: list[bytes] = []

    def inline_request(self, method: bytes, path: bytes) -> bool:
        if method == b"POST":
            self.inline.append(path)
            return True
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _app(scope, receive, send)


@asynccontextmanager
async def _listener(app: Any = _app) -> AsyncIterator[int]:
    config = Config()
    config.accesslog = None
    config.errorlog = None
    sock = trio.SocketListener(await bind_tcp_socket("127.0.0.1", 0))
    async with sock, trio.open_nursery() as nursery:
        await nursery.start(serve_app, app, config, sock)
        yield sock.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def _exchange(port: int, *writes: bytes, pause: float = 0.0, until_closed: bool = False) -> bytes:
    """Write ``writes`` (``pause`` apart), then read until the peer closes or goes quiet."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        for data in writes:
            await stream.send_all(data)
            await trio.sleep(pause)
        got = b""
        with trio.move_on_after(10 if until_closed else 0.5):
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                got += data
        return got


async def test_a_whole_answer_has_its_length_and_the_connection_serves_the_next() -> None:
    async with _listener() as port:
        got = await _exchange(port, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi",
                              b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n", pause=0.1)
    first, _, rest = got.partition(b"echo:hi")
    assert first.startswith(b"HTTP/1.1 200 \r\n") and b"content-length: 7\r\n" in first and b"date: " in first
    assert b"transfer-encoding" not in first
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"content-length: 5\r\n\r\necho:")


async def test_a_body_after_its_head_in_another_write_is_waited_for() -> None:
    async with _listener() as port:
        got = await _exchange(port, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nab", b"cde", pause=0.1)
    assert got.endswith(b"\r\n\r\necho:abcde")


async def test_connection_close_is_answered_then_closed() -> None:
    async with _listener() as port:
        got = await _exchange(port, b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", until_closed=True)
    assert b"connection: close\r\n" in got and got.endswith(b"echo:")


async def test_a_body_in_parts_is_chunked_and_a_late_body_follows_its_head() -> None:
    async with _listener() as port:
        parts = await _exchange(port, b"GET /parts HTTP/1.1\r\nHost: a\r\n\r\n")
        late = await _exchange(port, b"GET /start HTTP/1.1\r\nHost: a\r\n\r\n")
        length = await _exchange(port, b"GET /length HTTP/1.1\r\nHost: a\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in parts and parts.endswith(b"\r\n\r\n1\r\na\r\n2\r\nbb\r\n3\r\nccc\r\n0\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in late and late.endswith(b"4\r\nlate\r\n0\r\n\r\n")
    assert length.count(b"content-length") == 1 and length.endswith(b"\r\n\r\n12345")


async def test_a_failed_app_is_answered_500_and_pipelined_requests_keep_their_order() -> None:
    async with _listener() as port:
        failed = await _exchange(port, b"GET /fail HTTP/1.1\r\nHost: a\r\n\r\n", until_closed=True)
        two = await _exchange(port, b"GET /one HTTP/1.1\r\nHost: a\r\n\r\nGET /two HTTP/1.1\r\nHost: a\r\n\r\n")
    assert failed.startswith(b"HTTP/1.1 500 ")
    assert two.index(b"x-path: /one") < two.index(b"x-path: /two") and two.count(b"HTTP/1.1 200") == 2


async def test_requests_h11_reads_get_the_same_answers() -> None:
    """HEAD, HTTP/1.0 and a chunked request body take hypercorn's own path, a malformed request
    h11's 400."""
    async with _listener() as port:
        head = await _exchange(port, b"HEAD /echo HTTP/1.1\r\nHost: a\r\n\r\n")
        old = await _exchange(port, b"GET /echo HTTP/1.0\r\nHost: a\r\n\r\n", until_closed=True)
        chunked = await _exchange(port, b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                                        b"2\r\nhi\r\n0\r\n\r\n")
        bad = await _exchange(port, b"GET /echo HTTP/1.1\r\nBad Name: x\r\n\r\n", until_closed=True)
    assert head.startswith(b"HTTP/1.1 200") and not head.endswith(b"echo:")
    assert old.startswith(b"HTTP/1.1 200") and old.endswith(b"echo:")
    assert chunked.startswith(b"HTTP/1.1 200") and b"echo:hi" in chunked
    assert bad.startswith(b"HTTP/1.1 400")


def test_a_head_read_again_is_the_same_request() -> None:
    """A head read before (kept parsed) gives the same request, its own list of headers, and its own
    body's checks (a body longer than its length goes to h11)."""
    data = b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n"
    one, two = simple_request(data + b"{}", LIMIT), simple_request(data + b"[]", LIMIT)
    assert one is not None and two is not None and one.headers == two.headers and one.headers is not two.headers
    assert (one.body, two.body) == (b"{}", b"[]")
    assert simple_request(data + b"{}x", LIMIT) is None
    bad = b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"
    assert simple_request(bad, LIMIT) is None and simple_request(bad, LIMIT) is None


def test_a_response_head_written_again_is_read_once() -> None:
    """The same status and headers give the same head, from the cache the second time; a header given
    as a list (unhashable) is read each time, and a bad one is refused each time."""
    _heads_out.clear()
    headers = [(b"content-type", b"application/json"), (b"x-a", b" b ")]
    first = _head(202, headers)
    assert first == (b"HTTP/1.1 202 \r\ncontent-type: application/json\r\nx-a: b\r\n", 0)
    assert _head(202, list(headers)) is first
    assert _head(202, [[b"content-length", b"2"]]) == (b"HTTP/1.1 202 \r\ncontent-length: 2\r\n", 1)  # type: ignore[list-item]
    for _ in range(2):
        with pytest.raises(ValueError, match="illegal response header"):
            _head(200, [(b"bad name", b"x")])
    assert len(_heads_out) == 1 <= _HEADS_KEPT


async def test_inline_requests_get_the_same_answers() -> None:
    """A request served in its connection's reading task: a whole answer in one write with its length,
    a body in parts chunked, a late body after its head, a failure before or after the head a 500 (the
    head not written yet is replaced), a header h11 would refuse a 500; the connection serves the next."""
    app = _InlineApp()
    async with _listener(app) as port:
        whole = await _exchange(port, b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi",
                                b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nyou", pause=0.1)
        parts = await _exchange(port, b"POST /parts HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
        late = await _exchange(port, b"POST /start HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
        failed = await _exchange(port, b"POST /head-then-fail HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
                                 until_closed=True)
        refused = await _exchange(port, b"POST /bad-header HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
                                  until_closed=True)
    assert app.inline == [b"/echo", b"/echo", b"/parts", b"/start", b"/head-then-fail", b"/bad-header"]
    first, _, rest = whole.partition(b"echo:hi")
    assert first.startswith(b"HTTP/1.1 200 \r\n") and b"content-length: 7\r\n" in first and b"x-path: /echo" in first
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"content-length: 8\r\n\r\necho:you")
    assert b"transfer-encoding: chunked\r\n" in parts and parts.endswith(b"\r\n\r\n1\r\na\r\n2\r\nbb\r\n3\r\nccc\r\n0\r\n\r\n")
    assert b"content-length: 4\r\n" in late and late.endswith(b"\r\n\r\nlate")
    for got in (failed, refused):
        assert got.startswith(b"HTTP/1.1 500 ") and got.count(b"HTTP/1.1") == 1 and b"x-path" not in got
