"""The console's token sign-in in a real browser against ``serve --auth-tokens``: the form when the
server wants a token, a readable error for a wrong one, the token kept in ``sessionStorage`` and
offered as the WebSocket subprotocol ``acp-bearer.<base64url>`` beside ``acp.v1``, the stats needing
a token with the admin or metrics scope, sign-out, a revoked token's socket closed by the server."""

from __future__ import annotations

import base64
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from acp_server.auth.tokens import TokenRecord, hash_secret, new_secret, write_tokens
from tests.web_helpers import ServerProcess, launch

TOKEN_KEY = "acp-server.token"


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


def _record(token_id: str, secret: str, tenant: str, *scopes: str) -> TokenRecord:
    return TokenRecord(token_id, bytes.fromhex(hash_secret(secret)), tenant, frozenset(scopes))


def _sign_in(page: Page, token: str) -> None:
    page.fill("#token-input", token)
    page.click("#sign-in")


def test_sign_in_with_a_token(page: Page, tmp_path: Path) -> None:
    acme, root = new_secret(), new_secret()
    tokens = tmp_path / "tokens.toml"
    write_tokens(str(tokens), [_record("acme", acme, "acme"), _record("root", root, "ops", "admin")])
    server = ServerProcess(tmp_path / "state", ["--auth-tokens", str(tokens), "--echo-delay-ms", "200"]).start()
    try:
        # the server asks for a token: the page says so and waits (no reconnect loop)
        assert httpx.get(server.http_url + "/capabilities").status_code == 401
        assert httpx.get(server.http_url + "/capabilities", headers={"authorization": f"Bearer {acme}"}).status_code == 200
        page.goto(server.http_url + "/#sessions")
        conn, error = page.locator("#conn"), page.locator("#token-error")
        expect(conn).to_have_attribute("data-state", "token", timeout=10_000)
        expect(page.locator("#token-form")).to_be_visible()
        expect(error).to_have_attribute("data-kind", "needed")

        # a wrong token: a readable refusal, and it is not kept
        _sign_in(page, "not-the-token")
        expect(error).to_have_attribute("data-kind", "unauthorized", timeout=10_000)
        expect(error).to_contain_text("The server refused that token (401 unauthorized)")
        expect(conn).to_have_attribute("data-state", "token")
        assert page.evaluate(f"() => sessionStorage.getItem('{TOKEN_KEY}')") is None

        # the tenant's token: connected over acp.v1, kept for this tab, the sessions view works; the
        # stats need a scope this token lacks, and the operations view says so
        _sign_in(page, acme)
        expect(conn).to_have_attribute("data-state", "open", timeout=10_000)
        expect(page.locator("#token-form")).to_be_hidden()
        expect(page.locator("body")).to_have_attribute("data-subprotocol", "acp.v1")
        assert page.evaluate(f"() => sessionStorage.getItem('{TOKEN_KEY}')") == acme
        offered = page.evaluate("() => import('/console/rpc.js').then((m) => m.subprotocols())")
        assert offered == ["acp.v1", "acp-bearer." + base64.urlsafe_b64encode(acme.encode()).decode().rstrip("=")]
        page.click("#new-session")
        expect(page.locator("#transcript")).to_have_attribute("data-loaded", "true")
        page.fill("#prompt-input", "signed in")
        page.click("#send")
        expect(page.locator("#turn")).to_have_attribute("data-state", "completed", timeout=10_000)
        expect(page.locator("#transcript .msg.agent")).to_have_text("signed in")
        page.click("#tab-ops")
        expect(page.locator("#ops-notice")).to_contain_text("admin or metrics")

        # a reload keeps the token (sessionStorage); sign-out forgets it and the form comes back
        page.reload()
        expect(conn).to_have_attribute("data-state", "open", timeout=10_000)
        page.click("#sign-out")
        expect(conn).to_have_attribute("data-state", "token", timeout=10_000)
        expect(error).to_have_attribute("data-kind", "needed")
        assert page.evaluate(f"() => sessionStorage.getItem('{TOKEN_KEY}')") is None

        # an admin token reads the live figures
        _sign_in(page, root)
        expect(conn).to_have_attribute("data-state", "open", timeout=10_000)
        expect(page.locator("#ops-notice")).to_be_hidden()
        expect(page.locator("#transports tr[data-key=ws] td").nth(1)).to_have_text("1", timeout=10_000)

        # the page's fetches carry the token as a bearer: its probe (what explains a closed socket) is
        # answered 200 with it, 401 without; a restart reconnects with the token kept
        probe = "() => import('/console/rpc.js').then((m) => m.probe())"
        assert page.evaluate(probe) == {"status": 200, "retryAfterS": 0, "message": ""}
        server.restart()
        expect(conn).to_have_attribute("data-state", "open", timeout=15_000)
        expect(page.locator("#token-form")).to_be_hidden()
        assert page.evaluate(f"() => sessionStorage.getItem('{TOKEN_KEY}')") == root
        page.evaluate(f"() => sessionStorage.removeItem('{TOKEN_KEY}')")
        unauthorized = page.evaluate(probe)
        assert unauthorized["status"] == 401 and unauthorized["message"]
        page.evaluate(f"() => sessionStorage.setItem('{TOKEN_KEY}', {root!r})")

        # the token revoked (SIGHUP reloads the file): the server closes the socket, the page asks for a token
        write_tokens(str(tokens), [_record("acme", acme, "acme")])
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        expect(conn).to_have_attribute("data-state", "token", timeout=10_000)
        expect(error).to_have_attribute("data-kind", "unauthorized")
    finally:
        server.stop()
