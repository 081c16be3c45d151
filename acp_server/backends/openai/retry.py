"""The retry policy of model calls, as pure functions: what failed, whether to try again, how long to wait.

The I/O loop (:mod:`.backend`) describes each failed HTTP attempt as a :class:`Failure` and asks
:func:`next_delay`; it obeys the answer and decides nothing itself. The rules:

- **What is retried** (:func:`retryable`): a connection that could not be made or broke before the
  first delta reached the client (no HTTP answer, or a stream cut before any output), and the statuses
  408, 409, 429, 500, 502, 503 and 504. Never anything after output was sent to the client: the
  client has seen part of an answer, and a second answer would be a different one.
- **How long to wait** (:func:`retry_delay`): the server's own hint when it gives one
  (``retry-after-ms`` in milliseconds, else ``Retry-After`` in seconds or as an HTTP date), plus up to
  10% jitter so that clients told the same instant do not return at once; otherwise exponential
  backoff from :data:`BACKOFF_FIRST_S` doubling per attempt, capped at :data:`BACKOFF_MAX_S`, with
  full jitter (a uniform draw between 0 and that bound).
- **Whether to wait at all** (:func:`next_delay`): not after ``max_attempts`` attempts, and not when
  the retry would start at or after the prompt's deadline (``now + delay >= deadline``): such a retry
  could only be cut, so the prompt fails at once with what the last attempt said.
"""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "HINT_JITTER",
    "RETRY_STATUSES",
    "Failure",
    "next_delay",
    "parse_retry_after",
    "retry_delay",
    "retryable",
]

#: the HTTP statuses a later attempt may get past (timeout, conflict, rate limit, server trouble)
RETRY_STATUSES: Final = frozenset({408, 409, 429, 500, 502, 503, 504})
#: the first backoff bound; each further attempt doubles it
BACKOFF_FIRST_S: Final = 0.5
#: the largest backoff bound
BACKOFF_MAX_S: Final = 8.0
#: the most jitter added to a server's hint, as a fraction of it
HINT_JITTER: Final = 0.1


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt, as the policy needs to know it.

    Attributes:
        status: the HTTP status, ``None`` when there was no HTTP answer (connect error, timeout).
        headers: the answer's headers (lower-case names), empty without an answer.
        output_sent: some of this attempt's output already reached the client.
    """

    status: int | None = None
    headers: Mapping[str, str] | None = None
    output_sent: bool = False


def retryable(failure: Failure) -> bool:
    """Whether another attempt may succeed where ``failure`` did not (and may be made at all)."""
    if failure.output_sent:
        return False
    return failure.status is None or failure.status in RETRY_STATUSES


def parse_retry_after(headers: Mapping[str, str], now_wall: float) -> float | None:
    """The wait the server asked for, in seconds, or ``None`` when it gave no usable hint.

    ``retry-after-ms`` (a number of milliseconds) wins over ``Retry-After``, which is a number of
    seconds or an HTTP date (a date in the past means "now": 0). Negative or unparsable values are
    no hint.

    Args:
        headers: the response headers, with lower-case names.
        now_wall: the current wall-clock time (``time.time()``), for an HTTP date.
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return ms / 1000
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        parsed = email.utils.parsedate_tz(raw)
        if parsed is None:
            return None
        return max(0.0, email.utils.mktime_tz(parsed) - now_wall)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def retry_delay(
    attempt: int, failure: Failure, *, now_wall: float, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before the attempt after ``attempt`` (1-based) that ended in ``failure``.

    Args:
        attempt: the number of the attempt that failed (1 for the first).
        failure: what it ended with (its headers may carry the server's hint).
        now_wall: the current wall-clock time, for a ``Retry-After`` HTTP date.
        rand: a uniform draw in ``[0, 1)`` (tests pass a fixed one).
    """
    hint = parse_retry_after(failure.headers or {}, now_wall)
    if hint is not None:
        return float(hint * (1 + HINT_JITTER * rand()))
    bound = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1))
    return float(bound * rand())


def next_delay(
    attempt: int,
    failure: Failure,
    *,
    max_attempts: int,
    now: float,
    deadline: float | None,
    now_wall: float,
    rand: Callable[[], float] = random.random,
) -> float | None:
    """The wait before the next attempt, or ``None`` when there is to be no next attempt.

    Args:
        attempt: the number of the attempt that failed (1-based).
        failure: what it ended with.
        max_attempts: how many attempts a model call may make in all.
        now: the current time on the clock ``deadline`` is on (``trio.current_time()``).
        deadline: when the prompt's deadline passes on that clock (``None``: it has none).
        now_wall: the current wall-clock time, for a ``Retry-After`` HTTP date.
        rand: a uniform draw in ``[0, 1)``.
    """
    if attempt >= max_attempts or not retryable(failure):
        return None
    delay = retry_delay(attempt, failure, now_wall=now_wall, rand=rand)
    if deadline is not None and now + delay >= deadline:
        return None
    return delay
