"""``_acp_server/stats/subscribe``: one snapshot now, then one a second, until unsubscribe or close;
with a coordinator, the cluster as Redis holds it."""

from __future__ import annotations

import msgspec
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.coordinator import LimitPlan
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.metrics import render_metrics
from acp_server.statsfeed import SNAPSHOT_METHOD, StatsFeed

from .helpers import connect, running_server
from .redis_server import RedisServer, redis_server  # noqa: F401


def prompt_params(session_id: str) -> dict[str, object]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": "hello"}]}


def _refusals_metric(snapshot: dict[str, object]) -> dict[str, float]:
    """``acp_server_refusals_total{kind}`` as ``/metrics`` renders ``snapshot``."""
    out = {}
    for family in text_string_to_metric_families(render_metrics(snapshot).decode()):
        for sample in family.samples:
            if sample.name == "acp_server_refusals_total":
                out[sample.labels["kind"]] = sample.value
    return out


def _snapshots(client: object) -> list[dict[str, object]]:
    return [n["params"] for n in client.notifications if n["method"] == SNAPSHOT_METHOD]  # type: ignore[attr-defined]


async def test_subscribe_feeds_snapshots_until_unsubscribe(autojump_clock: trio.testing.MockClock) -> None:
    limits = Limits(max_pending_prompts_per_session=1)
    async with running_server(limits, EchoBackend(delay_ms=60_000)) as (server, nursery):
        await nursery.start(server.stats_feed.run)
        client = await connect(server, nursery)
        other = await connect(server, nursery)  # not subscribed: gets nothing
        assert await client.call("_acp_server/stats/subscribe") == {"intervalMs": 1000}
        await trio.testing.wait_all_tasks_blocked()
        first = _snapshots(client)
        assert len(first) >= 1 and first[0]["connections"]["byTransport"] == {"stream": 2}  # type: ignore[index]

        session_id, _ = await client.new_session()
        held_id, _held = client.start_request("session/prompt")
        await client.send({"jsonrpc": "2.0", "id": held_id, "method": "session/prompt", "params": prompt_params(session_id)})
        refused = await client.call_raw("session/prompt", prompt_params(session_id))
        assert refused["error"]["data"]["errorKind"] == "prompt_queue_full"
        count = len(_snapshots(client))
        await trio.sleep(3.5)
        later = _snapshots(client)
        assert len(later) - count == 3 or len(later) - count == 4
        last = later[-1]
        assert last["refusals"]["byKind"] == {"prompt_queue_full": 1}  # type: ignore[index]
        # /metrics counts the same refusals by the same kinds
        assert _refusals_metric(server.stats_snapshot()) == {"prompt_queue_full": 1}
        again = await client.call_raw("session/prompt", prompt_params(session_id))
        assert again["error"]["data"]["errorKind"] == "prompt_queue_full"
        assert _refusals_metric(server.stats_snapshot()) == {"prompt_queue_full": 2}
        assert last["sessions"] == [  # type: ignore[comparison-overlap]
            {"sessionId": session_id, "tenant": "default", "pending": 1, "running": True, "attached": 1}
        ]
        assert _snapshots(other) == []

        assert await client.call("_acp_server/stats/unsubscribe") == {"subscribed": True}
        count = len(_snapshots(client))
        await trio.sleep(3)
        assert len(_snapshots(client)) == count
        assert await client.call("_acp_server/stats/unsubscribe") == {"subscribed": False}
        nursery.cancel_scope.cancel()


async def test_a_closed_subscriber_is_dropped(autojump_clock: trio.testing.MockClock) -> None:
    async with running_server() as (server, nursery):
        await nursery.start(server.stats_feed.run)
        client = await connect(server, nursery)
        await client.call("_acp_server/stats/subscribe")
        assert len(server.stats_feed.subscribers) == 1
        await client.stream.aclose()
        await trio.sleep(2)
        assert server.stats_feed.subscribers == set()
        nursery.cancel_scope.cancel()


async def test_with_a_coordinator_snapshots_carry_the_cluster_and_a_failed_read(redis_server: RedisServer) -> None:  # noqa: F811
    """The feed reads the cluster as ``acp-server cluster`` does (a real redis-server) and each snapshot
    carries the last read; a read that fails keeps the last figures and says why."""
    plan = LimitPlan(seats=2, shares=(0, 2, 0, 0), pools={"echo": (1, 2)})
    coord = RedisCoordinator(redis_server.url, prefix="feed", replica_id="web-1", timeout_ms=200)
    feed = StatsFeed(lambda: {"bridge": {}}, cluster=coord.cluster)
    async with coord.running():
        assert b'"cluster"' not in feed.encode()  # nothing read yet
        await coord.acquire(coord.new_lease(), *plan.arrival("acme", 1, "echo"))
        await feed.read_cluster()
        doc = msgspec.json.decode(feed.encode())["params"]["cluster"]
        assert doc["error"] is None and doc["prefix"] == "feed"
        assert [(r["replicaId"], r["live"]) for r in doc["replicas"]] == [("web-1", True)]
        counts = {x["name"]: (x["count"], x["cap"]) for x in doc["limits"]}
        assert counts["seats"] == (1, 2) and counts["pool:echo"] == (1, 3)
        redis_server.pause()
        try:
            await feed.read_cluster()
        finally:
            redis_server.resume()
        failed = msgspec.json.decode(feed.encode())["params"]["cluster"]
        assert failed["error"] and failed["limits"] == doc["limits"] and failed["readAtMs"] >= doc["readAtMs"]
