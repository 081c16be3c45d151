"""qwen's published TypeScript SDK (``@qwen-code/sdk`` 0.1.14, its ``daemon`` entry, unchanged) driving a
live ``acp-server`` over the REST + SSE API: ``tests/node/flows.mjs`` runs one flow per process and
prints one JSON line that these tests check.

Node and the SDK come from ``tests/node`` (``npm ci``, which ``make test`` runs); without them the
tests are skipped with the reason. The SDK declares node >= 22; what these flows use runs on 20.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_e2e_sdk import ServerProcess
from .test_http_sdk import wait_http

NODE_DIR = Path(__file__).resolve().parent / "node"
NODE = shutil.which("node")

_needs_node = pytest.mark.skipif(
    NODE is None or not (NODE_DIR / "node_modules" / "@qwen-code" / "sdk").is_dir(),
    reason="node and tests/node/node_modules (npm ci in tests/node) are needed",
)


def flow(base: str, name: str) -> dict[str, Any]:
    run = subprocess.run([str(NODE), "flows.mjs", base, name], capture_output=True, text=True, timeout=60, cwd=NODE_DIR)
    assert run.returncode == 0, (run.stdout, run.stderr[-3000:])
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line of ``proc``'s stdout, or a failure naming the wait (never a hung suite)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"the SDK flow wrote no line in {timeout} s") from None


def serve(*args: str) -> ServerProcess:
    return ServerProcess("--listen", "tcp://127.0.0.1:0", *args)


@_needs_node
def test_capabilities_prompt_blocking_and_subscribed_with_events() -> None:
    """``capabilities()`` sees the limit; ``createOrAttach`` then ``prompt()`` on the blocking and the
    subscription paths; ``events()`` streams the updates and ``turn_complete``, all known to the SDK."""
    # a turn that outlasts its POST: with an instant echo, a turn_complete that reaches the SDK's open
    # subscription before the 202 does is sometimes missed by 0.1.14's prompt() (it then waits forever)
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0", "--max-pending-prompts-per-session", "5",
               "--echo-delay-ms", "200") as server:
        out = flow(wait_http(server), "basic")
    assert out["limit"] == 5 and out["workspaceCwd"].startswith("/"), out
    assert (out["blocking"], out["subscribed"]) == ("end_turn", "end_turn"), out
    assert out["text"].endswith("subscription path") and out["types"][-1] == "turn_complete", out
    assert set(out["unknown"]) <= {"replay_complete"} and out["ids"] == sorted(out["ids"]) and len(out["ids"]) == len(out["types"]) - out["types"].count("replay_complete"), out


@_needs_node
def test_pending_limit_local_and_from_the_server() -> None:
    """A 6th concurrent prompt raises the SDK's own ``DaemonPendingPromptLimitError``; with the local
    limit off, the server's 503 ``prompt_queue_full`` reaches the caller as the same error, with the
    server's ``limit`` and ``pendingCount``."""
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0", "--max-pending-prompts-per-session", "5",
               "--echo-delay-ms", "300") as server:
        out = flow(wait_http(server), "limit")
    assert sorted(out["first"]) == ["end_turn"] * 5 + ["limit"], out
    assert out["local"] == [{"limit": 5, "pendingCount": 5}], out
    assert sorted(out["second"]) == ["end_turn"] * 5 + ["limit"], out
    assert out["remote"] == [{"limit": 5, "pendingCount": 5, "sessionId": True}], out


@_needs_node
def test_cancel_ends_a_blocking_prompt() -> None:
    """``cancel()`` ends a running blocking ``prompt()`` with ``cancelled``, long before the echo would."""
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0", "--echo-delay-ms", "20000") as server:
        out = flow(wait_http(server), "cancel")
    assert out.get("stopReason") == "cancelled" and out["ms"] < 10000, out


@_needs_node
def test_events_resumed_from_a_last_event_id_get_the_missed_frames() -> None:
    """``events({lastEventId})`` replays what came after it, then ``replay_complete``."""
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0") as server:
        out = flow(wait_http(server), "resume")
    assert out["text"] == "two three" and out["types"][-2:] == ["turn_complete", "replay_complete"], out
    assert all(i > out["firstTurnEnd"] for i in out["ids"]), out
    # 0.1.14's isKnownDaemonEvent has no case for replay_complete (it is in its
    # DAEMON_KNOWN_EVENT_TYPE_VALUES): every other frame passes it
    assert set(out["unknown"]) <= {"replay_complete"}, out


@_needs_node
def test_stale_client_id_after_a_restart_heals_itself(tmp_path: Path) -> None:
    """After a restart on the same ``--state-dir``, the next ``prompt()`` gets 400 ``invalid_client_id``,
    resumes once and retries once by itself; the server counts that one resume."""
    port = free_port()
    # a turn that outlasts its POST (see the first test: 0.1.14's subscribed prompt() can miss an earlier turn_complete)
    args = ("--state-dir", str(tmp_path), "--http-listen", f"http://127.0.0.1:{port}", "--echo-delay-ms", "200")
    base = f"http://127.0.0.1:{port}"
    node: subprocess.Popen[str] | None = None
    try:
        with serve(*args) as server:
            wait_http(server)
            node = subprocess.Popen([str(NODE), "flows.mjs", base, "heal"], cwd=NODE_DIR, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert node.stdout is not None and node.stdin is not None
            ready = json.loads(_readline(node, 60))
            assert ready["ready"] is True, ready
        with serve(*args) as server:
            wait_http(server)
            node.stdin.write("go\n")
            node.stdin.flush()
            out = json.loads(_readline(node, 60))
            health = httpx.get(base + "/health?deep=1", timeout=10).json()
        assert (out["first"], out["second"]) == ("end_turn", "end_turn"), out
        assert out["before"] == ready["clientId"] and out["after"] != out["before"], out
        assert health["selfHealResumesTotal"] == 1, health
    finally:
        if node is not None:
            node.kill()
            node.communicate(timeout=10)  # reaps it and closes its pipes


def test_workspace_flag_is_the_capabilities_workspace(tmp_path: Path) -> None:
    """``--workspace DIR`` is ``workspaceCwd`` and ``POST /session``'s default ``cwd``."""
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0", "--workspace", str(tmp_path)) as server:
        base = wait_http(server)
        assert httpx.get(base + "/capabilities", timeout=10).json()["workspaceCwd"] == str(tmp_path)
        created = httpx.post(base + "/session", json={}, timeout=10).json()
        assert created["workspaceCwd"] == str(tmp_path)


@_needs_node
def test_every_frame_kind_against_the_sdk_event_guard() -> None:
    """A completed and a cancelled turn, a resync (a cursor from another bus) and the session's close,
    read raw with the SDK's ``subscribeEvents``: every frame type is one the SDK lists, and each passes
    its ``isKnownDaemonEvent`` except ``replay_complete`` and ``prompt_cancelled``, for which 0.1.14's
    guard has no case (it answers false for any data); the SDK learns the epoch from the header."""
    with serve("--ephemeral", "--http-listen", "http://127.0.0.1:0", "--echo-delay-ms", "1000") as server:
        out = flow(wait_http(server), "kinds")
    expected = {"session_update", "turn_complete", "prompt_cancelled", "state_resync_required", "replay_complete",
                "session_closed"}
    assert expected <= set(out["types"]), out
    assert out["listed"] == out["types"], out  # every type is in DAEMON_KNOWN_EVENT_TYPE_VALUES
    assert set(out["unknown"]) <= {"replay_complete", "prompt_cancelled"}, out
    assert isinstance(out["epoch"], str) and len(out["epoch"]) == 16, out
