"""Durable sessions: the SQLite store, its writer process, schema migrations and the state directory's lock."""

from .lock import StateDirLocked, StateLock
from .records import SERVER_RESTARTED, TURN_STATE, StoredEvent, StoredSession
from .schema import SCHEMA_VERSION, StoreVersionError
from .session_store import DB_NAME, SessionStore, StoreWriterError, default_state_dir

__all__ = [
    "DB_NAME",
    "SCHEMA_VERSION",
    "SERVER_RESTARTED",
    "TURN_STATE",
    "SessionStore",
    "StateDirLocked",
    "StateLock",
    "StoreVersionError",
    "StoreWriterError",
    "StoredEvent",
    "StoredSession",
    "default_state_dir",
]
