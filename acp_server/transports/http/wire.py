"""Writes of one burst in one ``send_all``: the socket under hypercorn's protocol code.

hypercorn writes every protocol event with its own ``send_all``: a response's head and body apart, and
each WebSocket frame (one JSON-RPC message each) apart. A prompt's burst of updates then costs one
system call, and one wake-up of the peer, per message, where the NDJSON shell joins them into one
write (measured here: 13 writes per echo prompt over WebSocket). :class:`BatchedWrites` queues what
hypercorn writes and lets one flusher task send everything queued during a scheduling pass at once,
as the shell's writer does.

Bounds: ``send_all`` returns once its bytes are queued, and waits while more than ``limit`` bytes are
queued, so a slow peer still stops its writers (and, through them, the per-connection shell, whose
own bound evicts it). A failed write fails the next ``send_all`` with ``BrokenResourceError``.

:class:`TlsBatchedWrites` is the same over a TLS stream whose handshake is already done (the listener
bounds the handshake itself): it shows hypercorn what it reads of an SSL stream (the negotiated ALPN
protocol, the socket under it), so that hypercorn speaks HTTP/2 when ``h2`` was chosen and names the
scheme ``https``/``wss``.

:class:`BatchedTCPServer` is hypercorn's ``TCPServer`` over such a stream with per-request costs cut,
its behaviour kept: a write that fits under the bound is queued at once (no lock, no cancel scope, no
checkpoint: the bytes are queued whole, so order and atomicity hold); the keep-alive timer is one task
per connection that sleeps until the connection may have been idle long enough and then looks
(hypercorn starts a new task at the end of every request and cancels it at the start of the next; a
deadline moved per request costs trio a heap update each time); reads make no deadline scope when
there is no ``read_timeout``. It also tells the stream when joining is useless: on plain HTTP/1.1 (not
a WebSocket, not HTTP/2) a response, and an SSE chunk, is written whole by one writer, so a write that
finds nothing queued before it goes to the socket at once from its writer's task (what the kernel does
not take is queued for the flusher), and a plain socket is read once it is readable, without a read
tried first to fail. Its HTTP/1.1 protocol is :class:`~.lean.LeanH11Protocol` (plain requests with less
work each; everything else as hypercorn).
"""

from __future__ import annotations

import os
import socket as _stdlib_socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

from ..waits import readable_waiter

__all__ = ["BatchedTCPServer", "BatchedWrites", "HeldWrite", "TlsBatchedWrites"]

#: the most scheduling passes the flusher waits for a burst to end: it writes after the first pass that
#: queued nothing more (a WebSocket burst queues one frame per pass)
_JOIN_PASSES = 32


class HeldWrite:
    """A write queued in order whose bytes are settled later: by :meth:`BatchedWrites.settle`, or by
    ``render`` when the flusher takes it first (an HTTP/1.1 head that waits to learn its body's length).

    Args:
        render: the bytes, when nothing settled them before the flusher took them.
    """

    __slots__ = ("data", "render")

    def __init__(self, render: Callable[[], bytes]) -> None:
        self.render = render
        self.data: bytes | None = None

    def take(self) -> bytes:
        """The settled bytes (rendered now if there are none yet)."""
        if self.data is None:
            self.data = self.render()
        return self.data


