"""Answers to the server's own requests (an agent asking for a permission or a file mid-turn).

Safe by default: a permission is answered ``cancelled`` (nothing is allowed unasked), file access is
not advertised at ``initialize`` and refused if asked anyway; terminals and anything else are refused
as unknown methods. A hook answers by returning the result object; raising an
:class:`acp_server.errors.AcpError` (e.g. ``InvalidParamsError(path=..., detail=...)``) answers that
error, any other exception answers ``internal``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["CANCELLED_PERMISSION", "Hooks", "RequestHook"]

#: A hook: the request's params in, the result object out.
RequestHook = Callable[[dict[str, Any]], Awaitable[Any]]

#: The answer to ``session/request_permission`` when no hook is given.
CANCELLED_PERMISSION: Final = {"outcome": {"outcome": "cancelled"}}


@dataclass(frozen=True)
class Hooks:
    """The client's handlers for requests the server sends it.

    Attributes:
        request_permission: ``session/request_permission``; ``None`` answers ``cancelled``.
        read_text_file: ``fs/read_text_file``; ``None``: not advertised, refused.
        write_text_file: ``fs/write_text_file``; ``None``: not advertised, refused.
        on_notification: called (synchronously, in the reader) with the method and params of every
            notification other than ``session/update``.
    """

    request_permission: RequestHook | None = None
    read_text_file: RequestHook | None = None
    write_text_file: RequestHook | None = None
    on_notification: Callable[[str, Any], None] | None = None

    def capabilities(self) -> dict[str, Any]:
        """``clientCapabilities`` for ``initialize``: file access only where a hook is given."""
        return {
            "fs": {"readTextFile": self.read_text_file is not None, "writeTextFile": self.write_text_file is not None},
            "terminal": False,
        }

    def for_method(self, method: str) -> RequestHook | None:
        """The hook answering ``method``, or ``None`` when the client refuses it."""
        if method == "session/request_permission":
            return self.request_permission or _cancelled_permission
        if method == "fs/read_text_file":
            return self.read_text_file
        if method == "fs/write_text_file":
            return self.write_text_file
        return None


async def _cancelled_permission(params: dict[str, Any]) -> Any:
    return CANCELLED_PERMISSION
