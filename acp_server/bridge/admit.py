"""A prompt's admission: the synchronous, all-or-nothing check and count, and the ticket it makes.

:class:`PromptAdmission` is the part of :class:`~.bridge.SessionBridge` that admits prompts (the bridge
is one; this module holds that concern, the bridge module the sessions' lifecycle).

Admission is synchronous: :meth:`PromptAdmission.admit` checks and counts with no ``await`` in
between, so under trio nothing can run between the check and the increment. Its order is fixed:
session lookup, client id, a request already cancelled, idempotency, the pending-prompt limit, the
admission policy, the backend pool's lease, then the increment and enqueue. Every admitted prompt
settles exactly once (result or error), and the session's pending slot is released at that moment.
With limits shared by replicas (``--coordinator``) a prompt is admitted by
:func:`~.shared_admit.admit_shared` instead: the same local checks now, the shared part over the
coordinator after them; both end in :meth:`PromptAdmission.make_ticket`.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..admission.limits import Limits
from ..admission.policy import PolicyEngine, Queued, Seat
from ..admission.pool import CapacityPool
from ..admission.shared import draining_refusal
from ..backends.base import ClientChannel
from ..errors import (
    RETRY_AFTER_MS,
    AcpError,
    IdempotencyKeyConflictError,
    PromptQueueFullError,
    RequestCancelledError,
)
from ..types.acp import ContentBlock
from .clients import ClientRegistry
from .fanout import FanOut
from .persistence import Persistence
from .runner import SessionRunner
from .session import Peer, PromptTicket, Session, new_ticket
from .settlement import PromptWaiter, Settlement

__all__ = ["PromptAdmission"]

_encoder = msgspec.json.Encoder()


class PromptAdmission:
    """Admits prompts to the bridge's sessions (a base of :class:`~.bridge.SessionBridge`, which sets
    the attributes below)."""

    sessions: dict[str, Session]
    limits: Limits
    clients: ClientRegistry
    policy: PolicyEngine
    _policy_on: bool
    _pools: dict[str, CapacityPool]
    persistence: Persistence
    fanout: FanOut
    settlement: Settlement
    runner: SessionRunner
    draining: bool
    _idempotency: collections.OrderedDict[tuple[str, str], tuple[bytes, PromptTicket, float]]
    _prompt_seq: int
    _now: Callable[[], float]
    _admitted: int
    _refused: int

    if TYPE_CHECKING:

        def get(self, session_id: str, tenant: str | None = None) -> Session:
            """The live session, or a stored one restored (see :meth:`~.bridge.SessionBridge.get`)."""
            ...

    def check_local(
        self,
        session_id: str,
        prompt: list[ContentBlock],
        peer: Peer | None,
        client_id: str | None,
        cancelled: bool,
        idempotency_key: str | None,
        tenant: str | None,
        now: float | None = None,
    ) -> tuple[Session, str | None, bytes, PromptTicket | None]:
        """The per-session part of a prompt's admission, in order: the session, the client id, a
        request already cancelled, the idempotency key, the pending limit (shared by :meth:`admit`
        and the coordinator's admission); ``now``: trio's clock, if the caller read it already.

        Returns:
            The session, the client id the request acts as, the prompt's fingerprint (empty without a key),
            and the earlier attempt's ticket when the key was admitted before (the caller attached).

        Raises:
            SessionNotFoundError, InvalidClientIdError, RequestCancelledError,
            IdempotencyKeyConflictError, PromptQueueFullError.
        """
        session = self.sessions.get(session_id)
        if session is None or (tenant is not None and session.tenant != tenant):
            session = self.get(session_id, tenant)  # not live (restored from the store), or not found
        client = self.clients.resolve(session, peer, client_id, now)
        if cancelled:
            raise RequestCancelledError()
        fingerprint = b""
        if idempotency_key is not None:
            fingerprint = hashlib.blake2b(_encoder.encode(prompt), digest_size=16).digest()
            seen = self._idempotent(session_id, idempotency_key)
            if seen is not None:
                if seen[0] != fingerprint:
                    raise IdempotencyKeyConflictError(session_id=session_id, idempotency_key=idempotency_key)
                if peer is not None:
                    self.clients.attach(session, peer)
                return session, client, fingerprint, seen[1]
        limit = self.limits.max_pending_prompts_per_session
        if limit and session.pending_count >= limit:
            self._queue_full(session, limit)
        return session, client, fingerprint, None

    def _queue_full(self, session: Session, limit: int) -> None:
        """Refuse a prompt to ``session``, whose pending limit is reached.

        Raises:
            PromptQueueFullError: always.
        """
        self._refused += 1
        raise PromptQueueFullError(
            session_id=session.session_id, limit=limit, pending_count=session.pending_count, retry_after_ms=RETRY_AFTER_MS
        )

    def admit(
        self,
        session_id: str,
        prompt: list[ContentBlock],
        peer: Peer | None,
        client_id: str | None = None,
        deadline_ms: int | None = None,
        cancelled: bool = False,
        channel: ClientChannel | None = None,
        meta: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        priority: str = "interactive",
    ) -> tuple[PromptTicket, bool]:
        """Admit a prompt or refuse it, synchronously and all or nothing.

        Returns:
            The prompt's ticket, and whether it is an earlier attempt's (an idempotent duplicate).

        A prompt whose ``(session, idempotency_key)`` was admitted within the TTL takes no slot and
        does not run again: the earlier attempt's ticket is returned (wait on it with
        :meth:`waiter` with ``owner=False``), so every attempt gets the same outcome.

        With the admission policy on, a prompt arriving at a session with nothing pending is decided
        now (after the pending limit, before the backend pool's lease): it gets a seat, or a place in
        the global waiting room, or is refused. One admitted behind others is decided when it reaches
        the head of its session's FIFO, and is never refused then.

        Raises:
            SessionNotFoundError, InvalidClientIdError, RequestCancelledError,
            IdempotencyKeyConflictError, PromptQueueFullError, AdmissionDeferredError,
            CapacityUnavailableError, CapacityExceededError:
                in this order of checks; a refusal changes nothing.
        """
        now = self._now()
        session = self.sessions.get(session_id)
        if session is not None and idempotency_key is None and not cancelled and (tenant is None or session.tenant == tenant):
            # check_local's usual case, inline: a live session, no key, a request not cancelled
            client = self.clients.resolve(session, peer, client_id, now)
            limit = self.limits.max_pending_prompts_per_session
            if limit and session.pending_count >= limit:
                self._queue_full(session, limit)
            fingerprint = b""
        else:
            session, client, fingerprint, earlier = self.check_local(
                session_id, prompt, peer, client_id, cancelled, idempotency_key, tenant, now
            )
            if earlier is not None:
                return earlier, True
        if self.draining:
            self._refused += 1
            raise draining_refusal()
        effective = self.limits.prompt_deadline_ms
        if deadline_ms is not None and (not effective or deadline_ms < effective):
            effective = deadline_ms
        policy = self.policy
        seat: Seat | Queued | None = None
        if self._policy_on and not session.pending_count:
            try:
                seat = policy.decide(
                    tenant=session.tenant,
                    priority=priority,
                    deadline=now + effective / 1000 if effective else None,
                    session_id=session_id,
                )
            except AcpError:
                self._refused += 1
                raise
        pool = self._pools.get(session.backend.name) if self._pools else None
        lease = None
        if pool is not None:
            try:
                lease = pool.try_lease(session_id)
            except AcpError:
                self._refused += 1
                if seat is not None:
                    policy.revoke(seat)  # all or nothing
                raise
        session.pending_count += 1
        ticket = self.make_ticket(  # positional: a call with keywords costs more
            session, prompt, peer, client, effective, channel, meta, priority, seat, lease,
            seat.position_hint if seat is not None and isinstance(seat, Queued) else None, now,
        )
        if idempotency_key is not None:
            self._remember(session_id, idempotency_key, fingerprint, ticket)
        return ticket, False

    def make_ticket(
        self,
        session: Session,
        prompt: list[ContentBlock],
        peer: Peer | None,
        client: str | None,
        effective_deadline_ms: int,
        channel: ClientChannel | None,
        meta: dict[str, Any] | None,
        priority: str,
        seat: Any,
        lease: Any,
        queued_at: int | None,
        now: float | None = None,
    ) -> PromptTicket:
        """The ticket of a prompt admitted now (its pending slot counted already): recorded, watched for
        its deadline, announced (``accepted``, then ``queued`` at ``queued_at`` when it waits for a seat)
        and put in its session's FIFO. ``now``: trio's clock, if the caller read it already."""
        seq = self._prompt_seq = self._prompt_seq + 1
        ticket = new_ticket(
            session, f"prompt_{seq}", prompt, peer, client, self._now() if now is None else now,
            effective_deadline_ms, channel, meta, lease, priority, seat, seq,
        )
        if self.persistence.durable:
            ticket.store_op = self.persistence.admit(ticket)
        if effective_deadline_ms:
            self.settlement.watch_deadline(ticket)
        self._admitted += 1
        if peer is not None and peer not in session.attached:
            self.clients.attach(session, peer)
        if queued_at is not None:
            fanout = self.fanout
            fanout.turn_state(ticket, "accepted")
            fanout.turn_state(ticket, "queued", position=queued_at)
            self.runner.enqueue(session, ticket)
            return ticket
        # A prompt that starts in this step sends ``accepted`` with ``running`` (FanOut.start); one
        # queued sends it now: nothing was sent for the session in between.
        ticket.accepted_due = True
        self.runner.enqueue(session, ticket)
        if ticket.accepted_due:
            ticket.accepted_due = False
            self.fanout.turn_state(ticket, "accepted")
        return ticket

    def pending_total(self) -> int:
        """Prompts admitted and not settled, over every live session."""
        return sum(session.pending_count for session in self.sessions.values())

    def _idempotent(self, session_id: str, key: str) -> tuple[bytes, PromptTicket, float] | None:
        """The live entry for ``(session_id, key)``, after dropping those older than the TTL."""
        table = self._idempotency
        cut = trio.current_time() - self.limits.idempotency_ttl_s
        while table:
            oldest = next(iter(table.values()))
            if oldest[2] > cut:
                break
            table.popitem(last=False)
        return table.get((session_id, key))

    def _remember(self, session_id: str, key: str, fingerprint: bytes, ticket: PromptTicket) -> None:
        """Keep ``ticket`` under its key, dropping the oldest beyond ``max_idempotency_keys``."""
        table = self._idempotency
        table[(session_id, key)] = (fingerprint, ticket, ticket.admitted_at)
        while len(table) > self.limits.max_idempotency_keys:
            table.popitem(last=False)

    def waiter(self, ticket: PromptTicket, *, owner: bool = True) -> PromptWaiter:
        """A :class:`~acp_server.jsonrpc.Deferred` for a request waiting on ``ticket`` (no task needed).

        ``owner``: the request that admitted the prompt (its cancel cancels the prompt); an idempotent
        duplicate is not, and its cancel only ends its own wait.
        """
        return PromptWaiter(self.settlement, ticket, owner)
