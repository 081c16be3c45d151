"""A small pipelined RESP2 connection for the coordinator's hot path: script calls, nothing else.

Every admission is one ``EVALSHA`` (batched per loop turn) and every release one more; through
``coredis`` each call crossed a command object, a retry policy, a telemetry span, a connection pool and
an in-memory stream pair, about 0.6-0.9 ms of CPU per call on this machine where the socket round trip
itself costs about 0.1 ms. :class:`RespPipe` writes each call's pre-encoded bytes straight to one socket
and a reader task hands the replies back in order, so calls from many tasks share the connection
without waiting for each other (pipelining). Everything else (pub/sub, ``PING``, the cluster's read-out)
stays on ``coredis``.

A call that is cancelled (a timeout) leaves its place in the queue: its reply is read and dropped when
it comes, so the replies of later calls stay matched. A write cut half-way, or a connection that ends,
closes the connection: every call on it fails with :class:`ConnectionError`, and the next call opens a
new one (with ``AUTH`` and ``SELECT`` from the URL).
"""

from __future__ import annotations

import collections
import os
import ssl
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio

__all__ = ["RespError", "RespPipe", "bulk", "encode_command"]

_CRLF: Final = b"\r\n"


class RespError(Exception):
    """An error reply from Redis (``-ERR ...``, ``-NOSCRIPT ...``)."""


class _Incomplete(Exception):
    pass


