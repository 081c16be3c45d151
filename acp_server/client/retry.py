"""Retrying a call the server refused for capacity, within the caller's deadline.

Only errors the server's registry marks retryable are sent again (``prompt_queue_full``,
``capacity_exceeded``, ...), and only when they do not say ``safeToRetry: false``. The wait is the
server's ``retryAfterMs`` when it gives one, else exponential backoff with full jitter. No wait ever
crosses the deadline: when it would, the last error is raised at once. Every attempt of one logical
call shares one idempotency key.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from .errors import ClientError, RpcError, is_retryable

__all__ = ["Attempt", "RetryPolicy", "new_idempotency_key", "retrying"]

T = TypeVar("T")


def new_idempotency_key() -> str:
    """A fresh key for one logical call (the same on each of its attempts)."""
    return f"idem_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class RetryPolicy:
    """How :func:`retrying` spaces and bounds attempts.

    Attributes:
        max_attempts: attempts in all, the first included (1: no retry).
        base_delay_s: the backoff's first ceiling; it doubles per attempt (full jitter: a uniform wait
            between 0 and the ceiling), used when the error gives no ``retryAfterMs``.
        max_delay_s: the backoff ceiling's cap (``retryAfterMs`` is honoured as given).
        rng: the source of jitter (a seeded ``random.Random`` makes waits reproducible).
    """

    max_attempts: int = 3
    base_delay_s: float = 0.25
    max_delay_s: float = 10.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be a positive integer (1: no retry); got {self.max_attempts!r}")
        for name in ("base_delay_s", "max_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} must be a non-negative number of seconds; got {value!r}")

    def delay_after(self, error: ClientError, attempt: int) -> float:
        """Seconds to wait after ``attempt`` (1-based) failed with ``error``."""
        if isinstance(error, RpcError) and error.retry_after_ms is not None:
            return error.retry_after_ms / 1000
        ceiling = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return self.rng.uniform(0, ceiling)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a logical call, as the attempt function sees it.

    Attributes:
        number: 1 for the first attempt.
        idempotency_key: the same on every attempt of the call.
        deadline: the call's deadline in trio time (``inf``: none).
    """

    number: int
    idempotency_key: str
    deadline: float = math.inf

    def remaining_ms(self) -> int | None:
        """The budget left, in whole milliseconds rounded up (at least 1), or ``None`` without a deadline."""
        if math.isinf(self.deadline):
            return None
        return max(1, math.ceil((self.deadline - trio.current_time()) * 1000))


async def retrying(
    attempt: Callable[[Attempt], Awaitable[T]],
    policy: RetryPolicy | None = None,
    *,
    deadline: float = math.inf,
    idempotency_key: str | None = None,
    sleep: Callable[[float], Awaitable[None]] = trio.sleep,
    on_retry: Callable[[ClientError, int, float], None] | None = None,
) -> T:
    """Run ``attempt`` until it succeeds, fails for good, runs out of attempts or of time.

    Args:
        attempt: makes one attempt; raises a :class:`~acp_server.client.ClientError` to fail it.
        policy: the bounds and backoff (default :class:`RetryPolicy()`: 3 attempts).
        deadline: the call's deadline in trio time; the caller's effective deadline (an enclosing
            ``trio.move_on_after``/``fail_after``) counts too, whichever is earlier.
        idempotency_key: the key every attempt carries (default: a fresh one).
        sleep: how to wait between attempts (a caller may make the wait interruptible).
        on_retry: ``on_retry(error, next_attempt, wait_s)`` before each wait (to tell a person).

    Returns:
        The first successful attempt's result.

    Raises:
        ClientError: the last attempt's error, when it is not retryable, when no attempt is left, or
            when the wait before the next one would cross the deadline.
    """
    policy = policy or RetryPolicy()
    key = idempotency_key or new_idempotency_key()
    number = 1
    while True:
        effective = min(deadline, trio.current_effective_deadline())
        try:
            return await attempt(Attempt(number, key, effective))
        except ClientError as exc:
            if number >= policy.max_attempts or not is_retryable(exc):
                raise
            wait = policy.delay_after(exc, number)
            effective = min(deadline, trio.current_effective_deadline())
            if trio.current_time() + wait >= effective:
                raise  # waiting would use up the budget: give up now, with the last error
            if on_retry is not None:
                on_retry(exc, number + 1, wait)
        await sleep(wait)
        number += 1
