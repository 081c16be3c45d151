"""Shared test helpers: an in-process server over memory streams, a raw JSON-RPC test client, and
the check that every error the server emits validates against ``schemas/``."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jsonschema
import msgspec
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import Backend
from acp_server.server import Server
from acp_server.store import TURN_STATE
from acp_server.types.ext import TurnStateParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "schemas"

#: make test-full sets this: heavy counts run in full there, reduced in make test.
FULL = os.environ.get("ACP_SERVER_FULL") == "1"


def scaled(full: int, reduced: int) -> int:
    return full if FULL else reduced


_error_validator: jsonschema.protocols.Validator | None = None


def error_validator() -> jsonschema.protocols.Validator:
    """A validator for a JSON-RPC error object, from ``schemas/jsonrpc-error.json`` and the per-kind schemas."""
    global _error_validator
    if _error_validator is None:
        from referencing import Registry, Resource

        registry: Registry = Registry()
        for path in SCHEMAS.rglob("*.json"):
            doc = json.loads(path.read_text())
            if "$id" in doc:
                registry = registry.with_resource(doc["$id"], Resource.from_contents(doc))
        top = json.loads((SCHEMAS / "jsonrpc-error.json").read_text())
        _error_validator = jsonschema.Draft202012Validator(top, registry=registry)
    return _error_validator


def assert_error_valid(error: dict[str, Any]) -> None:
    """Validate one JSON-RPC error object against the committed schemas."""
    error_validator().validate(error)


class RpcError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.error = error
        self.code = error["code"]
        self.data = error.get("data") or {}
        self.kind = self.data.get("errorKind")


class RawClient:
    """A JSON-RPC client over a trio stream that records every message the server sends.

    Every error response it sees is validated against ``schemas/`` (so any test using it checks the
    error contract for free). Notifications land in ``self.notifications``, except turn states, which
    land in ``self.turn_states``.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.next_id = 1
        self.waiting: dict[Any, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.notifications: list[dict[str, Any]] = []
        #: ``_acp_server/turn_state`` params, in arrival order (not in ``notifications``)
        self.turn_states: list[dict[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.notified = trio.Event()
        self.eof = trio.Event()
        self._buf = b""
        self.requests_from_server: list[dict[str, Any]] = []
        self._send_lock = trio.Lock()

    async def pump(self) -> None:
        try:
            while True:
                data = await self.stream.receive_some(65536)
                if not data:
                    break
                self._buf += data
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    if line.strip():
                        self._dispatch(json.loads(line))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.eof.set()

    def _dispatch(self, msg: Any) -> None:
        self.messages.append(msg)
        items = msg if isinstance(msg, list) else [msg]
        for item in items:
            if "error" in item:
                assert_error_valid(item["error"])
                self.errors.append(item["error"])
            if "method" in item:
                if "id" in item:
                    self.requests_from_server.append(item)
                elif item["method"] == TURN_STATE:
                    # Checked against the wire type; kept apart so that update counts stay what they were.
                    msgspec.convert(item["params"], TurnStateParams)
                    self.turn_states.append(item["params"])
                else:
                    self.notifications.append(item)
                self.notified.set()
                self.notified = trio.Event()
            elif not isinstance(msg, list) and item.get("id") in self.waiting:
                self.waiting.pop(item["id"]).send_nowait(item)

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(data)

    async def send(self, obj: Any) -> None:
        await self.send_raw(json.dumps(obj).encode() + b"\n")

    async def notify(self, method: str, params: Any = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg)

    def start_request(self, method: str, params: Any = None, *, id: Any = None) -> tuple[Any, trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Register a request id and its reply channel (send it with :meth:`send`)."""
        if id is None:
            id = self.next_id
            self.next_id += 1
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.waiting[id] = send
        return id, receive

    async def call_raw(self, method: str, params: Any = None, *, id: Any = None) -> dict[str, Any]:
        """Send a request and return the whole response message."""
        id, receive = self.start_request(method, params, id=id)
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg)
        return await receive.receive()

    async def call(self, method: str, params: Any = None, *, id: Any = None) -> Any:
        """Send a request; return its result or raise :class:`RpcError`."""
        resp = await self.call_raw(method, params, id=id)
        if "error" in resp:
            raise RpcError(resp["error"])
        return resp["result"]

    async def initialize(self, *, turn_states: bool | None = True) -> dict[str, Any]:
        """``initialize``, asking for ``_acp_server/turn_state`` (``_meta.turnStates``) unless told
        otherwise: ``None`` sends no word, so the server's ``--turn-states`` (default off) decides."""
        params: dict[str, Any] = {"protocolVersion": 1, "clientCapabilities": {}}
        if turn_states is not None:
            params["_meta"] = {"turnStates": turn_states}
        return await self.call("initialize", params)  # type: ignore[no-any-return]

    async def new_session(self, cwd: str = "/tmp", **meta: Any) -> tuple[str, str]:
        params: dict[str, Any] = {"cwd": cwd, "mcpServers": []}
        if meta:
            params["_meta"] = meta
        result = await self.call("session/new", params)
        return result["sessionId"], result["_meta"]["clientId"]

    async def prompt(self, session_id: str, text: str = "hello world", **meta: Any) -> Any:
        params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
        if meta:
            params["_meta"] = meta
        return await self.call("session/prompt", params)

    def updates(self, session_id: str) -> list[dict[str, Any]]:
        return [
            n["params"] for n in self.notifications if n["method"] == "session/update" and n["params"]["sessionId"] == session_id
        ]

    def agent_text(self, session_id: str) -> str:
        return "".join(
            u["update"]["content"]["text"] for u in self.updates(session_id) if u["update"]["sessionUpdate"] == "agent_message_chunk"
        )


@asynccontextmanager
async def running_server(
    limits: Limits | None = None, backend: Backend | None = None, *, drain_timeout_s: float = 0, **options: Any
) -> AsyncIterator[tuple[Server, trio.Nursery]]:
    """A server with its bridge running, inside a nursery; cancelled on exit.

    ``drain_timeout_s`` is 0 by default: in these tests a client that closes its stream has left (the
    half-close drain is tested on its own, in ``test_half_close.py``). ``options`` go to
    :class:`Server` (e.g. ``capacity``, ``policy``).
    """
    server = Server(limits, backend, drain_timeout_s=drain_timeout_s, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        yield server, nursery
        nursery.cancel_scope.cancel()


async def connect(server: Server, nursery: trio.Nursery, *, initialize: bool = True) -> RawClient:
    """A new in-memory connection to ``server`` with a :class:`RawClient` on the other end."""
    client_end, server_end = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle_stream, server_end, "test")
    client = RawClient(client_end)
    nursery.start_soon(client.pump)
    if initialize:
        await client.initialize()
    return client


def rows_of(directory: pathlib.Path, query: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of a query on what the session store in ``directory`` made durable, read by a connection of our own."""
    from acp_server.store import DB_NAME
    from acp_server.store.writer import applied_copy

    db = applied_copy(directory / DB_NAME)  # what is durable: the tables and the log not yet applied
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def stored_events(directory: pathlib.Path, session_id: str | None = None) -> list[tuple[str, int, str | None, Any]]:
    """Every transcript entry in the store in ``directory`` (of one session, or of all), in order:
    (session id, eventId, method or None for a session/update, decoded body)."""
    import msgspec

    from acp_server.store.writer import chunk_events

    query = "SELECT session_id, body FROM chunks" + (" WHERE session_id = ?" if session_id else "") + " ORDER BY seq"
    return [
        (sid, event_id, method, msgspec.json.decode(body))
        for sid, chunk in rows_of(directory, query, *([session_id] if session_id else []))
        for event_id, method, body in chunk_events(chunk)
    ]
