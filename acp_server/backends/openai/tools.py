"""The function tools a model gets when the client offers them, and how each call runs on the client.

A client that advertised ``fs.readTextFile``, ``fs.writeTextFile`` or ``terminal`` at ``initialize``
lends the model matching tools (:func:`tool_specs`): ``read_text_file``, ``write_text_file`` and
``run_command``. A call runs as the ACP agent's own requests would, through the prompt's
:class:`~acp_server.backends.base.ClientChannel` (the relay that carries ACP agents' requests to the
client that sent the prompt): a write or a command first asks ``session/request_permission`` and runs
only on an ``allow`` answer. :func:`run_tool` returns the text the model is given back and the status
and content the client is shown; it never raises for a failure of the tool itself (the model reads
the error and may try otherwise).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ...types.acp import ClientCapabilities
from ..agent_relay import PERMISSION, RELAYED_METHODS
from ..base import ClientChannel, ClientGoneError, ClientRequestError

__all__ = ["TOOL_KINDS", "ToolOutcome", "permission_request", "run_tool", "tool_specs", "tool_title"]

#: the most output of a command given back to the model, in bytes
OUTPUT_LIMIT: Final = 64 * 1024

_READ: Final = {
    "type": "function",
    "function": {
        "name": "read_text_file",
        "description": "Read a text file in the user's workspace (relative paths are from the session's directory).",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "the file's path"},
                "line": {"type": "integer", "description": "the first line to read (1-based)"},
                "limit": {"type": "integer", "description": "the most lines to read"},
            },
            "required": ["path"],
        },
    },
}
_WRITE: Final = {
    "type": "function",
    "function": {
        "name": "write_text_file",
        "description": "Write (create or replace) a text file in the user's workspace; the user is asked first.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "the file's path"},
                "content": {"type": "string", "description": "the file's whole new text"},
            },
            "required": ["path", "content"],
        },
    },
}
_RUN: Final = {
    "type": "function",
    "function": {
        "name": "run_command",
        "description": "Run a command in the user's terminal and return its output; the user is asked first.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "the program to run"},
                "args": {"type": "array", "items": {"type": "string"}, "description": "its arguments"},
                "cwd": {"type": "string", "description": "the working directory"},
            },
            "required": ["command"],
        },
    },
}

#: tool name -> (the ACP tool kind shown to the client, whether it asks permission first)
TOOL_KINDS: Final[Mapping[str, tuple[str, bool]]] = {
    "read_text_file": ("read", False),
    "write_text_file": ("edit", True),
    "run_command": ("execute", True),
}

_PERMISSION_OPTIONS: Final = [
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
]


def _offered(caps: ClientCapabilities, method: str) -> bool:
    return RELAYED_METHODS[method][1](caps)


def tool_specs(caps: ClientCapabilities | None) -> list[dict[str, Any]]:
    """The tools of a request for a client with ``caps`` (none without a client)."""
    if caps is None:
        return []
    specs: list[dict[str, Any]] = []
    if _offered(caps, "fs/read_text_file"):
        specs.append(_READ)
    if _offered(caps, "fs/write_text_file"):
        specs.append(_WRITE)
    if _offered(caps, "terminal/create"):
        specs.append(_RUN)
    return specs


def tool_title(name: str, args: Mapping[str, Any]) -> str:
    """What the client shows for a call of ``name`` with ``args``."""
    if name == "read_text_file":
        return f"Read {args.get('path', '?')}"
    if name == "write_text_file":
        return f"Write {args.get('path', '?')}"
    if name == "run_command":
        argv = [str(args.get("command", "?")), *(str(a) for a in args.get("args") or [])]
        return "Run " + " ".join(argv)
    return name


def permission_request(session_id: str, call_id: str, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``session/request_permission`` params asking to run one tool call."""
    kind, _ = TOOL_KINDS[name]
    tool_call = {
        "toolCallId": call_id,
        "title": tool_title(name, args),
        "kind": kind,
        "status": "pending",
        "rawInput": dict(args),
    }
    return {"sessionId": session_id, "toolCall": tool_call, "options": _PERMISSION_OPTIONS}


@dataclass(slots=True)
class ToolOutcome:
    """How one tool call ended.

    Attributes:
        result: the text given back to the model.
        status: ``completed`` or ``failed`` (shown to the client).
        content: the tool call's content shown to the client.
        cancelled: the client answered the permission ``cancelled`` (the turn is being cancelled).
    """

    result: str
    status: str = "completed"
    content: list[dict[str, Any]] = field(default_factory=list)
    cancelled: bool = False


def _failed(text: str) -> ToolOutcome:
    return ToolOutcome(f"error: {text}", "failed", [{"type": "content", "content": {"type": "text", "text": text}}])


def _path(args: Mapping[str, Any], cwd: str) -> str:
    path = args.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError("path: a non-empty string is required")
    return posixpath.normpath(posixpath.join(cwd, path))


