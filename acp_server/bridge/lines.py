"""A ``session/update`` line as the bridge writes it: one bytes format around the update's JSON.

Its own module so that the fan-out (every update it sends) and a prompt's ticket (its backend's
updates, :meth:`~.session.PromptTicket.emit`) format it alike; the HTTP transport cuts its frames from it.
"""

from __future__ import annotations

__all__ = ["UPDATE", "UPDATE_FROM", "encode_update"]


def encode_update(session_id: str, event_id: int, body: bytes, originator: str | None = None) -> bytes:
    """One ``session/update`` line: SessionNotification's shape around ``body`` (the update's JSON).

    ``originator``: the client id whose prompt caused it (``_meta.originatorClientId``); replays carry none.
    One bytes format per line (the ids are arguments: a ``%`` in them or in ``body`` is not read).
    """
    if originator is None:
        return UPDATE % (session_id.encode(), body, event_id)
    return UPDATE_FROM % (session_id.encode(), body, event_id, originator.encode())


UPDATE = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"%s","update":%s,"_meta":{"eventId":%d}}}\n'
UPDATE_FROM = (
    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"%s","update":%s,'
    b'"_meta":{"eventId":%d,"originatorClientId":"%s"}}}\n'
)
