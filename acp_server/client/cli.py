"""``acp-server prompt`` and ``acp-server sessions``: the client SDK as a command line for people.

``prompt`` prints the agent's text to stdout as it streams; on stderr ``acp-server: session <id>
client <id>`` once it holds the session (again after a self-heal), then ``acp-server: stop <reason>``
or ``acp-server: error <errorKind>: <message>``. Exit codes: 0 for any stop reason but ``cancelled``,
130 when interrupted (the first Ctrl-C sends ``$/cancel_request`` and waits for the answer, a second
one leaves at once), 1 for any other error, 2 for a bad command line.

``acp_server/cli.py`` mounts these with :func:`add_commands` and :func:`run`; :func:`main` runs them
on their own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import trio

from ..types.acp import PromptResult
from .client import Client, connect, parse_url
from .errors import ClientError
from .retry import RetryPolicy
from .session import PromptCall, SessionClient
from .updates import Update, UpdateStream

__all__ = ["COMMANDS", "add_commands", "main", "run"]

#: The subcommands this module owns.
COMMANDS = ("prompt", "sessions")
#: How long the first Ctrl-C waits for the server's answer to ``$/cancel_request``.
CANCEL_GRACE_S = 5.0
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def _url(text: str) -> str:
    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--connect {exc}") from None
    return text


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``prompt`` and ``sessions`` on an ``add_subparsers()`` result."""
    p = subparsers.add_parser(
        "prompt",
        help="send one prompt to a running acp-server and stream the answer",
        description="Send one prompt; the agent's text goes to stdout, the session and stop lines to stderr.",
    )
    p.add_argument("--connect", required=True, type=_url, metavar="URL", help="tcp://HOST:PORT, unix:/path, http://HOST:PORT/acp or ws://HOST:PORT/acp")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="prompt this existing session")
    which.add_argument("--new", action="store_true", help="open a new session (the default)")
    p.add_argument("--cwd", metavar="DIR", help="the session's working directory (default: the current one)")
    p.add_argument(
        "--client-id",
        metavar="ID",
        help="act as this client id (with --session: used as is, re-registered if stale; with --new: requested)",
    )
    p.add_argument("text", nargs="+", metavar="TEXT", help="the prompt (several words are joined by spaces)")
    s = subparsers.add_parser(
        "sessions", help="list the sessions of a running acp-server", description="List sessions, one per line."
    )
    s.add_argument("--connect", required=True, type=_url, metavar="URL", help="tcp://HOST:PORT, unix:/path, http://HOST:PORT/acp or ws://HOST:PORT/acp")
    s.add_argument("--cwd", metavar="DIR", help="only the sessions in this working directory")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``prompt`` or ``sessions`` command; returns the exit code."""
    command = _prompt if args.command == "prompt" else _sessions
    if args.cwd is not None or command is _prompt:
        args.cwd = os.path.abspath(args.cwd or os.getcwd())
    try:
        return trio.run(command, args)
    except KeyboardInterrupt:  # before our handler was in place
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """These commands on their own: ``python -c "from acp_server.client.cli import main; ..." prompt ...``."""
    parser = argparse.ArgumentParser(prog="acp-server", description="acp-server client commands.")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return run(parser.parse_args(argv))


def _say(text: str) -> None:
    print(f"acp-server: {text}", file=sys.stderr, flush=True)


def _error(exc: BaseException) -> None:
    kind = getattr(exc, "kind", None) or "unknown"
    _say(f"error {kind}: {exc}")


class _Text:
    """The agent's text on stdout, flushed as it streams, ended by a newline if it lacks one."""

    def __init__(self) -> None:
        self.last = "\n"

    def show(self, update: Update) -> None:
        text = update.text
        if text and update.kind == "agent_message_chunk":
            sys.stdout.write(text)
            sys.stdout.flush()
            self.last = text[-1]

    async def stream(self, updates: UpdateStream) -> None:
        async for update in updates:
            self.show(update)

    def end(self) -> None:
        if self.last != "\n":
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.last = "\n"


class _Interrupt:
    """Ctrl-C: the first cancels the prompt in flight (or everything, before there is one); the
    answer is awaited for :data:`CANCEL_GRACE_S` at most; a second Ctrl-C leaves at once."""

    def __init__(self) -> None:
        self.count = 0
        self.call: PromptCall | None = None
        self.scope = trio.CancelScope()

    async def watch(self, signals: Any) -> None:
        async for _ in signals:
            self.count += 1
            if self.count == 1 and self.call is not None:
                self.call.cancel()
                self.scope.deadline = min(self.scope.deadline, trio.current_time() + CANCEL_GRACE_S)
            else:
                self.scope.cancel()


async def _prompt(args: argparse.Namespace) -> int:
    interrupt = _Interrupt()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interrupt.watch, signals)
            code = EXIT_INTERRUPTED
            with interrupt.scope:
                code = await _prompt_once(args, interrupt)
            if interrupt.scope.cancelled_caught:
                _say("interrupted")
            nursery.cancel_scope.cancel()
    return EXIT_INTERRUPTED if interrupt.count else code


async def _hold(client: Client, args: argparse.Namespace, cwd: str) -> SessionClient:
    if args.session is None:
        return await client.new_session(cwd, client_id=args.client_id)
    if args.client_id is not None:
        return client.use_session(args.session, client_id=args.client_id, cwd=cwd)
    return await client.resume_session(args.session, cwd)


async def _prompt_once(args: argparse.Namespace, interrupt: _Interrupt) -> int:
    text = _Text()
    result: PromptResult | None = None
    failure: ClientError | None = None
    try:
        async with connect(args.connect) as client:
            session = await _hold(client, args, args.cwd)
            _say(f"session {session.session_id} client {session.client_id}")
            session.on_self_heal = lambda old, new: _say(f"session {session.session_id} client {new}")
            call = interrupt.call = session.prompt_call(" ".join(args.text), retry=RetryPolicy())
            async with trio.open_nursery() as printer:
                printer.start_soon(text.stream, session.updates)
                try:
                    result = await call.run()
                except ClientError as exc:
                    failure = exc
                printer.cancel_scope.cancel()
            for update in session.updates.drain_nowait():
                text.show(update)  # what arrived with the answer, before the printer stopped
    except ClientError as exc:
        failure = exc
    except OSError as exc:
        _say(f"error connection_failed: cannot connect to {args.connect}: {exc.strerror or exc}")
        return EXIT_ERROR
    finally:
        text.end()  # before any stderr line, so the text's last line is whole
    if failure is not None or result is None:
        _error(failure or ClientError("no outcome"))
        return EXIT_ERROR
    _say(f"stop {result.stop_reason}")
    return EXIT_INTERRUPTED if result.stop_reason == "cancelled" else 0


async def _sessions(args: argparse.Namespace) -> int:
    try:
        async with connect(args.connect) as client:
            sessions = await client.list_sessions(args.cwd)
    except ClientError as exc:
        _error(exc)
        return EXIT_ERROR
    except OSError as exc:
        _say(f"error connection_failed: cannot connect to {args.connect}: {exc.strerror or exc}")
        return EXIT_ERROR
    for info in sessions:
        fields = [info.session_id, info.cwd, info.updated_at or "-"]
        if info.title:
            fields.append(info.title)
        print("\t".join(fields), flush=True)
    return 0
