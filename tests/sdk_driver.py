"""Drive acp-server with the official ACP Python SDK (``acp``, asyncio) and print a JSON summary.

The tests spawn this script with ``sys.executable`` because the SDK runs on asyncio and the test suite
on trio. Usage::

    python tests/sdk_driver.py stdio [--echo-delay-ms N]   # spawns `python -m acp_server serve --stdio`
    python tests/sdk_driver.py tcp://127.0.0.1:PORT        # connects to a running server
    python tests/sdk_driver.py unix:/path/to.sock
    python tests/sdk_driver.py connect:tcp://127.0.0.1:PORT  # spawns `python -m acp_server connect URL`
    python tests/sdk_driver.py http://127.0.0.1:PORT/acp     # the SDK's Streamable HTTP client
    python tests/sdk_driver.py ws://127.0.0.1:PORT/acp       # the SDK's WebSocket client
    python tests/sdk_driver.py https://localhost:PORT/acp    # the same over TLS (wss:// too), and
    python tests/sdk_driver.py tls://localhost:PORT          # NDJSON over TLS: the CA in SSL_CERT_FILE

The scenario: ``initialize`` (asking for turn states) -> ``session/new`` -> one prompt -> three concurrent prompts on the session
-> a prompt cancelled with ``session/cancel`` while it runs -> one more prompt -> ``_acp_server/stats``.
Every message the server sends is recorded by a stream observer and, at the end, validated against the
SDK's pydantic models picked by its kind (the response to ``session/prompt`` against ``PromptResponse``,
a ``session/update`` against ``SessionNotification``, ...). A model may quietly replace a malformed
field by its default (the SDK's lenient deserialisation), so each result is also dumped back and
compared with what was sent: a difference is reported as a failure too. The summary goes to stdout;
the script itself asserts nothing, the test does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import ssl
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import urlsplit

import acp
from acp import schema
from acp.connection import StreamDirection, StreamEvent
from pydantic import BaseModel, ValidationError

#: The model each of our requests' results must validate against.
RESULT_MODELS: dict[str, type[BaseModel]] = {
    "initialize": schema.InitializeResponse,
    "session/new": schema.NewSessionResponse,
    "session/prompt": schema.PromptResponse,
    "session/list": schema.ListSessionsResponse,
    "session/load": schema.LoadSessionResponse,
}
#: The model of the params of each request an agent behind us may send the client (relayed).
REQUEST_MODELS: dict[str, type[BaseModel]] = {"session/request_permission": schema.RequestPermissionRequest}
#: The model of each notification's params.
NOTIFICATION_MODELS: dict[str, type[BaseModel]] = {"session/update": schema.SessionNotification}
TIMEOUT_S = 30.0

FIRST_TEXT = "hello from the official sdk"
CONCURRENT_TEXTS = ["alpha one", "beta two  three", "gamma\tfour five "]
CANCEL_TEXT = "cancel me while I run"
AFTER_TEXT = "still alive after the cancel"



TURN_STATE = "_acp_server/turn_state"
TURN_STATES = {
    "accepted", "queued", "waiting_for_dependency", "running", "paused_for_approval", "completed", "failed", "cancelled",
}


def _turn_state_problem(params: Any) -> str | None:
    """What is wrong with ``_acp_server/turn_state`` params (written here from the README, not imported)."""
    if not isinstance(params, dict):
        return "params is not an object"
    allowed = {"sessionId", "promptId", "state", "at", "reason", "positionHint", "_meta"}
    if set(params) - allowed:
        return f"unknown fields {sorted(set(params) - allowed)}"
    if not isinstance(params.get("sessionId"), str) or not isinstance(params.get("promptId"), str):
        return "sessionId and promptId must be strings"
    if params.get("state") not in TURN_STATES:
        return f"state {params.get('state')!r} is not a turn state"
    if not isinstance(params.get("at"), int) or params["at"] < 1_600_000_000_000:
        return "at must be epoch milliseconds"
    meta = params.get("_meta")
    if not isinstance(meta, dict) or not isinstance(meta.get("eventId"), int):
        return "_meta.eventId missing"
    return None

class SdkErrors(logging.Handler):
    """Collects what the SDK logs at ERROR: unparsable lines, handlers failing on a bad payload."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


