"""The benchmark's load generator: raw NDJSON over TCP, msgspec to decode, run apart from the server.

Each mode connects to a running ``acp-server`` on ``127.0.0.1:PORT``, does its work and prints one
JSON object on stdout. Pipelined modes use one blocking socket: requests are written in batches,
every answer read frees its slot for the next request, so the server always has work queued. Given
``--server-pid``, the server's CPU time and RSS are read from ``/proc`` at the edges of the measured
window (so the figures exclude process start-up and the handshake).

Modes:
    rpc          a trivial method (``_acp_server/capabilities``), ``--window`` requests in flight
    echo         one-word echo prompts over ``--sessions`` sessions, ``--depth`` in flight per session;
                 a depth over the pending limit makes the overload run: refused prompts are re-sent at
                 once (a client ignoring ``retryAfterMs``), or with ``--retry-after`` after the
                 refusal's ``retryAfterMs`` (what acp-server's client SDK does); ``--reconnect``: an
                 evicted client reconnects at once, resumes its sessions and goes on
    refusals     fill one session's pending limit (run the server with a long ``--echo-delay-ms``), then
                 time refusals one at a time (round trip) and pipelined (server CPU per refusal)
    hammer       a rude client: one session on ``--backend`` (a slow one) held full, ``--window``
                 refused prompts re-sent at once, reconnecting at once when evicted

``echo`` and ``refusals`` also report the server's own refusal timing (``refusals`` of
``_acp_server/stats``: request read to error written, p50/p99), read at the end of the run; start a
fresh server for each run whose figure you want alone.
    sessions     create ``--count`` idle sessions and report the server's RSS growth
    connections  open ``--count`` TCP connections at once, each initializes, opens a session and
                 prompts once (asyncio)

Example: ``python bench/loadgen.py echo --port 4170 --sessions 100 --depth 2 --duration 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from procfs import cpu_seconds, percentile, rss_bytes

__all__ = ["Wire", "main", "pipeline", "raise_nofile_limit"]

#: errorKinds that mean "refused for capacity" (retryable overload), not a failure.
REFUSAL_KINDS = frozenset({"prompt_queue_full", "capacity_exceeded", "admission_deferred", "capacity_unavailable"})
#: Our own calls (handshake, stats) use ids from here, far from the pipelined ones.
_CALL_IDS_FROM = 1 << 40
_NOTIFICATION_PREFIX = b'{"jsonrpc":"2.0","method"'
_UPDATE_PREFIX = b'{"jsonrpc":"2.0","method":"session/update"'
_EVICTED = b'"_acp_server/evicted"'


class _ErrorData(msgspec.Struct, rename="camel"):
    error_kind: str | None = None
    retry_after_ms: int | None = None


class _Error(msgspec.Struct):
    code: int = 0
    message: str = ""
    data: _ErrorData | None = None


class _Msg(msgspec.Struct):
    id: int | str | None = None
    method: str | None = None
    result: msgspec.Raw = msgspec.Raw(b"")
    error: _Error | None = None


_decode_msg = msgspec.json.Decoder(_Msg).decode
_encode = msgspec.json.Encoder().encode


class LoadError(Exception):
    """The server answered something the benchmark cannot go on with."""


def error_kind(error: _Error) -> str:
    kind = error.data.error_kind if error.data is not None else None
    return kind if kind is not None else f"code {error.code}"


class Wire:
    """One blocking TCP connection speaking newline-delimited JSON-RPC."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        self._timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tail = b""
        self._next_call_id = _CALL_IDS_FROM
        #: notifications :meth:`call` read while waiting for its answer
        self.notifications: list[dict[str, Any]] = []

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_lines(self, timeout: float | None = None) -> list[bytes]:
        """The complete lines of the next read (blocking; raises if the server hangs up).

        Given ``timeout`` (seconds), returns ``[]`` when nothing arrives by then.
        """
        if timeout is None:
            data = self.sock.recv(1 << 18)
        else:
            self.sock.settimeout(max(timeout, 1e-4))
            try:
                data = self.sock.recv(1 << 18)
            except TimeoutError:
                return []
            finally:
                self.sock.settimeout(self._timeout)
        if not data:
            raise LoadError("the server closed the connection")
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        return lines

    def call(self, method: str, params: Any = None) -> Any:
        """Send one request and wait for its answer; notifications meanwhile go to ``notifications``.

        Raises:
            LoadError: the answer is an error.
        """
        call_id = self._next_call_id
        self._next_call_id += 1
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": call_id, "method": method}
        if params is not None:
            request["params"] = params
        self.send(_encode(request) + b"\n")
        while True:
            for line in self.read_lines():
                msg = _decode_msg(line)
                if msg.id is None:
                    self.notifications.append(msgspec.json.decode(line))
                elif msg.id == call_id:
                    if msg.error is not None:
                        raise LoadError(f"{method} failed: {error_kind(msg.error)}: {msg.error.message}")
                    return msgspec.json.decode(msg.result) if msg.result else None

    def handshake(self, *, turn_states: bool = True) -> dict[str, Any]:
        # _acp_server/turn_state goes only to a connection that asks (the server's default): ask, or opt out
        params: dict[str, Any] = {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"turnStates": turn_states}}
        result: dict[str, Any] = self.call("initialize", params)
        return result

    def new_session(self) -> str:
        session_id: str = self.call("session/new", {"cwd": "/tmp", "mcpServers": []})["sessionId"]
        return session_id


