"""NDJSON framing: one JSON-RPC message per line, ``\\n``-terminated, UTF-8.

Memory stays bounded by the line limit: a line that grows past it is discarded as it arrives, never
accumulated, and reported once as :data:`TOO_LARGE`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["TOO_LARGE", "LineBuffer"]


class _TooLarge:
    __slots__ = ()

    def __repr__(self) -> str:
        return "TOO_LARGE"


TOO_LARGE: Final = _TooLarge()


class LineBuffer:
    """Splits a byte stream into lines of at most ``max_line_bytes`` (newline excluded).

    Args:
        max_line_bytes: the largest line accepted; a longer one yields :data:`TOO_LARGE` once and
            its bytes are dropped up to and including its newline.
    """

    __slots__ = ("_buf", "_discarding", "_max", "_pos", "_scan")

    def __init__(self, max_line_bytes: int) -> None:
        self._max = max_line_bytes
        self._buf = bytearray()
        self._pos = 0  # start of the first unread line in _buf
        self._scan = 0  # where the newline search resumes (>= _pos; bytes before it hold no newline)
        self._discarding = False

    def feed(self, data: bytes | bytearray) -> None:
        """Append bytes received from the peer."""
        if self._discarding:
            nl = data.find(b"\n")
            if nl < 0:
                return
            self._discarding = False
            data = data[nl + 1 :]
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = self._scan = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a complete line."""
        return len(self._buf) - self._pos

    def lines(self, data: bytes | bytearray) -> list[bytes | _TooLarge]:
        """Feed ``data`` and return every line it completes (oldest first), each line too large as
        :data:`TOO_LARGE`; what is left of an incomplete line is kept for the next call.

        The usual read (nothing held, whole lines) is split by one ``bytes.split``: no copy into the
        buffer and none out of it, one call for all the lines of the read.
        """
        if type(data) is not bytes:
            data = bytes(data)
        if not self._buf and not self._discarding:
            # Nothing held (the usual read): its lines are the split, less what follows the last newline.
            parts = data.split(b"\n")
            rest = parts.pop()
            if len(data) > self._max:
                parts = [TOO_LARGE if len(part) > self._max else part for part in parts]  # type: ignore[misc]
            if rest:
                self.feed(rest)
                line = self.next_line()  # the rest holds no newline: only an oversized one comes back
                if line is not None:
                    parts.append(line)  # type: ignore[arg-type]
            return parts  # type: ignore[return-value]
        if self._discarding:
            nl = data.find(b"\n")
            if nl < 0:
                return []
            self._discarding = False
            data = data[nl + 1 :]
        out: list[bytes | _TooLarge] = []
        if self._pos < len(self._buf):
            # The start of a line is held: complete it first (the slow path, a line split across reads).
            nl = data.find(b"\n")
            if nl < 0:
                self.feed(data)
                line = self.next_line()
                return [] if line is None else [line]
            self._buf += data[: nl + 1]
            data = data[nl + 1 :]
            while (line := self.next_line()) is not None:
                out.append(line)
        else:
            self._buf.clear()
            self._pos = self._scan = 0
        if not data:
            return out
        parts = data.split(b"\n")
        rest = parts.pop()
        if len(data) > self._max:
            out.extend(TOO_LARGE if len(part) > self._max else part for part in parts)
        else:
            out.extend(parts)
        if rest:
            self.feed(rest)
            line = self.next_line()  # the rest holds no newline: only an oversized one comes back
            if line is not None:
                out.append(line)
        return out

    def next_line(self) -> bytes | _TooLarge | None:
        """The next complete line, :data:`TOO_LARGE`, or ``None`` when more bytes are needed."""
        buf = self._buf
        nl = buf.find(b"\n", self._scan)  # _scan >= _pos always: no newline before it
        if nl < 0:
            if len(buf) - self._pos > self._max:
                # Drop what we hold of the oversized line and skip the rest as it arrives.
                del buf[:]
                self._pos = self._scan = 0
                self._discarding = True
                return TOO_LARGE
            self._scan = len(buf)
            if self._pos > 65536 and self._pos * 2 > len(buf):
                del buf[: self._pos]
                self._scan -= self._pos
                self._pos = 0
            return None
        start = self._pos
        self._pos = self._scan = nl + 1
        if nl - start > self._max:
            return TOO_LARGE
        line = bytes(buf[start:nl])
        if self._pos == len(buf):
            buf.clear()
            self._pos = self._scan = 0
        return line
