"""One server instance: the bridge, the method table, the connections, the listeners.

Everything shares one :class:`~acp_server.bridge.SessionBridge`, so a session created over TCP can be
prompted from a Unix connection or from stdio. There are no module globals: servers in one process
are independent.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from . import __version__
from .admission import Limits
from .admission.policy import PolicyEngine, PolicyLimits
from .admission.pool import CapacityManager, PoolLimits
from .admission.shared import SharedAdmission, shared_plan
from .auth.peers import PeerInfo, describe_stream
from .auth.settings import AuthSettings
from .backends import Backend, EchoBackend
from .backends.registry import build_backends
from .bridge import SessionBridge
from .config import BackendConfig
from .coordinator.settings import CoordinatorSettings
from .errors import AcpError
from .handlers import NOTIFICATIONS, REQUESTS, ConnContext
from .handlers.gate import credentials_upkeep, gated
from .jsonrpc import Dispatcher
from .listen_address import ListenAddress
from .signals import ShutdownSignals, shutdown_signals
from .statsfeed import StatsFeed
from .transports import ConnectionGate, ConnectionShell, listener_url, serve_tcp, serve_unix, stdio_stream
from .transports.refusal_budget import DEFAULT_REFUSAL_BUDGET, RefusalBudgetSettings
from .transports.timing import LatencyHistogram
from .types.ext import LimitsCapability

if TYPE_CHECKING:
    from .auth.gate import Authenticator
    from .store import SessionStore

__all__ = ["ListenAddress", "Server", "ServerConfig", "serve"]

log = logging.getLogger("acp_server")

#: How long shutdown waits for cancelled prompts to be answered and written.
SHUTDOWN_GRACE_S = 3.0
#: ``--drain-timeout-s``: how long accepted requests may still run once their input has ended
DRAIN_TIMEOUT_S = 30.0
#: ``--connection-idle-timeout-s``: a socket holding nothing is closed after this long without input
CONNECTION_IDLE_TIMEOUT_S = 300.0
#: a socket that has sent no complete line by then is closed
FIRST_MESSAGE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerConfig:
    """What :func:`serve` runs: transports, limits, backends, the store, the policy and metrics."""

    stdio: bool = False
    listen: Sequence[ListenAddress] = field(default_factory=list)
    echo_delay_ms: int = 0
    limits: Limits = field(default_factory=Limits)
    #: name -> backend configuration (default: the echo agent alone)
    backends: Mapping[str, BackendConfig] = field(default_factory=dict)
    default_backend: str = "echo"
    #: the durable store's directory (``None``: ephemeral, everything in memory)
    state_dir: str | None = None
    #: the admission policy (every limit off by default)
    policy: PolicyLimits = field(default_factory=PolicyLimits)
    #: where ``GET /metrics`` is served (``None``: no metrics endpoint); ``tcp`` only
    metrics_listen: ListenAddress | None = None
    #: label tenant series with tenant ids (unbounded, possibly sensitive: off by default)
    metrics_tenant_labels: bool = False
    #: where ``/acp`` and ``/health`` are served over HTTP (``tcp`` or ``unix``; none by default)
    http_listen: Sequence[ListenAddress] = field(default_factory=list)
    #: the HTTP listeners' bounds and allowed origins (an ``HttpOptions``; ``None``: the defaults)
    http: Any = None
    #: sockets of every listener together (0: from the fd limit, see ``default_max_connections``)
    max_connections: int = 0
    #: send ``_acp_server/turn_state`` to connections whose ``initialize`` does not say (``--turn-states``)
    turn_states: bool = False
    #: tokens, audit log, rate limit and TLS (``None``: none of them)
    auth: AuthSettings | None = None
    #: where the limits are shared with other replicas (``None`` or no URL: this process's own)
    coordinator: CoordinatorSettings | None = None
    #: ``--drain-timeout-s`` (config ``drain_timeout_s``), one setting for two drains: after a
    #: connection's input ends, how long its accepted requests may run (``None``: :data:`DRAIN_TIMEOUT_S`);
    #: on SIGTERM, when set, refuse new prompts (``draining``) and let running ones finish this long
    #: (``None`` or 0: cancel them at once)
    drain_timeout_s: float | None = None
    #: ``--connection-idle-timeout-s`` (0: off): a socket that holds nothing is closed after this long
    connection_idle_timeout_s: float = CONNECTION_IDLE_TIMEOUT_S
    #: ``--refusal-budget-rps`` / ``--refusal-budget-burst``: each peer's budget of hold-off refusals
    refusal_budget: RefusalBudgetSettings = DEFAULT_REFUSAL_BUDGET


class Server:
    """The server: owns the bridge and serves connections on any trio stream.

    Args:
        limits: every bound of this instance.
        backend: the agent behind the bridge (default: the echo agent).
        store: the durable store, already opened (default: none, every session in memory only).
        turn_states: whether a connection gets turn states when its ``initialize`` does not say
            (default: no; ``_meta.turnStates`` decides per connection).
        auth: the token checks of ``--auth-tokens`` (default: none; every connection is the owner's).
        drain_timeout_s: after a connection's input ends, how long its accepted requests may still run.
        connection_idle_timeout_s: a socket holding nothing is closed after this long without input (0: never).
        refusal_budget: each connection's budget of hold-off refusals; a peer that spends it is evicted
            (``ignored_retry_after``; a zero rate turns it off).
    """

    version = __version__

    def __init__(
        self,
        limits: Limits | None = None,
        backend: Backend | Mapping[str, Backend] | None = None,
        *,
        default_backend: str | None = None,
        capacity: CapacityManager | None = None,
        store: SessionStore | None = None,
        policy: PolicyLimits | None = None,
        turn_states: bool = False,
        auth: Authenticator | None = None,
        shared: SharedAdmission | None = None,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        connection_idle_timeout_s: float = CONNECTION_IDLE_TIMEOUT_S,
        refusal_budget: RefusalBudgetSettings = DEFAULT_REFUSAL_BUDGET,
    ) -> None:
        self.limits = limits or Limits()
        self.refusal_budget = refusal_budget
        self.drain_timeout_s = drain_timeout_s
        self.connection_idle_timeout_s = connection_idle_timeout_s
        self.turn_states = turn_states
        #: the token checks (``None``: no tokens configured, every connection is the owner's)
        self.auth = auth
        self.policy = PolicyEngine(policy)
        stored, prompt_seq = store.open() if store is not None else ({}, 0)
        self.store = store
        self.bridge = SessionBridge(
            backend or EchoBackend(),
            self.limits,
            default_backend=default_backend,
            capacity=capacity,
            store=store,
            stored=stored,
            prompt_seq=prompt_seq,
            policy=self.policy,
            shared=shared,
        )
        for each in self.bridge.backends.values():
            if hasattr(each, "relay_max_bytes"):  # an agent's messages obey the clients' size rule
                each.relay_max_bytes = self.limits.max_message_bytes
        if auth is None:
            self.dispatcher = Dispatcher(REQUESTS, NOTIFICATIONS)
        else:
            self.dispatcher = Dispatcher(gated(REQUESTS), gated(NOTIFICATIONS))
        self.connections: set[ConnectionShell] = set()
        # Bound once: each connection's shell keeps these (a bound method made per connection is 64 bytes).
        self._on_shell_closed = self._closed
        self._shell_holds = self._holds
        self._running = 0
        self._all_done = trio.Event()
        #: connections closed for letting their outbound queue overflow
        self.evictions = 0
        #: server-side cost of each overload refusal: request read -> error written
        self.refusal_latency = LatencyHistogram()
        #: overload refusals written, by ``errorKind`` (a console turns successive counts into rates)
        self.refusal_kinds: dict[str, int] = {}
        #: the connections subscribed to ``_acp_server/stats/subscribe``
        self.stats_feed = StatsFeed(self.stats_snapshot, cluster=shared.coordinator.cluster if shared is not None else None)

    def stats_snapshot(self) -> dict[str, Any]:
        """Every gauge and counter, as ``_acp_server/stats`` returns it and the metrics endpoint renders it.

        Cheap (no I/O), taken in the event loop's thread; plain builtins with camelCase keys.
        """
        bridge = self.bridge
        out_bridge: dict[str, Any] = msgspec.to_builtins(bridge.statistics())
        out_bridge["selfHealResumesTotal"] = bridge.self_heal_resumes
        return {
            "bridge": out_bridge,
            "pools": {name: msgspec.to_builtins(s) for name, s in bridge.capacity.statistics().items()},
            "admission": msgspec.to_builtins(self.policy.statistics()),
            "connections": {
                "open": len(self.connections),
                "evictionsTotal": self.evictions,
                "byTransport": self._connections_by_transport(),
            },
            "refusals": {**self.refusal_latency.snapshot(), "byKind": dict(self.refusal_kinds)},
            "sessions": self._session_rows(),
            # backends that count their own work (a model endpoint: requests, retries, tokens)
            "backends": {n: b.statistics() for n, b in bridge.backends.items() if hasattr(b, "statistics")},
            **self._coordinator_snapshot(),
        }

    def _coordinator_snapshot(self) -> dict[str, Any]:
        shared = self.bridge.shared
        if shared is None:
            return {}
        return {"coordinator": msgspec.to_builtins(shared.coordinator.statistics())}

    async def drain(self, timeout_s: float) -> None:
        """Refuse new prompts (``capacity_unavailable``, ``draining``) and wait up to ``timeout_s`` for the
        admitted ones to end."""
        bridge = self.bridge
        bridge.draining = True
        log.warning("draining: new prompts are refused; waiting up to %g s for %d running", timeout_s, bridge.pending_total())
        with trio.move_on_after(timeout_s):
            while bridge.pending_total():  # noqa: ASYNC110 - a sum over every session
                await trio.sleep(0.05)

    def _connections_by_transport(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for shell in self.connections:
            out[shell.transport] = out.get(shell.transport, 0) + 1
        return out

    def _session_rows(self, limit: int = 50) -> list[dict[str, Any]]:
        """The sessions with the most pending prompts first (at most ``limit``), for a console."""
        rows = sorted(self.bridge.sessions.values(), key=lambda s: (-s.pending_count, s.session_id))[:limit]
        return [
            {
                "sessionId": s.session_id,
                "tenant": s.tenant,
                "pending": s.pending_count,
                "running": s.running_ticket is not None,
                "attached": len(s.attached),
            }
            for s in rows
        ]

    def limits_capability(self) -> LimitsCapability:
        """``limits`` as ``initialize`` and ``_acp_server/capabilities`` advertise them (null: disabled)."""
        lim = self.limits
        return LimitsCapability(
            max_pending_prompts_per_session=lim.pending_limit,
            prompt_deadline_ms=lim.prompt_deadline_ms or None,
            max_message_bytes=lim.max_message_bytes,
            max_outbound_bytes=lim.outbound_bytes,
            max_inflight_requests=lim.max_inflight_requests,
            client_idle_timeout_s=lim.client_idle_timeout_s,
            session_idle_timeout_s=lim.session_idle_timeout_s,
        )

    def _closed(self, shell: ConnectionShell) -> None:
        if shell.evicted:
            self.evictions += 1
        self.stats_feed.unsubscribe(shell)
        self.connections.discard(shell)
        self.bridge.peer_closed(shell)

    def _context(self, shell: ConnectionShell, info: PeerInfo | None) -> ConnContext:
        ctx = ConnContext(self, shell)
        if info is not None:  # tokens are configured: only the owner's transports skip them
            ctx.peer_info = info
            if not info.trusted:
                ctx.identity = info.identity  # None unless the transport checked a token (HTTP's bearer)
                if info.identity is not None:
                    ctx.tenant = info.tenant or info.identity.tenant or "default"
        return ctx

    def _holds(self, shell: ConnectionShell) -> bool:
        """Whether the bridge keeps something for ``shell`` (a session it is attached to)."""
        state = self.bridge.clients.peers.get(shell)
        return state is not None and state.holds_sessions()

    async def handle_stream(
        self, stream: trio.abc.Stream, name: str = "connection", *, trusted: bool = False, socket: bool = True
    ) -> None:
        """Serve one connection until it ends (its failures stay its own).

        ``trusted``: the stream is the owner's (stdio) whatever it looks like; Unix sockets are found
        out by themselves. With tokens configured, every other peer must prove one. ``socket``: the
        first-message and idle timeouts and the refusal budget apply (not to stdio, the editor's own pipe).
        """
        lim = self.limits
        info = None
        if self.auth is not None:
            info = describe_stream(stream)
            if trusted:
                info = PeerInfo("stdio", trusted=True)
        shell = ConnectionShell(
            stream,
            self.dispatcher,
            partial(self._context, info=info),  # not a closure: this frame would keep two cells per connection
            max_message_bytes=lim.max_message_bytes,
            max_outbound_bytes=lim.outbound_bytes,
            max_inflight_requests=lim.max_inflight_requests,
            on_close=self._on_shell_closed,
            name=name,
            refusal_latency=self.refusal_latency,
            drain_timeout_s=self.drain_timeout_s,
            first_message_timeout_s=FIRST_MESSAGE_TIMEOUT_S if socket else None,
            idle_timeout_s=(self.connection_idle_timeout_s or None) if socket else None,
            holds=self._shell_holds,
            refusal_kinds=self.refusal_kinds,
            transport=transport_of(stream, name),
            refusal_budget=self.refusal_budget if socket else None,  # not the editor's own pipe
        )
        self.connections.add(shell)
        self._running += 1
        try:
            await shell.run()
        except Exception:
            # The frame every transport's connection runs in (stdio included): its defect is its own.
            log.exception("%s: connection failed; closed", name)
        finally:
            self._running -= 1
            if not self._running:
                self._all_done.set()

    async def shutdown(self) -> None:
        """Cancel every prompt (they answer ``cancelled``), let the answers out, close connections."""
        self.bridge.cancel_all()
        with trio.move_on_after(SHUTDOWN_GRACE_S):
            while any(c.inflight for c in self.connections):  # noqa: ASYNC110 - a condition over many connections
                await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        if self._running:
            # Closed connections flush what is queued (bounded by the shell's own timeout).
            self._all_done = trio.Event()
            with trio.move_on_after(SHUTDOWN_GRACE_S):
                await self._all_done.wait()


def transport_of(stream: trio.abc.Stream, name: str) -> str:
    """What a connection came over, for the stats: ``ws``/``http`` (named by the HTTP listener),
    ``stdio``, else what the socket is (``tcp``, ``tls``, ``unix``; ``stream`` for anything else)."""
    first = name.split(" ", 1)[0]
    if first in ("ws", "http", "stdio"):
        return first
    return describe_stream(stream).transport


async def serve(config: ServerConfig, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a server until SIGINT/SIGTERM, or until stdin ends when stdio is the only transport.

    A second signal during the shutdown is absorbed; a third one stops without waiting for the answers
    of cancelled prompts (see :mod:`acp_server.signals`).

    Each listener prints one line to stderr when ready: ``acp-server: listening on URL``.
    """
    configs = dict(config.backends) or {"echo": BackendConfig(kind="echo", delay_ms=config.echo_delay_ms)}
    backends = build_backends(configs)
    capacity = CapacityManager(
        {name: PoolLimits(max_active=c.max_active, max_waiting=c.max_waiting) for name, c in configs.items()}
    )
    store = None
    if config.state_dir is not None:
        from .store import SessionStore  # sqlite3 and the writer load only with a state directory

        store = SessionStore(config.state_dir)
    settings = config.auth or AuthSettings()
    auth = None
    if settings.tokens is not None:
        from .auth.gate import Authenticator  # the token checks load only with tokens

        auth = Authenticator(settings.tokens, audit=settings.audit, rate_limit_rps=settings.rate_limit_rps)
    coordinator: Any = None
    shared: SharedAdmission | None = None
    shared_settings = config.coordinator
    if shared_settings is not None and shared_settings.url is not None:
        from .coordinator import redis_coordinator  # coredis loads only with a coordinator

        coordinator = redis_coordinator(
            shared_settings.url, prefix=shared_settings.prefix,
            replica_id=shared_settings.effective_replica_id(),
            lease_ttl_s=shared_settings.lease_ttl_s, timeout_ms=shared_settings.timeout_ms,
            failure=shared_settings.failure, expected_replicas=shared_settings.expected_replicas,
        )
        pools = {name: PoolLimits(max_active=c.max_active, max_waiting=c.max_waiting) for name, c in configs.items()}
        shared = SharedAdmission(coordinator, shared_plan(config.policy, pools), lambda: server.bridge.draining)
    server = Server(
        config.limits,
        backends,
        default_backend=config.default_backend if config.backends else "echo",
        capacity=capacity,
        store=store,
        policy=config.policy,
        turn_states=config.turn_states,
        auth=auth,
        shared=shared,
        drain_timeout_s=config.drain_timeout_s if config.drain_timeout_s is not None else DRAIN_TIMEOUT_S,
        connection_idle_timeout_s=config.connection_idle_timeout_s,
        refusal_budget=config.refusal_budget,
    )
    with shutdown_signals() as signals:
        try:
            async with coordinator.running() if coordinator is not None else contextlib.nullcontext():
                await _serve(server, config, backends, signals, task_status)
        finally:
            if store is not None:
                store.close()  # what is still queued is written (a clean shutdown loses nothing)


async def _serve(
    server: Server,
    config: ServerConfig,
    backends: Mapping[str, Backend],
    signals: ShutdownSignals,
    task_status: trio.TaskStatus[Server],
) -> None:
    tls = config.auth.tls if config.auth is not None else None
    async with trio.open_nursery() as nursery:
        for backend in backends.values():
            run = getattr(backend, "run", None)
            if run is not None:
                await nursery.start(run)
        await nursery.start(server.bridge.run)
        await nursery.start(server.stats_feed.run)
        ensure_started = getattr(server.bridge.backend, "ensure_started", None)
        if ensure_started is not None:
            try:
                await ensure_started()  # so that initialize can advertise the agent's authMethods
            except AcpError as exc:
                log.warning("default backend %s did not start: %s", server.bridge.backend.name, exc)
        serving = trio.open_nursery()
        gate = ConnectionGate(config.max_connections)  # one count for every listener
        async with serving as listeners:
            if server.auth is not None or tls is not None:
                # before any listener is announced: a SIGHUP after "listening on" must find its handler
                await listeners.start(credentials_upkeep, server, tls)
            for addr in config.listen:
                try:
                    if addr.kind == "tcp":
                        tcp = partial(serve_tcp, host=addr.host, gate=gate)
                        bound = await listeners.start(tcp, server.handle_stream, addr.port)
                    elif addr.kind == "tls":
                        assert tls is not None  # the command line checked it
                        from .auth.tls import tls_handler  # loaded with TLS settings (--tls-cert)

                        handler = tls_handler(server.handle_stream, tls, f"tls {addr}")
                        tcp = partial(serve_tcp, host=addr.host, gate=gate)
                        bound = await listeners.start(tcp, handler, addr.port)
                    else:
                        bound = await listeners.start(partial(serve_unix, gate=gate), server.handle_stream, addr.path)
                except OSError as exc:
                    raise OSError(exc.errno, f"cannot listen on {addr}: {exc.strerror or exc}") from exc
                for listener in bound:
                    url = listener_url(listener)
                    if addr.kind == "tls":
                        url = "tls" + url.removeprefix("tcp")
                    print(f"acp-server: listening on {url}", file=sys.stderr, flush=True)
            if config.metrics_listen is not None:
                from .metrics import serve_metrics  # hypercorn and prometheus_client load only when asked

                await listeners.start(
                    partial(serve_metrics, tenant_labels=config.metrics_tenant_labels, auth=server.auth, tls=tls),
                    server.stats_snapshot,
                    config.metrics_listen,
                )

            if config.http_listen:
                from dataclasses import replace

                from .transports.http import HttpOptions
                from .transports.http.listener import serve_http  # hypercorn loads only when asked

                options = config.http if config.http is not None else HttpOptions()
                lim = server.limits  # one source for the message and queue bounds of every transport
                options = replace(
                    options,
                    limits=replace(
                        options.limits, max_message_bytes=lim.max_message_bytes, max_outbound_bytes=lim.outbound_bytes
                    ),
                )
                for addr in config.http_listen:
                    await listeners.start(partial(serve_http, gate=gate, tls=tls), server.handle_stream, addr, options)

            async def stdio_then_exit() -> None:
                await server.handle_stream(stdio_stream(), "stdio", trusted=True, socket=False)
                if not config.listen:
                    log.info("stdin closed, its requests answered, and no listeners: exiting")
                    listeners.cancel_scope.cancel()

            if config.stdio:
                listeners.start_soon(stdio_then_exit)

            async def on_signals() -> None:
                await signals.first()
                async with trio.open_nursery() as watching:
                    with trio.CancelScope() as forced:
                        watching.start_soon(signals.absorb, forced)  # a second signal is absorbed, a third forces
                        if config.drain_timeout_s:
                            await server.drain(config.drain_timeout_s)
                        with trio.move_on_after(SHUTDOWN_GRACE_S + 1):
                            await server.shutdown()
                    watching.cancel_scope.cancel()
                listeners.cancel_scope.cancel()

            listeners.start_soon(on_signals)
            task_status.started(server)
        nursery.cancel_scope.cancel()
