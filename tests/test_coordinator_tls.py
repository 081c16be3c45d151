"""The Redis coordinator over ``rediss://``: a real ``redis-server`` listening with TLS only, its
certificate from a test CA (``trustme``). The CA is named in the URL as coredis reads it
(``?ssl_ca_certs=PATH``); without it, or with another CA, the certificate is not trusted and the
connection fails (the coordinator is down, never silently unverified)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio
import trustme

from acp_server.coordinator import Need, Option
from acp_server.coordinator.redis import RedisCoordinator

from .redis_server import RedisServer
from .test_coordinator_redis import check_a_freed_seat_wakes_a_waiter_on_another_replica, replicas
from .tls_helpers import write_certs


@pytest.fixture
def tls_redis(tmp_path: pathlib.Path) -> Iterator[tuple[RedisServer, str]]:
    """A TLS-only redis-server and the CA file that signed its certificate."""
    certs = write_certs(tmp_path)
    server = RedisServer(str(tmp_path), tls=(certs.cert, certs.key, certs.ca))
    try:
        yield server, certs.ca
    finally:
        server.stop()


def _trusting(server: RedisServer, ca: str) -> RedisServer:
    """``server`` as the coordinator reaches it: its ``rediss://`` URL naming the CA to trust."""
    server.url = f"{server.url}?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    return server


async def test_replicas_share_a_cap_and_wake_each_other_over_tls(tls_redis: tuple[RedisServer, str]) -> None:
    server, ca = tls_redis
    trusted = _trusting(server, ca)
    assert trusted.url.startswith("rediss://")
    # the release is announced over pub/sub, on each replica's own TLS connection
    await check_a_freed_seat_wakes_a_waiter_on_another_replica(trusted)
    async with replicas(trusted, 2) as (a, b):
        holder = a.new_lease()
        await a.acquire(holder, Option((Need("seats", 1),)))
        stats = await b.cluster()
        assert {r.replica_id for r in stats.replicas} == {"r0", "r1"}
        assert [(x.name, x.count) for x in stats.limits] == [("seats", 1)]
        a.release(holder)
        await a.flush()
    out = await trio.to_thread.run_sync(server.command, "ZCARD", "{t}:l:seats")
    assert int(out.split()[-1]) == 0, "the release reached Redis over TLS"


@pytest.mark.parametrize("trust", ["none", "another CA"])
async def test_an_untrusted_certificate_leaves_the_coordinator_down(
    tls_redis: tuple[RedisServer, str], tmp_path: pathlib.Path, trust: str
) -> None:
    server, _ = tls_redis
    url = server.url
    if trust == "another CA":
        (tmp_path / "other").mkdir()
        other = write_certs(tmp_path / "other", trustme.CA(), "other")
        url = f"{url}?ssl_cert_reqs=required&ssl_ca_certs={other.ca}"
    coord = RedisCoordinator(url, prefix="t", replica_id="r0", timeout_ms=2000)
    with trio.fail_after(20):
        async with coord.running() as running:
            stats = running.statistics()
            assert not stats.up, "a certificate it cannot verify is an outage, not a connection"
            assert stats.failures_total >= 1


def test_the_cluster_command_reads_over_tls(tls_redis: tuple[RedisServer, str]) -> None:
    server, ca = tls_redis
    url = _trusting(server, ca).url
    out = subprocess.run(
        [sys.executable, "-m", "acp_server", "cluster", "--coordinator", url, "--coordinator-prefix", "t"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "replicas" in out.stdout.lower(), out.stdout
