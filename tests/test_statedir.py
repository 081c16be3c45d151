"""The default state directory, keyed by what a server serves, and the old shared location moved into it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

from acp_server.server import ListenAddress
from acp_server.statedir import adopt_legacy, keyed_state_dir, state_key, state_root
from acp_server.store import DB_NAME, StateLock

from .test_e2e_sdk import ServerProcess

ACP = [sys.executable, "-m", "acp_server"]


def tcp(port: int, host: str = "127.0.0.1") -> ListenAddress:
    return ListenAddress("tcp", host=host, port=port)


def test_state_key_per_listen_set_and_config_file() -> None:
    """One name per address set (in any order), another with a config file, another for another file."""
    assert state_key([tcp(4170)]) == "tcp-127.0.0.1-4170"
    assert state_key([tcp(4170), ListenAddress("unix", path="/run/a.sock")]) == state_key(
        [ListenAddress("unix", path="/run/a.sock"), tcp(4170)]
    )
    assert state_key([tcp(4170)]) != state_key([tcp(4171)])
    assert state_key([tcp(1, "::1")]) == "tcp--1-1"
    with_config = state_key([tcp(4170)], "/etc/acp/team.toml")
    assert with_config.startswith("tcp-127.0.0.1-4170+team-")
    assert with_config != state_key([tcp(4170)], "/home/me/team.toml")
    assert state_key([ListenAddress("unix", path="/a/s.sock")]) != state_key([ListenAddress("unix", path="/b/s.sock")])
    assert keyed_state_dir([tcp(4170)]) == state_root() / "tcp-127.0.0.1-4170"
    assert state_root() == pathlib.Path(os.environ["XDG_STATE_HOME"]) / "acp-server"


def _prompt(url: str, text: str) -> str:
    run = subprocess.run([*ACP, "prompt", "--connect", url, "--cwd", "/tmp", text], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    return run.stderr.split()[2]  # "acp-server: session <id> client <id>"


@pytest.fixture
def unix_address() -> Iterator[Callable[[str], str]]:
    """Makes ``unix:`` addresses of this test alone (a fixed path would be shared by parallel suites),
    and removes their socket files afterwards."""
    paths: list[pathlib.Path] = []

    def make(name: str) -> str:
        path = pathlib.Path(f"/tmp/acp-ux-{name}-{uuid.uuid4().hex[:12]}.sock")  # short: sun_path is 108 bytes
        paths.append(path)
        return f"unix:{path}"

    yield make
    for path in paths:
        path.unlink(missing_ok=True)


def _sessions(url: str) -> str:
    return subprocess.run([*ACP, "sessions", "--connect", url], capture_output=True, text=True, timeout=30).stdout


def test_two_servers_on_two_addresses_do_not_share_sessions(unix_address: Callable[[str], str]) -> None:
    """Two plain ``serve`` runs on different addresses run at once, each with its own sessions."""
    with ServerProcess("--listen", "tcp://127.0.0.1:0") as a, ServerProcess("--listen", unix_address("b")) as b:
        (url_a,) = a.wait_listening()
        (url_b,) = b.wait_listening()
        made_a = _prompt(url_a, "in a")
        made_b = _prompt(url_b, "in b")
        listed_a, listed_b = _sessions(url_a), _sessions(url_b)
    assert made_a in listed_a and made_a not in listed_b
    assert made_b in listed_b and made_b not in listed_a
    assert (state_root() / "tcp-127.0.0.1-0" / DB_NAME).is_file()


def test_the_old_shared_location_is_moved_into_the_first_keyed_directory(unix_address: Callable[[str], str]) -> None:
    """A database at ``$XDG_STATE_HOME/acp-server/sessions.db`` (where every server used to keep its
    sessions) is moved, WAL and all, into the keyed directory of the next plain ``serve``, which says so
    and serves the old sessions; the next server on another address starts empty."""
    root = state_root()
    with ServerProcess("--listen", "tcp://127.0.0.1:0", "--state-dir", str(root)) as old:
        (old_url,) = old.wait_listening()
        old_session = _prompt(old_url, "before the move")
        old.proc.send_signal(signal.SIGINT)
        assert old.proc.wait(30) == 0
    assert (root / DB_NAME).is_file()
    with ServerProcess("--listen", "tcp://127.0.0.1:0") as new:
        (url,) = new.wait_listening()
        listed = _sessions(url)
        said = new.stderr_lines
    target = root / "tcp-127.0.0.1-0"
    assert f"acp-server: moved the sessions of {root} (the old shared default) to {target}" in said
    assert old_session in listed
    assert not (root / DB_NAME).exists() and (target / DB_NAME).is_file()
    with ServerProcess("--listen", unix_address("c")) as other:
        (other_url,) = other.wait_listening()
        assert old_session not in _sessions(other_url)


def test_an_old_location_in_use_stays_where_it_is(tmp_path: pathlib.Path) -> None:
    """While another process holds the old location's lock, nothing is moved and the reason is given."""
    root = tmp_path / "acp-server"
    root.mkdir()
    (root / DB_NAME).write_bytes(b"")
    lock = StateLock(root)
    lock.acquire()
    try:
        said = adopt_legacy(tmp_path / "acp-server" / "tcp-127.0.0.1-4170", root)
    finally:
        lock.release()
    assert said == f"the sessions at {root} (the old default) stay there: in use by pid {os.getpid()}"
    assert (root / DB_NAME).exists()
    assert adopt_legacy(root / "k", root) == f"moved the sessions of {root} (the old shared default) to {root / 'k'}"
    assert adopt_legacy(root / "k2", root) is None  # nothing left to move
