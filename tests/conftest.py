import os
import shutil
import sys

import pytest

#: the acp-server command of the venv running the tests
ACP_SERVER = shutil.which("acp-server", path=os.path.dirname(sys.executable)) or "acp-server"


@pytest.fixture
def acp_server_cmd() -> list[str]:
    return [sys.executable, "-m", "acp_server"]
