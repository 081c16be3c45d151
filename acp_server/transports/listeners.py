"""TCP and Unix listeners shaped like ``trio.serve_listeners``, and the stdio stream.

Each listener is started with ``await nursery.start(serve_tcp, handler, port, host=...)`` and reports
the bound listeners, so the CLI and tests learn the real port. Each connection's handler is isolated:
an exception in it is logged and closes that connection only.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as _stdsocket
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["PipeStream", "isolated", "listener_url", "open_unix_listener", "serve_tcp", "serve_unix", "stdio_stream"]

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
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve TCP connections on every address ``host`` resolves to."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    await trio.serve_listeners(isolated(handler, f"tcp {host}:{port}"), listeners, task_status=task_status)


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
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve connections on a Unix socket at ``path``; the socket file is removed on exit."""
    listener = await open_unix_listener(path)
    try:
        await trio.serve_listeners(isolated(handler, f"unix {path}"), [listener], task_status=task_status)
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

    Args:
        receive_fd: the descriptor to read (stdin's duplicate); set non-blocking.
        send_fd: the descriptor to write (stdout's duplicate); set non-blocking.
    """

    def __init__(self, receive_fd: int, send_fd: int) -> None:
        os.set_blocking(receive_fd, False)
        os.set_blocking(send_fd, False)
        self._receive_fd: int | None = receive_fd
        self._send_fd: int | None = send_fd
        self._emptied = False  # the last read returned less than asked: the pipe was empty then

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        fd = self._receive_fd
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

    async def _wait_readable(self, fd: int) -> int:
        await trio.lowlevel.wait_readable(fd)
        if self._receive_fd is None:
            raise trio.ClosedResourceError("the stream was closed while reading")
        return fd

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._send_fd
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
                    fd = self._send_fd
                    if fd is None:
                        raise trio.ClosedResourceError("the stream was closed while writing") from None
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc

    async def wait_send_all_might_not_block(self) -> None:
        if self._send_fd is None:
            raise trio.ClosedResourceError("the stream is closed")
        await trio.lowlevel.wait_writable(self._send_fd)

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self._close_fd("_send_fd")

    async def aclose(self) -> None:
        self._close_fd("_send_fd")
        self._close_fd("_receive_fd")
        await trio.lowlevel.checkpoint()

    def _close_fd(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd is not None:
            setattr(self, attr, None)
            trio.lowlevel.notify_closing(fd)  # a task waiting on it wakes with ClosedResourceError
            os.close(fd)


def stdio_stream() -> PipeStream:
    """Our stdin and stdout as one trio stream (dup'd descriptors; nothing else may write stdout)."""
    return PipeStream(os.dup(0), os.dup(1))
