import os
import shutil
import sys
import tempfile

import pytest

#: the acp-server command of the venv running the tests
ACP_SERVER = shutil.which("acp-server", path=os.path.dirname(sys.executable)) or "acp-server"


@pytest.fixture
def acp_server_cmd() -> list[str]:
    return [sys.executable, "-m", "acp_server"]


def pytest_configure(config: pytest.Config) -> None:
    """Servers started outside any test (module- or session-scoped fixtures) never write to
    ``~/.local/state`` either: the whole run gets a temporary ``$XDG_STATE_HOME``."""
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="acp-test-state-")


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every server process a test starts keeps its durable sessions in a fresh directory of its own,
    never in ``~/.local/state`` (``serve`` without ``--stdio`` defaults to ``$XDG_STATE_HOME/acp-server``)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