class RecordingClient:
    """The client side: records every ``session/update`` the SDK delivers (already parsed by it)."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, Any]] = []
        self.agent_chunk = asyncio.Event()
        #: answer permission requests with "allow" (the agent scenario) instead of refusing them
        self.allow = False
        self.permission_requests = 0

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append((session_id, update))
        if getattr(update, "session_update", None) == "agent_message_chunk":
            self.agent_chunk.set()

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        if not self.allow:
            raise acp.RequestError.method_not_found("session/request_permission")
        self.permission_requests += 1
        return schema.RequestPermissionResponse(outcome=schema.AllowedOutcome(outcome="selected", option_id="allow"))

    def agent_text(self, start: int = 0) -> str:
        return "".join(
            u.content.text
            for _, u in self.updates[start:]
            if getattr(u, "session_update", "") == "agent_message_chunk"
        )

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, u in self.updates:
            out[u.session_update] = out.get(u.session_update, 0) + 1
        return out


class Recorder:
    """A stream observer: every message in both directions, in order."""

    def __init__(self) -> None:
        self.incoming: list[dict[str, Any]] = []
        self.request_methods: dict[Any, str] = {}

    def __call__(self, event: StreamEvent) -> None:
        msg = event.message
        if event.direction is StreamDirection.INCOMING:
            self.incoming.append(msg)
        elif "id" in msg and "method" in msg:
            self.request_methods[msg["id"]] = msg["method"]


def _round_trip_diff(model: BaseModel, raw: Any) -> str | None:
    """What the model lost or changed of ``raw`` (``None``: nothing)."""
    dumped = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return (
        None
        if dumped == raw
        else f"sent {json.dumps(raw, sort_keys=True)}, model kept {json.dumps(dumped, sort_keys=True)}"
    )


def validate_all(recorder: Recorder) -> tuple[dict[str, int], list[str]]:
    """Validate every incoming message by its kind; returns counts per model and the failures."""
    counts: dict[str, int] = {}
    failures: list[str] = []

    def check(model: type[BaseModel], raw: Any, what: str, *, exact: bool = True) -> None:
        try:
            parsed = model.model_validate(raw)
        except ValidationError as exc:
            failures.append(f"{what}: {model.__name__}: {exc}")
            return
        # The envelope models end in unions with ``Any``: only the payload models are compared exactly.
        diff = _round_trip_diff(parsed, raw) if exact else None
        if diff is not None:
            failures.append(f"{what}: {model.__name__} salvaged or dropped fields: {diff}")
            return
        counts[model.__name__] = counts.get(model.__name__, 0) + 1

    for msg in recorder.incoming:
        what = json.dumps(msg)[:300]
        if msg.get("jsonrpc") != "2.0":
            failures.append(f"{what}: not JSON-RPC 2.0")
            continue
        if "method" in msg:
            if "id" in msg:
                request_model = REQUEST_MODELS.get(msg["method"])
                if request_model is None:
                    failures.append(f"{what}: the echo agent sent a request to the client")
                else:
                    check(request_model, msg.get("params"), what)
                continue
            check(schema.AgentNotification, msg, what, exact=False)
            if msg["method"] == TURN_STATE:
                # Our extension notification (ACP lets agents send ``_``-prefixed ones): checked
                # against our wire type, since the SDK has no model for it.
                problem = _turn_state_problem(msg.get("params"))
                if problem:
                    failures.append(f"{what}: turn_state: {problem}")
                else:
                    counts["TurnState"] = counts.get("TurnState", 0) + 1
                continue
            model = NOTIFICATION_MODELS.get(msg["method"])
            if model is None:
                failures.append(f"{what}: no SDK model for notification {msg['method']!r}")
            else:
                check(model, msg.get("params"), what)
        elif "error" in msg:
            check(schema.AgentErrorMessage, msg, what, exact=False)
        elif "result" in msg:
            check(schema.AgentResponseMessage, msg, what, exact=False)
            method = recorder.request_methods.get(msg["id"])
            if method is None:
                failures.append(f"{what}: answers no request we sent")
            elif method.startswith("_"):
                counts["extension result"] = counts.get("extension result", 0) + 1
            elif method in RESULT_MODELS:
                check(RESULT_MODELS[method], msg["result"], what)
            else:
                failures.append(f"{what}: no SDK model for the result of {method!r}")
        else:
            failures.append(f"{what}: neither a request, a notification nor a response")
    return counts, failures


@contextlib.asynccontextmanager
async def connect(
    target: str, client: RecordingClient, recorder: Recorder, delay_ms: int
) -> AsyncIterator[Any]:
    """A ``ClientSideConnection`` to the server: spawned over stdio, or over a TCP/Unix socket."""
    if target == "stdio" or target.startswith("connect:"):
        # The SDK trims the child's environment and pipes stderr without reading it: pass ours and
        # let the server's stderr go to ours (the test reads it), so it can never fill a pipe.
        args = ["-m", "acp_server", "serve", "--stdio", "--echo-delay-ms", str(delay_ms)]
        if target.startswith("connect:"):
            args = ["-m", "acp_server", "connect", target[len("connect:") :]]
        async with acp.spawn_agent_process(
            cast(acp.Client, client),
            sys.executable,
            *args,
            env=dict(os.environ),
            transport_kwargs={"stderr": None},
            observers=[recorder],
        ) as (conn, _process):
            yield conn
        return
    if target.startswith(("https://", "tls://")):
        # Over TLS the server's certificate is checked against the system trust store, which honours
        # SSL_CERT_FILE (the test's CA); the SDK's own streams run over the verified connection.
        context = ssl.create_default_context()
        parts = urlsplit(target)
        if target.startswith("tls://"):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port, ssl=context)
            conn = acp.connect_to_agent(cast(acp.Client, client), writer, reader, observers=[recorder])
            try:
                yield conn
            finally:
                await conn.close()
                writer.close()
                with contextlib.suppress(ConnectionError, ssl.SSLError):
                    await writer.wait_closed()
            return
        import httpx
        from acp.http import create_http_stream

        async with httpx.AsyncClient(http2=True, timeout=httpx.Timeout(None), verify=context) as http:
            conn = acp.connect_to_agent(cast(acp.Client, client), create_http_stream(target, client=http), observers=[recorder])
            try:
                yield conn
            finally:
                await conn.close()
        return
    if target.startswith(("http://", "ws://", "wss://")):
        if target.startswith("http://"):
            from acp.http import create_http_stream

            transport = create_http_stream(target)
        else:
            from acp.ws import create_websocket_stream

            transport = await create_websocket_stream(target)
        conn = acp.connect_to_agent(cast(acp.Client, client), transport, observers=[recorder])
        try:
            yield conn
        finally:
            await conn.close()
        return
    if target.startswith("tcp://"):
        parts = urlsplit(target)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    elif target.startswith("unix:"):
        reader, writer = await asyncio.open_unix_connection(target[len("unix:") :])
    else:
        raise SystemExit(f"unknown target {target!r}")
    conn = acp.connect_to_agent(cast(acp.Client, client), writer, reader, observers=[recorder])
    try:
        yield conn
    finally:
        await conn.close()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def text(t: str) -> Any:
    return acp.text_block(t)


async def scenario(target: str, delay_ms: int) -> dict[str, Any]:
    client = RecordingClient()
    recorder = Recorder()
    out: dict[str, Any] = {"target": target}
    async with connect(target, client, recorder, delay_ms) as conn:
        init = await conn.initialize(
            protocol_version=acp.PROTOCOL_VERSION,
            client_capabilities=schema.ClientCapabilities(),
            client_info=schema.Implementation(name="sdk-driver", version="0"),
            turnStates=True,  # _meta.turnStates: the scenario validates every turn state it gets
        )
        out["protocolVersion"] = init.protocol_version
        out["agentName"] = init.agent_info.name if init.agent_info else None

        session = await conn.new_session(cwd=tempfile.gettempdir(), mcp_servers=[])
        sid = session.session_id
        out["sessionId"] = sid

        mark = len(client.updates)
        first = await conn.prompt(session_id=sid, prompt=[text(FIRST_TEXT)])
        out["first"] = {"sent": FIRST_TEXT, "stopReason": first.stop_reason, "text": client.agent_text(mark)}

        mark = len(client.updates)
        results = await asyncio.gather(
            *(conn.prompt(session_id=sid, prompt=[text(t)]) for t in CONCURRENT_TEXTS)
        )
        out["concurrent"] = {
            "sent": CONCURRENT_TEXTS,
            "stopReasons": [r.stop_reason for r in results],
            "text": client.agent_text(mark),
        }

        mark = len(client.updates)
        client.agent_chunk.clear()
        running = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text(CANCEL_TEXT)]))
        # The echo agent streams its chunks as soon as the turn starts, then waits out its delay:
        # a chunk means the prompt is running now.
        await client.agent_chunk.wait()
        await conn.cancel(session_id=sid)
        cancelled = await running
        out["cancelled"] = {
            "sent": CANCEL_TEXT,
            "stopReason": cancelled.stop_reason,
            "text": client.agent_text(mark),
        }

        mark = len(client.updates)
        after = await conn.prompt(session_id=sid, prompt=[text(AFTER_TEXT)])
        out["after"] = {"sent": AFTER_TEXT, "stopReason": after.stop_reason, "text": client.agent_text(mark)}

        stats = await conn.ext_method("acp_server/stats", {})
        out["pendingPromptsAtEnd"] = stats["bridge"]["pendingPrompts"]

    out["updateKinds"] = client.kinds()
    out["updateSessions"] = sorted({s for s, _ in client.updates})
    out["received"] = len(recorder.incoming)
    out["validated"], out["failures"] = validate_all(recorder)
    return out


async def agent_scenario(target: str) -> dict[str, Any]:
    """Against a server whose backend ``agent`` is ``tests/agents/fake_agent.py --ask-permission`` and
    whose echo backend is slow, with a pending limit of 1: a permission request relayed from the agent
    and answered here; ``$/cancel_request`` of a running prompt; a ``prompt_queue_full`` refusal; then
    ``session/load`` on a second connection, which replays the session."""
    client = RecordingClient()
    client.allow = True
    recorder = Recorder()
    out: dict[str, Any] = {"target": target}
    info = schema.Implementation(name="sdk-driver", version="0")
    cwd = tempfile.gettempdir()
    async with connect(target, client, recorder, 0) as conn:
        await conn.initialize(protocol_version=acp.PROTOCOL_VERSION, client_capabilities=schema.ClientCapabilities(), client_info=info)
        agent = (await conn.new_session(cwd=cwd, mcp_servers=[], backend="agent")).session_id
        mark = len(client.updates)
        done = await conn.prompt(session_id=agent, prompt=[text("with permission")])
        out["permission"] = {
            "stopReason": done.stop_reason, "text": client.agent_text(mark), "asked": client.permission_requests
        }

        echo = (await conn.new_session(cwd=cwd, mcp_servers=[])).session_id
        out["echoSession"] = echo
        client.agent_chunk.clear()
        running = asyncio.create_task(conn.prompt(session_id=echo, prompt=[text("cancelled by its id")]))
        await client.agent_chunk.wait()
        request_id = max(i for i, m in recorder.request_methods.items() if m == "session/prompt")
        await conn._conn.send_notification("$/cancel_request", {"requestId": request_id})
        try:
            out["cancelRequest"] = {"stopReason": (await running).stop_reason}
        except acp.RequestError as exc:
            out["cancelRequest"] = {"code": exc.code, "data": exc.data}

        client.agent_chunk.clear()
        long = asyncio.create_task(conn.prompt(session_id=echo, prompt=[text("holding the only slot")]))
        await client.agent_chunk.wait()
        try:
            await conn.prompt(session_id=echo, prompt=[text("one too many")])
            out["refusal"] = None
        except acp.RequestError as exc:
            out["refusal"] = {"code": exc.code, "message": str(exc), "data": exc.data}
        out["long"] = (await long).stop_reason

    second = RecordingClient()
    recorder2 = Recorder()
    async with connect(target, second, recorder2, 0) as conn:
        await conn.initialize(protocol_version=acp.PROTOCOL_VERSION, client_capabilities=schema.ClientCapabilities(), client_info=info)
        await conn.load_session(cwd=cwd, session_id=echo, mcp_servers=[])
        # the SDK runs each notification's handler in a task of its own: replayed updates that came in the
        # same read as the answer are handled just after it (wait until no more come)
        for _ in range(100):
            seen = len(second.updates)
            await asyncio.sleep(0.02)
            if len(second.updates) == seen:
                break
        out["replayKinds"] = second.kinds()
        out["replayText"] = second.agent_text()
        mark = len(second.updates)
        after = await conn.prompt(session_id=echo, prompt=[text("after the load")])
        out["afterLoad"] = {"stopReason": after.stop_reason, "text": second.agent_text(mark)}
    out["received"] = len(recorder.incoming) + len(recorder2.incoming)
    counts, failures = validate_all(recorder)
    counts2, failures2 = validate_all(recorder2)
    out["failures"] = failures + failures2
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="stdio, tcp://HOST:PORT or unix:/path")
    parser.add_argument(
        "--echo-delay-ms", type=int, default=500, help="for stdio: the spawned server's echo delay"
    )
    parser.add_argument("--scenario", choices=("echo", "agent"), default="echo", help="what to run (see above)")
    args = parser.parse_args()
    errors = SdkErrors()
    logging.getLogger().addHandler(errors)
    run = agent_scenario(args.target) if args.scenario == "agent" else scenario(args.target, args.echo_delay_ms)
    summary = asyncio.run(asyncio.wait_for(run, TIMEOUT_S))
    summary["sdkErrors"] = errors.records
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
