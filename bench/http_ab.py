"""Scenario ``http``: ACP's remote transport. The official SDK client drives echo prompts over

- our ``/acp`` with HTTP+SSE (``acp.http.create_http_stream``),
- our ``/acp`` with WebSocket (``acp.ws.create_websocket_stream``),
- our TCP NDJSON listener (the same server process, the baseline),
- the SDK's own remote server (``acp.http`` AcpServer via ``create_asgi_app`` under hypercorn,
  serving the SDK echo agent: ``bench/peers/sdk_http_server.py``) with the same HTTP client,

and the server process's CPU time (from ``/proc``) is read around each timed run of sequential
prompts on one session. Runs alternate between the four, round after round.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import acp
from acp.schema import AgentMessageChunk, TextContentBlock
from procfs import cpu_seconds
from servers import BENCH, BenchError, acp_server_argv, shell_command

__all__ = ["HttpSizes", "run_http"]

_START_TIMEOUT_S = 30.0
TARGETS = ("ours_sse", "ours_ws", "ours_tcp", "sdk_sse")


@dataclass(frozen=True)
class HttpSizes:
    rounds: int
    warmup: int
    prompts: int
    text: str


@dataclass
class Run:
    prompts: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    rounds: list[dict[str, float]] = field(default_factory=list)


class _Client:
    def __init__(self) -> None:
        self.text: list[str] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        if isinstance(update, AgentMessageChunk) and isinstance(update.content, TextContentBlock):
            self.text.append(update.content.text)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    """A server process whose stderr goes to a file; ready once ``pattern`` shows in it."""

    def __init__(self, argv: list[str], pattern: bytes) -> None:
        self.argv = argv
        self.log = tempfile.NamedTemporaryFile(prefix="acp-bench-http-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + _START_TIMEOUT_S
        self.found: list[re.Match[bytes]] = []
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_bytes()
            self.found = list(re.finditer(pattern, text))
            if self.found:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = Path(self.log.name).read_bytes()[-1500:].decode(errors="replace")
        self.stop()
        raise BenchError(f"{shell_command(argv)} did not start: {tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


async def _connect(target: str, url: str, client: _Client) -> tuple[Any, Callable[[], Awaitable[None]]]:
    if target in ("ours_sse", "sdk_sse"):
        from acp.http import create_http_stream

        conn = acp.connect_to_agent(cast(acp.Client, client), create_http_stream(url))
        return conn, conn.close
    if target == "ours_ws":
        from acp.ws import create_websocket_stream

        conn = acp.connect_to_agent(cast(acp.Client, client), await create_websocket_stream(url))
        return conn, conn.close
    host, port = url.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host.removeprefix("tcp://"), int(port))
    conn = acp.connect_to_agent(cast(acp.Client, client), writer, reader)

    async def close() -> None:
        await conn.close()
        writer.close()

    return conn, close


async def _one(target: str, url: str, pid: int, sizes: HttpSizes, run: Run) -> None:
    client = _Client()
    conn, close = await _connect(target, url, client)
    try:
        await asyncio.wait_for(conn.initialize(protocol_version=acp.PROTOCOL_VERSION), _START_TIMEOUT_S)
        sid = (await conn.new_session(cwd="/tmp", mcp_servers=[])).session_id
        prompt = [acp.text_block(sizes.text)]
        reply = await conn.prompt(session_id=sid, prompt=prompt)
        # the SDK runs each notification's handler in a task of its own and resolves a response at once:
        # chunks that arrived in the same read as the answer may be handled just after it
        for _ in range(100):
            if "".join(client.text) == sizes.text:
                break
            await asyncio.sleep(0.01)
        if reply.stop_reason != "end_turn" or "".join(client.text) != sizes.text:
            raise BenchError(f"{target} does not echo: {reply.stop_reason!r} {''.join(client.text)!r}")
        for _ in range(sizes.warmup):
            await conn.prompt(session_id=sid, prompt=prompt)
        cpu0, started = cpu_seconds(pid), time.perf_counter()
        for _ in range(sizes.prompts):
            await conn.prompt(session_id=sid, prompt=prompt)
        seconds, cpu_s = time.perf_counter() - started, cpu_seconds(pid) - cpu0
    finally:
        await close()
    run.prompts += sizes.prompts
    run.seconds += seconds
    run.cpu_s += cpu_s
    run.rounds.append(
        {"prompts_per_s": round(sizes.prompts / seconds, 1), "cpu_us_per_prompt": round(cpu_s * 1e6 / sizes.prompts, 1)}
    )


def _wait_accepting(port: int) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"nothing accepts on 127.0.0.1:{port}") from None
            time.sleep(0.05)


def run_http(sizes: HttpSizes) -> tuple[dict[str, Run], dict[str, str]]:
    """Every round over the four targets; per target its totals, and the server commands."""
    ours_argv = [
        *acp_server_argv(), "serve", "--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0",
    ]
    sdk_port = _free_port()
    sdk_argv = [sys.executable, str(BENCH / "peers" / "sdk_http_server.py"), str(sdk_port)]
    listening = rb"acp-server: (listening on tcp|http on http)://127\.0\.0\.1:(\d+)"
    ours = _Process(ours_argv, listening)
    try:
        while len(ours.found) < 2:  # (both lines, with the same two groups, however fast they came)
            time.sleep(0.05)
            ours.found = list(re.finditer(listening, Path(ours.log.name).read_bytes()))
        ports = {m.group(1): int(m.group(2)) for m in ours.found}
        sdk = _Process(sdk_argv, rb"listening")
        _wait_accepting(sdk_port)  # the SDK's server prints before hypercorn binds
        try:
            urls = {
                "ours_sse": f"http://127.0.0.1:{ports[b'http on http']}/acp",
                "ours_ws": f"ws://127.0.0.1:{ports[b'http on http']}/acp",
                "ours_tcp": f"tcp://127.0.0.1:{ports[b'listening on tcp']}",
                "sdk_sse": f"http://127.0.0.1:{sdk_port}/acp",
            }
            pids = {"ours_sse": ours.proc.pid, "ours_ws": ours.proc.pid, "ours_tcp": ours.proc.pid, "sdk_sse": sdk.proc.pid}
            runs = {t: Run() for t in TARGETS}

            async def all_rounds() -> None:
                for r in range(sizes.rounds):
                    for target in TARGETS if r % 2 == 0 else TARGETS[::-1]:
                        await _one(target, urls[target], pids[target], sizes, runs[target])

            asyncio.run(all_rounds())
        finally:
            sdk.stop()
    finally:
        ours.stop()
    return runs, {"ours": shell_command(ours_argv), "sdk": shell_command(sdk_argv)}
