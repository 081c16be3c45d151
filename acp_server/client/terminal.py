"""What ``acp-server prompt`` shows: the agent's text as it streams, one status line per event, and
the permission questions an agent asks mid-turn.

Two views share one interface (:class:`View`):

- :class:`HumanView`: the agent's text on stdout, flushed as it arrives; on stderr one line per event
  (``acp-server: tool call-1 Read notes.txt (read): pending``, ``acp-server: retrying in 2.0 s
  (prompt_queue_full, attempt 2/5)``, ``acp-server: stop end_turn``). While the prompt waits for a seat
  or for its backend, a terminal shows one progress line redrawn in place (``queued (position 2),
  1.4 s``); without a terminal each change of state is one line.
- :class:`JsonView`: one JSON object per line on stdout, each with a ``type`` (``session``, ``update``,
  ``turn_state``, ``retry``, ``permission``, ``result``, ``error``); nothing on stderr.

:class:`PermissionAsker` answers ``session/request_permission``: on a terminal it asks (``y``, ``n`` or
an option's number), with ``--yes`` or ``--deny`` it answers for the user and says so, and without either
and without a terminal it refuses (``cancelled``) and says how to answer next time.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, TextIO

import trio

from .errors import ClientError, RpcError
from .updates import Update

__all__ = ["HumanView", "JsonView", "PermissionAsker", "View", "pick_option"]

#: How often the progress line is redrawn on a terminal.
PROGRESS_INTERVAL_S = 0.1
_SPINNER = "|/-\\"
#: Turn states shown as progress (the prompt waits); any other state ends the progress line.
_WAITING = {"queued": "queued", "waiting_for_dependency": "waiting for the backend"}
_ALLOW = ("allow_once", "allow_always")
_REJECT = ("reject_once", "reject_always")

Answer = Literal["ask", "yes", "deny", "refuse"]


def pick_option(options: list[dict[str, Any]], allow: bool) -> dict[str, Any] | None:
    """The option a plain yes (``allow``) or no stands for: the first ``allow_once`` (else
    ``allow_always``), or the first ``reject_once`` (else ``reject_always``); ``None`` when there is none."""
    for kind in _ALLOW if allow else _REJECT:
        for option in options:
            if option.get("kind") == kind:
                return option
    return None


def _selected(option: dict[str, Any] | None) -> dict[str, Any]:
    if option is None or not isinstance(option.get("optionId"), str):
        return {"outcome": {"outcome": "cancelled"}}
    return {"outcome": {"outcome": "selected", "optionId": option["optionId"]}}


def _tool_label(params: dict[str, Any]) -> str:
    call = params.get("toolCall")
    call = call if isinstance(call, dict) else {}
    title = call.get("title") or "a tool call"
    call_id = call.get("toolCallId")
    return f"{title} ({call_id})" if call_id else str(title)


def _error_fields(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"errorKind": getattr(exc, "kind", None) or "unknown", "message": str(exc)}
    if isinstance(exc, RpcError):
        out["code"] = exc.code
        if exc.data:
            out["data"] = exc.data
    return out


class View(Protocol):
    """What the prompt command reports, whatever the output looks like."""

    def session(self, session_id: str, client_id: str | None) -> None:
        """The session is held (again after a self-heal)."""

    def update(self, update: Update) -> None:
        """One ``session/update`` of the session."""

    def turn_state(self, params: dict[str, Any]) -> None:
        """One ``_acp_server/turn_state`` of this command's prompt."""

    def retry(self, error: ClientError, attempt: int, max_attempts: int, wait_s: float) -> None:
        """A refusal will be retried: ``attempt`` of ``max_attempts`` comes after ``wait_s``."""

    def permission(self, params: dict[str, Any], answer: dict[str, Any], by: str) -> None:
        """A permission request was answered (``by``: ``user``, ``--yes``, ``--deny``, ``no terminal``)."""

    def result(self, result: dict[str, Any]) -> None:
        """The prompt's result (``stopReason``, ``_meta``)."""

    def error(self, exc: BaseException, detail: str | None = None) -> None:
        """The command ends with an error."""

    def interrupted(self) -> None:
        """A second Ctrl-C (or no answer to the cancel) ended the command."""

    def close(self) -> None:
        """Nothing more will be shown: end the text's last line, clear the progress line."""

    async def animate(self) -> None:
        """Redraw what moves (the progress line) until cancelled."""


