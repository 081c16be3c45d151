"""``acp-server prompt`` and ``acp-server sessions``: the client SDK as a command line for people.

``prompt`` streams the agent's text to stdout as it arrives; on stderr it says ``acp-server: session
<id> client <id>`` once it holds the session (again after a self-heal), one line per tool call and
per tool call update, each retry (``retrying in 2.0 s (prompt_queue_full, attempt 2/5)``), a progress
line while the prompt waits for a seat, each permission the agent asked and how it was answered, then
``acp-server: stop <reason>`` or ``acp-server: error <errorKind>: <message>`` (what it shows lives in
:mod:`acp_server.client.terminal`). ``--json`` prints one JSON object per line on stdout instead.

Exit codes: 0 the turn ended (``end_turn``, ``max_tokens``, ``max_turn_requests``); 1 an error; 2 a
bad command line; 3 refused (the server refused the prompt for capacity after every retry, or the agent
stopped with ``refusal``); 130 interrupted (a ``cancelled`` stop reason, or Ctrl-C: the first sends
``$/cancel_request`` and waits for the answer, a second one leaves at once).

``--connect`` defaults to ``$ACP_SERVER_URL``, else ``tcp://127.0.0.1:4170`` (what ``make run`` serves).

Both take ``--token`` (default ``$ACP_SERVER_TOKEN``; prefer the variable: arguments show in ``ps``)
and ``--ca-file`` for ``tls://``, ``https://`` and ``wss://`` servers.

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
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from ..auth.tls import TlsConfigError
from ..errors import REGISTRY, OverloadError, SessionLimitExceededError
from ..types.acp import PromptResult, SessionInfo
from .cli_flags import COMMANDS, DEFAULT_URL, ENV_URL, add_commands, default_url
from .client import Client, connect
from .errors import ClientError
from .hooks import Hooks
from .retry import RetryPolicy
from .session import PromptCall, SessionClient
from .terminal import Answer, HumanView, JsonView, PermissionAsker, View

__all__ = ["COMMANDS", "DEFAULT_URL", "ENV_URL", "add_commands", "default_url", "main", "run"]

#: How long the first Ctrl-C waits for the server's answer to ``$/cancel_request``.
CANCEL_GRACE_S = 5.0
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130
#: Stop reasons of a turn that ended as it should (exit 0).
_ENDED = frozenset({"end_turn", "max_tokens", "max_turn_requests"})
#: Error kinds that mean "refused for capacity" (exit 3).
REFUSED_KINDS = frozenset(
    {kind for kind, cls in REGISTRY.items() if issubclass(cls, OverloadError)} | {SessionLimitExceededError.kind}
)
_TURN_STATE = "_acp_server/turn_state"


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``prompt`` or ``sessions`` command; returns the exit code."""
    if args.cwd is not None or args.command == "prompt":
        args.cwd = os.path.abspath(args.cwd or os.getcwd())
    try:
        if args.command == "prompt":
            return trio.run(_prompt, args)
        return trio.run(_sessions, args)
    except KeyboardInterrupt:  # before our handler was in place
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """These commands on their own: ``python -c "from acp_server.client.cli import main; ..." prompt ...``."""
    parser = argparse.ArgumentParser(prog="acp-server", description="acp-server client commands.")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return run(parser.parse_args(argv))


def _tls_failed(view: View, exc: TlsConfigError) -> None:
    failure = ClientError(str(exc))
    failure.kind = "tls_config"
    view.error(failure, str(exc))


def _connect_failed(view: View, url: str, exc: OSError) -> None:
    why = exc.strerror or str(exc)
    hint = f"; is a server running there? start one with `make run` (or `acp-server serve`), or set ${ENV_URL}"
    failure = ClientError(why)
    failure.kind = "connection_failed"
    view.error(failure, f"cannot connect to {url}: {why}{hint}")


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


class _TurnTracker:
    """Hands the view the turn states of this command's own prompt.

    Turn states go to every connection attached to the session, other clients' prompts included; ours
    is the first prompt ``accepted`` after an attempt went out (the result names it only at the end).
    """

    def __init__(self, view: View) -> None:
        self.view = view
        self.session: SessionClient | None = None
        self.prompt_id: str | None = None
        self.armed = False

    def flush(self) -> None:
        """Show the updates that came before what is shown next (they wait in the session's stream,
        read by another task; the reader hands turn states and the agent's requests over at once)."""
        if self.session is not None:
            for update in self.session.updates.drain_nowait():
                self.view.update(update)

    def arm(self) -> None:
        """An attempt is about to go out: the next ``accepted`` prompt is ours."""
        self.armed = True
        self.prompt_id = None

    def notification(self, method: str, params: Any) -> None:
        if self.session is None or method != _TURN_STATE or not isinstance(params, dict):
            return
        if params.get("sessionId") != self.session.session_id:
            return
        if self.prompt_id is None:
            if not self.armed or params.get("state") != "accepted":
                return
            self.prompt_id = params.get("promptId")
        if params.get("promptId") == self.prompt_id:
            self.flush()
            self.view.turn_state(params)


def _answer_mode(args: argparse.Namespace) -> Answer:
    if args.yes:
        return "yes"
    if args.deny:
        return "deny"
    if not args.json and sys.stdin.isatty() and sys.stderr.isatty():
        return "ask"
    return "refuse"


