"""What the store keeps, and the frames that carry it to the writer process (no trio, no SQLite here).

The records of a round travel grouped by table, as the writer inserts them (so neither side handles
one record at a time more than it must). A round is a list of *ops*, each a tuple whose first item is
its kind:

- ``(EVENTS, {session_id: [event_id, method | None, body_json, event_id, ...]})``: transcript entries
- ``(ADMITS, [seq, prompt_id, session_id, seq, ...])``: admitted prompts
- ``(SETTLES, [seq, outcome, seq, ...])``: terminal outcomes (the first one of a prompt wins)
- ``(SESSION, id, cwd, backend, title, created_ms, updated_ms, mcp_servers_json, backend_state_json | None, tenant)``
- ``(DELETE, session_id)``
- ``(READ, read_id, session_id, after, upto)``: the transcript entries with ``after < eventId <= upto``

Within a run of EVENTS/ADMITS/SETTLES the tables are independent; the other ops are barriers: what
was queued before one is written before it.

A round travels as a header (payload length, round id, flags: :data:`READS` when it holds a read) and
its ops in MessagePack, which the writer logs as they are and decodes later. The writer answers each
group of rounds it made durable in one transaction with a frame ``[last_round_id, error | None,
reads]`` (a 4-byte big-endian length, then MessagePack), reads being ``[[read_id, [[event_id, method,
body_json], ...]], ...]``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "ADMITS",
    "DELETE",
    "EVENTS",
    "READ",
    "READS",
    "SERVER_RESTARTED",
    "SESSION",
    "SETTLES",
    "TURN_STATE",
    "FrameReader",
    "RoundReader",
    "StoredEvent",
    "StoredSession",
    "decode_ops",
    "encode_frame",
    "encode_ops",
    "encode_round",
]

#: the extension notification marking a prompt's turn (the server's restart included)
TURN_STATE = "_acp_server/turn_state"
#: the terminal outcome of a prompt the server could not finish
SERVER_RESTARTED = "server_restarted"

SESSION, EVENTS, ADMITS, SETTLES, DELETE, READ = range(6)

_HEADER = struct.Struct(">I")
#: a round's header: payload length, round id, flags
_ROUND = struct.Struct(">IIB")
#: round flag: it reads, so it must be applied at once (not only logged)
READS = 1
encode_ops = msgspec.msgpack.Encoder().encode
decode_ops = msgspec.msgpack.Decoder().decode


def encode_round(round_id: int, flags: int, ops: list[tuple[Any, ...]]) -> bytes:
    """A round as the server sends it: the header, then its ops in MessagePack (left encoded by the
    writer until it applies them)."""
    body = encode_ops(ops)
    return _ROUND.pack(len(body), round_id, flags) + body


def encode_frame(message: Any) -> bytes:
    """An answer of the writer: its length, then MessagePack."""
    body = encode_ops(message)
    return _HEADER.pack(len(body)) + body


class _Splitter:
    """Splits a byte stream into frames of ``header`` (whose first field is the payload length)."""

    def __init__(self, header: struct.Struct) -> None:
        self._header = header
        self._buffer = bytearray()

    def _split(self, data: bytes | bytearray) -> list[tuple[tuple[Any, ...], bytes]]:
        buffer = self._buffer
        buffer += data
        header = self._header
        frames = []
        start = 0
        while len(buffer) - start >= header.size:
            fields = header.unpack_from(buffer, start)
            end = start + header.size + fields[0]
            if end > len(buffer):
                break
            frames.append((fields, bytes(buffer[start + header.size : end])))
            start = end
        if start:
            del buffer[:start]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame."""
        return len(self._buffer)


class FrameReader(_Splitter):
    """The writer's answers out of a byte stream, decoded (sans-I/O: ``feed`` bytes, get the complete ones)."""

    def __init__(self) -> None:
        super().__init__(_HEADER)

    def feed(self, data: bytes | bytearray) -> list[Any]:
        return [decode_ops(payload) for _, payload in self._split(data)]


class RoundReader(_Splitter):
    """Rounds out of a byte stream, as (round id, flags, encoded ops)."""

    def __init__(self) -> None:
        super().__init__(_ROUND)

    def feed(self, data: bytes | bytearray) -> list[tuple[int, int, bytes]]:
        return [(fields[1], fields[2], payload) for fields, payload in self._split(data)]


@dataclass(slots=True)
class StoredSession:
    """A session's metadata, as the in-memory index (loaded at startup) and the ``sessions`` table hold it."""

    session_id: str
    cwd: str
    backend: str
    created_ms: int
    updated_ms: int
    mcp_servers: list[dict[str, Any]] = field(default_factory=list)
    title: str | None = None
    #: the id the next event of the session gets
    next_event_id: int = 1
    #: what a backend needs to re-open the session in its agent (e.g. the agent's own session id)
    backend_state: dict[str, Any] | None = None
    #: the tenant that created the session (``initialize`` ``_meta.tenantId``)
    tenant: str = "default"


class StoredEvent(msgspec.Struct, frozen=True, gc=False):
    """One transcript entry: ``method`` None for a ``session/update`` (``body``: the update), else an
    extension notification (``body``: its params without sessionId and _meta).

    A Struct: every terminal turn state makes one (a frozen dataclass took ~5,600 instructions to
    build, this ~650), and none holds a container, so the collector need not track them.
    """

    event_id: int
    method: str | None
    body: msgspec.Raw
