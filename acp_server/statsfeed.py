"""``_acp_server/stats/subscribe``: one stats snapshot a second to every connection that asked.

One task serves every subscriber, so a hundred open consoles cost one snapshot a second, not a
hundred. A subscriber is a bridge :class:`~acp_server.bridge.session.Peer`: its ``send`` queues the
notification and evicts a connection that cannot keep up, so a slow console never holds the feed.

With a coordinator (shared limits), each snapshot also carries ``cluster``: the replicas and every
shared limit's count as ``acp-server cluster`` reads them from Redis. That read is I/O, so a task of
its own repeats it (one at a time, only while someone is subscribed) and a snapshot carries the last
one; a read that fails keeps the last figures and says why in ``cluster.error``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

if TYPE_CHECKING:
    from .bridge import Peer

__all__ = ["SNAPSHOT_METHOD", "StatsFeed"]

#: The notification each subscriber gets once a second.
SNAPSHOT_METHOD = "_acp_server/stats/snapshot"

_encoder = msgspec.json.Encoder()


class StatsFeed:
    """The subscribers of the stats feed and the loop that feeds them.

    Args:
        snapshot: takes one stats document (``Server.stats_snapshot``).
        interval_s: seconds between snapshots.
        cluster: reads the cluster's replicas and shared limits (the coordinator's ``cluster``; ``None``:
            no coordinator, and no ``cluster`` in the snapshots).
    """

    __slots__ = ("_changed", "_reading", "cluster", "cluster_doc", "interval_s", "snapshot", "subscribers")

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
        cluster: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.cluster = cluster
        #: the connections that subscribed and have neither unsubscribed nor closed
        self.subscribers: set[Peer] = set()
        #: the last cluster read, as snapshots carry it (``None`` until one ended)
        self.cluster_doc: dict[str, Any] | None = None
        self._reading = False
        self._changed = trio.Event()

    def subscribe(self, peer: Peer) -> None:
        """Add ``peer``; it gets a first snapshot within the current tick."""
        self.subscribers.add(peer)
        self._changed.set()

    def unsubscribe(self, peer: Peer) -> bool:
        """Remove ``peer``; ``False`` if it was not subscribed."""
        if peer in self.subscribers:
            self.subscribers.discard(peer)
            return True
        return False

    def encode(self) -> bytes:
        """One snapshot notification, as the wire carries it."""
        params = self.snapshot()
        if self.cluster_doc is not None:
            params["cluster"] = self.cluster_doc
        note = {"jsonrpc": "2.0", "method": SNAPSHOT_METHOD, "params": params}
        return _encoder.encode(note) + b"\n"

    async def read_cluster(self) -> None:
        """Read the cluster once into :attr:`cluster_doc`: ``{prefix, replicas, limits, readAtMs, error}``
        (``error``: why the read failed, the figures then being the last ones read, if any)."""
        if self.cluster is None:
            return
        self._reading = True
        try:
            stats = await self.cluster()
        except Exception as exc:  # noqa: BLE001 - Redis away, slow or refusing: shown, never fatal to the feed
            doc = dict(self.cluster_doc or {"prefix": None, "replicas": [], "limits": []})
            doc["error"] = str(exc) or type(exc).__name__
        else:
            doc = msgspec.to_builtins(stats)
            doc["error"] = None
        finally:
            self._reading = False
        doc["readAtMs"] = int(time.time() * 1000)
        self.cluster_doc = doc

    def send_once(self) -> int:
        """Send one snapshot to every live subscriber (the closed ones are dropped); returns how many."""
        live = [p for p in self.subscribers if not p.closed]
        self.subscribers.intersection_update(live)
        if not live:
            return 0
        data = self.encode()
        for peer in live:
            peer.send(data)
        return len(live)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Feed the subscribers until cancelled (idle, without waking, while there are none)."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                while not self.subscribers:
                    self._changed = trio.Event()
                    await self._changed.wait()
                if self.cluster is not None and not self._reading:
                    nursery.start_soon(self.read_cluster)  # carried by the next snapshot
                self.send_once()
                await trio.sleep(self.interval_s)
