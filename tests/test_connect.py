"""``acp-server connect URL``: an editor spawns it as its agent command and gets a running server.

The official SDK driver (``tests/sdk_driver.py``) spawns ``python -m acp_server connect tcp://...``
over stdio and runs its whole scenario through the relay; a session made through the relay is then
visible to a direct connection (the relay reached the one shared server)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import trio

from .test_e2e_sdk import DRIVER, ECHO_DELAY_MS, ServerProcess, raw_clients


def test_official_sdk_session_through_connect(tmp_path: pathlib.Path) -> None:
    """The SDK's whole scenario (prompts, concurrent prompts, cancel) passes through the relay byte
    for byte, and the session lives in the running server."""
    with ServerProcess(
        "--listen", "tcp://127.0.0.1:0", "--echo-delay-ms", str(ECHO_DELAY_MS), "--state-dir", str(tmp_path / "s")
    ) as server:
        (url,) = server.wait_listening()
        run = subprocess.run(
            [sys.executable, str(DRIVER), f"connect:{url}"], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        summary = json.loads(run.stdout)
        context = f"summary: {json.dumps(summary, indent=1)}\ndriver stderr: {run.stderr}"
        assert summary["failures"] == [] and summary["sdkErrors"] == [], context
        assert summary["agentName"] == "acp-server"
        for phase in ("first", "after"):
            assert summary[phase]["stopReason"] == "end_turn", context
            assert summary[phase]["text"] == summary[phase]["sent"], context
        assert summary["concurrent"]["stopReasons"] == ["end_turn"] * 3, context
        assert summary["cancelled"]["stopReason"] == "cancelled", context
        validated = summary["validated"]
        assert validated["AgentResponseMessage"] + validated["AgentNotification"] == summary["received"], context

        async def listed() -> list[str]:
            async with raw_clients() as open_raw:
                direct = await open_raw(url)
                result = await direct.call("session/list", {})
                return [s["sessionId"] for s in result["sessions"]]

        assert summary["sessionId"] in trio.run(listed)


def test_connect_to_nothing_exits_1(tmp_path: pathlib.Path) -> None:
    """No server at the URL: exit 1 with one line naming the URL; a bad URL too."""
    sock = tmp_path / "none.sock"
    run = subprocess.run(
        [sys.executable, "-m", "acp_server", "connect", f"unix:{sock}"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 1
    assert f"cannot relay to unix:{sock}" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "acp_server", "connect", "ftp://x"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 1 and "unknown scheme" in run.stderr
