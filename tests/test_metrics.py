"""The Prometheus endpoint: what one stats snapshot renders to (names, labels, values, no tenant ids
unless asked), and ``serve_metrics`` over real HTTP: a scrape, a 404, the stderr line, rendering off
the event loop."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from acp_server import metrics
from acp_server.metrics import CONTENT_TYPE, render_metrics, serve_metrics
from acp_server.server import ListenAddress

TIMEOUT_S = 10
ANY_PORT = ListenAddress("tcp", host="127.0.0.1", port=0)
#: Tenant ids that must never reach the text unless tenant labels are asked for.
TENANTS = ("tenant-alpha", "tenant-beta")


def snapshot() -> dict[str, Any]:
    """A realistic ``Server.stats_snapshot()``: policy on, two pools, two tenants, some history."""
    return {
        "bridge": {
            "sessions": 7,
            "pendingPrompts": 9,
            "runningPrompts": 4,
            "queuedPrompts": 5,
            "clients": 3,
            "attachedConnections": 2,
            "admittedTotal": 120,
            "refusedTotal": 11,
            "settledTotal": 111,
            "selfHealResumesTotal": 2,
        },
        "pools": {
            "claude": {
                "active": 4,
                "waiting": 2,
                "leased": 6,
                "admittedTotal": 100,
                "refusedTotal": 3,
                "maxActive": 4,
                "maxWaiting": 8,
                "oldestWaitMs": 1500,
            },
            "echo": {
                "active": 0,
                "waiting": 0,
                "leased": 0,
                "admittedTotal": 20,
                "refusedTotal": 0,
                "maxActive": None,  # unlimited: no max series for it
                "maxWaiting": None,
                "oldestWaitMs": 0,
            },
        },
        "admission": {
            "enabled": True,
            "mode": "observe",
            "maxRunningPrompts": 4,
            "running": 4,
            "waiting": 3,
            "tenantsRunning": 2,
            "classes": {
                "critical": {"share": 1, "running": 0, "waiting": 0, "oldestWaitMs": 0},
                "interactive": {"share": 2, "running": 3, "waiting": 2, "oldestWaitMs": 250},
                "background": {"share": 1, "running": 1, "waiting": 1, "oldestWaitMs": 4000},
                "bulk": {"share": 0, "running": 0, "waiting": 0, "oldestWaitMs": 0},
            },
            "decisions": {
                "run": 90,
                "queued": 20,
                "deferred.tenant_limit": 4,
                "rejected.queue_full": 3,
                "rejected.deadline_unreachable": 2,
                "rejected.wait_too_long": 1,
            },
            "admittedTotal": 110,
            "grantedTotal": 105,
            "releasedTotal": 101,
            "expiredTotal": 1,
            "cancelledTotal": 2,
            "retryAfterServed": 10,
            "retryAfterMsTotal": 12500,
            "queueWait": {
                "interactive": {"buckets": [[0.1, 5], [1.0, 15], [math.inf, 18]], "sum": 9.5, "count": 18},
                "background": {"buckets": [[0.1, 0], [1.0, 1], [math.inf, 2]], "sum": 3.25, "count": 2},
            },
            "tenants": {
                "tenant-alpha": {"running": 3, "waiting": 2},
                "tenant-beta": {"running": 1, "waiting": 1},
            },
        },
        "connections": {"open": 5, "evictionsTotal": 1},
        "refusals": {
            "count": 14, "p50Us": 85.5, "p99Us": 410.0, "maxUs": 1250.0,
            "byKind": {"prompt_queue_full": 9, "capacity_exceeded": 5},
        },
    }


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: bytes) -> tuple[dict[str, str], Samples]:
    """The text format parsed back: family name -> type, and (sample name, sorted labels) -> value."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


# --- rendering ---------------------------------------------------------------------------------------


def test_metrics_render_admission_series() -> None:
    """Decisions by outcome and reason (empty for run/queued), per-class depth, oldest wait, seats, mode."""
    types, samples = parse(render_metrics(snapshot()))
    assert types["acp_server_admission_decisions"] == "counter"
    decisions = {
        (dict(lb)["outcome"], dict(lb)["reason"]): v
        for (n, lb), v in samples.items()
        if n == "acp_server_admission_decisions_total"
    }
    assert decisions == {
        ("run", ""): 90,
        ("queued", ""): 20,
        ("deferred", "tenant_limit"): 4,
        ("rejected", "queue_full"): 3,
        ("rejected", "deadline_unreachable"): 2,
        ("rejected", "wait_too_long"): 1,
    }
    assert by_label(samples, "acp_server_queue_depth", "class") == {
        "critical": 0,
        "interactive": 2,
        "background": 1,
        "bulk": 0,
    }
    assert by_label(samples, "acp_server_queue_oldest_wait_seconds", "class")["background"] == 4.0
    assert by_label(samples, "acp_server_queue_oldest_wait_seconds", "class")["interactive"] == 0.25
    assert by_label(samples, "acp_server_running_prompts", "class") == {
        "critical": 0,
        "interactive": 3,
        "background": 1,
        "bulk": 0,
    }
    assert by_label(samples, "acp_server_class_seat_share", "class")["interactive"] == 2
    assert samples[("acp_server_admission_info", (("enabled", "true"), ("mode", "observe")))] == 1
    assert samples[("acp_server_admission_max_running_prompts", ())] == 4
    assert samples[("acp_server_admission_tenants_running", ())] == 2
    assert samples[("acp_server_retry_after_served_total", ())] == 10
    assert samples[("acp_server_retry_after_seconds_total", ())] == 12.5
    assert samples[("acp_server_admission_granted_total", ())] == 105
    assert samples[("acp_server_admission_expired_total", ())] == 1


