"""The retry policy of model calls as pure functions: which failures retry, the server's hints, the
backoff bounds, and no retry past the deadline (no network, no event loop)."""

from __future__ import annotations

import email.utils

from hypothesis import given
from hypothesis import strategies as st

from acp_server.backends.openai.retry import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    RETRY_STATUSES,
    Failure,
    next_delay,
    parse_retry_after,
    retry_delay,
    retryable,
)

NOW = 1_700_000_000.0


def test_which_failures_are_retried() -> None:
    assert retryable(Failure())  # no HTTP answer: connect error, timeout, a stream broken before output
    for status in (408, 409, 429, 500, 502, 503, 504):
        assert retryable(Failure(status))
    for status in (400, 401, 403, 404, 413, 422, 501, 505):
        assert not retryable(Failure(status))
    assert not retryable(Failure(None, output_sent=True))  # the client saw part of an answer
    assert not retryable(Failure(503, output_sent=True))
    assert RETRY_STATUSES == {408, 409, 429, 500, 502, 503, 504}


def test_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "1"}, NOW) == 1.0
    assert parse_retry_after({"retry-after": "2.5"}, NOW) == 2.5
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}, NOW) == 0.25  # ms wins
    assert parse_retry_after({"retry-after-ms": "junk", "retry-after": "9"}, NOW) == 9.0
    date = email.utils.formatdate(NOW + 30, usegmt=True)
    assert parse_retry_after({"retry-after": date}, NOW) == 30.0
    past = email.utils.formatdate(NOW - 30, usegmt=True)
    assert parse_retry_after({"retry-after": past}, NOW) == 0.0
    for junk in ("soon", "-1", "nan", "inf", ""):
        assert parse_retry_after({"retry-after": junk}, NOW) is None
    assert parse_retry_after({}, NOW) is None


def test_a_hint_is_waited_with_up_to_10_percent_jitter() -> None:
    failure = Failure(429, {"retry-after": "2"})
    assert retry_delay(1, failure, now_wall=NOW, rand=lambda: 0.0) == 2.0
    assert retry_delay(1, failure, now_wall=NOW, rand=lambda: 0.999) < 2.2


def test_backoff_doubles_from_half_a_second_to_eight_with_full_jitter() -> None:
    top = [retry_delay(n, Failure(500), now_wall=NOW, rand=lambda: 1.0) for n in range(1, 8)]
    assert top == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert retry_delay(3, Failure(500), now_wall=NOW, rand=lambda: 0.0) == 0.0


def test_no_retry_after_the_last_attempt_or_past_the_deadline() -> None:
    hinted = Failure(429, {"retry-after": "5"})
    common = {"now": 100.0, "now_wall": NOW, "rand": lambda: 0.0}
    assert next_delay(1, hinted, max_attempts=3, deadline=None, **common) == 5.0
    assert next_delay(3, hinted, max_attempts=3, deadline=None, **common) is None
    assert next_delay(1, hinted, max_attempts=3, deadline=104.0, **common) is None  # 100 + 5 >= 104
    assert next_delay(1, hinted, max_attempts=3, deadline=105.0, **common) is None  # equal: it would be cut
    assert next_delay(1, hinted, max_attempts=3, deadline=105.5, **common) == 5.0
    assert next_delay(1, Failure(400), max_attempts=3, deadline=None, **common) is None


@given(
    attempt=st.integers(1, 20),
    max_attempts=st.integers(1, 10),
    status=st.sampled_from([None, 400, 408, 429, 500, 501, 503]),
    hint=st.one_of(st.none(), st.floats(0, 120)),
    output_sent=st.booleans(),
    now=st.floats(0, 1e6),
    left=st.one_of(st.none(), st.floats(0, 60)),
    draw=st.floats(0, 1, exclude_max=True),
)
def test_next_delay_properties(
    attempt: int, max_attempts: int, status: int | None, hint: float | None, output_sent: bool,
    now: float, left: float | None, draw: float,
) -> None:
    headers = {"retry-after": repr(hint)} if hint is not None else {}
    failure = Failure(status, headers, output_sent)
    deadline = None if left is None else now + left
    delay = next_delay(
        attempt, failure, max_attempts=max_attempts, now=now, deadline=deadline, now_wall=NOW, rand=lambda: draw
    )
    if delay is None:
        return
    assert attempt < max_attempts and retryable(failure)
    assert deadline is None or now + delay < deadline
    if hint is not None:
        assert hint <= delay <= hint * 1.1
    else:
        assert 0 <= delay <= min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
