"""``acp-server connect URL``: relay this process's stdin/stdout to a running server, byte for byte.

Over ``http://.../acp`` and ``ws://.../acp`` (ACP's remote transport) the bytes are NDJSON lines,
each carried as one message (:mod:`acp_server.client.remote`).

An editor that can only spawn its agent as a command gets a share of one long-lived server: the
command it spawns is this relay. Nothing is parsed: bytes go through as they come.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import trio

__all__ = ["open_url", "relay_stdio"]

_CHUNK = 65536
#: after stdin ends, how long to wait for the server to finish answering and close its side
DRAIN_TIMEOUT_S = 10.0


async def open_url(url: str) -> trio.SocketStream:
    """A stream to ``tcp://HOST:PORT`` or ``unix:/path``.

    Raises:
        ValueError: the URL is of neither form.
        OSError: nothing listens there.
    """
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        return await trio.open_unix_socket(path[2:] if path.startswith("//") else path)
    if url.startswith("tcp://"):
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url!r} is not tcp://HOST:PORT")
        return await trio.open_tcp_stream(parts.hostname, parts.port)
    raise ValueError(f"{url!r}: unknown scheme; accepted: tcp://HOST:PORT or unix:/path")


async def relay_stdio(url: str) -> None:
    """Relay stdin to the server and the server to stdout until the server closes the connection.

    When stdin ends, the write side is shut down and the server's last answers still reach stdout.
    """
    if url.startswith(("http://", "ws://")):
        from ..client.remote import open_remote_stream

        async with open_remote_stream(url) as remote:
            await _relay(remote)
        return
    await _relay(await open_url(url))


async def _relay(sock: trio.abc.HalfCloseableStream | trio.abc.Stream) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(os.dup(1))
    async with sock, stdin, stdout, trio.open_nursery() as nursery:

        async def upstream() -> None:
            while data := await stdin.receive_some(_CHUNK):
                await sock.send_all(data)
            try:
                await sock.send_eof()  # type: ignore[union-attr]  # each stream here has one
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.deadline = trio.current_time() + DRAIN_TIMEOUT_S

        async def downstream() -> None:
            try:
                while data := await sock.receive_some(_CHUNK):
                    await stdout.send_all(data)
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(upstream)
        nursery.start_soon(downstream)
