"""``acp-server connect URL``: relay this process's stdin/stdout to a running server, byte for byte.

Over ``http://.../acp`` and ``ws://.../acp`` (ACP's remote transport) the bytes are NDJSON lines,
each carried as one message (:mod:`acp_server.client.remote`).

An editor that can only spawn its agent as a command gets a share of one long-lived server: the
command it spawns is this relay. Nothing is parsed: bytes go through as they come, with one exception:
given a token (``--token`` or ``ACP_SERVER_TOKEN``), the relay sends its own ``authenticate``
(``acp-server-token``, request id :data:`AUTH_REQUEST_ID`) right after the client's ``initialize``
line and keeps the answer to itself (a refusal is printed to stderr), so a client that knows nothing of
tokens works unchanged; only then is the stream no longer byte for byte.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any
from urllib.parse import urlsplit

import trio

from ..auth.tls import open_tls_stream

__all__ = ["AUTH_REQUEST_ID", "open_url", "relay_stdio"]

_CHUNK = 65536
#: after stdin ends on a TLS connection (no half-close: the server cannot see the end), how long to
#: wait for its last answers; over TCP and Unix sockets the server closes its side once it has answered
DRAIN_TIMEOUT_S = 10.0
#: the id of the relay's own ``authenticate`` (a string no client counter produces)
AUTH_REQUEST_ID = "acp-server-connect-authenticate"


async def open_url(url: str, ca_file: str | None = None) -> trio.abc.HalfCloseableStream:
    """A stream to ``tcp://HOST:PORT``, ``tls://HOST:PORT`` (verified with ``ca_file`` or the system
    trust store) or ``unix:/path``.

    Raises:
        ValueError: the URL is of neither form.
        OSError: nothing listens there.
    """
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        return await trio.open_unix_socket(path[2:] if path.startswith("//") else path)
    if url.startswith(("tcp://", "tls://")):
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url!r} is not {parts.scheme}://HOST:PORT")
        if parts.scheme == "tls":
            return _TlsRelayStream(await open_tls_stream(parts.hostname, parts.port, ca_file))
        return await trio.open_tcp_stream(parts.hostname, parts.port)
    raise ValueError(f"{url!r}: unknown scheme; accepted: tcp://HOST:PORT, tls://HOST:PORT or unix:/path")


class _TlsRelayStream(trio.abc.HalfCloseableStream):
    """A TLS stream whose ``send_eof`` is a no-op: TLS has no half-close, and the server ends the
    connection itself once it has answered (the relay's drain timeout bounds the wait)."""

    def __init__(self, inner: trio.SSLStream[trio.SocketStream]) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _authenticate_line(token: str) -> bytes:
    request = {
        "jsonrpc": "2.0",
        "id": AUTH_REQUEST_ID,
        "method": "authenticate",
        "params": {"methodId": "acp-server-token", "_meta": {"token": token}},
    }
    return json.dumps(request).encode() + b"\n"


def _is_initialize(line: bytes) -> bool:
    try:
        message: Any = json.loads(line)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("method") == "initialize"


def _our_answer(line: bytes) -> dict[str, Any] | None:
    if AUTH_REQUEST_ID.encode() not in line:
        return None
    try:
        message: Any = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("id") == AUTH_REQUEST_ID else None


async def relay_stdio(url: str, token: str | None = None, ca_file: str | None = None) -> None:
    """Relay stdin to the server and the server to stdout until the server closes the connection.

    When stdin ends, the write side is shut down and the server's last answers still reach stdout.
    With ``token``, the relay authenticates after the client's ``initialize`` (see the module).
    """
    if url.startswith(("http://", "ws://")):
        from ..client.remote import open_remote_stream

        async with open_remote_stream(url, token=token) as remote:  # the bearer header on every request
            await _relay(remote, token)
        return
    await _relay(await open_url(url, ca_file), token)


async def _relay(sock: trio.abc.HalfCloseableStream | trio.abc.Stream, token: str | None) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(os.dup(1))
    async with sock, stdin, stdout, trio.open_nursery() as nursery:

        async def upstream() -> None:
            pending = b""
            injecting = token is not None
            while data := await stdin.receive_some(_CHUNK):
                if injecting:
                    assert token is not None
                    pending += data
                    head = b""
                    while b"\n" in pending and injecting:
                        line, pending = pending.split(b"\n", 1)
                        head += line + b"\n"
                        if _is_initialize(line):
                            head += _authenticate_line(token)
                            injecting = False
                    data, pending = (head + pending, b"") if not injecting else (head, pending)
                    if not data:
                        continue
                await sock.send_all(data)
            if pending:
                await sock.send_all(pending)
            try:
                await sock.send_eof()  # type: ignore[union-attr]  # each stream here has one
            except trio.BrokenResourceError:
                pass
            if isinstance(sock, _TlsRelayStream):
                nursery.cancel_scope.deadline = trio.current_time() + DRAIN_TIMEOUT_S

        async def downstream() -> None:
            waiting = token is not None  # for the answer to our authenticate, kept from the client
            buffered = b""
            try:
                while data := await sock.receive_some(_CHUNK):
                    if waiting:
                        buffered += data
                        out = b""
                        while b"\n" in buffered and waiting:
                            line, buffered = buffered.split(b"\n", 1)
                            answer = _our_answer(line)
                            if answer is None:
                                out += line + b"\n"
                                continue
                            waiting = False
                            if "error" in answer:
                                message = answer["error"].get("message") if isinstance(answer["error"], dict) else None
                                print(f"acp-server connect: the token was refused: {message}", file=sys.stderr, flush=True)
                        data, buffered = (out + buffered, b"") if not waiting else (out, buffered)
                        if not data:
                            continue
                    await stdout.send_all(data)
            except trio.BrokenResourceError:
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(upstream)
        nursery.start_soon(downstream)
