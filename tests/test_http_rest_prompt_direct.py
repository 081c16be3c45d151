"""``POST /session/:id/prompt`` answered from its parsed head (``AcpHttpApp.direct_request``): the same
bytes on the wire as the general ASGI path, for every answer, and the general path for what it does not
check itself."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from acp_server.admission import Limits
from acp_server.transports.http.app import AcpHttpApp

from .http_helpers import TIMEOUT_S, http_server


async def _exchange(port: int, request: bytes) -> tuple[bytes, bool]:
    """One request on a fresh connection: its whole answer (``content-length`` framed), and whether the
    server closed the connection after it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head)[1])  # type: ignore[index]
        while len(body) < length:
            body += await stream.receive_some(65536)
        with trio.move_on_after(0.5):
            closed = await stream.receive_some(1) == b""
            return head + b"\r\n\r\n" + body, closed
        return head + b"\r\n\r\n" + body, False


def _request(sid: str, body: bytes, *, extra: bytes = b"", content_type: bytes = b"application/json") -> bytes:
    return (b"POST /session/%s/prompt HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
            % (sid.encode(), content_type, len(body), extra, body))


def _normal(answer: bytes) -> bytes:
    """An answer without its ``date`` (a second apart), its prompt's ids (one per prompt) and so its length."""
    answer = re.sub(rb"date: [^\r]*\r\n", b"", answer)
    answer = re.sub(rb"content-length: \d+", b"content-length: L", answer)
    answer = re.sub(rb'"promptId":"[^"]*"', b'"promptId":"P"', answer)
    return re.sub(rb'"lastEventId":\d+', b'"lastEventId":N', answer)


_PROMPT = b'{"prompt":[{"type":"text","text":"hi"}]}'


async def _answers(sid: str, port: int, client_id: str) -> list[tuple[bytes, bool]]:
    cases = [
        _request(sid, _PROMPT),
        _request(sid, _PROMPT, extra=b"x-qwen-client-id: %s\r\n" % client_id.encode()),
        _request(sid, _PROMPT, extra=b"connection: close\r\n"),
        _request("nope", _PROMPT),
        _request(sid, _PROMPT, content_type=b"text/plain"),
        _request(sid, b"{not json"),
        _request(sid, b"{}"),
        _request(sid, b""),
        _request(sid, b'{"prompt":[{"type":"text","text":"x"}],"deadlineMs":-5}'),
        _request(sid, _PROMPT, extra=b"x-qwen-client-id: bad id!\r\n"),
        _request(sid, _PROMPT, extra=b"x-qwen-client-id: never-registered\r\n"),
        # a header given twice: its first value is the one read, on both paths
        _request(sid, _PROMPT, extra=b"x-qwen-client-id: %s\r\nx-qwen-client-id: bad id!\r\n" % client_id.encode()),
        _request(sid, _PROMPT, extra=b"x-qwen-client-id: bad id!\r\nx-qwen-client-id: %s\r\n" % client_id.encode()),
        _request(sid, _PROMPT, extra=b"content-type: text/plain\r\n"),
        _request(sid, _PROMPT, content_type=b"text/plain", extra=b"content-type: application/json\r\n"),
    ]
    return [await _exchange(port, case) for case in cases]


