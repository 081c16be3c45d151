"""A scripted OpenAI-compatible chat-completions server for tests and the benchmark (ASGI, hypercorn's trio worker).

``POST /v1/chat/completions`` answers with the next :class:`Step` of :attr:`ScriptedModel.script`
(FIFO); with the script empty it streams the default reply: ``"you said: " + the last user text``,
word by word, then usage. A step can stream text, reasoning and tool calls whose JSON arguments are
split over several deltas; answer an HTTP error status with headers (a 429 with ``Retry-After``); stall
before the first byte; cut the connection in the middle of the stream; trickle its deltas slowly; or
hold the stream open until the client closes it. The model records every request (body and headers),
the requests in flight now and at most, and when each stream was closed by the client.

Run in-process with ``await nursery.start(serve_model, model)`` (returns the base URL), or as a
process: ``python tests/openai_server.py`` prints ``model on http://127.0.0.1:PORT/v1`` and serves
the default reply at once (the benchmark's "answering at once" server).
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class ToolCallSpec:
    """A tool call the model makes; ``arguments`` is sent in ``pieces`` deltas."""

    call_id: str
    name: str
    arguments: str
    pieces: int = 3


@dataclass
class Step:
    """One scripted answer.

    Attributes:
        status: the HTTP status; anything but 200 is answered with ``error_message`` as JSON.
        headers: extra response headers (``retry-after``, ``retry-after-ms``).
        text: content pieces, one delta each (``None``: the default reply's words).
        reasoning: reasoning pieces, sent before the content (as ``reasoning_content``).
        tool_calls: tool calls, sent after the content.
        finish_reason: the last choice's ``finish_reason`` (``None``: no finish chunk).
        usage: prompt and completion tokens on a final chunk (``None``: no usage chunk).
        stall_s: wait this long before the response starts.
        trickle_s: wait this long between deltas.
        cut_after: close the connection abruptly after this many deltas (``None``: never).
        hold_after: after this many chunks (or after the last), keep the stream open until the client
            closes it.
        done: send ``data: [DONE]`` at the end.
        role_chunk: open with a chunk that carries only the role (as OpenAI's server does); without it
            the first byte is the first content delta.
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error_message: str = "scripted failure"
    text: list[str] | None = None
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallSpec] = field(default_factory=list)
    finish_reason: str | None = "stop"
    usage: tuple[int, int] | None = (11, 7)
    stall_s: float = 0.0
    trickle_s: float = 0.0
    cut_after: int | None = None
    hold_after: int | None = None
    done: bool = True
    role_chunk: bool = True


class _Cut(Exception):
    """Raised inside the app to make hypercorn drop the connection mid-stream."""


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    return ""


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: Any = None) -> bytes:
    chunk: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "scripted"}
    chunk["choices"] = [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish}
    ]
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class ScriptedModel:
    """The app's state: the script, what was asked, what is in flight.

    Attributes:
        script: steps to answer with, oldest first.
        requests: each request's decoded body, in arrival order.
        headers: each request's headers (lower-case names), in arrival order.
        in_flight: requests being answered now; ``peak``: the most at once.
        started_at: when each request arrived (``trio.current_time()``).
        first_byte_at: when each response sent its first body byte.
        closed_at: when the client closed a stream that was still being sent (per request index).
    """

    def __init__(self) -> None:
        self.script: deque[Step] = deque()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.peak = 0
        self.started_at: list[float] = []
        self.first_byte_at: dict[int, float] = {}
        self.closed_at: dict[int, float] = {}
        self.done_at: set[int] = set()
        self.closed = trio.Event()
        self.arrived = trio.Event()

    def default(self) -> Step:
        """The step answered when the script is empty (the default reply; the benchmark sets its own)."""
        return Step()

    def push(self, *steps: Step) -> None:
        self.script.extend(steps)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                if kind == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif kind == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions" or scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        index = len(self.requests)
        self.requests.append(json.loads(raw))
        self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        self.started_at.append(trio.current_time())
        self.arrived.set()
        self.arrived = trio.Event()
        step = self.script.popleft() if self.script else self.default()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if index not in self.done_at:
                        self.closed_at[index] = trio.current_time()
                        self.closed.set()
                        self.closed = trio.Event()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await self._answer(index, step, send)
                self.done_at.add(index)
                nursery.cancel_scope.cancel()
        finally:
            self.in_flight -= 1

    async def _answer(self, index: int, step: Step, send: Send) -> None:
        if step.stall_s:
            await trio.sleep(step.stall_s)
        if step.status != 200:
            headers = [(b"content-type", b"application/json")]
            headers += [(k.encode(), v.encode()) for k, v in step.headers.items()]
            await send({"type": "http.response.start", "status": step.status, "headers": headers})
            body = json.dumps({"error": {"message": step.error_message, "type": "scripted"}}).encode()
            await send({"type": "http.response.body", "body": body})
            return
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunks: list[bytes] = [_chunk({"role": "assistant", "content": ""})] if step.role_chunk else []
        chunks += [_chunk({"reasoning_content": piece}) for piece in step.reasoning]
        text = step.text
        if text is None:
            reply = "you said: " + _last_user_text(self.requests[index])
            text = [w + " " for w in reply.split(" ")]
            text[-1] = text[-1].rstrip(" ")
        chunks += [_chunk({"content": piece}) for piece in text if piece]
        for i, call in enumerate(step.tool_calls):
            size = max(1, -(-len(call.arguments) // call.pieces))
            parts = [call.arguments[j : j + size] for j in range(0, len(call.arguments), size)] or [""]
            first = {"index": i, "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": parts[0]}}
            chunks.append(_chunk({"tool_calls": [first]}))
            chunks += [_chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}) for p in parts[1:]]
        if step.finish_reason is not None:
            chunks.append(_chunk(finish=step.finish_reason))
        if step.usage is not None:
            p, c = step.usage
            chunks.append(_chunk(usage={"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}))
        if step.done:
            chunks.append(b"data: [DONE]\n\n")
        for n, data in enumerate(chunks):
            if step.cut_after is not None and n >= step.cut_after:
                raise _Cut("scripted cut")
            if step.hold_after is not None and n >= step.hold_after:
                await trio.sleep_forever()
            if n and step.trickle_s:
                await trio.sleep(step.trickle_s)
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if n == 0:
                self.first_byte_at[index] = trio.current_time()
        if step.hold_after is not None:  # past the last chunk: the body never ends
            await trio.sleep_forever()
        await send({"type": "http.response.body", "body": b""})


async def serve_model(model: ScriptedModel, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``model`` on a free loopback port until cancelled; reports its base URL (``.../v1``)."""
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
    await sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    with sock:
        port = sock.getsockname()[1]
        config = Config()
        config.bind = [f"fd://{sock.dup().detach()}"]
        config.accesslog = None
        config.errorlog = None
        config.graceful_timeout = 0.2
        config.keep_alive_timeout = 60
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, model, config)
            task_status.started(f"http://127.0.0.1:{port}/v1")
            await trio.sleep_forever()


async def _main() -> None:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_model, ScriptedModel())
        print(f"model on {url}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    trio.run(_main)
