"""The web console in a real browser (Debian's chromium under Playwright) against a real server.

Each flow drives the page as an operator would and reads what the page shows. Agent-provided markup
(a message, a tool call title, permission options, an error) must render as text: a script of theirs
would set ``window.__pwned``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.web_helpers import ServerProcess, launch

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
ECHO_CONFIG = """
[backends.echo]
kind = "echo"
max_active = 1
max_waiting = 1
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


def _new_page(browser: Any) -> Iterator[Page]:
    """A page in a context of its own (its own sessionStorage and WebSocket: another tab, another operator)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert errors == [], errors


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    yield from _new_page(browser)


@pytest.fixture
def other_page(browser: Any) -> Iterator[Page]:
    yield from _new_page(browser)


def _server(tmp_path: Path, *args: str) -> ServerProcess:
    config = tmp_path / "acp-server.toml"
    config.write_text(ECHO_CONFIG)
    return ServerProcess(tmp_path / "state", ["--config", str(config), *args])


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[ServerProcess]:
    server = _server(tmp_path, "--echo-delay-ms", "400", "--max-pending-prompts-per-session", "1").start()
    yield server
    server.stop()


@pytest.fixture
def slow_echo(tmp_path: Path) -> Iterator[ServerProcess]:
    """Each echo turn takes 4 s: long enough to act on a running prompt."""
    server = _server(tmp_path, "--echo-delay-ms", "4000", "--max-pending-prompts-per-session", "1").start()
    yield server
    server.stop()


def _open_sessions(page: Page, server: ServerProcess) -> str:
    page.goto(server.http_url + "/#sessions")
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    page.click("#new-session")
    expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
    return page.inner_text("#chat-title")


def _prompt(page: Page, text: str) -> None:
    page.fill("#prompt-input", text)
    page.click("#send")


def _not_pwned(page: Page) -> None:
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#transcript img, #notice img").count() == 0


def test_console_headers_and_routes(echo: ServerProcess) -> None:
    r = httpx.get(echo.http_url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'self'" in csp and "unsafe-inline" not in csp
    assert "connect-src 'self' ws: wss:" in csp
    js = httpx.get(echo.http_url + "/console/main.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert js.headers["content-security-policy"] == csp
    assert httpx.get(echo.http_url + "/console/missing.js").status_code == 404
    assert httpx.post(echo.http_url + "/").status_code == 405
    assert httpx.get(echo.http_url + "/", headers={"host": "evil.example"}).status_code == 403
    assert httpx.get(echo.http_url + "/", headers={"origin": "http://evil.example"}).status_code == 403


def test_operations_view_reflects_a_load(page: Page, tmp_path: Path) -> None:
    """The page shows a load while it runs (the pool's running and waiting prompts, its refusals and
    their chart, the sessions), then the load gone.

    The page reads one snapshot a second, so the load's turns do not end by themselves (each would take
    10 minutes): one runs and one waits in the pool (``max_active = 1``, ``max_waiting = 1``) and the
    other four are refused, whenever each arrives, until the test has seen all of it and cancels them.
    Turns that end on a timer (400 ms) could all fall between two snapshots on a loaded machine."""
    echo = _server(tmp_path, "--echo-delay-ms", "600000", "--max-pending-prompts-per-session", "1").start()
    try:
        page.goto(echo.http_url + "/")
        expect(page.locator("#transports tr[data-key=ws] td").nth(1)).to_have_text("1")
        expect(page.locator("#pools tr[data-key=echo] td").first).to_have_text("echo")
        expect(page.locator("#cluster")).to_be_hidden()  # no coordinator: no cluster card
        load = echo.load(6, text="one two three four five", hold=True)
        try:
            row = page.locator("#refusals tr[data-key=capacity_exceeded]")
            # the load's process may take seconds to start on a loaded machine
            expect(row.locator("td").nth(2)).to_have_text("4", timeout=30_000)
            expect(page.locator("#n-pending")).to_have_text("2")
            pool = page.locator("#pools tr[data-key=echo] td")
            expect(pool.nth(1)).to_have_text("1")  # active
            expect(pool.nth(2)).to_have_text("1")  # waiting
            expect(page.locator("#refusal-chart polyline[data-kind=capacity_exceeded]")).to_have_count(1)
            expect(page.locator("#session-rows tbody tr")).not_to_have_count(0)
        finally:
            out, _ = load.communicate("\n", timeout=60)  # cancels the running and the waiting prompt
        assert sorted(out.split()) == ["cancelled"] * 2 + ["capacity_exceeded"] * 4, out
        expect(page.locator("#n-pending")).to_have_text("0", timeout=10_000)
        expect(page.locator("#pools tr[data-key=echo] td").nth(1)).to_have_text("0")
        expect(row.locator("td").nth(2)).to_have_text("4")
    finally:
        echo.stop()


def test_prompt_streams_the_answer_as_text(page: Page, echo: ServerProcess) -> None:
    _open_sessions(page, echo)
    _prompt(page, "hello " + HOSTILE)
    expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=15_000)
    agent = page.locator("#transcript .msg.agent")
    expect(agent).to_have_text("hello " + HOSTILE)
    seen = (page.get_attribute("#turn", "data-seen") or "").split()
    assert seen[:2] == ["sent", "accepted"] and "running" in seen and seen[-1] == "completed"
    _not_pwned(page)
    # the session is listed, and opening it again renders its replay
    page.click("#refresh")
    page.locator("#session-list li").first.click()
    expect(page.locator("#transcript .msg.user")).to_have_text("hello " + HOSTILE)
    expect(page.locator("#transcript .msg.agent")).to_have_text("hello " + HOSTILE)
    _not_pwned(page)


# Holds this page's session/prompt frames back for a while, as a slow network would: another tab's
# prompt sent meanwhile is admitted first, and its `accepted` reaches this page while its own prompt
# is out and not yet named.
_SLOW_PROMPTS = """() => {
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    if (String(data).includes('"session/prompt"')) setTimeout(() => send.call(this, data), 700);
    else send.call(this, data);
  };
}"""


def test_two_pages_on_one_session_each_follow_and_cancel_their_own_prompt(
    page: Page, other_page: Page, tmp_path: Path
) -> None:
    """Two tabs on one session: each turn bar follows the prompt this tab sent (the turn states name
    the client id a prompt went out as), even when the other tab's `accepted` arrives first; Cancel is
    ``$/cancel_request`` of this tab's own request: its running prompt ends `cancelled` and the other
    tab's prompt, queued behind it, runs on to `completed`."""
    server = _server(tmp_path, "--echo-delay-ms", "3000", "--max-pending-prompts-per-session", "2").start()
    try:
        session_id = _open_sessions(page, server)
        other_page.goto(server.http_url + "/#sessions")
        other_page.click(f"#session-list li[data-session-id='{session_id}']")
        expect(other_page.locator("#transcript")).to_have_attribute("data-loaded", "true")
        other_page.evaluate(_SLOW_PROMPTS)
        _prompt(other_page, "from the other tab")  # goes out 0.7 s late
        _prompt(page, "from this tab")
        mine, theirs = page.locator("#turn"), other_page.locator("#turn")
        expect(mine).to_have_attribute("data-state", "running", timeout=10_000)
        expect(theirs).to_have_attribute("data-prompt-id", re.compile(r"^prompt_"), timeout=10_000)
        assert theirs.get_attribute("data-state") == "accepted"  # behind this tab's prompt, not running
        page.click("#cancel")
        expect(mine).to_have_attribute("data-state", "cancelled", timeout=10_000)
        expect(page.locator("#turn-detail")).to_have_text("request_cancelled")
        expect(page.locator("#send")).to_be_enabled()
        expect(theirs).to_have_attribute("data-state", "completed", timeout=15_000)
        seen = (theirs.get_attribute("data-seen") or "").split()
        assert seen == ["sent", "accepted", "running", "completed"]
        expect(other_page.locator("#transcript .msg.agent").last).to_have_text("from the other tab")
        # the prompt each bar followed is the one its answer names (a cancelled request's error names none)
        ours, other = (p.get_attribute("#turn", "data-prompt-id") for p in (page, other_page))
        assert ours and other and ours != other
        assert other_page.get_attribute("#turn", "data-result-prompt-id") == other
    finally:
        server.stop()


