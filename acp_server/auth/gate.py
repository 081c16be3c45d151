"""The server's authenticator: tokens, failure counting, request rates and the audit log, in one place.

Transports and handlers ask it three things, and map its plain answers onto their own errors:

- :meth:`Authenticator.check`: does this presented secret, from this address, prove a token?
  (:class:`Outcome`: an identity, a refusal with ``retry_after_ms`` when the address is over its
  failure limit, or a failure, always the same whatever was wrong);
- :meth:`Authenticator.throttle`: may this identity make one more request now?
- :meth:`Authenticator.reload`: take the tokens file again (SIGHUP), auditing what changed.

Where a stream comes from (:class:`PeerInfo`, :func:`describe_stream`) is :mod:`.peers`, re-exported
here; this module loads only when tokens are configured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .audit import AuditLog
from .http_rules import WS_SUBPROTOCOL, parse_bearer, parse_ws_subprotocols
from .identity import Identity
from .peers import PeerInfo, describe_stream
from .ratelimit import AuthFailureLimiter, RateLimiter
from .tokens import MAX_SECRET_CHARS, ReloadResult, TokenStore

__all__ = ["Authenticator", "Outcome", "PeerInfo", "describe_stream"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer to :meth:`Authenticator.check`.

    Attributes:
        identity: who the secret proves, or ``None``.
        retry_after_ms: > 0 when the address was refused unchecked (over its failure limit).
    """

    identity: Identity | None
    retry_after_ms: int = 0


class Authenticator:
    """Token checks with failure counting, per-identity request rates and audit lines.

    Args:
        store: the tokens in force.
        audit: where audit lines go (default: stderr).
        rate_limit_rps: requests a second per token (burst twice that); ``None``: no limit.
        failures: the per-address failure counter (default: 10 a minute).
        clock: the monotonic clock of the rate limits.
    """

    def __init__(
        self,
        store: TokenStore,
        *,
        audit: AuditLog | None = None,
        rate_limit_rps: float | None = None,
        failures: AuthFailureLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.audit = audit or AuditLog()
        self.failures = failures or AuthFailureLimiter(clock=clock)
        self.rates = RateLimiter(rate_limit_rps, clock=clock) if rate_limit_rps else None
        #: streams outside the connection shells that act for a token (HTTP's SSE subscribers): each
        #: has ``identity`` and ``evict(reason)``, and is evicted with the connections of its token
        self.streams: set[Any] = set()

    def check(self, secret: object, *, source: str | None, transport: str, audit_ok: bool = True) -> Outcome:
        """Check a presented secret from ``source`` (an IP address, or ``None``).

        An address over its failure limit is refused before the secret is looked at; every other
        failure counts against the address and is audited with its reason (never the secret).
        ``audit_ok=False``: a success is not audited here (the caller audits it its own way).
        """
        refused = self.failures.refused(source)
        if refused:
            self.audit.auth_refused(transport=transport, source=source, retry_after_ms=refused)
            return Outcome(None, refused)
        identity = self.store.authenticate(secret)
        if identity is None:
            self.failures.failed(source)
            if secret is None:
                reason = "missing"
            elif not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_CHARS:
                reason = "malformed"
            else:
                reason = "unknown_or_expired"
            self.audit.auth_failed(reason=reason, transport=transport, source=source)
            return Outcome(None)
        if not audit_ok:
            return Outcome(identity)
        self.audit.auth_ok(
            token_id=identity.token_id or "", tenant=identity.tenant or "", transport=transport, source=source
        )
        return Outcome(identity)

    def check_http(
        self,
        *,
        authorization: str | Sequence[str] | None,
        ws_protocols: str | Sequence[str] | None = None,
        source: str | None,
        transport: str = "http",
        audit_ok: bool = True,
    ) -> tuple[Outcome, str | None]:
        """Check an HTTP request's (or WebSocket handshake's) credentials, as :meth:`check` does a secret.

        ``Authorization: Bearer`` first, else the ``acp-bearer.`` subprotocol. A request with no credential
        at all is audited (``missing``) but not counted against its address: it made no attempt.

        Returns:
            the outcome (no identity: answer 401 with the one body, or 429 when ``retry_after_ms``), and
            the subprotocol to answer a WebSocket handshake with (``acp.v1``) when it succeeded.
        """
        offer = parse_ws_subprotocols(ws_protocols)
        if authorization is not None:
            secret: object = parse_bearer(authorization)
            malformed = secret is None
        else:
            secret, malformed = offer.secret, offer.malformed
        if secret is None and not malformed:
            self.audit.auth_failed(reason="missing", transport=transport, source=source)
            return Outcome(None), None
        outcome = self.check(secret if not malformed else "", source=source, transport=transport, audit_ok=audit_ok)
        answer = WS_SUBPROTOCOL if outcome.identity is not None and offer.acp else None
        return outcome, answer

    def throttle(self, identity: Identity | None) -> int:
        """Count one request of ``identity``: 0 to proceed, else ``retryAfterMs`` (the owner is never limited)."""
        if self.rates is None or identity is None or identity.token_id is None:
            return 0
        return self.rates.acquire(identity.token_id)

    def valid(self, identity: Identity) -> bool:
        """Whether ``identity`` still holds (its token is in force, unchanged and not expired)."""
        return self.store.valid(identity)

    def reload(self) -> ReloadResult:
        """Re-read the tokens file; audit the outcome; the tokens in force stay when it cannot be used."""
        result = self.store.reload()
        path = self.store.path or ""
        if result.error is not None:
            self.audit.tokens_reload_failed(path=path, detail=result.error)
            return result
        self.audit.tokens_reloaded(
            path=path, added=len(result.added), removed=len(result.removed), changed=len(result.changed)
        )
        if self.rates is not None:
            for token_id in (*result.removed, *result.changed):
                self.rates.forget(token_id)
        return result
