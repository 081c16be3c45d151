"""``serve --stdio`` answers prompts read together in the order they were read, every time.

8 sessions' prompts written in one go are read at once and their turns run in one scheduling pass; trio
would run that pass's turns in their order or reversed, at random, and the session answered first in
one round was answered last in the next (``cli.tune_scheduler`` fixes the order). A client handles the
answers in the order they come, so that coin decided whose prompt waited for 7 others' handling.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

_SESSIONS = 8
_ROUNDS = 12


class _Stdio:
    """A ``serve --stdio`` child and its NDJSON lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "acp_server", "serve", "--stdio"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ),
        )
        self._buffer = b""
        self._next_id = 0

    def write(self, messages: list[dict[str, Any]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in messages))
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        return {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}

    def answers(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """The next ``count`` responses, in the order they arrived (notifications skipped)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        got: list[dict[str, Any]] = []
        while len(got) < count:
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                assert left > 0, f"timed out with {got}"
                if select.select([fd], [], [], left)[0]:
                    chunk = os.read(fd, 65536)
                    assert chunk, "the server exited"
                    self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "id" in message and "method" not in message:
                got.append(message)
        return got

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)
        self.proc.stdout.close()


def test_prompts_read_together_are_answered_in_the_order_they_came() -> None:
    server = _Stdio()
    try:
        server.write([server.request("initialize", {"protocolVersion": 1, "clientCapabilities": {}})])
        assert "result" in server.answers(1)[0]
        news = [server.request("session/new", {"cwd": "/tmp", "mcpServers": []}) for _ in range(_SESSIONS)]
        server.write(news)
        sessions = [answer["result"]["sessionId"] for answer in server.answers(_SESSIONS)]
        orders = []
        for _ in range(_ROUNDS):
            prompts = [
                server.request("session/prompt", {"sessionId": s, "prompt": [{"type": "text", "text": "hi"}]})
                for s in sessions
            ]
            server.write(prompts)  # one write: the server reads them at once
            answers = server.answers(_SESSIONS)
            assert all(a["result"]["stopReason"] == "end_turn" for a in answers)
            orders.append([a["id"] for a in answers] == [p["id"] for p in prompts])
        assert all(orders), orders
    finally:
        server.close()
