"""Which limits an admission takes: the admission bounds spelled as coordinator options.

Pure: :class:`LimitPlan` turns the global seats (with their class shares), the tenant caps, the
waiting room and the backend pools into :class:`~acp_server.coordinator.base.Option` values with
stable limit names, so every replica with the same configuration names the same limits:

| limit | cap | held by |
|---|---|---|
| ``seats`` / ``seats:c<rank>`` | ``max_running_prompts`` / counted | a running prompt |
| ``tenant:<id>`` | the tenant's cap | a running prompt of that tenant |
| ``room`` / ``room:c<rank>`` | ``max_queued_prompts`` / counted | a prompt waiting for a seat |
| ``pool:<backend>`` | ``max_active + max_waiting`` | an admitted prompt of that backend |
| ``pool:<backend>:active`` | ``max_active`` | a backend call running |

An arrival is one call with two options: a seat now (the seat count soft, so a full one falls through)
or a place in the waiting room; both hold the pool's admission slot. A waiter's seat leaves the room in
the same call.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import ClassRule, Need, Option

__all__ = ["LimitPlan"]

_CLASSES = 4


class LimitPlan:
    """The limits of one configuration.

    Args:
        seats: global seats (0: none).
        shares: seats per class, in rank order (summing to ``seats``); empty without seats.
        room: waiting-room places (0: no waiting room).
        tenant_max_running: the default tenant cap (0: none).
        tenant_overrides: tenant -> its own cap.
        pools: backend -> ``(max_active, max_waiting)`` (``max_waiting`` ``None``: unbounded).
    """

    def __init__(
        self,
        *,
        seats: int = 0,
        shares: tuple[int, ...] = (),
        room: int = 0,
        tenant_max_running: int = 0,
        tenant_overrides: Mapping[str, int] | None = None,
        pools: Mapping[str, tuple[int, int | None]] | None = None,
    ) -> None:
        if seats and len(shares) != _CLASSES:
            raise ValueError(f"shares must give the seats of each of the {_CLASSES} classes; got {shares!r}")
        self.seats = seats
        self.shares = shares
        self.room = room
        self.tenant_max_running = tenant_max_running
        self.tenant_overrides = dict(tenant_overrides or {})
        self.pools = dict(pools or {})
        self._seat_names = tuple(f"seats:c{r}" for r in range(_CLASSES))
        self._room_names = tuple(f"room:c{r}" for r in range(_CLASSES))

    def tenant_cap(self, tenant: str) -> int:
        return self.tenant_overrides.get(tenant, self.tenant_max_running)

    def _rule(self, rank: int) -> ClassRule:
        return ClassRule(rank, self.shares, self._seat_names, self._room_names)

    def _pool_need(self, backend: str) -> tuple[Need, ...]:
        pool = self.pools.get(backend)
        if pool is None:
            return ()
        active, waiting = pool
        return (Need(f"pool:{backend}", 0 if waiting is None else active + waiting),)

    def _seat_needs(self, tenant: str, rank: int, *, soft: bool) -> tuple[Need, ...]:
        needs: list[Need] = []
        cap = self.tenant_cap(tenant)
        if cap:
            needs.append(Need(f"tenant:{tenant}", cap))
        if self.seats:
            needs.append(Need("seats", self.seats, soft))
            needs.append(Need(self._seat_names[rank]))
        return tuple(needs)

    def arrival(self, tenant: str, rank: int, backend: str) -> tuple[Option, ...]:
        """The options of a prompt arriving at an idle session: a seat now, else a waiting-room place."""
        pool = self._pool_need(backend)
        seat = Option(
            self._seat_needs(tenant, rank, soft=bool(self.room)) + pool,
            self._rule(rank) if self.seats else None,
        )
        if not (self.seats and self.room):
            return (seat,)
        room = Option((Need("room", self.room), Need(self._room_names[rank])) + pool)
        return (seat, room)

    def admission(self, backend: str) -> Option | None:
        """The option of a prompt admitted behind others in its session: the pool's slot only."""
        pool = self._pool_need(backend)
        return Option(pool) if pool else None

    def seat(self, tenant: str, rank: int) -> Option:
        """A seat for a prompt at the head of its session (a waiter, or one admitted behind others)."""
        return Option(self._seat_needs(tenant, rank, soft=False), self._rule(rank) if self.seats else None)

    def room_names(self, rank: int) -> tuple[str, ...]:
        """The limits a waiter leaves when it takes its seat."""
        return ("room", self._room_names[rank]) if self.room else ()

    def permit(self, backend: str) -> Option | None:
        """One backend call's permit (``None``: the backend has no pool)."""
        pool = self.pools.get(backend)
        return None if pool is None else Option((Need(f"pool:{backend}:active", pool[0]),))

    def permit_names(self, backend: str) -> tuple[str, ...]:
        return (f"pool:{backend}:active",) if backend in self.pools else ()

    @property
    def enabled(self) -> bool:
        """True when anything is limited."""
        return bool(self.seats or self.tenant_max_running or any(self.tenant_overrides.values()) or self.pools)
