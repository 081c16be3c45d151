"""Durable sessions: the SQLite store, its schema migrations and the state directory's lock."""

from .lock import StateDirLocked, StateLock
from .schema import SCHEMA_VERSION, StoreVersionError
from .sqlite import (
    DB_NAME,
    SERVER_RESTARTED,
    TURN_STATE,
    SessionStore,
    StoredEvent,
    StoredSession,
    default_state_dir,
)

__all__ = [
    "DB_NAME",
    "SCHEMA_VERSION",
    "SERVER_RESTARTED",
    "TURN_STATE",
    "SessionStore",
    "StateDirLocked",
    "StateLock",
    "StoreVersionError",
    "StoredEvent",
    "StoredSession",
    "default_state_dir",
]
