"""The REST API's event side: one SSE subscriber as a bridge ``Peer``, and the cuts that turn the bridge's
own lines into their frames without decoding them (the envelope and its general translation are
:mod:`.rest_envelope`; the channel a REST prompt's agent asks its permission questions on is
:mod:`.rest_permissions`).

A subscriber (:class:`SseSubscriber`) is attached to its session with the bridge's own calls
(``replay`` then live fan-out), so it receives exactly the NDJSON lines an ACP connection receives,
each turned into qwen's envelope (:func:`~.rest_envelope.envelope`); a live update sent to it alone
comes as its parts instead (:meth:`SseSubscriber.send_update`), and its frame is the one of its line.
Its frames are queued, bounded and written by :class:`~.rest_queue.FrameQueue` (the slow reader's
warning and eviction are there).
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any

import trio

from ...bridge.fanout import encode_update
from .rest_envelope import (
    EVENT_TYPES,
    _event,
    _update_frames,
    control_event,
    encode_frame,
    envelope,
    envelopes,
)
from .rest_queue import FrameQueue

if TYPE_CHECKING:
    from ...auth.tokens import Identity

__all__ = ["EVENT_TYPES", "SseSubscriber", "control_event", "encode_frame", "envelope", "envelopes", "frames_of"]

#: REST peers' ids stay clear of the socket shells' (small counters).
_ids = itertools.count(1 << 40)
#: an originating client id no update comes from (see ``SseSubscriber._fast_originator``)
_NOBODY = object()


#: a ``session/update`` line as the bridge writes it (``fanout.encode_update``): these first bytes, the
#: session id (plain: :data:`_PLAIN_ID`) and ``","update":``, the update's JSON, then the line's last
#: :data:`_UPDATE_META` (the bridge's: the update's own come before it) and :data:`_UPDATE_TAIL`; no
#: carriage return or line feed but the last (JSON allows them as whitespace; SSE reads them as line
#: ends). It is cut with byte searches: a regular expression over the whole line steps through every
#: byte of the update, which costs several times more.
_UPDATE_PREFIX = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"'
_UPDATE_META = b',"_meta":{"eventId":'
_META_LEN = len(_UPDATE_META)
_PLAIN_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
#: the session id and the update's key, after :data:`_UPDATE_PREFIX`
_UPDATE_SESSION = re.compile(rb'[A-Za-z0-9._:-]{1,128}","update":')
#: the line's end after its last :data:`_UPDATE_META`: 1, the event id; 2, the originating client id's member
_UPDATE_TAIL = re.compile(rb'([1-9][0-9]{0,15})(,"originatorClientId":"[A-Za-z0-9._:-]{1,128}")?\}\}\}\n?')
#: :data:`_UPDATE_TAIL` after its event id: 1, the originating client id's member
_TAIL_END = re.compile(rb'(,"originatorClientId":"[A-Za-z0-9._:-]{1,128}")?\}\}\}\n?')
_DIGITS = b"0123456789"
#: the first event id past :data:`_UPDATE_TAIL`'s 16 digits
_MAX_CUT_ID = 10**16
#: the most line ends (:data:`_TAIL_END`) a subscriber keeps
_TAIL_ENDS_KEPT = 64
_FRAME_HEAD = b'\nevent: session_update\ndata: {"v":1,"type":"session_update","data":{"sessionId":"'
#: a turn state line as the bridge writes it (``fanout.turn_state``): these first bytes, the session id,
#: ``","promptId":"``, then :data:`_TURN_REST`; only the terminal states become frames
_TURN_PREFIX = b'{"jsonrpc":"2.0","method":"_acp_server/turn_state","params":{"sessionId":"'
_TURN_HEAD = re.compile(rb'[^"\\]*","promptId":"')
#: from the prompt id: 1, the prompt id; 2, the state
_TURN_REST = re.compile(rb'([^"\\]*)","state":"([a-z_]+)"')
_TERMINAL = frozenset((b"completed", b"cancelled", b"failed"))
#: a completed turn's line from its ``"at"``, when its reason needs no escaping: 1, the stop reason
#: (none: ``end_turn``); 2, the event id
_COMPLETED_REST = re.compile(
    rb',"at":-?[0-9]{1,20}(?:,"reason":"([A-Za-z0-9_]{1,64})")?(?:,"positionHint":-?[0-9]{1,20})?'
    rb',"_meta":\{"eventId":([1-9][0-9]{0,15})(?:,"originatorClientId":"[A-Za-z0-9._:-]{1,128}")?\}\}\}\n?'
)

#: a completed turn's line from its prompt id, when :func:`_cut_turn` cuts it (a plain prompt id, then
#: :data:`_COMPLETED_REST`), in one match: 1, the prompt id; 2, the stop reason; 3, the event id
_COMPLETED_FROM_PROMPT = re.compile(rb'([A-Za-z0-9._:-]{1,128})","state":"completed"' + _COMPLETED_REST.pattern)

_Frames = list[tuple[int | None, bytes]]
#: the characters of a plain id (:data:`_PLAIN_ID`), for ``str.strip``
_PLAIN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"
_PLAIN_REASON = re.compile(r"[A-Za-z0-9_]{1,64}")
#: stop reasons -> their bytes in a ``turn_complete`` frame (``None``: not what the cut takes), as met
_reasons: dict[str, bytes | None] = {}


def _reason_of(reason: str) -> bytes | None:
    """``reason`` as :data:`_COMPLETED_REST` takes it (``[A-Za-z0-9_]{1,64}``), or ``None``; kept."""
    stop = reason.encode() if _PLAIN_REASON.fullmatch(reason) and reason.isascii() else None
    if len(_reasons) >= _TAIL_ENDS_KEPT:
        _reasons.clear()
    _reasons[reason] = stop
    return stop


def _cut_update(line: bytes, start: int, head: bytes) -> _Frames | None:
    """The frame of a ``session/update`` line whose update's JSON starts at ``start`` (the bytes
    before it checked by the caller), ``head`` being the frame's bytes up to the same point; ``None``
    when the rest of the line is not the bridge's layout."""
    cut = line.rfind(_UPDATE_META)
    if cut < start:
        return None
    tail = _UPDATE_TAIL.fullmatch(line, cut + len(_UPDATE_META))
    if tail is None or line.find(b"\r") >= 0 or line.find(b"\n", 0, cut) >= 0:
        return None
    digits = tail[1]
    # the update's JSON as the line has it, between the envelope's parts
    frame = b"".join((b"id: ", digits, head, line[start:cut], b'},"_meta":{"eventId":', digits, b'},"id":', digits,
                      tail[2] or b"", b"}\n\n"))
    return [(int(digits), frame)]


