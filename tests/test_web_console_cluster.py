"""The console's cluster view in a real browser: two replicas sharing their limits through a real
``redis-server``, the console open on one of them, a load run on the other."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.redis_server import RedisServer, redis_server  # noqa: F401
from tests.web_helpers import ServerProcess, launch

CONFIG = """
[backends.echo]
kind = "echo"
max_active = 1
max_waiting = 3
"""


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as p:
        browser = launch(p)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        pg = context.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        yield pg
        browser.close()
        assert errors == [], errors


def _replica(tmp_path: Path, redis: RedisServer, name: str) -> ServerProcess:
    config = tmp_path / "acp-server.toml"
    config.write_text(CONFIG)
    args = [
        "--config", str(config), "--echo-delay-ms", "2500", "--max-running-prompts", "2",
        "--coordinator", redis.url, "--coordinator-prefix", "ui", "--replica-id", name, "--lease-ttl-s", "1.5",
    ]  # fmt: skip
    return ServerProcess(tmp_path / f"state-{name}", args).start()


def _cell(page: Page, table: str, key: str, column: int) -> Any:
    return page.locator(f"#{table} tr[data-key='{key}'] td").nth(column)


def test_cluster_view_shows_replicas_and_shared_limits(page: Page, tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    one = _replica(tmp_path, redis_server, "web-1")
    two = _replica(tmp_path, redis_server, "web-2")
    try:
        page.goto(one.http_url + "/")
        expect(page.locator("#cluster")).to_be_visible()
        expect(page.locator("#cluster-summary")).to_contain_text("this replica web-1: coordinator up (redis)")
        expect(page.locator("#cluster-summary")).to_contain_text("2 live replicas", timeout=10_000)
        expect(_cell(page, "replicas", "web-1", 0)).to_have_text("web-1 (this one)")
        expect(_cell(page, "replicas", "web-2", 1)).to_have_text("live")
        expect(_cell(page, "replicas", "web-2", 2)).to_have_text(re.compile(r"^\d+(\.\d)? (ms|s) ago$"))

        # two prompts on the other replica: both hold a cluster seat; one runs its backend call, the
        # other waits for the pool's one permit; this replica's own figures stay at 0
        load = two.load(2, text="held elsewhere")
        try:
            expect(_cell(page, "cluster-limits", "seats", 2)).to_have_text("2", timeout=10_000)
            expect(_cell(page, "cluster-limits", "seats", 3)).to_have_text("2")
            expect(_cell(page, "cluster-limits", "seats", 1)).to_have_text("seats: global seats (running prompts)")
            expect(_cell(page, "cluster-limits", "pool:echo", 2)).to_have_text("2")
            expect(_cell(page, "cluster-limits", "pool:echo", 3)).to_have_text("4")
            expect(_cell(page, "cluster-limits", "pool:echo:active", 2)).to_have_text("1")
            expect(_cell(page, "cluster-limits", "seats:c1", 1)).to_have_text("seats: class interactive")
            expect(page.locator("#n-running")).to_have_text("0")
        finally:
            out, _ = load.communicate(timeout=60)
        assert out.split() == ["end_turn", "end_turn"]
        expect(_cell(page, "cluster-limits", "seats", 2)).to_have_text("0", timeout=10_000)
        expect(_cell(page, "cluster-limits", "pool:echo", 2)).to_have_text("0")

        two.stop()  # it stops renewing: one lease TTL later the registry shows it gone
        expect(_cell(page, "replicas", "web-2", 1)).to_have_text("gone", timeout=10_000)
        expect(page.locator("#replicas tr[data-key='web-2']")).to_have_attribute("data-live", "false")
        expect(_cell(page, "replicas", "web-1", 1)).to_have_text("live")
    finally:
        two.stop()
        one.stop()

