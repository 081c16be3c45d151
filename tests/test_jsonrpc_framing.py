"""Pure tests of the NDJSON framing (:class:`acp_server.jsonrpc.LineBuffer`): no event loop, bytes in, lines out."""

from __future__ import annotations

import pytest

from acp_server.jsonrpc import TOO_LARGE, LineBuffer


def drain(buf: LineBuffer) -> list[object]:
    """Every line (or TOO_LARGE) the buffer can produce from what it holds now."""
    out: list[object] = []
    while (line := buf.next_line()) is not None:
        out.append(line)
    return out


_split_by = {"mode": "next_line"}


@pytest.fixture(autouse=True, params=["next_line", "lines"])
def split_by(request: pytest.FixtureRequest) -> str:
    """Every test that frames through :func:`feed_all` runs twice: with ``feed`` and ``next_line``,
    and with ``lines``, which splits a whole read at once."""
    _split_by["mode"] = request.param
    return str(request.param)


def feed_all(buf: LineBuffer, *chunks: bytes) -> list[object]:
    out: list[object] = []
    for chunk in chunks:
        if _split_by["mode"] == "lines":
            out += buf.lines(chunk)
        else:
            buf.feed(chunk)
            out += drain(buf)
    return out


def test_framing_needs_a_newline() -> None:
    """A line without its newline is not a line yet; nothing is returned and the bytes are kept."""
    buf = LineBuffer(100)
    buf.feed(b'{"a": 1}')
    assert buf.next_line() is None
    assert buf.buffered == 8
    buf.feed(b"\n")
    assert drain(buf) == [b'{"a": 1}']
    assert buf.buffered == 0


def test_framing_several_lines_in_one_chunk() -> None:
    """One chunk holding several lines yields them in order, and keeps the unfinished tail."""
    buf = LineBuffer(100)
    assert feed_all(buf, b"one\ntwo\nthree\nfou") == [b"one", b"two", b"three"]
    assert buf.buffered == 3
    assert feed_all(buf, b"r\n") == [b"four"]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_framing_line_split_across_chunks(size: int) -> None:
    """A stream cut into chunks of any size frames to the same lines as the whole stream."""
    data = b'{"jsonrpc":"2.0","id":1,"method":"x"}\n{"jsonrpc":"2.0","method":"y"}\n\nlast\n'
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert feed_all(LineBuffer(100), *chunks) == [
        b'{"jsonrpc":"2.0","id":1,"method":"x"}',
        b'{"jsonrpc":"2.0","method":"y"}',
        b"",
        b"last",
    ]


def test_framing_crlf_keeps_the_carriage_return_for_the_decoder() -> None:
    """CRLF endings frame on the LF; the CR stays in the line (JSON whitespace, stripped by the connection)."""
    buf = LineBuffer(100)
    assert feed_all(buf, b"a\r\nb\r", b"\n") == [b"a\r", b"b\r"]


def test_framing_empty_lines_are_returned_empty() -> None:
    """Blank lines come out as empty lines (the connection skips them as keep-alives)."""
    assert feed_all(LineBuffer(10), b"\n\n", b"x\n\n") == [b"", b"", b"x", b""]


def test_framing_line_of_exactly_the_limit_is_accepted() -> None:
    """The limit is inclusive, whether the line arrives in one chunk or byte by byte."""
    assert feed_all(LineBuffer(10), b"x" * 10 + b"\n") == [b"x" * 10]
    assert feed_all(LineBuffer(10), *[b"x"] * 10, b"\n") == [b"x" * 10]


def test_framing_oversize_in_one_chunk_then_next_line() -> None:
    """A complete over-limit line in one chunk is TOO_LARGE once, and the lines after it frame normally."""
    buf = LineBuffer(10)
    assert feed_all(buf, b"x" * 11 + b"\nok\n") == [TOO_LARGE, b"ok"]
    assert buf.buffered == 0


def test_framing_oversize_across_chunks_is_dropped_as_it_arrives() -> None:
    """A line growing past the limit is reported once, its bytes are dropped (not held) until its
    newline, and framing resumes at the next line."""
    buf = LineBuffer(10)
    assert feed_all(buf, b"x" * 6) == []
    assert feed_all(buf, b"x" * 6) == [TOO_LARGE]
    assert buf.buffered == 0
    for _ in range(100):  # the rest of the oversized line: never buffered, never reported again
        assert feed_all(buf, b"y" * 1000) == []
        assert buf.buffered == 0
    assert feed_all(buf, b"yyy\nnext\npart") == [b"next"]
    assert buf.buffered == 4
    assert feed_all(buf, b"ial\n") == [b"partial"]


def test_framing_discard_ends_at_a_newline_at_the_start_of_a_chunk() -> None:
    """Discard mode stops at the newline even when it is the first byte of a chunk."""
    buf = LineBuffer(4)
    assert feed_all(buf, b"abcdef") == [TOO_LARGE]
    assert feed_all(buf, b"\n", b"ok\n") == [b"ok"]


def test_framing_oversize_after_complete_lines_in_the_same_chunk() -> None:
    """Complete lines before an oversized tail in one chunk are still delivered, then TOO_LARGE."""
    buf = LineBuffer(5)
    assert feed_all(buf, b"a\nbb\n" + b"z" * 20) == [b"a", b"bb", TOO_LARGE]
    assert feed_all(buf, b"zz\nc\n") == [b"c"]


def test_framing_two_oversized_lines_in_a_row() -> None:
    """Each oversized line is reported once, whether it ends in the chunk or after it."""
    buf = LineBuffer(3)
    assert feed_all(buf, b"aaaaa\nbbbbb", b"bb\nc\n") == [TOO_LARGE, TOO_LARGE, b"c"]


def test_framing_buffer_is_bounded_by_limit_plus_one_chunk() -> None:
    """Streaming a huge line never holds more than the limit plus the chunk just fed."""
    limit, chunk = 1000, 64
    buf = LineBuffer(limit)
    peak = 0
    reported = 0
    for _ in range(200):
        buf.feed(b"x" * chunk)
        peak = max(peak, buf.buffered)
        reported += sum(1 for line in drain(buf) if line is TOO_LARGE)
    assert reported == 1
    assert peak <= limit + chunk
    assert feed_all(buf, b"\n{}\n") == [b"{}"]


def test_framing_consumed_bytes_are_released() -> None:
    """Lines already read do not pile up while a partial line is always pending: the storage behind
    the buffer stays bounded over a long stream (white-box: reads the private bytearray)."""
    buf = LineBuffer(100)
    head, tail = b'{"jsonrpc":"2.0",', b'"method":"n"}\n'
    buf.feed(head)
    for _ in range(20000):
        buf.feed(tail + (head + tail) * 3 + head)
        assert drain(buf) == [(head + tail)[:-1]] * 4
        assert buf.buffered == len(head)
    assert len(buf._buf) < 4 * 65536
