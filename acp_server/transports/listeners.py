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

__all__ = ["isolated", "open_unix_listener", "serve_tcp", "serve_unix", "stdio_stream", "listener_url"]

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


def stdio_stream() -> trio.StapledStream[Any, Any]:
    """Our stdin and stdout as one trio stream (dup'd descriptors; nothing else may write stdout)."""
    return trio.StapledStream(trio.lowlevel.FdStream(os.dup(1)), trio.lowlevel.FdStream(os.dup(0)))
