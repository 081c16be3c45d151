"""``serve_http``: the HTTP listener, hypercorn's trio worker in the server's nursery.

HTTP/1.1 and HTTP/2 over cleartext (h2c with prior knowledge, and the ``Upgrade: h2c`` dance), and
WebSocket over HTTP/1.1. The socket is bound here (a Unix socket with mode 0600, as the NDJSON one),
and connections are served by hypercorn's protocol code (``TCPServer``) one by one, each isolated.

With TLS (``https://``), each accepted socket first completes its handshake within
``--tls-handshake-timeout-s`` (:func:`~acp_server.auth.tls.accept_tls`, ALPN ``h2`` and ``http/1.1``):
a silent or plain-TCP client is closed there, alone, and hypercorn only ever sees finished handshakes
(HTTP/2 when ``h2`` was chosen; WebSocket as ``wss://``). :func:`serve_app` is that loop for any ASGI
app (the metrics endpoint uses it too).
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
from hypercorn.trio.worker_context import WorkerContext

from ...auth.http_rules import TrustedProxies
from ...auth.tls import HTTP_ALPN, ServerTls, TlsHandshakeError, accept_tls
from ..address import ListenAddress
from ..listeners import ConnectionGate, bind_tcp_socket, open_unix_listener, serve_listeners
from .addresses import ForwardedFor
from .app import AcpHttpApp, HttpLimits, HttpOptions
from .auth import HttpGuard
from .rules import HostRules
from .wire import BatchedTCPServer, BatchedWrites, TlsBatchedWrites

__all__ = ["serve_app", "serve_http"]

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


async def serve_app(
    app: Any,
    config: Config,
    listener: trio.SocketListener,
    *,
    tls: ServerTls | None = None,
    gate: ConnectionGate | None = None,
    name: str = "http",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker loop, with each TCP connection isolated (and counted by ``gate``, the
    server's ``--max-connections`` shared with its other listeners, when given), and, with ``tls``,
    each connection's handshake bounded before hypercorn sees it (a failed one is logged at info and
    closes that connection alone; each handshake takes the context in force, so a SIGHUP reload
    applies to new connections).

    ``hypercorn.trio.serve`` runs every connection in one ``trio.serve_listeners``, where an exception
    escaping one connection's handler (hypercorn's own protocol code meeting a malformed peer, say)
    ends the whole listener. Here each connection runs hypercorn's ``TCPServer`` under a guard: its
    failure is logged and closes that connection alone. Its socket is wrapped in
    :class:`~.wire.BatchedWrites`, so that the writes of one burst leave together.
    """
    wrapped = ASGIWrapper(app)
    context = WorkerContext(None)

    async def connection(stream: trio.SocketStream) -> None:
        batched: BatchedWrites
        if tls is not None:
            try:
                secure = await accept_tls(stream, tls)
            except TlsHandshakeError as exc:
                log.info("%s: %s; connection closed", name, exc)
                return
            batched = TlsBatchedWrites(secure, stream.socket)
        else:
            batched = BatchedWrites(stream)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(batched.flusher)
                await BatchedTCPServer(wrapped, config, context, {}, batched)
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


def _rules(options: HttpOptions, *, port: int | None, bound_host: str = "127.0.0.1", scheme: str = "http") -> HostRules:
    return HostRules(
        port=port, bound_host=bound_host, allow_origins=options.allow_origins, allow_hosts=options.allow_hosts, scheme=scheme
    )


def _rest_api(handle_stream: Any, options: HttpOptions) -> Any:
    """The REST API over the server whose shell ``handle_stream`` is (``None`` for any other stream handler)."""
    from ...server import Server
    from .rest import RestApi

    server = getattr(handle_stream, "__self__", None)
    if not isinstance(server, Server):
        return None
    return RestApi(server, max_message_bytes=options.limits.max_message_bytes, workspace=options.workspace)


def _guard(handle_stream: Any, address: ListenAddress) -> HttpGuard:
    """The credential checks of the server whose shell ``handle_stream`` is (none for any other handler;
    a Unix socket's peers are the owner's)."""
    auth = getattr(getattr(handle_stream, "__self__", None), "auth", None)
    return HttpGuard(auth, trusted=address.kind == "unix")


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
    tls: ServerTls | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/acp`` and ``/health`` on ``address`` until cancelled.

    Once bound it prints ``acp-server: http on http://HOST:PORT`` (``https://`` with TLS, or
    ``unix:/path``) to stderr and reports that URL. Hypercorn's logs go to the ``acp_server.http``
    logger (stderr, never stdout).

    Args:
        handle_stream: serves one connection's byte stream (the server's per-connection shell).
        address: ``tcp`` (port 0: any free port), ``https`` (the same with TLS) or ``unix``.
        options: bounds, allowed hosts and origins, trusted proxies.
        gate: the count of open sockets shared with the server's other listeners (``--max-connections``);
            a connection past it is answered 503 ``too_many_connections`` and closed.
        tls: the server's certificates (``address.kind == "https"`` needs them); this listener offers
            ALPN ``h2`` and ``http/1.1``.

    Raises:
        ValueError: an ``https`` address without ``tls``.
        OSError: the address cannot be bound (the message names it).
    """
    secure = address.kind == "https"
    if secure and tls is None:
        raise ValueError(f"--http-listen {address}: https:// needs --tls-cert FILE and --tls-key FILE")
    http_tls = tls.with_alpn(HTTP_ALPN) if secure and tls is not None else None
    scheme = "https" if secure else "http"
    try:
        if address.kind == "unix":
            listener = await open_unix_listener(address.path)
            url = f"unix:{address.path}"
            rules = _rules(options, port=None)
        else:
            listener = trio.SocketListener(await bind_tcp_socket(address.host, address.port))
            host, port = listener.socket.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            url = f"{scheme}://{shown}:{port}"
            rules = _rules(options, port=port, bound_host=shown, scheme=scheme)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on http {address}: {exc.strerror or exc}") from exc
    proxies = TrustedProxies(options.trusted_proxies)
    try:
        async with listener, trio.open_nursery() as nursery:
            app = AcpHttpApp(
                handle_stream, nursery, rules, options.limits, _rest_api(handle_stream, options), _guard(handle_stream, address)
            )
            app.readiness = _readiness(handle_stream)
            served: Any = ForwardedFor(app, proxies) if proxies.networks else app
            await nursery.start(
                partial(serve_app, tls=http_tls, gate=gate, name=f"http {address}"), served, _config(options.limits), listener
            )
            print(f"acp-server: http on {url}", file=sys.stderr, flush=True)
            task_status.started(url)
    finally:
        if address.kind == "unix":
            try:
                os.unlink(address.path)
            except OSError:
                pass
