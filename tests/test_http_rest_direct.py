"""SSE frames of the bridge's live fan-out written as their scheduling pass ends, without the pump."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from acp_server.bridge.fanout import encode_update
from acp_server.transports.http.rest_events import SseSubscriber, frames_of


def _line(event_id: int) -> bytes:
    return encode_update("s1", event_id, b'{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"x"}}')


async def test_live_frames_leave_in_one_direct_write_as_their_pass_ends() -> None:
    """Frames queued in one pass leave joined through ``direct`` once the pass ends (not before, and not
    through the pump); frames ``direct`` refuses are taken by the pump, in order, none lost."""
    sub = SseSubscriber("s1")
    written: list[bytes] = []
    accept = [True]

    def direct(data: bytes) -> bool:
        if accept[0]:
            written.append(data)
        return accept[0]

    sub.direct = direct
    taken: list[bytes] = []

    async def pump() -> None:
        while (frames := await sub.take()) is not None:
            taken.append(b"".join(frames))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            await trio.testing.wait_all_tasks_blocked()
            sub.send(_line(1))
            sub.send(_line(2))
            assert written == [] and len(sub.frames) == 2  # the pass has not ended yet
            await trio.testing.wait_all_tasks_blocked()
            assert written == [frames_of(_line(1))[0][1] + frames_of(_line(2))[0][1]]
            assert taken == [] and not sub.frames and sub.nbytes == 0 and sub.last_event_id == 2
            sub.send(_line(3))  # the pump still waits: the next pass's frames go the same way
            await trio.testing.wait_all_tasks_blocked()
            assert written[1:] == [frames_of(_line(3))[0][1]] and taken == []
            accept[0] = False
            sub.send(_line(4))
            sub.send(_line(5))
            await trio.testing.wait_all_tasks_blocked()
            assert len(written) == 2
            assert taken == [frames_of(_line(4))[0][1] + frames_of(_line(5))[0][1]]
            accept[0] = True
            sub.send(_line(6))  # the pump waits again: direct once more
            await trio.testing.wait_all_tasks_blocked()
            assert written[2:] == [frames_of(_line(6))[0][1]] and len(taken) == 1
            sub.close()
    assert not sub.frames


async def test_without_direct_the_pump_writes_live_frames() -> None:
    """A stream that cannot be written without waiting (no ``direct``: h11, HTTP/2, TLS) keeps its pump."""
    sub = SseSubscriber("s1")
    taken: list[bytes] = []

    async def pump() -> None:
        while (frames := await sub.take()) is not None:
            taken.append(b"".join(frames))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            await trio.testing.wait_all_tasks_blocked()
            sub.send(_line(1))
            await trio.testing.wait_all_tasks_blocked()
            assert taken == [frames_of(_line(1))[0][1]]
            sub.close()


_WORKING = (b'{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{"sessionId":"s1","promptId":"p1",'
            b'"state":"working"}}\n')
_COMPLETED = (b'{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{"sessionId":"s1","promptId":"p1",'
              b'"state":"completed","_meta":{"eventId":9}}}\n')
_ODD = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"a":\r1},"_meta":{"eventId":8}}}\n'


@pytest.mark.parametrize(
    "lines",
    [
        [_line(1), _line(2), encode_update("s1", 3, b"[]", "cli-1")],
        [_WORKING, _line(1), _line(2), _COMPLETED],
        [_line(1), _ODD, _COMPLETED],  # a line the bridge's layout does not describe: each line on its own
        [_COMPLETED, _line(10)],
    ],
)
async def test_lines_of_a_pass_are_written_as_their_frames_one_by_one_would_be(lines: list[bytes]) -> None:
    """The run of a pass's lines, translated together, is byte for byte the frames of each line joined;
    the stream's event id and frame count follow the last of them."""
    want = b"".join(frame for line in lines for _, frame in frames_of(line))
    ids = [i for line in lines for i, _ in frames_of(line) if i is not None]
    count = sum(len(frames_of(line)) for line in lines)
    sub = SseSubscriber("s1")
    written: list[bytes] = []
    sub.direct = lambda data: written.append(data) is None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sub.take)
            await trio.testing.wait_all_tasks_blocked()
            for line in lines:
                sub.send(line)
            await trio.testing.wait_all_tasks_blocked()
            assert b"".join(written) == want and len(written) == 1
            assert sub.last_event_id == ids[-1] and sub.frames_queued == count
            sub.close()
