"""A fake ACP agent over stdio, written with the official SDK (``acp``), for the subprocess backend's tests.

Run it as ``python -m tests.agents.fake_agent [flags]`` from the repository root. By default it echoes
each prompt's text back as ``agent_message_chunk`` updates, one per word (whitespace kept); the first
chunk carries ``_meta`` ``{"fake": {"chunk": 0}}`` and, when the prompt had ``_meta``, a chunk
``meta:<json> `` comes first. ``session/new`` answers two modes and ``_meta`` ``{"fake": {"pid": ...}}``;
``session/set_mode`` sends a ``current_mode_update`` before answering. A prompt whose text starts with
``hold`` sends ``holding `` and waits for ``session/cancel`` (then stops with ``cancelled``).

Flags select the other behaviours:

--ask-permission     asks ``session/request_permission`` first and sends ``permission:<optionId> ``
                     (or ``permission:cancelled `` and stops with ``cancelled``)
--read-file PATH     asks ``fs/read_text_file`` first and sends ``file:<content> `` or ``read-error:<code> ``
--ext-request        sends the request ``_fake/ping`` first and sends ``ext-error:<code> `` (or ``ext:ok ``)
--crash-on-prompt    a prompt whose text starts with ``crash`` sends ``crashing `` then ``os._exit(3)``
--ignore-cancel      never answers a cancelled ``hold`` prompt
--stderr-bytes N     writes N bytes to stderr at start and during each prompt (one line of them over 4 KiB)
--require-auth       advertises an auth method; ``session/new`` answers -32000 until ``authenticate``
--fail-initialize    answers ``initialize`` with an error
--prompt-error       answers every prompt with error -32042 carrying data
--load-session       advertises ``loadSession``; ``session/load`` replays a ``user_message_chunk``
--close-session      advertises ``sessionCapabilities.close`` (``session/close`` is logged to stderr)
--tool-call          first reports a tool call ``call-1`` "Read notes.txt" (kind ``read``, ``pending``), then
                     its updates ``in_progress`` and ``completed``; with --ask-permission the permission
                     request comes between the call and its updates

Each session it creates is named ``fake-<pid>-<n>``. The ``initialize`` answer carries in
``agentCapabilities._meta.clientCapabilities`` the client capabilities it was offered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from typing import Any

import acp
from acp import schema
from acp.helpers import update_current_mode

_WORD = re.compile(r"\s*\S+\s*|\s+")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake_agent", description=__doc__.split("\n")[0])
    parser.add_argument("--ask-permission", action="store_true")
    parser.add_argument("--read-file", metavar="PATH")
    parser.add_argument("--ext-request", action="store_true")
    parser.add_argument("--crash-on-prompt", action="store_true")
    parser.add_argument("--ignore-cancel", action="store_true")
    parser.add_argument("--stderr-bytes", type=int, default=0, metavar="N")
    parser.add_argument("--require-auth", action="store_true")
    parser.add_argument("--fail-initialize", action="store_true")
    parser.add_argument("--prompt-error", action="store_true")
    parser.add_argument("--load-session", action="store_true")
    parser.add_argument("--close-session", action="store_true")
    parser.add_argument("--tool-call", action="store_true")
    return parser.parse_args(argv)


def write_stderr(n: int) -> None:
    """Write ``n`` bytes of log lines to stderr, one of them longer than 4 KiB (blocking, on purpose)."""
    if n <= 0:
        return
    long_line = b"L" * min(n, 10_000)
    rest = n - len(long_line)
    line = b"x" * 99 + b"\n"
    out = sys.stderr.buffer
    out.write(long_line[:-1] + b"\n")
    while rest > 0:
        out.write(line[-rest:] if rest < len(line) else line)
        rest -= len(line)
    out.flush()


class FakeAgent:
    """The agent side of the SDK's ``acp.Agent`` interface (structurally: absent methods stay absent)."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.conn: acp.Client | None = None
        self.authenticated = False
        self.sessions: dict[str, str] = {}  # session id -> cwd
        self.cancelled: dict[str, asyncio.Event] = {}
        self.count = 0

    def on_connect(self, conn: acp.Client) -> None:
        self.conn = conn

    @property
    def client(self) -> acp.Client:
        assert self.conn is not None
        return self.conn

    async def initialize(
        self,
        protocol_version: int,
        client_capabilities: schema.ClientCapabilities | None = None,
        client_info: schema.Implementation | None = None,
        **kwargs: Any,
    ) -> schema.InitializeResponse:
        if self.opts.fail_initialize:
            raise acp.RequestError(-32603, "initialize refused", {"flag": "fail-initialize"})
        offered = {}
        if client_capabilities is not None:
            offered = client_capabilities.model_dump(by_alias=True, exclude_none=True)
        session_caps = schema.SessionCapabilities(
            close=schema.SessionCloseCapabilities() if self.opts.close_session else None
        )
        auth_methods: list[Any] = (
            [schema.AuthMethodAgent(id="fake-login", name="Fake login")] if self.opts.require_auth else []
        )
        return schema.InitializeResponse(
            protocol_version=acp.PROTOCOL_VERSION,
            agent_capabilities=schema.AgentCapabilities(
                load_session=self.opts.load_session,
                session_capabilities=session_caps,
                field_meta={"clientCapabilities": offered},
            ),
            auth_methods=auth_methods,
            agent_info=schema.Implementation(name="fake-agent", version="1"),
        )

    async def authenticate(self, method_id: str, **kwargs: Any) -> schema.AuthenticateResponse:
        if method_id != "fake-login":
            raise acp.RequestError(-32602, f"unknown auth method {method_id!r}")
        self.authenticated = True
        return schema.AuthenticateResponse()

    def _new_id(self) -> str:
        self.count += 1
        return f"fake-{os.getpid()}-{self.count}"

    async def new_session(
        self, cwd: str, mcp_servers: Any = None, **kwargs: Any
    ) -> schema.NewSessionResponse:
        if self.opts.require_auth and not self.authenticated:
            raise acp.RequestError.auth_required({"methods": ["fake-login"]})
        session_id = self._new_id()
        self.sessions[session_id] = cwd
        modes = schema.SessionModeState(
            current_mode_id="ask",
            available_modes=[
                schema.SessionMode(id="ask", name="Ask"),
                schema.SessionMode(id="code", name="Code"),
            ],
        )
        return schema.NewSessionResponse(
            session_id=session_id,
            modes=modes,
            field_meta={
                "fake": {"pid": os.getpid(), "cwd": cwd},
                "requestMeta": {k: v for k, v in kwargs.items() if k not in schema.NewSessionRequest.model_fields},
            },
        )

    async def load_session(
        self, cwd: str, session_id: str, mcp_servers: Any = None, **kwargs: Any
    ) -> schema.LoadSessionResponse:
        if not self.opts.load_session:
            raise acp.RequestError.method_not_found("session/load")
        self.sessions[session_id] = cwd
        await self.client.session_update(session_id, acp.update_user_message_text("replayed history"))
        return schema.LoadSessionResponse()

    async def set_session_mode(
        self, session_id: str, mode_id: str, **kwargs: Any
    ) -> schema.SetSessionModeResponse:
        await self.client.session_update(session_id, update_current_mode(mode_id))
        return schema.SetSessionModeResponse()

    async def set_config_option(
        self, config_id: str, session_id: str, value: str | bool, **kwargs: Any
    ) -> schema.SetSessionConfigOptionResponse:
        if config_id != "verbose" or not isinstance(value, bool):
            raise acp.RequestError.invalid_params({"configId": config_id})
        option = schema.SessionConfigOptionBoolean(id="verbose", name="Verbose", current_value=value, type="boolean")
        return schema.SetSessionConfigOptionResponse(config_options=[option])

    async def close_session(self, session_id: str, **kwargs: Any) -> schema.CloseSessionResponse:
        self.sessions.pop(session_id, None)
        print(f"fake-agent closed {session_id}", file=sys.stderr, flush=True)
        return schema.CloseSessionResponse()

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        if not self.opts.ignore_cancel:
            self.cancelled.setdefault(session_id, asyncio.Event()).set()

    async def _say(self, session_id: str, text: str, meta: dict[str, Any] | None = None) -> None:
        update = acp.update_agent_message_text(text)
        if meta is not None:
            update.field_meta = meta
        await self.client.session_update(session_id, update)

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> schema.PromptResponse:
        if session_id not in self.sessions:
            raise acp.RequestError.invalid_params({"sessionId": session_id, "reason": "unknown session"})
        self.cancelled[session_id] = asyncio.Event()
        text = "".join(getattr(block, "text", "") for block in prompt)
        meta = {k: v for k, v in kwargs.items() if k not in schema.PromptRequest.model_fields}
        write_stderr(self.opts.stderr_bytes)
        if self.opts.prompt_error:
            data = {"flag": "prompt-error", "sessionId": session_id}
            raise acp.RequestError(-32042, "fake prompt failure", data)
        if meta:
            await self._say(session_id, f"meta:{json.dumps(meta, sort_keys=True)} ")
        if self.opts.crash_on_prompt and text.startswith("crash"):
            await self._say(session_id, "crashing ")
            os._exit(3)
        if self.opts.ext_request:
            try:
                await self.client.ext_method("fake/ping", {"sessionId": session_id})
            except acp.RequestError as exc:
                await self._say(session_id, f"ext-error:{exc.code} ")
            else:
                await self._say(session_id, "ext:ok ")
        if self.opts.tool_call:
            start = acp.start_tool_call("call-1", "Read notes.txt", kind="read", status="pending")
            await self.client.session_update(session_id, start)
        if self.opts.ask_permission:
            title = "Read notes.txt" if self.opts.tool_call else "Write"
            answer = await self.client.request_permission(
                session_id=session_id,
                tool_call=schema.ToolCallUpdate(tool_call_id="call-1", title=title, status="pending"),
                options=[
                    schema.PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                    schema.PermissionOption(option_id="deny", name="Deny", kind="reject_once"),
                ],
            )
            outcome = answer.outcome
            if isinstance(outcome, schema.AllowedOutcome):
                await self._say(session_id, f"permission:{outcome.option_id} ")
            else:
                await self._say(session_id, "permission:cancelled ")
                return schema.PromptResponse(stop_reason="cancelled")
        if self.opts.tool_call:
            for status in ("in_progress", "completed"):
                await self.client.session_update(session_id, acp.update_tool_call("call-1", status=status))
        if self.opts.read_file:
            try:
                read = await self.client.read_text_file(session_id=session_id, path=self.opts.read_file)
            except acp.RequestError as exc:
                await self._say(session_id, f"read-error:{exc.code} ")
                if self.cancelled[session_id].is_set():
                    return schema.PromptResponse(stop_reason="cancelled")
            else:
                await self._say(session_id, f"file:{read.content} ")
        if text.startswith("hold"):
            await self._say(session_id, "holding ")
            await self.cancelled[session_id].wait()
            return schema.PromptResponse(stop_reason="cancelled")
        for i, word in enumerate(_WORD.findall(text)):
            await self._say(session_id, word, {"fake": {"chunk": i}} if i == 0 else None)
        return schema.PromptResponse(stop_reason="end_turn")


async def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    write_stderr(opts.stderr_bytes)
    await acp.run_agent(FakeAgent(opts), use_unstable_protocol=True)


if __name__ == "__main__":
    asyncio.run(main())
