"""How the connection shell's reader waits for input, and reads without waiting.

- :func:`read_now`: a non-blocking read, ``None`` when there is nothing yet.
- :func:`readable_waiter`: trio's readable wait without its two wrapper coroutines (sockets).
- :func:`edge_waiter`: the stdio pipe, waited on with one ``epoll_wait`` per wait and no ``epoll_ctl``.

The pipe's wait. trio registers a descriptor it waits on with ``EPOLLONESHOT``: each wait re-arms it (an ``epoll_ctl``
system call, and ``_update_registrations`` in Python), since an event disarms it. A sequential stdio
prompt then costs four system calls: ``read``, ``write``, ``epoll_wait`` and that ``epoll_ctl``. Here the
pipe's read end is registered once in the run's epoll, edge-triggered (``EPOLLIN | EPOLLET``, no
``EPOLLONESHOT``): the kernel reports each time data arrives in the pipe, and nothing is re-armed. A
wait only tells trio's epoll manager which task waits (its ``EpollWaiters`` entry, with the flags it
believes armed, so that it makes no ``epoll_ctl`` of its own); trio's ``process_events`` wakes the task
and drops the entry, as for any one-shot event.

An edge is reported once, to whoever waits then; one that comes while nobody waits is lost. So the
reader waits only when the pipe was seen empty (a short read, or one that failed with ``EAGAIN``) and
no ``epoll_wait`` ran since: the reader checks the count of trio's scheduling passes (each ends in one
``epoll_wait``), and reads again first if one ran (see ``ConnectionShell.run``). This is the stdio pipe
only: its read end is waited on by nobody else (a socket's descriptor is also waited on for writing,
which would make trio re-register it one-shot). :meth:`PipeStream._wait_readable
<.listeners.PipeStream>` (trio's own wait) drops the registration first, and ``notify_closing`` drops
it when the stream closes.
"""

from __future__ import annotations

import inspect
import os
import select
from collections import defaultdict
from collections.abc import Awaitable, Callable
from functools import cache
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .listeners import PipeStream

__all__ = ["READ_SIZE", "edge_waiter", "read_now", "readable_waiter"]

#: how much the shell's reader asks for at each read (a shorter read emptied the kernel's buffer)
READ_SIZE = 65536
_EDGE = select.EPOLLIN | select.EPOLLET


def read_now(fd: int) -> bytes | None:
    """What a non-blocking descriptor has to read now (``b""`` at its end), ``None`` if nothing yet."""
    try:
        return os.read(fd, READ_SIZE)
    except BlockingIOError:
        return None


def readable_waiter() -> Callable[[int, str], Awaitable[None]]:
    """``wait(fd, "read_task")``: trio's ``wait_readable(fd)``, without its two wrapper coroutines.

    ``trio.lowlevel.wait_readable`` awaits the run's I/O manager's ``wait_readable``, which awaits its
    ``_epoll_wait(fd, "read_task")``: every step of a reader that waits goes through both frames again.
    On trio's epoll manager (Linux) this calls ``_epoll_wait`` itself; without it (another trio, another
    platform), ``trio.lowlevel.wait_readable``.
    """
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT

        io = GLOBAL_RUN_CONTEXT.runner.io_manager
        epoll_wait = io._epoll_wait
        public = io.wait_readable
    except (ImportError, AttributeError):
        epoll_wait = None
    if epoll_wait is None or not inspect.iscoroutinefunction(epoll_wait) or not inspect.iscoroutinefunction(public):
        return _public_wait_readable
    return epoll_wait


async def _public_wait_readable(fd: int, _: str) -> None:
    await trio.lowlevel.wait_readable(fd)


