"""Regenerate the console's screenshots (``make screenshots``): docs/console-operations.png,
docs/console-sessions.png and docs/console-cluster.png, at 1280x800, of a real server under a little
load (the cluster: two replicas sharing their limits through a real ``redis-server``).

A headless screenshot may fire at the load event, before the page's WebSocket has brought anything
in, so each shot first waits for an element that only rendered data produces.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from tests.redis_server import RedisServer  # noqa: E402
from tests.web_helpers import ServerProcess, launch  # noqa: E402

CONFIG = """
[backends.echo]
kind = "echo"
max_active = 2
max_waiting = 2
"""


def cluster(out: Path) -> None:
    """The operations view of one of two replicas on one Redis, the other under load."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "acp-server.toml"
        config.write_text(CONFIG.replace("max_active = 2", "max_active = 3").replace("max_waiting = 2", "max_waiting = 5"))
        redis = RedisServer(tmp)
        replicas: list[ServerProcess] = []
        try:
            for name in ("web-1", "web-2"):
                args = [
                    "--config", str(config), "--echo-delay-ms", "4000", "--max-running-prompts", "4",
                    "--max-queued-prompts", "4", "--coordinator", redis.url, "--replica-id", name,
                ]  # fmt: skip
                replicas.append(ServerProcess(Path(tmp) / f"state-{name}", args).start())
            with sync_playwright() as p:
                browser = launch(p)
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(replicas[0].http_url + "/")
                expect(page.locator("#cluster-summary")).to_contain_text("2 live replicas", timeout=15_000)
                loads = [replicas[1].load(3, text="elsewhere " * 4), replicas[0].load(2, text="here " * 4)]
                expect(page.locator("#cluster-limits tr[data-key=seats] td").nth(2)).to_have_text("4", timeout=15_000)
                expect(page.locator("#cluster-limits tr[data-key=room] td").nth(2)).to_have_text("1", timeout=15_000)
                page.locator("#cluster").scroll_into_view_if_needed()
                page.screenshot(path=str(out / "console-cluster.png"))
                for load in loads:
                    load.communicate(timeout=60)
                browser.close()
        finally:
            for replica in replicas:
                replica.stop()
            redis.stop()


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "acp-server.toml"
        config.write_text(CONFIG)
        server = ServerProcess(
            Path(tmp) / "state",
            ["--config", str(config), "--echo-delay-ms", "3000", "--max-pending-prompts-per-session", "1"],
        ).start()
        try:
            with sync_playwright() as p:
                browser = launch(p)
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(server.http_url + "/")
                expect(page.locator("body")).to_have_attribute("data-snapshots", "2")
                loads = []
                for _ in range(4):  # waves of load: some run, some wait, the rest are refused
                    loads.append(server.load(7, text="load " * 6))
                    time.sleep(1.5)
                expect(page.locator("#refusals tr[data-key=capacity_exceeded]")).to_be_visible()
                expect(page.locator("#n-pending")).not_to_have_text("0")
                page.screenshot(path=str(out / "console-operations.png"))
                for load in loads:
                    load.communicate(timeout=60)

                page.click("#tab-sessions")
                page.click("#new-session")
                expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
                page.fill("#prompt-input", "Which prompts are waiting, and for how long?")
                page.click("#send")
                expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=30_000)
                session_id = page.inner_text("#chat-title")
                expect(page.locator("#n-running")).to_have_text("0", timeout=10_000)
                held = server.load(1, session=session_id, text="a long answer " * 5)
                expect(page.locator("#n-running")).to_have_text("1", timeout=10_000)
                page.fill("#prompt-input", "And one more, please")
                page.click("#send")
                expect(page.locator("#notice")).to_have_attribute("data-kind", "prompt_queue_full")
                page.screenshot(path=str(out / "console-sessions.png"))
                held.communicate(timeout=60)
                browser.close()
        finally:
            server.stop()


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent)
    main(where)
    cluster(where)
