"""ACP v1 messages (protocolVersion 1) as msgspec Structs: the params we read and the results we send.

Reading is lenient where the official SDK is terse: fields equal to their schema default may be absent.
Unknown fields are ignored, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .base import Meta, Wire, meta_field

__all__ = [
    "AgentCapabilities",
    "AgentMessageChunk",
    "AudioContent",
    "AuthenticateParams",
    "CancelParams",
    "CancelRequestParams",
    "ClientCapabilities",
    "CloseSessionParams",
    "ContentBlock",
    "EmbeddedResource",
    "FileSystemCapability",
    "ImageContent",
    "Implementation",
    "InitializeParams",
    "InitializeResult",
    "ListSessionsParams",
    "ListSessionsResult",
    "LoadSessionParams",
    "NewSessionParams",
    "NewSessionResult",
    "PromptCapabilities",
    "PromptParams",
    "PromptResult",
    "ResourceLink",
    "SessionCapabilities",
    "SessionIdParams",
    "SessionInfo",
    "SessionMode",
    "SessionModeState",
    "SessionNotification",
    "SessionUpdate",
    "SetConfigOptionParams",
    "SetSessionModeParams",
    "TextContent",
    "UserMessageChunk",
]

PROTOCOL_VERSION = 1

#: The longest session id read (ours are 37 characters; a longer one cannot name a session).
MAX_SESSION_ID_CHARS = 256
#: The largest integer of the ACP schema's ``int64`` fields.
INT64_MAX = 2**63 - 1

SessionId = Annotated[str, msgspec.Meta(max_length=MAX_SESSION_ID_CHARS)]

StopReason = Literal["end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"]


# --- content blocks (tagged on "type") -------------------------------------------------------------


# gc=False (content blocks, session updates): plain data decoded from JSON or built by a backend, which
# never takes part in a reference cycle; the collector does not track them. A session's history holds
# its updates for the server's lifetime: tracked, they made every young-generation collection that
# promoted them walk them again (5-12 ms pauses at 8 busy sessions), and every full collection too.
class _Block(Wire, tag_field="type", kw_only=True, gc=False):
    annotations: dict[str, Any] | None = None
    meta: Meta = meta_field()


class TextContent(_Block, tag="text", kw_only=True):
    text: str


class ImageContent(_Block, tag="image", kw_only=True):
    data: str
    mime_type: str
    uri: str | None = None


class AudioContent(_Block, tag="audio", kw_only=True):
    data: str
    mime_type: str


class ResourceLink(_Block, tag="resource_link", kw_only=True):
    uri: str
    name: str
    title: str | None = None
    description: str | None = None
    mime_type: str | None = None
    size: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None


class EmbeddedResource(_Block, tag="resource", kw_only=True):
    resource: dict[str, Any]


ContentBlock = TextContent | ImageContent | AudioContent | ResourceLink | EmbeddedResource


# --- initialize / authenticate ---------------------------------------------------------------------


class FileSystemCapability(Wire, kw_only=True):
    read_text_file: bool = False
    write_text_file: bool = False
    meta: Meta = meta_field()


class ClientCapabilities(Wire, kw_only=True):
    fs: FileSystemCapability = msgspec.field(default_factory=FileSystemCapability)
    terminal: bool = False
    #: ElicitationCapabilities (``form``/``url``) when the client takes ``elicitation/create``
    elicitation: dict[str, Any] | None = None
    meta: Meta = meta_field()


class Implementation(Wire, kw_only=True):
    name: str
    version: str
    title: str | None = None


class InitializeParams(Wire, kw_only=True):
    protocol_version: Annotated[int, msgspec.Meta(ge=0, le=65535)] = PROTOCOL_VERSION  # uint16 in the schema
    client_capabilities: ClientCapabilities = msgspec.field(default_factory=ClientCapabilities)
    client_info: Implementation | None = None
    meta: Meta = meta_field()


class PromptCapabilities(Wire, omit_defaults=False, kw_only=True):
    image: bool = False
    audio: bool = False
    embedded_context: bool = False


class SessionCapabilities(Wire, kw_only=True):
    """Each present key names a session method that exists (the schema's ``{}`` capability objects)."""

    list: dict[str, Any] | None = None
    close: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    delete: dict[str, Any] | None = None


class AgentCapabilities(Wire, omit_defaults=False, kw_only=True):
    load_session: bool = False
    prompt_capabilities: PromptCapabilities = msgspec.field(default_factory=PromptCapabilities)
    session_capabilities: SessionCapabilities = msgspec.field(default_factory=SessionCapabilities)
    meta: Meta = meta_field()


class InitializeResult(Wire, kw_only=True):
    protocol_version: int
    agent_capabilities: AgentCapabilities
    agent_info: Implementation
    auth_methods: list[dict[str, Any]] = msgspec.field(default_factory=list)
    meta: Meta = meta_field()


class AuthenticateParams(Wire, kw_only=True):
    method_id: str
    meta: Meta = meta_field()


# --- sessions --------------------------------------------------------------------------------------


class NewSessionParams(Wire, kw_only=True):
    cwd: str
    mcp_servers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    additional_directories: list[str] = msgspec.field(default_factory=list)
    meta: Meta = meta_field()


class SessionMode(Wire, kw_only=True):
    id: str
    name: str
    description: str | None = None


class SessionModeState(Wire, kw_only=True):
    current_mode_id: str
    available_modes: list[SessionMode]


class NewSessionResult(Wire, kw_only=True):
    session_id: SessionId
    modes: SessionModeState | None = None
    meta: Meta = meta_field()


class SessionIdParams(Wire, kw_only=True):
    """Params of every request that names one session and nothing else (close, heartbeat, detach, fork)."""

    session_id: SessionId
    meta: Meta = meta_field()


class CloseSessionParams(SessionIdParams, kw_only=True):
    pass


class CancelParams(SessionIdParams, kw_only=True):
    pass


class LoadSessionParams(Wire, kw_only=True):
    """``session/load`` and ``session/resume`` (``mcpServers`` is ignored by resume)."""

    session_id: SessionId
    cwd: str
    mcp_servers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    meta: Meta = meta_field()


class SetSessionModeParams(Wire, kw_only=True):
    session_id: SessionId
    mode_id: str
    meta: Meta = meta_field()


class SetConfigOptionParams(Wire, kw_only=True):
    session_id: SessionId
    config_id: str
    value: str | bool
    meta: Meta = meta_field()


class ListSessionsParams(Wire, kw_only=True):
    cwd: str | None = None
    cursor: str | None = None
    meta: Meta = meta_field()


class SessionInfo(Wire, kw_only=True):
    session_id: SessionId
    cwd: str
    title: str | None = None
    updated_at: str | None = None
    meta: Meta = meta_field()


class ListSessionsResult(Wire, kw_only=True):
    sessions: list[SessionInfo]
    next_cursor: str | None = None


# --- prompts and updates ---------------------------------------------------------------------------


class PromptParams(Wire, kw_only=True):
    session_id: SessionId
    prompt: Annotated[list[ContentBlock], msgspec.Meta(min_length=1)]
    meta: Meta = meta_field()


class PromptResult(Wire, kw_only=True):
    stop_reason: StopReason
    meta: Meta = meta_field()


class _Update(Wire, tag_field="sessionUpdate", kw_only=True, gc=False):  # gc=False: see _Block
    meta: Meta = meta_field()


class AgentMessageChunk(_Update, tag="agent_message_chunk", kw_only=True):
    content: ContentBlock


class UserMessageChunk(_Update, tag="user_message_chunk", kw_only=True):
    content: ContentBlock


SessionUpdate = AgentMessageChunk | UserMessageChunk


class SessionNotification(Wire, kw_only=True):
    session_id: SessionId
    update: Any  # a SessionUpdate Struct, or an update dict relayed from an agent
    meta: Meta = meta_field()


class CancelRequestParams(Wire, kw_only=True):
    request_id: int | str
