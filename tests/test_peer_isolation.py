"""One peer's trouble stays its own: an agent message over the clients' ``--max-message-bytes`` fails
its prompt (``agent_error``, reason ``message_too_large``) and is not relayed; a defect injected into
an agent's reader ends that agent only; one injected into a connection (stdio's frame or a socket's)
ends that connection only; the first-message and idle timeouts close only the sockets they name.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.backends import AcpAgentBackend, Backend, EchoBackend
from acp_server.backends.agent_process import AgentProcess
from acp_server.jsonrpc import Event
from acp_server.server import FIRST_MESSAGE_TIMEOUT_S, Server

from .helpers import ROOT, RawClient, RpcError, connect, running_server
from .test_agent_hostile_lines import AGENT, RAW_AGENT

LIMIT = 256 * 1024


async def _agent_server(limits: Limits | None = None) -> tuple[Server, AcpAgentBackend]:
    agent = AcpAgentBackend(AGENT, RAW_AGENT, cwd=str(ROOT))
    backends: dict[str, Backend] = {AGENT: agent, "echo": EchoBackend()}
    return Server(limits, backends, default_backend=AGENT), agent


async def test_an_agent_update_over_max_message_bytes_fails_its_prompt_and_is_not_relayed() -> None:
    with trio.fail_after(30):
        server, agent = await _agent_server(Limits(max_message_bytes=LIMIT))
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await nursery.start(server.bridge.run)
            client = await connect(server, nursery)
            session_id, _ = await client.new_session(str(ROOT))
            with pytest.raises(RpcError) as info:
                await client.prompt(session_id, f"big-{4 * LIMIT}")
            error = info.value.error
            assert error["data"]["errorKind"] == "agent_error", error
            assert error["data"]["reason"] == "message_too_large" and error["data"]["promptId"]
            assert all(len(str(n)) < LIMIT for n in client.notifications)  # nothing that large relayed
            assert (await client.prompt(session_id, f"big-{LIMIT // 4}"))["stopReason"] == "end_turn"
            assert (await client.prompt(session_id, "plain"))["stopReason"] == "end_turn"
            assert not client.eof.is_set()  # the client was not evicted
            nursery.cancel_scope.cancel()


async def test_a_defect_in_an_agent_reader_ends_that_agent_not_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    armed = {"on": False}
    take_events = AgentProcess._take_events

    def failing(self: AgentProcess, events: list[Event]) -> bool:
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("injected into the agent reader")
        return take_events(self, events)

    monkeypatch.setattr(AgentProcess, "_take_events", failing)
    with trio.fail_after(30):
        server, agent = await _agent_server()
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await nursery.start(server.bridge.run)
            client = await connect(server, nursery)
            other = await connect(server, nursery)
            session_id, _ = await client.new_session(str(ROOT))
            echo_session, _ = await other.new_session(str(ROOT), backend="echo")
            armed["on"] = True
            with pytest.raises(RpcError) as info:
                await client.prompt(session_id, "plain")
            assert info.value.kind not in (None, "internal"), info.value.error
            # the server, the other connection and the failed prompt's own connection carry on
            assert (await other.prompt(echo_session, "still here"))["stopReason"] == "end_turn"
            result: Any = await client.call("_acp_server/capabilities")
            assert "limits" in result
            nursery.cancel_scope.cancel()


class _FailingStream(trio.abc.Stream):
    """A stream whose second read raises what no transport would (a defect in the connection)."""

    def __init__(self, first: bytes) -> None:
        self.first: bytes | None = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if self.first is not None:
            data, self.first = self.first, None
            return data
        raise RuntimeError("injected into the connection")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("socket", [False, True], ids=["stdio", "socket"])
async def test_a_defect_in_a_connection_ends_that_connection_only(socket: bool) -> None:
    """``handle_stream`` (the frame stdio runs in, unisolated by any listener) returns instead of raising."""
    with trio.fail_after(10):
        async with running_server() as (server, nursery):
            other = await connect(server, nursery)
            init = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}\n'
            await server.handle_stream(_FailingStream(init), "stdio", trusted=not socket, socket=socket)
            session_id, _ = await other.new_session()
            assert (await other.prompt(session_id, "after"))["stopReason"] == "end_turn"
            assert len(server.connections) == 1


async def _raw(server: Server, nursery: trio.Nursery) -> tuple[RawClient, trio.Event]:
    client_end, server_end = trio.testing.memory_stream_pair()
    ended = trio.Event()

    async def serve() -> None:
        try:
            await server.handle_stream(server_end, "test")
        finally:
            ended.set()

    nursery.start_soon(serve)
    client = RawClient(client_end)
    nursery.start_soon(client.pump)
    return client, ended


async def test_a_socket_without_a_complete_line_is_closed_after_the_first_message_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_server() as (server, nursery):
        silent, silent_ended = await _raw(server, nursery)
        partial, partial_ended = await _raw(server, nursery)
        talker, talker_ended = await _raw(server, nursery)
        await partial.send_raw(b'{"jsonrpc":"2.0","id":1,')
        await trio.sleep(FIRST_MESSAGE_TIMEOUT_S / 2)
        await talker.initialize()
        await trio.sleep(FIRST_MESSAGE_TIMEOUT_S / 2 + 0.5)
        assert silent_ended.is_set() and partial_ended.is_set()
        assert not talker_ended.is_set()
        assert (await talker.call("_acp_server/capabilities"))["limits"]


async def test_an_idle_socket_holding_nothing_is_closed_and_one_attached_to_a_session_is_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_server() as (server, nursery):
        server.connection_idle_timeout_s = 60
        idle, idle_ended = await _raw(server, nursery)
        attached, attached_ended = await _raw(server, nursery)
        await idle.initialize()
        await attached.initialize()
        session_id, _ = await attached.new_session()
        await trio.sleep(30)
        await idle.call("_acp_server/capabilities")  # input resets the clock
        await trio.sleep(45)
        assert not idle_ended.is_set()
        await trio.sleep(30)
        assert idle_ended.is_set()
        await trio.sleep(600)
        assert not attached_ended.is_set()
        assert (await attached.prompt(session_id, "still open"))["stopReason"] == "end_turn"


async def test_the_idle_timeout_can_be_turned_off(autojump_clock: trio.testing.MockClock) -> None:
    async with running_server() as (server, nursery):
        server.connection_idle_timeout_s = 0
        idle, idle_ended = await _raw(server, nursery)
        await idle.initialize()
        await trio.sleep(3600)
        assert not idle_ended.is_set()


def test_the_new_flags_and_their_config_keys(tmp_path: Any) -> None:
    """``--drain-timeout-s``, ``--connection-idle-timeout-s`` and ``--max-history-events``, each with its
    config key; the command line wins; bad values exit 2 naming the flag."""
    from acp_server.cli import _build, _parse, server_config
    from acp_server.config import ConfigError, parse_config

    def config(*argv: str) -> Any:
        parser, serve = _build()
        return server_config(_parse(parser, ["serve", "--ephemeral", *argv]), serve)

    default = config()
    assert default.drain_timeout_s is None  # not given: 30 s for half-close, SIGTERM cancels at once
    assert default.connection_idle_timeout_s == 300 and default.limits.max_history_events == 10_000
    toml = tmp_path / "c.toml"
    toml.write_text("drain_timeout_s = 5\nconnection_idle_timeout_s = 0\nmax_history_events = 77\n")
    from_file = config("--config", str(toml))
    assert (from_file.drain_timeout_s, from_file.connection_idle_timeout_s) == (5, 0)
    assert from_file.limits.max_history_events == 77
    given = config("--config", str(toml), "--drain-timeout-s", "1.5", "--connection-idle-timeout-s", "9",
                   "--max-history-events", "3")
    assert (given.drain_timeout_s, given.connection_idle_timeout_s, given.limits.max_history_events) == (1.5, 9, 3)
    for bad in (["--drain-timeout-s", "-1"], ["--connection-idle-timeout-s", "x"], ["--max-history-events", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            config(*bad)
        assert exit_info.value.code == 2
    with pytest.raises(ConfigError, match="max_history_events"):
        parse_config("max_history_events = 0")
