"""The coordinator's pipelined RESP2 connection against a real redis-server: replies stay matched to
their calls under concurrency and after a cancelled call, a broken connection fails its calls and the
next call reconnects, ``AUTH`` and ``SELECT`` come from the URL, ``NOSCRIPT`` falls back to ``EVAL``,
and a subscription delivers messages."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import trio

from acp_server.coordinator.resp import RespError, RespPipe, _parse, encode_command

from .redis_server import RedisServer, redis_server  # noqa: F401


def test_parse_reads_every_reply_type_and_waits_for_a_whole_one() -> None:
    buf = bytearray(b"*4\r\n:12\r\n$3\r\nabc\r\n$-1\r\n*1\r\n+OK\r\n-ERR bad\r\n")
    value, pos = _parse(buf, 0)
    assert value == [12, b"abc", None, [b"OK"]]
    error, end = _parse(buf, pos)
    assert isinstance(error, RespError) and str(error) == "ERR bad" and end == len(buf)
    from acp_server.coordinator import resp

    with pytest.raises(resp._Incomplete):
        _parse(bytearray(b"*2\r\n:1\r\n$5\r\nab"), 0)
    assert encode_command("SET", "k", 3) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n3\r\n"


async def test_concurrent_calls_get_their_own_replies(redis_server: RedisServer) -> None:  # noqa: F811
    async with trio.open_nursery() as nursery:
        pipe = RespPipe(redis_server.url, nursery)
        got: dict[int, object] = {}

        async def echo(i: int) -> None:
            got[i] = await pipe.call(encode_command("ECHO", f"v{i}"))

        async with trio.open_nursery() as calls:
            for i in range(200):
                calls.start_soon(echo, i)
        assert got == {i: f"v{i}".encode() for i in range(200)}
        # a cancelled call's reply is read and dropped: the next call gets its own
        with trio.move_on_after(0) :
            await pipe.call(encode_command("ECHO", "lost"))
        assert await pipe.call(encode_command("ECHO", "next")) == b"next"
        with pytest.raises(RespError):
            await pipe.call(encode_command("NOSUCHCOMMAND"))
        nursery.cancel_scope.cancel()


async def test_a_stopped_server_times_out_and_replies_stay_matched_after(redis_server: RedisServer) -> None:  # noqa: F811
    async with trio.open_nursery() as nursery:
        pipe = RespPipe(redis_server.url, nursery)
        assert await pipe.call(encode_command("PING")) == b"PONG"
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            with trio.move_on_after(0.3) as scope:
                await pipe.call(encode_command("ECHO", "while stopped"))
            assert scope.cancelled_caught
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert await pipe.call(encode_command("ECHO", "after")) == b"after"
        nursery.cancel_scope.cancel()


async def test_a_closed_connection_fails_its_calls_and_the_next_call_reconnects(redis_server: RedisServer) -> None:  # noqa: F811
    async with trio.open_nursery() as nursery:
        pipe = RespPipe(redis_server.url, nursery)
        await pipe.call(encode_command("CLIENT", "SETNAME", "victim"))
        redis_server.command("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")
        with pytest.raises(ConnectionError):
            with trio.fail_after(5):
                while True:  # the kill reaches the reader soon; calls before it may still pass
                    await pipe.call(encode_command("BLPOP", "never", "0.05"))
        assert await pipe.call(encode_command("ECHO", "again")) == b"again"
        nursery.cancel_scope.cancel()


async def test_auth_and_select_come_from_the_url_and_noscript_falls_back_to_eval(redis_server: RedisServer) -> None:  # noqa: F811
    redis_server.command("CONFIG", "SET", "requirepass", "s3cret")
    try:
        url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/3"
        async with trio.open_nursery() as nursery:
            pipe = RespPipe(url, nursery)
            await pipe.call(encode_command("SET", "where", "db3"))
            source = "return redis.call('GET', KEYS[1])"
            sha = hashlib.sha1(source.encode()).hexdigest()
            await pipe.call(encode_command("SCRIPT", "FLUSH"))
            assert await pipe.evalsha(sha, source, ["where"], []) == b"db3"  # loaded by EVAL
            assert await pipe.call(encode_command("EVALSHA", sha, 1, "where")) == b"db3"
            got: list[list[object]] = []
            conn = await pipe.subscribe("chan", got.append)
            await pipe.call(encode_command("PUBLISH", "chan", "hello"))
            with trio.fail_after(5):
                while not got:  # noqa: ASYNC110 - delivered by the subscription's reader
                    await trio.sleep(0.01)
            assert got == [[b"message", b"chan", b"hello"]]
            conn.fail(ConnectionError("done"))
            with pytest.raises(RespError):
                await RespPipe(f"redis://:wrong@127.0.0.1:{redis_server.port}/0", nursery).call(encode_command("PING"))
            nursery.cancel_scope.cancel()
        assert b"db3" in redis_server.command("-a", "s3cret", "-n", "3", "GET", "where")
    finally:
        redis_server.command("-a", "s3cret", "CONFIG", "SET", "requirepass", "")
