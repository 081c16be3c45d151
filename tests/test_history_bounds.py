"""Bounded live memory per session, against real server processes.

- Many 2 KB prompts on one session: the server's RSS (from ``/proc``) stops growing once the session's
  in-memory history holds ``--max-history-events`` (20,000 prompts under ``ACP_SERVER_FULL=1``, with
  the default bound; fewer with a small bound in ``make test``).
- ``session/load`` of a large transcript (150 MiB under ``ACP_SERVER_FULL=1``) replays every event in
  order, older ones read back from the store in pages, to a client that reads, while another
  connection's ``_acp_server/capabilities`` round trips go on; their latency is printed (``-s``).
- Without a store, a replay that cannot start from the beginning says so first
  (``_acp_server/replay_truncated``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .helpers import scaled
from .test_e2e_sdk import ServerProcess
from .test_half_close import LineReader

FULL = bool(os.environ.get("ACP_SERVER_FULL"))
TEXT_2K = "x" * 2048


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Client:
    """A blocking NDJSON client on one TCP connection."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=120)
        self.reader = LineReader(self.sock)
        self.reader.deadline += 600
        self.next_id = 1
        self.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"turnStates": False}})

    def send(self, method: str, params: dict[str, Any]) -> int:
        id = self.next_id
        self.next_id += 1
        self.sock.sendall(json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode() + b"\n")
        return id

    def call(self, method: str, params: dict[str, Any]) -> Any:
        answer = self.reader.answer(self.send(method, params))
        assert "result" in answer, answer
        return answer["result"]

    def prompts(self, session_id: str, count: int, text: str, window: int = 4) -> None:
        """``count`` prompts, ``window`` in flight at once (under the per-session pending limit)."""
        sent = answered = 0
        ids: list[int] = []
        while answered < count:
            while sent < count and sent - answered < window:
                ids.append(self.send("session/prompt", {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}))
                sent += 1
            answer = self.reader.answer(ids[answered])
            assert answer["result"]["stopReason"] == "end_turn", answer
            answered += 1

    def close(self) -> None:
        self.sock.close()


def _server(*args: str) -> tuple[ServerProcess, str]:
    server = ServerProcess("--listen", "tcp://127.0.0.1:0", *args)
    (url,) = server.wait_listening(1)
    return server, url


@pytest.mark.parametrize("store", [False, True], ids=["ephemeral", "store"])
def test_many_prompts_on_one_session_keep_rss_bounded(store: bool, tmp_path: Path) -> None:
    durable = ["--state-dir", str(tmp_path / "state")] if store else ["--ephemeral"]
    if FULL:
        warmup, total, bound_args = 500, 20_000, []
    else:
        # A small bound, reached early; the warm-up also covers the allocator's and the collector's own
        # growth (a plateau near 4,000 prompts whatever the bound): what follows must not grow the process.
        warmup, total, bound_args = 3_500, 6_000, ["--max-history-events", "500"]
    server, url = _server(*durable, *bound_args)
    try:
        client = Client(url)
        session_id = client.call("session/new", {"cwd": "/tmp", "mcpServers": []})["sessionId"]
        client.prompts(session_id, warmup, TEXT_2K)
        before = _rss_bytes(server.proc.pid)
        started = time.monotonic()
        client.prompts(session_id, total - warmup, TEXT_2K)
        elapsed = time.monotonic() - started
        after = _rss_bytes(server.proc.pid)
        client.close()
        growth = after - before
        per_prompt = growth / (total - warmup)
        print(
            f"\nRSS ({'store' if store else 'ephemeral'}): {before / 2**20:.1f} MiB after {warmup} prompts, "
            f"{after / 2**20:.1f} MiB after {total} (+{growth / 2**20:.1f} MiB, {per_prompt:.0f} B/prompt, "
            f"{(total - warmup) / elapsed:.0f} prompts/s)"
        )
        if FULL:
            assert growth <= 32 * 2**20
        else:
            # Unbounded, these 2,500 prompts grew the server by ~23 MiB (~9.5 KB each).
            assert growth <= 8 * 2**20, growth
    finally:
        server.stop()


