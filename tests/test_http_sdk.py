"""End to end over ``/acp``: the official SDK's own remote clients (``acp.http.create_http_stream``,
``acp.ws.create_websocket_stream``) against a real ``acp-server`` process; ``acp-server connect
ws://`` relaying an SDK stdio session; one session shared by TCP, HTTP/SSE and WebSocket peers; and
SIGTERM with streams open.

The SDK runs on asyncio in its own process (``tests/sdk_driver.py``), as in ``test_e2e_sdk``.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from acp_server.admission import Limits
from acp_server.client.websocket import open_websocket
from acp_server.transports import serve_tcp

from .helpers import RawClient, assert_error_valid
from .http_helpers import TIMEOUT_S, eventually, http_peer, http_server
from .test_e2e_sdk import DRIVER, ECHO_DELAY_MS, ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def wait_http(server: ServerProcess, timeout: float = 15.0) -> str:
    """The URL of the ``acp-server: http on URL`` line."""
    deadline = time.monotonic() + timeout
    while True:
        line = server.next_stderr_line(deadline, "the 'http on' line")
        if line.startswith("acp-server: http on "):
            return line.split(" on ", 1)[1]


def run_driver(target: str, *args: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, str(DRIVER), target, *args], capture_output=True, text=True, timeout=90, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    summary: dict[str, Any] = json.loads(run.stdout)
    summary["driverStderr"] = run.stderr[-3000:]
    return summary


@pytest.mark.parametrize("scheme", ["http", "ws", "connect:ws"])
def test_sdk_remote_clients_run_the_whole_scenario(scheme: str) -> None:
    """The SDK's HTTP and WebSocket clients (and an SDK stdio session relayed by ``acp-server connect
    ws://``): prompts with updates, concurrent prompts, ``session/cancel``; every message validates."""
    with ServerProcess("--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0",
                       "--echo-delay-ms", str(ECHO_DELAY_MS)) as server:
        base = wait_http(server)
        url = base + "/acp"
        target = {"http": url, "ws": url.replace("http://", "ws://"), "connect:ws": "connect:" + url.replace("http://", "ws://")}[scheme]
        summary = run_driver(target)
    context = json.dumps(summary, indent=1)
    assert summary["failures"] == [] and summary["sdkErrors"] == [], context
    for phase in ("first", "after"):
        assert summary[phase]["stopReason"] == "end_turn", context
        assert summary[phase]["text"] == summary[phase]["sent"], context
    assert summary["concurrent"]["stopReasons"] == ["end_turn"] * 3, context
    # One session runs its prompts one at a time, in arrival order, so the echoes never interleave. Over
    # HTTP the three concurrent POSTs are concurrent requests, which arrive in any order.
    sent = summary["concurrent"]["sent"]
    orders = [sent] if scheme != "http" else [list(p) for p in itertools.permutations(sent)]
    assert summary["concurrent"]["text"] in ["".join(o) for o in orders], context
    assert summary["cancelled"]["stopReason"] == "cancelled", context
    assert summary["pendingPromptsAtEnd"] == 0
    validated = summary["validated"]
    assert validated["AgentResponseMessage"] + validated["AgentNotification"] == summary["received"], context
    assert validated["PromptResponse"] == 6 and validated["TurnState"] >= 18, context


@pytest.mark.parametrize("scheme", ["http", "ws"])
def test_sdk_remote_clients_permission_cancel_request_refusal_and_replay(scheme: str) -> None:
    """Over each remote client: a permission request relayed from an ACP agent backend and answered by
    the SDK; ``$/cancel_request`` of a running prompt; a ``prompt_queue_full`` refusal whose error
    validates against ``schemas/``; ``session/load`` on a second connection replaying the session."""
    agent = f"agent={sys.executable} -m tests.agents.fake_agent --ask-permission"
    with ServerProcess("--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0",
                       # the echo turn's length is the window in which $/cancel_request must arrive after its
                       # first chunk: 1.5 s was missed once under make test-full's load (end_turn came back)
                       "--echo-delay-ms", "3000", "--max-pending-prompts-per-session", "1", "--agent", agent) as server:
        url = wait_http(server) + "/acp"
        summary = run_driver(url if scheme == "http" else url.replace("http://", "ws://"), "--scenario", "agent")
    context = json.dumps(summary, indent=1)
    assert summary["failures"] == [] and summary["sdkErrors"] == [], context
    assert summary["permission"] == {"stopReason": "end_turn", "text": "permission:allow with permission", "asked": 1}
    assert summary["cancelRequest"] == {"code": -32800, "data": {"errorKind": "request_cancelled"}}, context
    refusal = summary["refusal"]
    assert refusal["data"]["errorKind"] == "prompt_queue_full" and refusal["data"]["limit"] == 1, context
    assert_error_valid(refusal)
    assert summary["long"] == "end_turn"
    # the replay: both prompts of the session, each as its user chunk and the agent's echo
    assert summary["replayKinds"]["user_message_chunk"] == 2, context
    assert summary["replayText"] == "cancelled by its idholding the only slot", context
    assert summary["afterLoad"] == {"stopReason": "end_turn", "text": "after the load"}


