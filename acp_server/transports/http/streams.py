"""The two outbound pumps of ``/acp``: an SSE response body and a WebSocket, each serving one queue.

Both follow one rule of hypercorn's trio worker: once the client has left, ``send()`` is silently
dropped and only ``receive()`` learns of it (``http.disconnect``, ``websocket.disconnect``). So each
pump runs beside a watcher task that waits on ``receive()`` and ends the pump when the client goes;
a pump never relies on a failing ``send()``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .peer import MessagePeer, OutQueue
from .rules import sse_frame

__all__ = ["SSE_HEADERS", "SSE_KEEPALIVE_S", "pump_sse", "pump_websocket"]

log = logging.getLogger("acp_server.http")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

#: An idle SSE stream sends a comment this often, so that proxies keep it open (the SDK's interval).
SSE_KEEPALIVE_S = 15.0
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_KEEPALIVE = b": keepalive\n\n"


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, kind: str) -> None:
    """Cancel ``scope`` when the client leaves (the only place hypercorn reports it)."""
    while True:
        message = await receive()
        if message["type"] == kind:
            scope.cancel()
            return


async def pump_sse(
    peer: MessagePeer,
    queue: OutQueue,
    send: Send,
    receive: Receive,
    headers: list[tuple[bytes, bytes]],
    *,
    keepalive_s: float = SSE_KEEPALIVE_S,
) -> None:
    """Answer a GET with an event stream of ``queue``'s messages until the connection ends, the
    client leaves, or a newer GET for the same stream replaces this one."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
    finished = False
    with peer.reading(queue) as reader:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, "http.disconnect")
            with reader:
                while True:
                    with trio.move_on_after(keepalive_s) as idle:
                        lines = await queue.take()
                    if idle.cancelled_caught:
                        await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                        continue
                    if lines is None:
                        finished = True
                        break
                    await send({"type": "http.response.body", "body": sse_frame(lines), "more_body": True})
                    queue.sent(lines)
            nursery.cancel_scope.cancel()
    if finished or reader.cancelled_caught:
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def pump_websocket(
    peer: MessagePeer,
    send: Send,
    receive: Receive,
    shell_done: trio.Event,
    max_message_bytes: int,
    send_texts_nowait: Callable[[list[bytes]], bool] | None = None,
) -> None:
    """Carry one JSON-RPC message per text frame both ways until either side ends.

    Text frames go to :meth:`MessagePeer.feed`; binary frames are ignored. When the client leaves,
    the peer's input ends (the shell closes as after a socket's end); when the shell is done, what is
    queued is sent and the socket is closed. ``send_texts_nowait`` (the server's frame writer, where
    it offers one: :data:`~.lean_ws.FRAMES_EXTENSION`) sends what the queue holds in one write; where
    it cannot (past the write bound, closing), each message goes as a ``websocket.send``.
    """
    queue = peer.connection
    with peer.reading(queue):
        async with trio.open_nursery() as nursery:

            async def inbound() -> None:
                while True:
                    message = await receive()
                    kind = message["type"]
                    if kind == "websocket.receive":
                        text = message.get("text")
                        if text is not None:
                            await peer.feed_when_room(text.encode(), max_message_bytes)
                    elif kind == "websocket.disconnect":
                        peer.end_input()
                        return

            nursery.start_soon(inbound)
            while True:
                lines = await queue.take()
                if lines is None:
                    break
                if send_texts_nowait is None or not send_texts_nowait(lines):
                    queue.handing = True  # (the shell's writes queue behind these meanwhile)
                    try:
                        for line in lines:
                            await send({"type": "websocket.send", "text": line.decode()})
                    finally:
                        queue.handing = False
                queue.sent(lines)
            await shell_done.wait()
            await send({"type": "websocket.close", "code": 1000})
            nursery.cancel_scope.cancel()
