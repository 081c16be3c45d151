"""A raw NDJSON ACP agent that writes lines no SDK would: nested too deep, truncated, not UTF-8.

Run it as ``python tests/agents/raw_agent.py``. ``initialize`` and ``session/new`` answer plainly; a
prompt's text picks what it writes before its ``ok `` chunk and ``end_turn`` answer:

deep-update    a ``session/update`` nested 5,000 levels deep
bad-utf8       a ``session/update`` whose text holds a byte that is not UTF-8
truncated      half of a ``session/update`` line
nested-N       a chunk ``n `` whose ``_meta`` nests N levels deep
deep-answer    no chunk: the prompt's answer itself is nested 5,000 levels deep
anything else  nothing more
"""

from __future__ import annotations

import json
import sys

DEPTH = 5000


def write(data: bytes) -> None:
    sys.stdout.buffer.write(data + b"\n")
    sys.stdout.buffer.flush()


def update(session_id: str, text: str) -> bytes:
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {
                "sessionId": session_id,
                "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}},
            },
        }
    ).encode()


def main() -> None:
    sessions = 0
    for raw in sys.stdin.buffer:
        msg = json.loads(raw)
        method, id = msg.get("method"), msg.get("id")
        if id is None:
            continue  # notifications (session/cancel) and answers
        if method == "initialize":
            result: object = {"protocolVersion": 1, "agentCapabilities": {}, "authMethods": []}
        elif method == "session/new":
            sessions += 1
            result = {"sessionId": f"raw-{sessions}"}
        elif method == "session/prompt":
            sid = msg["params"]["sessionId"]
            text = "".join(b.get("text", "") for b in msg["params"]["prompt"])
            if text == "deep-answer":
                deep = b"[" * DEPTH + b"]" * DEPTH
                write(b'{"jsonrpc":"2.0","id":' + json.dumps(id).encode() + b',"result":{"stopReason":' + deep + b"}}")
                continue
            if text == "deep-update":
                write(
                    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"' + sid.encode()
                    + b'","update":' + b'{"a":' * DEPTH + b"1" + b"}" * DEPTH + b"}}"
                )
            elif text.startswith("nested-"):
                depth = int(text.removeprefix("nested-"))
                write(update(sid, "n ").replace(b'"text":"n "}', b'"text":"n "},"_meta":' + b"[" * depth + b"]" * depth))
            elif text == "bad-utf8":
                write(update(sid, "X").replace(b'"X"', b'"\xff\xfe"'))
            elif text == "truncated":
                write(update(sid, "cut")[:40])
            write(update(sid, "ok "))
            result = {"stopReason": "end_turn"}
        else:
            write(json.dumps({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "no"}}).encode())
            continue
        write(json.dumps({"jsonrpc": "2.0", "id": id, "result": result}).encode())


if __name__ == "__main__":
    main()