async def test_one_session_shared_by_tcp_sse_and_websocket() -> None:
    """A session made over TCP and loaded over HTTP/SSE and WebSocket: a prompt from each is seen by all
    three once, with the same eventIds; the pending limit counts prompts from all three."""
    with trio.fail_after(TIMEOUT_S * 2):
        async with http_server(Limits(max_pending_prompts_per_session=3)) as (server, nursery, url):
            listeners = await nursery.start(partial(serve_tcp, host="127.0.0.1"), server.handle_stream, 0)
            port = listeners[0].socket.getsockname()[1]
            tcp = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
            nursery.start_soon(tcp.pump)
            nursery.start_soon(_close_at_exit, tcp)
            await tcp.initialize()
            sid, _ = await tcp.new_session()
            async with open_websocket(url.replace("http://", "ws://") + "/acp") as ws_stream, http_peer(url, nursery) as sse:
                ws = RawClient(ws_stream)
                nursery.start_soon(ws.pump)
                await ws.initialize()
                await ws.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                await sse.initialize()
                id, r = await sse.post("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
                assert sse.conn_stream is not None
                await sse.conn_stream.wait_for(lambda m: m.get("id") == id)
                stream = await sse.open_stream(sid)

                assert (await tcp.prompt(sid, "from tcp"))["stopReason"] == "end_turn"
                assert (await ws.prompt(sid, "from ws"))["stopReason"] == "end_turn"
                assert (await sse.prompt(sid, "from sse"))["result"]["stopReason"] == "end_turn"

                def sse_updates() -> list[dict[str, Any]]:
                    return [m["params"] for m in stream.messages if m.get("method") == "session/update"]

                expected = "from tcpfrom wsfrom sse"

                def sse_text() -> str:
                    chunks = [u for u in sse_updates() if u["update"]["sessionUpdate"] == "agent_message_chunk"]
                    return "".join(u["update"]["content"]["text"] for u in chunks)

                await eventually(lambda: tcp.agent_text(sid) == ws.agent_text(sid) == sse_text() == expected)
                agent_ids = [
                    [u["_meta"]["eventId"] for u in ups if u["update"]["sessionUpdate"] == "agent_message_chunk"]
                    for ups in (tcp.updates(sid), ws.updates(sid), sse_updates())
                ]
                assert agent_ids[0] == agent_ids[1] == agent_ids[2]
                assert len(set(agent_ids[0])) == len(agent_ids[0])  # each update once

                # the pending limit (3) counts the prompts of all three peers
                server.bridge.backend.delay_ms = 2000  # type: ignore[attr-defined]
                async with trio.open_nursery() as inner:
                    inner.start_soon(tcp.prompt, sid, "one")
                    inner.start_soon(ws.prompt, sid, "two")
                    inner.start_soon(sse.prompt, sid, "three")
                    await eventually(lambda: server.bridge.sessions[sid].pending_count == 3)
                    pid, r = await sse.post(
                        "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "four"}]}, session_id=sid
                    )
                    refusal = await stream.wait_for(lambda m: m.get("id") == pid)
                    assert refusal["error"]["data"]["errorKind"] == "prompt_queue_full"
                    assert refusal["error"]["data"]["pendingCount"] == 3
                    assert_error_valid(refusal["error"])
                    server.bridge.backend.delay_ms = 0  # type: ignore[attr-defined]  # the three finish


async def _close_at_exit(client: RawClient) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await client.stream.aclose()


async def test_sigterm_with_open_streams_cancels_and_exits_0() -> None:
    """SIGTERM while an SSE peer's prompt runs and a WebSocket is open: the prompt answers
    ``cancelled`` on its stream, the streams end, the WebSocket closes, and the process exits 0."""
    with ServerProcess(
        "--ephemeral", "--listen", "tcp://127.0.0.1:0", "--http-listen", "http://127.0.0.1:0", "--echo-delay-ms", "5000"
    ) as server:
        url = await trio.to_thread.run_sync(wait_http, server)
        with trio.fail_after(TIMEOUT_S):
            async with trio.open_nursery() as nursery, http_peer(url, nursery) as peer:
                async with open_websocket(url.replace("http://", "ws://") + "/acp") as ws_stream:
                    ws = RawClient(ws_stream)
                    nursery.start_soon(ws.pump)
                    await ws.initialize()
                    await peer.initialize()
                    sid = await peer.new_session()
                    id, r = await peer.post(
                        "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "long"}]}, session_id=sid
                    )
                    stream = peer.session_streams[sid]
                    await stream.wait_for(lambda m: m.get("method") == "session/update")
                    server.proc.send_signal(signal.SIGTERM)
                    answer = await stream.wait_for(lambda m: m.get("id") == id)
                    assert answer["result"]["stopReason"] == "cancelled"
                    await stream.ended.wait()
                    assert peer.conn_stream is not None
                    await peer.conn_stream.ended.wait()
                    await ws.eof.wait()
                    returncode = await trio.to_thread.run_sync(server.proc.wait, 10.0)
                    assert returncode == 0, server.rest_of_stderr()
                nursery.cancel_scope.cancel()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(url + "/health")
