"""A little load for the console's browser tests and ``make screenshots``, as a separate process.

``python -m tests.web_load --connect tcp://HOST:PORT --prompts N [--session ID] [--text T] [--hold]`` sends
``N`` prompts at once with the client SDK (each on a new session, or all on ``--session``), prints one
line per outcome (the stop reason, or the refusal's ``errorKind``) and exits when all are answered.
With ``--hold``, a line on stdin (or its end) sends ``session/cancel`` to every session whose prompt is
still unanswered: against a server whose turns outlast the test, the prompts hold until released.
"""

from __future__ import annotations

import argparse
import sys

import trio

from acp_server.client import ClientError, SessionClient, connect


async def _one(
    target: str, session_id: str | None, text: str, out: list[str], running: set[SessionClient] | None = None
) -> None:
    async with connect(target) as client:
        if session_id is None:
            session = await client.new_session("/")
        else:
            session = await client.resume_session(session_id, "/")
        if running is not None:
            running.add(session)
        try:
            result = await session.prompt(text)
        except ClientError as exc:
            out.append(str(getattr(exc, "kind", None) or type(exc).__name__))
        else:
            out.append(str(result.stop_reason))
        finally:
            if running is not None:
                running.discard(session)


async def _release(running: set[SessionClient]) -> None:
    """Wait for a line on stdin, then cancel every prompt still unanswered."""
    await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    for session in list(running):
        session.cancel()


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="web_load")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--session")
    parser.add_argument("--text", default="load " * 4)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args(argv)
    out: list[str] = []
    running: set[SessionClient] | None = set() if args.hold else None
    async with trio.open_nursery() as outer:
        if running is not None:
            outer.start_soon(_release, running)
        async with trio.open_nursery() as nursery:
            for _ in range(args.prompts):
                nursery.start_soon(_one, args.connect, args.session, args.text, out, running)
        outer.cancel_scope.cancel()
    for line in out:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
