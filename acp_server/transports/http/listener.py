"""``serve_http``: the HTTP listener, hypercorn's trio worker in the server's nursery.

HTTP/1.1 and HTTP/2 over cleartext (h2c with prior knowledge, and the ``Upgrade: h2c`` dance), and
WebSocket over HTTP/1.1. The socket is bound here (a Unix socket with mode 0600, as the NDJSON one),
and connections are served by hypercorn's protocol code (``TCPServer``) one by one, each isolated.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

from ..address import ListenAddress
from ..listeners import ConnectionGate, bind_tcp_socket, open_unix_listener, serve_listeners
from .app import AcpHttpApp, HttpLimits, HttpOptions
from .rules import HostRules
from .wire import BatchedWrites

__all__ = ["serve_http"]

log = logging.getLogger("acp_server.http")


def _config(limits: HttpLimits) -> Config:
    config = Config()
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = 0.5
    config.include_server_header = False
    config.websocket_max_message_size = limits.max_message_bytes
    config.h2_max_inbound_frame_size = 2**14
    return config


async def _serve_connections(
    app: AcpHttpApp,
    config: Config,
    listener: trio.SocketListener,
    *,
    gate: ConnectionGate | None = None,
    name: str = "http",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker loop, with each TCP connection isolated (and counted by ``gate``, the
    server's ``--max-connections`` shared with its other listeners, when given).

    ``hypercorn.trio.serve`` runs every connection in one ``trio.serve_listeners``, where an exception
    escaping one connection's handler (hypercorn's own protocol code meeting a malformed peer, say)
    ends the whole listener. Here each connection runs hypercorn's ``TCPServer`` under a guard: its
    failure is logged and closes that connection alone. Its socket is wrapped in
    :class:`~.wire.BatchedWrites`, so that the writes of one burst leave together.
    """
    wrapped = ASGIWrapper(app)  # type: ignore[arg-type]
    context = WorkerContext(None)

    async def connection(stream: trio.SocketStream) -> None:
        try:
            async with trio.open_nursery() as nursery:
                batched = BatchedWrites(stream)
                nursery.start_soon(batched.flusher)
                await TCPServer(wrapped, config, context, {}, batched)  # type: ignore[arg-type]
                nursery.cancel_scope.cancel()
        except Exception:
            log.warning("http: a connection failed in the HTTP layer; closing it alone", exc_info=True)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    if gate is None:
        await trio.serve_listeners(connection, [listener], task_status=task_status)
        return
    await serve_listeners(
        connection,  # type: ignore[arg-type]
        [listener],
        gate=gate,
        name=name,
        refusal=_http_refusal(gate.limit),
        task_status=task_status,
    )


def _http_refusal(limit: int) -> bytes:
    """The whole HTTP/1.1 answer to a connection past ``--max-connections``: 503 with the error body."""
    body = msgspec.json.encode({
        "error": f"The server holds its limit of {limit} connections (--max-connections); retry later",
        "code": "too_many_connections",
        "limit": limit,
        "retryAfterMs": 1000,
    })
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _rest_api(handle_stream: Any, options: HttpOptions) -> Any:
    """The REST API over the server whose shell ``handle_stream`` is (``None`` for any other stream handler)."""
    from ...server import Server
    from .rest import RestApi

    server = getattr(handle_stream, "__self__", None)
    if not isinstance(server, Server):
        return None
    return RestApi(server, max_message_bytes=options.limits.max_message_bytes, workspace=options.workspace)


def _readiness(handle_stream: Any) -> Any:
    """What ``/health?ready=1`` asks: the shared admission's readiness when the server has a
    coordinator (503 while it is down in ``closed`` mode, or while draining), else nothing."""
    server = getattr(handle_stream, "__self__", None)
    shared = getattr(getattr(server, "bridge", None), "shared", None)
    return None if shared is None else shared.readiness


async def serve_http(
    handle_stream: Callable[[trio.abc.Stream, str], Awaitable[None]],
    address: ListenAddress,
    options: HttpOptions,
    *,
    gate: ConnectionGate | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/acp`` and ``/health`` on ``address`` until cancelled.

    Once bound it prints ``acp-server: http on http://HOST:PORT`` (or ``unix:/path``) to stderr and
    reports that URL. Hypercorn's logs go to the ``acp_server.http`` logger (stderr, never stdout).

    Args:
        handle_stream: serves one connection's byte stream (the server's per-connection shell).
        address: ``tcp`` (port 0: any free port) or ``unix``.
        options: bounds and allowed origins.
        gate: the count of open sockets shared with the server's other listeners (``--max-connections``);
            a connection past it is answered 503 ``too_many_connections`` and closed.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    try:
        if address.kind == "unix":
            listener = await open_unix_listener(address.path)
            url = f"unix:{address.path}"
            rules = HostRules(port=None, allow_origins=options.allow_origins)
        else:
            listener = trio.SocketListener(await bind_tcp_socket(address.host, address.port))
            host, port = listener.socket.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{port}"
            rules = HostRules(port=port, bound_host=shown, allow_origins=options.allow_origins)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on http {address}: {exc.strerror or exc}") from exc
    try:
        async with listener, trio.open_nursery() as nursery:
            app = AcpHttpApp(handle_stream, nursery, rules, options.limits, _rest_api(handle_stream, options))
            app.readiness = _readiness(handle_stream)
            await nursery.start(
                partial(_serve_connections, gate=gate, name=f"http {address}"), app, _config(options.limits), listener
            )
            print(f"acp-server: http on {url}", file=sys.stderr, flush=True)
            task_status.started(url)
    finally:
        if address.kind == "unix":
            try:
                os.unlink(address.path)
            except OSError:
                pass
