"""The Lua scripts of the Redis coordinator, read once from the package's ``lua/`` folder, and the key names.

Every key of one cluster shares the hash tag ``{prefix}``, so each script call touches one slot: it is
atomic on a single Redis and on Redis Cluster alike. The scripts take every key they touch in ``KEYS``.

| key | type | holds |
|---|---|---|
| ``{p}:l:<name>`` | sorted set | the leases in limit ``<name>``; score = expiry (ms, Redis time) |
| ``{p}:lease:<id>`` | string | ``"<fencing token>|<replica>"``, expiring with the lease |
| ``{p}:tomb:<id>:<n>`` | string | attempt ``n`` of lease ``id`` was given up: it may not win any more |
| ``{p}:fence`` | counter | the last fencing token drawn |
| ``{p}:caps`` | hash | limit set key -> its cap as last asserted |
| ``{p}:replicas`` | sorted set | replica id -> its last renewal (ms) |
| ``{p}:waiting`` | sorted set | replica id -> until when (ms) it has a waiter refused in Redis |
| ``{p}:idem:<session>:<key>`` | string | an idempotency claim (``claim.lua``) |
| ``{p}:freed`` | channel | a message each time a lease leaves a limit while another replica waits |
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Final

__all__ = ["SCRIPT_NAMES", "Keys", "script_source"]

#: The scripts shipped in ``acp_server/coordinator/lua/``.
SCRIPT_NAMES: Final = ("acquire", "release", "renew", "claim", "settle_claim")


@functools.cache
def script_source(name: str) -> str:
    """The text of ``lua/<name>.lua`` (read once per process); the two scripts that apply releases get
    ``lua/_releases.lua`` (the steps they share) between their leading comment and their code.

    Raises:
        ValueError: ``name`` is not one of :data:`SCRIPT_NAMES`.
    """
    if name not in SCRIPT_NAMES:
        raise ValueError(f"no such coordinator script: {name!r} (one of {', '.join(SCRIPT_NAMES)})")
    folder = resources.files(__package__).joinpath("lua")
    text = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_RELEASES:
        # after the script's own leading comment (what it takes, returns and keeps), before its code
        lines = text.splitlines(keepends=True)
        head = next((i for i, line in enumerate(lines) if not line.startswith("--")), len(lines))
        shared = folder.joinpath("_releases.lua").read_text(encoding="utf-8")
        text = "".join(lines[:head]) + shared + "".join(lines[head:])
    return text


#: The scripts that apply releases, with ``lua/_releases.lua`` (the steps they share) in front of their code.
_WITH_RELEASES: Final = frozenset({"acquire", "release"})


class Keys:
    """The key names of one prefix."""

    __slots__ = ("caps", "fence", "freed", "prefix", "replicas", "waiting", "_tag")

    def __init__(self, prefix: str) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError(f"--coordinator-prefix must be a non-empty string without braces; got {prefix!r}")
        self.prefix = prefix
        self._tag = "{" + prefix + "}"
        self.fence = f"{self._tag}:fence"
        self.caps = f"{self._tag}:caps"
        self.replicas = f"{self._tag}:replicas"
        self.freed = f"{self._tag}:freed"
        self.waiting = f"{self._tag}:waiting"

    def limit(self, name: str) -> str:
        """The sorted set of limit ``name``."""
        return f"{self._tag}:l:{name}"

    def limit_name(self, key: str) -> str:
        """The limit name of a sorted set key (the reverse of :meth:`limit`)."""
        return key.removeprefix(f"{self._tag}:l:")

    def lease(self, lease_id: str) -> str:
        return f"{self._tag}:lease:{lease_id}"

    def tomb(self, lease_id: str, attempt: int) -> str:
        return f"{self._tag}:tomb:{lease_id}:{attempt}"

    def claim(self, session_id: str, key: str) -> str:
        return f"{self._tag}:idem:{len(session_id)}:{session_id}:{key}"
