"""Where a client connects: the URL forms :func:`~acp_server.client.connect` and ``--connect`` accept.

Pure (no trio, no socket), so the command line checks ``--connect`` without loading the client.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["parse_url"]


def parse_url(url: str) -> tuple[str, str, int]:
    """``tcp://HOST:PORT`` -> ``("tcp", host, port)`` (``tls://`` -> ``("tls", host, port)``); ``unix:/path``
    (or ``unix:///path``) -> ``("unix", path, 0)``; ``http(s)://HOST:PORT/acp`` and ``ws(s)://HOST:PORT/acp``
    (ACP's remote transport) -> ``("http"|"https"|"ws"|"wss", url, port)``.

    Raises:
        ValueError: any other form (the message says what is accepted).
    """
    accepted = (
        "tcp://HOST:PORT, tls://HOST:PORT, unix:/absolute/path, http(s)://HOST:PORT/acp or ws(s)://HOST:PORT/acp"
    )
    if url.startswith(("http://", "https://", "ws://", "wss://")):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError(f"{url!r} is not of the form {accepted} (the endpoint's path, e.g. /acp, is needed)")
        return parts.scheme, url, port or (443 if parts.scheme in ("https", "wss") else 80)
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(f"{url!r}: a Unix socket needs an absolute path; accepted: {accepted}")
        return "unix", path, 0
    if url.startswith(("tcp://", "tls://")):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"{url!r} is not of the form {accepted}")
        return parts.scheme, parts.hostname, port
    raise ValueError(f"{url!r}: unknown scheme; accepted: {accepted}")
