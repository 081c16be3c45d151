"""TCP and Unix listeners shaped like ``trio.serve_listeners``, and the stdio stream.

Each listener is started with ``await nursery.start(serve_tcp, handler, port, host=...)`` and reports
the bound listeners, so the CLI and tests learn the real port. Each connection's handler is isolated:
an exception in it is logged and closes that connection only.

The accept loop is ours rather than ``trio.serve_listeners``, for two bounds. A :class:`ConnectionGate`
shared by every listener counts their sockets together; past its limit a new connection is sent
``_acp_server/evicted {reason: "too_many_connections"}`` and closed at once, so the process keeps
descriptors for its backends and its store. When ``accept`` fails for want of descriptors or memory
(``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``), the loop backs off (0.1 s doubling to 1 s) and logs
one line per episode, not one traceback per attempt.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket as _stdsocket
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
import trio

__all__ = [
    "ConnectionGate",
    "PipeStream",
    "default_max_connections",
    "isolated",
    "listener_url",
    "open_unix_listener",
    "serve_listeners",
    "serve_tcp",
    "serve_unix",
    "stdio_stream",
]

log = logging.getLogger("acp_server.transports")

Handler = Callable[[trio.abc.Stream], Awaitable[None]]


def isolated(handler: Handler, name: str) -> Handler:
    """Wrap a connection handler so that its failure closes its connection only."""

    async def run(stream: trio.abc.Stream) -> None:
        try:
            await handler(stream)
        except Exception:
            log.exception("%s: connection handler failed; closing that connection", name)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    return run


#: accept(2) failures that mean "out of descriptors or memory for now": back off, do not give up
ACCEPT_CAPACITY_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 1.0
#: descriptors of the fd limit kept for what is not a client socket: stdio, the store, agent pipes, logs
FD_HEADROOM_MIN = 64


def default_max_connections() -> int:
    """The default of ``--max-connections``: the soft ``RLIMIT_NOFILE`` less head-room (an eighth of it,
    at least :data:`FD_HEADROOM_MIN`), never below 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft - max(FD_HEADROOM_MIN, soft // 8))


class ConnectionGate:
    """The open sockets of every listener together, against one limit.

    Args:
        limit: the most connections served at once; a later one is refused (0: :func:`default_max_connections`).
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit or default_max_connections()
        self.open = 0
        #: connections refused for the limit since start
        self.refused = 0
        self._refusing = False  # inside an episode of refusals (logged once)

    def refusal(self) -> bytes:
        """The notification a refused connection is sent."""
        return _encoder.encode(_Evicted("2.0", "_acp_server/evicted", _TooMany(limit=self.limit))) + b"\n"

    async def serve(self, handler: Handler, stream: trio.abc.Stream, name: str, refusal: bytes | None = None) -> None:
        """Run ``handler(stream)`` if there is room, else send ``refusal`` (default: the NDJSON
        ``_acp_server/evicted`` of :meth:`refusal`) and close the connection at once.

        The handler is isolated (see :func:`isolated`): an exception in it is logged and closes
        that connection only."""
        if self.open >= self.limit:
            self.refused += 1
            if not self._refusing:
                self._refusing = True
                log.warning(
                    "%s: %d connections open, the --max-connections limit: refusing new ones "
                    "(too_many_connections) until one closes",
                    name,
                    self.open,
                )
            with trio.move_on_after(1):
                try:
                    await stream.send_all(refusal if refusal is not None else self.refusal())
                    if isinstance(stream, trio.abc.HalfCloseableStream):
                        await stream.send_eof()
                    # What the peer already sent is read (for at most the second above), so that the
                    # close is a FIN after our answer, not a reset that may discard it.
                    while await stream.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            await trio.aclose_forcefully(stream)
            return
        self.open += 1
        try:
            await handler(stream)
        except Exception:
            # The handler's failure closes its connection only (what :func:`isolated` does, without
            # one more suspended frame per open connection).
            log.exception("%s: connection handler failed; closing that connection", name)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            self.open -= 1
            if self._refusing and self.open < self.limit:
                self._refusing = False
                log.info("%s: below the --max-connections limit again (%d refused so far)", name, self.refused)


class _TooMany(msgspec.Struct):
    limit: int
    reason: str = "too_many_connections"


class _Evicted(msgspec.Struct):
    jsonrpc: str
    method: str
    params: _TooMany


_encoder = msgspec.json.Encoder()


async def _accept_loop(
    listener: trio.SocketListener,
    handler: Handler,
    gate: ConnectionGate,
    nursery: trio.Nursery,
    name: str,
    refusal: bytes | None,
) -> None:
    backoff = 0.0  # > 0: inside an episode of accept failures
    failures = 0
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                failures += 1
                if not backoff:
                    log.warning(
                        "%s: accept failed with %s (%s) with %d connections open; pausing accepts, "
                        "retrying until it succeeds (lower --max-connections or raise the fd limit)",
                        name,
                        errno.errorcode.get(exc.errno, exc.errno),
                        os.strerror(exc.errno),
                        gate.open,
                    )
                    backoff = _BACKOFF_FIRST_S
                await trio.sleep(backoff)
                backoff = min(2 * backoff, _BACKOFF_MAX_S)
                continue
            if backoff:
                log.info("%s: accepting again after %d failed accepts", name, failures)
                backoff, failures = 0.0, 0
            # Named by the listener: a name trio derived from the function would be a string per task.
            nursery.start_soon(gate.serve, handler, stream, name, refusal, name=name)


async def bind_tcp_socket(host: str, port: int, *, backlog: int = 128) -> trio.socket.SocketType:
    """A listening TCP socket on the first address ``host`` resolves to (port 0: any free port), for a
    server that runs its own accept loop (the HTTP listener, the metrics endpoint).

    Raises:
        OSError: ``host`` does not resolve, or the address cannot be bound.
    """
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    family, type_, proto, _, sockaddr = infos[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind(sockaddr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_listeners(
    handler: Handler,
    listeners: Sequence[trio.SocketListener],
    *,
    gate: ConnectionGate | None = None,
    name: str = "listener",
    refusal: bytes | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on every listener and run ``handler(stream)`` for each connection (isolated: see
    :func:`isolated`), within ``gate``'s limit (default: a gate of its own); a connection past the
    limit is sent ``refusal`` (default: NDJSON ``_acp_server/evicted``) and closed."""
    gate = gate or ConnectionGate()
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, handler, gate, nursery, name, refusal)
        task_status.started(list(listeners))


