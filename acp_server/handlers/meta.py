"""Our own ``_meta`` keys on requests, read and checked in one place."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParamsError

__all__ = ["meta_client_id", "meta_deadline_ms"]


def meta_client_id(meta: dict[str, Any] | None) -> str | None:
    """``_meta.clientId``: a non-empty string, or absent."""
    if not meta:
        return None
    value = meta.get("clientId")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidParamsError(path="_meta.clientId", detail=f"must be a non-empty string; got {value!r}")
    return value


def meta_deadline_ms(meta: dict[str, Any] | None) -> int | None:
    """``_meta.deadlineMs``: a positive integer number of milliseconds, or absent."""
    if not meta:
        return None
    value = meta.get("deadlineMs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidParamsError(path="_meta.deadlineMs", detail=f"must be a positive integer (milliseconds); got {value!r}")
    return value
