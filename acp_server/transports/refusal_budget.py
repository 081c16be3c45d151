"""The per-peer refusal budget: a peer that keeps sending what it was just told to hold off is paced,
then shed.

A refusal cannot be made cheap enough in Python (building the error alone costs microseconds), so a
client that re-sends a refused prompt at once, ignoring ``retryAfterMs``, spends the server's CPU on
refusals instead of on its neighbours' prompts. Each connection therefore gets a token bucket
(``rate_per_s`` tokens a second, at most ``burst``) that every *hold-off* refusal spends from: the
:class:`~acp_server.errors.OverloadError` family, each of which carries ``retryAfterMs``
(``prompt_queue_full``, ``capacity_exceeded``, ``admission_deferred``, ``capacity_unavailable``,
``rate_limited``). Other errors (bad params, unknown session, a deadline) are not hold-offs and cost
nothing.

A bucket may go into debt. In debt, the peer's next requests that target a scope it was told to hold
off (:meth:`RefusalBudget.holds_off`: a held session's requests; all of them while a server-wide kind is
held) wait unstarted until the refill has paid the debt back, at most :data:`MAX_PAUSE_S` at a time, or
until room opens where they wait: a held session's oldest waiting request starts as soon as one of the
peer's admitted prompts on that session ends. Its other requests start at once, and its notifications
(``session/cancel`` and ``$/cancel_request`` included) run at once, its admitted prompts run on and are
answered. When a wait is over the waiting requests start, one session's after another's, until one is
refused into debt again, which starts the next wait. A wait lasts until the debt is paid back, and at
least :data:`MIN_PAUSE_S`: the tokens refilled beyond the debt pay for the first refusals after it, so a
client that keeps re-sending is refused in batches (ten at the defaults, one scheduling pass and one
write each) five times a second, not once every 20 ms: its neighbours' requests are delayed only when
they arrive during one of those few batches. It is thus paced to about
``rate_per_s / ignored_cost`` refusals a second (50 at the defaults, well under 1% of a CPU), while its
admissible work is admitted as soon as there is room for it: a session it keeps full stays busy, and the
server spends its time on admissible work, this client's and its neighbours'. After a run of ``burst``
refusals from the one that put its bucket in debt on (ten seconds of pacing at the defaults; the run
ends when the bucket is full again) the shell sends
``_acp_server/evicted {reason: "ignored_retry_after"}`` and closes the connection; its admitted prompts
end as on any disconnect. Pacing first, rather than evicting at the first empty bucket, is also what
keeps a client that reconnects at once from spending a new burst every few milliseconds.

What counts as ignoring: a refusal opens a *hold* on its scope until ``retryAfterMs`` has passed (the
session for ``prompt_queue_full``, which is per session; the error kind for the others, which hold for
a backend, a tenant, a token or the whole server). A later refusal on a held scope, of a request read
more than ``grace_s`` after the hold opened (so it was not merely already on its way, pipelined behind
the first), ignored the hint: it costs ``ignored_cost`` tokens instead of one. A hold is not extended by
the refusals that ignore it, so a client re-sending at once pays ``ignored_cost`` for each re-send once
``grace_s`` has passed.

Why a polite client is never shed: a client that waits ``retryAfterMs`` after each refusal before it
re-sends that request (acp-server's SDK, :mod:`acp_server.client.retry`) re-sends after the hold that
refused it has ended (a hold another of its calls opened later may still make a re-send cost four), and
each of its calls is refused at most once per ``retryAfterMs`` (5 s for ``prompt_queue_full``). ``burst`` absorbs one wave of refusals of a pipelined
client (the default is above ``--max-inflight-requests``' default of 256) and ``rate_per_s`` its
sustained rate (256 calls refused every 5 s are 51 a second, a quarter of the default of 200).

The budget is pure (no trio, no I/O): the shell passes the time and acts on the answer, and it is
created at a peer's first refusal, so a connection that is never refused pays nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import OverloadError, PromptQueueFullError

__all__ = [
    "DEFAULT_REFUSAL_BUDGET",
    "EVICTION_REASON",
    "MAX_PAUSE_S",
    "MIN_PAUSE_S",
    "RefusalBudget",
    "RefusalBudgetSettings",
    "session_of",
]

#: ``_acp_server/evicted``'s ``reason`` when a peer's budget is spent
EVICTION_REASON = "ignored_retry_after"
#: holds remembered per peer before expired ones are dropped (a peer with many sessions held at once)
_MAX_HOLDS = 256
#: the longest a peer's next requests wait at once while its budget is in debt
MAX_PAUSE_S = 1.0
#: the shortest such wait: what the refill brings meanwhile pays for the next few refusals, so a peer
#: that keeps re-sending is refused a few at a time (one scheduling pass, one write, and one read of
#: its re-sends each) a few times a second, not one at a time every time one refusal's debt is paid
#: back (every 20 ms at the defaults): each such wake-up of the peer's costs its neighbours a delay,
#: so fewer of them leave fewer of the neighbours' requests delayed
MIN_PAUSE_S = 0.2


@dataclass(frozen=True)
class RefusalBudgetSettings:
    """The bucket's parameters (``--refusal-budget-rps``, ``--refusal-budget-burst``).

    Attributes:
        rate_per_s: tokens added per second (0: no budget, never evict).
        burst: the bucket's size, and its content at a peer's first refusal.
        ignored_cost: tokens a refusal costs when its request ignored an earlier refusal's
            ``retryAfterMs`` (one otherwise).
        grace_s: refusals of requests read within this long of the refusal that opened a hold were
            already on their way (pipelined) and cost one token.
    """

    rate_per_s: float = 200.0
    burst: float = 500.0
    ignored_cost: float = 4.0
    grace_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "burst", "ignored_cost", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"refusal budget: {name} must be a non-negative number; got {value!r}")
        if self.rate_per_s and not self.burst:
            raise ValueError("refusal budget: burst must be positive when rate_per_s is (0 rate turns it off)")

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0


DEFAULT_REFUSAL_BUDGET = RefusalBudgetSettings()


def _scope(error: OverloadError) -> Any:
    """What one refusal's hold covers: the session (its id) for ``prompt_queue_full``, else its kind
    (the error's class: a key no session id can equal)."""
    if type(error) is PromptQueueFullError:
        return error.payload.session_id  # type: ignore[attr-defined]
    return type(error)


class _SessionRef(msgspec.Struct, rename="camel"):
    session_id: str | None = None


_decode_session_ref = msgspec.json.Decoder(_SessionRef).decode


def session_of(params: bytes | None) -> str | None:
    """The ``sessionId`` a request's raw params name (the scope ``prompt_queue_full`` holds), if any.

    Params that are not an object with a string ``sessionId`` name none: the request is answered on its
    own merits once it starts.
    """
    if not params:
        return None
    try:
        return _decode_session_ref(params).session_id
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


class RefusalBudget:
    """One peer's bucket (see the module docstring).

    Args:
        settings: rate, burst, the cost of ignoring a hold, the pipelining grace.
        now: the current time in seconds (any monotonic clock; the same one for :meth:`charge`).

    Attributes:
        tokens: what is left, as of ``stamp``.
        refusals: hold-off refusals charged; ignored: those that ignored a hold; in_debt: those that
            left the bucket in debt (each made the peer's next requests wait).
    """

    __slots__ = ("_debt_run", "_holds", "_kinds_until", "ignored", "in_debt", "refusals", "settings", "stamp", "tokens")

    def __init__(self, settings: RefusalBudgetSettings, now: float) -> None:
        self.settings = settings
        self.tokens = float(settings.burst)
        self.stamp = now
        self.refusals = 0
        self.ignored = 0
        self.in_debt = 0
        self._debt_run = 0  # refusals since the bucket went into debt (0: not in a run; it ends when full)
        #: scope -> (when its hold opened, when it ends)
        self._holds: dict[Any, tuple[float, float]] = {}
        self._kinds_until = 0.0  # when the last hold on a kind (not a session) ends

    def holds_off(self, session_id: str | None, now: float) -> bool:
        """Whether a request naming ``session_id`` (``None``: no session) targets a scope this peer was
        told to hold off at ``now``: its session's hold, or any kind's (they cover a backend, a
        tenant, a token or the whole server: every request of the peer)."""
        if now < self._kinds_until:
            return True
        hold = self._holds.get(session_id) if session_id is not None else None
        return hold is not None and now < hold[1]

    def charge(self, error: OverloadError, now: float) -> float:
        """Spend for one hold-off refusal written to this peer at ``now``.

        Returns:
            How long the peer's next requests are to wait: 0 while the bucket holds tokens; in debt, the
            time the refill takes to pay it back, at least :data:`MIN_PAUSE_S` (unless that would
            refill more than half the bucket beyond the debt) and at most :data:`MAX_PAUSE_S`;
            ``inf`` once the peer has been refused ``burst`` times since its bucket went into debt
            without being full again: it is to be evicted.
        """
        s = self.settings
        self.tokens = min(float(s.burst), self.tokens + (now - self.stamp) * s.rate_per_s)
        if self.tokens == s.burst:
            self._debt_run = 0
        self.stamp = now
        self.refusals += 1
        cost = 1.0
        retry_after_ms = getattr(error.payload, "retry_after_ms", 0)
        if retry_after_ms:
            key = _scope(error)
            hold = self._holds.get(key)
            if hold is not None and now < hold[1]:
                if now - hold[0] > s.grace_s:
                    cost = s.ignored_cost
                    self.ignored += 1
            else:
                holds = self._holds
                if len(holds) >= _MAX_HOLDS:
                    self._prune(now)
                until = now + retry_after_ms / 1000
                holds[key] = (now, until)
                if type(key) is not str:
                    self._kinds_until = max(self._kinds_until, until)
        tokens = self.tokens = self.tokens - cost
        if tokens < 0:
            self.in_debt += 1
            self._debt_run += 1
        elif self._debt_run:
            self._debt_run += 1  # paid by what refilled during a wait: the same run of debt
        else:
            return 0.0
        if self._debt_run > s.burst:
            return math.inf
        if tokens >= 0:
            return 0.0
        # Beyond the debt, a wait refills at most half the bucket: a full bucket would end the run of
        # debt, and with it the count towards the eviction.
        batch_s = min(MIN_PAUSE_S, (s.burst / 2 - tokens) / s.rate_per_s)
        return min(max(-tokens / s.rate_per_s, batch_s), MAX_PAUSE_S)

    def _prune(self, now: float) -> None:
        holds = self._holds
        for key in [k for k, (_, until) in holds.items() if until <= now]:
            del holds[key]
        if len(holds) >= _MAX_HOLDS:  # all still held: forget them (the bucket still bounds the peer)
            holds.clear()

    def evicted_params(self) -> dict[str, Any]:
        """The params of the ``_acp_server/evicted`` notification this peer is sent."""
        s = self.settings
        return {
            "reason": EVICTION_REASON,
            "refusals": self.refusals,
            "ignoredRetryAfter": self.ignored,
            "inDebt": self.in_debt,
            "budgetRps": s.rate_per_s,
            "budgetBurst": s.burst,
        }