async def test_direct_answers_are_the_general_paths_bytes(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each answer (202, and every refusal: 404, 415, 400 parse_error and body shape, client id syntax and
    registration, ``Connection: close``) is byte for byte the general path's (but its date and ids), and
    the direct path answered them all; a connection closed after its answer logs no failure."""
    answered: list[Any] = []
    direct: Callable[..., Any] = AcpHttpApp.direct_request

    def spy(self: AcpHttpApp, *args: Any) -> Any:
        answer = direct(self, *args)
        answered.append(answer)
        return answer

    with trio.fail_after(TIMEOUT_S):
        async with http_server(Limits(max_pending_prompts_per_session=0)) as (_server, _outer, url):
            port = int(url.rsplit(":", 1)[1])
            async with httpx.AsyncClient(timeout=10) as c:
                made = (await c.post(url + "/session", json={"cwd": "/tmp", "sessionScope": "thread"})).json()
                sid, client_id = made["sessionId"], made["clientId"]
                monkeypatch.setattr(AcpHttpApp, "direct_request", spy)
                fast = await _answers(sid, port, client_id)
                monkeypatch.setattr(AcpHttpApp, "direct_request", lambda self, *args: None)
                general = await _answers(sid, port, client_id)
    assert len(answered) == len(fast) and all(a is not None for a in answered)
    assert [(_normal(a), closed) for a, closed in fast] == [(_normal(a), closed) for a, closed in general]
    assert [a.split(b" ", 2)[1] for a, _ in fast] == [b"202", b"202", b"202", b"404", b"415", b"400", b"400", b"400",
                                                      b"400", b"400", b"400", b"202", b"400", b"202", b"415"]
    assert [closed for _, closed in fast] == [False, False, True] + [False] * 12
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_what_direct_does_not_check_takes_the_general_path() -> None:
    """A browser's request (``Origin``: CORS headers), one naming a tenant, a foreign ``Host`` or a
    percent-encoded path are not answered directly: the general path answers them as before."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(allow_origins=frozenset({"http://ok.example"})) as (_server, _outer, url):
            port = int(url.rsplit(":", 1)[1])
            async with httpx.AsyncClient(timeout=10) as c:
                sid = (await c.post(url + "/session", json={"cwd": "/tmp", "sessionScope": "thread"})).json()["sessionId"]
            app_calls: list[Any] = []
            direct: Callable[..., Any] = AcpHttpApp.direct_request

            def spy(self: AcpHttpApp, *args: Any) -> Any:
                answer = direct(self, *args)
                app_calls.append(answer)
                return answer

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(AcpHttpApp, "direct_request", spy)
                browser, _ = await _exchange(port, _request(sid, _PROMPT, extra=b"origin: http://ok.example\r\n"))
                tenant, _ = await _exchange(port, _request(sid, _PROMPT, extra=b"x-acp-tenant: other\r\n"))
                foreign, _ = await _exchange(port, _request(sid, _PROMPT).replace(b"host: 127.0.0.1", b"host: evil.example"))
                encoded, _ = await _exchange(port, _request(f"%{ord(sid[0]):02X}{sid[1:]}", _PROMPT))
    assert app_calls == [None, None, None, None]
    assert browser.startswith(b"HTTP/1.1 202 ") and b"access-control-allow-origin: http://ok.example" in browser
    assert tenant.startswith(b"HTTP/1.1 404 ")  # the other tenant has no such session
    assert foreign.startswith(b"HTTP/1.1 403 ")
    assert encoded.startswith(b"HTTP/1.1 202 ")


async def test_plain_prompt_admits_as_the_handler_with_no_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body with no ``_meta`` or deadline is admitted with the bridge's call itself (positional, no
    handler context): the same arguments ``session/prompt``'s handler gives it for that body with the
    header's client id in ``_meta``, and no waiter on the ticket (the turn is read on the SSE stream);
    the turn still ends and frees its slot."""
    calls: list[tuple[Any, ...]] = []
    tickets: list[Any] = []
    admit: Callable[..., Any] | None = None

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert admit is not None
        ticket, duplicate = admit(self, *args, **kwargs)
        names = ("peer", "client_id", "deadline_ms", "cancelled", "channel", "meta", "idempotency_key", "tenant")
        terms = dict(zip(names, args[2:], strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        calls.append((args[0], type(terms["peer"]).__name__, terms["client_id"], terms.get("deadline_ms"),
                      terms.get("cancelled"), type(terms["channel"]).__name__, terms.get("meta"), terms.get("tenant")))
        tickets.append(ticket)
        return ticket, duplicate

    with trio.fail_after(TIMEOUT_S):
        async with http_server() as (server, _outer, url):
            port = int(url.rsplit(":", 1)[1])
            async with httpx.AsyncClient(timeout=10) as c:
                made = (await c.post(url + "/session", json={"cwd": "/tmp", "sessionScope": "thread"})).json()
                sid, client_id = made["sessionId"], made["clientId"]
                admit = type(server.bridge).admit
                monkeypatch.setattr(type(server.bridge), "admit", spy)
                extra = b"x-qwen-client-id: %s\r\n" % client_id.encode()
                plain, _ = await _exchange(port, _request(sid, _PROMPT, extra=extra))
                assert tickets[0].waiters == ()
                # the same prompt through the handler's general path (a _meta member the bridge ignores)
                meta = b'{"prompt":[{"type":"text","text":"hi"}],"_meta":{"x":1}}'
                general, _ = await _exchange(port, _request(sid, meta, extra=extra))
                for ticket in tickets:
                    await ticket.wait()
                assert server.bridge.get(sid).pending_count == 0
    assert plain.startswith(b"HTTP/1.1 202 ") and general.startswith(b"HTTP/1.1 202 ")
    assert calls[0][:6] == calls[1][:6] == (sid, "RestCaller", client_id, None, False, "RestChannel")
    assert calls[0][7] == calls[1][7] == "default"
    assert all(t.settled for t in tickets)