class HumanView:
    """Text on ``out``, status lines on ``err``; a progress line redrawn in place when ``err`` is a terminal.

    Args:
        out: where the agent's text goes (stdout).
        err: where status lines go (stderr).
        tty: whether ``err`` is a terminal (default: asked of ``err``).
    """

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, *, tty: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.tty = self.err.isatty() if tty is None else tty
        # Text and status lines share one screen: a status line must start on a line of its own.
        self.same_screen = self.tty and self.out.isatty()
        self._last = "\n"
        self._progress: tuple[str, int | None, float] | None = None  # (state, position, since)
        self._drawn = False
        self._tick = 0
        self._tools: dict[str, str] = {}
        self._shown_state: tuple[str, int | None] | None = None
        #: a question waits on the current line for its answer (the typed newline ends it)
        self.question_open = False

    # --- output primitives ---------------------------------------------------------------------------

    def _clear(self) -> None:
        if self._drawn:
            self.err.write("\r\x1b[K")
            self.err.flush()
            self._drawn = False

    def _line(self, text: str) -> None:
        self._clear()
        if self.question_open:
            self.err.write("\n")
            self.question_open = False
        if self.same_screen and self._last != "\n":
            self.out.write("\n")
            self.out.flush()
            self._last = "\n"
        self.err.write(f"acp-server: {text}\n")
        self.err.flush()

    def _draw(self) -> None:
        if self._progress is None or not self.tty:
            return
        state, position, since = self._progress
        if self.same_screen and self._last != "\n":
            self.out.write("\n")
            self.out.flush()
            self._last = "\n"
        where = f" (position {position})" if position is not None else ""
        spin = _SPINNER[self._tick % len(_SPINNER)]
        self.err.write(f"\r\x1b[Kacp-server: {spin} {_WAITING[state]}{where}, {time.monotonic() - since:.1f} s")
        self.err.flush()
        self._drawn = True

    def text(self, text: str) -> None:
        """Write the agent's text as it came."""
        if not text:
            return
        self._progress = None
        self._clear()
        self.out.write(text)
        self.out.flush()
        self._last = text[-1]

    # --- View ----------------------------------------------------------------------------------------

    def session(self, session_id: str, client_id: str | None) -> None:
        self._line(f"session {session_id} client {client_id}")

    def update(self, update: Update) -> None:
        kind = update.kind
        if kind == "agent_message_chunk":
            self.text(update.text or "")
        elif kind in ("tool_call", "tool_call_update"):
            self._tool(update.update, kind == "tool_call")

    def _tool(self, body: dict[str, Any], start: bool) -> None:
        call_id = str(body.get("toolCallId") or "?")
        title = body.get("title")
        if isinstance(title, str) and title:
            self._tools[call_id] = title
        title = self._tools.get(call_id, "")
        kind = body.get("kind")
        status = body.get("status") or ("pending" if start else "updated")
        parts = ["tool", call_id]
        if title:
            parts.append(title)
        if start and isinstance(kind, str):
            parts.append(f"({kind})")
        self._line(f"{' '.join(parts)}: {status}")

    def turn_state(self, params: dict[str, Any]) -> None:
        state = params.get("state")
        if not isinstance(state, str):
            return
        position = params.get("positionHint")
        position = position if isinstance(position, int) and not isinstance(position, bool) else None
        if state == "accepted":
            return  # running or queued follows at once
        if state not in _WAITING:
            self._progress = None
            self._clear()
            return
        if self.tty:
            since = self._progress[2] if self._progress is not None else time.monotonic()
            self._progress = (state, position, since)
            self._draw()
        elif (state, position) != self._shown_state:
            where = f" (position {position})" if position is not None else ""
            self._line(f"{_WAITING[state]}{where}")
        self._shown_state = (state, position)

    def retry(self, error: ClientError, attempt: int, max_attempts: int, wait_s: float) -> None:
        kind = getattr(error, "kind", None) or type(error).__name__
        self._line(f"retrying in {wait_s:.1f} s ({kind}, attempt {attempt}/{max_attempts})")

    def permission(self, params: dict[str, Any], answer: dict[str, Any], by: str) -> None:
        outcome = answer.get("outcome", {})
        if outcome.get("outcome") == "selected":
            chosen = outcome.get("optionId")
            names = {o.get("optionId"): o for o in params.get("options", []) if isinstance(o, dict)}
            option = names.get(chosen, {})
            said = f"{option.get('name') or chosen} [{option.get('kind') or '?'}]"
        else:
            said = "cancelled (refused)"
        if by == "user":
            self._line(f"permission for {_tool_label(params)}: {said}")
        elif by == "no terminal":
            self._line(
                f"permission for {_tool_label(params)}: {said}, answered for you: no terminal to ask "
                "(pass --yes or --deny)"
            )
        else:
            self._line(f"permission for {_tool_label(params)}: {said}, answered for you ({by})")

    def ask(self, params: dict[str, Any]) -> None:
        """Print a permission question (the answer is read by :class:`PermissionAsker`)."""
        self._line(f"the agent asks permission: {_tool_label(params)}")
        for i, option in enumerate(_options(params), 1):
            self.err.write(f"  {i}) {option.get('name') or option.get('optionId')} [{option.get('kind') or '?'}]\n")
        self.err.flush()

    def question(self, text: str) -> None:
        """A question on stderr, the cursor left after it."""
        self._clear()
        self.err.write(f"acp-server: {text} ")
        self.err.flush()
        self.question_open = True

    def result(self, result: dict[str, Any]) -> None:
        self._line(f"stop {result.get('stopReason')}")

    def error(self, exc: BaseException, detail: str | None = None) -> None:
        kind = getattr(exc, "kind", None) or "unknown"
        self._line(f"error {kind}: {detail or exc}")

    def interrupted(self) -> None:
        self._line("interrupted")

    def close(self) -> None:
        self._progress = None
        self._clear()
        if self._last != "\n":
            self.out.write("\n")
            self.out.flush()
            self._last = "\n"

    async def animate(self) -> None:
        while True:
            await trio.sleep(PROGRESS_INTERVAL_S)
            if self._progress is not None:
                self._tick += 1
                self._draw()