class BatchedWrites(trio.abc.HalfCloseableStream):
    """A socket stream whose writes are joined by :meth:`flusher` (run it beside the stream's user).

    Args:
        stream: the accepted socket (or a stream over it).
        limit: queued bytes past which ``send_all`` waits.
        socket: the socket under ``stream`` (default: ``stream.socket``).
    """

    def __init__(self, stream: trio.abc.Stream, *, limit: int = 256 * 1024, socket: Any = None) -> None:
        self.stream = stream
        # hypercorn reads the addresses from it
        self.socket = socket if socket is not None else cast(trio.SocketStream, stream).socket
        #: the standard socket under a plain one's trio socket, whose ``fileno`` is no Python call (-1 once
        #: closed, as trio's); ``None`` (trio's own is asked) where it is not there
        self._raw: Any = None
        #: ``wait(fd, "read_task")``: the run's wait for a readable descriptor, without trio's two wrapper
        #: coroutines (``waits.readable_waiter``), for a plain socket
        self._wait_readable: Callable[[int, str], Awaitable[None]] | None = None
        if type(stream) is trio.SocketStream:
            raw = getattr(stream.socket, "_sock", None)
            self._raw = raw if isinstance(raw, _stdlib_socket.socket) else None
            self._wait_readable = readable_waiter()
        self.limit = limit
        self._out: list[bytes | HeldWrite] = []
        self._nbytes = 0
        self._wake = trio.Event()
        self._room = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._error: BaseException | None = None
        #: the flusher is writing what it took (nothing may be written past it meanwhile)
        self._writing = False
        #: whether the flusher waits for a burst to end (a WebSocket's or HTTP/2's writers queue over
        #: several passes; an HTTP/1.1 response or SSE chunk is queued whole in one)
        self.join = True

    def _queue(self, data: bytes | bytearray | memoryview) -> None:
        self._out.append(bytes(data))
        self._nbytes += len(data)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    def _write_now(self, data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        """Write what the kernel takes of ``data`` at once, when nothing is queued or being written before
        it, writes are not joined and the socket is plain; the rest (all of it otherwise) is returned."""
        if self.join or self._out or self._writing:
            return data
        raw = self._raw  # (set only for a plain socket)
        if raw is not None:
            fd = raw.fileno()  # -1 once closed: never a stale number
        elif type(self.stream) is trio.SocketStream:
            fd = self.stream.socket.fileno()
        else:
            return data
        if fd < 0:
            return data
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            return data
        except OSError as exc:
            self._fail(exc)
            return b""
        return data[sent:]

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake.set()
        self._room.set()
        self._idle.set()

    @property
    def queued(self) -> bool:
        """Something waits for the flusher task (queued, or being written)."""
        return bool(self._out) or self._writing

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Write or queue ``data`` if that needs no wait (``False``: broken, or past ``limit``: use
        :meth:`send_all`). On plain HTTP/1.1 (no joining) what the socket takes is written at once."""
        if self._error is not None or self._nbytes + len(data) > self.limit:
            return False
        rest = self._write_now(data)
        if self._error is not None:
            return False
        if rest:
            self._queue(rest)
        return True

    def hold(self, held: HeldWrite, *, wake: bool = True) -> None:
        """Queue ``held``: its bytes are settled before it is written, and count from then (an HTTP/1.1
        head: its writes need no joining). ``wake=False``: the flusher is not told (the writer settles
        it, which tells the flusher if it cannot write it at once)."""
        self.join = False
        self._out.append(held)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        if wake:
            self._wake.set()

    def drop(self, held: HeldWrite) -> None:
        """Take ``held`` out of the queue if nothing settled it (its connection is gone)."""
        if held.data is None and held in self._out:
            self._out.remove(held)
            if not self._out and not self._writing:
                self._idle.set()

    async def settle(self, held: HeldWrite, data: bytes) -> None:
        """Give ``held`` (queued, not taken yet) its bytes; waits as :meth:`send_all` past the bound."""
        if len(self._out) == 1 and self._out[0] is held and not self._writing:  # nothing before it
            self._out = []
            held.data = data
            rest = self._write_now(data)
            if self._error is not None:
                raise trio.BrokenResourceError("the connection broke") from self._error
            if not rest:
                self._idle.set()
                return
            self._out, held.data = [held], bytes(rest)
        else:
            held.data = data
        self._wake.set()
        self._nbytes += len(held.data)
        while self._nbytes > self.limit and self._error is None:
            self._room = trio.Event()
            await self._room.wait()
        if self._error is not None:
            raise trio.BrokenResourceError("the connection broke") from self._error

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise trio.BrokenResourceError("the connection broke") from self._error
        self._queue(data)
        while self._nbytes > self.limit and self._error is None:
            self._room = trio.Event()
            await self._room.wait()
        if self._error is not None:
            raise trio.BrokenResourceError("the connection broke") from self._error
        await trio.lowlevel.checkpoint()

    async def flusher(self) -> None:
        """Send what is queued, one join per burst, until the stream breaks or this is cancelled."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._error is not None:
                return
            if not self._out:  # written at once by its writer
                continue
            for _ in range(_JOIN_PASSES if self.join else 0):
                queued = len(self._out)
                await trio.lowlevel.cancel_shielded_checkpoint()
                if len(self._out) == queued:
                    break
            out, self._out = self._out, []
            data = b"".join([part if isinstance(part, bytes) else self._take(part) for part in out])
            self._writing = True
            try:
                await self._send(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._fail(exc)
                return
            finally:
                self._writing = False
            self._nbytes -= len(data)
            self._room.set()
            if not self._out:
                self._idle.set()

    def _take(self, held: HeldWrite) -> bytes:
        settled = held.data is not None
        data = held.take()
        if not settled:
            self._nbytes += len(data)  # counted now, as it is written
        return data

    async def _send(self, data: bytes) -> None:
        """Write ``data``: on a plain socket what the kernel takes at once is written without a
        scheduling pass (the rest, and any TLS stream, through ``send_all``)."""
        if type(self.stream) is trio.SocketStream:
            raw = self._raw
            fd = raw.fileno() if raw is not None else self.stream.socket.fileno()  # -1 once closed: never a stale number
            if fd >= 0:
                try:
                    sent = os.write(fd, data)
                except BlockingIOError:
                    sent = 0
                if sent == len(data):
                    return
                data = data[sent:]
        await self.stream.send_all(data)

    async def _drain(self) -> None:
        with trio.move_on_after(1.0):
            await self._idle.wait()

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """Read what is there; a plain socket is read once it is readable (an HTTP/1.1 peer has
        usually sent nothing yet when its connection is read again: no read is tried first to fail)."""
        wait = self._wait_readable
        if wait is None or type(self.stream) is not trio.SocketStream:
            return await self.stream.receive_some(max_bytes)
        sock = self._raw if self._raw is not None else self.stream.socket
        while True:
            fd = sock.fileno()
            if fd < 0:  # (closed by this side: an answer that ended its connection)
                raise trio.ClosedResourceError("the connection is closed")
            await wait(fd, "read_task")
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the connection is closed")
            try:
                return os.read(fd, max_bytes or MAX_RECV)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"the connection broke: {exc}") from exc

    async def send_eof(self) -> None:
        await self._drain()
        if not isinstance(self.stream, trio.abc.HalfCloseableStream):
            raise AttributeError("a TLS stream has no half-close")  # what hypercorn expects of one
        await self.stream.send_eof()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._drain()
        await self.stream.aclose()


class _Transport:
    """What hypercorn reads of an SSL stream's ``transport_stream``: its socket."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket


class TlsBatchedWrites(BatchedWrites):
    """:class:`BatchedWrites` over a TLS stream whose handshake is done (see the module docstring).

    Args:
        stream: the TLS stream, past its handshake.
        socket: the accepted socket under it.
        limit: queued bytes past which ``send_all`` waits.
    """

    def __init__(self, stream: trio.SSLStream[Any], socket: Any, *, limit: int = 256 * 1024) -> None:
        super().__init__(stream, limit=limit, socket=socket)
        self.transport_stream = _Transport(socket)
        self._alpn: str | None = stream.selected_alpn_protocol()

    async def do_handshake(self) -> None:
        """Done already (hypercorn calls it first)."""
        await trio.lowlevel.checkpoint()

    def selected_alpn_protocol(self) -> str | None:
        """The protocol the handshake chose (``h2``, ``http/1.1``, or ``None``: the client offered none)."""
        return self._alpn


class BatchedTCPServer(TCPServer):
    """hypercorn's ``TCPServer`` over a :class:`BatchedWrites` (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        config: hypercorn's config (its ``keep_alive_timeout`` is the idle bound between requests).
        context: the worker context.
        state: the lifespan state.
        stream: the connection's :class:`BatchedWrites`.
    """

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: BatchedWrites) -> None:
        super().__init__(app, config, context, state, stream)  # type: ignore[arg-type]
        self.batched = stream
        #: the keep-alive timer's state: a request is being served, or since when the connection is idle
        #: (the timer reads them when it fires, so a request moves no deadline)
        self._busy = False
        #: the run's clock, read straight (``trio.current_time`` finds it anew on each call)
        self._clock = trio.lowlevel.current_clock()
        self._idle_since = self._clock.current_time()
        self._idle_started = False

    @property
    def protocol(self) -> ProtocolWrapper:
        """hypercorn's protocol wrapper, whose HTTP/1.1 protocol is a :class:`~.lean.LeanH11Protocol`."""
        return self._protocol

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        # hypercorn's ``run`` builds the wrapper, which builds an ``H11Protocol`` for any connection that
        # did not choose h2: the same arguments make the lean one
        if type(wrapper.protocol) is H11Protocol:
            from .lean import LeanH11Protocol

            lean = LeanH11Protocol(
                wrapper.app, wrapper.config, wrapper.context, wrapper.task_group, wrapper.state, wrapper.ssl,
                wrapper.client, wrapper.server, wrapper.send,
            )
            lean.batched = self.batched
            lean.timer = self
            wrapper.protocol = lean
        self._protocol = wrapper

    async def protocol_send(self, event: Event) -> None:
        """Queue a write at once when it fits; move the keep-alive deadline in place."""
        if isinstance(event, RawData):
            protocol = getattr(self.protocol, "protocol", None)
            self.batched.join = not isinstance(protocol, H11Protocol) or isinstance(protocol.stream, WSStream)
            if self.batched.send_nowait(event.data):
                return
        elif isinstance(event, Updated):
            if event.idle:
                self.mark_idle()
            else:
                self._busy = True
            return
        await super().protocol_send(event)

    def mark_busy(self) -> None:
        """A request is being served (what ``Updated(idle=False)`` says, without an event)."""
        self._busy = True

    def mark_idle(self) -> None:
        """The connection is idle from now (``Updated(idle=True)``)."""
        self._busy = False
        self._idle_since = self._clock.current_time()

    async def _read_data(self) -> None:
        """hypercorn's read loop; without a ``read_timeout`` it makes no deadline scope per read."""
        if self.config.read_timeout is not None:
            await super()._read_data()
            return
        from .lean import LeanH11Protocol

        while True:
            try:
                data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            protocol = self._protocol.protocol  # (the wrapper's own handle is for h2's switch, which a plain request never makes)
            if data and type(protocol) is LeanH11Protocol and await protocol.serve_plain(bytes(data)):
                continue
            await self.protocol.handle(RawData(bytes(data)))
            if not data:
                break
        await self.protocol.handle(Closed())

    async def _idle_timeout(self) -> None:
        """Close the connection once it has been idle for ``keep_alive_timeout`` seconds."""
        if self._idle_started:  # the timer's scope is entered once; hypercorn restarts it only at the start
            await super()._idle_timeout()
            return
        self._idle_started = True
        timeout = self.config.keep_alive_timeout
        due = self._idle_since + timeout
        terminated = self.context.terminated
        while not terminated.is_set():
            with trio.move_on_at(due):
                await terminated.wait()
            now = trio.current_time()
            if self._busy:
                due = now + timeout  # looked at again a whole period after now at the earliest
            elif now < self._idle_since + timeout:
                due = self._idle_since + timeout
            else:
                break
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()
