"""Relaying an agent's own requests to the client whose prompt turn is running.

Mid-turn, an ACP agent asks its client things: a permission, a file, a terminal, a form. Behind the
server there is no single client, so each such request goes to the connection that sent the running
prompt, and only when that connection advertised the capability (a permission is always allowed).
A request that cannot be relayed is refused to the agent at once; one still open when its turn ends or
its client leaves is answered for the client (``cancelled`` for a permission, ``-32800`` otherwise), so
an agent never waits for an answer that will not come.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

import trio

from ..types.acp import ClientCapabilities
from .agent_process import AgentProcess
from .base import ClientChannel, ClientGoneError, ClientRequestError, Turn

__all__ = ["RELAYED_METHODS", "TurnRelay", "answer_abandoned"]

log = logging.getLogger("acp_server.backends.agent_relay")

Id = int | str

PERMISSION: Final = "session/request_permission"
_CANCELLED_OUTCOME: Final = {"outcome": {"outcome": "cancelled"}}


def _terminal(caps: ClientCapabilities) -> bool:
    return caps.terminal


#: the agent's requests we relay: method -> (the capability's name, whether a client advertised it)
RELAYED_METHODS: Final[Mapping[str, tuple[str, Callable[[ClientCapabilities], bool]]]] = {
    PERMISSION: ("", lambda caps: True),
    "fs/read_text_file": ("fs.readTextFile", lambda caps: caps.fs.read_text_file),
    "fs/write_text_file": ("fs.writeTextFile", lambda caps: caps.fs.write_text_file),
    "terminal/create": ("terminal", _terminal),
    "terminal/output": ("terminal", _terminal),
    "terminal/release": ("terminal", _terminal),
    "terminal/wait_for_exit": ("terminal", _terminal),
    "terminal/kill": ("terminal", _terminal),
    "elicitation/create": ("elicitation", lambda caps: caps.elicitation is not None),
}


def answer_abandoned(child: AgentProcess, req_id: Id, method: str, why: str) -> None:
    """Answer a relayed request the client will not: a cancelled permission, else request_cancelled."""
    if method == PERMISSION:
        child.respond(req_id, _CANCELLED_OUTCOME)
    else:
        child.respond_error(req_id, {"code": -32800, "message": f"Request cancelled: {why}"})


def _error_object(error: Any) -> dict[str, Any]:
    """A client's error object as a well-formed one (a broken one becomes -32603)."""
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message")
        if isinstance(code, int) and isinstance(message, str):
            return {k: v for k, v in error.items() if k in ("code", "message", "data")}
    return {"code": -32603, "message": "the client answered with a malformed error", "data": error}


class TurnRelay:
    """A prompt turn running on an agent: its updates' destination, and the requests relayed for it.

    Args:
        turn: the bridge's turn (its ``client`` is asked; ``None`` once it left).
        child: the agent process running the turn.
        nursery: where relay tasks run (the backend's, so a relay never blocks the reader).
    """

    __slots__ = ("child", "closing", "nursery", "relays", "turn")

    def __init__(self, turn: Turn, child: AgentProcess, nursery: trio.Nursery) -> None:
        self.turn = turn
        self.child = child
        self.nursery = nursery
        self.closing = False
        self.relays: set[trio.CancelScope] = set()

    def end(self) -> None:
        """The turn is over: answer every request still open for the client, and take no new one."""
        self.closing = True
        for scope in self.relays:
            scope.cancel()

    def take(self, req_id: Id, method: str, params: dict[str, Any]) -> tuple[int, str] | None:
        """Relay one request of the agent's (its params naming our session), or answer it for the client.

        Returns:
            ``None`` when it is (being) answered, else the code and message to refuse it with.
        """
        if self.closing:
            answer_abandoned(self.child, req_id, method, "the prompt turn has ended")
            return None
        client = self.turn.client
        if client is None:
            return -32603, f"{method}: the client that sent the prompt has disconnected"
        capability, advertised = RELAYED_METHODS[method]
        if not advertised(client.capabilities):
            return -32601, f"Method not found: the client did not advertise the {capability} capability"
        # Registered before the task starts, so a turn ending meanwhile still reaches it.
        scope = trio.CancelScope()
        self.relays.add(scope)
        self.nursery.start_soon(self._relay, req_id, method, params, client, scope)
        return None

    async def _relay(
        self, req_id: Id, method: str, params: dict[str, Any], client: ClientChannel, scope: trio.CancelScope
    ) -> None:
        child = self.child
        try:
            with scope:
                try:
                    result = await client.request(method, params)
                except ClientRequestError as exc:
                    child.respond_error(req_id, _error_object(exc.error))
                except ClientGoneError:
                    answer_abandoned(child, req_id, method, "the client disconnected")
                except Exception:
                    log.exception("relaying %s to the client failed", method)
                    failed = {"code": -32603, "message": f"acp-server failed to relay {method}"}
                    child.respond_error(req_id, failed)
                else:
                    child.respond(req_id, result)
                return
            answer_abandoned(child, req_id, method, "the prompt turn has ended")
        finally:
            self.relays.discard(scope)
