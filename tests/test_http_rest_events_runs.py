"""A subscriber sent a run of lines at once (a store's commit round: ``fanout.CommitFanOut`` joins the
lines it holds for the same connections), and the live stream of a server with a store."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from acp_server.bridge.fanout import encode_update
from acp_server.transports.http import rest_events
from acp_server.transports.http.rest_events import SseSubscriber

from .test_http_qwen_sdk import serve
from .test_http_sdk import wait_http


def _turn(state: str, event_id: int, reason: str = ',"reason":"end_turn"') -> bytes:
    return (f'{{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{{"sessionId":"s-1","promptId":"p1",'
            f'"state":"{state}","at":1700000000000{reason},"_meta":{{"eventId":{event_id},"originatorClientId":"c1"}}}}}}\n').encode()


def test_a_run_of_lines_is_queued_as_each_line_alone() -> None:
    """Lines sent joined in one ``send`` queue the frames each line sent alone queues, in order, with
    the same last event id; another subscriber sent the same run queues the same frames."""
    lines = [
        encode_update("s-1", 1, b'{"a":1}', "c1"),
        encode_update("s-1", 2, b'{"b":[2]}', "c1"),
        _turn("running", 3),
        encode_update("s-1", 4, b'{"c":"x"}'),
        _turn("completed", 5),
    ]
    alone = SseSubscriber("s-1", max_frames=1024)
    for line in lines:
        rest_events._last_line = (b"", [])
        alone.send(line)
    assert len(alone.frames) == 4 and alone.last_event_id == 5
    run = b"".join(lines)
    for _ in range(2):
        joined = SseSubscriber("s-1", max_frames=1024)
        joined.send(run)
        assert list(joined.frames) == list(alone.frames) and joined.last_event_id == 5
    last = SseSubscriber("s-1", max_frames=1024)
    last.send(run[:-1])  # a run whose last line has no line feed
    assert list(last.frames) == list(alone.frames)


def test_a_server_with_a_store_streams_each_update_and_turn_complete(tmp_path: Path) -> None:
    """With ``--state-dir`` the updates of a REST prompt reach its subscriber live, one frame each,
    then its ``turn_complete``."""
    with serve("--state-dir", str(tmp_path / "state"), "--http-listen", "http://127.0.0.1:0") as server:
        base = wait_http(server)
        sid = httpx.post(base + "/session", json={"sessionScope": "thread"}, timeout=10).json()["sessionId"]
        text: list[str] = []
        attached = threading.Event()

        def watch() -> None:
            # from event 0: replay_complete comes once the subscriber is attached to the live stream
            with httpx.stream("GET", f"{base}/session/{sid}/events", headers={"Last-Event-ID": "0"}, timeout=10) as r:
                for chunk in r.iter_text():
                    text.append(chunk)
                    seen = "".join(text)
                    if "event: replay_complete" in seen:
                        attached.set()
                    if "event: turn_complete" in seen:
                        return

        watcher = threading.Thread(target=watch)
        watcher.start()
        assert attached.wait(10)
        prompt = {"prompt": [{"type": "text", "text": "one two three four"}]}
        assert httpx.post(f"{base}/session/{sid}/prompt", json=prompt, timeout=10).status_code == 202
        watcher.join(10)
        got = "".join(text)
    assert got.count("event: session_update") == 5, got  # the prompt's own text, then 4 words
    assert got.count("event: turn_complete") == 1, got