def _bridge_update_frame(line: bytes) -> _Frames | None:
    """The frame of a ``session/update`` line in the bridge's own layout (:func:`~acp_server.bridge.fanout.encode_update`:
    session id, the update's JSON, then ``_meta`` with the event id and maybe the originating client id),
    cut from the line's bytes without decoding it; ``None`` for any other line. The frame is the one
    :func:`_update_frames` writes, byte for byte (a test holds them equal)."""
    if not line.startswith(_UPDATE_PREFIX):
        return None
    session = _UPDATE_SESSION.match(line, len(_UPDATE_PREFIX))
    if session is None:
        return None
    return _cut_update(line, session.end(), _FRAME_HEAD + line[len(_UPDATE_PREFIX):session.end()])


def _cut_turn(line: bytes, start: int, session_id: bytes | None) -> _Frames | None:
    """The frames of a turn state line of ``session_id`` whose prompt id starts at ``start`` (the bytes
    before it checked by the caller): none for a state that is not terminal, ``turn_complete`` cut from
    the bytes of a completed turn's line whose ids and reason need no escaping (the frame :func:`envelopes`
    encodes, byte for byte: a test holds them equal), the general translation for the other terminal
    ones (and any of a session id that is not plain: ``session_id`` ``None``); ``None`` for a line of
    another layout."""
    rest = _TURN_REST.match(line, start)
    if rest is None:
        return None
    state = rest[2]
    if state not in _TERMINAL:
        return []
    done = _COMPLETED_REST.fullmatch(line, rest.end()) if state == b"completed" else None
    if done is None or session_id is None or _PLAIN_ID.fullmatch(rest[1]) is None:
        return [(event.get("id"), encode_frame(event)) for event in envelopes(line)]
    digits = done[2]
    frame = b"".join((
        b"id: ", digits, b'\nevent: turn_complete\ndata: {"v":1,"type":"turn_complete","data":{"sessionId":"', session_id,
        b'","stopReason":"', done[1] or b"end_turn", b'","promptId":"', rest[1], b'"},"_meta":{"eventId":', digits,
        b'},"id":', digits, b"}\n\n",
    ))
    return [(int(digits), frame)]


