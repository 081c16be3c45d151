"""The refusal-latency histogram: bucket layout, quantiles against exact ones, the snapshot's shape."""

from __future__ import annotations

import math
import random

import pytest

from acp_server.transports.timing import _NBUCKETS, LatencyHistogram, _bounds


def exact_quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1000.0


def test_buckets_tile_the_range_without_gaps() -> None:
    """Each bucket starts where the last ended, and above 32 ns none is wider than 1/16 of its start."""
    for index in range(_NBUCKETS - 1):
        low, high = _bounds(index)
        assert high == _bounds(index + 1)[0]
        if low >= 32:
            assert (high - low) * 16 <= low


def test_record_lands_in_the_bucket_that_holds_the_value() -> None:
    values = [0, 1, 31, 32, 33, 63, 64, 1000, 999_999, 123_456_789, 2**44]
    for ns in values:
        h = LatencyHistogram()
        h.record(ns)
        index = next(i for i, n in enumerate(h._buckets) if n)
        low, high = _bounds(index)
        assert low <= ns < high


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_quantiles_within_bucket_resolution(seed: int) -> None:
    """p50/p99 of a log-normal sample agree with the exact nearest-rank quantiles within 3.2 %."""
    rng = random.Random(seed)
    values = [int(rng.lognormvariate(11, 1.2)) for _ in range(5000)]
    h = LatencyHistogram()
    for ns in values:
        h.record(ns)
    for q in (0.5, 0.9, 0.99, 1.0):
        assert h.quantile(q) == pytest.approx(exact_quantile(values, q), rel=0.032)
    assert h.count == len(values) and h.sum_ns == sum(values)
    assert h.max_us == max(values) / 1000.0


def test_snapshot_is_plain_and_empty_is_zero() -> None:
    h = LatencyHistogram()
    assert h.snapshot() == {"count": 0, "p50Us": 0.0, "p99Us": 0.0, "maxUs": 0.0}
    for ns in (100_000, 200_000, 300_000):
        h.record(ns)
    snap = h.snapshot()
    assert set(snap) == {"count", "p50Us", "p99Us", "maxUs"}
    assert snap["count"] == 3 and snap["maxUs"] == 300.0
    assert snap["p50Us"] == pytest.approx(200.0, rel=0.032)
    assert type(snap["count"]) is int and all(type(snap[k]) is float for k in ("p50Us", "p99Us", "maxUs"))


def test_out_of_range_values_are_clamped() -> None:
    """A negative duration counts as 0; one past the last bucket lands in it, its exact max kept."""
    h = LatencyHistogram()
    h.record(-5)
    h.record(2**60)
    assert h._buckets[0] == 1 and h._buckets[-1] == 1
    assert h.quantile(0.0) == 0.0
    assert h.quantile(1.0) <= h.max_us == 2**60 / 1000.0


def test_quantile_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        LatencyHistogram().quantile(1.5)