def prompt_template(session_id: str, text: str) -> bytes:
    """A ``session/prompt`` request with ``%d`` where its id goes."""
    params = _encode({"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}).replace(
        b"%", b"%%"
    )
    return b'{"jsonrpc":"2.0","id":%d,"method":"session/prompt","params":' + params + b"}\n"


def call_template(method: str) -> bytes:
    return b'{"jsonrpc":"2.0","id":%d,"method":"' + method.encode() + b'"}\n'


@dataclass
class Run:
    """What one pipelined run saw."""

    sent: int = 0
    ok: int = 0
    refused: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    #: session/update notifications, and any other (e.g. _acp_server/turn_state)
    notifications: int = 0
    other_notifications: int = 0
    #: refusals whose re-send waited for their retryAfterMs, and the re-sends made before the end
    retry_waits: int = 0
    retries_sent: int = 0
    retry_after_ms: set[int] = field(default_factory=set)
    #: _acp_server/evicted notifications seen, connections the server ended (each followed by a
    #: reconnect when the run reconnects), and requests in flight on them (never answered)
    evicted: int = 0
    disconnects: int = 0
    lost: int = 0
    ok_latencies: list[float] = field(default_factory=list)
    refusal_latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    server_cpu_s: float | None = None
    client_cpu_s: float = 0.0
    results: list[bytes] = field(default_factory=list)
    #: the connection the run ended on (a new one after each reconnect)
    wire: Wire | None = None
    #: (when, template) of the refused slots still waiting for their retryAfterMs at the end
    waiting: list[tuple[float, int]] = field(default_factory=list)

    def summary(self, per: str = "ok") -> dict[str, Any]:
        done = self.ok if per == "ok" else self.refused
        cpu_us = self.server_cpu_s * 1e6 / done if self.server_cpu_s is not None and done else None
        return {
            "sent": self.sent,
            "ok": self.ok,
            "refused": self.refused,
            "errors": dict(self.errors),
            "notifications": self.notifications,
            "other_notifications": self.other_notifications,
            "retry_waits": self.retry_waits,
            "retries_sent": self.retries_sent,
            "retry_after_ms_seen": sorted(self.retry_after_ms),
            "evicted": self.evicted,
            "disconnects": self.disconnects,
            "lost": self.lost,
            "elapsed_s": round(self.elapsed_s, 4),
            "ok_per_s": round(self.ok / self.elapsed_s, 1) if self.elapsed_s else None,
            "refused_per_s": round(self.refused / self.elapsed_s, 1) if self.elapsed_s else None,
            "ok_p50_ms": _ms(percentile(self.ok_latencies, 0.50)),
            "ok_p99_ms": _ms(percentile(self.ok_latencies, 0.99)),
            "refusal_p50_ms": _ms(percentile(self.refusal_latencies, 0.50)),
            "refusal_p99_ms": _ms(percentile(self.refusal_latencies, 0.99)),
            "server_cpu_s": round(self.server_cpu_s, 4) if self.server_cpu_s is not None else None,
            # Under 1.0, the server waited for work or (on a busy machine) for a CPU.
            "server_cpu_share": round(self.server_cpu_s / self.elapsed_s, 3)
            if self.server_cpu_s is not None and self.elapsed_s
            else None,
            # Near 1.0, the load generator (not the server) may be what limits the rate.
            "client_cpu_share": round(self.client_cpu_s / self.elapsed_s, 3) if self.elapsed_s else None,
            "client_cpu_s": round(self.client_cpu_s, 4),
            f"server_cpu_us_per_{per}": round(cpu_us, 2) if cpu_us is not None else None,
        }


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 4) if seconds is not None else None


