"""Where a listener listens: one small value type shared by the CLI, the server and the metrics endpoint.

It imports nothing but :mod:`dataclasses`, so the command line parses ``--listen`` without loading trio.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ListenAddress"]


@dataclass(frozen=True)
class ListenAddress:
    """Where to listen: ``kind`` is ``"tcp"`` or ``"tls"`` (host, port) or ``"unix"`` (path)."""

    kind: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}://{host}:{self.port}"
