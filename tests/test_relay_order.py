"""Order across the relay, against a real server and a real ACP agent: an agent that sends a
``tool_call`` update and then asks ``session/request_permission`` is seen by the client in that
order, whether or not the store is on (with the store, updates wait for their commit; a relayed
request waits for them).

Fails on a server whose relayed requests overtake the updates the agent sent before them.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .test_e2e_sdk import ServerProcess
from .test_half_close import LineReader

PROMPTS = 6
AGENT = [sys.executable, "-m", "tests.agents.fake_agent", "--tool-call", "--ask-permission"]


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")


@pytest.mark.parametrize("store", [True, False], ids=["store", "ephemeral"])
def test_tool_call_update_reaches_the_client_before_the_permission_request(store: bool, tmp_path: Path) -> None:
    durable = ["--state-dir", str(tmp_path / "state")] if store else ["--ephemeral"]
    server = ServerProcess("--listen", "tcp://127.0.0.1:0", *durable, "--", *AGENT)
    try:
        (url,) = server.wait_listening(1)
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
            reader = LineReader(sock)
            reader.deadline += 30  # the agent's first spawn imports the SDK
            _send(sock, {"id": 1, "method": "initialize", "params": {"protocolVersion": 1, "clientCapabilities": {}}})
            reader.answer(1)
            _send(sock, {"id": 2, "method": "session/new", "params": {"cwd": str(Path.cwd()), "mcpServers": []}})
            session_id = reader.answer(2)["result"]["sessionId"]
            orders: list[list[str]] = []
            for n in range(PROMPTS):
                id = 10 + n
                text = [{"type": "text", "text": f"go {n}"}]
                _send(sock, {"id": id, "method": "session/prompt", "params": {"sessionId": session_id, "prompt": text}})
                seen: list[str] = []
                while True:
                    message = reader.message()
                    assert message is not None, "the server closed the connection"
                    if message.get("method") == "session/update":
                        update = message["params"]["update"]
                        if update["sessionUpdate"] == "tool_call":
                            seen.append("tool_call")
                    elif message.get("method") == "session/request_permission":
                        seen.append("permission")
                        outcome = {"outcome": {"outcome": "selected", "optionId": "allow"}}
                        _send(sock, {"id": message["id"], "result": outcome})
                    elif message.get("id") == id and "method" not in message:
                        assert message["result"]["stopReason"] == "end_turn", message
                        break
                orders.append(seen)
            assert orders == [["tool_call", "permission"]] * PROMPTS
    finally:
        server.stop()