def pipeline(
    wire: Wire,
    templates: Sequence[bytes],
    depth: int,
    *,
    duration: float | None = None,
    count: int | None = None,
    server_pid: int | None = None,
    keep_results: bool = False,
    first_id: int = 1,
    honour_retry_after: bool = False,
    reconnect: Callable[[], Wire] | None = None,
    still_waiting: Sequence[tuple[float, int]] = (),
    linger: float | None = None,
) -> Run:
    """Keep ``depth`` requests in flight per template until ``duration`` seconds or ``count`` sends.

    Every answer (result or refusal) frees its slot, and a batch of replacements is written after each
    read. A refused slot is re-sent at once, or with ``honour_retry_after`` once the refusal's
    ``retryAfterMs`` has passed. Sending stops at the end (slots still waiting to retry are dropped);
    the run ends when every request sent has its answer. Given ``reconnect``, a connection the server
    ends (an eviction) is replaced by ``reconnect()`` at once, as a client that wants its work done
    would, and the requests it had in flight (lost, never answered) are sent again on the new one;
    without it, the end of the connection ends the run with :class:`LoadError`. ``still_waiting``
    (an earlier run's :attr:`Run.waiting`) carries on that run's slots that wait for a retryAfterMs:
    a polite client does not forget a hold-off between a warm-up and the measured run. ``linger``:
    wait at most this long after the end for the answers still missing (requests the server holds).
    """
    run = Run()
    pending: dict[int, tuple[int, float]] = {}
    waiting = list(still_waiting)  # (when, template): refused slots waiting for retryAfterMs
    heapq.heapify(waiting)
    ready = [k for _ in range(depth) for k in range(len(templates))]
    for _, k in waiting:
        ready.remove(k)
    next_id = first_id
    started = time.perf_counter()
    stop_at = started + duration if duration is not None else float("inf")
    budget = count if count is not None else sys.maxsize
    cpu0 = cpu_seconds(server_pid) if server_pid else None
    own0 = time.process_time()
    ok_lat, ref_lat, results = run.ok_latencies, run.refusal_latencies, run.results
    while True:
        if waiting:
            now = time.perf_counter()
            while waiting and waiting[0][0] <= now:
                ready.append(heapq.heappop(waiting)[1])
                run.retries_sent += 1
        if ready:
            now = time.perf_counter()
            if now < stop_at and budget > 0:
                ready = ready[:budget]
                budget -= len(ready)
                parts = []
                for k in ready:
                    pending[next_id] = (k, now)
                    parts.append(templates[k] % next_id)
                    next_id += 1
                run.sent += len(parts)
                try:
                    wire.send(b"".join(parts))
                except OSError:
                    if reconnect is None:
                        raise
            ready = []
        if not pending:
            if waiting and time.perf_counter() < stop_at:
                time.sleep(max(0.0, min(waiting[0][0], stop_at) - time.perf_counter()))
                continue
            break
        timeout = max(0.0, waiting[0][0] - time.perf_counter()) if waiting else None
        if linger is not None:
            left = stop_at + linger - time.perf_counter()
            if left <= 0:
                break
            timeout = left if timeout is None else min(timeout, left)
        try:
            lines = wire.read_lines(timeout)
        except (LoadError, OSError):
            if reconnect is None:
                raise
            run.disconnects += 1
            run.lost += len(pending)
            ready = [k for k, _ in pending.values()]
            pending.clear()
            wire.close()
            wire = reconnect()
            continue
        now = time.perf_counter()
        for line in lines:
            if line.startswith(_NOTIFICATION_PREFIX):
                if line.startswith(_UPDATE_PREFIX):
                    run.notifications += 1
                elif _EVICTED in line:
                    run.evicted += 1
                else:
                    run.other_notifications += 1
                continue
            msg = _decode_msg(line)
            if msg.id is None:
                if msg.method == "session/update":
                    run.notifications += 1
                else:
                    run.other_notifications += 1
                continue
            entry = pending.pop(msg.id, None)  # type: ignore[arg-type]
            if entry is None:
                raise LoadError(f"an answer to id {msg.id!r}, which is not in flight")
            k, sent_at = entry
            if msg.error is None:
                ready.append(k)
                run.ok += 1
                ok_lat.append(now - sent_at)
                if keep_results:
                    results.append(bytes(msg.result))
            elif error_kind(msg.error) in REFUSAL_KINDS:
                run.refused += 1
                ref_lat.append(now - sent_at)
                after_ms = msg.error.data.retry_after_ms if msg.error.data is not None else None
                if honour_retry_after and after_ms:
                    run.retry_waits += 1
                    run.retry_after_ms.add(after_ms)
                    heapq.heappush(waiting, (now + after_ms / 1000, k))
                else:
                    ready.append(k)
            else:
                ready.append(k)
                run.errors[error_kind(msg.error)] += 1
    run.elapsed_s = time.perf_counter() - started
    run.wire = wire
    run.waiting = waiting
    run.client_cpu_s = time.process_time() - own0
    if server_pid:
        assert cpu0 is not None
        run.server_cpu_s = cpu_seconds(server_pid) - cpu0
    return run