def _capabilities_loop(url: str, stop: threading.Event, latencies: list[float]) -> None:
    client = Client(url)
    try:
        while not stop.is_set():
            started = time.perf_counter()
            client.call("_acp_server/capabilities", {})
            latencies.append(time.perf_counter() - started)
    finally:
        client.close()


def test_load_of_a_large_transcript_streams_from_the_store_while_others_are_served(tmp_path: Path) -> None:
    """The replay reaches a reading client whole and in order (read from the store in pages beyond the
    in-memory bound, paced by the writer: never evicted), while round trips go on meanwhile."""
    size_mib = scaled(150, 16)
    text = "y" * (512 * 1024)  # each prompt: its user message and its echo, ~1 MiB of transcript
    prompts = size_mib
    args = ["--state-dir", str(tmp_path / "state"), "--max-history-events", "8", "--max-outbound-bytes", str(8 * 2**20)]
    server, url = _server(*args, "--max-message-bytes", str(4 * 2**20))
    try:
        writer = Client(url)
        session_id = writer.call("session/new", {"cwd": "/tmp", "mcpServers": []})["sessionId"]
        writer.prompts(session_id, prompts, text, window=2)
        writer.close()

        stop = threading.Event()
        latencies: list[float] = []
        pinger = threading.Thread(target=_capabilities_loop, args=(url, stop, latencies))
        loader = Client(url)
        pinger.start()
        try:
            time.sleep(0.2)
            during_from = len(latencies)
            started = time.monotonic()
            id = loader.send("session/load", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
            event_ids: list[int] = []
            replayed = 0
            while True:
                message = loader.reader.message()
                assert message is not None, "the loading client was disconnected"
                if message.get("method") == "session/update":
                    event_ids.append(message["params"]["_meta"]["eventId"])
                    replayed += len(json.dumps(message))
                elif message.get("id") == id:
                    assert "result" in message, message
                    break
                else:
                    assert message.get("method") != "_acp_server/evicted", message
            elapsed = time.monotonic() - started
            during = latencies[during_from:]
        finally:
            stop.set()
            pinger.join(30)
            loader.close()
        assert len(event_ids) == 2 * prompts  # every user message and every echo
        assert event_ids == sorted(event_ids) and len(set(event_ids)) == len(event_ids)
        assert replayed >= prompts * 2 * len(text)
        assert during, "no round trip completed during the replay"
        during.sort()
        p50, p99 = during[len(during) // 2], during[min(len(during) - 1, int(len(during) * 0.99))]
        print(
            f"\nreplay of {replayed / 2**20:.0f} MiB in {elapsed:.2f} s; {len(during)} concurrent capabilities "
            f"round trips: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {during[-1] * 1000:.1f} ms"
        )
    finally:
        server.stop()


def test_an_ephemeral_replay_past_the_bound_begins_with_replay_truncated() -> None:
    server, url = _server("--ephemeral", "--max-history-events", "10")
    try:
        writer = Client(url)
        session_id = writer.call("session/new", {"cwd": "/tmp", "mcpServers": []})["sessionId"]
        writer.prompts(session_id, 20, "hello")
        writer.close()
        loader = Client(url)
        id = loader.send("session/load", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
        messages = []
        while (message := loader.reader.message()) is not None:
            if message.get("id") == id:
                break
            messages.append(message)
        loader.close()
        first = messages[0]
        assert first["method"] == "_acp_server/replay_truncated", first
        assert first["params"]["sessionId"] == session_id
        updates = [m for m in messages if m.get("method") == "session/update"]
        assert updates and first["params"]["firstEventId"] <= updates[0]["params"]["_meta"]["eventId"]
        assert len(messages) - 1 <= 10  # only what is kept
    finally:
        server.stop()
