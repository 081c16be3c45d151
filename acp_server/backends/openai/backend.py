"""A backend that fronts an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp's server,
Ollama, LM Studio, a hosted API): the model server becomes an ACP agent.

Each prompt is one or more streamed ``POST {base_url}/chat/completions`` calls (``stream: true``, read
as server-sent events by :mod:`.sse`): content deltas go to the client as ``agent_message_chunk``,
reasoning deltas as ``agent_thought_chunk``, tool calls as ``tool_call`` / ``tool_call_update`` and
run on the client (:mod:`.tools`), after which the model is called again with their results, at most
``max_tool_rounds`` calls per prompt. The ``finish_reason`` of the last call is the stop reason:
``stop`` -> ``end_turn``, ``length`` -> ``max_tokens``, ``content_filter`` -> ``refusal`` (none, or an
unknown one, -> ``end_turn``, logged).

The backend pool's permit (:attr:`~acp_server.backends.base.Turn.permit`) is held for one HTTP attempt
at a time: it is released during a backoff, while a tool runs or a permission is asked, and taken
again (FIFO) before the next attempt, so ``max_active`` bounds the requests at the model server at
every moment. Failed attempts are retried as :mod:`.retry` decides; the final failure is one error:
``backend_unavailable`` (``model_unreachable`` or ``model_error``, with ``attempts`` and the last
``status``), or ``agent_error`` with the HTTP status as ``agentCode`` for a 4xx the model server
will answer the same way again. ``session/cancel`` cancels the running call: the HTTP stream is
closed at once.

The conversation of each session lives in memory (:mod:`.request`); after a restart, a fork, or when
it was dropped, it is rebuilt from the session's transcript, which holds everything the model needs
back (``_meta.openai`` on tool-call updates). The API key is sent as ``Authorization: Bearer`` and
appears in no log line and no error (a server's message that repeats it is redacted).
"""

from __future__ import annotations

import codecs
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Final, cast

import httpx
import msgspec
import trio

from ...errors import AgentError, BackendUnavailableError
from ...types.acp import AgentMessageChunk, StopReason, TextContent
from ..base import BaseBackend, SessionSetup, Turn
from .request import (
    META_KEY,
    NOT_RUN,
    Message,
    TokenEstimate,
    close_turn,
    request_body,
    trim_turns,
    turns_from_transcript,
    user_message,
)
from .retry import RETRY_STATUSES, Failure, next_delay
from .sse import (
    ChunkReader,
    Done,
    Finish,
    ReasoningDelta,
    SseParser,
    StreamFailed,
    TextDelta,
    ToolCallAcc,
    ToolCallDelta,
    Usage,
)
from .tools import TOOL_KINDS, run_tool, tool_specs, tool_title

__all__ = ["OpenAIBackend", "stop_reason_of"]

log = logging.getLogger("acp_server.backends.openai")

_FINISH: Final[Mapping[str, StopReason]] = {"stop": "end_turn", "length": "max_tokens", "content_filter": "refusal"}
#: how long the end of the body may take after ``[DONE]`` before the connection is dropped
_AFTER_DONE_S: Final = 1.0
#: the most of an error answer's body read (for its message)
_ERROR_BODY_LIMIT: Final = 64 * 1024
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def stop_reason_of(finish_reason: str | None) -> StopReason:
    """The ACP stop reason of a call that ended with ``finish_reason`` and no tool call."""
    return _FINISH.get(finish_reason or "", "end_turn")


class _AttemptFailed(Exception):
    """One HTTP attempt failed in a way the retry policy decides about."""

    def __init__(self, failure: Failure, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.status = status
        self.detail = detail


@dataclass(slots=True)
class _Reply:
    """What one model call produced."""

    text: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallAcc] = field(default_factory=list)
    finish: str | None = None
    usage: Usage | None = None
    output_sent: bool = False


@dataclass(slots=True)
class _Conversation:
    """One session as the backend keeps it: ``turns`` is ``None`` until rebuilt from the transcript."""

    cwd: str
    turns: list[list[Message]] | None
    estimate: TokenEstimate = field(default_factory=TokenEstimate)


