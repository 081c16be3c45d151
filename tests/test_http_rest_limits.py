"""The REST API's limits, live: a prompt refused by each admission layer (the status, ``Retry-After``
and body of ``capacity_exceeded``, ``capacity_unavailable``, ``admission_deferred`` and
``session_limit_exceeded``; ``prompt_queue_full`` and the request checks are in ``test_http_rest.py``),
the status table and ``Retry-After`` rounding of every refusal kind it sends, the cursor paging of
``GET /workspace/:cwd/sessions`` and the byte bound of an event subscriber's queue."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import trio

from acp_server.admission import Limits
from acp_server.admission.policy_limits import PolicyLimits
from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.backends import EchoBackend
from acp_server.transports.http.rest_events import SseSubscriber
from acp_server.transports.http.rest_request import refusal

from .http_helpers import TIMEOUT_S, assert_http_error_valid, check_error_body, http_server
from .test_schemas import sample_error

OK = [{"type": "text", "text": "x"}]
SLOW_MS = 5000  # the first prompt holds its seat for the whole test


def _retry_after(body: dict[str, Any]) -> str:
    """The ``Retry-After`` a refusal carrying ``retryAfterMs`` must have: whole seconds, at least 1."""
    return str(max(1, math.ceil(body["retryAfterMs"] / 1000)))


async def _two_prompts(url: str, c: httpx.AsyncClient) -> tuple[str, httpx.Response]:
    """Two new sessions (``thread`` scope); the first's prompt is accepted, the second's answer is
    returned with that second session's id."""
    first = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
    second = (await c.post(url + "/session", json={"sessionScope": "thread"})).json()["sessionId"]
    accepted = await c.post(f"{url}/session/{first}/prompt", json={"prompt": OK})
    assert accepted.status_code == 202, accepted.text
    return second, await c.post(f"{url}/session/{second}/prompt", json={"prompt": OK})


def _refused(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = check_error_body(r)  # validates against schemas/http/ and as the JSON-RPC error's data
    assert body["code"] == code, body
    assert "promptId" not in body  # refused before any acceptance
    assert r.headers["retry-after"] == _retry_after(body)
    return body


async def test_a_full_backend_pool_is_503_capacity_exceeded() -> None:
    options = {"capacity": CapacityManager({"echo": PoolLimits(max_active=1, max_waiting=0)})}
    with trio.fail_after(TIMEOUT_S):
        async with http_server(None, EchoBackend(delay_ms=SLOW_MS), server_options=options) as (_s, _n, url):
            async with httpx.AsyncClient(timeout=10) as c:
                sid, r = await _two_prompts(url, c)
                body = _refused(r, 503, "capacity_exceeded")
                assert (body["backendId"], body["sessionId"], body["limit"], body["activeCount"]) == ("echo", sid, 1, 1)


async def test_no_free_seat_and_no_waiting_room_is_503_capacity_unavailable() -> None:
    options = {"policy": PolicyLimits(max_running_prompts=1, max_queued_prompts=0)}
    with trio.fail_after(TIMEOUT_S):
        async with http_server(None, EchoBackend(delay_ms=SLOW_MS), server_options=options) as (_s, _n, url):
            async with httpx.AsyncClient(timeout=10) as c:
                _sid, r = await _two_prompts(url, c)
                body = _refused(r, 503, "capacity_unavailable")
                assert body["retryAfterMs"] >= 1


async def test_a_tenant_at_its_seat_cap_is_429_admission_deferred() -> None:
    options = {"policy": PolicyLimits(tenant_max_running=1)}
    with trio.fail_after(TIMEOUT_S):
        async with http_server(None, EchoBackend(delay_ms=SLOW_MS), server_options=options) as (_s, _n, url):
            async with httpx.AsyncClient(timeout=10) as c:
                _sid, r = await _two_prompts(url, c)
                body = _refused(r, 429, "admission_deferred")
                assert body["tenantId"] == "default"  # REST callers are tenant default (no token binds one)


async def test_a_session_over_max_sessions_is_503_session_limit_exceeded() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_sessions=1)) as (_s, _n, url):
            async with httpx.AsyncClient(timeout=10) as c:
                assert (await c.post(url + "/session", json={"sessionScope": "thread"})).status_code == 200
                r = await c.post(url + "/session", json={"sessionScope": "thread"})
                assert r.status_code == 503, r.text
                body = check_error_body(r)
                assert (body["code"], body["limit"]) == ("session_limit_exceeded", 1)


