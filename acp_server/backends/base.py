"""What the session bridge needs of an agent backend, as a small Protocol.

A backend never learns who the client is. For each prompt it gets a :class:`Turn`: the session id, the
prompt's content blocks, ``emit`` to stream ``session/update`` payloads, and ``client``, a narrow channel
to the connection that sent the prompt (for an agent's own requests: permission, fs, terminal), or
``None`` when that connection is gone. It returns a stop reason.

Session lifecycle calls (``open_session``, ``close_session``, ``set_mode``, ``fork``) let a backend
that fronts a real agent keep the agent's sessions in step with ours; the echo agent ignores them. A
turn is cancelled by trio cancellation of :meth:`Backend.prompt` (its deadline passed, its prompt was
cancelled, or the session closed): the backend tells its agent (``session/cancel``) itself.
Errors a backend raises are :class:`~acp_server.errors.AcpError` subclasses (``backend_unavailable``,
``agent_error``, ``auth_required``), so they reach the client with their own ``errorKind``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import trio

from ..errors import InvalidParamsError
from ..types.acp import ClientCapabilities, ContentBlock, StopReason

__all__ = [
    "Backend",
    "BaseBackend",
    "ClientChannel",
    "ClientRequestError",
    "ClientGoneError",
    "PermitControl",
    "SessionSetup",
    "Turn",
]


class ClientChannel(Protocol):
    """The connection that sent the running prompt, as a backend may address it."""

    @property
    def capabilities(self) -> ClientCapabilities:
        """What the client advertised at ``initialize`` (only those requests may be relayed)."""
        ...

    async def request(self, method: str, params: Any) -> Any:
        """Send a request to the client and return its result.

        Raises:
            ClientRequestError: the client answered with an error (``.error`` is its error object).
            ClientGoneError: the connection closed before it answered.
        """
        ...


class ClientRequestError(Exception):
    """The client answered a relayed request with an error."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "client error"))
        self.error = error


class ClientGoneError(Exception):
    """The client connection closed before it answered a relayed request (not the client SDK's
    :class:`~acp_server.client.ConnectionLostError`, which is about its own connection to the server)."""


class PermitControl(Protocol):
    """The backend pool's permit of a running prompt, for a backend that calls its dependency more than
    once per prompt (a model endpoint: retries, tool rounds) and must not hold the permit in between.

    The bridge takes the permit before :meth:`Backend.prompt` and releases whatever is still held
    after it; a backend may release it meanwhile and take it again (FIFO behind other prompts) before
    its next call. :class:`~acp_server.admission.pool.Lease` is one.
    """

    @property
    def holds_permit(self) -> bool:
        """True while the permit is held."""
        ...

    def release_permit(self) -> None:
        """Give the permit back (to the oldest waiter, if any)."""
        ...

    async def acquire_permit(self) -> None:
        """Take the permit again, waiting in FIFO order."""
        ...


#: the transcript of a session before the running prompt: ``(None, update)`` for each ``session/update``
#: payload, ``(method, params)`` for each extension notification kept (the terminal turn states)
TranscriptEntry = tuple[str | None, Any]


class SessionSetup:
    """What a backend returns when it opens a session: modes and extra result fields to pass on."""

    __slots__ = ("config_options", "meta", "modes")

    def __init__(
        self,
        modes: dict[str, Any] | None = None,
        config_options: list[dict[str, Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.modes = modes
        self.config_options = config_options
        self.meta = meta


class Turn:
    """One prompt as a backend sees it.

    Attributes:
        session_id: the bridge's session id.
        prompt_id: the server's id of this prompt.
        prompt: the content blocks sent by the client.
        emit: call with a session update (a Struct such as ``AgentMessageChunk``, or a dict) to stream it
            to every attached client; updates emitted after the prompt settled are dropped.
        client: the prompt's sender, for relaying the agent's requests; ``None`` once it is gone.
        meta: the request's ``_meta`` without our own keys (passed through to an agent).
        permit: the backend pool's permit, ``None`` when the backend has no pool.
        deadline: when the prompt's deadline passes on trio's clock (``None``: it has none).
        transcript: returns the session's transcript before this prompt (read back from the store
            when it is not in memory); ``None`` when the bridge keeps none.
        result_meta: keys a backend adds to the result's ``_meta`` (usage, context trimming).
    """

    __slots__ = (
        "client", "deadline", "emit", "meta", "permit", "prompt", "prompt_id", "result_meta", "session_id",
        "transcript",
    )

    def __init__(
        self,
        session_id: str,
        prompt_id: str,
        prompt: Sequence[ContentBlock],
        emit: Callable[[Any], None],
        client: ClientChannel | None = None,
        meta: dict[str, Any] | None = None,
        *,
        permit: PermitControl | None = None,
        deadline: float | None = None,
        transcript: Callable[[], Awaitable[list[TranscriptEntry]]] | None = None,
    ) -> None:
        self.session_id = session_id
        self.prompt_id = prompt_id
        self.prompt = prompt
        self.emit = emit
        self.client = client
        self.meta = meta
        self.permit = permit
        self.deadline = deadline
        self.transcript = transcript
        self.result_meta: dict[str, Any] = {}


@runtime_checkable
class Backend(Protocol):
    """An agent the bridge can put turns on.

    A backend may also have ``start_prompt(turn) -> StopReason | Awaitable[StopReason]``: the turn's
    synchronous start, which the bridge calls instead of :meth:`prompt` when the turn can start in
    the step that admitted it (nothing queued before it). It returns the stop reason of a turn it
    ended already, or what to await for the rest (awaited under the turn's cancel scope, as
    :meth:`prompt` is). What runs in it must not wait: the echo agent's whole turn, an agent
    process's request written to its queue.
    """

    name: str

    async def open_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        meta: dict[str, Any] | None = None,
    ) -> SessionSetup:
        """Create the agent's side of a new session; ``emit`` streams updates outside any turn, and
        ``meta`` is the request's ``_meta`` without our own keys (passed on to an agent)."""
        ...

    async def prompt(self, turn: Turn) -> StopReason:
        """Run one turn to its end; trio cancellation means it was cancelled (or its deadline passed)."""
        ...

    async def set_mode(self, session_id: str, mode_id: str) -> None:
        """Change the session's mode (``session/set_mode``)."""
        ...

    async def set_config_option(self, session_id: str, config_id: str, value: Any) -> dict[str, Any]:
        """Set one of the session's config options (``session/set_config_option``); returns the
        agent's result (``configOptions``)."""
        ...

    async def close_session(self, session_id: str) -> None:
        """The session ended; release the agent's side of it."""
        ...

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        """Make ``new_session_id`` a branch of ``source_session_id`` (the bridge copies the history)."""
        ...


class BaseBackend:
    """Defaults for the optional parts of :class:`Backend`: a backend with no agent-side session state.

    Subclasses implement :meth:`prompt`; everything else is a no-op that still checkpoints.
    """

    name: str = "backend"

    async def open_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        meta: dict[str, Any] | None = None,
    ) -> SessionSetup:
        await trio.lowlevel.checkpoint()
        return SessionSetup()

    async def prompt(self, turn: Turn) -> StopReason:
        raise NotImplementedError

    async def set_mode(self, session_id: str, mode_id: str) -> None:
        await trio.lowlevel.checkpoint()

    async def set_config_option(self, session_id: str, config_id: str, value: Any) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        raise InvalidParamsError(path="configId", detail=f"unknown config option {config_id!r}; this agent has none")

    async def close_session(self, session_id: str) -> None:
        await trio.lowlevel.checkpoint()

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        await trio.lowlevel.checkpoint()
