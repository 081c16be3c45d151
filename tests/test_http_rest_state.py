"""The REST API's own state (``rest_state.RestState``): the event epoch and the default session per cwd,
kept in the state directory when there is one."""

from __future__ import annotations

import json
from pathlib import Path

from acp_server.transports.http.rest_state import DEFAULTS_FILE, EPOCH_FILE, RestState


def test_epoch_is_kept_in_the_directory_and_new_without_one(tmp_path: Path) -> None:
    """The same directory gives the same epoch; another directory, or none, a new one; a damaged
    epoch file is replaced."""
    first = RestState(tmp_path).epoch
    assert RestState(tmp_path).epoch == first and (tmp_path / EPOCH_FILE).read_text().strip() == first
    (tmp_path / "other").mkdir()
    assert RestState(tmp_path / "other").epoch != first
    assert RestState(None).epoch != RestState(None).epoch
    (tmp_path / EPOCH_FILE).write_text("not an epoch\n")
    fresh = RestState(tmp_path).epoch
    assert fresh != first and len(fresh) == 16 and RestState(tmp_path).epoch == fresh


def test_default_sessions_survive_a_new_state_and_forget(tmp_path: Path) -> None:
    """``set_default`` is written through; ``forget_session`` drops every cwd it was the default of; an
    unreadable file starts empty instead of failing."""
    state = RestState(tmp_path)
    state.set_default("/a", "s1")
    state.set_default("/b", "s1")
    state.set_default("/c", "s2")
    again = RestState(tmp_path)
    assert (again.default_session("/a"), again.default_session("/c"), again.default_session("/x")) == ("s1", "s2", None)
    again.forget_session("s1")
    assert json.loads((tmp_path / DEFAULTS_FILE).read_text()) == {"/c": "s2"}
    (tmp_path / DEFAULTS_FILE).write_text("{not json")
    assert RestState(tmp_path).default_session("/c") is None
    memory = RestState(None)
    memory.set_default("/a", "s9")
    assert memory.default_session("/a") == "s9" and not list(Path(tmp_path).glob("*.tmp"))