async def _permitted(
    client: ClientChannel, session_id: str, call_id: str, name: str, args: Mapping[str, Any]
) -> ToolOutcome | None:
    """``None`` when the client allowed the call, else how it ends."""
    answer = await client.request(PERMISSION, permission_request(session_id, call_id, name, args))
    outcome = answer.get("outcome") if isinstance(answer, dict) else None
    if isinstance(outcome, dict) and outcome.get("outcome") == "selected" and outcome.get("optionId") == "allow":
        return None
    if isinstance(outcome, dict) and outcome.get("outcome") == "cancelled":
        return ToolOutcome("the user cancelled the turn", "failed", cancelled=True)
    return ToolOutcome("the user rejected this tool call", "failed")


async def run_tool(
    client: ClientChannel | None, session_id: str, cwd: str, call_id: str, name: str, arguments: str
) -> ToolOutcome:
    """Run one tool call on the client: permission first for a write or a command.

    Args:
        client: the prompt's client channel (``None``: it left, the call fails).
        session_id: the session (named in every request to the client).
        cwd: the session's directory, against which relative paths resolve.
        call_id: the model's id of the call.
        name: the function's name.
        arguments: its JSON arguments as the model wrote them.
    """
    if name not in TOOL_KINDS:
        return _failed(f"there is no tool named {name!r}")
    if client is None:
        return _failed("the client that sent the prompt has disconnected")
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        return _failed(f"the arguments are not valid JSON: {exc}")
    if not isinstance(args, dict):
        return _failed("the arguments must be a JSON object")
    try:
        if TOOL_KINDS[name][1]:
            refused = await _permitted(client, session_id, call_id, name, args)
            if refused is not None:
                return refused
        if name == "read_text_file":
            return await _read(client, session_id, cwd, args)
        if name == "write_text_file":
            return await _write(client, session_id, cwd, args)
        return await _run(client, session_id, cwd, args)
    except ValueError as exc:
        return _failed(str(exc))
    except ClientRequestError as exc:
        return _failed(f"the client refused: {exc.error.get('message', 'error')}")
    except ClientGoneError:
        return _failed("the client disconnected")


async def _read(client: ClientChannel, session_id: str, cwd: str, args: Mapping[str, Any]) -> ToolOutcome:
    params: dict[str, Any] = {"sessionId": session_id, "path": _path(args, cwd)}
    for key in ("line", "limit"):
        if isinstance(args.get(key), int) and not isinstance(args.get(key), bool):
            params[key] = args[key]
    result = await client.request("fs/read_text_file", params)
    text = result.get("content") if isinstance(result, dict) else None
    if not isinstance(text, str):
        raise ValueError("the client's answer has no text content")
    return ToolOutcome(text, content=[{"type": "content", "content": {"type": "text", "text": text}}])


async def _write(client: ClientChannel, session_id: str, cwd: str, args: Mapping[str, Any]) -> ToolOutcome:
    path = _path(args, cwd)
    content = args.get("content")
    if not isinstance(content, str):
        raise ValueError("content: a string is required")
    await client.request("fs/write_text_file", {"sessionId": session_id, "path": path, "content": content})
    return ToolOutcome(
        f"wrote {len(content)} characters to {path}",
        content=[{"type": "diff", "path": path, "oldText": None, "newText": content}],
    )


async def _run(client: ClientChannel, session_id: str, cwd: str, args: Mapping[str, Any]) -> ToolOutcome:
    command = args.get("command")
    if not isinstance(command, str) or not command:
        raise ValueError("command: a non-empty string is required")
    argv = args.get("args") or []
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("args: a list of strings is required")
    where = args.get("cwd")
    params: dict[str, Any] = {
        "sessionId": session_id,
        "command": command,
        "args": argv,
        "cwd": posixpath.normpath(posixpath.join(cwd, where)) if isinstance(where, str) and where else cwd,
        "outputByteLimit": OUTPUT_LIMIT,
    }
    created = await client.request("terminal/create", params)
    terminal_id = created.get("terminalId") if isinstance(created, dict) else None
    if not isinstance(terminal_id, str):
        raise ValueError("the client's terminal/create answer has no terminalId")
    ids = {"sessionId": session_id, "terminalId": terminal_id}
    try:
        exited = await client.request("terminal/wait_for_exit", ids)
        output = await client.request("terminal/output", ids)
    finally:
        try:
            await client.request("terminal/release", ids)
        except (ClientRequestError, ClientGoneError):
            pass
    text = output.get("output", "") if isinstance(output, dict) else ""
    code = exited.get("exitCode") if isinstance(exited, dict) else None
    signal = exited.get("signal") if isinstance(exited, dict) else None
    status_line = f"exit code {code}" if signal is None else f"killed by signal {signal}"
    result = f"{text}\n[{status_line}]" if text else f"[{status_line}]"
    return ToolOutcome(
        result,
        "completed" if code == 0 and signal is None else "failed",
        [{"type": "content", "content": {"type": "text", "text": result}}],
    )
