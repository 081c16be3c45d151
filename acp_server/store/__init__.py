"""Durable sessions: the SQLite store, its writer process, schema migrations and the state directory's lock.

The records and the lock load with the package; the store itself (and ``sqlite3`` with it) loads on
first use of one of its names, so that a server without a state directory never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .lock import StateDirLocked, StateLock
from .records import SERVER_RESTARTED, TURN_STATE, StoredEvent, StoredSession

if TYPE_CHECKING:
    from .schema import SCHEMA_VERSION, StoreVersionError
    from .session_store import DB_NAME, SessionStore, StoreWriterError, default_state_dir

#: name -> the module that defines it, loaded on first access (PEP 562)
_LAZY = {
    "SCHEMA_VERSION": ".schema",
    "StoreVersionError": ".schema",
    "DB_NAME": ".session_store",
    "SessionStore": ".session_store",
    "StoreWriterError": ".session_store",
    "default_state_dir": ".session_store",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

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
