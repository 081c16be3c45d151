"""The official SDK's own remote server: ``acp.http`` AcpServer through ``create_asgi_app`` under
hypercorn (asyncio), serving the SDK echo agent (``sdk_echo_agent.py``) at ``/acp``.

Run: ``python bench/peers/sdk_http_server.py PORT``; prints ``listening PORT`` to stderr when ready.
It is the SDK side of the ``http`` benchmark scenario, what a developer would write with the SDK alone.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from acp.http.asgi import create_asgi_app
from hypercorn.asyncio import serve
from hypercorn.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdk_echo_agent import SdkEchoAgent  # noqa: E402


def _agent(conn: Any) -> SdkEchoAgent:
    agent = SdkEchoAgent()
    agent.on_connect(conn)
    return agent


async def main(port: int) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    print(f"listening {port}", file=sys.stderr, flush=True)
    await serve(create_asgi_app(_agent), config)  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
