"""Byte streams and listeners (stdio, TCP, Unix) and the per-connection shell. No ACP method here."""

from .listeners import (
    ConnectionGate,
    PipeStream,
    isolated,
    listener_url,
    open_unix_listener,
    serve_tcp,
    serve_unix,
    stdio_stream,
)
from .shell import ConnectionShell

__all__ = [
    "ConnectionGate",
    "ConnectionShell",
    "PipeStream",
    "isolated",
    "listener_url",
    "open_unix_listener",
    "serve_tcp",
    "serve_unix",
    "stdio_stream",
]
