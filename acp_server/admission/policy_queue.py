"""The waiting room of the admission policy: one queue per priority class, fair across tenants, with aging.

Pure bookkeeping, no trio: :class:`~acp_server.admission.policy.PolicyEngine` decides *when* a seat is
free and *which class* gets it; this module answers *which waiter* of that class is next.

- **Classes.** :data:`PRIORITIES` lists the four classes in rank order, highest first; a waiter sits in
  exactly one class queue at a time (its *rank*, an index into :data:`PRIORITIES`).
- **Fair queuing** (``discipline="fair"``, the default). Within a class, waiters are kept per tenant,
  FIFO, and tenants take turns: the tenant granted last goes to the back of the rotation, and a tenant
  joining the rotation goes just ahead of it, so no tenant is granted twice in a row while another
  eligible tenant of that class waits. A tenant the engine reports
  ineligible (at its own seat cap) is skipped and keeps its place.
- **Plain FIFO** (``discipline="fifo"``): the oldest eligible waiter of the class, whatever its tenant.
  It exists to show, in the tests, what fair queuing buys.
- **Aging.** A ``background`` or ``bulk`` waiter moves up one rank every ``aging_s`` seconds it waits
  (bulk -> background -> interactive; never to critical), so a low class cannot starve under a
  saturating higher one. Aging is applied lazily by :meth:`WaitingRoom.age`, which the engine calls just
  before it picks a waiter, from a per-class heap of due times.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable
from typing import Final, Literal

__all__ = ["INTERACTIVE", "PRIORITIES", "Discipline", "Priority", "QueueEntry", "WaitingRoom", "rank_of"]

Priority = Literal["critical", "interactive", "background", "bulk"]
Discipline = Literal["fair", "fifo"]

#: The priority classes in rank order, highest first; a rank is an index into this tuple.
PRIORITIES: Final[tuple[Priority, ...]] = ("critical", "interactive", "background", "bulk")
#: The rank aging stops at: nothing ages into ``critical``.
INTERACTIVE: Final = 1
_RANKS: Final[dict[str, int]] = {name: rank for rank, name in enumerate(PRIORITIES)}


def rank_of(priority: str) -> int:
    """The rank of a priority class name.

    Raises:
        ValueError: ``priority`` is not one of :data:`PRIORITIES`.
    """
    try:
        return _RANKS[priority]
    except KeyError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; got {priority!r}") from None


class QueueEntry:
    """One waiter as the waiting room sees it; the engine's ``Queued`` ticket extends it.

    Attributes:
        tenant: whose prompt this is (fair queuing rotates over tenants).
        base_rank: the rank the prompt asked for.
        rank: the rank it waits in now (``base_rank`` raised by aging).
        enqueued_at: when it entered the room.
        due: when aging moves it up next (``inf``: never).
        queued: True while it sits in the room.
    """

    __slots__ = ("base_rank", "due", "enqueued_at", "queued", "rank", "tenant")

    def __init__(self, tenant: str, rank: int) -> None:
        self.tenant = tenant
        self.base_rank = rank
        self.rank = rank
        self.enqueued_at = 0.0
        self.due = math.inf
        self.queued = False


class _ClassQueue:
    """The waiters of one class: arrival order, and per-tenant FIFOs in rotation order."""

    __slots__ = ("aging", "last", "order", "tenants")

    def __init__(self) -> None:
        self.order: dict[QueueEntry, None] = {}  # insertion order: arrival (aged entries at the end)
        self.tenants: collections.OrderedDict[str, collections.deque[QueueEntry]] = collections.OrderedDict()
        self.aging: list[tuple[float, int, QueueEntry]] = []  # (due, seq, entry); stale items drop lazily
        self.last: str | None = None  # the tenant granted last; when it still waits, it is last in turn

    def add(self, entry: QueueEntry) -> None:
        self.order[entry] = None
        fifo = self.tenants.get(entry.tenant)
        if fifo is None:
            # A tenant that had nothing waiting joins the rotation at the back, but ahead of the tenant
            # granted last: otherwise that tenant would be granted twice in a row.
            self.tenants[entry.tenant] = fifo = collections.deque()
            if self.last is not None and self.last in self.tenants:
                self.tenants.move_to_end(self.last)
        fifo.append(entry)

    def discard(self, entry: QueueEntry, *, rotate: bool) -> None:
        del self.order[entry]
        fifo = self.tenants[entry.tenant]
        if fifo[0] is entry:
            fifo.popleft()
        else:
            fifo.remove(entry)
        if rotate:
            self.last = entry.tenant
        if not fifo:
            del self.tenants[entry.tenant]
        elif rotate:
            self.tenants.move_to_end(entry.tenant)
        if not self.order:
            self.aging.clear()  # every heap item is stale now


class WaitingRoom:
    """The waiters of every class, with the queue discipline and aging of one engine.

    Args:
        discipline: ``"fair"`` (rotate over tenants within a class) or ``"fifo"`` (oldest first).
        aging_s: seconds of waiting per one-rank promotion of background and bulk waiters (0: no aging).
    """

    def __init__(self, discipline: Discipline = "fair", aging_s: float = 0.0) -> None:
        if discipline not in ("fair", "fifo"):
            raise ValueError(f'discipline must be "fair" or "fifo"; got {discipline!r}')
        self._fair = discipline == "fair"
        self._aging_s = aging_s
        self._classes = tuple(_ClassQueue() for _ in PRIORITIES)
        self._size = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._size

    def count(self, rank: int) -> int:
        """Waiters in the class of ``rank`` now."""
        return len(self._classes[rank].order)

    def push(self, entry: QueueEntry, now: float) -> None:
        """Add ``entry`` at the back of its tenant's FIFO in the class of ``entry.rank``."""
        entry.enqueued_at = now
        entry.queued = True
        entry.due = math.inf
        self._add(entry, now + self._aging_s)
        self._size += 1

    def _add(self, entry: QueueEntry, due: float) -> None:
        queue = self._classes[entry.rank]
        queue.add(entry)
        if self._aging_s and entry.rank > INTERACTIVE:
            entry.due = due
            self._seq += 1
            heapq.heappush(queue.aging, (due, self._seq, entry))
        else:
            entry.due = math.inf

    def remove(self, entry: QueueEntry) -> None:
        """Take ``entry`` out without a grant (cancelled or expired): the rotation does not move."""
        self._classes[entry.rank].discard(entry, rotate=False)
        entry.queued = False
        self._size -= 1

    def take(self, entry: QueueEntry) -> None:
        """Take ``entry`` out for a grant: under fair queuing its tenant goes to the back of the rotation."""
        self._classes[entry.rank].discard(entry, rotate=self._fair)
        entry.queued = False
        self._size -= 1

    def tenant_counts(self) -> dict[str, int]:
        """Waiters per tenant now, over every class."""
        counts: dict[str, int] = {}
        for queue in self._classes:
            for tenant, fifo in queue.tenants.items():
                counts[tenant] = counts.get(tenant, 0) + len(fifo)
        return counts

    def peek(self, rank: int, eligible: Callable[[str], bool] | None = None) -> QueueEntry | None:
        """The waiter of class ``rank`` served next, skipping tenants ``eligible`` refuses (``None``: all)."""
        queue = self._classes[rank]
        if self._fair:
            for tenant, fifo in queue.tenants.items():
                if eligible is None or eligible(tenant):
                    return fifo[0]
            return None
        for entry in queue.order:
            if eligible is None or eligible(entry.tenant):
                return entry
        return None

    def age(self, now: float) -> int:
        """Move every waiter due by ``now`` up one rank (repeatedly when due again). Returns how many moves."""
        if not self._aging_s or not self._size:
            return 0
        moves = 0
        # Lowest class first, so a bulk waiter that is due twice climbs both steps in one call.
        for rank in range(len(PRIORITIES) - 1, INTERACTIVE, -1):
            queue = self._classes[rank]
            heap = queue.aging
            while heap and heap[0][0] <= now:
                due, _, entry = heapq.heappop(heap)
                if not entry.queued or entry.rank != rank or entry.due != due:
                    continue  # left the room, or already moved
                queue.discard(entry, rotate=False)
                entry.rank = rank - 1
                self._add(entry, due + self._aging_s)
                moves += 1
        return moves

    def oldest(self, rank: int) -> float | None:
        """When the longest-waiting waiter of class ``rank`` entered the room (``None``: nobody waits)."""
        order = self._classes[rank].order
        return min((entry.enqueued_at for entry in order), default=None)

    def tenants_waiting(self, rank: int) -> int:
        """Distinct tenants with a waiter in class ``rank``."""
        return len(self._classes[rank].tenants)
