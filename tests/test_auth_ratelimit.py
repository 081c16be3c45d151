"""Token buckets per identity and failed authentications per address, with time driven by hand."""

from __future__ import annotations

import pytest

from acp_server.auth.ratelimit import AuthFailureLimiter, RateLimiter, TokenBucket, is_local_address


def test_a_bucket_allows_a_burst_of_2n_then_paces_at_n() -> None:
    limiter = RateLimiter(5, clock=lambda: 0.0)
    assert [limiter.acquire("a", 0.0) for _ in range(10)] == [0] * 10
    assert limiter.acquire("a", 0.0) == 200  # one token comes back every 1/5 s
    assert limiter.acquire("a", 0.1) == 100
    assert limiter.acquire("a", 0.2) == 0
    assert limiter.acquire("a", 0.2) == 200
    # other identities have their own bucket
    assert limiter.acquire("b", 0.2) == 0
    # a long idle period refills to the burst, not beyond
    assert [limiter.acquire("a", 100.0) for _ in range(11)][-2:] == [0, 200]


def test_the_injected_clock_is_used() -> None:
    now = [0.0]
    limiter = RateLimiter(1, clock=lambda: now[0])
    assert limiter.acquire("a") == 0 and limiter.acquire("a") == 0
    assert limiter.acquire("a") == 1000
    now[0] = 1.0
    assert limiter.acquire("a") == 0


def test_a_clock_stepping_back_neither_adds_nor_fails() -> None:
    bucket = TokenBucket(1, 2, now=10.0)
    assert bucket.take(10.0) == 0 and bucket.take(10.0) == 0
    assert bucket.take(5.0) == pytest.approx(1.0)
    assert bucket.take(11.0) == 0


def test_forget_and_bounded_keys() -> None:
    limiter = RateLimiter(1, max_keys=3)
    limiter.acquire("a", 0.0)
    limiter.acquire("a", 0.0)
    assert limiter.acquire("a", 0.0) > 0
    limiter.forget("a")
    assert limiter.acquire("a", 0.0) == 0
    for key in "bcdef":
        limiter.acquire(key, 0.0)
    assert len(limiter._buckets) <= 3


@pytest.mark.parametrize("rps", [0, -1, float("inf"), float("nan")])
def test_bad_rates_are_refused(rps: float) -> None:
    with pytest.raises(ValueError, match="--rate-limit-rps must be a positive number"):
        RateLimiter(rps)


def test_the_11th_failure_in_a_minute_is_refused_unchecked_until_the_window_moves() -> None:
    limiter = AuthFailureLimiter()
    for i in range(10):
        assert limiter.refused("10.0.0.7", float(i)) == 0
        limiter.failed("10.0.0.7", float(i))
    assert limiter.refused("10.0.0.7", 10.0) == 50_000  # until the failure at t=0 is a minute old
    assert limiter.refused("10.0.0.8", 10.0) == 0  # another address is untouched
    assert limiter.refused("10.0.0.7", 59.5) == 500
    assert limiter.refused("10.0.0.7", 60.0) == 0
    assert limiter.failures("10.0.0.7", 60.0) == 9
    limiter.failed("10.0.0.7", 60.0)
    assert limiter.refused("10.0.0.7", 60.5) == 500  # the failure at t=1 leaves at 61


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1", None, "", "/run/acp.sock"])
def test_local_peers_are_never_counted(address: str | None) -> None:
    limiter = AuthFailureLimiter()
    for _ in range(50):
        limiter.failed(address, 0.0)
    assert limiter.refused(address, 0.0) == 0
    assert is_local_address(address)


def test_remote_addresses_are_not_local() -> None:
    assert not is_local_address("10.0.0.1") and not is_local_address("2001:db8::1")
    assert not is_local_address("::ffff:10.0.0.1")


def test_tracked_addresses_are_bounded() -> None:
    limiter = AuthFailureLimiter(max_addresses=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(limiter._failures) == 100
    assert limiter.failures("10.0.3.231", 0.0) == 1  # the most recent are kept