# --- modes ---------------------------------------------------------------------------------------


def mode_rpc(args: argparse.Namespace) -> dict[str, Any]:
    wire = Wire(args.port)
    wire.handshake()
    templates = [call_template(args.method)]
    pipeline(wire, templates, args.window, duration=args.warmup)
    run = pipeline(wire, templates, args.window, duration=args.duration, server_pid=args.server_pid)
    wire.close()
    if run.errors or run.refused:
        raise LoadError(f"{args.method} failed: {dict(run.errors)}, {run.refused} refused")
    return {"method": args.method, "window": args.window, **run.summary()}


def _check_echo(wire: Wire, session_id: str, text: str) -> None:
    """One prompt, answered ``end_turn`` with the text echoed back as ``agent_message_chunk`` updates."""
    wire.notifications.clear()
    result = wire.call(
        "session/prompt", {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    )
    chunks = [
        n["params"]["update"]
        for n in wire.notifications
        if n.get("method") == "session/update" and n["params"]["sessionId"] == session_id
    ]
    echoed = "".join(u["content"]["text"] for u in chunks if u.get("sessionUpdate") == "agent_message_chunk")
    if result.get("stopReason") != "end_turn" or echoed != text:
        raise LoadError(f"the echo backend answered {result!r} with {echoed!r} for {text!r}")


def mode_echo(args: argparse.Namespace) -> dict[str, Any]:
    wire = Wire(args.port)
    limits = wire.handshake(turn_states=not args.no_turn_states).get("agentCapabilities", {}).get("_meta", {}).get("limits", {})
    depth = args.depth
    if args.per_limit is not None:
        if not limits.get("maxPendingPromptsPerSession"):
            raise LoadError("--per-limit needs a server with a pending-prompt limit")
        depth = args.per_limit * limits["maxPendingPromptsPerSession"]
    sessions = [wire.new_session() for _ in range(args.sessions)]
    _check_echo(wire, sessions[0], args.text)
    templates = [prompt_template(s, args.text) for s in sessions]
    polite = args.retry_after

    def reconnect() -> Wire:
        """A new connection that resumes the sessions (an evicted client coming back at once)."""
        fresh = Wire(args.port)
        fresh.handshake(turn_states=not args.no_turn_states)
        for session_id in sessions:
            fresh.call("session/resume", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
        return fresh

    again = reconnect if args.reconnect else None
    warm = pipeline(wire, templates, depth, duration=args.warmup, honour_retry_after=polite, reconnect=again)
    assert warm.wire is not None
    run = pipeline(
        warm.wire, templates, depth, duration=args.duration, server_pid=args.server_pid,
        honour_retry_after=polite, reconnect=again, still_waiting=warm.waiting,
    )
    assert run.wire is not None
    run.wire.close()
    run.retry_after_ms |= warm.retry_after_ms
    wire = Wire(args.port)  # the run's own may be paced or evicted by now
    wire.handshake()
    server_refusals = server_refusal_timing(wire)
    evictions = wire.call("_acp_server/stats")["connections"].get("evictionsTotal")
    for session_id in sessions:  # leave the server as we found it (live sessions count to --max-sessions)
        wire.call("session/close", {"sessionId": session_id})
    wire.close()
    if run.errors:
        raise LoadError(f"prompts failed: {dict(run.errors)}")
    return {
        "reconnect": args.reconnect,
        "server_evictions_total": evictions,
        # a polite client's refused slots of the warm-up still wait in the run (their retryAfterMs)
        "warmup_refused": warm.refused,
        "warmup_retry_waits": warm.retry_waits,
        "sessions": args.sessions,
        "depth": depth,
        "concurrent": args.sessions * depth,
        "pending_limit": limits.get("maxPendingPromptsPerSession"),
        "words_per_prompt": len(args.text.split()),
        "retry_after": polite,
        "server_refusals": server_refusals,
        **run.summary(),
    }


def server_refusal_timing(wire: Wire) -> dict[str, Any] | None:
    """The server's ``refusals`` figures (request read to error written), since it started.

    ``None`` from a server whose ``_acp_server/stats`` has no such entry (an older one). A refusal is
    recorded once the write carrying it returns, which may be just after the client read it: one round
    trip first lets that happen before the figures are read.
    """
    wire.call("_acp_server/capabilities")
    refusals: dict[str, Any] | None = wire.call("_acp_server/stats").get("refusals")
    return refusals


def mode_refusals(args: argparse.Namespace) -> dict[str, Any]:
    wire = Wire(args.port)
    limit = (
        wire.handshake()
        .get("agentCapabilities", {})
        .get("_meta", {})
        .get("limits", {})
        .get("maxPendingPromptsPerSession")
    )
    if not limit:
        raise LoadError("the server has no pending-prompt limit, so nothing is ever refused")
    session_id = wire.new_session()
    template = prompt_template(session_id, args.text)
    # The held prompts take ids 1..limit; the server runs them (slowly) until we hang up.
    wire.send(b"".join(template % i for i in range(1, limit + 1)))
    pending = wire.call("_acp_server/stats")["bridge"]["pendingPrompts"]
    if pending != limit:
        raise LoadError(
            f"expected {limit} held prompts, the server holds {pending}: is --echo-delay-ms long?"
        )
    rtts: list[float] = []
    next_id = limit + 1
    for _ in range(args.count):
        started = time.perf_counter()
        wire.send(template % next_id)
        answer: _Msg | None = None
        while answer is None:
            for line in wire.read_lines():
                msg = _decode_msg(line)
                if msg.id == next_id:
                    answer = msg
        rtts.append(time.perf_counter() - started)
        if answer.error is None or error_kind(answer.error) not in REFUSAL_KINDS:
            raise LoadError(f"expected a refusal, got {answer!r}")
        next_id += 1
    one_at_a_time = server_refusal_timing(wire)
    run = pipeline(
        wire, [template], args.window, duration=args.duration, server_pid=args.server_pid, first_id=next_id
    )
    wire.close()
    if run.ok or run.errors:
        raise LoadError(f"expected refusals only, got {run.ok} admitted and {dict(run.errors)}")
    return {
        "pending_limit": limit,
        "round_trips": args.count,
        "rtt_p50_ms": _ms(percentile(rtts, 0.50)),
        "rtt_p99_ms": _ms(percentile(rtts, 0.99)),
        "rtt_max_ms": _ms(max(rtts)) if rtts else None,
        # The server's own timing of the same refusals (the server is expected fresh: nothing before).
        "server_one_at_a_time": one_at_a_time,
        "pipelined": run.summary(per="refused"),
    }


def mode_hammer(args: argparse.Namespace) -> dict[str, Any]:
    """A client that only makes the server refuse: one session on ``--backend`` (a slow one) held full,
    ``--window`` refused prompts re-sent at once, reconnecting at once (resuming the session) when
    evicted. Its admitted prompts are held by the slow backend, so what it costs the server is refusals."""
    def connect() -> tuple[Wire, int]:
        wire = Wire(args.port)
        limit = wire.handshake().get("agentCapabilities", {}).get("_meta", {}).get("limits", {}).get(
            "maxPendingPromptsPerSession"
        )
        if not limit:
            raise LoadError("the server has no pending-prompt limit, so nothing is ever refused")
        return wire, int(limit)

    wire, limit = connect()
    session_id: str = wire.call(
        "session/new", {"cwd": "/tmp", "mcpServers": [], "_meta": {"backend": args.backend}}
    )["sessionId"]

    def reconnect() -> Wire:
        fresh, _ = connect()
        fresh.call("session/resume", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
        return fresh

    template = prompt_template(session_id, args.text)
    wire.send(b"".join(template % i for i in range(1, limit + 1)))  # held by the slow backend
    run = pipeline(
        wire, [template], args.window, duration=args.duration, server_pid=args.server_pid,
        first_id=limit + 1, reconnect=reconnect, linger=0.5,
    )
    assert run.wire is not None
    run.wire.close()
    return {"pending_limit": limit, "window": args.window, "backend": args.backend, **run.summary(per="refused")}


def mode_sessions(args: argparse.Namespace) -> dict[str, Any]:
    wire = Wire(args.port)
    wire.handshake()
    template = [b'{"jsonrpc":"2.0","id":%d,"method":"session/new","params":{"cwd":"/tmp","mcpServers":[]}}\n']
    pipeline(wire, template, args.window, count=args.warm)
    before = rss_bytes(args.server_pid)
    run = pipeline(
        wire, template, args.window, count=args.count, server_pid=args.server_pid, first_id=args.warm + 1
    )
    after = rss_bytes(args.server_pid)
    stats = wire.call("_acp_server/stats")["bridge"]
    wire.close()
    if run.errors or run.ok != args.count:
        raise LoadError(f"session/new: {run.ok} of {args.count} created, errors {dict(run.errors)}")
    return {
        "sessions": args.count,
        "warm_sessions": args.warm,
        "server_sessions": stats["sessions"],
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "rss_per_session_bytes": round((after - before) / args.count, 1),
        "session_new_per_s": round(run.ok / run.elapsed_s, 1),
        "server_cpu_us_per_session_new": round(run.server_cpu_s * 1e6 / run.ok, 2)
        if run.server_cpu_s
        else None,
    }


def raise_nofile_limit(needed: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to ``needed`` (within the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


async def _one_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, text: str, go: asyncio.Event
) -> float:
    """Initialize, open a session, prompt once; seconds from the first byte sent to the answer."""
    await go.wait()
    started = time.perf_counter()
    writer.write(
        b'{"jsonrpc":"2.0","id":1,"method":"initialize",'
        b'"params":{"protocolVersion":1,"clientCapabilities":{}}}\n'
        b'{"jsonrpc":"2.0","id":2,"method":"session/new","params":{"cwd":"/tmp","mcpServers":[]}}\n'
    )
    session_id = None
    while session_id is None:
        msg = _decode_msg(await reader.readline())
        if msg.error is not None:
            raise LoadError(f"id {msg.id}: {error_kind(msg.error)}")
        if msg.id == 2:
            session_id = msgspec.json.decode(msg.result)["sessionId"]
    writer.write(prompt_template(session_id, text) % 3)
    echoed = []
    while True:
        line = await reader.readline()
        if not line:
            raise LoadError("the server closed the connection before answering the prompt")
        msg = _decode_msg(line)
        if msg.id is None:
            if msg.method == "session/update":  # others (e.g. _acp_server/turn_state) are not the echo
                update = msgspec.json.decode(line)["params"]["update"]
                if update.get("sessionUpdate") == "agent_message_chunk":
                    echoed.append(update["content"]["text"])
            continue
        if msg.error is not None:
            raise LoadError(f"prompt: {error_kind(msg.error)}")
        if msgspec.json.decode(msg.result).get("stopReason") != "end_turn" or "".join(echoed) != text:
            raise LoadError(f"prompt answered {bytes(msg.result)!r} with {''.join(echoed)!r}")
        return time.perf_counter() - started


async def _connections(args: argparse.Namespace) -> dict[str, Any]:
    soft = raise_nofile_limit(args.count + 64)
    before = rss_bytes(args.server_pid)
    # Opened and served in waves of --wave connections (a wave's connections all at once, each
    # initializing, opening a session and prompting; every connection stays open to the end): a herd of
    # 10,000 opened at once outlasts the server's first-message timeout for the last ones served (it
    # closes a socket that sent no complete line in time), which measures the herd, not the connections.
    wave = args.wave or args.count
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    open_failures: Counter[str] = Counter()
    outcomes: list[Any] = []
    started = time.perf_counter()
    for first in range(0, args.count, wave):
        opened = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", args.port) for _ in range(min(wave, args.count - first))),
            return_exceptions=True,
        )
        batch = [s for s in opened if not isinstance(s, BaseException)]
        open_failures.update(type(s).__name__ for s in opened if isinstance(s, BaseException))
        streams += batch
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(_one_connection(r, w, args.text, go)) for r, w in batch]
        go.set()
        outcomes += await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), args.timeout)
    wall = time.perf_counter() - started
    peak = rss_bytes(args.server_pid)
    # One more client while every other connection is still open: connect, initialize, open a
    # session and prompt once; the time from connect() to the prompt's answer.
    new_client_s: float | None = None
    new_client_error: str | None = None
    try:
        connect_started = time.perf_counter()
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", args.port), args.timeout)
        now = asyncio.Event()
        now.set()
        await asyncio.wait_for(_one_connection(reader, writer, args.text, now), args.timeout)
        new_client_s = time.perf_counter() - connect_started
        writer.close()
    except (TimeoutError, OSError, LoadError) as exc:
        new_client_error = f"{type(exc).__name__}: {exc}"[:120]
    for _, writer in streams:
        writer.close()
    await asyncio.gather(*(w.wait_closed() for _, w in streams), return_exceptions=True)
    latencies = [o for o in outcomes if isinstance(o, float)]
    failures = Counter(f"{type(o).__name__}: {o}"[:120] for o in outcomes if isinstance(o, BaseException))
    return {
        "connections": args.count,
        "wave": wave,
        "opened": len(streams),
        "served": len(latencies),
        "open_failures": dict(open_failures),
        "failures": dict(failures.most_common(5)),
        "nofile_soft_limit": soft,
        "wall_s": round(wall, 4),
        "p50_ms": _ms(percentile(latencies, 0.50)),
        "p99_ms": _ms(percentile(latencies, 0.99)),
        "rss_before_bytes": before,
        "rss_all_open_bytes": peak,
        "rss_per_connection_bytes": round((peak - before) / max(1, len(streams)), 1),
        "new_client_ms": _ms(new_client_s),
        "new_client_error": new_client_error,
    }


