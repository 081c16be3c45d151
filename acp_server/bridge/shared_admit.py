"""Admission when the limits are a cluster's: the local part now, the shared part over the coordinator.

With ``--coordinator`` a prompt is admitted in two steps. The local part runs synchronously as the
request is read, exactly as :meth:`~.bridge.SessionBridge.admit` checks it (session, client id, a request
already cancelled, this replica's idempotency table, the per-session pending limit) and reserves the
prompt's pending slot, so the session's FIFO and its limit see it at once. The shared part is one
coordinator call (:class:`~acp_server.admission.shared.SharedAdmission`): the idempotency claim across
replicas when the prompt has a key, then its seat or waiting-room place with the pool's slot. A refusal
there gives the pending slot back and answers the request with the refusal: nothing is recorded,
announced or counted as admitted. Prompts of one session pass the shared step in their order of arrival.

:class:`SharedAdmit` is the request's :class:`~acp_server.jsonrpc.Deferred`: it answers with the
refusal, or hands over to the prompt's :class:`~.settlement.PromptWaiter` once the ticket exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..coordinator import Lease
from ..errors import (
    RETRY_AFTER_MS,
    AcpError,
    DuplicateInFlightError,
    IdempotencyKeyConflictError,
    LeaseLostError,
    RequestCancelledError,
)
from ..jsonrpc import Deferred
from ..types.acp import ContentBlock
from .session import Peer, PromptTicket

if TYPE_CHECKING:
    from ..backends.base import ClientChannel
    from .bridge import SessionBridge

__all__ = ["SharedAdmit", "admit_shared"]

log = logging.getLogger("acp_server.bridge")
_encoder = msgspec.json.Encoder()


def admit_shared(
    bridge: SessionBridge,
    session_id: str,
    prompt: list[ContentBlock],
    *,
    peer: Peer | None,
    client_id: str | None = None,
    deadline_ms: int | None = None,
    cancelled: bool = False,
    channel: ClientChannel | None = None,
    meta: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    tenant: str | None = None,
    priority: str = "interactive",
) -> Deferred:
    """The local part of admission, now; the request's answer comes from the returned Deferred.

    Raises:
        SessionNotFoundError, InvalidClientIdError, RequestCancelledError, IdempotencyKeyConflictError,
        PromptQueueFullError: the local checks, in :meth:`SessionBridge.admit`'s order.
    """
    session, client, fingerprint, earlier = bridge.check_local(
        session_id, prompt, peer, client_id, cancelled, idempotency_key, tenant
    )
    if earlier is not None:
        return bridge.waiter(earlier, owner=False)
    effective = bridge.limits.prompt_deadline_ms
    if deadline_ms is not None and (not effective or deadline_ms < effective):
        effective = deadline_ms
    first = not session.pending_count
    session.pending_count += 1  # reserved: the FIFO and the pending limit see it from now on
    gates = bridge.admission_gates
    before = gates.get(session_id)
    gate = gates[session_id] = trio.Event()

    async def shared_part(admit: SharedAdmit) -> PromptTicket:
        try:
            if before is not None:
                await before.wait()  # the session's earlier prompt passes first
            assert bridge.shared is not None
            claimed = False
            if idempotency_key is not None:
                await _claim(bridge, session_id, idempotency_key, fingerprint.hex(), admit)
                claimed = True
            try:
                hold = await bridge.shared.admit(
                    tenant=session.tenant, priority=priority, backend=session.backend.name,
                    session_id=session_id, first=first,
                )
            except BaseException:
                if claimed:  # refused after the claim: the key is free again
                    assert idempotency_key is not None
                    with trio.CancelScope(shield=True):
                        await bridge.shared.coordinator.settle_claim(session_id, idempotency_key, admit.claim_id, drop=True)
                raise
        except BaseException:
            session.pending_count -= 1
            bridge._refused += 1
            raise
        finally:
            gate.set()
            if gates.get(session_id) is gate:
                del gates[session_id]
        ticket = bridge.make_ticket(
            session, prompt, peer, client, effective, channel=channel, meta=meta, priority=priority,
            seat=None, lease=hold, queued_at=hold.position_hint if hold.state == "queued" else None,
        )
        if idempotency_key is not None:
            bridge._remember(session_id, idempotency_key, fingerprint, ticket)
            runner = bridge.runner.nursery
            assert runner is not None
            runner.start_soon(_settle_when_done, bridge, ticket, idempotency_key, admit.claim_id)

        def lost(lease: Lease) -> None:
            error = LeaseLostError(lease_id=lease.id, fencing_token=lease.token, prompt_id=ticket.prompt_id)
            bridge.settlement.settle(ticket, None, error)

        hold.lease.on_lost = lost
        return ticket

    deferred = SharedAdmit(bridge, shared_part)
    return deferred


async def _claim(bridge: SessionBridge, session_id: str, key: str, fingerprint: str, admit: SharedAdmit) -> None:
    """Claim the idempotency key across replicas, or raise what another replica's claim means."""
    assert bridge.shared is not None
    coordinator = bridge.shared.coordinator
    claim = await coordinator.claim(session_id, key, fingerprint, admit.claim_id, bridge.limits.idempotency_ttl_s)
    if claim.claimed:
        return
    if claim.fingerprint != fingerprint:
        raise IdempotencyKeyConflictError(session_id=session_id, idempotency_key=key)
    raise DuplicateInFlightError(
        session_id=session_id, idempotency_key=key, replica_id=claim.replica_id,
        retry_after_ms=max(1, min(claim.ttl_ms, RETRY_AFTER_MS)),
    )


