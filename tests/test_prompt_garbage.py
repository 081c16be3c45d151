"""A prompt leaves nothing for the cycle collector, and a session's history is not tracked by it.

A reference cycle per prompt (the request's slot, its waiter and the shell's callbacks holding one
another) once left every prompt's objects to the collector: young collections of 50-140 ms under 8
busy sessions, the p99 of ``make bench``. Session updates kept in a history, tracked, were walked
again by every collection that promoted them.
"""

from __future__ import annotations

import gc

import trio

from acp_server.bridge.session import PromptTicket
from acp_server.bridge.settlement import PromptWaiter
from acp_server.types.acp import AgentMessageChunk, TextContent, UserMessageChunk

from .helpers import connect, running_server

#: our objects of one prompt: none of them may end in a cycle
_PER_PROMPT = (PromptTicket, PromptWaiter)


async def test_answered_prompts_leave_no_reference_cycle() -> None:
    with trio.fail_after(20):
        async with running_server() as (server, nursery):
            client = await connect(server, nursery)
            sessions = [(await client.new_session())[0] for _ in range(4)]
            await client.prompt(sessions[0], "warm up")
            flags = gc.get_debug()
            gc.collect()
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
            try:
                for _ in range(5):
                    assert (await client.prompt(sessions[0], "one after the other"))["stopReason"] == "end_turn"
                async with trio.open_nursery() as prompts:  # several sessions at once, as in the benchmark
                    for session_id in sessions:
                        prompts.start_soon(client.prompt, session_id, "all at once")
                gc.collect()
                cyclic = [o for o in gc.garbage if isinstance(o, _PER_PROMPT)]
            finally:
                gc.set_debug(flags)
                gc.garbage.clear()
            assert cyclic == [], f"{len(cyclic)} prompt objects were left in reference cycles"


async def test_a_sessions_history_is_not_tracked_by_the_collector() -> None:
    with trio.fail_after(20):
        async with running_server() as (server, nursery):
            client = await connect(server, nursery)
            session_id, _ = await client.new_session()
            await client.prompt(session_id, "three words here")
            updates = [update for _, update in server.bridge.sessions[session_id].history]
            chunks = [u for u in updates if isinstance(u, AgentMessageChunk | UserMessageChunk)]
            assert len(chunks) == 4  # the prompt's own text and three chunks
            assert not any(gc.is_tracked(u) or gc.is_tracked(u.content) for u in chunks)
            # even with a dict inside (annotations, _meta), an update is not tracked; the dict still is
            built = AgentMessageChunk(content=TextContent(text="x", annotations={"audience": ["user"]}))
            assert not gc.is_tracked(built) and gc.is_tracked(built.content.annotations)