def bulk(arg: bytes | str | int) -> bytes:
    """One argument as a RESP bulk string (callers join pre-encoded arguments into commands)."""
    data = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def encode_command(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(map(bulk, args))


def _parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One reply from ``buf`` at ``pos``: (value, position after it). Raises _Incomplete."""
    end = buf.find(_CRLF, pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    nxt = end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), nxt
    if kind == 0x24:  # '$' bulk string
        size = int(line)
        if size < 0:
            return None, nxt
        if len(buf) < nxt + size + 2:
            raise _Incomplete
        return bytes(buf[nxt : nxt + size]), nxt + size + 2
    if kind == 0x2A:  # '*' array
        count = int(line)
        if count < 0:
            return None, nxt
        items = []
        for _ in range(count):
            item, nxt = _parse(buf, nxt)
            items.append(item)
        return items, nxt
    if kind == 0x2B:  # '+' simple string
        return line, nxt
    if kind == 0x2D:  # '-' error
        return RespError(line.decode(errors="replace")), nxt
    raise ConnectionError(f"unexpected RESP reply type {chr(kind)!r}")


class _Pending:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None


class _Connection:
    """One socket, its queue of calls waiting for their replies, and its reader task."""

    def __init__(self, stream: trio.abc.Stream, on_push: Callable[[list[Any]], None] | None = None) -> None:
        self.stream = stream
        #: a subscription's messages (``[b"message", channel, data]``) go here, not to a call
        self.on_push = on_push
        #: set once the reader stopped and the socket is closed
        self.ended = trio.Event()
        #: the socket's descriptor for writes that need no wait (a plain socket; None with TLS)
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self.waiting: collections.deque[_Pending] = collections.deque()
        self.send_lock = trio.Lock()
        self.broken: BaseException | None = None
        self.scope = trio.CancelScope()  # the reader's: cancelled when the connection is dropped

    def fail(self, error: BaseException) -> None:
        if self.broken is None:
            self.broken = error
            self.scope.cancel()
        while self.waiting:
            pending = self.waiting.popleft()
            pending.value = ConnectionError(str(error) or type(error).__name__)
            pending.done.set()

    async def reader(self) -> None:
        buf = bytearray()
        try:
            with self.scope:
                await self._read(buf)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, ValueError) as exc:
            self.fail(exc)
        finally:
            self.fail(ConnectionError("connection closed"))
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
            self.ended.set()

    async def _read(self, buf: bytearray) -> None:
        while True:
            data = await self.stream.receive_some(65536)
            if not data:
                raise ConnectionError("Redis closed the connection")
            buf += data
            pos = 0
            push = self.on_push
            while pos < len(buf) and (self.waiting or push is not None):
                try:
                    value, pos = _parse(buf, pos)
                except _Incomplete:
                    break
                if push is not None and type(value) is list and value and value[0] == b"message":
                    push(value)
                    continue
                if not self.waiting:
                    raise ConnectionError(f"a reply nobody asked for: {value!r}"[:200])
                pending = self.waiting.popleft()
                pending.value = value
                pending.done.set()
            del buf[:pos]


class RespPipe:
    """Pipelined calls to one Redis over one connection, reopened when it breaks.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS, the system's trust store) or
            ``unix:///path?db=N``.
        nursery: runs the connection's reader task.
        connect_timeout_s: the bound on opening a connection (with its ``AUTH`` and ``SELECT``).
    """

    def __init__(self, url: str, nursery: trio.Nursery, *, connect_timeout_s: float = 1.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self._scheme = parts.scheme
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 6379
        self._path = urllib.parse.unquote(parts.path)
        query = urllib.parse.parse_qs(parts.query)
        db = query.get("db", [""])[0] or (self._path.strip("/") if self._scheme != "unix" else "")
        self._db = int(db or 0)
        self._user = urllib.parse.unquote(parts.username) if parts.username else None
        self._password = urllib.parse.unquote(parts.password) if parts.password else None
        self._nursery = nursery
        self._timeout_s = connect_timeout_s
        self._conn: _Connection | None = None
        self._open_lock = trio.Lock()

    async def _open(self) -> _Connection:
        async with self._open_lock:
            conn = self._conn
            if conn is not None and conn.broken is None:
                return conn
            conn = self._conn = await self._connect()
            return conn

    async def _connect(self, on_push: Callable[[list[Any]], None] | None = None) -> _Connection:
        """A new connection, authenticated and on its database, with its reader running."""
        with trio.fail_after(self._timeout_s):
            stream: trio.abc.Stream
            if self._scheme == "unix":
                stream = await trio.open_unix_socket(self._path)
            else:
                stream = await trio.open_tcp_stream(self._host, self._port)
                if self._scheme == "rediss":
                    stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=self._host)
                    await stream.do_handshake()
            conn = _Connection(stream, on_push)
            self._nursery.start_soon(conn.reader)
            hello: list[tuple[bytes | str | int, ...]] = []
            if self._password is not None:
                hello.append(("AUTH", self._user, self._password) if self._user else ("AUTH", self._password))
            if self._db:
                hello.append(("SELECT", self._db))
            try:
                for command in hello:
                    reply = await self._send(conn, encode_command(*command))
                    if isinstance(reply, BaseException):
                        raise reply
            except BaseException as exc:
                conn.fail(exc)
                raise
        return conn

    async def subscribe(self, channel: str, on_message: Callable[[list[Any]], None]) -> _Connection:
        """Subscribe to ``channel`` on a connection of its own: ``on_message`` gets each message
        (``[b"message", channel, data]``) until the connection ends (``ended``; drop it with ``fail``).

        Raises:
            RespError, ConnectionError, OSError, trio.TooSlowError: the subscription could not be made.
        """
        conn = await self._connect(on_message)
        try:
            with trio.fail_after(self._timeout_s):
                reply = await self._send(conn, encode_command("SUBSCRIBE", channel))
            if isinstance(reply, BaseException):
                raise reply
        except BaseException as exc:
            conn.fail(exc)
            raise
        return conn

    async def _send(self, conn: _Connection, data: bytes) -> Any:
        if conn.broken is not None:
            raise ConnectionError(str(conn.broken))
        pending = _Pending()
        conn.waiting.append(pending)
        lock = conn.send_lock
        if conn.fd is not None and not lock.locked():
            # The usual case: the socket takes the whole command at once, with no task switch and no
            # cancel scope; only what it does not take goes through the locked, shielded path.
            try:
                sent = os.write(conn.fd, data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                conn.fail(exc)
                sent = len(data)
            if sent < len(data):
                lock.acquire_nowait()  # nobody else can write between the two parts
                try:
                    await self._send_rest(conn, data[sent:])
                finally:
                    lock.release()
        else:
            async with lock:
                await self._send_rest(conn, data)
        await pending.done.wait()
        return pending.value

    async def _send_rest(self, conn: _Connection, data: bytes) -> None:
        # A write cut half-way would leave a partial command on the socket: shielded, bounded, and
        # the connection dropped if it does not complete.
        if conn.broken is not None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self._timeout_s) as scope:
            try:
                await conn.stream.send_all(data)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                conn.fail(exc)
        if scope.cancelled_caught:
            conn.fail(ConnectionError("a write to Redis did not complete"))

    async def call(self, data: bytes) -> Any:
        """Send one pre-encoded command; its reply (``bytes``, ``int``, lists of them, or ``None``).

        Raises:
            RespError: Redis answered with an error.
            ConnectionError, OSError: the connection could not be opened or broke.
        """
        conn = self._conn
        if conn is None or conn.broken is not None:
            conn = await self._open()
        value = await self._send(conn, data)
        if isinstance(value, BaseException):
            raise value
        return value

    async def evalsha(self, sha: str, source: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """Run a script by its SHA-1, loading it with ``EVAL`` when Redis does not have it."""
        try:
            return await self.call(encode_command("EVALSHA", sha, len(keys), *keys, *args))
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call(encode_command("EVAL", source, len(keys), *keys, *args))

    async def evalsha_encoded(self, sha: str, source: str, count: int, body: bytes) -> Any:
        """:meth:`evalsha` with the arguments after the script already encoded: ``body`` holds
        ``count`` bulk strings (``numkeys``, the keys, the arguments)."""
        head = b"*%d\r\n$7\r\nEVALSHA\r\n" % (count + 2)
        try:
            return await self.call(head + bulk(sha) + body)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call(b"*%d\r\n$4\r\nEVAL\r\n" % (count + 2) + bulk(source) + body)

    def close(self) -> None:
        """Drop the connection (its calls fail); a later call opens a new one."""
        if self._conn is not None:
            self._conn.fail(ConnectionError("closed"))
            self._conn = None