def _turn_frames(line: bytes) -> _Frames | None:
    """:func:`_cut_turn` of a turn state line of any session; ``None`` for any other line."""
    if not line.startswith(_TURN_PREFIX):
        return None
    head = _TURN_HEAD.match(line, len(_TURN_PREFIX))
    if head is None:
        return None
    session_id = line[len(_TURN_PREFIX):head.end() - len(b'","promptId":"')]
    return _cut_turn(line, head.end(), session_id if _PLAIN_ID.fullmatch(session_id) else None)


_last_line: tuple[bytes, _Frames] = (b"", [])
#: the last run of lines :func:`_lines_of` split, and its lines
_last_split: tuple[bytes, list[bytes]] = (b"", [])


def _lines_of(data: bytes) -> list[bytes]:
    """The NDJSON lines of ``data``, each with its line feed: the bridge sends a run of lines in one
    ``send`` when it holds them for a store's commit (``fanout.CommitFanOut``), and each is a message of
    its own, as an ACP connection's client reads them. The last run split is kept: every subscriber of
    the session is sent the same run."""
    global _last_split
    if _last_split[0] is data:
        return _last_split[1]
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    _last_split = (data, lines)
    return lines
#: the last update line :meth:`SseSubscriber.send` cut: the line, its event id's digits and its frame
_last_update: tuple[bytes, bytes, bytes] = (b"", b"", b"")


def frames_of(line: bytes) -> list[tuple[int | None, bytes]]:
    """The encoded SSE frames of one bridge line, each with the event id it carries. The bridge sends
    one line object to every subscriber of a session, so the last line's frames are kept: a fan-out to
    N subscribers translates and encodes once. A turn state that is not terminal has no frame, which
    its first bytes tell."""
    global _last_line
    if _last_line[0] is line:
        return _last_line[1]
    frames = _bridge_update_frame(line)
    if frames is None:
        frames = _turn_frames(line)
        if frames is None:
            frames = _update_frames(line)
            if frames is None:
                frames = [(event.get("id"), encode_frame(event)) for event in envelopes(line)]
    _last_line = (line, frames)
    return frames


