"""A Hypothesis state machine drives one capacity pool through random leases, refusals, backend calls,
finishes, cancels, grant/cancel races and lease releases, and checks it against a plain model after
every step: counters, who holds a permit (so FIFO order), who entered a call, and no leaked or doubly
released permit.

Hypothesis rules are synchronous, so the pool lives in a trio run on a background thread; each step
runs there as one synchronous action followed by ``wait_all_tasks_blocked`` to let every task settle.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
import trio
import trio.testing
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from acp_server.admission import CapacityPool, Lease, PoolLimits
from acp_server.errors import CapacityExceededError

from .helpers import scaled

T = TypeVar("T")

#: the longest a step may take on a loaded machine before the test reports the pool stuck
TIMEOUT_S = 30.0


class TrioThread:
    """A trio run on a daemon thread, taking synchronous steps from the test thread.

    Every wait is bounded, so a broken pool fails the test instead of hanging it.
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(TIMEOUT_S):
            raise TimeoutError("the trio thread did not start")

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by close(), not lost in the thread
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def step(self, action: Callable[[], T]) -> T:
        """Run ``action`` synchronously in the trio thread, then wait until every task is blocked.

        Raises:
            Whatever ``action`` raised; TimeoutError when the trio thread does not answer.
        """
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run() -> None:
            try:
                result = action()
                await trio.testing.wait_all_tasks_blocked()
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(result)

        self.token.run_sync_soon(self.nursery.start_soon, run)
        return done.result(timeout=TIMEOUT_S)

    def abandon(self) -> None:
        """Ask the run to stop without waiting for it; the daemon thread dies with the process at worst."""
        if self._failure is None:
            with contextlib.suppress(trio.RunFinishedError):
                self.token.run_sync_soon(self._stop.set)
        self._thread.join(0.5)

    def close(self) -> None:
        if self._failure is None:
            self.token.run_sync_soon(self._stop.set)
        self._thread.join(TIMEOUT_S)
        if self._failure is not None:
            raise self._failure
        if self._thread.is_alive():
            raise TimeoutError("the trio thread did not stop")


@dataclass(eq=False)
class Call:
    """One backend call under a lease, and what the model expects of it."""

    lease: Lease
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    finish: trio.Event = field(default_factory=trio.Event)
    # what happened, set by the worker task
    entered: bool = False
    done: bool = False
    error: BaseException | None = None
    # what the model expects
    state: str = "waiting"  # waiting -> body -> done, or waiting -> done
    expect_entered: bool = False
    expect_error: bool = False


async def worker(call: Call) -> None:
    with call.scope:
        try:
            async with call.lease.permit():
                call.entered = True
                await call.finish.wait()
        except RuntimeError as exc:  # the lease was released while this call waited
            call.error = exc
    call.done = True


