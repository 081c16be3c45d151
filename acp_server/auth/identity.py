"""Who a connection is (:class:`Identity`), the owner's identity, and the scopes a token may carry.

Apart from the tokens file (:mod:`.tokens`) because every connection has an identity, with tokens
configured or not: the handlers and transports load this small module, the tokens file's parsing,
hashing and store load only when ``--auth-tokens`` is used (or ``acp-server token`` runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OWNER", "SCOPES", "Identity"]

#: The scopes a token may carry: ``admin`` acts for any tenant and reads all stats; ``metrics`` scrapes.
SCOPES = ("admin", "metrics")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection is, as the server granted it.

    Attributes:
        token_id: the token that proved it, or ``None`` for the owner (Unix socket, stdio).
        tenant: the token's tenant, or ``None`` for the owner (who names any tenant).
        scopes: ``admin`` and/or ``metrics``.
    """

    token_id: str | None
    tenant: str | None
    scopes: frozenset[str] = field(default_factory=frozenset)

    @property
    def admin(self) -> bool:
        """May act for any tenant and read all statistics."""
        return "admin" in self.scopes

    @property
    def may_scrape(self) -> bool:
        """May read ``/metrics`` and ``_acp_server/stats``."""
        return "admin" in self.scopes or "metrics" in self.scopes

    def may_act_for(self, tenant: str) -> bool:
        """Whether this identity may act for ``tenant`` (its own, or any with ``admin``)."""
        return self.admin or tenant == self.tenant


#: The identity of Unix-socket and stdio peers: the socket is 0600, so they are the server's owner.
OWNER = Identity(token_id=None, tenant=None, scopes=frozenset({"admin"}))