class SseSubscriber(FrameQueue):
    """One ``GET /session/:id/events`` stream as the bridge's ``Peer`` (see the module docstring): a
    :class:`~.rest_queue.FrameQueue` fed with the frames of the bridge's lines.

    Args:
        session_id: the session it watches.
        max_frames: frames its queue holds before it is evicted.
        max_bytes: bytes its queue holds before it is evicted.
    """

    def __init__(self, session_id: str, *, max_frames: int = 256, max_bytes: int = 2 * 1024 * 1024) -> None:
        super().__init__(session_id, max_frames=max_frames, max_bytes=max_bytes)
        self.peer_id = next(_ids)
        #: the token the stream was opened with (evicted with it: :meth:`evict`)
        self.identity: Identity | None = None
        # the first bytes of this session's update and turn state lines in the bridge's layout, and of an
        # update's frame: its lines are cut without a search for the session id (one that is not plain
        # takes :func:`frames_of`, whose patterns it never matches)
        sid = session_id.encode()
        plain = _PLAIN_ID.fullmatch(sid) is not None
        self._sid = sid
        self._update_head = _UPDATE_PREFIX + sid + b'","update":' if plain else b"\n"
        self._frame_head = _FRAME_HEAD + sid + b'","update":'
        self._turn_head = _TURN_PREFIX + sid + b'","promptId":"' if plain else b"\n"
        self._update_start = len(self._update_head)
        self._turn_start = len(self._turn_head)
        self._turn_frame_head = b'\nevent: turn_complete\ndata: {"v":1,"type":"turn_complete","data":{"sessionId":"' + sid + b'","stopReason":"'
        #: the ends of update lines after their event id seen already (:data:`_TAIL_END`) -> the
        #: originating client id's member (``b""``: none; ``None``: not the bridge's layout). A session's
        #: lines end alike (its prompts' client ids), so that most are a dictionary lookup.
        self._tail_ends: dict[bytes, bytes | None] = {}
        #: how the update lines end after their event id, as the last one cut did (its originating client
        #: id's member, then ``}}}\n``), and that member: a line that ends so is cut without looking at
        #: its end again
        self._end = b"}}}\n"
        self._end_len = len(self._end)
        self._member = b""
        #: the session id is plain: :meth:`send_update` builds an update's frame from its parts
        self._plain = plain
        #: originating client ids -> their member in a frame (``None``: not plain, the line's path decides)
        self._members: dict[str | None, bytes | None] = {None: b""}
        #: the last originating client id :meth:`send_update` met, and its frame's end (its member, then
        #: the frame's last bytes; ``None``: not plain)
        self._originator: str | None = None
        self._member_end: bytes | None = b"}\n\n"
        #: the originating client id whose updates :meth:`send_update` frames at once (the last one met,
        #: while the session id and it are plain and the stream is open; :data:`_NOBODY` otherwise), and
        #: its frame's end
        self._fast_originator: object = None if plain else _NOBODY
        self._fast_end = b"}\n\n"

    def _frames_of(self, line: bytes) -> _Frames:
        """:func:`frames_of` of a line, this session's update and turn state lines in the bridge's
        layout cut without searching their session id."""
        global _last_line
        head = self._update_head
        if line.startswith(head):
            frames = _cut_update(line, len(head), self._frame_head)
        elif line.startswith(self._turn_head):
            done = _COMPLETED_FROM_PROMPT.fullmatch(line, len(self._turn_head))
            if done is None:
                frames = _cut_turn(line, len(self._turn_head), self._sid)
            else:  # (what _cut_turn writes for it, in one match)
                prompt_id, reason, digits = done.groups()
                frames = [(int(digits), b"".join((
                    b"id: ", digits, b'\nevent: turn_complete\ndata: {"v":1,"type":"turn_complete","data":{"sessionId":"',
                    self._sid, b'","stopReason":"', reason or b"end_turn", b'","promptId":"', prompt_id,
                    b'"},"_meta":{"eventId":', digits, b'},"id":', digits, b"}\n\n",
                )))]
        else:
            frames = None
        if frames is None:
            return frames_of(line)
        _last_line = (line, frames)
        return frames

    def send(self, data: bytes) -> None:
        """The bridge's live fan-out: translate and queue (never waits). This session's update line in
        the bridge's layout, the usual one, is cut here (what :func:`_cut_update` does, without its list
        of one frame): a line that ends as the last one did (:attr:`_end`) has its event id's digits
        between its last ``_meta`` and that end, checked as :data:`_UPDATE_TAIL`'s ``[1-9][0-9]{0,15}``."""
        global _last_update
        last = _last_update
        if last[0] is data:  # another subscriber of the session cut this line already
            self._last_id = last[1]
            self._queue(last[2])
            return
        if data.startswith(self._update_head) and data.endswith(self._end):
            cut = data.rfind(_UPDATE_META)
            digits = data[cut + _META_LEN:len(data) - self._end_len]
            if (cut >= self._update_start and digits.isdigit() and len(digits) <= 16 and digits[0] != 48
                    and data.find(b"\r") < 0 and data.find(b"\n", 0, cut) < 0):
                frame = b"".join((b"id: ", digits, self._frame_head, data[self._update_start:cut], b'},"_meta":{"eventId":',
                                  digits, b'},"id":', digits, self._member, b"}\n\n"))
                _last_update = (data, digits, frame)
                self._last_id = digits
                self._queue(frame)
                return
        elif data.startswith(self._turn_head):  # a completed turn's line, as _frames_of cuts it
            done = _COMPLETED_FROM_PROMPT.fullmatch(data, self._turn_start)
            if done is not None:
                prompt_id, reason, digits = done.groups()
                frame = b"".join((b"id: ", digits, self._turn_frame_head, reason or b"end_turn", b'","promptId":"', prompt_id,
                                  b'"},"_meta":{"eventId":', digits, b'},"id":', digits, b"}\n\n"))
                _last_update = (data, digits, frame)
                self._last_id = digits
                self._queue(frame)
                return
        self._send_line(data)

    def send_update(self, event_id: int, body: bytes, originator: str | None) -> None:
        """The bridge's live update to this subscriber alone, as its parts (``fanout.FanOut.update_sinks``):
        queues the frame :meth:`send` cuts from its line (``fanout.encode_update``), built from them. The
        update's JSON is msgspec's (no line feed or carriage return); an event id past 16 digits, a
        session id or an originating client id that is not plain take the line's path. The usual update
        (the same originating client id as the last, the queue below its warning) is framed and queued
        here; any other goes through :meth:`_send_update`."""
        if originator is not self._fast_originator or event_id >= _MAX_CUT_ID:
            self._send_update(event_id, body, originator)
            return
        digits = b"%d" % event_id  # (once: a join of the parts costs less than a format of three ints)
        frame = b"".join((b"id: ", digits, self._frame_head, body, b'},"_meta":{"eventId":', digits, b'},"id":', digits,
                          self._fast_end))
        size = self.nbytes + len(frame)
        frames = self.frames
        if len(frames) >= self._fast_frames or size >= self._warn_bytes:
            self._last_id = event_id
            self.push(frame)
            return
        self._last_id = event_id
        frames.append(frame)
        self.nbytes = size
        if self._waiting:
            self._wake()

    def _send_update(self, event_id: int, body: bytes, originator: str | None) -> None:
        """:meth:`send_update` of an update its first test does not take: another originating client id
        (learnt here), a closed stream, a session id that is not plain, a long event id."""
        if originator is self._originator:
            end = self._member_end
        else:
            member = self._members.get(originator, b"-")
            if member == b"-":
                member = self._member_of(originator)
            end = None if member is None else member + b"}\n\n"
            self._originator, self._member_end = originator, end
        if end is None or not self._plain or event_id >= _MAX_CUT_ID:
            self.send(encode_update(self.session_id, event_id, body, originator))
            return
        if not self._closed:
            self._fast_originator, self._fast_end = originator, end
        self._last_id = event_id
        digits = b"%d" % event_id
        self._queue(b"".join((b"id: ", digits, self._frame_head, body, b'},"_meta":{"eventId":', digits, b'},"id":', digits, end)))

    def close(self) -> None:
        """End the stream once what is queued is written (its later live updates are dropped by :meth:`push`)."""
        self._fast_originator = _NOBODY
        super().close()

    def send_completed(self, prompt_id: str, reason: str, event_id: int, originator: str | None) -> bool:
        """The bridge's completed turn to this subscriber alone, as its parts (``fanout.FanOut.completed_sinks``):
        queues the ``turn_complete`` frame :meth:`send` cuts from its line (``_COMPLETED_FROM_PROMPT``),
        built from them. ``False`` (nothing done: send the line) for what that cut does not take: a
        prompt id, stop reason, session id or originating client id that is not plain, an event id past
        16 digits."""
        if event_id >= _MAX_CUT_ID or not 0 < len(prompt_id) <= 128 or prompt_id.strip(_PLAIN_CHARS):
            return False
        stop = _reasons.get(reason, b"-")
        if stop == b"-":
            stop = _reason_of(reason)
        if stop is None:
            return False
        if originator is not self._fast_originator:  # (that one's member is plain, as the session id)
            if not self._plain:
                return False
            if originator is self._originator:
                if self._member_end is None:
                    return False
            else:
                member = self._members.get(originator, b"-")
                if member == b"-":
                    member = self._member_of(originator)
                if member is None:
                    return False
        digits = b"%d" % event_id
        self._last_id = event_id
        self._queue(b"".join((b"id: ", digits, self._turn_frame_head, stop, b'","promptId":"', prompt_id.encode(),
                              b'"},"_meta":{"eventId":', digits, b'},"id":', digits, b"}\n\n")))
        return True

    def _member_of(self, originator: str | None) -> bytes | None:
        """The ``originatorClientId`` member of ``originator``'s frames (``None``: not plain), kept."""
        raw = (originator or "").encode()
        member = b',"originatorClientId":"%s"' % raw if _PLAIN_ID.fullmatch(raw) else None
        if len(self._members) >= _TAIL_ENDS_KEPT:
            self._members = {None: b""}
        self._members[originator] = member
        return member

    def _send_line(self, data: bytes) -> None:
        """:meth:`send` of a line its first cut does not take: an update line that ends otherwise than
        the last one (its end learnt here: :attr:`_end`), a turn state, any other line."""
        global _last_line
        last = _last_line
        if last[0] is data:
            frames = last[1]
        elif -1 < data.find(b"\n") < len(data) - 1:
            for line in _lines_of(data):
                self.send(line)
            return
        elif data.startswith(self._update_head) and data.find(b"\r") < 0:
            # the line's end after its last ``_meta``: the event id's digits (as _UPDATE_TAIL's
            # ``[1-9][0-9]{0,15}``), then an end seen before or checked once against _TAIL_END
            cut = data.rfind(_UPDATE_META)
            tail = data[cut + _META_LEN:]
            end = tail.lstrip(_DIGITS)
            width = len(tail) - len(end)
            member = self._tail_ends.get(end, b"-")
            if member == b"-":
                member = self._tail_end(end)
            if (member is None or cut < self._update_start or not 0 < width <= 16 or tail[0] == 48
                    or data.find(b"\n", 0, cut) >= 0):
                frames = frames_of(data)
            else:
                digits = tail[:width]
                frame = b"".join((b"id: ", digits, self._frame_head, data[self._update_start:cut], b'},"_meta":{"eventId":',
                                  digits, b'},"id":', digits, member, b"}\n\n"))
                if end.endswith(b"}}}\n"):
                    self._end, self._end_len, self._member = end, len(end), member
                number = int(digits)
                _last_line = (data, [(number, frame)])
                self.last_event_id = number
                self._queue(frame)
                return
        else:
            frames = self._frames_of(data)
        for event_id, frame in frames:
            if event_id is not None:
                self.last_event_id = event_id
            self._queue(frame)

    def _tail_end(self, end: bytes) -> bytes | None:
        """The originating client id's member of an update line's ``end`` (:data:`_TAIL_END`; ``b""``
        without one, ``None``: not the bridge's layout), kept for the lines after it."""
        found = _TAIL_END.fullmatch(end)
        member = None if found is None else found[1] or b""
        if len(self._tail_ends) >= _TAIL_ENDS_KEPT:
            self._tail_ends.clear()
        self._tail_ends[end] = member
        return member

    async def send_reliably(self, data: bytes) -> None:
        """A replayed line: waits while the queue is at half its bound instead of evicting."""
        frames = frames_of(data)
        if not frames:
            return
        while not self._closed and (len(self.frames) * 2 >= self.max_frames or self.nbytes * 2 >= self.max_bytes):
            await self.wait_for_room()
        for event_id, frame in frames:
            self.push_frame(event_id, frame)

    def session_ended(self, session_id: str) -> None:
        """The bridge closed the session (``DELETE``, an ACP ``session/close``, ``session/delete``):
        one ``session_closed``, then the stream ends."""
        self.push_event(_event("session_closed", {"sessionId": session_id, "reason": "client_close"}))
        self.close()

    async def request(self, method: str, params: Any = None) -> Any:
        """A subscriber is never asked directly (permissions go through :class:`RestChannel`)."""
        raise trio.EndOfChannel
