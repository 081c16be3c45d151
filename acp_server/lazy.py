"""Names a module re-exports but imports on first use (PEP 562), so that importing it costs nothing
its caller does not use (``acp-server --help`` loads no server).

A module keeps a map of each such name to the module that defines it (relative to its package) and
puts what :func:`lazy_exports` returns in its namespace as ``__getattr__`` and ``__dir__``; the first
use of a name imports its home and keeps the value in the module, so later uses are plain lookups.
Type checkers see the names through an ``if TYPE_CHECKING:`` import beside the map.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the module whose ``globals()`` is ``namespace``.

    Args:
        namespace: the module's ``globals()`` (its ``__name__``, ``__package__`` and ``__all__`` are
            read from it when a name is looked up).
        homes: each lazily exported name -> its defining module, relative to the module's package.
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, namespace["__package__"]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