class JsonView:
    """One JSON object per line on ``out`` for every event."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def _emit(self, kind: str, **fields: Any) -> None:
        self.out.write(json.dumps({"type": kind, **fields}, separators=(",", ":")) + "\n")
        self.out.flush()

    def session(self, session_id: str, client_id: str | None) -> None:
        self._emit("session", sessionId=session_id, clientId=client_id)

    def update(self, update: Update) -> None:
        fields: dict[str, Any] = {"sessionId": update.session_id, "update": update.update}
        if update.meta is not None:
            fields["_meta"] = update.meta
        self._emit("update", **fields)

    def turn_state(self, params: dict[str, Any]) -> None:
        self._emit("turn_state", **params)

    def retry(self, error: ClientError, attempt: int, max_attempts: int, wait_s: float) -> None:
        self._emit(
            "retry", attempt=attempt, maxAttempts=max_attempts, waitMs=round(wait_s * 1000), error=_error_fields(error)
        )

    def permission(self, params: dict[str, Any], answer: dict[str, Any], by: str) -> None:
        self._emit("permission", request=params, answer=answer, by=by)

    def result(self, result: dict[str, Any]) -> None:
        self._emit("result", **result)

    def error(self, exc: BaseException, detail: str | None = None) -> None:
        fields = _error_fields(exc)
        if detail:
            fields["message"] = detail
        self._emit("error", **fields)

    def interrupted(self) -> None:
        self._emit("interrupted")

    def close(self) -> None:
        self.out.flush()

    async def animate(self) -> None:
        await trio.sleep_forever()


def _options(params: dict[str, Any]) -> list[dict[str, Any]]:
    options = params.get("options")
    return [o for o in options if isinstance(o, dict)] if isinstance(options, list) else []


class PermissionAsker:
    """Answers ``session/request_permission`` for the prompt command.

    Args:
        mode: ``ask`` (read the answer from the terminal), ``yes``/``deny`` (answer for the user), or
            ``refuse`` (no terminal and no flag: ``cancelled``).
        view: where the question and the answer are shown.
        read_line: reads one line of the answer (``""`` at end of input); default: stdin in a thread.
        before: called first (to show what came before the request).
    """

    def __init__(
        self,
        mode: Answer,
        view: View,
        read_line: Callable[[], str] | None = None,
        *,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.mode = mode
        self.view = view
        self.read_line = read_line or sys.stdin.readline
        self.before = before

    async def __call__(self, params: dict[str, Any]) -> dict[str, Any]:
        if self.before is not None:
            self.before()
        options = _options(params)
        if self.mode == "yes":
            answer, by = _selected(pick_option(options, True)), "--yes"
        elif self.mode == "deny":
            answer, by = _selected(pick_option(options, False)), "--deny"
        elif self.mode == "refuse" or not isinstance(self.view, HumanView):
            answer, by = _selected(None), "no terminal"
        else:
            answer, by = await self._ask(params, options, self.view), "user"
        self.view.permission(params, answer, by)
        return answer

    async def _ask(self, params: dict[str, Any], options: list[dict[str, Any]], view: HumanView) -> dict[str, Any]:
        view.ask(params)
        choices = f"y/n/1-{len(options)}" if options else "y/n"
        while True:
            view.question(f"allow? [{choices}]")
            line = await trio.to_thread.run_sync(self.read_line, abandon_on_cancel=True)
            if not line:  # end of input: nobody will answer
                return _selected(None)
            view.question_open = False  # the terminal echoed the answer and its newline
            text = line.strip().lower()
            if text in ("y", "yes"):
                return _selected(pick_option(options, True))
            if text in ("n", "no"):
                return _selected(pick_option(options, False))
            if text.isdigit() and 1 <= int(text) <= len(options):
                return _selected(options[int(text) - 1])
            view.err.write(f"acp-server: answer y, n or an option's number (1-{len(options)})\n")
