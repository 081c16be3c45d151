"""Each Lua script of the Redis coordinator on its own, against a real redis-server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import coredis
import pytest
import trio

from acp_server.coordinator.scripts import SCRIPT_NAMES, Keys, script_source

from .redis_server import RedisServer, redis_server  # noqa: F401

K = Keys("t")


class Scripts:
    def __init__(self, client: coredis.Redis[bytes]) -> None:
        self.client = client
        self.s = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    @staticmethod
    def request(
        lease: str,
        options: list[dict[str, Any]],
        *,
        names: list[str],
        token: int = 0,
        leave: list[str] = (),  # type: ignore[assignment]
        attempt: int = 1,
        wait: bool = False,
    ) -> tuple[list[str], list[Any]]:
        """One request: options [{"n": [[name, cap, soft]], "c": {...names...}}], names numbered 1.. in
        the order given."""
        keys = [K.tomb(lease, attempt), K.lease(lease)] + [K.limit(n) for n in names]
        ix = {n: i + 1 for i, n in enumerate(names)}
        spec_o = []
        for o in options:
            spec: dict[str, Any] = {"n": [[ix[n], cap, soft] for n, cap, soft in o["n"]]}
            if "c" in o:
                c = o["c"]
                spec["c"] = {"r": c["r"], "s": c["s"], "k": [ix[n] for n in c["k"]], "w": [ix[n] for n in c["w"]]}
            spec_o.append(spec)
        body: dict[str, Any] = {"o": spec_o}
        if leave:
            body["d"] = [ix[n] for n in leave]
        if wait:
            body["q"] = 1
        return keys, [lease, token, len(names), json.dumps(body)]

    async def batch(
        self, requests: list[tuple[list[str], list[Any]]], *, ttl: int = 10_000, replica: str = "r1",
        releases: list[tuple[str, list[str], bool, int, int]] = (),  # type: ignore[assignment]
    ) -> list[list[Any]]:
        """One acquire.lua call: ``releases`` (lease, sets, full, tombstone ms, attempt) first."""
        keys = [K.fence, K.caps, K.waiting]
        args: list[Any] = [ttl, replica, K.freed, len(requests), len(releases), "0"]
        for lease, names, full, tomb_ms, attempt in releases:
            keys += [K.tomb(lease, attempt), K.lease(lease)] + [K.limit(n) for n in names]
            args += [lease, "1" if full else "0", tomb_ms, len(names)]
        for k, a in requests:
            keys.extend(k)
            args.extend(a)
        return [list(r) for r in await self.s["acquire"](keys=keys, args=args)]

    async def acquire(
        self, lease: str, options: list[dict[str, Any]], *, ttl: int = 10_000, replica: str = "r1", **kw: Any
    ) -> list[Any]:
        return (await self.batch([self.request(lease, options, **kw)], ttl=ttl, replica=replica))[0]

    async def release(
        self, lease: str, names: list[str], *, full: bool = True, tomb_ms: int = 0, attempt: int = 1,
        replica: str = "r1", unregister: bool = False,
    ) -> int:
        keys = [K.waiting, K.tomb(lease, attempt), K.lease(lease)] + [K.limit(n) for n in names]
        args = [K.freed, replica, "1" if unregister else "0", 1, lease, "1" if full else "0", tomb_ms, len(names)]
        return int(await self.s["release"](keys=keys, args=args))

    async def renew(
        self, leases: list[tuple[str, list[str]]], *, ttl: int = 10_000, replica: str = "r1", waiting: bool = False
    ) -> list[int]:
        keys = [K.replicas, K.waiting]
        args: list[Any] = [replica, ttl, len(leases), "1" if waiting else "0"]
        for lease, names in leases:
            keys.append(K.lease(lease))
            keys.extend(K.limit(n) for n in names)
            args.extend((lease, len(names)))
        return [int(x) for x in await self.s["renew"](keys=keys, args=args)]

    async def members(self, name: str) -> set[bytes]:
        return set(await self.client.zrange(K.limit(name), 0, -1))


@pytest.fixture
async def scripts(redis_server: RedisServer) -> AsyncIterator[Scripts]:  # noqa: F811
    async with coredis.Redis.from_url(redis_server.url) as client:
        yield Scripts(client)


# --- acquire.lua -----------------------------------------------------------------------------------


async def test_acquire_never_passes_the_cap(scripts: Scripts) -> None:
    opt = [{"n": [["seats", 2, 0]]}]
    assert (await scripts.acquire("a", opt, names=["seats"]))[0] == 1
    assert (await scripts.acquire("b", opt, names=["seats"]))[0] == 1
    refused = await scripts.acquire("c", opt, names=["seats"])
    assert refused[:5] == [0, 1, 2, 2, 0]
    assert await scripts.members("seats") == {b"a", b"b"}
    # a holder asking again is not counted against itself
    assert (await scripts.acquire("a", opt, names=["seats"], attempt=2))[0] == 1


async def test_acquire_is_all_or_nothing(scripts: Scripts) -> None:
    await scripts.acquire("x", [{"n": [["tenant:t", 1, 0]]}], names=["tenant:t"])
    refused = await scripts.acquire("a", [{"n": [["seats", 5, 0], ["tenant:t", 1, 0]]}], names=["seats", "tenant:t"])
    assert refused[0] == 0 and refused[1] == 2  # the tenant limit, the request's set 2
    assert await scripts.members("seats") == set()
    assert await scripts.client.get(K.lease("a")) is None


async def test_a_full_soft_cap_falls_through_to_the_next_option(scripts: Scripts) -> None:
    names = ["seats", "room", "pool:e"]
    options = [{"n": [["seats", 1, 1], ["pool:e", 3, 0]]}, {"n": [["room", 1, 0], ["pool:e", 3, 0]]}]
    assert (await scripts.acquire("a", options, names=names))[0] == 1
    assert (await scripts.acquire("b", options, names=names))[0] == 2  # queued
    refused = await scripts.acquire("c", options, names=names)  # the room is full too
    assert refused[:5] == [0, 2, 1, 1, 0]
    assert await scripts.members("pool:e") == {b"a", b"b"}
    # a full hard cap in the first option refuses at once, the second is not tried
    await scripts.acquire("p", [{"n": [["pool:e", 0, 0]]}], names=["pool:e"])  # count only: joins
    hard = [{"n": [["seats", 9, 1], ["pool:e", 3, 0]]}, {"n": [["room", 9, 0]]}]
    assert (await scripts.acquire("d", hard, names=names))[:2] == [0, 3]
    assert b"d" not in await scripts.members("room")


async def test_a_tombstoned_attempt_takes_nothing(scripts: Scripts) -> None:
    assert await scripts.release("a", ["seats"], tomb_ms=10_000, attempt=1) == 0
    assert await scripts.acquire("a", [{"n": [["seats", 5, 0]]}], names=["seats"], attempt=1) == [-1]
    assert await scripts.members("seats") == set()
    # the lease's next attempt is not tombstoned
    assert (await scripts.acquire("a", [{"n": [["seats", 5, 0]]}], names=["seats"], attempt=2))[0] == 1


async def test_expired_members_stop_counting_and_are_not_held(scripts: Scripts) -> None:
    opt = [{"n": [["seats", 1, 0]]}]
    assert (await scripts.acquire("a", opt, names=["seats"], ttl=50))[0] == 1
    assert (await scripts.acquire("b", opt, names=["seats"]))[0] == 0
    await trio.sleep(0.08)
    assert (await scripts.acquire("b", opt, names=["seats"]))[0] == 1
    # "a" expired: asking again it is a newcomer, and the seat is b's
    assert (await scripts.acquire("a", opt, names=["seats"], attempt=2))[0] == 0
    assert await scripts.members("seats") == {b"b"}


async def test_fencing_tokens_grow_and_are_kept_on_request(scripts: Scripts) -> None:
    t1 = (await scripts.acquire("a", [{"n": [["s", 0, 0]]}], names=["s"]))[1]
    t2 = (await scripts.acquire("b", [{"n": [["s", 0, 0]]}], names=["s"]))[1]
    assert t2 > t1
    kept = (await scripts.acquire("a", [{"n": [["u", 0, 0]]}], names=["u"], token=t1, attempt=2))[1]
    assert kept == t1
    assert (await scripts.client.get(K.lease("a"))) == f"{t1}|r1".encode()


CLS = {"k": ["seats:c0", "seats:c1", "seats:c2", "seats:c3"], "w": ["room:c0", "room:c1", "room:c2", "room:c3"]}
CLS_NAMES = ["seats", "room", *CLS["k"], *CLS["w"]]


def _seat(rank: int, shares: list[int], seats: int = 4) -> dict[str, Any]:
    return {"n": [["seats", seats, 0], [CLS["k"][rank], 0, 0]], "c": {"r": rank, "s": shares, **CLS}}


def _room(rank: int) -> dict[str, Any]:
    return {"n": [["room", 10, 0], [CLS["w"][rank], 0, 0]]}


async def test_class_rule_a_class_at_its_share_borrows_only_when_no_class_below_its_share_waits(scripts: Scripts) -> None:
    shares = [1, 2, 1, 0]
    n = CLS_NAMES
    # bulk (share 0) borrows while nobody waits
    assert (await scripts.acquire("b1", [_seat(3, shares)], names=n))[0] == 1
    # an interactive waiter appears: bulk can no longer borrow
    assert (await scripts.acquire("w1", [_room(1)], names=n))[0] == 1
    refused = await scripts.acquire("b2", [_seat(3, shares)], names=n)
    assert refused[0] == 0 and refused[4] == 1  # soft: a class-share refusal
    # the interactive waiter takes its seat and leaves the room in the same call
    assert (await scripts.acquire("w1", [_seat(1, shares)], names=n, leave=["room", "room:c1"], attempt=2))[0] == 1
    assert await scripts.members("room") == set()
    assert await scripts.members("seats") == {b"b1", b"w1"}
    # nobody waits now: bulk borrows again
    assert (await scripts.acquire("b2", [_seat(3, shares)], names=n, attempt=2))[0] == 1


async def test_class_rule_an_arrival_queues_behind_a_waiter_of_its_class(scripts: Scripts) -> None:
    shares = [1, 2, 1, 0]
    n = CLS_NAMES
    assert (await scripts.acquire("w1", [_room(1)], names=n))[0] == 1
    # a free seat, but an interactive prompt waits: the arrival falls through to the room
    assert (await scripts.acquire("a", [_seat(1, shares), _room(1)], names=n))[0] == 2
    # the waiter itself takes the seat
    assert (await scripts.acquire("w1", [_seat(1, shares)], names=n, leave=["room", "room:c1"], attempt=2))[0] == 1


async def test_acquire_that_leaves_a_set_publishes(scripts: Scripts, redis_server: RedisServer) -> None:  # noqa: F811
    # another replica waits (its attempt was refused): a set left is announced to it
    await scripts.acquire("x", [{"n": [["seats", 0, 0]]}], names=["seats"])
    assert (await scripts.acquire("y", [{"n": [["seats", 1, 0]]}], names=["seats"], replica="r2", wait=True))[0] == 0
    async with scripts.client.pubsub(channels=[K.freed], ignore_subscribe_messages=True) as ps:
        await scripts.acquire("w", [_room(1)], names=CLS_NAMES)
        await scripts.acquire("w", [_seat(1, [1, 2, 1, 0])], names=CLS_NAMES, leave=["room", "room:c1"], attempt=2)
        with trio.fail_after(5):
            message = None
            while message is None:  # None: a subscribe confirmation, filtered out
                message = await ps.get_message()
        assert message["type"] == "message" and message["channel"] == K.freed.encode()


async def test_a_waiter_taking_the_last_seat_from_the_room_announces_nothing(scripts: Scripts) -> None:
    await scripts.acquire("x", [{"n": [["seats", 1, 0]]}], names=["seats"])
    assert (await scripts.acquire("y", [{"n": [["seats", 1, 0]]}], names=["seats"], replica="r2", wait=True))[0] == 0
    async with scripts.client.pubsub(channels=[K.freed]) as ps:
        await scripts.acquire("w", [_room(1)], names=CLS_NAMES)
        assert await _announced(scripts, ps, scripts.release("x", ["seats"]))  # r2 waits
        took = scripts.acquire("w", [_seat(1, [1, 2, 1, 0], seats=1)], names=CLS_NAMES, leave=["room", "room:c1"], attempt=2)
        # w left the room, but the seats are full again: nothing anyone could take
        assert not await _announced(scripts, ps, took)
        assert await scripts.members("room") == set() and await scripts.members("seats") == {b"w"}


async def test_one_call_serves_a_batch_in_order(scripts: Scripts) -> None:
    opt = [{"n": [["seats", 2, 0]]}]
    replies = await scripts.batch([scripts.request(x, opt, names=["seats"]) for x in "abc"])
    assert [r[0] for r in replies] == [1, 1, 0]  # the third sees the first two
    assert replies[1][1] == replies[0][1] + 1  # tokens in order
    assert await scripts.members("seats") == {b"a", b"b"}


async def test_a_batched_release_frees_every_lease(scripts: Scripts) -> None:
    await scripts.batch([scripts.request(x, [{"n": [["seats", 5, 0]]}], names=["seats"]) for x in "ab"])
    keys = [K.waiting, K.tomb("a", 1), K.lease("a"), K.limit("seats"), K.tomb("b", 1), K.lease("b"), K.limit("seats")]
    args = [K.freed, "r1", "0", 2, "a", "1", 0, 1, "b", "1", 0, 1]
    assert await scripts.s["release"](keys=keys, args=args) == 2
    assert await scripts.members("seats") == set()


async def test_releases_in_an_acquire_call_go_before_its_requests(scripts: Scripts) -> None:
    seat = [{"n": [["seats", 1, 0]]}]
    await scripts.acquire("a", seat, names=["seats"])
    # a's release and b's acquisition in one call: b gets the seat a leaves
    replies = await scripts.batch([scripts.request("b", seat, names=["seats"])], releases=[("a", ["seats"], True, 0, 1)])
    assert replies[0][0] == 1
    assert await scripts.members("seats") == {b"b"}
    assert await scripts.client.get(K.lease("a")) is None
    # a release with a tombstone refuses that attempt's acquisition in the same call
    replies = await scripts.batch(
        [scripts.request("c", seat, names=["seats"], attempt=2)], releases=[("c", ["seats"], True, 5000, 2)]
    )
    assert replies == [[-1]]


# --- release.lua -----------------------------------------------------------------------------------


async def test_release_is_idempotent_and_frees_the_seat(scripts: Scripts) -> None:
    opt = [{"n": [["seats", 1, 0], ["pool:e", 2, 0]]}]
    await scripts.acquire("a", opt, names=["seats", "pool:e"])
    assert await scripts.release("a", ["seats", "pool:e"]) == 2
    assert await scripts.release("a", ["seats", "pool:e"]) == 0
    assert await scripts.client.get(K.lease("a")) is None
    assert (await scripts.acquire("b", opt, names=["seats", "pool:e"]))[0] == 1


async def test_a_partial_release_keeps_the_lease(scripts: Scripts) -> None:
    await scripts.acquire("a", [{"n": [["pool:e", 3, 0], ["pool:e:active", 1, 0]]}], names=["pool:e", "pool:e:active"])
    assert await scripts.release("a", ["pool:e:active"], full=False) == 1
    assert await scripts.members("pool:e") == {b"a"}
    assert await scripts.client.get(K.lease("a")) is not None


async def test_a_release_racing_its_acquire_leaves_a_tombstone(scripts: Scripts) -> None:
    # the release of attempt 3 reaches Redis before the acquire of attempt 3
    await scripts.release("a", ["seats"], tomb_ms=5000, attempt=3)
    assert await scripts.acquire("a", [{"n": [["seats", 1, 0]]}], names=["seats"], attempt=3) == [-1]
    assert await scripts.client.pttl(K.tomb("a", 3)) > 0
    assert await scripts.members("seats") == set()


async def _announced(scripts: Scripts, ps: Any, step: Any) -> bool:
    """Whether ``step`` (a script call) published on the channel: a marker published after it is read,
    and whatever came before it."""
    await step
    await scripts.client.publish(K.freed, "mark")
    seen = []
    with trio.fail_after(5):
        while not seen or seen[-1] != b"mark":
            message = await ps.get_message(ignore_subscribe_messages=True)
            if message is not None:
                seen.append(message["data"])
    return b"left" in seen


async def test_a_release_is_announced_only_while_another_replica_waits(scripts: Scripts) -> None:
    seat = [{"n": [["seats", 1, 0]]}]
    async with scripts.client.pubsub(channels=[K.freed]) as ps:
        await scripts.acquire("a", seat, names=["seats"])
        # nobody waits: the room freed is announced to nobody
        assert not await _announced(scripts, ps, scripts.release("a", ["seats"]))
        await scripts.acquire("a", seat, names=["seats"], attempt=2)
        # an arrival refused (not a waiter) does not wait in Redis' eyes
        assert (await scripts.acquire("b", seat, names=["seats"], replica="r2"))[0] == 0
        assert await scripts.client.zcard(K.waiting) == 0
        # a waiter's attempt refused on r2: r2 waits from the same step on, r1's release is announced
        assert (await scripts.acquire("b", seat, names=["seats"], replica="r2", attempt=2, wait=True))[0] == 0
        assert await scripts.client.zscore(K.waiting, "r2") is not None
        assert await _announced(scripts, ps, scripts.release("a", ["seats"]))
        # the same from a release that an acquire call applies first
        await scripts.acquire("a", seat, names=["seats"], attempt=5)
        assert await _announced(scripts, ps, scripts.batch([], releases=[("a", ["seats"], True, 0, 5)]))
        # r2's own release is not announced to r2 (it wakes its waiters itself)
        await scripts.acquire("c", seat, names=["seats"], replica="r2")
        assert not await _announced(scripts, ps, scripts.release("c", ["seats"], replica="r2"))
        # r2 leaves (no waiter any more): releases go quiet again
        await scripts.acquire("a", seat, names=["seats"], attempt=3)
        await scripts.release("z", [], replica="r2", unregister=True)
        assert await scripts.client.zcard(K.waiting) == 0
        assert not await _announced(scripts, ps, scripts.release("a", ["seats"]))
        # an entry expires with the TTL (a replica that died waiting)
        await scripts.acquire("a", seat, names=["seats"], attempt=4)
        assert (await scripts.acquire("d", seat, names=["seats"], replica="r3", ttl=100, wait=True))[0] == 0
        await trio.sleep(0.2)
        assert not await _announced(scripts, ps, scripts.release("a", ["seats"]))


async def test_renew_keeps_a_waiting_replica_in_the_waiting_set(scripts: Scripts) -> None:
    now, *_ = await scripts.renew([], replica="r2", ttl=10_000, waiting=True)
    assert await scripts.client.zscore(K.waiting, "r2") >= now + 10_000
    await scripts.renew([], replica="r3", ttl=10_000)
    assert await scripts.client.zscore(K.waiting, "r3") is None


# --- renew.lua -------------------------------------------------------------------------------------


async def test_renew_extends_whole_leases_and_reports_the_rest(scripts: Scripts) -> None:
    await scripts.acquire("a", [{"n": [["seats", 5, 0]]}], names=["seats"], ttl=200)
    await scripts.acquire("b", [{"n": [["seats", 5, 0], ["pool:e", 5, 0]]}], names=["seats", "pool:e"], ttl=200)
    await scripts.client.zrem(K.limit("pool:e"), ["b"])  # b is no longer whole
    out = await scripts.renew([("a", ["seats"]), ("b", ["seats", "pool:e"]), ("gone", ["seats"])], ttl=10_000)
    now, live, *lost = out
    assert live == 1 and lost == [2, 3]
    assert await scripts.client.zscore(K.limit("seats"), "a") > now + 5000
    assert await scripts.client.pttl(K.lease("a")) > 5000
    # b's score was not extended: it expires with its old TTL, never revived
    assert await scripts.client.zscore(K.limit("seats"), "b") < now + 1000


async def test_renew_does_not_revive_an_expired_lease(scripts: Scripts) -> None:
    await scripts.acquire("a", [{"n": [["seats", 1, 0]]}], names=["seats"], ttl=40)
    await trio.sleep(0.06)
    *_, lost = await scripts.renew([("a", ["seats"])])
    assert lost == 1


async def test_renew_is_the_replica_heartbeat(scripts: Scripts) -> None:
    await scripts.renew([], replica="r1", ttl=100)
    await scripts.renew([], replica="r2", ttl=100)
    assert (await scripts.renew([], replica="r3", ttl=100))[1] == 3
    await trio.sleep(0.15)
    assert (await scripts.renew([], replica="r3", ttl=100))[1] == 1  # r1, r2 stopped renewing


# --- claim.lua, settle_claim.lua -------------------------------------------------------------------


async def _claim(s: Scripts, fp: str, replica: str, prompt: str, ttl: int = 10_000) -> list[Any]:
    return list(await s.s["claim"](keys=[K.claim("s1", "k")], args=[fp, replica, ttl, prompt]))


async def test_claim_is_set_nx_and_names_the_holder(scripts: Scripts) -> None:
    assert await _claim(scripts, "f1", "r1", "p1") == [1]
    held = await _claim(scripts, "f2", "r2", "p9")
    assert held[:5] == [0, b"f1", b"r1", b"running", b"p1"] and 0 < held[5] <= 10_000


async def test_settle_claim_only_by_its_holder(scripts: Scripts) -> None:
    await _claim(scripts, "f1", "host:1", "p1")
    settle = scripts.s["settle_claim"]
    assert await settle(keys=[K.claim("s1", "k")], args=["host:2", "p1", "done"]) == 0
    assert await settle(keys=[K.claim("s1", "k")], args=["host:1", "p1", "done"]) == 1
    assert (await _claim(scripts, "f1", "r2", "p2"))[3] == b"done"
    assert await scripts.client.pttl(K.claim("s1", "k")) > 0  # KEEPTTL
    assert await settle(keys=[K.claim("s1", "k")], args=["host:1", "p1", "drop"]) == 1
    assert await _claim(scripts, "f3", "r2", "p2") == [1]


def test_every_script_names_its_keys_argv_and_invariant() -> None:
    for name in SCRIPT_NAMES:
        head = script_source(name).split("\nlocal ", 1)[0]
        assert head.startswith(f"-- {name}.lua:"), name
        for word in ("KEYS", "ARGV[1]", "Invariant:", "Returns"):
            assert word in head, (name, word)
