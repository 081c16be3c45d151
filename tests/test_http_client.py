"""Our client SDK over ``http://.../acp`` and ``ws://.../acp``: the same :class:`Client` as ``tcp://``.

Each test runs a real server with a real HTTP listener in this process; the client speaks to it over
loopback through :mod:`acp_server.client.remote` (httpx) or :mod:`acp_server.client.websocket`.
"""

from __future__ import annotations

import pathlib

import pytest
import trio

from acp_server.admission import Limits
from acp_server.backends import EchoBackend
from acp_server.client import ConnectionLostError, RetryPolicy, RpcError, connect
from acp_server.errors import RETRY_AFTER_MS
from acp_server.server import ListenAddress, Server
from acp_server.store import SessionStore
from acp_server.transports.http import HttpLimits, HttpOptions, serve_http

from .http_helpers import TIMEOUT_S, eventually, http_server

SCHEMES = ["http", "ws"]


def endpoint(url: str, scheme: str) -> str:
    return (url if scheme == "http" else url.replace("http://", "ws://")) + "/acp"


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_prompt_updates_and_cancel(scheme: str) -> None:
    """A prompt streams its updates and ends ``end_turn``; a running prompt cancelled by its caller
    sends ``$/cancel_request`` and the server's turn ends (nothing is left pending)."""
    with trio.fail_after(TIMEOUT_S):
        async with http_server(backend=EchoBackend(delay_ms=300)) as (server, _n, url):
            async with connect(endpoint(url, scheme)) as client:
                session = await client.new_session("/tmp")
                result = await session.prompt("over the web")
                assert result.stop_reason == "end_turn"
                assert len(server.connections) == 1
                server.bridge.backend.delay_ms = 10_000  # type: ignore[attr-defined]
                with trio.move_on_after(0.5):
                    await session.prompt("cancelled by its caller")
                await eventually(lambda: server.bridge.statistics().pending_prompts == 0)
                server.bridge.backend.delay_ms = 0  # type: ignore[attr-defined]
                assert (await session.prompt("after")).stop_reason == "end_turn"
            await eventually(lambda: not server.connections)


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_retry_after_retry_after_ms(scheme: str) -> None:
    """A prompt refused ``prompt_queue_full`` (the only slot taken by another client) is sent again
    ``retryAfterMs`` later and succeeds once the slot is free."""
    with trio.fail_after(TIMEOUT_S):
        backend = EchoBackend(delay_ms=1000)
        async with http_server(Limits(max_pending_prompts_per_session=1), backend) as (_server, nursery, url):
            async with connect(endpoint(url, scheme)) as a, connect(endpoint(url, scheme)) as b:
                session = await a.new_session("/tmp")
                other = await b.resume_session(session.session_id, "/tmp")
                nursery.start_soon(session.prompt, "holding the slot")
                await trio.sleep(0.3)
                started = trio.current_time()
                call = other.prompt_call("retried", retry=RetryPolicy())
                result = await call.run()
                waited = trio.current_time() - started
                assert result.stop_reason == "end_turn"
                assert call.attempts == 2
                assert waited >= RETRY_AFTER_MS / 1000 * 0.9


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_self_heal_after_a_restart(scheme: str, tmp_path: pathlib.Path) -> None:
    """The server restarts (same port, same state directory): the old connection ends (it does not
    hang), a new connection takes the session back by its old client id (re-registered by the
    client's self-heal when the server no longer knows it) and prompts it."""
    port = 0
    sid = client_id = ""
    for round in range(2):
        with trio.fail_after(TIMEOUT_S):
            server = Server(store=SessionStore(str(tmp_path)))
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.bridge.run)
                    options = HttpOptions(limits=HttpLimits())
                    url = await nursery.start(
                        serve_http, server.handle_stream, ListenAddress("tcp", host="127.0.0.1", port=port), options
                    )
                    port = int(url.rsplit(":", 1)[1])
                    async with connect(endpoint(url, scheme)) as client:
                        if round == 0:
                            session = await client.new_session("/tmp")
                            sid, client_id = session.session_id, session.client_id or ""
                            assert (await session.prompt("before the restart")).stop_reason == "end_turn"
                        else:
                            heals: list[tuple[str | None, str]] = []
                            session = client.use_session(sid, client_id=client_id, cwd="/tmp")
                            session.on_self_heal = lambda old, new, heals=heals: heals.append((old, new))
                            assert (await session.prompt("after the restart")).stop_reason == "end_turn"
                            assert session.client_id is not None
                            # the new HTTP connection had not established the session: one resume healed it
                            assert heals == [(client_id, session.client_id)] and session.self_heals == 1
                    nursery.cancel_scope.cancel()
            finally:
                if server.store is not None:
                    server.store.close()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_restart_ends_the_old_connection(scheme: str) -> None:
    """The server behind an open client goes away: the client's calls fail with
    :class:`ConnectionLostError` instead of hanging."""
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as outer:
            server_scope = trio.CancelScope()
            started = trio.Event()
            urls: list[str] = []

            async def run_server() -> None:
                with server_scope:
                    async with http_server() as (_s, _n, url):
                        urls.append(url)
                        started.set()
                        await trio.sleep_forever()

            outer.start_soon(run_server)
            await started.wait()
            async with connect(endpoint(urls[0], scheme)) as client:
                session = await client.new_session("/tmp")
                server_scope.cancel()
                await trio.sleep(0.3)
                with pytest.raises((ConnectionLostError, RpcError, OSError)):
                    await session.prompt("nobody there")