def tracked(method: Callable[..., None]) -> Callable[..., None]:
    """Mark the machine unsteady while ``method`` runs: teardown then knows a step failed midway."""

    @functools.wraps(method)
    def wrapper(self: PoolMachine, *args: object, **kwargs: object) -> None:
        self.steady = False
        method(self, *args, **kwargs)
        self.steady = True

    return wrapper


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trio = TrioThread()
        self.steady = True
        self.pool: CapacityPool | None = None
        self.max_active = 0
        self.live: list[Lease] = []
        self.released: list[Lease] = []
        self.calls: list[Call] = []
        self.current: dict[Lease, Call] = {}
        # the model
        self.holding: set[Lease] = set()
        self.queue: list[Call] = []
        self.admitted = 0
        self.refused = 0

    # --- model helpers ------------------------------------------------------------------------------

    @property
    def limits(self) -> PoolLimits:
        assert self.pool is not None
        return self.pool.limits

    def model_free_permit(self) -> None:
        """A permit came back: the oldest waiter gets it, or it goes back to the pool."""
        if self.queue:
            call = self.queue.pop(0)
            call.state = "body"
            call.expect_entered = True
            self.holding.add(call.lease)

    def model_release_lease(self, lease: Lease) -> None:
        self.live.remove(lease)
        self.released.append(lease)
        call = self.current.get(lease)
        if call is not None and call.state == "waiting":
            self.queue.remove(call)
            call.state = "done"
            call.expect_error = True
        if lease in self.holding:
            self.holding.remove(lease)
            self.model_free_permit()

    def model_end_call(self, call: Call) -> None:
        """The call is cancelled or finishes."""
        if call.state == "waiting":
            self.queue.remove(call)
        elif call.lease in self.holding:
            self.holding.remove(call.lease)
            self.model_free_permit()
        call.state = "done"

    def idle_leases(self) -> list[Lease]:
        return [lease for lease in self.live if lease not in self.current or self.current[lease].state == "done"]

    def open_calls(self) -> list[Call]:
        return [call for call in self.calls if call.state != "done"]

    # --- rules --------------------------------------------------------------------------------------

    @initialize(max_active=st.integers(1, 2), max_waiting=st.none() | st.integers(0, 4))
    @tracked
    def make_pool(self, max_active: int, max_waiting: int | None) -> None:
        self.pool = CapacityPool("b", PoolLimits(max_active=max_active, max_waiting=max_waiting))
        self.max_active = max_active

    @rule(session=st.sampled_from(["s1", "s2", "s3"]))
    @tracked
    def lease(self, session: str) -> None:
        assert self.pool is not None
        pool = self.pool
        bound = self.limits.admission_limit
        before = pool.statistics()
        if bound is not None and len(self.live) >= bound:
            with pytest.raises(CapacityExceededError) as info:
                self.trio.step(lambda: pool.try_lease(session))
            self.refused += 1
            payload = info.value.payload
            assert (payload.limit, payload.session_id) == (bound, session)
            assert (payload.active_count, payload.waiting_count) == (before.active, before.leased - before.active)
        else:
            self.live.append(self.trio.step(lambda: pool.try_lease(session)))
            self.admitted += 1

    @precondition(lambda self: self.idle_leases())
    @rule(data=st.data())
    @tracked
    def start_call(self, data: st.DataObject) -> None:
        """A backend call (a first attempt or a retry) under an idle lease."""
        lease = data.draw(st.sampled_from(self.idle_leases()))
        call = Call(lease)
        self.calls.append(call)
        self.current[lease] = call
        if len(self.holding) < self.max_active and not self.queue:
            call.state = "body"
            call.expect_entered = True
            self.holding.add(lease)
        else:
            self.queue.append(call)
        self.trio.step(lambda: self.trio.nursery.start_soon(worker, call))

    @precondition(lambda self: any(call.state == "body" for call in self.calls))
    @rule(data=st.data())
    @tracked
    def finish_call(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if c.state == "body"]))
        self.model_end_call(call)
        self.trio.step(call.finish.set)

    @precondition(lambda self: any(call.state != "done" for call in self.calls))
    @rule(data=st.data())
    @tracked
    def cancel_call(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from(self.open_calls()))
        self.model_end_call(call)
        self.trio.step(call.scope.cancel)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    @tracked
    def release_lease(self, data: st.DataObject, twice: bool) -> None:
        """Release a lease in any state: idle, waiting for a permit, or holding one."""
        lease = data.draw(st.sampled_from(self.live))
        self.model_release_lease(lease)

        def release() -> None:
            lease.release()
            if twice:
                lease.release()

        self.trio.step(release)

    @precondition(lambda self: self.queue and any(lease in self.holding for lease in self.live))
    @rule(data=st.data(), release_first=st.booleans())
    @tracked
    def race(self, data: st.DataObject, release_first: bool) -> None:
        """In one tick, a holder gives its permit back and the oldest waiter is cancelled, in either order."""
        holder = data.draw(st.sampled_from([lease for lease in self.live if lease in self.holding]))
        oldest = self.queue[0]
        if release_first:
            self.model_release_lease(holder)
            self.model_end_call(oldest)  # granted, then cancelled at its first checkpoint
        else:
            self.model_end_call(oldest)
            self.model_release_lease(holder)

        def act() -> None:
            if release_first:
                holder.release()
                oldest.scope.cancel()
            else:
                oldest.scope.cancel()
                holder.release()

        self.trio.step(act)

    # --- invariants ---------------------------------------------------------------------------------

    @invariant()
    @tracked
    def pool_matches_model(self) -> None:
        if self.pool is None:
            return
        stats = self.pool.statistics()
        assert stats.active == len(self.holding) <= self.max_active
        assert stats.waiting == len(self.queue)
        assert stats.leased == len(self.live)
        bound = self.limits.admission_limit
        assert bound is None or stats.leased <= bound
        assert (stats.admitted_total, stats.refused_total) == (self.admitted, self.refused)
        # who holds a permit: a FIFO violation or a lost/duplicated permit shows here
        holders = {lease for lease in self.live + self.released if lease.holds_permit}
        assert holders == self.holding
        for call in self.calls:
            assert call.entered == call.expect_entered, call
            assert call.done == (call.state == "done"), call
            assert (call.error is not None) == call.expect_error, call

    def teardown(self) -> None:
        if not self.steady:
            # A step already failed: the pool may be corrupt, so driving it further could hang the
            # shrinker on every example. Report that failure alone and abandon the trio thread.
            self.trio.abandon()
            return
        try:
            if self.pool is not None:
                pool = self.pool

                def drain() -> None:
                    for call in self.calls:
                        call.scope.cancel()
                    for lease in self.live:
                        lease.release()

                self.trio.step(drain)
                stats = pool.statistics()
                assert (stats.active, stats.waiting, stats.leased) == (0, 0, 0)
                assert all(call.done for call in self.calls)
                assert not any(lease.holds_permit or lease.waiting for lease in self.live + self.released)
        finally:
            self.trio.close()


PoolMachine.TestCase.settings = settings(
    max_examples=scaled(500, 150),
    stateful_step_count=scaled(60, 40),
    deadline=None,
    # the explain phase reruns a failure hundreds of times over threads: minutes for little insight
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestPoolStateMachine = PoolMachine.TestCase
