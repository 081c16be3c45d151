"""The web console's static files: ``GET /`` and ``GET /console/<file>`` from ``acp_server/web``.

The files are package data read once; nothing is built or fetched at run time. Every answer carries
a Content-Security-Policy that allows scripts, styles and connections only from this origin (the
page's WebSocket goes to ``/acp`` on the same host), so no inline script and no agent-provided markup
can run. ``Host`` and ``Origin`` are checked with the listener's rules, as for ``/acp``.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from ...errors import MethodNotAllowedError
from .rules import HostRules, error_body, header
from .streams import Send

__all__ = ["CONSOLE_PREFIX", "CSP", "serve_console"]

#: Where the console's assets live (``/`` is its page).
CONSOLE_PREFIX = "/console/"

#: No inline script or style, nothing from elsewhere, no framing.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)

_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
}


@cache
def _assets() -> dict[str, tuple[bytes, bytes]]:
    """``path -> (content type, body)`` for every file of ``acp_server/web`` (read once)."""
    out: dict[str, tuple[bytes, bytes]] = {}
    root = resources.files("acp_server.web")
    for entry in root.iterdir():
        suffix = entry.name[entry.name.rfind(".") :] if "." in entry.name else ""
        if entry.is_file() and suffix in _TYPES:
            out[CONSOLE_PREFIX + entry.name] = (_TYPES[suffix], entry.read_bytes())
    out["/"] = out[CONSOLE_PREFIX + "index.html"]
    return out


def _headers(content_type: bytes, length: int) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", content_type),
        (b"content-length", str(length).encode()),
        (b"content-security-policy", CSP.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"cache-control", b"no-cache"),
    ]


async def serve_console(scope: dict[str, Any], send: Send, rules: HostRules) -> bool:
    """Answer a request for the console's page or one of its assets; ``False`` if it is neither."""
    path = scope["path"]
    if path != "/" and not path.startswith(CONSOLE_PREFIX):
        return False
    headers = scope["headers"]
    method = scope["method"]
    asset = _assets().get(path)
    status, body, out = 200, b"", []
    host = header(headers, b"host")
    refusal = rules.check_host(host) or rules.check_origin(header(headers, b"origin"), host=host, scheme=scope.get("scheme"))
    if refusal is None and method not in ("GET", "HEAD"):
        refusal = MethodNotAllowedError(path=path, method=method, allowed=["GET", "HEAD"])
    if refusal is not None:
        status, body = refusal.status, error_body(refusal)
        out = [(b"content-type", b"application/json"), (b"content-security-policy", CSP.encode())]
        if isinstance(refusal, MethodNotAllowedError):
            out.append((b"allow", b"GET, HEAD"))
    elif asset is None:
        status, body = 404, b"not found\n"
        out = _headers(b"text/plain; charset=utf-8", len(body))
    else:
        content_type, body = asset
        out = _headers(content_type, len(body))
        if method == "HEAD":
            body = b""
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})
    return True
