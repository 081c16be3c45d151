"""Our own ``_meta`` keys on requests, read and checked in one place.

Our keys are consumed here and never forwarded to an agent; every other ``_meta`` key passes through.
"""

from __future__ import annotations

from typing import Any

from ..admission.policy import PRIORITIES
from ..errors import InvalidParamsError
from ..logtext import clip

__all__ = [
    "MAX_DEADLINE_MS",
    "MAX_META_STR",
    "OUR_META_KEYS",
    "meta_client_id",
    "meta_bool",
    "meta_deadline_ms",
    "meta_priority",
    "meta_str",
    "meta_tenant",
    "passthrough_meta",
]

#: ``_meta`` keys acp-server reads itself (those of later issues included).
OUR_META_KEYS = frozenset(
    {"clientId", "deadlineMs", "backend", "tenantId", "priority", "idempotencyKey", "afterEventId", "turnStates"}
)


#: The longest string accepted in one of our ``_meta`` keys (client ids, idempotency keys, backend names).
MAX_META_STR = 256
#: The longest ``_meta.deadlineMs`` accepted: 2^31 - 1 ms, about 24.8 days.
MAX_DEADLINE_MS = 2**31 - 1


def meta_str(meta: dict[str, Any] | None, key: str) -> str | None:
    """``_meta.<key>``: a non-empty string of at most :data:`MAX_META_STR` characters, or absent."""
    if not meta:
        return None
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_META_STR:
        raise InvalidParamsError(
            path=f"_meta.{key}",
            detail=f"must be a non-empty string of at most {MAX_META_STR} characters; got {clip(repr(value))}",
        )
    return value


def meta_client_id(meta: dict[str, Any] | None) -> str | None:
    """``_meta.clientId``: a non-empty string, or absent."""
    return meta_str(meta, "clientId")


def meta_deadline_ms(meta: dict[str, Any] | None) -> int | None:
    """``_meta.deadlineMs``: a positive integer number of milliseconds, or absent."""
    if not meta:
        return None
    value = meta.get("deadlineMs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DEADLINE_MS:
        raise InvalidParamsError(
            path="_meta.deadlineMs",
            detail=f"must be a positive integer of milliseconds, at most {MAX_DEADLINE_MS}; got {clip(repr(value))}",
        )
    return value


def meta_priority(meta: dict[str, Any] | None) -> str:
    """``_meta.priority``: one of the priority classes (default ``interactive``)."""
    value = meta.get("priority") if meta else None
    if value is None:
        return "interactive"
    if value not in PRIORITIES:
        raise InvalidParamsError(
            path="_meta.priority", detail=f"must be one of {', '.join(PRIORITIES)}; got {clip(repr(value))}"
        )
    return str(value)


#: The longest tenant id accepted (it is logged and, with ``--metrics-tenant-labels``, a label value).
MAX_TENANT_ID = 128


def meta_tenant(meta: dict[str, Any] | None) -> str:
    """``_meta.tenantId`` at ``initialize``: a non-empty string of printable characters (default ``default``)."""
    value = meta_str(meta, "tenantId")
    if value is None:
        return "default"
    if len(value) > MAX_TENANT_ID or not value.isprintable():
        raise InvalidParamsError(
            path="_meta.tenantId",
            detail=f"must be at most {MAX_TENANT_ID} printable characters; got {value[:MAX_TENANT_ID + 1]!r}",
        )
    return value


def meta_bool(meta: dict[str, Any] | None, key: str, default: bool) -> bool:
    """``_meta.<key>``: ``true`` or ``false`` (absent: ``default``)."""
    value = meta.get(key) if meta else None
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParamsError(path=f"_meta.{key}", detail=f"must be true or false; got {clip(repr(value))}")
    return value


def passthrough_meta(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """``_meta`` without our own keys (what an agent may see), or ``None`` when nothing is left."""
    if not meta:
        return None
    rest = {k: v for k, v in meta.items() if k not in OUR_META_KEYS}
    return rest or None
