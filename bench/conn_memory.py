"""Where an open TCP connection's memory goes: a ``tracemalloc`` diff between N and 2N connections.

The server runs in this process (``acp_server.server.serve``, echo backend, ``--ephemeral``, no session
cap); a client process opens connections the way ``bench/run.py --only scale`` does (each initializes,
opens a session, prompts once and stays open). Once N are open, tracing starts; N more are opened; the
difference between the two snapshots, divided by N, is printed grouped by line (or by traceback), the
largest first. The client's own allocations are in another process; the tracer's are filtered out.

Usage::

    python bench/conn_memory.py                    # 300 + 300 connections, by line, top 40
    python bench/conn_memory.py --count 500 --group traceback --top 20

A figure is a mean over N connections: a container that the run shares (the scheduler's set of tasks,
the timer's heap) shows up at N when it grows, amortized. Tracing slows the server several times:
300 connections take about a minute here.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import socket
import subprocess
import sys
import tracemalloc

PROMPT = {"jsonrpc": "2.0", "id": 3, "method": "session/prompt"}


def _client(port: int) -> None:
    """Open the connections asked for on stdin (one count per line), answering ``ok`` after each batch."""
    held: list[tuple[socket.socket, object]] = []
    for line in sys.stdin:
        for _ in range(int(line)):
            sock = socket.create_connection(("127.0.0.1", port))
            reader = sock.makefile("rb")
            sock.sendall(
                b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}}\n'
                b'{"jsonrpc":"2.0","id":2,"method":"session/new","params":{"cwd":"/tmp","mcpServers":[]}}\n'
            )
            session_id = None
            while session_id is None:
                msg = json.loads(reader.readline())
                if msg.get("id") == 2:
                    session_id = msg["result"]["sessionId"]
            params = {"sessionId": session_id, "prompt": [{"type": "text", "text": "hello"}]}
            sock.sendall(json.dumps({**PROMPT, "params": params}).encode() + b"\n")
            while json.loads(reader.readline()).get("id") != 3:
                pass
            held.append((sock, reader))
        print("ok", flush=True)


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="connections opened before, and while, tracing")
    parser.add_argument("--port", type=int, default=47990)
    parser.add_argument("--group", choices=("lineno", "traceback", "filename"), default="lineno")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--frames", type=int, default=14, help="frames kept per allocation")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _raise_nofile()
    if args.client:
        _client(args.port)
        return

    import trio

    from acp_server.admission.limits import Limits
    from acp_server.server import ServerConfig, serve
    from acp_server.transports.address import ListenAddress

    n = args.count
    config = ServerConfig(
        listen=[ListenAddress("tcp", "127.0.0.1", args.port)], max_connections=4 * n + 100, limits=Limits(max_sessions=0)
    )
    client = subprocess.Popen(
        [sys.executable, __file__, "--client", "--port", str(args.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    stdin, stdout = client.stdin, client.stdout

    def open_more(count: int) -> None:
        stdin.write(f"{count}\n")
        stdin.flush()
        if stdout.readline().strip() != "ok":
            raise SystemExit("the client failed")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config)
            await trio.to_thread.run_sync(open_more, n)
            await trio.to_thread.run_sync(open_more, 10)  # warm-up of whatever the first ones grew
            await trio.sleep(0.5)
            gc.collect()
            tracemalloc.start(args.frames)
            before = tracemalloc.take_snapshot()
            await trio.to_thread.run_sync(open_more, n)
            await trio.sleep(0.5)
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            ignore = [
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "*/trio/_threads.py", all_frames=True),
            ]
            before, after = before.filter_traces(ignore), after.filter_traces(ignore)
            total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            print(f"per connection: {total / n:,.0f} bytes traced ({n} connections)")
            for stat in after.compare_to(before, args.group)[: args.top]:
                print(f"{stat.size_diff / n:8,.0f} B {stat.count_diff / n:6.2f} blocks")
                lines = stat.traceback.format()
                for line in lines if args.group == "traceback" else lines[:2]:
                    print("      ", line)
            client.kill()
            nursery.cancel_scope.cancel()

    trio.run(run)


if __name__ == "__main__":
    main()