def test_metrics_render_queue_wait_histogram() -> None:
    """The snapshot's cumulative buckets become ``le`` buckets, with ``_sum`` and ``_count``."""
    types, samples = parse(render_metrics(snapshot()))
    assert types["acp_server_queue_wait_seconds"] == "histogram"
    buckets = {
        dict(lb)["le"]: v
        for (n, lb), v in samples.items()
        if n == "acp_server_queue_wait_seconds_bucket" and dict(lb)["class"] == "interactive"
    }
    assert buckets == {"0.1": 5, "1.0": 15, "+Inf": 18}
    assert samples[("acp_server_queue_wait_seconds_sum", (("class", "interactive"),))] == 9.5
    assert samples[("acp_server_queue_wait_seconds_count", (("class", "interactive"),))] == 18
    assert samples[("acp_server_queue_wait_seconds_count", (("class", "background"),))] == 2


def test_metrics_render_pools_bridge_connections_refusals() -> None:
    """Per-backend pool gauges and counters, bridge gauges and counters, connections, evictions, refusal cost."""
    _, samples = parse(render_metrics(snapshot()))
    assert by_label(samples, "acp_server_pool_active", "backend") == {"claude": 4, "echo": 0}
    assert by_label(samples, "acp_server_pool_waiting", "backend") == {"claude": 2, "echo": 0}
    assert by_label(samples, "acp_server_pool_oldest_wait_seconds", "backend") == {"claude": 1.5, "echo": 0}
    assert by_label(samples, "acp_server_pool_max_active", "backend") == {"claude": 4}  # echo: unlimited
    assert by_label(samples, "acp_server_pool_refused_total", "backend") == {"claude": 3, "echo": 0}
    expected = {
        "acp_server_sessions": 7,
        "acp_server_pending_prompts": 9,
        "acp_server_bridge_running_prompts": 4,
        "acp_server_bridge_queued_prompts": 5,
        "acp_server_clients": 3,
        "acp_server_attached_connections": 2,
        "acp_server_prompts_admitted_total": 120,
        "acp_server_prompts_refused_total": 11,
        "acp_server_prompts_settled_total": 111,
        "acp_server_self_heal_resumes_total": 2,
        "acp_server_connections_open": 5,
        "acp_server_evictions_total": 1,
        "acp_server_refusals_timed_total": 14,
    }
    assert {name: samples[(name, ())] for name in expected} == expected
    latency = by_label(samples, "acp_server_refusal_latency_seconds", "quantile")
    assert latency == pytest.approx({"0.5": 85.5e-6, "0.99": 410e-6, "1": 1250e-6})
    kinds = by_label(samples, "acp_server_refusals_total", "kind")
    assert kinds == {"prompt_queue_full": 9, "capacity_exceeded": 5}


def test_metrics_no_tenant_ids_without_tenant_labels() -> None:
    """By default no series carries a tenant id; with ``tenant_labels`` the per-tenant series appear."""
    text = render_metrics(snapshot())
    assert not any(t.encode() in text for t in TENANTS)
    assert b"acp_server_tenant_" not in text
    assert all(k != "tenant" for (_, labels) in parse(text)[1] for k, _ in labels)

    _, samples = parse(render_metrics(snapshot(), tenant_labels=True))
    assert by_label(samples, "acp_server_tenant_running", "tenant") == {"tenant-alpha": 3, "tenant-beta": 1}
    assert by_label(samples, "acp_server_tenant_waiting", "tenant") == {"tenant-alpha": 2, "tenant-beta": 1}