# the statuses the issue fixes for qwen's API (S and later issues added rate_limited and the 409s)
STATUSES = {
    "prompt_queue_full": 503, "capacity_exceeded": 503, "capacity_unavailable": 503,
    "session_limit_exceeded": 503, "admission_deferred": 429, "rate_limited": 429,
    "subscriber_limit_exceeded": 429, "idempotency_key_conflict": 409, "session_not_found": 404,
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(STATUSES))
def test_each_refusal_kind_has_its_status_and_a_valid_body(kind: str) -> None:
    status, headers, raw = refusal(sample_error(kind), [])
    body = json.loads(raw)
    assert status == STATUSES[kind]
    assert body["code"] == kind
    assert_http_error_valid(body)
    retry = [v.decode() for k, v in headers if k == b"retry-after"]
    assert retry == ([_retry_after(body)] if "retryAfterMs" in body else [])


@pytest.mark.parametrize(("ms", "header"), [(0, "1"), (1, "1"), (999, "1"), (1000, "1"), (1001, "2"), (4500, "5")])
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(ms: int, header: str) -> None:
    exc = sample_error("prompt_queue_full")
    exc.payload = exc.data = type(exc.payload)(**{**{f: getattr(exc.payload, f) for f in exc.payload.__struct_fields__},
                                                  "retry_after_ms": ms})
    _status, headers, _raw = refusal(exc, [])
    assert dict(headers)[b"retry-after"] == header.encode()


async def test_workspace_sessions_page_with_the_cursor_and_only_that_cwd() -> None:
    """``GET /workspace/:cwd/sessions`` returns pages of 100 with ``nextCursor`` until the last; other
    cwds' sessions are not listed; a cursor that is not one of ours is a 400 with a valid body."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_sessions=0)) as (_s, _n, url), httpx.AsyncClient(timeout=10) as c:
            made = {(await c.post(url + "/session", json={"cwd": "/srv/p", "sessionScope": "thread"})).json()["sessionId"]
                    for _ in range(230)}
            await c.post(url + "/session", json={"cwd": "/srv/other", "sessionScope": "thread"})
            listed: list[str] = []
            pages = 0
            cursor: str | None = None
            while True:
                r = await c.get(url + "/workspace/%2Fsrv%2Fp/sessions", params={"cursor": cursor} if cursor else None)
                assert r.status_code == 200, r.text
                page = r.json()
                pages += 1
                listed += [s["sessionId"] for s in page["sessions"]]
                assert all(s["cwd"] == "/srv/p" for s in page["sessions"])
                cursor = page.get("nextCursor")
                if cursor is None:
                    break
            assert (pages, len(listed), set(listed)) == (3, 230, made)
            bad = await c.get(url + "/workspace/%2Fsrv%2Fp/sessions", params={"cursor": "not-a-cursor"})
            assert bad.status_code == 400, bad.text
            assert check_error_body(bad)["code"] == "invalid_params"


def test_a_subscriber_queue_is_bounded_by_frames_and_by_bytes() -> None:
    """The defaults are 256 frames and 2 MiB; the byte bound warns at 75 % and evicts past it, as the
    frame bound does (``test_http_rest.py``)."""
    default = SseSubscriber("s")
    assert (default.max_frames, default.max_bytes) == (256, 2 * 1024 * 1024)
    sub = SseSubscriber("s", max_frames=1000, max_bytes=1000)
    frame = b"data: " + b"x" * 94 + b"\n\n"  # 102 bytes
    for _ in range(7):
        sub.push(frame)
    assert not sub.warned and not sub.closed  # 714 bytes: under 75 %
    sub.push(frame)
    assert sub.warned and not sub.closed  # 816 bytes
    for _ in range(3):
        sub.push(frame)
    assert sub.closed and sub.evicted
    assert b"client_evicted" in sub.frames[-1]