def mode_connections(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_connections(args))


MODES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "rpc": mode_rpc,
    "echo": mode_echo,
    "refusals": mode_refusals,
    "hammer": mode_hammer,
    "sessions": mode_sessions,
    "connections": mode_connections,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadgen", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--port", type=int, required=True, help="the server's TCP port on 127.0.0.1")
    common.add_argument(
        "--server-pid", type=int, default=None, help="read the server's CPU and RSS from /proc"
    )
    common.add_argument("--text", default="hello", help="the prompt text (default: one word, one update)")
    timed = argparse.ArgumentParser(add_help=False)
    timed.add_argument("--duration", type=float, default=3.0, help="seconds of measured load")
    timed.add_argument("--warmup", type=float, default=0.5, help="seconds of load before measuring")
    p = sub.add_parser("rpc", parents=[common, timed], help="a trivial method, pipelined")
    p.add_argument("--method", default="_acp_server/capabilities")
    p.add_argument("--window", type=int, default=256, help="requests in flight")
    p = sub.add_parser("echo", parents=[common, timed], help="echo prompts over many sessions, pipelined")
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--depth", type=int, default=2, help="prompts in flight per session")
    p.add_argument(
        "--per-limit",
        type=int,
        default=None,
        metavar="F",
        help="F times the server's pending limit in flight per session (overrides --depth)",
    )
    p.add_argument(
        "--no-turn-states",
        action="store_true",
        help="opt out of _acp_server/turn_state at initialize (the figure without their cost; "
        "without it each connection asks for them)",
    )
    p.add_argument(
        "--retry-after",
        action="store_true",
        help="re-send a refused prompt only after its retryAfterMs (default: at once, ignoring it)",
    )
    p.add_argument(
        "--reconnect",
        action="store_true",
        help="when the server ends the connection (an eviction), reconnect at once, resume the sessions "
        "and go on (default: the run fails)",
    )
    p = sub.add_parser("refusals", parents=[common, timed], help="refusals of a full session")
    p.add_argument("--count", type=int, default=2000, help="refusals timed one at a time")
    p.add_argument("--window", type=int, default=256, help="refusals in flight in the pipelined part")
    p = sub.add_parser("hammer", parents=[common, timed], help="a rude client that only gets refusals")
    p.add_argument("--backend", required=True, help="a slow backend (prompts held), e.g. an echo with delay_ms")
    p.add_argument("--window", type=int, default=240, help="refused prompts in flight, re-sent at once")
    p = sub.add_parser("sessions", parents=[common], help="RSS per idle session")
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--warm", type=int, default=200, help="sessions created before the RSS baseline")
    p.add_argument("--window", type=int, default=256, help="session/new requests in flight")
    p = sub.add_parser("connections", parents=[common], help="many connections, one prompt each")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--wave", type=int, default=0, help="connections served at once, wave after wave (0: all)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode in ("sessions", "connections") and not args.server_pid:
        print(f"loadgen {args.mode}: --server-pid is required (RSS is read from /proc)", file=sys.stderr)
        return 2
    try:
        out = MODES[args.mode](args)
    except (LoadError, OSError) as exc:
        print(f"loadgen {args.mode}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
