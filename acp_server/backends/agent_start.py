"""Starting an agent child: the ``initialize`` handshake, and the restart backoff after failures.

Used by :class:`~acp_server.backends.acp_agent.AcpAgentBackend`, which owns the child's lifecycle.
"""

from __future__ import annotations

import logging
from typing import Any, Final, Literal

import trio

from .. import __version__
from ..types.acp import PROTOCOL_VERSION
from .agent_process import AgentProcess, AgentRpcError, ChildExitedError

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "BACKOFF_RESET_S",
    "CLIENT_CAPABILITIES",
    "FailureReason",
    "StartAttempt",
    "StartFailed",
    "initialize_child",
    "restart_delay",
]

log = logging.getLogger("acp_server.backends.acp_agent")

FailureReason = Literal["spawn_failed", "exited", "initialize_failed"]

#: the first delay of the restart backoff; each further failure doubles it
BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 30.0
#: a child that stayed up this long resets the backoff
BACKOFF_RESET_S: Final = 60.0

#: the client capabilities we advertise to the child: all that we can relay
CLIENT_CAPABILITIES: Final = {
    "fs": {"readTextFile": True, "writeTextFile": True},
    "terminal": True,
    "elicitation": {"form": {}, "url": {}},
}


def restart_delay(failures: int) -> float:
    """Seconds to wait before the next start after ``failures`` failures in a row (0 after the first)."""
    if failures <= 1:
        return 0.0
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 2)))


class StartFailed(Exception):
    """Starting the child failed: why (``reason``), and its exit code when it exited."""

    def __init__(self, reason: FailureReason, exit_code: int | None) -> None:
        super().__init__(reason)
        self.reason: FailureReason = reason
        self.exit_code = exit_code


class StartAttempt:
    """One spawn + initialize, shared by every caller that needs the child meanwhile."""

    __slots__ = ("done", "failure")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.failure: tuple[FailureReason, int | None] | None = ("spawn_failed", None)


async def initialize_child(child: AgentProcess, name: str, timeout_s: float) -> dict[str, Any]:
    """Send ``initialize`` to a freshly spawned child and check its answer (our protocol version).

    Returns:
        The child's ``initialize`` result.

    Raises:
        StartFailed: ``initialize_failed`` (exited, refused, too slow, another protocol version: the
            child is killed).
    """
    params = {
        "protocolVersion": PROTOCOL_VERSION,
        "clientCapabilities": CLIENT_CAPABILITIES,
        "clientInfo": {"name": "acp-server", "title": "acp-server", "version": __version__},
    }
    try:
        with trio.fail_after(timeout_s):
            result = await child.request("initialize", params)
    except ChildExitedError as exc:
        log.warning("backend %s: agent exited during initialize (code %s)", name, exc.exit_code)
        raise StartFailed("initialize_failed", exc.exit_code) from exc
    except AgentRpcError as exc:
        log.warning("backend %s: agent refused initialize: %s", name, exc.error)
        child.kill()
        raise StartFailed("initialize_failed", None) from exc
    except trio.TooSlowError as exc:
        log.warning("backend %s: agent did not answer initialize in %s s", name, timeout_s)
        child.kill()
        raise StartFailed("initialize_failed", None) from exc
    if not isinstance(result, dict) or result.get("protocolVersion") != PROTOCOL_VERSION:
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        log.warning("backend %s: agent speaks protocol version %r, not %d", name, version, PROTOCOL_VERSION)
        child.kill()
        raise StartFailed("initialize_failed", None)
    return result
