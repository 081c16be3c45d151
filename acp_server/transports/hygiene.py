"""Socket hygiene of a connection shell: the first-message and idle timeouts.

Not for stdio (the editor's own pipe): a connection that sends no complete line within
``first_message_timeout_s`` is closed, and so is one that holds nothing (no request in flight, no
request of ours open, nothing ``holds`` says it keeps, such as an attached session) and sends nothing
for ``idle_timeout_s``. Both are kept by one timer for the whole run (:mod:`.deadlines`), not by a task
per connection: a socket costs one heap entry, and a wake-up per timeout period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from .deadlines import Deadline, deadlines
from .refusals import RefusalGuard

__all__ = ["IdleTimeouts"]

log = logging.getLogger("acp_server.connection")


class IdleTimeouts(RefusalGuard):
    """The timeouts of :class:`~.shell.ConnectionShell`, its base (``__init__`` sets these slots)."""

    __slots__ = ("_deadline", "_first_message_timeout_s", "_idle_timeout_s", "_last_input", "_opened")

    _deadline: Deadline | None  # this socket's pending wake-up in the run's shared timer, if any
    _first_message_timeout_s: float | None
    _idle_timeout_s: float | None
    _last_input: float  # trio.current_time() of the last bytes read
    _opened: float  # trio.current_time() when the shell's run() began

    if TYPE_CHECKING:
        _got_line: bool
        _input_ended: bool
        _slots: dict[Any, Any]
        _outbound: dict[Any, Any]
        _holds: Callable[[Any], bool] | None

    def _holds_nothing(self) -> bool:
        return not (self._slots or self._outbound or (self._holds is not None and self._holds(self)))

    def _arm_timeouts(self) -> None:
        """Ask the run's shared timer for this socket's first wake-up (first message, else idle)."""
        now = self._opened = trio.current_time()
        first, idle = self._first_message_timeout_s, self._idle_timeout_s
        if first is not None:
            self._deadline = deadlines().at(now + first, self._first_message_due)
        elif idle is not None:
            self._deadline = deadlines().at(now + idle, self._idle_due)

    def _first_message_due(self) -> None:
        """Close a socket that sent no complete line in time; else watch it for idling."""
        self._deadline = None
        if self._closed:
            return
        if not self._got_line and not self._input_ended:
            log.info("%s: no complete message within %.0f s; closing", self.name, self._first_message_timeout_s)
            self.close()
            return
        if self._idle_timeout_s is not None:
            self._idle_due()

    def _idle_due(self) -> None:
        """Close a socket idle for ``idle_timeout_s`` holding nothing; else wake up again when it may be."""
        self._deadline = None
        idle = self._idle_timeout_s
        if self._closed or idle is None:
            return
        now = trio.current_time()
        deadline = max(self._last_input, self._opened) + idle
        if now >= deadline:
            if self._holds_nothing() and not self._input_ended:
                log.info("%s: idle for %.0f s holding nothing; closing", self.name, idle)
                self.close()
                return
            deadline = now + idle
        self._deadline = deadlines().at(deadline, self._idle_due)