async def _settle_when_done(bridge: SessionBridge, ticket: PromptTicket, key: str, claim_id: str) -> None:
    """Once the prompt has its outcome, mark its claim done in the coordinator: another replica then
    answers the same key with ``idempotency_key_conflict`` (another prompt) or ``duplicate_in_flight``
    naming this replica, which has the outcome (the same prompt)."""
    await ticket.done.wait()
    assert bridge.shared is not None
    await bridge.shared.coordinator.settle_claim(ticket.session.session_id, key, claim_id, drop=False)


class SharedAdmit(Deferred):
    """A prompt request between the local and the shared part of its admission.

    Args:
        bridge: runs the shared part in its nursery.
        shared_part: the shared part; returns the admitted prompt's ticket, or raises its refusal.
    """

    __slots__ = ("_bridge", "_done", "_inner", "_part", "_scope", "_settled", "claim_id", "decided", "ticket")

    def __init__(self, bridge: SessionBridge, shared_part: Callable[[SharedAdmit], Any]) -> None:
        self._bridge = bridge
        self._part = shared_part
        self._done: Callable[[Any, AcpError | None], None] | None = None
        self._settled: Callable[[], None] | None = None
        self._inner: Deferred | None = None
        self._scope = trio.CancelScope()
        bridge._claim_seq += 1
        #: names this admission in its idempotency claim (the prompt id is known only once admitted)
        self.claim_id = f"{bridge.shared.coordinator.replica_id if bridge.shared else ''}#{bridge._claim_seq}"
        #: set once the shared part decided: ``ticket`` is the admitted prompt's, or ``None`` (refused)
        self.decided = trio.Event()
        self.ticket: Any = None

    def on_settled(self, settled: Callable[[], None]) -> None:
        self._settled = settled
        if self._inner is not None:
            self._inner.on_settled(settled)

    def subscribe(self, done: Callable[[Any, AcpError | None], None]) -> None:
        self._done = done
        nursery = self._bridge.runner.nursery
        assert nursery is not None, "the bridge is not running"
        nursery.start_soon(self._run)

    async def _run(self) -> None:
        try:
            with self._scope:
                ticket = await self._part(self)
        except AcpError as exc:
            self._answer(None, exc)
            return
        except Exception:
            log.exception("shared admission failed")
            from ..errors import InternalError

            self._answer(None, InternalError())
            return
        if self._scope.cancelled_caught:
            self._answer(None, RequestCancelledError())
            return
        self.ticket = ticket
        self.decided.set()
        inner = self._inner = self._bridge.waiter(ticket)
        if self._settled is not None:
            inner.on_settled(self._settled)
        if self._done is not None:
            inner.subscribe(self._done)

    def _answer(self, result: Any, error: AcpError | None) -> None:
        self.decided.set()
        done, self._done = self._done, None
        if done is not None:
            done(result, error)

    def cancel(self, *, connection_lost: bool) -> None:
        """Before the shared part is over, the request's cancel stops it (nothing is admitted); after,
        the prompt's waiter handles it (the owner's cancel cancels the prompt)."""
        if self._inner is not None:
            cancel = getattr(self._inner, "cancel", None)
            if cancel is not None:
                cancel(connection_lost=connection_lost)
            return
        if connection_lost:
            self._done = None
        self._scope.cancel()

