"""Drive acp-server's ``openai`` backend with the official ACP Python SDK (``acp``, asyncio); print a JSON summary.

The tests spawn it with ``sys.executable`` (the SDK runs on asyncio, the suite on trio) while they
serve the scripted model (``tests/openai_server.py``) themselves. Usage::

    python tests/openai_sdk_driver.py tcp://127.0.0.1:PORT SCENARIO [--session-id ID]

Scenarios: ``conversation`` (two prompts on one session), ``cancel`` (a prompt cancelled once its
first chunk arrived), ``tools`` (one prompt; the client answers the permission, the file read and the
file write the model asks for), ``loop`` (one prompt whose model never stops calling tools),
``first`` (a session and one prompt: the summary names the session) and ``continue`` (``session/load``
of ``--session-id`` after a restart, then a prompt). The client advertises ``fs`` and ``terminal``.
Every message the server sends is validated against the SDK's models picked by its kind (the
server's requests to the client included) and dumped back to catch fields the models drop; the
script asserts nothing, the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from typing import Any, cast
from urllib.parse import urlsplit

import acp
from acp import schema
from pydantic import BaseModel, ValidationError
from sdk_driver import TURN_STATE, Recorder, SdkErrors, _round_trip_diff, _turn_state_problem

TIMEOUT_S = 30.0
#: the text the client's read_text_file answers
FILE_TEXT = "the file's text\nsecond line\n"

RESULT_MODELS: dict[str, type[BaseModel]] = {
    "initialize": schema.InitializeResponse,
    "session/new": schema.NewSessionResponse,
    "session/load": schema.LoadSessionResponse,
    "session/prompt": schema.PromptResponse,
}
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "session/request_permission": schema.RequestPermissionRequest,
    "fs/read_text_file": schema.ReadTextFileRequest,
    "fs/write_text_file": schema.WriteTextFileRequest,
}


class ToolClient:
    """The client side: records updates, allows every permission, serves one file, records writes."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, Any]] = []
        self.agent_chunk = asyncio.Event()
        self.permissions: list[dict[str, Any]] = []
        self.reads: list[str] = []
        self.writes: list[tuple[str, str]] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append((session_id, update))
        if getattr(update, "session_update", None) == "agent_message_chunk":
            self.agent_chunk.set()

    async def request_permission(self, session_id: str, tool_call: Any, options: list[Any], **kwargs: Any) -> Any:
        self.permissions.append({"toolCallId": tool_call.tool_call_id, "options": [o.option_id for o in options]})
        allow = next(o.option_id for o in options if o.kind == "allow_once")
        return schema.RequestPermissionResponse(outcome=schema.AllowedOutcome(outcome="selected", option_id=allow))

    async def read_text_file(self, session_id: str, path: str, **kwargs: Any) -> Any:
        self.reads.append(path)
        return schema.ReadTextFileResponse(content=FILE_TEXT)

    async def write_text_file(self, session_id: str, path: str, content: str, **kwargs: Any) -> Any:
        self.writes.append((path, content))
        return schema.WriteTextFileResponse()

    def text(self, start: int = 0) -> str:
        return "".join(
            u.content.text for _, u in self.updates[start:] if getattr(u, "session_update", "") == "agent_message_chunk"
        )

    def kinds(self, start: int = 0) -> list[str]:
        return [u.session_update for _, u in self.updates[start:]]


