"""One write per echo prompt: the turn's states, its updates and its answer leave together.

Over stdio a prompt of the echo backend is five messages (``accepted``, ``running``, the chunk,
``completed``, the answer); each write costs a system call and wakes the editor. What the reader
queues waits for the end of the scheduling pass in which the runner takes its turn (the outbox's
end-of-pass flush, held one pass by the dispatch), and the echo backend ends a turn without yielding,
so the five leave in one write.
"""

from __future__ import annotations

import os
from functools import partial

import msgspec
import trio
import trio.testing

from acp_server.transports.listeners import PipeStream

from .helpers import RawClient, running_server


class _CountingPipe(PipeStream):
    """The stdio stream, counting its writes (by the writer task, or at the end of a pass)."""

    def __init__(self, receive_fd: int, send_fd: int) -> None:
        super().__init__(receive_fd, send_fd)
        self.writes: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await super().send_all(data)

    def write_nowait(self, data: bytes) -> int:
        sent = super().write_nowait(data)
        self.writes.append(bytes(data[:sent]))
        return sent


async def test_each_sequential_echo_prompt_is_one_write() -> None:
    to_server_r, to_server_w = os.pipe()
    to_client_r, to_client_w = os.pipe()
    server_end = _CountingPipe(to_server_r, to_client_w)
    client = RawClient(PipeStream(to_client_r, to_server_w))
    with trio.fail_after(20):
        async with running_server() as (server, nursery):
            nursery.start_soon(partial(server.handle_stream, server_end, "stdio", trusted=True, socket=False))
            nursery.start_soon(client.pump)
            await client.initialize()
            session_id, _ = await client.new_session()
            for word in ("one", "two", "three", "four", "five", "six"):
                before = len(server_end.writes)
                assert (await client.prompt(session_id, word))["stopReason"] == "end_turn"
                await trio.testing.wait_all_tasks_blocked()
                written = server_end.writes[before:]
                assert len(written) == 1, [len(w) for w in written]
                methods = [msgspec.json.decode(line).get("method") for line in written[0].splitlines()]
                assert methods == [
                    "_acp_server/turn_state", "_acp_server/turn_state", "session/update", "_acp_server/turn_state", None,
                ]
            await client.stream.aclose()
