"""Scenario ``openai``: acp-server's ``openai`` backend against the scripted model server answering at once.

The scripted server (``tests/openai_server.py``) runs in this process under trio, acp-server in its
own (``--agent bench=openai:URL#scripted``), and a minimal NDJSON client here measures:

- server CPU per prompt and per streamed token: sequential prompts, each streaming ``tokens`` content
  deltas, then as many streaming a tenth of that; the server's CPU from ``/proc``. Per token is the
  difference between the two runs per delta (the marginal cost), per prompt the long run's average;
- the added latency to the first ``agent_message_chunk``: from the model server sending its first
  byte (a content delta) to this client reading the chunk (same process, same clock). The model
  pauses 20 ms after that byte, so that sending the rest (in this same process) does not delay the
  client's read and count as the server's latency;
- the time from ``session/cancel`` to the model server seeing its stream closed (the stream is held
  open after a few deltas until the client goes).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from procfs import cpu_seconds, percentile
from servers import TcpServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.openai_server import ScriptedModel, Step, serve_model  # noqa: E402

__all__ = ["OpenAISizes", "run_openai"]


@dataclass(frozen=True)
class OpenAISizes:
    prompts: int  # sequential prompts timed for CPU and first-chunk latency
    tokens: int  # content deltas per reply
    cancels: int  # prompts cancelled mid-stream
    latency_prompts: int  # prompts timed for the first chunk
    warmup: int


class _Client:
    """One NDJSON connection: requests by id, and the arrival time of each prompt's first chunk."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.next_id = 0
        self.waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.first_chunk_at: float | None = None
        self.chunks = 0
        self.got_chunk = trio.Event()

    async def pump(self) -> None:
        buf = b""
        while data := await self._receive():
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line:
                    continue
                now = trio.current_time()
                msg = json.loads(line)
                if msg.get("method") == "session/update":
                    if msg["params"]["update"]["sessionUpdate"] == "agent_message_chunk":
                        self.chunks += 1
                        if self.first_chunk_at is None:
                            self.first_chunk_at = now
                            self.got_chunk.set()
                elif "id" in msg and msg["id"] in self.waiting:
                    self.waiting.pop(msg["id"]).send_nowait(msg)

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(1 << 16)
        except trio.BrokenResourceError:
            return b""

    async def call(self, method: str, params: Any) -> dict[str, Any]:
        self.next_id += 1
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.waiting[self.next_id] = send
        line = json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        await self.stream.send_all(line.encode() + b"\n")
        reply = await receive.receive()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]  # type: ignore[no-any-return]

    async def notify(self, method: str, params: Any) -> None:
        await self.stream.send_all(json.dumps({"jsonrpc": "2.0", "method": method, "params": params}).encode() + b"\n")

    def reset(self) -> None:
        self.first_chunk_at = None
        self.chunks = 0
        self.got_chunk = trio.Event()


async def _run(sizes: OpenAISizes, out: dict[str, Any]) -> None:
    short = max(1, sizes.tokens // 10)
    reply = {"tokens": sizes.tokens}

    class Model(ScriptedModel):
        def default(self) -> Step:
            n = reply["tokens"]
            return Step(text=[f"w{i} " for i in range(n)], role_chunk=False, usage=(n, n))

    words = [f"w{i} " for i in range(sizes.tokens)]
    model = Model()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_model, model)
        args = ["--agent", f"bench=openai:{url}#scripted", "--default-backend", "bench"]
        server = TcpServer(args)
        await trio.to_thread.run_sync(server.__enter__)
        try:
            out["command"] = server.command
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            client = _Client(stream)
            nursery.start_soon(client.pump)
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
            sid = (await client.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["sessionId"]
            prompt = {"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}
            # A fresh session per prompt would grow nothing; one session grows its conversation, so the
            # measured prompts run on a second session reset for each (session/new is not timed).
            for _ in range(sizes.warmup):
                await client.call("session/prompt", prompt)
            cpu = {}
            for n in (sizes.tokens, short):
                reply["tokens"] = n
                spent = 0.0
                chunks = 0
                for _ in range(sizes.prompts):
                    sid = (await client.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["sessionId"]
                    client.reset()
                    before = cpu_seconds(server.pid)
                    await client.call("session/prompt", {**prompt, "sessionId": sid})
                    spent += cpu_seconds(server.pid) - before
                    chunks += client.chunks
                assert chunks == n * sizes.prompts, (chunks, n)
                cpu[n] = spent / sizes.prompts
            out["prompts"] = sizes.prompts
            out["cpu_per_prompt_us"] = cpu[sizes.tokens] * 1e6
            out["cpu_per_short_prompt_us"] = cpu[short] * 1e6
            out["cpu_per_token_us"] = (cpu[sizes.tokens] - cpu[short]) / (sizes.tokens - short) * 1e6
            added: list[float] = []
            for _ in range(sizes.latency_prompts):
                model.push(Step(text=words[:3], role_chunk=False, trickle_s=0.02))
                sid = (await client.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["sessionId"]
                client.reset()
                index = len(model.requests)
                await client.call("session/prompt", {**prompt, "sessionId": sid})
                assert client.first_chunk_at is not None
                added.append(client.first_chunk_at - model.first_byte_at[index])
            out["first_chunk_added_ms_p50"] = statistics.median(added) * 1e3
            out["first_chunk_added_ms_p99"] = (percentile(added, 0.99) or 0) * 1e3
            cancel: list[float] = []
            for _ in range(sizes.cancels):
                model.push(Step(text=words, role_chunk=False, hold_after=3))
                sid = (await client.call("session/new", {"cwd": "/tmp", "mcpServers": []}))["sessionId"]
                client.reset()
                index = len(model.requests)
                async with trio.open_nursery() as inner:
                    inner.start_soon(client.call, "session/prompt", {**prompt, "sessionId": sid})
                    await client.got_chunk.wait()
                    sent = trio.current_time()
                    await client.notify("session/cancel", {"sessionId": sid})
                    while index not in model.closed_at:
                        await model.closed.wait()
                cancel.append(model.closed_at[index] - sent)
            out["cancels"] = sizes.cancels
            out["cancel_to_close_ms_p50"] = statistics.median(cancel) * 1e3
            out["cancel_to_close_ms_max"] = max(cancel) * 1e3
        finally:
            await trio.to_thread.run_sync(server.__exit__, None, None, None)
            nursery.cancel_scope.cancel()


def run_openai(sizes: OpenAISizes) -> dict[str, Any]:
    """Run the scenario; returns its raw figures (see the module docstring)."""
    out: dict[str, Any] = {"tokens_per_reply": sizes.tokens, "tokens_per_short_reply": max(1, sizes.tokens // 10)}
    trio.run(_run, sizes, out)
    return out
