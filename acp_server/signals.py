"""SIGINT and SIGTERM for a serving process: the first one asks for a graceful shutdown, the second is
absorbed, the third cuts the shutdown's grace short. None of them ever ends in a traceback.

A signal receiver that is closed redelivers what it still holds, and a process group's Ctrl-C (or
``timeout``) sends several signals within milliseconds: so the receiver stays open until serving is
over, and behind it the signals are ignored, so that a late one finds nothing to interrupt. When no
signal came (stdin ended), the process's own handlers are put back.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import trio

__all__ = ["SIGNALS", "ShutdownSignals", "shutdown_signals"]

log = logging.getLogger("acp_server")

#: the signals that stop a server
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ShutdownSignals:
    """The signals received while serving: see :func:`shutdown_signals`.

    Attributes:
        count: how many have arrived.
    """

    def __init__(self, receiver: AsyncIterator[int]) -> None:
        self._receiver = receiver
        self.count = 0

    async def first(self) -> int:
        """Wait for the first signal (the request to shut down) and return its number."""
        signum = await self._receiver.__anext__()
        self.count += 1
        log.info("received %s: shutting down", signal.Signals(signum).name)
        return signum

    async def absorb(self, force: trio.CancelScope) -> None:
        """During shutdown: log the second signal and ignore it; cancel ``force`` at the third."""
        async for signum in self._receiver:
            self.count += 1
            name = signal.Signals(signum).name
            if self.count == 2:
                log.warning("received %s again: already shutting down (a third one stops at once)", name)
            else:
                log.warning("received %s a third time: stopping without waiting for answers", name)
                force.cancel()
                return


@contextmanager
def shutdown_signals() -> Iterator[ShutdownSignals]:
    """Receive SIGINT and SIGTERM for the duration of the block (main thread only).

    On the way out the signals are ignored (a signal received then, or still held by the receiver,
    interrupts nothing), unless none came: then the handlers from before are restored.
    """
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)  # what the receiver restores when it closes
    watch: ShutdownSignals | None = None
    try:
        with trio.open_signal_receiver(*SIGNALS) as receiver:
            watch = ShutdownSignals(receiver)
            yield watch
    finally:
        if watch is None or not watch.count:
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
