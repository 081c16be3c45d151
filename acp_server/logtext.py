"""Untrusted text as it may appear in a log line: cut to a bounded length.

A peer chooses its method names, ids, client ids and error texts; a log line quoting one whole would let
a single request write megabytes to the log, once per line that names it. Every log call that quotes
peer-chosen text passes it through :func:`clip`.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["LOG_TEXT_CHARS", "clip"]

#: the most characters of one untrusted value a log line quotes
LOG_TEXT_CHARS: Final = 200


def clip(value: Any, limit: int = LOG_TEXT_CHARS) -> str:
    """``value`` as text (``str`` of it; ``repr`` of anything but a string), at most ``limit`` characters
    followed by how many more there were: ``'abc…(+999997 chars)'``."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…(+{len(text) - limit} chars)"