async def _prompt(args: argparse.Namespace) -> int:
    view: View = JsonView() if args.json else HumanView()
    interrupt = _Interrupt()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interrupt.watch, signals)
            code = EXIT_INTERRUPTED
            with interrupt.scope:
                code = await _prompt_once(args, interrupt, view)
            if interrupt.scope.cancelled_caught:
                view.close()
                view.interrupted()
            nursery.cancel_scope.cancel()
    return EXIT_INTERRUPTED if interrupt.count else code


async def _hold(client: Client, args: argparse.Namespace, cwd: str) -> SessionClient:
    if args.session is None:
        return await client.new_session(cwd, client_id=args.client_id, backend=args.backend)
    if args.client_id is not None:
        return client.use_session(args.session, client_id=args.client_id, cwd=cwd)
    return await client.resume_session(args.session, cwd)


def _exit_code(result: PromptResult | None, failure: ClientError | None) -> int:
    if failure is not None or result is None:
        return EXIT_REFUSED if failure is not None and failure.kind in REFUSED_KINDS else EXIT_ERROR
    if result.stop_reason in _ENDED:
        return EXIT_OK
    if result.stop_reason == "refusal":
        return EXIT_REFUSED
    return EXIT_INTERRUPTED  # cancelled


async def _prompt_once(args: argparse.Namespace, interrupt: _Interrupt, view: View) -> int:
    tracker = _TurnTracker(view)
    asker = PermissionAsker(_answer_mode(args), view, before=tracker.flush)
    hooks = Hooks(request_permission=asker, on_notification=tracker.notification)
    result: PromptResult | None = None
    failure: ClientError | None = None

    def on_retry(error: ClientError, attempt: int, wait_s: float) -> None:
        tracker.arm()
        view.retry(error, attempt, args.max_attempts, wait_s)

    async def show(session: SessionClient) -> None:
        # Drained with no checkpoint between taking and showing, so that an update never waits in a
        # task while a turn state or a permission question (shown by the reader) overtakes it.
        updates = session.updates
        while not (updates.closed and not len(updates)):
            await updates.wait_buffered()
            tracker.flush()

    try:
        async with connect(
            args.connect, hooks=hooks, turn_states=True, token=args.token, ca_file=args.ca_file
        ) as client:  # turn states for the progress line
            session = await _hold(client, args, args.cwd)
            tracker.session = session
            view.session(session.session_id, session.client_id)
            session.on_self_heal = lambda old, new: view.session(session.session_id, new)
            retry = RetryPolicy(max_attempts=args.max_attempts)
            call = interrupt.call = session.prompt_call(" ".join(args.text), retry=retry)
            call.on_retry = on_retry
            async with trio.open_nursery() as printer:
                printer.start_soon(show, session)
                printer.start_soon(view.animate)
                tracker.arm()
                try:
                    result = await call.run()
                except ClientError as exc:
                    failure = exc
                printer.cancel_scope.cancel()
            tracker.flush()  # what arrived with the answer, before the printer stopped
    except ClientError as exc:
        failure = exc
    except OSError as exc:
        view.close()
        _connect_failed(view, args.connect, exc)
        return EXIT_ERROR
    except TlsConfigError as exc:  # --ca-file cannot be used
        view.close()
        _tls_failed(view, exc)
        return EXIT_ERROR
    finally:
        view.close()  # before any last line, so the text's last line is whole
    if failure is not None or result is None:
        view.error(failure or ClientError("no outcome"))
    else:
        view.result(msgspec.to_builtins(result))
    return _exit_code(result, failure)


# --- sessions ----------------------------------------------------------------------------------------

_COLUMNS = ("ID", "TITLE", "CWD", "UPDATED", "PENDING")


def _row(info: SessionInfo) -> tuple[str, ...]:
    pending = (info.meta or {}).get("pendingCount")
    return (
        info.session_id,
        info.title or "-",
        info.cwd,
        (info.updated_at or "-").replace("+00:00", "Z"),
        str(pending) if isinstance(pending, int) else "-",
    )


def format_table(sessions: Sequence[SessionInfo]) -> str:
    """The sessions as a table with a header, columns padded to their widest cell."""
    rows = [_COLUMNS, *(_row(info) for info in sessions)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"


async def _sessions(args: argparse.Namespace) -> int:
    view = JsonView() if args.json else HumanView()
    try:
        async with connect(args.connect, token=args.token, ca_file=args.ca_file) as client:
            sessions = await client.list_sessions(args.cwd)
    except ClientError as exc:
        view.error(exc)
        return EXIT_ERROR
    except OSError as exc:
        _connect_failed(view, args.connect, exc)
        return EXIT_ERROR
    except TlsConfigError as exc:  # --ca-file cannot be used
        _tls_failed(view, exc)
        return EXIT_ERROR
    if args.json:
        for info in sessions:
            print(json.dumps(msgspec.to_builtins(info), separators=(",", ":")), flush=True)
    elif sessions:
        sys.stdout.write(format_table(sessions))
        sys.stdout.flush()
    else:
        where = f" in {args.cwd}" if args.cwd else ""
        print(f"acp-server: no sessions{where} at {args.connect}", file=sys.stderr, flush=True)
    return 0
