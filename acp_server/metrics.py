"""The Prometheus endpoint: the server's one stats snapshot, rendered as metrics over HTTP.

:func:`render_metrics` is pure: it turns the dict that ``Server.stats_snapshot()`` returns (the same one
``_acp_server/stats`` answers with) into the Prometheus text format. :func:`serve_metrics` serves it on
``GET /metrics`` with hypercorn's trio worker. A scrape takes the snapshot in the trio thread (it is a
handful of dict reads) and renders it in a worker thread, so a slow scrape never stalls the event loop.

Every series is prefixed ``acp_server_``. Tenant ids become label values only with
``tenant_labels=True`` (``--metrics-tenant-labels``): they are unbounded and may be sensitive, so by
default no series carries one. A section or key missing from the snapshot yields no sample rather
than a failure, so that a server whose policy is off (or a snapshot from an older server) still renders.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from .listen_address import ListenAddress
from .transports.listeners import bind_tcp_socket

if TYPE_CHECKING:
    from .auth.tls import ServerTls

__all__ = ["CONTENT_TYPE", "METRICS_PATH", "render_metrics", "serve_metrics"]

log = logging.getLogger("acp_server.metrics")

METRICS_PATH = "/metrics"
#: The Prometheus text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "acp_server_"

Snapshot = Mapping[str, Any]


def _num(section: Any, key: str) -> float | None:
    """``section[key]`` when it is a number (bools excluded), else ``None`` (absent or malformed)."""
    if not isinstance(section, Mapping):
        return None
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _table(section: Any, key: str) -> Mapping[str, Any]:
    value = section.get(key) if isinstance(section, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _gauge(name: str, doc: str, section: Any, key: str, scale: float = 1.0) -> GaugeMetricFamily:
    family = GaugeMetricFamily(_P + name, doc)
    if (value := _num(section, key)) is not None:
        family.add_metric([], value * scale)
    return family


def _counter(name: str, doc: str, section: Any, key: str, scale: float = 1.0) -> CounterMetricFamily:
    family = CounterMetricFamily(_P + name, doc)
    if (value := _num(section, key)) is not None:
        family.add_metric([], value * scale)
    return family


def _labelled(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    label: str,
    rows: Mapping[str, Any],
    key: str,
    scale: float = 1.0,
) -> Metric:
    """One series per ``rows`` entry (``label`` = its name), valued ``rows[name][key] * scale``."""
    family = kind(_P + name, doc, labels=[label])
    for value_of, row in rows.items():
        if (value := _num(row, key)) is not None:
            family.add_metric([str(value_of)], value * scale)
    return family


def _bound(upper: float) -> str:
    return "+Inf" if math.isinf(upper) else repr(upper)


def _histogram(name: str, doc: str, label: str, rows: Mapping[str, Any]) -> HistogramMetricFamily:
    """A histogram per row from its cumulative ``buckets`` ``[[upper_s, count], ...]``, ``sum`` and ``count``."""
    family = HistogramMetricFamily(_P + name, doc, labels=[label])
    for value_of, row in rows.items():
        raw = row.get("buckets") if isinstance(row, Mapping) else None
        if not isinstance(raw, list | tuple):
            continue
        try:
            buckets = [(_bound(float(upper)), float(count)) for upper, count in raw]
        except (TypeError, ValueError):
            continue  # not [[bound, count], ...]: no series rather than a failed scrape
        total = _num(row, "count")
        if not buckets or buckets[-1][0] != "+Inf":
            # Prometheus needs the +Inf bucket; it holds every observation.
            buckets.append(("+Inf", total if total is not None else (buckets[-1][1] if buckets else 0.0)))
        family.add_metric([str(value_of)], buckets, _num(row, "sum") or 0.0)
    return family


def _decisions(admission: Mapping[str, Any]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        _P + "admission_decisions",
        "Admission decisions at arrival by outcome and reason (in observe mode: what enforce mode would do)",
        labels=["outcome", "reason"],
    )
    for key, value in _table(admission, "decisions").items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        outcome, _, reason = str(key).partition(".")
        family.add_metric([outcome, reason], float(value))
    return family


class _SnapshotCollector:
    """A one-shot collector over one snapshot (a ``prometheus_client`` custom collector)."""

    def __init__(self, snapshot: Snapshot, tenant_labels: bool) -> None:
        self.snapshot = snapshot
        self.tenant_labels = tenant_labels

    def collect(self) -> Iterator[Metric]:
        # A family without samples (its section absent from the snapshot) is left out altogether.
        return (family for family in self._families() if family.samples)

    def _families(self) -> Iterator[Metric]:
        yield from self._admission(_table(self.snapshot, "admission"))
        yield from self._pools(_table(self.snapshot, "pools"))
        yield from self._bridge(_table(self.snapshot, "bridge"))
        conns = _table(self.snapshot, "connections")
        yield _gauge("connections_open", "Client connections open now", conns, "open")
        yield _counter(
            "evictions",
            "Connections evicted: an outbound queue past --max-outbound-bytes, or a refusal budget spent (ignored_retry_after)",
            conns,
            "evictionsTotal",
        )
        yield from self._refusals(_table(self.snapshot, "refusals"))
        yield from self._backends(_table(self.snapshot, "backends"))
        yield from self._coordinator(_table(self.snapshot, "coordinator"))

    def _backends(self, backends: Mapping[str, Any]) -> Iterable[Metric]:
        for name, key, doc in (
            ("model_requests", "modelRequestsTotal", "HTTP attempts made to each model endpoint"),
            ("model_retries", "modelRetriesTotal", "Attempts a model endpoint's failure made the backend repeat"),
            ("model_failures", "modelFailuresTotal", "Model calls that failed after their last attempt"),
            ("model_dropped_turns", "droppedTurnsTotal", "Old turns left out of requests to fit the model's window"),
        ):
            yield _labelled(CounterMetricFamily, name, doc, "backend", backends, key)
        tokens = CounterMetricFamily(
            _P + "model_tokens", "Tokens the model endpoints reported, by kind (prompt, completion)",
            labels=["backend", "kind"],
        )
        for backend, row in backends.items():
            for kind, key in (("prompt", "promptTokensTotal"), ("completion", "completionTokensTotal")):
                if (value := _num(row, key)) is not None:
                    tokens.add_metric([backend, kind], value)
        yield tokens

    def _coordinator(self, coord: Mapping[str, Any]) -> Iterable[Metric]:
        """The shared limits' coordinator (only with ``--coordinator``)."""
        if not coord:
            return
        up = GaugeMetricFamily(_P + "coordinator_up", "1 while the coordinator (Redis) answers, else 0")
        up.add_metric([], 1.0 if coord.get("up") else 0.0)
        yield up
        for name, key, doc in (
            ("coordinator_live_replicas", "liveReplicas", "Replicas renewed within one lease TTL, as last seen"),
            ("coordinator_leases", "leases", "Shared leases this replica holds"),
            ("coordinator_local_leases", "localLeases", "Leases held against the local share while Redis is away"),
            ("coordinator_releases_queued", "releasesQueued", "Releases waiting for Redis to answer"),
            ("coordinator_waiters", "waiters", "Tasks of this replica waiting for a shared limit"),
        ):
            yield _gauge(name, doc, coord, key)
        yield _gauge("coordinator_renew_seconds", "Latency of the last lease renewal", coord, "renewMsLast", 1e-3)
        yield _gauge("coordinator_renew_max_seconds", "Slowest lease renewal", coord, "renewMsMax", 1e-3)
        for name, key, doc in (
            ("coordinator_failures", "failuresTotal", "Coordinator calls that failed or got no answer in time"),
            ("coordinator_outages", "outagesTotal", "Times the coordinator went away"),
            ("coordinator_acquired", "acquiredTotal", "Shared acquisitions granted"),
            ("coordinator_refused", "refusedTotal", "Shared acquisitions refused"),
            ("coordinator_leases_lost", "lostTotal", "Leases lost (expired in an outage and not re-taken)"),
            ("coordinator_reasserted", "reassertedTotal", "Leases renewed or re-taken after an outage"),
        ):
            yield _counter(name, doc, coord, key)

    def _admission(self, adm: Mapping[str, Any]) -> Iterable[Metric]:
        info = InfoMetricFamily(
            _P + "admission", "The admission policy: mode (enforce|observe) and whether it limits"
        )
        if isinstance(mode := adm.get("mode"), str):
            info.add_metric([], {"mode": mode, "enabled": "true" if adm.get("enabled") else "false"})
        yield info
        yield _gauge(
            "admission_max_running_prompts", "Global seats (0: no global limit)", adm, "maxRunningPrompts"
        )
        yield _gauge("admission_tenants_running", "Tenants holding at least one seat", adm, "tenantsRunning")
        yield _decisions(adm)
        classes = _table(adm, "classes")
        yield _labelled(
            GaugeMetricFamily,
            "running_prompts",
            "Seats held now per priority class",
            "class",
            classes,
            "running",
        )
        yield _labelled(
            GaugeMetricFamily,
            "queue_depth",
            "Prompts waiting for a seat per priority class",
            "class",
            classes,
            "waiting",
        )
        yield _labelled(
            GaugeMetricFamily,
            "queue_oldest_wait_seconds",
            "How long the oldest waiter of each priority class has waited (0: none waits)",
            "class",
            classes,
            "oldestWaitMs",
            1e-3,
        )
        yield _labelled(
            GaugeMetricFamily,
            "class_seat_share",
            "Seats each priority class is due when all are busy",
            "class",
            classes,
            "share",
        )
        yield _histogram(
            "queue_wait_seconds",
            "Time granted waiters spent waiting for a seat",
            "class",
            _table(adm, "queueWait"),
        )
        for name, key, doc in (
            ("admission_admitted", "admittedTotal", "Prompts given a seat or a place in the waiting room"),
            ("admission_granted", "grantedTotal", "Seats handed out"),
            ("admission_released", "releasedTotal", "Seats given back"),
            ("admission_expired", "expiredTotal", "Waiters removed because their deadline ran out"),
            ("admission_cancelled", "cancelledTotal", "Waiters that left before their seat"),
            ("retry_after_served", "retryAfterServed", "Refusals sent with a retryAfterMs"),
        ):
            yield _counter(name, doc, adm, key)
        yield _counter(
            "retry_after_seconds",
            "Sum of the retryAfterMs served, in seconds",
            adm,
            "retryAfterMsTotal",
            1e-3,
        )
        if self.tenant_labels:
            tenants = _table(adm, "tenants")
            yield _labelled(
                GaugeMetricFamily, "tenant_running", "Seats held per tenant", "tenant", tenants, "running"
            )
            yield _labelled(
                GaugeMetricFamily,
                "tenant_waiting",
                "Prompts waiting per tenant",
                "tenant",
                tenants,
                "waiting",
            )

    def _pools(self, pools: Mapping[str, Any]) -> Iterable[Metric]:
        for name, key, doc, scale in (
            ("pool_active", "active", "Backend calls running now per backend", 1.0),
            ("pool_waiting", "waiting", "Admitted prompts waiting for a backend call", 1.0),
            ("pool_leased", "leased", "Leases held on each backend pool (active + waiting)", 1.0),
            ("pool_max_active", "maxActive", "Backend calls allowed at once (absent: unlimited)", 1.0),
            (
                "pool_oldest_wait_seconds",
                "oldestWaitMs",
                "How long the oldest waiter of each backend has waited",
                1e-3,
            ),
        ):
            yield _labelled(GaugeMetricFamily, name, doc, "backend", pools, key, scale)
        yield _labelled(
            CounterMetricFamily,
            "pool_admitted",
            "Prompts admitted per backend pool",
            "backend",
            pools,
            "admittedTotal",
        )
        yield _labelled(
            CounterMetricFamily,
            "pool_refused",
            "Prompts refused per backend pool",
            "backend",
            pools,
            "refusedTotal",
        )

    def _refusals(self, refusals: Mapping[str, Any]) -> Iterable[Metric]:
        by_kind = CounterMetricFamily(
            _P + "refusals",
            "Overload refusals written, by errorKind (the stats feed's refusals.byKind)",
            labels=["kind"],
        )
        for kind, value in sorted(_table(refusals, "byKind").items()):
            if not isinstance(value, bool) and isinstance(value, int | float):
                by_kind.add_metric([str(kind)], float(value))
        yield by_kind
        yield _counter(
            "refusals_timed", "Overload refusals whose server-side cost was timed", refusals, "count"
        )
        latency = GaugeMetricFamily(
            _P + "refusal_latency_seconds",
            "Server-side cost of an overload refusal (request read -> error written) by quantile (1: the maximum)",
            labels=["quantile"],
        )
        for quantile, key in (("0.5", "p50Us"), ("0.99", "p99Us"), ("1", "maxUs")):
            if (value := _num(refusals, key)) is not None:
                latency.add_metric([quantile], value * 1e-6)
        yield latency

    def _bridge(self, bridge: Mapping[str, Any]) -> Iterable[Metric]:
        for name, key, doc in (
            ("sessions", "sessions", "Live (in-memory) sessions"),
            ("pending_prompts", "pendingPrompts", "Prompts admitted and not yet answered (queued + running)"),
            ("bridge_running_prompts", "runningPrompts", "Prompts running in their session now"),
            ("bridge_queued_prompts", "queuedPrompts", "Prompts queued behind others in their session"),
            ("clients", "clients", "Known client ids"),
            ("attached_connections", "attachedConnections", "Connections attached to at least one session"),
        ):
            yield _gauge(name, doc, bridge, key)
        for name, key, doc in (
            ("prompts_admitted", "admittedTotal", "Prompts admitted by the session bridge"),
            ("prompts_refused", "refusedTotal", "Prompts refused by the session bridge"),
            ("prompts_settled", "settledTotal", "Prompts answered (completed, failed or cancelled)"),
            (
                "self_heal_resumes",
                "selfHealResumesTotal",
                "Sessions resumed by clients healing a lost connection",
            ),
        ):
            yield _counter(name, doc, bridge, key)


