"""One session as the client holds it: its id, ``cwd`` and server-given client id; prompts with a local
pending-prompt guard, self-heal of a stale client id, retries, and cancellation of one request.

The guard reserves a slot per prompt before anything is sent and releases it when the outcome is
known: a result, an error answer, the answer to a cancel, the connection's end, or an answer that
cannot be decoded. A prompt whose caller is cancelled keeps its slot until the server answers the
``$/cancel_request`` (the server still counts it until then).

Self-heal: when a prompt's admission answers ``invalid_client_id`` (the id expired or was detached),
or ``session_not_established`` (an ``/acp`` connection that has not loaded or resumed the session),
the session re-registers with ``session/resume`` without a client id, takes the new id, and sends the
prompt again, once, in the same slot. That is safe because an admission error means it never ran.
Concurrent prompts share one resume; a failed resume is raised to all of them and forgotten, so a
later prompt tries again.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..errors import InvalidClientIdError, SessionNotEstablishedError
from ..types.acp import PromptResult
from .connection import Call, Id
from .errors import ClientError, ConnectionLostError, PendingPromptLimitError, ProtocolError, RpcError
from .retry import Attempt, RetryPolicy, new_idempotency_key, retrying
from .updates import UpdateStream

if TYPE_CHECKING:
    from .client import Client

__all__ = ["PromptCall", "PromptInput", "SessionClient", "client_id_of"]

#: Refusals a ``session/resume`` cures: a stale client id, and (over ``/acp``) a session used on an
#: HTTP connection before it was established there (a new connection after a restart).
_HEALED_BY_RESUME = frozenset({InvalidClientIdError.kind, SessionNotEstablishedError.kind})

log = logging.getLogger("acp_server.client")

#: What a prompt may be given as: a text, or content blocks (dicts, or the Structs of ``acp_server.types.acp``).
PromptInput = str | Sequence[Mapping[str, Any] | msgspec.Struct]


def client_id_of(result: Any, method: str) -> str:
    """``_meta.clientId`` of a session result.

    Raises:
        ProtocolError: the result carries none.
    """
    meta = result.get("_meta") if isinstance(result, dict) else None
    client_id = meta.get("clientId") if isinstance(meta, dict) else None
    if not isinstance(client_id, str) or not client_id:
        raise ProtocolError(f"the {method} result carries no _meta.clientId: {result!r}")
    return client_id


def _blocks(prompt: PromptInput) -> list[Any]:
    if isinstance(prompt, str):
        return [{"type": "text", "text": prompt}]
    return [msgspec.to_builtins(block) if isinstance(block, msgspec.Struct) else dict(block) for block in prompt]


class _Slot:
    """One reserved pending-prompt slot of a session; released exactly once."""

    __slots__ = ("_handed_off", "_held", "_session")

    def __init__(self, session: SessionClient) -> None:
        self._session = session
        self._held = True
        self._handed_off = False

    def release(self) -> None:
        if self._held:
            self._held = False
            self._session._pending -= 1

    def hand_off(self, call: Call) -> None:
        """The caller leaves: ``call``'s answer (or the connection's end) releases the slot."""
        self._handed_off = True
        call.when_done(self.release)

    def release_by_caller(self) -> None:
        if not self._handed_off:
            self.release()


class _Heal:
    """One shared ``session/resume`` after a stale client id."""

    __slots__ = ("done", "error", "new_id")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: ClientError | None = None
        self.new_id: str | None = None


class SessionClient:
    """A session held through one :class:`~acp_server.client.Client` (made by its ``new_session``,
    ``load_session``, ``resume_session`` or ``use_session``). Every call carries ``_meta.clientId``.

    Attributes:
        session_id: the session.
        cwd: its working directory (sent again by a self-heal's resume).
        client_id: the id the server gave this client (replaced by a self-heal).
        result: the result of the call that made it (``modes`` and so on), if any.
        on_self_heal: ``on_self_heal(old_id, new_id)`` after each self-heal (from the client by default).
        self_heals: how many self-heals have replaced :attr:`client_id`.
    """

    def __init__(
        self,
        client: Client,
        session_id: str,
        cwd: str,
        client_id: str | None,
        *,
        result: dict[str, Any] | None = None,
    ) -> None:
        self._client = client
        self._conn = client.connection
        self.session_id = session_id
        self.cwd = cwd
        self.client_id = client_id
        self.result = result
        self.on_self_heal: Callable[[str | None, str], None] | None = client.on_self_heal
        self.self_heals = 0
        self._pending = 0
        self._heal: _Heal | None = None
        self._updates = self._conn.updates(session_id)

    def __repr__(self) -> str:
        return f"SessionClient({self.session_id!r}, client_id={self.client_id!r}, pending={self._pending})"

    # --- state ---------------------------------------------------------------------------------------

    @property
    def updates(self) -> UpdateStream:
        """This session's ``session/update`` notifications, as an async iterator."""
        return self._updates

    @property
    def pending_prompts(self) -> int:
        """Prompts of this client holding a slot (sent and not yet answered)."""
        return self._pending

    @property
    def prompt_limit(self) -> int | None:
        """The local pending-prompt limit (``None``: disabled); see ``connect(max_pending_prompts=...)``."""
        return self._client.max_pending_prompts

    def _meta(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        meta = dict(extra or {})
        if self.client_id is not None:
            meta["clientId"] = self.client_id
        return meta

    def _params(self, **fields: Any) -> dict[str, Any]:
        return {"sessionId": self.session_id, **fields, "_meta": self._meta()}

    # --- prompts -------------------------------------------------------------------------------------

    def prompt_call(
        self,
        prompt: PromptInput,
        *,
        retry: RetryPolicy | None = None,
        budget_s: float | None = None,
        meta: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> PromptCall:
        """A prompt ready to :meth:`~PromptCall.run`, which another task may :meth:`~PromptCall.cancel`.

        Args: as :meth:`prompt`.
        """
        return PromptCall(self, prompt, retry=retry, budget_s=budget_s, meta=meta, idempotency_key=idempotency_key)

    async def prompt(
        self,
        prompt: PromptInput,
        *,
        retry: RetryPolicy | None = None,
        budget_s: float | None = None,
        meta: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> PromptResult:
        """Send a prompt and wait for its stop reason (its updates stream through :attr:`updates`).

        Cancelling the caller sends ``$/cancel_request`` for the request in flight (not ``session/cancel``,
        which would end other clients' prompts too); the slot stays reserved until the server answers.

        Args:
            prompt: a text, or content blocks.
            retry: retry refusals for capacity (``None``: one attempt); see :func:`retrying`.
            budget_s: the time budget in seconds, sent as ``_meta.deadlineMs`` (the server enforces it) and
                bounding retry waits; an enclosing trio deadline counts too.
            meta: more ``_meta`` keys (ours, ``clientId``, ``idempotencyKey``, ``deadlineMs``, win).
            idempotency_key: the key every attempt carries (default: a fresh one per call).

        Raises:
            PendingPromptLimitError: the local guard is full (nothing sent) or the server's queue is.
            RpcError: the server's error (after self-heal and retries, where they apply).
            ConnectionLostError, ProtocolError: no usable answer.
        """
        call = self.prompt_call(prompt, retry=retry, budget_s=budget_s, meta=meta, idempotency_key=idempotency_key)
        return await call.run()

    def _reserve(self) -> _Slot:
        limit = self.prompt_limit
        if limit is not None and self._pending >= limit:
            raise PendingPromptLimitError(self.session_id, limit, self._pending)
        self._pending += 1
        return _Slot(self)

    async def _self_heal(self, stale: str | None) -> None:
        """Make sure :attr:`client_id` is no longer ``stale``: join the resume in progress or start one.

        Raises:
            ClientError: the resume's own error.
        """
        if self.client_id != stale:
            return  # another prompt's resume already replaced it
        heal = self._heal
        if heal is None:
            heal = self._heal = _Heal()
            # In the connection's nursery: a waiter's cancellation must not fail the others' resume.
            self._conn.nursery.start_soon(self._resume, heal)
        await heal.done.wait()
        if heal.error is not None:
            raise heal.error

    async def _resume(self, heal: _Heal) -> None:
        try:
            # No clientId: asking for the stale id back is what failed; the server mints a fresh one.
            result = await self._conn.call("session/resume", {"sessionId": self.session_id, "cwd": self.cwd})
            new_id = client_id_of(result, "session/resume")
        except ClientError as exc:
            heal.error = exc
        else:
            old_id, self.client_id = self.client_id, new_id
            heal.new_id = new_id
            self.self_heals += 1
            log.info("session %s: client id %s was stale; re-registered as %s", self.session_id, old_id, new_id)
            if self.on_self_heal is not None:
                try:
                    self.on_self_heal(old_id, new_id)
                except Exception:
                    log.exception("on_self_heal callback failed")
        finally:
            if heal.error is None and heal.new_id is None:
                heal.error = ConnectionLostError("the client closed during the resume")
            self._heal = None
            heal.done.set()

    # --- the other session calls ---------------------------------------------------------------------

    def cancel(self) -> None:
        """``session/cancel``: ends the session's running and queued prompts, other clients' included.

        To stop one prompt of your own, cancel its caller or :meth:`PromptCall.cancel` instead.
        """
        self._conn.notify("session/cancel", self._params())

    async def close(self) -> None:
        """``session/close``: the session ends for every client; its update stream ends here."""
        await self._conn.call("session/close", self._params())
        self._conn.close_updates(self.session_id)

    async def detach(self) -> None:
        """``_acp_server/detach``: give up this client id (and the updates, unless held otherwise)."""
        await self._conn.call("_acp_server/detach", self._params())

    async def heartbeat(self) -> dict[str, Any]:
        """``_acp_server/heartbeat``: keep the client id alive; returns ``lastSeenAt`` and the ids."""
        result = await self._conn.call("_acp_server/heartbeat", self._params())
        return result if isinstance(result, dict) else {}

    async def set_mode(self, mode_id: str) -> None:
        """``session/set_mode``."""
        await self._conn.call("session/set_mode", self._params(modeId=mode_id))

    async def fork(self) -> SessionClient:
        """``_acp_server/fork``: a new session branched from this one's history, held by this client."""
        result = await self._conn.call("_acp_server/fork", self._params())
        session_id = result.get("sessionId") if isinstance(result, dict) else None
        if not isinstance(session_id, str):
            raise ProtocolError(f"the _acp_server/fork result carries no sessionId: {result!r}")
        return SessionClient(
            self._client, session_id, self.cwd, client_id_of(result, "_acp_server/fork"), result=result
        )


class PromptCall:
    """One logical prompt (its attempts, retries and self-heal), run once by :meth:`run`.

    :meth:`cancel` may be called from any task: the request in flight gets ``$/cancel_request`` and
    :meth:`run` still returns the server's answer to it (a ``cancelled`` stop reason, or raises
    ``request_cancelled``); no further attempt or resume is made. Cancelled while nothing is in flight,
    :meth:`run` raises a local ``request_cancelled`` :class:`RpcError`.

    Attributes:
        idempotency_key: carried by every attempt as ``_meta.idempotencyKey``.
        attempts: ``session/prompt`` requests sent so far.
        on_retry: ``on_retry(error, next_attempt, wait_s)`` before each wait between attempts.
    """

    def __init__(
        self,
        session: SessionClient,
        prompt: PromptInput,
        *,
        retry: RetryPolicy | None,
        budget_s: float | None,
        meta: Mapping[str, Any] | None,
        idempotency_key: str | None,
    ) -> None:
        if budget_s is not None and (isinstance(budget_s, bool) or not budget_s > 0):
            raise ValueError(f"budget_s must be a positive number of seconds; got {budget_s!r}")
        self.session = session
        self.idempotency_key = idempotency_key or new_idempotency_key()
        self.attempts = 0
        self._blocks = _blocks(prompt)
        self._retry = retry or RetryPolicy(max_attempts=1)
        self._budget_s = budget_s
        self._meta = dict(meta or {})
        self._cancelled = False
        self._started = False
        self._inflight: Call | None = None
        self._waits: set[trio.CancelScope] = set()
        self.on_retry: Callable[[ClientError, int, float], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def request_id(self) -> Id | None:
        """The JSON-RPC id of the attempt in flight, if one is."""
        return self._inflight.id if self._inflight is not None else None

    def cancel(self) -> None:
        """Ask the server to cancel this prompt (``$/cancel_request``); no more attempts are made."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._inflight is not None:
            self.session._conn.cancel_request(self._inflight)
        for scope in self._waits:
            scope.cancel()

    async def run(self) -> PromptResult:
        """Run the prompt to its outcome (see :meth:`SessionClient.prompt`)."""
        if self._started:
            raise RuntimeError("a PromptCall runs once; make another with SessionClient.prompt_call")
        self._started = True
        await trio.lowlevel.checkpoint_if_cancelled()  # a caller already cancelled takes no slot, sends nothing
        self._check_cancelled()
        deadline = math.inf if self._budget_s is None else trio.current_time() + self._budget_s
        return await retrying(
            self._attempt,
            self._retry,
            deadline=deadline,
            idempotency_key=self.idempotency_key,
            sleep=self._sleep,
            on_retry=self.on_retry,
        )

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise RpcError.cancelled_locally("session/prompt", "the prompt was cancelled while none of it was in flight")

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """A wait that :meth:`cancel` ends (then the local ``request_cancelled`` is raised)."""
        scope = trio.CancelScope()
        self._waits.add(scope)
        try:
            with scope:
                yield
        finally:
            self._waits.discard(scope)
        self._check_cancelled()

    async def _sleep(self, seconds: float) -> None:
        self._check_cancelled()
        with self._interruptible():
            await trio.sleep(seconds)

    async def _attempt(self, attempt: Attempt) -> PromptResult:
        self._check_cancelled()
        await trio.lowlevel.checkpoint_if_cancelled()
        session = self.session
        slot = session._reserve()
        try:
            healed = False
            while True:
                sent_id = session.client_id
                try:
                    return await self._send(attempt, sent_id, slot)
                except RpcError as exc:
                    if exc.kind not in _HEALED_BY_RESUME or healed or self._cancelled:
                        raise
                healed = True  # at most one resume and one resend per attempt: no loop
                with self._interruptible():
                    await session._self_heal(sent_id)
                await trio.lowlevel.checkpoint_if_cancelled()
        finally:
            slot.release_by_caller()

    async def _send(self, attempt: Attempt, client_id: str | None, slot: _Slot) -> PromptResult:
        conn = self.session._conn
        meta = dict(self._meta)
        meta["idempotencyKey"] = attempt.idempotency_key
        if client_id is not None:
            meta["clientId"] = client_id
        remaining = attempt.remaining_ms()
        if remaining is not None:
            meta["deadlineMs"] = remaining
        call = conn.start_call(
            "session/prompt", {"sessionId": self.session.session_id, "prompt": self._blocks, "_meta": meta}
        )
        self.attempts += 1
        self._inflight = call
        try:
            await call.done.wait()
        except trio.Cancelled:
            conn.cancel_request(call)
            slot.hand_off(call)  # released when the server answers the cancel (or the connection ends)
            raise
        finally:
            self._inflight = None
        result = call.outcome()
        try:
            return msgspec.convert(result, PromptResult)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"undecodable session/prompt result {result!r}: {exc}") from None