def test_queue_full_refusal_shows_its_retry_time(page: Page, slow_echo: ServerProcess) -> None:
    session_id = _open_sessions(page, slow_echo)
    load = slow_echo.load(1, session=session_id, text="held by another client")
    try:
        expect(page.locator("#n-running")).to_have_text("1", timeout=10_000)  # the hidden ops view
        _prompt(page, "me too")
        notice = page.locator("#notice")
        expect(notice).to_have_attribute("data-kind", "prompt_queue_full", timeout=10_000)
        expect(notice).to_contain_text("Prompt queue full")
        expect(notice.locator(".retry")).to_contain_text("retry in")
        expect(page.locator("#turn")).to_have_attribute("data-state", "refused")
        expect(page.locator("#send")).to_be_enabled()
    finally:
        load.communicate(timeout=60)


def test_restart_then_prompt_again(page: Page, echo: ServerProcess) -> None:
    _open_sessions(page, echo)
    _prompt(page, "before")
    expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=10_000)
    echo.restart()
    expect(page.locator("#conn")).to_have_attribute("data-state", "open", timeout=15_000)
    expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
    expect(page.locator("#transcript .msg.agent")).to_have_text("before")  # the replay, re-rendered
    _prompt(page, "after")
    expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=10_000)
    expect(page.locator("#transcript .msg.agent").last).to_have_text("after")