def render_metrics(snapshot: Snapshot, *, tenant_labels: bool = False) -> bytes:
    """The Prometheus text format of one stats snapshot.

    Args:
        snapshot: what ``Server.stats_snapshot()`` returns; missing sections and keys yield no samples.
        tenant_labels: emit ``acp_server_tenant_running{tenant}`` and ``..._waiting{tenant}``; without
            it no series carries a tenant id.

    Returns:
        The exposition text (``CONTENT_TYPE``), UTF-8.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot, tenant_labels))
    return generate_latest(registry)


def _metrics_app(snapshot: Callable[[], Snapshot], tenant_labels: bool, auth: Any = None) -> Callable[..., Any]:
    guard = None
    if auth is not None:  # tokens are on: a scrape proves one with the admin or metrics scope
        from .transports.http.auth import HttpGuard

        guard = HttpGuard(auth)

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1000, "reason": None})
            return
        refusal = guard.scrape(dict(scope)) if guard is not None else None
        if refusal is not None:
            await send({"type": "http.response.start", "status": refusal.status, "headers": refusal.headers})
            await send({"type": "http.response.body", "body": refusal.body, "more_body": False})
            return
        if scope["method"] == "GET" and scope["path"] == METRICS_PATH:
            snap = snapshot()  # in the trio thread: the bridge's state is only read there
            body = await trio.to_thread.run_sync(lambda: render_metrics(snap, tenant_labels=tenant_labels))
            status, content_type = 200, CONTENT_TYPE
        else:
            body, status, content_type = (
                b"not found: metrics are served at GET /metrics\n",
                404,
                "text/plain; charset=utf-8",
            )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
                "trailers": False,
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


async def serve_metrics(
    snapshot: Callable[[], Snapshot],
    address: ListenAddress,
    *,
    tenant_labels: bool = False,
    auth: Any = None,
    tls: ServerTls | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` over HTTP (or HTTPS) on ``address`` until cancelled; anything else is a 404.

    Once bound it prints ``acp-server: metrics on http://HOST:PORT/metrics`` (``https://`` with TLS)
    to stderr and reports ``(host, port)`` (the real port when 0 was asked). Hypercorn's own logs go
    to the ``acp_server.metrics`` logger (stderr), never to stdout, which is the ACP stream under
    ``--stdio``. Connections are served as the HTTP listener's are (each isolated; with TLS, each
    handshake bounded by ``--tls-handshake-timeout-s`` and made with the certificates in force).

    Args:
        snapshot: called in the trio thread on each scrape; the rendering runs in a worker thread.
        address: a ``tcp`` address (port 0: any free port), or ``https`` (the same with TLS).
        tenant_labels: label tenant series with tenant ids (see :func:`render_metrics`).
        auth: the server's :class:`~acp_server.auth.gate.Authenticator` (``--auth-tokens``): every
            request then shows ``Authorization: Bearer`` of a token with the ``admin`` or ``metrics``
            scope (401 with the listener's one body, 403 ``insufficient_scope``); ``None``: open.
        tls: the server's certificates (an ``https`` address needs them).

    Raises:
        ValueError: ``address`` is not a TCP address, or is ``https`` without ``tls``.
        OSError: the address cannot be bound (the message names it).
    """
    from .auth.tls import HTTP_ALPN
    from .transports.http.listener import serve_app

    if address.kind not in ("tcp", "https"):
        raise ValueError(f"--metrics-listen {address}: metrics are served over HTTP, on tcp://HOST:PORT or https://HOST:PORT")
    secure = address.kind == "https"
    if secure and tls is None:
        raise ValueError(f"--metrics-listen {address}: https:// needs --tls-cert FILE and --tls-key FILE")
    try:
        sock = await bind_tcp_socket(address.host, address.port)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on metrics {address}: {exc.strerror or exc}") from exc
    listener = trio.SocketListener(sock)
    async with listener:
        host, port = sock.getsockname()[:2]
        config = Config()
        config.accesslog = None
        config.errorlog = log
        config.graceful_timeout = 0.5
        shown = f"[{host}]" if ":" in host else host
        scheme = "https" if secure else "http"
        metrics_tls = tls.with_alpn(HTTP_ALPN) if secure and tls is not None else None
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(serve_app, tls=metrics_tls, name="metrics"),
                _metrics_app(snapshot, tenant_labels, auth),
                config,
                listener,
            )
            print(f"acp-server: metrics on {scheme}://{shown}:{port}{METRICS_PATH}", file=sys.stderr, flush=True)
            task_status.started((host, port))
