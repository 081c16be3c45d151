"""Regenerate the console's screenshots (``make screenshots``): docs/console-operations.png and
docs/console-sessions.png, at 1280x800, of a real server under a little load.

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

from tests.web_helpers import ServerProcess, launch  # noqa: E402

CONFIG = """
[backends.echo]
kind = "echo"
max_active = 2
max_waiting = 2
"""


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
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent))