@dataclass(slots=True)
class OpenAIStatistics:
    """Counters of one backend, for ``/metrics`` (camelCase keys in the stats snapshot)."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    dropped_turns: int = 0

    def snapshot(self) -> dict[str, int]:
        """The counters with the stats snapshot's camelCase names."""
        return {
            "modelRequestsTotal": self.requests,
            "modelRetriesTotal": self.retries,
            "modelFailuresTotal": self.failures,
            "promptTokensTotal": self.prompt_tokens,
            "completionTokensTotal": self.completion_tokens,
            "droppedTurnsTotal": self.dropped_turns,
        }


def _error_message(raw: bytes, status: int) -> str:
    """The model server's message in an error answer's body (JSON ``error.message`` and kin, else text)."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        for candidate in (
            error.get("message") if isinstance(error, dict) else error,
            body.get("message"),
            body.get("detail"),
        ):
            if isinstance(candidate, str) and candidate:
                return candidate[:500]
    text = raw.decode(errors="replace").strip()
    return text[:500] if text else f"HTTP {status}"


class OpenAIBackend(BaseBackend):
    """An OpenAI-compatible chat-completions endpoint as an ACP agent.

    Args:
        name: the backend's id (in errors and logs).
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is added).
        model: the model name sent in each request.
        api_key: sent as ``Authorization: Bearer`` (``None``: no header).
        request_timeout_s: the longest silence on a connection (connect, first byte, between bytes).
        max_attempts: HTTP attempts per model call, the first included.
        system_prompt: put first in every request (``None``: none).
        extra_body: keys passed through in every request body.
        context_tokens: the model's window; longer conversations drop their oldest turns (``None``: never).
        images: the model takes image parts (else an image in a prompt is refused).
        max_tool_rounds: model calls per prompt; a prompt that would need more stops with ``max_turn_requests``.
    """

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        request_timeout_s: float = 300.0,
        max_attempts: int = 3,
        system_prompt: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        context_tokens: int | None = None,
        images: bool = False,
        max_tool_rounds: int = 16,
    ) -> None:
        if max_attempts < 1 or max_tool_rounds < 1:
            raise ValueError("max_attempts and max_tool_rounds must be at least 1")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.extra_body = dict(extra_body or {})
        self.context_tokens = context_tokens
        self.images = images
        self.max_tool_rounds = max_tool_rounds
        self.stats = OpenAIStatistics()
        self._api_key = api_key or None
        self._system: list[Message] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._url = self.base_url + "/chat/completions"
        self._client: httpx.AsyncClient | None = None
        self._sessions: dict[str, _Conversation] = {}

    def __repr__(self) -> str:
        return f"<OpenAIBackend {self.name!r} {self._url} model {self.model!r}>"

    # --- lifecycle ---------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        client = self._client
        if client is None:
            headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            timeout = httpx.Timeout(self.request_timeout_s, connect=min(10.0, self.request_timeout_s))
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = self._client = httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)
        return client

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the HTTP client's connection pool until cancelled (then close it)."""
        self._http()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            client, self._client = self._client, None
            if client is not None:
                with trio.CancelScope(shield=True):
                    await client.aclose()

    def statistics(self) -> dict[str, int]:
        """The backend's counters (requests, retries, failures, tokens), for the stats snapshot."""
        return self.stats.snapshot()

    def call_headers(self, turn: Turn) -> dict[str, str]:
        """Headers added to each HTTP attempt of ``turn``'s model calls.

        None today; this is where a per-call credential goes (a coordinator's fencing token carried in
        ``turn.meta``), so that every attempt, retries included, presents the current one.
        """
        return {}

    # --- sessions ------------------------------------------------------------------------------------

    async def open_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        meta: dict[str, Any] | None = None,
    ) -> SessionSetup:
        """A new, empty conversation; the model server is not called."""
        self._sessions[session_id] = _Conversation(cwd, [])
        await trio.lowlevel.checkpoint()
        return SessionSetup()

    def restore_session(
        self,
        session_id: str,
        cwd: str,
        mcp_servers: list[dict[str, Any]],
        emit: Callable[[Any], None],
        state: dict[str, Any] | None,
    ) -> None:
        """Know a stored session again; its conversation is rebuilt from its transcript at its next prompt."""
        self._sessions.setdefault(session_id, _Conversation(cwd, None))

    async def close_session(self, session_id: str) -> None:
        """Forget the session's conversation (its transcript stays in the store)."""
        self._sessions.pop(session_id, None)
        await trio.lowlevel.checkpoint()

    async def fork(self, source_session_id: str, new_session_id: str) -> None:
        """The branch rebuilds its conversation from the transcript the bridge copied."""
        source = self._sessions.get(source_session_id)
        self._sessions[new_session_id] = _Conversation(source.cwd if source else "/", None)
        await trio.lowlevel.checkpoint()

    async def _conversation(self, turn: Turn) -> tuple[_Conversation, list[list[Message]]]:
        conv = self._sessions.get(turn.session_id)
        if conv is None:
            conv = self._sessions[turn.session_id] = _Conversation("/", None)
        turns = conv.turns
        if turns is None:
            entries = await turn.transcript() if turn.transcript is not None else []
            turns = turns_from_transcript(entries, images=self.images)
            if conv.turns is None:
                conv.turns = turns
            turns = conv.turns
        return conv, turns

    # --- a prompt ------------------------------------------------------------------------------------

    def _budget(self) -> int | None:
        if self.context_tokens is None:
            return None
        reserve = self.extra_body.get("max_completion_tokens", self.extra_body.get("max_tokens"))
        if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
            reserve = self.context_tokens // 4
        return max(1, self.context_tokens - reserve)

    async def prompt(self, turn: Turn) -> StopReason:
        """Run one prompt: model calls and the tool rounds between them, at most ``max_tool_rounds`` calls.

        Raises:
            InvalidParamsError: a content block the model cannot take (before any call).
            BackendUnavailableError: a model call failed after its last attempt.
            AgentError: the model server refused the request (a 4xx other than 408, 409, 429).
        """
        user = user_message(turn.prompt, images=self.images)  # refuses what the model cannot take first
        conv, turns = await self._conversation(turn)
        messages_turn: list[Message] = [user]
        turns.append(messages_turn)
        tools = tool_specs(turn.client.capabilities if turn.client is not None else None)
        usage = [0, 0, 0]
        calls = 0
        dropped = 0
        try:
            while True:
                calls += 1
                messages, dropped = trim_turns(self._system, turns, self._budget(), conv.estimate)
                if dropped:
                    log.info("backend %s: prompt %s: %d oldest turns left out of the request", self.name,
                             turn.prompt_id, dropped)
                attempts: list[_Reply] = []
                try:
                    reply = await self._call(turn, request_body(self.model, messages, tools, self.extra_body), attempts)
                except BaseException:
                    # What the client saw of a call that did not finish (cancelled, cut) stays in the
                    # conversation, as it stays in the transcript: its text, never a half-streamed tool call.
                    if attempts and attempts[-1].text:
                        messages_turn.append({"role": "assistant", "content": "".join(attempts[-1].text)})
                    raise
                if reply.usage is not None:
                    usage[0] += reply.usage.prompt_tokens
                    usage[1] += reply.usage.completion_tokens
                    usage[2] += reply.usage.total_tokens
                    conv.estimate.observe(messages, reply.usage.prompt_tokens)
                assistant: Message = {"role": "assistant", "content": "".join(reply.text) or None}
                if reply.tool_calls:
                    assistant["tool_calls"] = [
                        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in reply.tool_calls
                    ]
                if reply.text or reply.tool_calls:
                    messages_turn.append(assistant)
                if not reply.tool_calls:
                    if reply.finish not in _FINISH:
                        log.warning("backend %s: prompt %s: the model's stream ended with finish_reason %r:"
                                    " end_turn", self.name, turn.prompt_id, reply.finish)
                    return stop_reason_of(reply.finish)
                if calls >= self.max_tool_rounds:
                    for call in reply.tool_calls:
                        self._tool_update(turn, call.call_id, "failed", [], NOT_RUN)
                    log.info("backend %s: prompt %s reached max_tool_rounds (%d model calls)", self.name,
                             turn.prompt_id, calls)
                    return "max_turn_requests"
                for call in reply.tool_calls:
                    if await self._run_tool(turn, conv, call, messages_turn):
                        return "cancelled"
        finally:
            close_turn(messages_turn)
            self.stats.prompt_tokens += usage[0]
            self.stats.completion_tokens += usage[1]
            self.stats.dropped_turns += dropped
            turn.result_meta.update(
                usage={"inputTokens": usage[0], "outputTokens": usage[1], "totalTokens": usage[2]},
                modelCalls=calls,
                droppedTurns=dropped,
            )

    # --- tools ---------------------------------------------------------------------------------------

    def _tool_update(
        self, turn: Turn, call_id: str, status: str, content: list[dict[str, Any]], result: str | None = None
    ) -> None:
        update: dict[str, Any] = {"sessionUpdate": "tool_call_update", "toolCallId": call_id, "status": status}
        if content:
            update["content"] = content
        if result is not None:
            update["rawOutput"] = {"result": result}
            update["_meta"] = {META_KEY: {"result": result}}
        turn.emit(update)

    async def _run_tool(
        self, turn: Turn, conv: _Conversation, call: ToolCallAcc, messages_turn: list[Message]
    ) -> bool:
        """Run one tool call (no permit held) and record its result; True when the turn was cancelled."""
        self._tool_update(turn, call.call_id, "in_progress", [])
        outcome = await run_tool(turn.client, turn.session_id, conv.cwd, call.call_id, call.name, call.arguments)
        messages_turn.append({"role": "tool", "tool_call_id": call.call_id, "content": outcome.result})
        self._tool_update(turn, call.call_id, outcome.status, outcome.content, outcome.result)
        return outcome.cancelled

    # --- one model call, with its retries ------------------------------------------------------------

    async def _call(self, turn: Turn, body: dict[str, Any], attempts: list[_Reply]) -> _Reply:
        """One model call: HTTP attempts under the permit, backoffs without it, as :func:`next_delay` says;
        each attempt's reply is appended to ``attempts`` as it begins."""
        payload = _encode(body)
        permit = turn.permit
        attempt = 0
        while True:
            attempt += 1
            if permit is not None and not permit.holds_permit:
                await permit.acquire_permit()
            self.stats.requests += 1
            failed: _AttemptFailed | None = None
            reply = _Reply()
            attempts.append(reply)
            try:
                await self._attempt(turn, payload, reply)
            except _AttemptFailed as exc:
                failed = exc
            finally:
                if permit is not None and permit.holds_permit:
                    permit.release_permit()
            if failed is None:
                log.info("backend %s: prompt %s attempt %d/%d: status 200", self.name, turn.prompt_id,
                         attempt, self.max_attempts)
                return reply
            delay = next_delay(
                attempt,
                failed.failure,
                max_attempts=self.max_attempts,
                now=trio.current_time(),
                deadline=turn.deadline,
                now_wall=time.time(),
            )
            log.warning(
                "backend %s: prompt %s attempt %d/%d failed: status %s (%s); %s",
                self.name, turn.prompt_id, attempt, self.max_attempts, failed.status, failed.detail,
                "giving up" if delay is None else f"retry in {delay:.3f} s",
            )
            if delay is None:
                self.stats.failures += 1
                raise BackendUnavailableError(
                    backend_id=self.name,
                    session_id=turn.session_id,
                    reason="model_error" if failed.failure.status is not None else "model_unreachable",
                    attempts=attempt,
                    status=failed.status,
                    detail=failed.detail,
                )
            self.stats.retries += 1
            await trio.sleep(delay)

    def _redact(self, text: str) -> str:
        key = self._api_key
        return text.replace(key, "[redacted]") if key and key in text else text

    async def _attempt(self, turn: Turn, payload: bytes, reply: _Reply) -> None:
        """One HTTP attempt, streamed to the client as it arrives and gathered into ``reply``."""
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            **self.call_headers(turn),
        }
        status: int | None = None
        try:
            async with self._http().stream("POST", self._url, content=payload, headers=headers) as response:
                status = response.status_code
                if not 200 <= status < 300:
                    raw = await response.aread()
                    message = self._redact(_error_message(raw[:_ERROR_BODY_LIMIT], status))
                    if 400 <= status < 500 and status not in RETRY_STATUSES:
                        self.stats.failures += 1
                        raise AgentError(backend_id=self.name, agent_code=status, agent_message=message)
                    answer = {k.lower(): v for k, v in response.headers.items()}
                    raise _AttemptFailed(Failure(status, answer), status, message)
                await self._read_stream(turn, response, reply)
        except httpx.TransportError as exc:
            if reply.output_sent:
                detail = "the stream broke after output was sent to the client (not retried)"
            elif status is not None:
                detail = "the stream broke before any output"
            else:
                detail = self._redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise _AttemptFailed(Failure(None, None, reply.output_sent), status, detail) from None

    async def _read_stream(self, turn: Turn, response: httpx.Response, reply: _Reply) -> None:
        parser = SseParser()
        reader = ChunkReader()
        # An uncompressed body (we ask for identity) is read raw: httpx's decoding layers cost a few
        # microseconds per delta for nothing. Read to the end even after [DONE] (which ends the body
        # in practice): leaving httpx's iterators half-way leaves its inner generators to the collector.
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        source = response.aiter_raw() if encoding in ("", "identity") else response.aiter_bytes()
        decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        with trio.CancelScope() as tail:
            async with aclosing(cast(AsyncGenerator[bytes, None], source)) as pieces:
                async for raw in pieces:
                    if not reader.done:
                        for data in parser.feed(decode(raw)):
                            self._events(turn, reader, data, reply)
                        if reader.done:  # a server that keeps the body open after [DONE] is left soon
                            tail.deadline = trio.current_time() + _AFTER_DONE_S
        if not reader.done:
            for data in parser.close():
                self._events(turn, reader, data, reply)
        reply.finish = reader.finish_reason
        reply.usage = reader.usage
        for call in sorted(reader.tool_calls.values(), key=lambda c: c.index):
            if not call.call_id:
                call.call_id = f"call_{uuid.uuid4().hex[:24]}"
            self._announce(turn, call, reply)
            try:
                args = _decode(call.arguments) if call.arguments.strip() else {}
            except msgspec.DecodeError:
                args = {}
            update: dict[str, Any] = {
                "sessionUpdate": "tool_call_update",
                "toolCallId": call.call_id,
                "title": tool_title(call.name, args if isinstance(args, dict) else {}),
                "rawInput": args,
                "_meta": {META_KEY: {"arguments": call.arguments}},
            }
            turn.emit(update)
            reply.tool_calls.append(call)

    def _announce(self, turn: Turn, call: ToolCallAcc, reply: _Reply) -> None:
        if call.announced or not call.call_id or not call.name:
            return
        call.announced = True
        reply.output_sent = True
        kind = TOOL_KINDS.get(call.name, ("other", False))[0]
        turn.emit({
            "sessionUpdate": "tool_call",
            "toolCallId": call.call_id,
            "title": call.name,
            "kind": kind,
            "status": "pending",
            "_meta": {META_KEY: {"name": call.name}},
        })

    def _events(self, turn: Turn, reader: ChunkReader, data: str, reply: _Reply) -> None:
        try:
            events = reader.feed(data)
        except ValueError as exc:
            raise _AttemptFailed(Failure(None, None, reply.output_sent), 200, str(exc)) from None
        emit = turn.emit
        for event in events:
            if isinstance(event, TextDelta):
                reply.output_sent = True
                reply.text.append(event.text)
                emit(AgentMessageChunk(content=TextContent(text=event.text)))
            elif isinstance(event, ReasoningDelta):
                reply.output_sent = True
                emit({"sessionUpdate": "agent_thought_chunk", "content": {"type": "text", "text": event.text}})
            elif isinstance(event, ToolCallDelta):
                self._announce(turn, reader.tool_calls[event.index], reply)
            elif isinstance(event, StreamFailed):
                detail = self._redact(f"the model server sent an error in the stream: {event.message}")
                raise _AttemptFailed(Failure(None, None, reply.output_sent), 200, detail)
            elif isinstance(event, Finish | Usage | Done):
                pass
