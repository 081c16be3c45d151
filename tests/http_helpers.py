"""Helpers for the ``/acp`` tests: a live HTTP listener on a real server, and a raw HTTP+SSE peer.

The peer speaks the RFD's transport by hand with httpx (trio), so each test sees the status codes,
headers and event streams themselves; every error body it meets is checked against ``schemas/``.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import jsonschema
import referencing
import trio

from acp_server.admission import Limits
from acp_server.backends import Backend
from acp_server.errors import REGISTRY
from acp_server.server import ListenAddress, Server
from acp_server.transports.http import HttpLimits, HttpOptions, serve_http

from .helpers import assert_error_valid, running_server

TIMEOUT_S = 20.0
#: ``initialize`` as the ``/acp`` and WebSocket test peers send it: they ask for ``_acp_server/turn_state``
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1, "_meta": {"turnStates": True}}}


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds (a server-side effect with no event to wait on)."""
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - state of the server, polled
            await trio.sleep(0.01)


_HTTP_SCHEMAS = pathlib.Path(__file__).resolve().parent.parent / "schemas" / "http"


@functools.cache
def http_error_validator() -> jsonschema.Draft202012Validator:
    """A validator of ``schemas/http/error.json`` (every non-2xx body), its sibling files resolved."""
    resources = [
        (doc["$id"], referencing.Resource.from_contents(doc))
        for doc in (json.loads(p.read_text()) for p in _HTTP_SCHEMAS.glob("*.json") if p.name != "openapi.json")
    ]
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(resources)
    root = json.loads((_HTTP_SCHEMAS / "error.json").read_text())
    return jsonschema.Draft202012Validator(root, registry=registry)


def assert_http_error_valid(body: Any) -> None:
    """``body`` validates against ``schemas/http/error.json`` (and against its kind's own file)."""
    http_error_validator().validate(body)
    kind_schema = json.loads((_HTTP_SCHEMAS / f"{body['code']}.json").read_text())
    jsonschema.Draft202012Validator(kind_schema).validate(body)


def check_error_body(response: httpx.Response) -> dict[str, Any]:
    """The body of a non-2xx answer: ``{"error", "code", ...data}``; it validates against
    ``schemas/http/`` and its data as the JSON-RPC error of the same kind would."""
    body = response.json()
    assert set(body) >= {"error", "code"}, body
    assert_http_error_valid(body)
    kind = body["code"]
    data = {k: v for k, v in body.items() if k not in ("error", "code")}
    assert_error_valid({"code": REGISTRY[kind].code, "message": body["error"], "data": {"errorKind": kind, **data}})
    return body


@asynccontextmanager
async def http_server(
    limits: Limits | None = None,
    backend: Backend | None = None,
    *,
    allow_origins: frozenset[str] = frozenset(),
    server_options: Mapping[str, Any] | None = None,
    **http: Any,
) -> AsyncIterator[tuple[Server, trio.Nursery, str]]:
    """A server (bridge running) with an HTTP listener on a free loopback port; yields its base URL.

    ``server_options`` go to :class:`Server` (e.g. ``capacity``, ``policy``), ``http`` to ``HttpLimits``.
    """
    async with running_server(limits, backend, **(server_options or {})) as (server, nursery):
        lim = server.limits
        options = HttpOptions(
            limits=HttpLimits(max_message_bytes=lim.max_message_bytes, max_outbound_bytes=lim.outbound_bytes, **http),
            allow_origins=allow_origins,
        )
        url = await nursery.start(serve_http, server.handle_stream, ListenAddress("tcp", host="127.0.0.1", port=0), options)
        yield server, nursery, url


class SseStream:
    """One open event stream: every message it carried, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.ended = trio.Event()
        self.opened = trio.Event()
        self._changed = trio.Event()
        self.scope = trio.CancelScope()

    def push(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            for message in self.messages:
                if predicate(message):
                    return message
            if self.ended.is_set():
                raise AssertionError(f"the stream ended without it; got {self.messages}")
            await self._changed.wait()


class HttpPeer:
    """A client of ``/acp`` over HTTP+SSE, by hand."""

    def __init__(self, client: httpx.AsyncClient, url: str, nursery: trio.Nursery) -> None:
        self.client = client
        self.url = url + "/acp"
        self.nursery = nursery
        self.connection_id: str | None = None
        self.next_id = 1
        self.conn_stream: SseStream | None = None
        self.session_streams: dict[str, SseStream] = {}

    async def initialize(self, params: dict[str, Any] | None = None) -> dict[str, Any]:
        body = dict(INIT, params=params or INIT["params"])
        r = await self.client.post(self.url, json=body)
        assert r.status_code == 200, r.text
        self.connection_id = r.headers["acp-connection-id"]
        self.conn_stream = await self.open_stream()
        result: dict[str, Any] = r.json()
        return result

    def headers(self, session_id: str | None = None) -> dict[str, str]:
        out = {"acp-connection-id": self.connection_id or ""}
        if session_id is not None:
            out["acp-session-id"] = session_id
        return out

    async def post(self, method: str, params: Any = None, *, session_id: str | None = None, id: Any = "auto") -> tuple[Any, httpx.Response]:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if id == "auto":
            id = self.next_id
            self.next_id += 1
        if id is not None:
            message["id"] = id
        if params is not None:
            message["params"] = params
        r = await self.client.post(self.url, json=message, headers=self.headers(session_id))
        return id, r

    async def open_stream(self, session_id: str | None = None) -> SseStream:
        stream = SseStream()

        async def read() -> None:
            try:
                with stream.scope:
                    async with self.client.stream(
                        "GET", self.url, headers={"accept": "text/event-stream", **self.headers(session_id)}
                    ) as r:
                        stream.status, stream.headers = r.status_code, r.headers
                        stream.opened.set()
                        if r.status_code != 200:
                            return
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                stream.push(json.loads(line[6:]))
            except httpx.HTTPError:
                pass
            finally:
                stream.opened.set()
                stream.ended.set()

        self.nursery.start_soon(read)
        await stream.opened.wait()
        if session_id is not None:
            self.session_streams[session_id] = stream
        return stream

    async def new_session(self) -> str:
        id, r = await self.post("session/new", {"cwd": "/tmp", "mcpServers": []})
        assert r.status_code == 202, r.text
        assert self.conn_stream is not None
        answer = await self.conn_stream.wait_for(lambda m: m.get("id") == id)
        sid: str = answer["result"]["sessionId"]
        await self.open_stream(sid)
        return sid

    async def prompt(self, sid: str, text: str) -> dict[str, Any]:
        """Send a prompt and wait for its answer on the session stream."""
        id, r = await self.post("session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}, session_id=sid)
        assert r.status_code == 202, r.text
        answer = await self.session_streams[sid].wait_for(lambda m: m.get("id") == id and "method" not in m)
        return answer


@asynccontextmanager
async def http_peer(url: str, nursery: trio.Nursery, **client: Any) -> AsyncIterator[HttpPeer]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), **client) as c:
        peer = HttpPeer(c, url, nursery)
        try:
            yield peer
        finally:
            for stream in [peer.conn_stream, *peer.session_streams.values()]:
                if stream is not None:
                    stream.scope.cancel()
