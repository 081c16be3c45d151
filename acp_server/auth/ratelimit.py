"""Request rates per identity and failed authentications per source address, as pure counters.

Nothing here sleeps or imports trio: every call takes the current monotonic time (``now``, seconds) or
reads the injected clock, so tests drive time by hand.

- :class:`RateLimiter`: a token bucket per identity (``--rate-limit-rps N``: N requests a second on
  average, bursts of ``2N``). Which requests count is the caller's choice (the handlers exempt
  cancellations, which only free capacity).
- :class:`AuthFailureLimiter`: failed authentications per source address in a sliding minute; after
  :data:`MAX_AUTH_FAILURES` the address is refused without its secret being checked, until the oldest
  failure leaves the window. Loopback and Unix-socket peers are never counted: they are local.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

__all__ = [
    "AUTH_FAILURE_WINDOW_S",
    "MAX_AUTH_FAILURES",
    "AuthFailureLimiter",
    "RateLimiter",
    "TokenBucket",
    "is_local_address",
]

#: Failed authentications one address may make in :data:`AUTH_FAILURE_WINDOW_S` before it is refused.
MAX_AUTH_FAILURES = 10
AUTH_FAILURE_WINDOW_S = 60.0


class TokenBucket:
    """A bucket holding up to ``burst`` tokens, refilled at ``rate`` a second.

    Args:
        rate: tokens added per second (positive).
        burst: the bucket's size; it starts full.
        now: the monotonic time the bucket is made at.
    """

    __slots__ = ("_level", "_stamp", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if not rate > 0 or not burst >= 1 or math.isinf(rate) or math.isinf(burst):
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1; got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._stamp = now

    def _refill(self, now: float) -> None:
        if now > self._stamp:  # a clock that stepped back adds nothing and takes nothing
            self._level = min(self.burst, self._level + (now - self._stamp) * self.rate)
            self._stamp = now

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` tokens if the bucket holds them.

        Returns:
            0.0 when taken; else the seconds until it would hold them (nothing is taken).
        """
        self._refill(now)
        if self._level >= cost:
            self._level -= cost
            return 0.0
        return (cost - self._level) / self.rate

    def full(self, now: float) -> bool:
        """Whether the bucket is back to its full size (it may then be forgotten: a new one is the same)."""
        self._refill(now)
        return self._level >= self.burst


class RateLimiter:
    """One :class:`TokenBucket` per identity key: ``rps`` a second, bursts of ``2 * rps``.

    Args:
        rps: requests a second per identity (positive).
        clock: the monotonic clock used when a call passes no ``now``.
        max_keys: buckets kept at most; full buckets are forgotten first (a new one is the same).
    """

    def __init__(self, rps: float, *, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000) -> None:
        if not rps > 0 or math.isinf(rps):
            raise ValueError(f"--rate-limit-rps must be a positive number; got {rps}")
        self.rps = rps
        self.burst = max(1.0, 2 * rps)
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def acquire(self, key: Hashable, now: float | None = None) -> int:
        """Count one request of ``key``.

        Returns:
            0 when it may proceed; else the milliseconds after which it would (``retryAfterMs``, >= 1).
        """
        now = self._clock() if now is None else now
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rps, self.burst, now)
            self._prune(now)
        else:
            self._buckets.move_to_end(key)
        wait = bucket.take(now)
        return 0 if wait == 0 else max(1, math.ceil(wait * 1000))

    def _prune(self, now: float) -> None:
        if len(self._buckets) <= self._max_keys:
            return
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)  # the least recently used

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s bucket (its token was revoked)."""
        self._buckets.pop(key, None)


def is_local_address(address: str | None) -> bool:
    """Whether a peer address is local: ``None`` or a non-IP (Unix socket, stdio), or a loopback IP."""
    if not address:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True  # not an IP address: a Unix socket path or a pipe
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class AuthFailureLimiter:
    """Failed authentications per source address in a sliding window.

    Args:
        max_failures: failures an address may make in the window; the next attempt is refused unchecked.
        window_s: the window's length in seconds.
        clock: the monotonic clock used when a call passes no ``now``.
        max_addresses: addresses tracked at most (the least recently failing are forgotten first).
    """

    def __init__(
        self,
        *,
        max_failures: int = MAX_AUTH_FAILURES,
        window_s: float = AUTH_FAILURE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 65_536,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        stamps = self._failures.get(address)
        if stamps is None:
            return None
        while stamps and stamps[0] <= now - self.window_s:
            stamps.popleft()
        if not stamps:
            del self._failures[address]
            return None
        return stamps

    def refused(self, address: str | None, now: float | None = None) -> int:
        """Whether ``address`` is refused before its secret is looked at.

        Returns:
            0 when it may try; else the milliseconds until its oldest counted failure leaves the window.
        """
        if is_local_address(address):
            return 0
        assert address is not None
        now = self._clock() if now is None else now
        stamps = self._recent(address, now)
        if stamps is None or len(stamps) < self.max_failures:
            return 0
        return max(1, math.ceil((stamps[0] + self.window_s - now) * 1000))

    def failed(self, address: str | None, now: float | None = None) -> None:
        """Count one failed authentication of ``address`` (local addresses are not counted)."""
        if is_local_address(address):
            return
        assert address is not None
        now = self._clock() if now is None else now
        stamps = self._recent(address, now)
        if stamps is None:
            stamps = self._failures[address] = deque(maxlen=self.max_failures)
            while len(self._failures) > self._max_addresses:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(address)
        stamps.append(now)

    def failures(self, address: str, now: float | None = None) -> int:
        """Failures of ``address`` still in the window."""
        now = self._clock() if now is None else now
        stamps = self._recent(address, now)
        return 0 if stamps is None else len(stamps)
