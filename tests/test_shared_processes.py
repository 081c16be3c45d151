"""Several ``acp-server serve`` processes on one coordinator, with an agent that counts the calls
running across all of them in Redis and checks their fencing tokens: the cluster's seats are never
exceeded, a SIGKILLed replica's seats come back within one TTL, and a drain refuses new prompts while
running ones finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio

from .helpers import RawClient, scaled
from .redis_server import RedisServer, redis_server  # noqa: F401

CWD = Path(__file__).resolve().parent.parent


class Replica:
    def __init__(self, proc: trio.Process, client: RawClient, stream: trio.SocketStream) -> None:
        self.proc = proc
        self.client = client
        self.stream = stream


@asynccontextmanager
async def replica(redis: RedisServer, nursery: trio.Nursery, *flags: str, hold_ms: int = 20) -> AsyncIterator[Replica]:
    agent = f"count={sys.executable} -m tests.agents.counting_agent --port {redis.port} --prefix t --hold-ms {hold_ms}"
    command = [
        sys.executable, "-m", "acp_server", "serve", "--ephemeral", "--listen", "tcp://127.0.0.1:0",
        "--coordinator", redis.url, "--coordinator-prefix", "t", "--agent", agent, "--default-backend", "count", *flags,
    ]
    proc = await trio.lowlevel.open_process(command, cwd=CWD, env=dict(os.environ), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    stderr = proc.stderr
    try:
        buf = b""
        prefix = b"acp-server: listening on tcp://"
        with trio.fail_after(30):
            while prefix not in buf or not buf.endswith(b"\n"):
                data = await stderr.receive_some(65536)
                assert data, f"the server ended before listening: {buf.decode(errors='replace')}"
                buf += data
        port = int(buf[buf.index(prefix) + len(prefix) :].split(b"\n", 1)[0].decode().rsplit(":", 1)[1])

        async def drain() -> None:
            while await stderr.receive_some(65536):
                pass

        nursery.start_soon(drain)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = RawClient(stream)
        nursery.start_soon(client.pump)
        try:
            await client.initialize()
            yield Replica(proc, client, stream)
        finally:
            await stream.aclose()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            await stderr.aclose()


def _get(redis: RedisServer, key: str) -> int:
    out = redis.command("GET", key).decode().strip().strip('"')
    return int(out) if out and out != "(nil)" else 0


async def test_four_replicas_never_pass_the_clusters_seats(redis_server: RedisServer) -> None:  # noqa: F811
    seats, sessions_each = 3, 6
    prompts_each = scaled(420, 6)  # 10,080 admissions in make test-full
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        reps = [
            await stack.enter_async_context(replica(redis_server, nursery, "--max-running-prompts", str(seats)))
            for _ in range(4)
        ]
        answered = 0

        async def prompting(rep: Replica) -> None:
            nonlocal answered
            session_id, _ = await rep.client.new_session()
            for _ in range(prompts_each):
                result = await rep.client.prompt(session_id, "hi")
                assert result["stopReason"] == "end_turn"
                answered += 1

        async with trio.open_nursery() as inner:
            for rep in reps:
                for _ in range(sessions_each):
                    inner.start_soon(prompting, rep)
        nursery.cancel_scope.cancel()
    total = 4 * sessions_each * prompts_each
    assert answered == total
    calls = await trio.to_thread.run_sync(_get, redis_server, "{test}:calls")
    peak = await trio.to_thread.run_sync(_get, redis_server, "{test}:peak")
    stale = await trio.to_thread.run_sync(_get, redis_server, "{test}:stale")
    assert calls == total and peak <= seats and stale == 0
    assert peak == seats  # the seats were used


async def test_a_killed_replicas_seats_come_back_within_one_ttl(redis_server: RedisServer) -> None:  # noqa: F811
    ttl = 1.0
    flags = ("--max-running-prompts", "2", "--lease-ttl-s", str(ttl))
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(redis_server, nursery, *flags, hold_ms=60_000))
        b = await stack.enter_async_context(replica(redis_server, nursery, *flags, hold_ms=10))
        for _ in range(2):
            session_id, _ = await a.client.new_session()
            params = {"sessionId": session_id, "prompt": [{"type": "text", "text": "long"}]}
            rid, _ = a.client.start_request("session/prompt", params)
            await a.client.send({"jsonrpc": "2.0", "id": rid, "method": "session/prompt", "params": params})
        with trio.fail_after(10):
            while await trio.to_thread.run_sync(_get, redis_server, "{test}:running") < 2:  # noqa: ASYNC110 - Redis' count
                await trio.sleep(0.05)
        session_id, _ = await b.client.new_session()
        waiting = trio.Event()
        answered_at = 0.0

        async def prompt_b() -> None:
            nonlocal answered_at
            waiting.set()
            result = await b.client.prompt(session_id, "hi")
            assert result["stopReason"] == "end_turn"
            answered_at = trio.current_time()
            answered.set()

        answered = trio.Event()
        nursery.start_soon(prompt_b)
        await waiting.wait()
        await trio.sleep(0.3)
        assert answered_at == 0.0  # both seats are a's
        a.proc.send_signal(signal.SIGKILL)
        killed_at = trio.current_time()
        with trio.fail_after(10):
            await answered.wait()
        # within one TTL of the last renewal (every TTL/3), plus the re-check
        assert answered_at - killed_at < ttl + 0.5 + 0.5
        nursery.cancel_scope.cancel()


async def test_a_drain_refuses_new_prompts_and_lets_running_ones_finish(redis_server: RedisServer) -> None:  # noqa: F811
    flags = ("--max-running-prompts", "2", "--drain-timeout-s", "10")
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(redis_server, nursery, *flags, hold_ms=1500))
        session_id, _ = await a.client.new_session()
        params = {"sessionId": session_id, "prompt": [{"type": "text", "text": "long"}]}
        rid, running = a.client.start_request("session/prompt", params)
        await a.client.send({"jsonrpc": "2.0", "id": rid, "method": "session/prompt", "params": params})
        with trio.fail_after(10):
            while await trio.to_thread.run_sync(_get, redis_server, "{test}:running") < 1:  # noqa: ASYNC110 - Redis' count
                await trio.sleep(0.05)
        a.proc.send_signal(signal.SIGTERM)
        await trio.sleep(0.2)
        other, _ = await a.client.new_session()
        refused = await a.client.call_raw("session/prompt", {"sessionId": other, "prompt": [{"type": "text", "text": "x"}]})
        assert refused["error"]["data"]["errorKind"] == "capacity_unavailable"
        assert refused["error"]["data"]["reason"] == "draining"
        with trio.fail_after(10):
            done = await running.receive()
        assert done["result"]["stopReason"] == "end_turn"
        with trio.fail_after(10):
            assert await a.proc.wait() == 0
        # every lease was released on the way out
        assert redis_server.command("ZCARD", "{t}:l:seats").split()[-1] == b"0"
        nursery.cancel_scope.cancel()


async def test_redis_stopped_closed_refuses_local_admits_and_both_recover(redis_server: RedisServer) -> None:  # noqa: F811
    common = ("--max-running-prompts", "4", "--coordinator-timeout-ms", "200", "--lease-ttl-s", "1")
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        closed = await stack.enter_async_context(replica(redis_server, nursery, *common, hold_ms=10))
        local = await stack.enter_async_context(
            replica(redis_server, nursery, *common, "--coordinator-failure", "local", "--expected-replicas", "2", hold_ms=10)
        )
        sc, _ = await closed.client.new_session()
        sl, _ = await local.client.new_session()
        assert (await closed.client.prompt(sc, "before"))["stopReason"] == "end_turn"
        redis_server.pause()
        try:
            with trio.fail_after(5):
                refused = await closed.client.call_raw("session/prompt", {"sessionId": sc, "prompt": [{"type": "text", "text": "x"}]})
                # the first call may spend the timeout finding Redis away; the next is refused at once
                refused = await closed.client.call_raw("session/prompt", {"sessionId": sc, "prompt": [{"type": "text", "text": "x"}]})
            data = refused["error"]["data"]
            assert data["errorKind"] == "capacity_unavailable" and data["reason"] == "coordinator_unavailable"
            assert data["retryAfterMs"] >= 100
            # local: admitted against ceil(4 / 2) seats and running (the agent itself then waits for the
            # stopped Redis, where it counts calls)
            params = {"sessionId": sl, "prompt": [{"type": "text", "text": "y"}]}
            rid, local_done = local.client.start_request("session/prompt", params)
            await local.client.send({"jsonrpc": "2.0", "id": rid, "method": "session/prompt", "params": params})
            with trio.fail_after(10):
                while not any(  # noqa: ASYNC110 - the turn states the connection collected
                    ts["sessionId"] == sl and ts["state"] == "running" for ts in local.client.turn_states
                ):
                    await trio.sleep(0.05)
        finally:
            redis_server.resume()
        with trio.fail_after(10):
            local_reply = await local_done.receive()
        # the agent could not reach Redis while it was stopped, and answered once it resumed
        assert local_reply.get("result", {}).get("stopReason") == "end_turn", local_reply
        with trio.fail_after(15):
            while True:
                reply = await closed.client.call_raw("session/prompt", {"sessionId": sc, "prompt": [{"type": "text", "text": "z"}]})
                if "result" in reply:
                    break
                await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
