"""A latency histogram cheap enough for the hot path: fixed log-spaced buckets, no trio, no allocation.

Buckets follow the HdrHistogram layout: values under 32 ns have one bucket each, and every power of
two above is cut into 16 equal buckets, so a bucket spans at most 1/16 of its lower bound (quantiles
are reported at the bucket's middle: within about 3 %). ``record`` is a few integer operations
on a preallocated list; quantiles walk the ~700 buckets and are meant for a stats request, not for
every message.
"""

from __future__ import annotations

import math

__all__ = ["LatencyHistogram"]

_SUB_BITS = 4
_SUB = 1 << _SUB_BITS  # buckets per power of two
_EXACT = 2 * _SUB  # values below this have a bucket each
_MAX_EXPONENT = 40  # 2**45 ns (about 9.8 hours) and above land in the last bucket
_NBUCKETS = _SUB * (_MAX_EXPONENT + 1) + _SUB


def _bounds(index: int) -> tuple[int, int]:
    """The half-open range ``[low, high)`` of nanoseconds that bucket ``index`` holds."""
    if index < _EXACT:
        return index, index + 1
    exponent = index // _SUB - 1
    mantissa = index - _SUB * exponent
    return mantissa << exponent, (mantissa + 1) << exponent


class LatencyHistogram:
    """Durations in nanoseconds, summarised as quantiles in microseconds.

    Example:
        >>> h = LatencyHistogram()
        >>> h.record(250_000)
        >>> h.snapshot()["count"]
        1
    """

    __slots__ = ("_buckets", "_max_ns", "count", "sum_ns")

    def __init__(self) -> None:
        self._buckets = [0] * _NBUCKETS
        self.count = 0
        self.sum_ns = 0
        self._max_ns = 0

    def record(self, ns: int) -> None:
        """Add one duration (nanoseconds; negative values count as 0)."""
        if ns < _EXACT:
            if ns < 0:
                ns = 0
            index = ns
        else:
            exponent = ns.bit_length() - _SUB_BITS - 1
            index = _SUB * exponent + (ns >> exponent)
            if index >= _NBUCKETS:
                index = _NBUCKETS - 1
        self._buckets[index] += 1
        self.count += 1
        self.sum_ns += ns
        if ns > self._max_ns:
            self._max_ns = ns

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0 <= q <= 1) in microseconds; 0.0 when nothing was recorded.

        Raises:
            ValueError: ``q`` is outside [0, 1].
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be between 0 and 1, got {q!r}")
        if self.count == 0:
            return 0.0
        rank = max(1, math.ceil(q * self.count))  # the first value for q == 0
        seen = 0
        for index, n in enumerate(self._buckets):
            seen += n
            if seen >= rank:
                low, high = _bounds(index)
                middle = min((low + high - 1) / 2, self._max_ns)
                return middle / 1000.0
        return self._max_ns / 1000.0  # unreachable while counts agree; kept for safety

    @property
    def max_us(self) -> float:
        """The largest duration recorded, in microseconds (exact, not bucketed)."""
        return self._max_ns / 1000.0

    def snapshot(self) -> dict[str, float | int]:
        """``{"count", "p50Us", "p99Us", "maxUs"}`` as plain builtins (microseconds, 0.1 us precision)."""
        return {
            "count": self.count,
            "p50Us": round(self.quantile(0.5), 1),
            "p99Us": round(self.quantile(0.99), 1),
            "maxUs": round(self.max_us, 1),
        }
