"""``acp_server.bridge.clients.ClientRegistry``: client ids per session and the state it keeps per
connection (what the transports no longer hold)."""

from __future__ import annotations

import pytest
import trio

from acp_server.bridge.clients import ClientRegistry
from acp_server.bridge.sessions import SessionTable
from acp_server.errors import InvalidClientIdError

from .fakes import FakeBackend, FakePeer


async def test_register_attaches_and_remembers_the_connections_client_id() -> None:
    clients = ClientRegistry()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    peer = FakePeer()
    cid = clients.register(session, peer)
    assert cid.startswith("client_") and session.attached == {peer}
    assert clients.registration(peer, session.session_id) == cid
    assert clients.state(peer).sessions == {session}
    assert clients.resolve(session, peer, None) == cid, "its own id when it names none"
    assert clients.resolve(session, FakePeer(), None) is None, "anonymous for a connection without one"
    with pytest.raises(InvalidClientIdError):
        clients.resolve(session, peer, "client_forged")


async def test_a_closed_connection_is_registered_but_not_attached() -> None:
    clients = ClientRegistry()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    gone = FakePeer()
    gone.closed = True
    cid = clients.register(session, gone)
    assert cid in session.clients and session.attached == set() and gone not in clients.peers
    clients.attach(session, gone)
    assert session.attached == set()


async def test_peer_closed_detaches_it_everywhere_and_forgets_it() -> None:
    clients = ClientRegistry()
    one = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    two = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    peer, other = FakePeer(), FakePeer()
    c1 = clients.register(one, peer)
    clients.register(two, peer)
    clients.register(two, other)
    clients.set_turn_states(peer, False)
    clients.peer_closed(peer)
    assert one.attached == set() and two.attached == {other}
    assert peer not in clients.peers and clients.turn_states(peer), "forgotten: the defaults again"
    assert c1 in one.clients, "its client ids stay with their sessions"
    clients.peer_closed(peer)  # twice is harmless


async def test_session_closed_drops_its_clients_and_every_connections_registration() -> None:
    clients = ClientRegistry()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    a, b = FakePeer(), FakePeer()
    clients.register(session, a)
    clients.register(session, b)
    clients.session_closed(session)
    assert session.attached == set() and session.clients == {}
    assert clients.registration(a, session.session_id) is None and clients.state(b).sessions == set()


async def test_release_keeps_the_connection_attached_while_it_holds_another_registration() -> None:
    clients = ClientRegistry()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    peer = FakePeer()
    own = clients.register(session, peer)
    shared = clients.register(session, None)  # another client's id, released through this connection
    clients.release(session, peer, shared)
    assert shared not in session.clients and peer in session.attached
    clients.release(session, peer, own)
    assert own not in session.clients and peer not in session.attached


async def test_expire_idle_drops_only_the_ids_last_seen_before_the_cut() -> None:
    clients = ClientRegistry()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    old = clients.register(session, None)
    cut = trio.current_time()
    await trio.sleep(0.01)
    fresh = clients.register(session, None)
    clients.expire_idle(session, cut)
    assert list(session.clients) == [fresh] and old not in session.clients
    assert not clients.any_live(session)
    live = FakePeer()
    clients.attach(session, live)
    assert clients.any_live(session)
    clients.detach(session, live)
    assert not clients.any_live(session) and clients.state(live).sessions == set()


async def test_a_connection_attached_to_none_one_or_many_sessions_and_detached_again() -> None:
    """One session is kept without a set of its own (most connections hold one); two or more in a set,
    and whatever the form, attach, detach, close and a closed session leave the same membership."""
    clients = ClientRegistry()
    sessions = [SessionTable.build(FakeBackend(), "/tmp", [], "default") for _ in range(3)]
    peer = FakePeer()
    state = clients.state(peer)
    assert state.sessions == set() and not state.holds_sessions()
    clients.attach(sessions[0], peer)
    clients.attach(sessions[0], peer)
    assert state.sessions == {sessions[0]} and state.holds_sessions()
    assert not isinstance(state._attached, set)  # one session: no set
    for session in sessions[1:]:
        clients.attach(session, peer)
    assert state.sessions == set(sessions)
    clients.detach(sessions[1], peer)
    clients.detach(sessions[1], peer)
    assert state.sessions == {sessions[0], sessions[2]}
    clients.session_closed(sessions[0])
    assert state.sessions == {sessions[2]} and not isinstance(state._attached, set)
    clients.detach(sessions[0], peer)  # not attached any more: nothing changes
    assert state.sessions == {sessions[2]}
    clients.detach(sessions[2], peer)
    assert state.sessions == set() and not state.holds_sessions()
    for session in sessions[1:]:
        clients.attach(session, peer)
    clients.peer_closed(peer)
    assert all(peer not in s.attached for s in sessions) and peer not in clients.peers
