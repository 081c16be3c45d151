"""One ``/acp`` connection as a byte stream: the seam between HTTP and the per-connection shell.

An ``/acp`` connection id (or one WebSocket) is one bridge peer, served by the same
:class:`~acp_server.transports.shell.ConnectionShell` and JSON-RPC core as a socket. The shell
reads newline-delimited JSON from :meth:`MessagePeer.receive_some` and writes it to
:meth:`MessagePeer.send_all`; the HTTP layer feeds each POSTed message (or WebSocket text frame) in
with :meth:`MessagePeer.feed` and reads the shell's output from :class:`OutQueue` s.

Routing (HTTP): each message the shell writes goes to one queue. A response goes to the stream of the
request it answers: the session's stream for a session-scoped request (``session/prompt``, ...,
named by ``Acp-Session-Id`` on its POST), the connection stream otherwise; a response that establishes
a session (``session/new``, ``load``, ``resume``, ``_acp_server/fork``) registers that session on the
connection. A request or notification whose ``params.sessionId`` is a session established here goes to
that session's stream; anything else (replays before the session is established, other sessions')
to the connection stream. A queue whose stream is not open yet keeps its messages for it. Over a
WebSocket, everything goes to the one socket in order, with nothing decoded; on a lean WebSocket
(``lean_ws``: :attr:`MessagePeer.frames` set) the shell's outbox writes it as it writes a socket, at
the end of each scheduling pass and a pass's first answer at once, through
:meth:`MessagePeer.write_nowait`, without its writer task, while nothing waits in the queue before it.

Backpressure: :meth:`MessagePeer.send_all` returns once every queue it wrote to is back under
``limit`` bytes. A reader that falls behind therefore stops the shell's writer, whose own queue then
overflows exactly as behind a slow socket: the shell evicts the connection (``_acp_server/evicted``)
and nobody else waits. An evicted connection remembers why (:attr:`MessagePeer.evicted`), so that the
HTTP layer answers its later POSTs 429 ``connection_evicted``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import trio

from ...auth.gate import PeerInfo
from .rules import (
    ESTABLISHING_METHODS,
    RESULT_SESSION_METHODS,
    SESSION_SCOPED_METHODS,
    Envelope,
    decode_outbound,
)

__all__ = ["EVICTED", "MessagePeer", "OutQueue", "ResponseWaiter"]

log = logging.getLogger("acp_server.http")

#: the shell's last message to a connection it closes: the HTTP layer answers later POSTs 429
EVICTED = "_acp_server/evicted"


class _EvictedReason(msgspec.Struct):
    reason: str = "unknown"


class _Evicted(msgspec.Struct):
    params: _EvictedReason = msgspec.field(default_factory=_EvictedReason)


def _evicted_reason(line: bytes) -> str:
    try:
        return msgspec.json.decode(line, type=_Evicted).params.reason
    except msgspec.DecodeError:
        return "unknown"


class OutQueue:
    """The messages waiting for one outbound stream (an SSE response, or a WebSocket).

    Bytes count from the moment a message is queued until its reader has handed it to the server
    (:meth:`sent`), so a stream whose client does not read keeps its bytes counted.
    """

    __slots__ = ("_peer", "_ready", "closed", "handing", "lines", "nbytes", "reader")

    def __init__(self, peer: MessagePeer) -> None:
        self._peer = peer
        self.lines: list[bytes] = []
        self.nbytes = 0
        self.closed = False
        #: the reader holds lines it took and has not handed to the server yet (nothing may pass them)
        self.handing = False
        #: the cancel scope of the reader serving this queue now (``None``: no stream open)
        self.reader: trio.CancelScope | None = None
        self._ready = trio.Event()

    def push(self, line: bytes) -> None:
        self.lines.append(line)
        self.nbytes += len(line)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self) -> list[bytes] | None:
        """Everything queued, once there is something (``None``: closed and drained).

        The bytes stay counted until :meth:`sent` is called with the taken lines.
        """
        while not self.lines:
            if self.closed:
                return None
            self._ready = trio.Event()
            await self._ready.wait()
        lines, self.lines = self.lines, []
        return lines

    def sent(self, lines: list[bytes]) -> None:
        """``lines`` (from :meth:`take`) are written: they no longer count against the limit."""
        self.nbytes -= sum(map(len, lines))
        self._peer._room_made()


class ResponseWaiter:
    """The answer to one request, captured instead of queued (``initialize``'s, for its 200 body)."""

    __slots__ = ("data", "done")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data = b""


class MessagePeer(trio.abc.Stream):
    """The byte stream a shell serves for one ``/acp`` connection (see the module docstring).

    Args:
        limit: bytes one queue holds before :meth:`send_all` waits (``--max-outbound-bytes``).
        multiplex: one queue for everything, in order, nothing decoded (a WebSocket).
    """

    def __init__(self, *, limit: int, multiplex: bool = False) -> None:
        self.limit = limit
        self.multiplex = multiplex
        #: who the HTTP layer found the connection to be (its token's identity and tenant, its address);
        #: the server reads it instead of asking for ``authenticate``
        self.peer_info: PeerInfo | None = None
        self.connection = OutQueue(self)
        #: the queues of session streams (opened, or holding messages for a stream not open yet)
        self.sessions: dict[str, OutQueue] = {}
        #: sessions established on this connection: their messages go to their own stream
        self.established: set[str] = set()
        #: session -> its session/load or session/resume requests in flight (its stream may open early)
        self._establishing: dict[str, int] = {}
        #: our peer's requests in flight: id -> (method, the session it is scoped to)
        self._routes: dict[Any, tuple[str, str | None]] = {}
        self._waiters: dict[Any, ResponseWaiter] = {}
        self._inbound = bytearray()
        self._inbound_ready = trio.Event()
        self._inbound_taken = trio.Event()
        self._eof = False
        self._closed = False
        self._partial = b""
        self._room = trio.Event()
        self.streams_open = 0
        self._streams_changed = trio.Event()
        #: the ``reason`` of the ``_acp_server/evicted`` the shell sent before closing (``None``: not evicted)
        self.evicted: str | None = None
        #: a WebSocket's frame writer (``lean_ws``): what the shell writes goes straight to the socket
        #: when nothing is queued before it and it fits the socket's write bound (``False``: queue it)
        self.frames: Callable[[list[bytes]], bool] | None = None

    # --- inbound: the HTTP layer feeds, the shell reads ----------------------------------------------

    def feed(self, message: bytes) -> None:
        """One JSON-RPC message from the client (a POST body or a text frame)."""
        if self._eof:
            return
        self._inbound += message
        self._inbound += b"\n"
        self._inbound_ready.set()

    async def feed_when_room(self, message: bytes, limit: int) -> None:
        """:meth:`feed`, once the shell has read what was fed before down to ``limit`` bytes: a client
        whose shell stopped reading (it pauses at four times ``--max-inflight-requests`` waiting)
        waits in its POST or its WebSocket, as a socket's sender waits on a full buffer."""
        while len(self._inbound) > limit and not (self._eof or self._closed):
            self._inbound_taken = trio.Event()
            await self._inbound_taken.wait()
        self.feed(message)

    def end_input(self) -> None:
        """The client is gone (DELETE, WebSocket closed, grace period over): the shell reads the end."""
        self._eof = True
        self._inbound_ready.set()
        self._inbound_taken.set()

    @property
    def inbound_bytes(self) -> int:
        return len(self._inbound)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        waited = False
        while not self._inbound:
            if self._eof or self._closed:
                await trio.lowlevel.checkpoint()
                return b""
            self._inbound_ready = trio.Event()
            await self._inbound_ready.wait()
            waited = True
        size = max_bytes or 65536
        self._inbound_taken.set()
        if len(self._inbound) <= size:
            data = bytes(self._inbound)
            self._inbound.clear()
        else:
            data = bytes(self._inbound[:size])
            del self._inbound[:size]
        if not waited:  # (a wait was this call's checkpoint: no second pass for what it woke to)
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    # --- the requests routing needs to know about ----------------------------------------------------

    def note_request(self, env: Envelope, session_id: str | None) -> None:
        """A POSTed request: remember where its answer goes (``session_id``: its ``Acp-Session-Id``)."""
        method = env.method
        if method in SESSION_SCOPED_METHODS:
            self._routes[env.id] = (method, session_id)
        elif method in ESTABLISHING_METHODS:
            session_id = None if method in RESULT_SESSION_METHODS else env.params_session()
            self._routes[env.id] = (method, session_id)
            if session_id is not None:
                self._establishing[session_id] = self._establishing.get(session_id, 0) + 1

    def expect_response(self, id: Any) -> ResponseWaiter:
        """Capture the answer to request ``id`` instead of queueing it."""
        waiter = self._waiters[id] = ResponseWaiter()
        return waiter

    def has_session(self, session_id: str) -> bool:
        """The session is established here (a session-scoped POST may name it)."""
        return session_id in self.established

    def may_stream(self, session_id: str) -> bool:
        """A GET may open the session's stream: established, or being loaded or resumed here (its
        stream then opens before the answer, and carries the session's messages once it is in)."""
        return session_id in self.established or session_id in self._establishing

    # --- outbound: the shell writes, queues take -----------------------------------------------------

    @property
    def writes_nowait(self) -> bool:
        """Whether the shell's outbox writes here without its writer task (:meth:`write_nowait`, at the
        end of each pass and for a pass's first answer, as on a socket): a WebSocket with a frame writer."""
        return self.multiplex and self.frames is not None

    def write_nowait(self, data: bytes) -> int:
        """Frame the whole lines of ``data`` and hand them to the socket without a wait: ``len(data)``
        when they went (or were queued by the socket's writer, under its bound), 0 when they did not
        (nothing taken: the outbox's writer task sends them with :meth:`send_all`, which queues them
        in order behind what is queued already and waits for room). A WebSocket's only."""
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        if self._partial or not data.endswith(b"\n"):
            return 0
        return len(data) if self._frames_now(data.split(b"\n")) else 0

    def _frames_now(self, lines: list[bytes]) -> bool:
        """Hand ``lines`` (empty ones skipped) to the frame writer if nothing waits in the queue before
        them; whether they went (or there was nothing to write): in order, nothing counted."""
        frames, queue = self.frames, self.connection
        if frames is None or queue.lines or queue.handing or queue.closed:
            return False
        lines = [line for line in lines if line]
        return not lines or frames(lines)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        chunk = bytes(data)
        if self._partial:
            chunk, self._partial = self._partial + chunk, b""
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        if self.multiplex:
            queue = self.connection
            if self._frames_now(lines):
                await trio.lowlevel.checkpoint()
                return
            for line in lines:
                if line:
                    queue.push(line)
            touched: tuple[OutQueue, ...] | set[OutQueue] = (queue,)
        else:
            touched = set()
            for line in lines:
                if line:
                    target = self._route(line)
                    if target is not None:
                        target.push(line)
                        touched.add(target)
        await self._wait_for_room(touched)

    async def _wait_for_room(self, touched: tuple[OutQueue, ...] | set[OutQueue]) -> None:
        limit = self.limit
        while not self._closed and any(q.nbytes > limit for q in touched):
            self._room = trio.Event()
            await self._room.wait()
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await self._wait_for_room(self._all_queues())

    def _all_queues(self) -> tuple[OutQueue, ...]:
        return (self.connection, *self.sessions.values())

    def _room_made(self) -> None:
        self._room.set()

    def _route(self, line: bytes) -> OutQueue | None:
        env = decode_outbound(line)
        if env is None:
            return self.connection
        if env.is_response:
            waiter = self._waiters.pop(env.id, None)
            if waiter is not None:
                waiter.data = line
                waiter.done.set()
                return None
            route = self._routes.pop(env.id, None)
            if route is None:
                return self.connection
            method, session_id = route
            if method in ESTABLISHING_METHODS:
                if session_id is not None:
                    left = self._establishing.pop(session_id, 1) - 1
                    if left:
                        self._establishing[session_id] = left
                if bytes(env.result) != b"null":
                    established = env.result_session() if session_id is None else session_id
                    if established is not None:
                        self.established.add(established)
                return self.connection
            if session_id is not None and session_id in self.established:
                return self.session_queue(session_id)
            return self.connection
        if env.method == EVICTED:
            self.evicted = _evicted_reason(line)
            return self.connection
        session_id = env.params_session()
        if session_id is not None and session_id in self.established:
            return self.session_queue(session_id)
        return self.connection

    def session_queue(self, session_id: str) -> OutQueue:
        """The queue of ``session_id``'s stream (created on first use)."""
        queue = self.sessions.get(session_id)
        if queue is None:
            queue = self.sessions[session_id] = OutQueue(self)
            if self._closed:
                queue.close()
        return queue

    # --- streams: who reads the queues --------------------------------------------------------------

    @contextmanager
    def reading(self, queue: OutQueue) -> Iterator[trio.CancelScope]:
        """Serve ``queue`` from the current task; a newer reader of the same queue replaces this one."""
        previous = queue.reader
        if previous is not None:
            previous.cancel()
        scope = queue.reader = trio.CancelScope()
        self._stream_delta(+1)
        try:
            yield scope
        finally:
            if queue.reader is scope:
                queue.reader = None
            self._stream_delta(-1)

    def _stream_delta(self, delta: int) -> None:
        self.streams_open += delta
        self._streams_changed.set()
        self._streams_changed = trio.Event()

    async def wait_streams_change(self) -> None:
        await self._streams_changed.wait()

    # --- closing ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """The shell is done: every queue ends once drained, and the input reads as ended."""
        if not self._closed:
            self._closed = True
            self._eof = True
            self._inbound_ready.set()
            self._inbound_taken.set()
            self.connection.close()
            for queue in self.sessions.values():
                queue.close()
            for waiter in self._waiters.values():
                waiter.done.set()
            self._room.set()
        await trio.lowlevel.checkpoint()