def test_metrics_tolerate_missing_and_malformed_keys() -> None:
    """Absent sections render nothing (no empty families); a malformed value is skipped, not fatal."""
    assert render_metrics({}) == b""
    snap = snapshot()
    del snap["pools"], snap["admission"]["retryAfterMsTotal"]
    snap["bridge"]["sessions"] = "many"
    snap["admission"]["queueWait"] = {"bulk": {"buckets": [[0.1], "x"], "sum": 1.0, "count": 1}}
    snap["refusals"] = {"whatever": {"shape": [1, 2]}, "byKind": {"rate_limited": "many", "prompt_queue_full": 2}}
    types, samples = parse(render_metrics(snap))
    assert not any(name.startswith("acp_server_pool_") for name in types)
    assert "acp_server_queue_wait_seconds" not in types
    assert "acp_server_retry_after_seconds" not in types and "acp_server_sessions" not in types
    assert "acp_server_refusal_latency_seconds" not in types
    assert by_label(samples, "acp_server_refusals_total", "kind") == {"prompt_queue_full": 2}
    assert samples[("acp_server_pending_prompts", ())] == 9


def test_metrics_histogram_without_inf_bucket_gets_one() -> None:
    """A bucket list that stops short of +Inf is completed with the total count (Prometheus needs it)."""
    snap = {"admission": {"queueWait": {"bulk": {"buckets": [[0.5, 1], [2.0, 3]], "sum": 4.0, "count": 4}}}}
    _, samples = parse(render_metrics(snap))
    assert samples[("acp_server_queue_wait_seconds_bucket", (("class", "bulk"), ("le", "+Inf")))] == 4


# --- serving -----------------------------------------------------------------------------------------


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh connection; status, headers (lower-case names), body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, body


async def start(nursery: trio.Nursery, snap: Callable[[], dict[str, Any]], **kwargs: Any) -> tuple[str, int]:
    result: tuple[str, int] = await nursery.start(
        lambda task_status: serve_metrics(snap, ANY_PORT, task_status=task_status, **kwargs)
    )
    return result


async def test_metrics_scrape_over_http(capsys: pytest.CaptureFixture[str]) -> None:
    """Port 0 binds a real port, announced on stderr; each scrape renders a fresh snapshot; stdout stays clean."""
    calls = 0

    def snap() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        s = snapshot()
        s["connections"]["open"] = calls
        return s

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            host, port = await start(nursery, snap)
            assert host == "127.0.0.1" and port > 0
            status, headers, body = await http_get(port, "/metrics")
            assert status == 200
            assert headers["content-type"] == CONTENT_TYPE
            assert int(headers["content-length"]) == len(body)
            _, samples = parse(body)
            assert (
                samples[("acp_server_admission_decisions_total", (("outcome", "run"), ("reason", "")))] == 90
            )
            assert samples[("acp_server_connections_open", ())] == 1
            _, _, body = await http_get(port, "/metrics")
            assert parse(body)[1][("acp_server_connections_open", ())] == 2
            nursery.cancel_scope.cancel()
    out, err = capsys.readouterr()
    assert out == ""  # stdout is the ACP stream under --stdio: hypercorn writes nothing there
    assert err.splitlines() == [f"acp-server: metrics on http://127.0.0.1:{port}/metrics"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/"), ("GET", "/metrics/x"), ("POST", "/metrics")])
async def test_metrics_other_requests_get_404(method: str, path: str) -> None:
    """Only ``GET /metrics`` is served; nothing else takes a snapshot."""
    taken: list[int] = []
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            _, port = await start(nursery, lambda: taken.append(1) or snapshot())
            status, _, body = await http_get(port, path, method)
            assert status == 404 and b"GET /metrics" in body
            nursery.cancel_scope.cancel()
    assert taken == []


async def test_metrics_render_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot is taken in the trio thread, the rendering in a worker thread."""
    loop_thread = threading.get_ident()
    threads: dict[str, int] = {}
    real_render = metrics.render_metrics

    def snap() -> dict[str, Any]:
        threads["snapshot"] = threading.get_ident()
        return snapshot()

    def render(s: dict[str, Any], *, tenant_labels: bool = False) -> bytes:
        threads["render"] = threading.get_ident()
        return real_render(s, tenant_labels=tenant_labels)

    monkeypatch.setattr(metrics, "render_metrics", render)
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            _, port = await start(nursery, snap, tenant_labels=True)
            status, _, body = await http_get(port, "/metrics")
            nursery.cancel_scope.cancel()
    assert status == 200 and b'acp_server_tenant_running{tenant="tenant-alpha"} 3.0' in body
    assert threads["snapshot"] == loop_thread
    assert threads["render"] != loop_thread


async def test_metrics_refuse_unix_and_name_a_taken_port() -> None:
    """Metrics are HTTP over TCP only; a port someone holds is an OSError naming the address."""
    with pytest.raises(ValueError, match=r"on tcp://HOST:PORT or https://HOST:PORT"):
        await serve_metrics(snapshot, ListenAddress("unix", path="/tmp/x.sock"))
    with trio.fail_after(TIMEOUT_S):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        try:
            taken = ListenAddress("tcp", host="127.0.0.1", port=port)
            with pytest.raises(OSError, match=rf"cannot listen on metrics tcp://127\.0\.0\.1:{port}: "):
                await serve_metrics(snapshot, taken)
        finally:
            for listener in listeners:
                await listener.aclose()
