"""The wire of the Redis coordinator: script calls bounded by a timeout, batches, the release queue.

:class:`RedisWire` owns what touches Redis: the ``coredis`` client (raw bytes, no decoding) and one
connection of its pool held for every script call (the *line*: each call is one ``create_request`` on it,
in the order the calls are made, so calls made together share one write and one read, and a release
queued before an acquisition reaches Redis before it), the scripts, called by SHA-1 with keys and
arguments encoded to bytes ahead of time (loaded with the first ``PING`` of a connection, and again on
``NOSCRIPT``), the up/down state a failed call moves to, the encoding of acquisitions (once per kind of
admission) and their batching (those of one turn of the event loop go out in one ``acquire.lua`` call,
waiters in their queue's order; while a call is on its way the next batch gathers) and the queue of
releases, sent in order, many per call, kept while Redis is away, and taken into the next acquisition
call when one goes out first (``acquire.lua`` applies them before its requests).
:class:`~acp_server.coordinator.redis.RedisCoordinator` builds the leases, the outages and the waiters on
it.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import coredis
import coredis.exceptions
import trio
from coredis.commands.constants import CommandName
from coredis.connection import BaseConnection

from .base import CoordinatorUnavailable, FailureMode, Lease, Option
from .scripts import SCRIPT_NAMES, Keys, script_source

__all__ = ["SCRIPT_NAMES", "RedisWire", "script_source"]

log = logging.getLogger("acp_server.coordinator")

#: Acquisitions or releases per ``acquire.lua`` or ``release.lua`` call.
_BATCH: Final = 64
#: Script calls sent together in one round trip (a pipeline) when more than one batch is ready.
_PIPELINE: Final = 16
#: Encoded request shapes kept (one per tenant, class and backend seen): past it the cache starts over.
_SHAPES_MAX: Final = 1024

_ERRORS: Final = (coredis.exceptions.RedisError, OSError, trio.TooSlowError)


class _Down(Exception):
    """A call got no answer in time (or the connection failed): the coordinator is away."""


#: The batch order of an acquisition that is not a waiter's: after every waiter of the same call.
ARRIVAL: Final = (1 << 30, 0)


class _Pending:
    """One acquisition waiting for its batch's reply: its KEYS and ARGV, encoded. ``done`` is set when
    its reply (or error) is there, or when its task is to own a call just sent (``own``)."""

    __slots__ = ("args", "done", "error", "keys", "order", "own", "result")

    def __init__(self, keys: list[bytes], args: list[bytes], order: tuple[int, int]) -> None:
        self.order = order
        self.keys = keys
        self.args = args
        self.done = trio.Event()
        self.result: Any = None
        self.error: _Down | None = None
        self.own: _Flight | None = None

    def fail(self, error: _Down) -> None:
        self.error = error
        self.done.set()


class _Flight:
    """One ``acquire.lua`` call on its way: its requests, in order, the request (or the error of
    sending it) and the releases it applies first (with this replica's leave of ``{p}:waiting``)."""

    __slots__ = ("args", "items", "keys", "releases", "request")

    def __init__(
        self, items: list[_Pending], keys: list[Any], args: list[Any], request: Any,
        releases: tuple[list[_Release], bool] | None,
    ) -> None:
        self.items = items
        self.keys = keys
        self.args = args
        self.request = request
        self.releases = releases


#: The ``own`` of a request whose task is to wait one turn of the loop and send what gathered.
_GATHER: Final = _Flight([], [], [], None, None)


class _Release:
    __slots__ = ("full", "lease_id", "names", "queued_at", "sent", "tomb")

    def __init__(
        self, lease_id: str, names: tuple[str, ...], full: bool, tomb: int | None, now: float,
        sent: trio.Event | None = None,
    ) -> None:
        self.lease_id = lease_id
        self.names = names
        self.full = full
        self.tomb = tomb  # the attempt whose tombstone to leave, None for none
        self.queued_at = now
        self.sent = sent  # set once the release reached Redis (or was dropped as stale)


class RedisWire:
    """Calls to one Redis, for one replica.

    Args:
        url: ``redis://HOST:PORT/DB`` or ``rediss://`` (TLS).
        keys: the key names of the prefix.
        replica_id: this replica.
        lease_ttl_s: the leases' TTL (tombstones live as long).
        timeout_ms: a call unanswered for this long means Redis is away.
        failure: ``"closed"`` or ``"local"`` (named in the log line of an outage).
    """

    def __init__(
        self, url: str, keys: Keys, replica_id: str, lease_ttl_s: float, timeout_ms: int, failure: FailureMode
    ) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--coordinator must be a redis:// or rediss:// URL; got {url!r}")
        if isinstance(lease_ttl_s, bool) or not isinstance(lease_ttl_s, (int, float)) or not lease_ttl_s > 0.1:
            raise ValueError(f"--lease-ttl-s must be a number of seconds above 0.1; got {lease_ttl_s!r}")
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 1:
            raise ValueError(f"--coordinator-timeout-ms must be a positive integer; got {timeout_ms!r}")
        if failure not in ("closed", "local"):
            raise ValueError(f'--coordinator-failure must be "closed" or "local"; got {failure!r}')
        self.url = url
        self.keys = keys
        self._replica_id = replica_id
        self._ttl_ms = round(lease_ttl_s * 1000)
        self._timeout_s = timeout_ms / 1000
        self._failure: FailureMode = failure
        self._client: coredis.Redis[bytes] | None = None
        #: script name -> (SHA-1, source), registered on the client by ``running()``
        self._scripts: dict[str, tuple[str, str]] = {}
        self._up = False
        self._up_event = trio.Event()
        self._down_event = trio.Event()
        #: set when another replica announces Redis answers again: the reconnect is tried at once
        self._poke = trio.Event()
        self._next_attempt = 0.0
        self._releases: collections.deque[_Release] = collections.deque()
        #: acquisitions gathering for the next call, and the call on its way (at most one)
        self._acquire_pending: list[_Pending] = []
        self._flight: _Flight | None = None
        self._gathering = False  # a task yields one turn of the loop before it sends what gathered
        #: the last call answered several requests: their tasks are likely to ask again together
        self._gather_next = False
        self._release_wake = trio.Event()
        self._releases_idle = trio.Event()
        self._releases_idle.set()
        #: release calls sent and not answered yet (``flush`` waits for them too)
        self._release_inflight = 0
        #: the connection every script call goes on (``None`` until the first ``_hello``)
        self._line: BaseConnection | None = None
        #: True while this replica may be in ``{p}:waiting`` (a waiter's attempt was refused there)
        self._waiting_sent = False
        #: True when this replica should leave ``{p}:waiting`` with the next release call
        self._unregister = False
        self._failures = self._outages = 0
        self._caps_sent: dict[str, int] = {}  # caps recorded in {p}:caps over this connection
        #: (options, leave) -> their encoding (set names, set keys, JSON spec): one per kind of admission
        self._shapes: dict[tuple[tuple[Option, ...], tuple[str, ...], bool], tuple[tuple[str, ...], list[bytes], bytes]] = {}
        #: the batch's fixed KEYS and ARGV heads, encoded once
        self._acquire_keys = [keys.fence.encode(), keys.caps.encode(), keys.waiting.encode()]
        self._acquire_args = [str(self._ttl_ms).encode(), replica_id.encode(), keys.freed.encode()]

    def _register_scripts(self, client: coredis.Redis[bytes]) -> None:
        """Register every script on ``client`` (its SHA-1 is computed once; nothing is sent yet)."""
        self._scripts = {}
        for name in SCRIPT_NAMES:
            script = client.register_script(script_source(name))
            self._scripts[name] = (str(script.sha), script_source(name))

    async def _hello(self) -> None:
        """``PING`` and ``SCRIPT LOAD`` of every script in one round trip on the line (a new connection
        from the pool when there is none or it broke): Redis answers, and the first calls after a start
        or a restart of Redis find their scripts.

        Raises:
            coredis.exceptions.RedisError, OSError, trio.TooSlowError: no answer within the timeout.
        """
        client = self._client
        assert client is not None
        with trio.fail_after(self._timeout_s):
            line = self._line
            if line is None or not line.usable:
                self._line = None
                line = self._line = await client.connection_pool.get_connection()
            requests = [line.create_request(CommandName.PING, decode=False)]
            requests += [
                line.create_request(CommandName.SCRIPT_LOAD, source, decode=False) for _, source in self._scripts.values()
            ]
            for request in requests:
                await request

    def _send(self, script: str, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> Any:
        """Queue one ``EVALSHA`` on the line now (its place on the wire is fixed by this call); await
        the returned request for the reply (``TimeoutError`` past the timeout).

        Raises:
            coredis.exceptions.ConnectionError: the line is gone (or was never made).
        """
        line = self._line
        if line is None:
            raise coredis.exceptions.ConnectionError("no connection to the coordinator yet")
        return line.create_request(
            CommandName.EVALSHA, self._scripts[script][0], len(keys), *keys, *args, decode=False,
            timeout=self._timeout_s,
        )

    async def _reply(self, script: str, request: Any, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> Any:
        """The reply of a request made by :meth:`_send`; on ``NOSCRIPT`` (a restarted or flushed Redis:
        the call did not run) the script is loaded and the call sent once more."""
        try:
            return await request
        except coredis.exceptions.NoScriptError:
            line = self._line
            assert line is not None
            await line.create_request(CommandName.SCRIPT_LOAD, self._scripts[script][1], decode=False, timeout=self._timeout_s)
            return await self._send(script, keys, args)

    async def _call(self, script: str, keys: Sequence[str | bytes], args: Sequence[str | bytes | int]) -> Any:
        """One script call on the line, bounded by the timeout; a failure marks the coordinator down."""
        try:
            return await self._reply(script, self._send(script, keys, args), keys, args)
        except _ERRORS as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> _Down:
        self._failures += 1
        self._mark_down(exc)
        return _Down(str(exc) or type(exc).__name__)

    async def _call_many(
        self, script: str, calls: Sequence[tuple[Sequence[str | bytes], Sequence[str | bytes | int]]]
    ) -> list[Any]:
        """Several calls of ``script`` (``(keys, args)`` each) in one round trip: queued on the line
        together (one write), each bounded by the timeout; a failure marks the coordinator down. A call
        answered ``NOSCRIPT`` did not run: the script is loaded and that call sent again."""
        try:
            requests = [self._send(script, keys, args) for keys, args in calls]
            return [await self._reply(script, r, *call) for r, call in zip(requests, calls, strict=True)]
        except _ERRORS as exc:
            raise self._failed(exc) from exc

    def _mark_down(self, exc: BaseException) -> None:
        if self._up:
            self._up = False
            self._outages += 1
            self._up_event = trio.Event()
            self._poke = trio.Event()
            self._down_event.set()
            self._next_attempt = trio.current_time()
            log.warning("coordinator %s is away (%s); failure mode %s", self.url, exc or type(exc).__name__, self._failure)

    def _unavailable(self) -> CoordinatorUnavailable:
        wait_ms = max(100, math.ceil((self._next_attempt - trio.current_time()) * 1000))
        return CoordinatorUnavailable(f"the coordinator {self.url} does not answer", retry_after_ms=wait_ms)

    # --- acquire ----------------------------------------------------------------------------------

    def _acquire_request(
        self, lease: Lease, options: Sequence[Option], leave: Sequence[str], attempt: int, token: int,
        wait: bool = False,
    ) -> tuple[tuple[str, ...], list[bytes], list[bytes]]:
        """One request of a batched ``acquire.lua`` call, encoded: the names of its limit sets (set
        ``i`` is ``names[i - 1]``), its KEYS (tombstone, record, sets) and ARGV (``wait``: a waiter's
        attempt, which enters ``{p}:waiting`` when refused)."""
        # A shape is kept once its caps are all recorded over this connection (the caps a request
        # records ride in its spec): a kept shape needs no look at the caps.
        shape = (tuple(options), tuple(leave), wait)
        cached = self._shapes.get(shape)
        if cached is None:
            sent = self._caps_sent
            record = {n.name: n.cap for o in options for n in o.needs if sent.get(n.name) != n.cap}
            cached = self._request_shape(options, leave, record, wait)
            if record:
                if any(name in sent for name in record):
                    self._shapes.clear()  # a cap changed: the shapes kept with the old one record it again
                sent.update(record)
            else:
                if len(self._shapes) >= _SHAPES_MAX:
                    self._shapes.clear()
                self._shapes[shape] = cached
        names, sets, spec = cached
        lease_id = lease.id
        keys = [self.keys.tomb(lease_id, attempt).encode(), self.keys.lease(lease_id).encode(), *sets]
        args = [lease_id.encode(), b"%d" % token, b"%d" % len(names), spec]
        return names, keys, args

    def _request_shape(
        self, options: Sequence[Option], leave: Sequence[str], record: dict[str, int], wait: bool = False
    ) -> tuple[tuple[str, ...], list[bytes], bytes]:
        """What a request's options and leave list encode to, the same for every lease: the set names,
        their keys and the JSON spec (with ``record``'s caps to note in the caps hash)."""
        names: list[str] = []
        index: dict[str, int] = {}

        def ki(name: str) -> int:
            i = index.get(name)
            if i is None:
                names.append(name)
                i = index[name] = len(names)
            return i

        spec_options = []
        for option in options:
            spec: dict[str, Any] = {"n": [[ki(n.name), n.cap, 1 if n.soft else 0] for n in option.needs]}
            rule = option.classes
            if rule is not None:
                spec["c"] = {
                    "r": rule.rank,
                    "s": list(rule.shares),
                    "k": [ki(n) for n in rule.seat_names],
                    "w": [ki(n) for n in rule.room_names],
                }
            spec_options.append(spec)
        body: dict[str, Any] = {"o": spec_options}
        if leave:
            body["d"] = [ki(n) for n in leave]
        if record:
            body["a"] = [[ki(name), cap] for name, cap in record.items()]
        if wait:
            body["q"] = 1
        sets = [self.keys.limit(n).encode() for n in names]
        return tuple(names), sets, json.dumps(body, separators=(",", ":")).encode()

    async def _batched_acquire(self, keys: list[bytes], args: list[bytes], order: tuple[int, int]) -> Any:
        """Send one request (its keys and four arguments, encoded) with the others gathered; its reply.

        At most one ``acquire.lua`` call is on its way; the requests made meanwhile gather and go out
        as one call when it is answered. An arrival with nothing on its way or gathering is sent at
        once (no turn of the loop waited), unless the last call answered several (their tasks are
        likely to ask again in the same turn); a waiter's attempt waits one turn, so the attempts of
        one pass share a call, sorted into queue order. The task that sends a call (or is handed one sent
        for it) awaits its reply and gives every request of the call its own: no task in between.
        A cancel is seen once the reply is known: the waits go on shielded (bounded by the timeout).

        Raises:
            _Down: the call failed or timed out.
        """
        item = _Pending(keys, args, order)
        pending = self._acquire_pending
        pending.append(item)
        try:
            if self._flight is None and not self._gathering:
                if order != ARRIVAL or len(pending) > 1 or self._gather_next:
                    self._gathering = True
                    await self._gather()
                elif pending:
                    self._launch()
            await self._follow(item)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self._follow(item)
        if item.error is not None:
            raise item.error
        return item.result

    async def _follow(self, item: _Pending) -> None:
        """Until ``item`` has its reply: send or land the calls it is handed, else wait for it."""
        while True:
            flight = item.own
            if flight is not None:
                item.own = None
                item.done = trio.Event()
                if flight is _GATHER:
                    await self._gather()
                else:
                    await self._land(flight)
            elif item.done.is_set():
                break  # (Event.wait on a set event would still yield a turn of the loop)
            else:
                await item.done.wait()

    async def _gather(self) -> None:
        """Let the other tasks of this turn of the loop add their requests, then send them."""
        self._gather_next = False
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._gathering = False
        if self._flight is None and self._acquire_pending:
            self._launch()

    def _launch(self) -> None:
        """Send the gathered requests (up to :data:`_BATCH`) in one call, with up to :data:`_BATCH`
        queued releases applied first (the room they free is there for this call); its first request's
        task owns it."""
        pending = self._acquire_pending
        batch = pending[:_BATCH]
        del pending[:_BATCH]
        batch.sort(key=lambda item: item.order)  # waiters in their queue's order, then the arrivals
        queue = self._releases
        unregister = self._unregister and self._may_unregister()
        releases: tuple[list[_Release], bool] | None = None
        keys: list[Any] = self._acquire_keys.copy()
        if self._up and (queue or unregister):
            cut = trio.current_time() - 2 * self._ttl_ms / 1000
            taken = [queue.popleft() for _ in range(min(_BATCH, len(queue)))]
            fresh = [item for item in taken if item.queued_at > cut]
            args: list[Any] = [*self._acquire_args, b"%d" % len(batch), b"%d" % len(fresh), b"1" if unregister else b"0"]
            self._release_parts(fresh, keys, args)
            releases = (taken, unregister)
            if unregister:
                self._unregister = self._waiting_sent = False
            self._release_inflight += 1
        else:
            args = [*self._acquire_args, b"%d" % len(batch), b"0", b"0"]
        for item in batch:
            keys += item.keys
            args += item.args
        try:
            request = self._send("acquire", keys, args)
        except _ERRORS as exc:
            request = exc
        flight = self._flight = _Flight(batch, keys, args, request, releases)
        owner = batch[0]
        owner.own = flight
        owner.done.set()

    async def _land(self, flight: _Flight) -> None:
        """Await ``flight``'s reply, give each request its own, and send what gathered meanwhile."""
        replies: Any = None
        down: _Down | None = None
        unexpected: BaseException | None = None
        try:
            if isinstance(flight.request, BaseException):
                raise flight.request
            try:
                replies = await flight.request
            except (trio.Cancelled, coredis.exceptions.NoScriptError):
                # A cancelled wait leaves the request and line intact: awaited again, shielded, it lands.
                with trio.CancelScope(shield=True):
                    replies = await self._reply("acquire", flight.request, flight.keys, flight.args)
        except _ERRORS as exc:
            down = self._failed(exc)
        except BaseException as exc:  # not an answer of Redis: the call still lands, then it is raised
            down = _Down(repr(exc))
            unexpected = exc
        if flight.releases is not None:
            taken, unregister = flight.releases
            self._release_inflight -= 1
            if down is not None:
                self._releases.extendleft(reversed(taken))
                if unregister:
                    self._unregister = self._waiting_sent = True
            else:
                for release in taken:
                    if release.sent is not None:
                        release.sent.set()
                if not self._releases and not self._release_inflight:
                    self._releases_idle.set()
        for i, item in enumerate(flight.items):
            if down is not None:
                item.error = down
            else:
                item.result = replies[i]
            item.done.set()
        self._flight = None
        self._gather_next = len(flight.items) > 1
        pending = self._acquire_pending
        if pending and not self._gathering:
            if self._gather_next:
                # The tasks just answered ask again in the next turn: the first gathered one sends
                # after it, with them, rather than alone now.
                self._gathering = True
                pending[0].own = _GATHER
                pending[0].done.set()
            else:
                self._launch()
        if self._releases and self._flight is None:
            self._release_wake.set()  # no acquisition went out to take them along
        if unexpected is not None:
            raise unexpected

    def _enqueue_release(self, item: _Release) -> None:
        self._releases.append(item)
        self._releases_idle = trio.Event() if self._releases_idle.is_set() else self._releases_idle
        self._release_wake.set()

    def _may_unregister(self) -> bool:
        """True when this replica may leave ``{p}:waiting`` now (no waiter, none on its way)."""
        return False

    def _release_call(self, items: Sequence[_Release], unregister: bool = False) -> tuple[list[str], list[str | int]]:
        """The KEYS and ARGV of one ``release.lua`` call for ``items`` (``unregister``: this replica
        leaves ``{p}:waiting`` in the same call)."""
        keys: list[str] = [self.keys.waiting]
        args: list[str | int] = [self.keys.freed, self._replica_id, "1" if unregister else "0", len(items)]
        self._release_parts(items, keys, args)
        return keys, args

    def _release_parts(self, items: Sequence[_Release], keys: list[Any], args: list[Any]) -> None:
        """Add the KEYS and the four ARGV values of each release (as ``release.lua`` and
        ``acquire.lua`` take them)."""
        keys_ = self.keys
        for item in items:
            keys.append(keys_.tomb(item.lease_id, item.tomb or 0))
            keys.append(keys_.lease(item.lease_id))
            keys.extend([keys_.limit(n) for n in item.names])
            args += (item.lease_id, "1" if item.full else "0", self._ttl_ms if item.tomb is not None else 0, len(item.names))

    def _send_releases(self) -> tuple[list[_Release], list[Any], list[Any], bool] | None:
        """Take up to :data:`_PIPELINE` calls' worth of queued releases (many per call; an item older
        than two TTLs is dropped: what it held stopped counting long ago) and queue their calls on the
        line now, with this replica's leave of ``{p}:waiting`` when it is due; ``None`` when there is
        nothing to send. :meth:`_settle_releases` awaits the replies."""
        queue = self._releases
        unregister = self._unregister and self._may_unregister()
        if not queue and not unregister:
            return None
        cut = trio.current_time() - 2 * self._ttl_ms / 1000
        taken = [queue.popleft() for _ in range(min(_BATCH * _PIPELINE, len(queue)))]
        fresh = [item for item in taken if item.queued_at > cut]
        calls = [self._release_call(fresh[i : i + _BATCH], unregister and not i) for i in range(0, len(fresh), _BATCH)]
        if not calls:  # only the leave of {p}:waiting, or every item was stale
            calls = [self._release_call((), unregister)]
        if unregister:
            self._unregister = self._waiting_sent = False
        self._release_inflight += 1
        try:
            requests = [self._send("release", keys, args) for keys, args in calls]
        except _ERRORS as exc:
            requests = [exc]
        return taken, calls, requests, unregister

    async def _settle_releases(self, sent: tuple[list[_Release], list[Any], list[Any], bool]) -> None:
        """Await the replies of :meth:`_send_releases`' calls.

        Raises:
            _Down: a call failed; its items are put back first in the queue.
        """
        taken, calls, requests, unregister = sent
        try:
            for request, call in zip(requests, calls, strict=False):
                if isinstance(request, BaseException):
                    raise request
                await self._reply("release", request, *call)
        except _ERRORS as exc:
            self._releases.extendleft(reversed(taken))
            if unregister:
                self._unregister = self._waiting_sent = True
            raise self._failed(exc) from exc
        finally:
            self._release_inflight -= 1
        for item in taken:
            if item.sent is not None:
                item.sent.set()
        if not self._releases and not self._release_inflight:
            self._releases_idle.set()

    async def _drain_releases(self) -> None:
        """Send the queued releases in order, many per call and up to :data:`_PIPELINE` calls per write,
        until the queue is empty.

        Raises:
            _Down: a call failed; its items stay first in the queue.
        """
        while (sent := self._send_releases()) is not None:
            await self._settle_releases(sent)
        if not self._release_inflight:
            self._releases_idle.set()

    async def _releaser(self) -> None:
        """Send queued releases as they come; while Redis is away, wait for it."""
        while True:
            if not self._releases and not (self._unregister and self._may_unregister()):
                if not self._release_inflight:
                    self._releases_idle.set()
                await self._release_wake.wait()
                self._release_wake = trio.Event()
                continue
            if not self._up:
                await self._up_event.wait()
            if self._flight is not None or self._gathering:
                # An acquisition call goes out soon (this turn's, or the next when the one on its way
                # is answered, which wakes this task if none does): the releases go in its write.
                await self._release_wake.wait()
                self._release_wake = trio.Event()
                continue
            try:
                await self._drain_releases()
            except _Down:
                continue

    async def flush(self) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.flush`."""
        await self._releases_idle.wait()

