"""The bounds the server enforces, as one frozen record with validated fields."""

from __future__ import annotations

import math
from typing import Any

import msgspec

__all__ = ["Limits", "check_non_negative_int", "check_positive_int"]


def check_non_negative_int(name: str, value: Any, *, zero: str = "0 disables the limit") -> int:
    """Return ``value`` when it is a non-negative integer, else raise naming ``name``.

    Raises:
        TypeError: ``value`` is not an integer (bools and floats included).
        ValueError: ``value`` is negative.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and not math.isnan(value) and value.is_integer():
            raise TypeError(f"{name} must be a non-negative integer ({zero}); got the float {value!r}")
        raise TypeError(f"{name} must be a non-negative integer ({zero}); got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer ({zero}); got {value}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` when it is an integer of at least 1, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value}")
    return value


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Every bound of one server instance. Zero means "no limit" where the field says so.

    Attributes:
        max_pending_prompts_per_session: queued + running prompts a session holds (0: unlimited).
        prompt_deadline_ms: default deadline of a prompt, counted from admission (0: none).
        client_idle_timeout_s: a client id with no request or heartbeat for this long is dropped.
        session_idle_timeout_s: an unattached, idle session with no clients is closed after this long.
        max_message_bytes: the longest line accepted from a peer.
        max_outbound_bytes: bytes queued to one connection before it is evicted (0: twice the above).
        max_inflight_requests: unanswered requests of one connection that run at once.
        idempotency_ttl_s: how long an admitted ``(sessionId, idempotencyKey)`` is remembered.
        max_idempotency_keys: the most keys remembered at once (the oldest expire first).
        max_sessions: live (in-memory) sessions at once; more get ``session_limit_exceeded`` (0: unlimited).
        max_history_events: the most recent events of a session kept in memory (for late joiners and
            replays); older ones are read from the store in pages, or are gone without a store.
    """

    max_pending_prompts_per_session: int = 5
    prompt_deadline_ms: int = 0
    client_idle_timeout_s: float = 300.0
    session_idle_timeout_s: float = 1800.0
    max_message_bytes: int = 50 * 1024 * 1024
    max_outbound_bytes: int = 0
    max_inflight_requests: int = 256
    idempotency_ttl_s: float = 600.0
    max_idempotency_keys: int = 100_000
    max_sessions: int = 1000
    max_history_events: int = 10_000

    def __post_init__(self) -> None:
        check_non_negative_int("max_pending_prompts_per_session", self.max_pending_prompts_per_session)
        check_non_negative_int("prompt_deadline_ms", self.prompt_deadline_ms, zero="0 means no deadline")
        check_positive_int("max_message_bytes", self.max_message_bytes)
        check_non_negative_int("max_outbound_bytes", self.max_outbound_bytes, zero="0 means twice max_message_bytes")
        check_positive_int("max_inflight_requests", self.max_inflight_requests)
        check_positive_int("max_idempotency_keys", self.max_idempotency_keys)
        check_non_negative_int("max_sessions", self.max_sessions)
        check_positive_int("max_history_events", self.max_history_events)
        for name in ("client_idle_timeout_s", "session_idle_timeout_s", "idempotency_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")

    @property
    def pending_limit(self) -> int | None:
        """The per-session pending-prompt limit, ``None`` when disabled."""
        return self.max_pending_prompts_per_session or None

    @property
    def outbound_bytes(self) -> int:
        return self.max_outbound_bytes or 2 * self.max_message_bytes
