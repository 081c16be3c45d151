"""session/load replays the transcript in order with the original eventIds; session/resume re-registers."""

from acp_server.store import StoredEvent

from .helpers import RpcError, connect, running_server


async def test_load_replays_history_in_order_then_streams_live() -> None:
    async with running_server() as (server, nursery):
        a = await connect(server, nursery)
        session_id, _ = await a.new_session()
        await a.prompt(session_id, "one two")
        await a.prompt(session_id, "three")
        b = await connect(server, nursery)
        result = await b.call("session/load", {"sessionId": session_id, "cwd": "/tmp", "mcpServers": []})
        assert result["_meta"]["clientId"].startswith("client_")
        replayed = b.updates(session_id)
        ids = [u["_meta"]["eventId"] for u in replayed]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert all("originatorClientId" not in u["_meta"] for u in replayed)
        kinds = [u["update"]["sessionUpdate"] for u in replayed]
        assert kinds == ["user_message_chunk", "agent_message_chunk", "agent_message_chunk",
                         "user_message_chunk", "agent_message_chunk"]
        assert b.agent_text(session_id) == "one twothree"
        # b is attached now: a's next prompt streams to it live
        await a.prompt(session_id, "four")
        assert b.agent_text(session_id) == "one twothreefour"


async def test_after_event_id_replays_only_the_tail() -> None:
    async with running_server() as (server, nursery):
        a = await connect(server, nursery)
        session_id, _ = await a.new_session()
        await a.prompt(session_id, "one")
        last = a.updates(session_id)[-1]["_meta"]["eventId"]
        await a.prompt(session_id, "two")
        b = await connect(server, nursery)
        await b.call("session/resume", {"sessionId": session_id, "cwd": "/tmp", "_meta": {"afterEventId": last}})
        history = server.bridge.sessions[session_id].history
        tail = [e for e, u in history if e > last and not isinstance(u, StoredEvent)]
        assert len(tail) == 2  # prompt "two": its user chunk and its echo
        assert [u["_meta"]["eventId"] for u in b.updates(session_id)] == tail
        # and the terminal turn states after ``last``: prompt "one"'s and prompt "two"'s
        assert [(t["promptId"], t["state"]) for t in b.turn_states] == [("prompt_1", "completed"), ("prompt_2", "completed")]


async def test_resume_registers_a_fresh_id_without_replay() -> None:
    async with running_server() as (server, nursery):
        a = await connect(server, nursery)
        session_id, old = await a.new_session()
        await a.prompt(session_id, "one")
        b = await connect(server, nursery)
        result = await b.call("session/resume", {"sessionId": session_id, "cwd": "/tmp"})
        new = result["_meta"]["clientId"]
        assert new != old and b.updates(session_id) == []
        assert (await b.prompt(session_id, "x", clientId=new))["stopReason"] == "end_turn"
        try:
            await b.call("session/resume", {"sessionId": "sess_nope", "cwd": "/tmp"})
        except RpcError as exc:
            assert exc.kind == "session_not_found"
        else:
            raise AssertionError("resume of an unknown session succeeded")
