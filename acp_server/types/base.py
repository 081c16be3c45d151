"""The base of every wire type: camelCase names, defaults omitted, keyword-only construction."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["Meta", "Wire", "meta_field"]

Meta = dict[str, Any] | None


class Wire(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True):
    """Base for ACP and extension messages.

    Fields equal to their default are omitted on encode; on decode absent fields take the default,
    which is what lets terse clients (the official SDK omits defaults) be read leniently.
    """


def meta_field() -> Any:
    """The ``_meta`` field every ACP object may carry (``rename="camel"`` cannot produce the underscore)."""
    return msgspec.field(default=None, name="_meta")