def test_permission_request_and_hostile_agent_strings(page: Page, tmp_path: Path) -> None:
    agent = ["--", sys.executable, "-m", "tests.agents.fake_agent", "--ask-permission", "--tool-call", "--hostile"]
    server = ServerProcess(tmp_path / "state", agent).start()
    try:
        _open_sessions(page, server)
        _prompt(page, "hi")
        allow = page.locator("#transcript .permission button[data-option-id=allow]")
        expect(allow).to_have_text("Allow" + HOSTILE, timeout=15_000)
        expect(page.locator("#turn")).to_have_attribute("data-state", "paused_for_approval")
        expect(page.locator("#transcript .tool .title")).to_have_text("Read notes.txt" + HOSTILE)
        allow.click()
        expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=15_000)
        expect(page.locator("#transcript .msg.agent").last).to_contain_text("permission:allow")
        expect(page.locator("#transcript .tool .status")).to_have_text("completed")
        _prompt(page, "fail now")
        expect(page.locator("#notice")).to_contain_text("agent failed " + HOSTILE, timeout=15_000)
        _not_pwned(page)
    finally:
        server.stop()


def test_a_stale_client_id_heals_once(page: Page, tmp_path: Path) -> None:
    """The client id expires while the page idles: the next prompt resumes once and goes through."""
    server = ServerProcess(tmp_path / "state", ["--client-idle-timeout-s", "1"]).start()
    try:
        _open_sessions(page, server)
        page.wait_for_timeout(2500)
        _prompt(page, "still here")
        expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=10_000)
        expect(page.locator("#transcript")).to_have_attribute("data-self-heals", "1")
        expect(page.locator("#transcript .msg.agent")).to_have_text("still here")
        expect(page.locator("#notice")).to_be_hidden()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("flags", "waiting", "detail"),
    [
        ([], "waiting_for_dependency", "waiting for a backend permit"),  # a permit of the echo pool (max_active 1)
        (["--max-running-prompts", "1"], "queued", "in the waiting room"),  # a policy seat
    ],
)
def test_a_waiting_prompt_shows_why_then_runs(
    page: Page, tmp_path: Path, flags: list[str], waiting: str, detail: str
) -> None:
    """Behind another session's running prompt, this one waits, and the page says so as the server does."""
    server = _server(tmp_path, "--echo-delay-ms", "3000", *flags).start()
    try:
        _open_sessions(page, server)
        load = server.load(1, text="first in line")
        try:
            expect(page.locator("#n-running")).to_have_text("1", timeout=10_000)  # the hidden ops view
            _prompt(page, "second")
            expect(page.locator("#turn")).to_have_attribute("data-state", waiting, timeout=10_000)
            expect(page.locator("#turn-detail")).to_contain_text(detail)
            expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=15_000)
        finally:
            load.communicate(timeout=60)
        seen = (page.get_attribute("#turn", "data-seen") or "").split()
        assert seen.index(waiting) < seen.index("running") < seen.index("completed")
        expect(page.locator("#transcript .msg.agent").last).to_have_text("second")
    finally:
        server.stop()


def test_a_stored_token_rides_as_a_subprotocol_beside_acp_v1(page: Page, echo: ServerProcess) -> None:
    page.goto(echo.http_url + "/")
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    page.evaluate("() => sessionStorage.setItem('acp-server.token', 'a token')")
    page.reload()
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    expect(page.locator("body")).to_have_attribute("data-subprotocol", "acp.v1")
