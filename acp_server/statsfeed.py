"""``_acp_server/stats/subscribe``: one stats snapshot a second to every connection that asked.

One task serves every subscriber, so a hundred open consoles cost one snapshot a second, not a
hundred. A subscriber is a bridge :class:`~acp_server.bridge.session.Peer`: its ``send`` queues the
notification and evicts a connection that cannot keep up, so a slow console never holds the feed.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """

    __slots__ = ("_changed", "interval_s", "snapshot", "subscribers")

    def __init__(self, snapshot: Callable[[], dict[str, Any]], interval_s: float = 1.0) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        #: the connections that subscribed and have neither unsubscribed nor closed
        self.subscribers: set[Peer] = set()
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
        note = {"jsonrpc": "2.0", "method": SNAPSHOT_METHOD, "params": self.snapshot()}
        return _encoder.encode(note) + b"\n"

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
        while True:
            while not self.subscribers:
                self._changed = trio.Event()
                await self._changed.wait()
            self.send_once()
            await trio.sleep(self.interval_s)
