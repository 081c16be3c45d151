"""An ACP agent over stdio for the shared-limits tests: it counts the calls running across every agent
process in Redis and checks each call's fencing token against the lease in Redis.

Run it as ``python -m tests.agents.counting_agent --port PORT --prefix P [--hold-ms MS]``. Each
``session/prompt`` (answered in a thread of its own, so calls overlap) reads ``_meta.leaseId`` and
``_meta.fencingToken``; when ``{P}:lease:<id>`` does not hold that token it counts the call stale
(``{test}:stale``). It increments ``{test}:running``, records the most seen in ``{test}:peak``, holds the
call for a random time up to ``--hold-ms`` (all of it when the prompt's text starts with ``long``), decrements ``{test}:running``, counts ``{test}:calls`` and
answers ``end_turn``. Plain NDJSON JSON-RPC and plain RESP, no libraries.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from typing import Any

_PEAK = (
    "local r = redis.call('INCR', KEYS[1]) "
    "if r > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], r) end return r"
)


class Resp:
    """One RESP connection (a thread's own)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def call(self, *args: str | int) -> Any:
        out = [f"*{len(args)}\r\n".encode()]
        for a in args:
            b = str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        self.sock.sendall(b"".join(out))
        return self._read()

    def _read(self) -> Any:
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b"-"):
            return rest.decode()
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.file.read(n + 2)[:-2]
            return data.decode()
        if kind == b"*":
            return [self._read() for _ in range(int(rest))]
        raise ValueError(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--hold-ms", type=int, default=20)
    args = parser.parse_args()
    lock = threading.Lock()
    local = threading.local()
    sessions = 0

    def send(msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with lock:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def redis() -> Resp:
        if not hasattr(local, "r"):
            local.r = Resp(args.port)
        return local.r  # type: ignore[no-any-return]

    def prompt(msg: dict[str, Any]) -> None:
        meta = msg["params"].get("_meta") or {}
        r = redis()
        record = r.call("GET", "{" + args.prefix + "}:lease:" + str(meta.get("leaseId")))
        if record is None or record.split("|")[0] != str(meta.get("fencingToken")):
            r.call("INCR", "{test}:stale")
        r.call("EVAL", _PEAK, 2, "{test}:running", "{test}:peak")
        blocks = msg["params"].get("prompt") or [{}]
        full = str(blocks[0].get("text", "")).startswith("long")
        try:
            time.sleep((1.0 if full else random.random()) * args.hold_ms / 1000)
        finally:
            r.call("DECR", "{test}:running")
            r.call("INCR", "{test}:calls")
        send({"jsonrpc": "2.0", "id": msg["id"], "result": {"stopReason": "end_turn"}})

    for line in sys.stdin.buffer:
        msg = json.loads(line)
        method = msg.get("method")
        if "id" not in msg or method is None:
            continue
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": msg["id"], "result": {"protocolVersion": 1, "agentCapabilities": {}}})
        elif method == "session/new":
            sessions += 1
            send({"jsonrpc": "2.0", "id": msg["id"], "result": {"sessionId": f"count-{sessions}"}})
        elif method == "session/prompt":
            threading.Thread(target=prompt, args=(msg,), daemon=True).start()
        else:
            send({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "not here"}})


if __name__ == "__main__":
    main()