@cache
def _waiter_type(base: type) -> type:
    """trio's ``EpollWaiters`` with a ``write_task`` that notices a hang-up (see :func:`edge_waiter`)."""

    def get_write_task(self: Any) -> None:
        if self.read_task is not None:
            # trio's process_events asks for the writer first, the reader still set, only for an
            # event with more than EPOLLIN in it: the writing end closed (EPOLLHUP) or an error.
            self.hangup = True
        return None

    def set_write_task(self: Any, task: object) -> None:
        if task is not None:  # a writer waits on the read end (nobody does): trio's wait decides then
            self.hangup = True

    return type(
        "EdgeWaiters",
        (base,),
        {"__slots__": ("hangup",), "write_task": property(get_write_task, set_write_task)},
    )


def edge_waiter(pipe: PipeStream) -> Callable[[int], Awaitable[None]] | None:
    """``wait(fd)`` for ``pipe``'s :attr:`~.listeners.PipeStream.receive_fd` in the current run, as
    described above; ``None`` where trio's internals are not those of its epoll manager (another trio,
    another platform: the caller then waits with trio's ``wait_readable``).

    ``wait(fd)`` raises ``trio.ClosedResourceError`` when the stream is closed while it waits, and
    falls back to trio's own wait when the descriptor cannot be registered (a regular file: trio's wait
    then raises as it did before).

    An edge that reports a hang-up (the writing end closed) may come with the last data: the read after
    it is short, yet the next read would return the end of input, and no edge comes any more. The
    registration's entry notices it (trio's ``process_events`` asks the entry for a writer task only
    for such an event), and the next wait is trio's own, which returns at once then.
    """
    try:
        from outcome import Value
        from trio._core._io_epoll import EpollIOManager, EpollWaiters
        from trio._core._run import GLOBAL_RUN_CONTEXT
        from trio._core._traps import WaitTaskRescheduled, _async_yield

        run_context: Any = GLOBAL_RUN_CONTEXT
        io: Any = run_context.runner.io_manager
        registered = io._registered
        epoll = io._epoll
    except (ImportError, AttributeError):
        return None
    if type(io) is not EpollIOManager or type(registered) is not defaultdict:
        return None
    if registered.default_factory is not EpollWaiters or not hasattr(EpollWaiters(), "current_flags"):
        return None
    entry = _waiter_type(EpollWaiters)()
    entry.hangup = False
    succeeded = trio.lowlevel.Abort.SUCCEEDED
    readable = select.EPOLLIN

    def abort(_: object) -> trio.lowlevel.Abort:
        # Cancelled: nobody waits any more; the registration stays (the reader reads before its next wait).
        entry.read_task = None
        entry.current_flags = 0
        fd = pipe.receive_fd
        if fd is not None and registered.get(fd) is entry:
            del registered[fd]
        return succeeded

    # trio.lowlevel.wait_task_rescheduled(abort)'s yield, its one trap object made once (its abort is
    # always this one): no coroutine frame and no trap object per wait
    trap = WaitTaskRescheduled(abort)

    async def wait_edge(fd: int) -> None:
        if entry.hangup or fd in registered:
            # A hang-up was seen (or another task waits on it): trio's one-shot wait, which reports
            # what holds now (the end of input at once), or raises BusyResourceError.
            entry.hangup = False
            pipe.drop_edge()
            await trio.lowlevel.wait_readable(fd)
            return
        if pipe.edge_epoll is not epoll:
            try:
                try:
                    epoll.register(fd, _EDGE)
                except FileExistsError:  # registered one-shot by trio's wait before
                    epoll.modify(fd, _EDGE)
            except OSError:
                await trio.lowlevel.wait_readable(fd)  # (a regular file) trio's wait raises as before
                return
            pipe.edge_epoll = epoll
        entry.read_task = run_context.task  # trio.lowlevel.current_task(), without the call
        entry.current_flags = readable  # armed, as trio sees it: it makes no epoll_ctl
        registered[fd] = entry
        woken = await _async_yield(trap)
        if type(woken) is not Value:  # an Error (a cancellation): raised. A Value is None: no unwrap call
            woken.unwrap()

    return wait_edge