def validate(recorder: Recorder) -> tuple[dict[str, int], list[str]]:
    """Validate every incoming message by its kind; returns counts per model and the failures."""
    counts: dict[str, int] = {}
    failures: list[str] = []

    def check(model: type[BaseModel], raw: Any, what: str, *, exact: bool = True) -> None:
        try:
            parsed = model.model_validate(raw)
        except ValidationError as exc:
            failures.append(f"{what}: {model.__name__}: {exc}")
            return
        diff = _round_trip_diff(parsed, raw) if exact else None
        if diff is not None:
            failures.append(f"{what}: {model.__name__} salvaged or dropped fields: {diff}")
            return
        counts[model.__name__] = counts.get(model.__name__, 0) + 1

    for msg in recorder.incoming:
        what = json.dumps(msg)[:300]
        if "method" in msg and "id" in msg:
            model = REQUEST_MODELS.get(msg["method"])
            if model is None:
                failures.append(f"{what}: no SDK model for request {msg['method']!r}")
            else:
                check(model, msg.get("params"), what)
        elif "method" in msg:
            if msg["method"] == TURN_STATE:
                problem = _turn_state_problem(msg.get("params"))
                if problem:
                    failures.append(f"{what}: turn_state: {problem}")
                continue
            if msg["method"] != "session/update":
                failures.append(f"{what}: unexpected notification")
                continue
            check(schema.SessionNotification, msg.get("params"), what)
        elif "error" in msg:
            check(schema.AgentErrorMessage, msg, what, exact=False)
        elif "result" in msg:
            method = recorder.request_methods.get(msg["id"])
            if method in RESULT_MODELS:
                check(RESULT_MODELS[method], msg["result"], what)
            elif method is None or not method.startswith("_"):
                failures.append(f"{what}: no SDK model for the result of {method!r}")
    return counts, failures


def text(t: str) -> Any:
    return acp.text_block(t)


def result_of(response: Any) -> dict[str, Any]:
    return cast(dict[str, Any], response.model_dump(mode="json", by_alias=True, exclude_unset=True))


async def scenario(target: str, name: str, session_id: str | None) -> dict[str, Any]:
    client = ToolClient()
    recorder = Recorder()
    out: dict[str, Any] = {"scenario": name}
    parts = urlsplit(target)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    conn = acp.connect_to_agent(cast(acp.Client, client), writer, reader, observers=[recorder])
    try:
        caps = schema.ClientCapabilities(
            fs=schema.FileSystemCapabilities(read_text_file=True, write_text_file=True), terminal=True
        )
        await conn.initialize(protocol_version=acp.PROTOCOL_VERSION, client_capabilities=caps)
        if name == "continue":
            assert session_id is not None
            await conn.load_session(cwd=tempfile.gettempdir(), session_id=session_id, mcp_servers=[])
            out["replayedText"] = client.text()
            out["replayedKinds"] = client.kinds()
            sid = session_id
        else:
            sid = (await conn.new_session(cwd="/work", mcp_servers=[])).session_id
        out["sessionId"] = sid
        prompts = {
            "conversation": ["first question", "second question"],
            "first": ["remember the word apricot"],
            "continue": ["what was the word?"],
            "tools": ["edit the notes"],
            "loop": ["never stop"],
        }
        out["results"] = []
        out["texts"] = []
        if name == "cancel":
            running = asyncio.create_task(conn.prompt(session_id=sid, prompt=[text("stream until I cancel")]))
            await client.agent_chunk.wait()
            await conn.cancel(session_id=sid)
            out["results"].append(result_of(await running))
            out["texts"].append(client.text())
        for t in prompts.get(name, []):
            mark = len(client.updates)
            out["results"].append(result_of(await conn.prompt(session_id=sid, prompt=[text(t)])))
            out["texts"].append(client.text(mark))
        out["kinds"] = client.kinds()
        out["toolUpdates"] = [
            u.model_dump(mode="json", by_alias=True, exclude_unset=True)
            for _, u in client.updates
            if u.session_update in ("tool_call", "tool_call_update")
        ]
        out["permissions"] = client.permissions
        out["reads"] = client.reads
        out["writes"] = client.writes
    finally:
        await conn.close()
        writer.close()
    out["validated"], out["failures"] = validate(recorder)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="tcp://HOST:PORT")
    parser.add_argument("scenario")
    parser.add_argument("--session-id")
    args = parser.parse_args()
    errors = SdkErrors()
    logging.getLogger().addHandler(errors)
    summary = asyncio.run(asyncio.wait_for(scenario(args.target, args.scenario, args.session_id), TIMEOUT_S))
    summary["sdkErrors"] = errors.records
    json.dump(summary, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