def listener_url(listener: trio.abc.Listener[Any]) -> str:
    """``tcp://HOST:PORT`` or ``unix:/path`` for a bound listener."""
    sock = listener.socket  # type: ignore[attr-defined]
    if sock.family == trio.socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


async def serve_tcp(
    handler: Handler,
    port: int,
    *,
    host: str,
    gate: ConnectionGate | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve TCP connections on every address ``host`` resolves to (within ``gate``: see :func:`serve_listeners`)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    await serve_listeners(handler, listeners, gate=gate, name=f"tcp {host}:{port}", task_status=task_status)


def _socket_is_live(path: str) -> bool:
    probe = _stdsocket.socket(_stdsocket.AF_UNIX, _stdsocket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


async def open_unix_listener(path: str, *, backlog: int = 128) -> trio.SocketListener:
    """Bind a Unix listener at ``path`` with mode 0600.

    A stale socket file (nobody accepts on it) is replaced; a live one is refused.

    Raises:
        OSError: ``EADDRINUSE`` when a server is live on ``path``; other bind failures as they come.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, "the path exists and is not a socket")
        if _socket_is_live(path):
            raise OSError(errno.EADDRINUSE, "another server is live on this socket")
        os.unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the file is created 0600: no window where others could connect
    try:
        await sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return trio.SocketListener(sock)


async def serve_unix(
    handler: Handler,
    path: str,
    *,
    gate: ConnectionGate | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve connections on a Unix socket at ``path`` (within ``gate``); the socket file is removed on exit."""
    listener = await open_unix_listener(path)
    try:
        await serve_listeners(handler, [listener], gate=gate, name=f"unix {path}", task_status=task_status)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class PipeStream(trio.abc.HalfCloseableStream):
    """Two pipe descriptors (ours to close) as one stream, doing the I/O first and waiting only if it must.

    trio's ``FdStream`` yields to the scheduler before every read and write; a request-response peer on
    stdio then pays, per message, a scheduler pass plus a read that fails with ``EAGAIN``. Here, as with
    trio's sockets, the system call comes first: ``send_all`` waits only when the pipe is full, and
    ``receive_some`` reads at once, except after a short read (which emptied the pipe), when it waits
    for readability first instead of making a read that would fail. ``receive_some`` is still a
    checkpoint (it yields after a read that did not wait); ``send_all`` yields only while it waits, so
    its caller must reach a checkpoint of its own between writes (the shell's writer waits for its
    next message), and it raises ``Cancelled`` on entry in a cancelled scope. One reader and one writer
    at a time, as the shell has.

    The connection shell reads :attr:`receive_fd` itself, in the same way (see ``ConnectionShell.run``).

    Args:
        receive_fd: the descriptor to read (stdin's duplicate); set non-blocking.
        send_fd: the descriptor to write (stdout's duplicate); set non-blocking.

    Attributes:
        receive_fd: the descriptor read, ``None`` once the stream is closed (a task waiting on it is
            woken with ``ClosedResourceError`` first).
        send_fd: the descriptor written, ``None`` once the stream is closed (the outbox writes it
            itself at the end of a pass, as :meth:`write_nowait` does).
        edge_epoll: the epoll object (of a trio run) in which :attr:`receive_fd` is registered
            edge-triggered by :func:`~.waits.edge_waiter`, if any.
    """

    def __init__(self, receive_fd: int, send_fd: int) -> None:
        os.set_blocking(receive_fd, False)
        os.set_blocking(send_fd, False)
        self.receive_fd: int | None = receive_fd
        self.send_fd: int | None = send_fd
        self._emptied = False  # the last read returned less than asked: the pipe was empty then
        self.edge_epoll: object | None = None

    def open_fd(self) -> int:
        """:attr:`receive_fd`, for a reader that reads it itself (asked for again after each wait).

        Raises:
            trio.ClosedResourceError: the stream is closed.
        """
        fd = self.receive_fd
        if fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        return fd

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        fd = self.receive_fd
        if fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        size = max_bytes or 65536
        waited = self._emptied
        if waited:
            fd = await self._wait_readable(fd)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                data = os.read(fd, size)
            except BlockingIOError:
                fd = await self._wait_readable(fd)
                waited = True
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            else:
                break
        self._emptied = len(data) < size
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    def drop_edge(self) -> None:
        """Unregister :attr:`receive_fd`'s edge-triggered registration (trio's one-shot wait comes next)."""
        epoll, self.edge_epoll = self.edge_epoll, None
        if epoll is not None and self.receive_fd is not None:
            try:
                epoll.unregister(self.receive_fd)  # type: ignore[attr-defined]
            except (OSError, ValueError):  # the run's epoll is closed, or the descriptor is gone
                pass

    async def _wait_readable(self, fd: int) -> int:
        if self.edge_epoll is not None:
            self.drop_edge()
        await trio.lowlevel.wait_readable(fd)
        if self.receive_fd is None:
            raise trio.ClosedResourceError("the stream was closed while reading")
        return fd

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        fd = self.send_fd
        if fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            sent, length = 0, len(view)
            while sent < length:
                try:
                    sent += os.write(fd, view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(fd)
                    fd = self.send_fd
                    if fd is None:
                        raise trio.ClosedResourceError("the stream was closed while writing") from None
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc

    def write_nowait(self, data: bytes) -> int:
        """Write what the pipe takes now, without waiting; how much it took.

        Raises:
            trio.ClosedResourceError: the stream is closed.
            BlockingIOError: the pipe is full.
            OSError: the write failed (the reader is gone).
        """
        fd = self.send_fd
        if fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        return os.write(fd, data)

    async def wait_send_all_might_not_block(self) -> None:
        if self.send_fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        await trio.lowlevel.wait_writable(self.send_fd)

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self._close_fd("send_fd")

    async def aclose(self) -> None:
        self._close_fd("send_fd")
        self._close_fd("receive_fd")
        await trio.lowlevel.checkpoint()

    def _close_fd(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd is not None:
            setattr(self, attr, None)
            if attr == "receive_fd":
                self.edge_epoll = None  # notify_closing unregisters it
            trio.lowlevel.notify_closing(fd)  # a task waiting on it wakes with ClosedResourceError
            os.close(fd)


def stdio_stream() -> PipeStream:
    """Our stdin and stdout as one trio stream (dup'd descriptors; nothing else may write stdout)."""
    return PipeStream(os.dup(0), os.dup(1))
