"""What an ACP agent child sends us, routed to our sessions: its ``session/update`` notifications and
its requests of the client (:class:`ChildMessages`, a part of
:class:`~acp_server.backends.acp_agent.AcpAgentBackend`), and :class:`AgentSession`, one of our
sessions as the child knows it.

An update goes to the running turn's ``emit``, or to the session's own outside a turn (none while
``session/load`` replays history); a request the client may be asked (:data:`RELAYED_METHODS`) is
relayed through the running turn, anything else is refused to the child at once. A message longer
than the clients accept fails the turn it belongs to and is never relayed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..errors import AgentError
from ..jsonrpc import Notification, Request
from .agent_process import AgentProcess, decode_params
from .agent_relay import RELAYED_METHODS, TurnRelay

__all__ = ["AgentSession", "ChildMessages"]

#: the backend's logger (these lines were its own before the split, and keep its name)
log = logging.getLogger("acp_server.backends.acp_agent")


class AgentSession:
    """One of our sessions on the child: its id there, the turn running on it, where updates go between turns."""

    __slots__ = ("attach_lock", "child", "child_sid", "cwd", "emit", "id", "loading", "mcp_servers", "run")

    def __init__(
        self, id: str, cwd: str, mcp_servers: list[dict[str, Any]], emit: Callable[[Any], None] | None
    ) -> None:
        self.id = id
        self.cwd = cwd
        self.mcp_servers = mcp_servers
        self.emit = emit
        self.child: AgentProcess | None = None
        self.child_sid: str | None = None
        self.run: TurnRelay | None = None
        self.loading = False  # session/load replays history as updates: not news for anyone
        self.attach_lock = trio.Lock()


class ChildMessages:
    """The child's messages to us, for :class:`~acp_server.backends.acp_agent.AcpAgentBackend` (which
    defines the attributes below and hands these methods to each child it spawns)."""

    name: str
    #: the clients' ``--max-message-bytes`` (``None``: no bound)
    relay_max_bytes: int | None
    #: the current child's session id -> our session
    _routes: dict[str, AgentSession]

    def _too_large(self, child: AgentProcess, method: str, params: Any) -> bool:
        """Whether ``params`` exceed what a client accepts; if so its turn fails (see ``relay_max_bytes``)."""
        limit = self.relay_max_bytes
        if limit is None or params is None or len(params) <= limit:
            return False
        error = AgentError(
            backend_id=self.name,
            agent_code=-32600,
            agent_message=f"the agent sent a {method} of {len(params)} bytes, over the {limit} bytes a client accepts",
            reason="message_too_large",
        )
        session_id = self._session_id_in(params)
        session = self._routes.get(session_id) if session_id is not None else None
        run = session.run if session is not None else None
        if session is not None and run is not None and run.child is child:
            log.warning("backend %s: %s; failing the prompt of %s", self.name, error.message, session.id)
            run.fail(error)
        else:
            log.warning("backend %s: %s outside a prompt turn; dropped", self.name, error.message)
        return True

    @staticmethod
    def _session_id_in(params: Any) -> str | None:
        """The ``sessionId`` of a large message, read without decoding all of it."""
        head = bytes(memoryview(params)[:4096])
        marker = head.find(b'"sessionId"')
        if marker < 0:
            decoded = decode_params(params)
            sid = decoded.get("sessionId") if isinstance(decoded, dict) else None
            return sid if isinstance(sid, str) else None
        rest = head[marker + len(b'"sessionId"') :].lstrip(b" \t\r\n:")
        if not rest.startswith(b'"'):
            return None
        end = rest.find(b'"', 1)
        return rest[1:end].decode("utf-8", "replace") if end > 0 else None

    def _on_child_notification(self, child: AgentProcess, note: Notification) -> None:
        if note.method != "session/update":
            log.debug("backend %s: ignoring %s from the agent", self.name, note.method)
            return
        if self._too_large(child, note.method, note.params):
            return
        params = decode_params(note.params)
        if not isinstance(params, dict) or not isinstance(params.get("update"), dict):
            log.warning("backend %s: dropping a malformed session/update", self.name)
            return
        child_sid = params.get("sessionId")
        session = self._routes.get(child_sid) if isinstance(child_sid, str) else None
        if session is None or session.child is not child:
            log.debug("backend %s: dropping an update of unknown session %r", self.name, child_sid)
            return
        if session.loading:
            return
        run = session.run
        emit = run.turn.emit if run is not None and run.child is child else session.emit
        if emit is None:
            return
        try:
            emit(params["update"])
        except Exception:
            log.exception("backend %s: emitting an update of %s failed", self.name, session.id)

    def _on_child_request(self, child: AgentProcess, req: Request) -> None:
        if req.method in RELAYED_METHODS and self._too_large(child, req.method, req.params):
            child.respond_error(req.id, {"code": -32600, "message": f"{req.method} is too large to relay"})
            return
        refusal = self._take_request(child, req)
        if refusal is not None:
            code, message = refusal
            log.info("backend %s: refused %s from the agent: %s", self.name, req.method, message)
            child.respond_error(req.id, {"code": code, "message": message})

    def _take_request(self, child: AgentProcess, req: Request) -> tuple[int, str] | None:
        """Start relaying ``req``, or answer it for the client; else the refusal's code and message."""
        method = req.method
        if method not in RELAYED_METHODS:
            return -32601, f'Method not found: acp-server does not relay "{method}" to its clients'
        params = decode_params(req.params)
        child_sid = params.get("sessionId") if isinstance(params, dict) else None
        if not isinstance(params, dict) or not isinstance(child_sid, str):
            return -32602, f"Invalid params: {method} needs an object with a string sessionId"
        session = self._routes.get(child_sid)
        if session is None or session.child is not child:
            return -32603, f'{method} names session "{child_sid}", which acp-server does not know'
        run = session.run
        if run is None or run.child is not child:
            return -32603, f"{method} arrived outside a prompt turn of the session: there is no client to ask"
        return run.take(req.id, method, {**params, "sessionId": session.id})
