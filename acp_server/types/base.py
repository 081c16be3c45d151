"""The base of every wire type: camelCase names, defaults omitted, keyword-only construction."""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["Meta", "Wire", "meta_field", "validation_location"]

Meta = dict[str, Any] | None


class Wire(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True):
    """Base for ACP and extension messages.

    Fields equal to their default are omitted on encode; on decode absent fields take the default,
    which is what lets terse clients (the official SDK omits defaults) be read leniently.
    """


def meta_field() -> Any:
    """The ``_meta`` field every ACP object may carry (``rename="camel"`` cannot produce the underscore)."""
    return msgspec.field(default=None, name="_meta")


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_NAMED_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<field>[^`]+)`$")


def validation_location(exc: msgspec.ValidationError) -> tuple[str, str]:
    """The dotted path (``[i]`` for items; ``""`` for the top level) and the detail of msgspec's message.

    A missing or unknown field is named at the end of the path (``prompt[0].type``, ``backends.x.foo``).
    """
    text = str(exc)
    m = _AT.match(text)
    detail = m.group("detail") if m else text
    path = (m.group("path") or "").removeprefix(".") if m else ""
    named = _NAMED_FIELD.match(detail)
    if named:
        path = f"{path}.{named.group('field')}" if path else named.group("field")
    return path, detail
