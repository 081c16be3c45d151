"""The tokens file, its records, and the store that turns a presented secret into an :class:`Identity`.

The file (``--auth-tokens FILE``) is TOML, one table per token; it holds the SHA-256 of each secret,
never the secret itself::

    [tokens.ci-acme]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    scopes = ["metrics"]              # optional: "admin" (any tenant, all stats), "metrics" (may scrape)
    expires = 2027-01-01T00:00:00Z    # optional, RFC 3339 with an offset (a TOML datetime or a string)

The file must be private to its owner (no group or other permission bits): a file anyone else can
read or write is refused with the fix, ``chmod 600 FILE``. Secrets are 256-bit random strings
(:func:`new_secret`); a presented secret is hashed and compared with *every* record in constant time
(:func:`hmac.compare_digest`, no early exit), so neither the timing nor the path taken says which
record came close.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .identity import OWNER, SCOPES, Identity  # theirs; re-exported here, where they were first

__all__ = [
    "MAX_SECRET_CHARS",
    "OWNER",
    "SCOPES",
    "Identity",
    "ReloadResult",
    "TokenFileError",
    "TokenPermissionError",
    "TokenRecord",
    "TokenStore",
    "check_private",
    "format_expires",
    "hash_secret",
    "is_token_id",
    "load_tokens",
    "new_secret",
    "parse_expires",
    "parse_tokens",
    "render_tokens",
    "write_tokens",
]

#: A presented secret longer than this is refused before hashing (ours are 43 characters).
MAX_SECRET_CHARS = 512
#: Token ids are TOML bare keys (table names that need no quoting): letters, digits, ``_``, ``-``.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_MAX_TENANT = 128
_RECORD_KEYS = ("sha256", "tenant", "scopes", "expires")


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message names the file, the key and the rule broken."""


class TokenPermissionError(TokenFileError):
    """The tokens file is accessible by group or others; the message gives the ``chmod`` that fixes it."""


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """One ``[tokens.<id>]`` table.

    Attributes:
        id: the table name; what logs, audit lines and ``token list`` show.
        sha256: the SHA-256 digest of the secret (32 bytes).
        tenant: the tenant a connection holding this token acts for.
        scopes: a subset of :data:`SCOPES`.
        expires: the instant the token stops working (aware), or ``None``.
    """

    id: str
    sha256: bytes
    tenant: str
    scopes: frozenset[str] = frozenset()
    expires: datetime | None = None

    def expired(self, now: datetime) -> bool:
        """Whether the token has expired at ``now`` (an aware datetime)."""
        return self.expires is not None and now >= self.expires


def is_token_id(text: str) -> bool:
    """Whether ``text`` may name a token (1-64 letters, digits, ``_`` or ``-``)."""
    return bool(_ID.match(text))


def hash_secret(secret: str) -> str:
    """The lowercase hex SHA-256 of a secret's UTF-8 bytes (what the file's ``sha256`` holds)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    """A fresh 256-bit random secret, URL-safe base64 without padding (43 characters)."""
    return secrets.token_urlsafe(32)


def parse_expires(value: object, where: str) -> datetime:
    """An RFC 3339 instant (a TOML offset datetime or a string) as an aware UTC datetime.

    Raises:
        TokenFileError: not a datetime, or one without a UTC offset.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            value = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "zZ" and text else text)
        except ValueError:
            raise TokenFileError(
                f"{where}: must be an RFC 3339 date-time with an offset, e.g. 2027-01-01T00:00:00Z; got {text!r}"
            ) from None
    if not isinstance(value, datetime):
        raise TokenFileError(f"{where}: must be an RFC 3339 date-time, e.g. 2027-01-01T00:00:00Z; got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise TokenFileError(f"{where}: needs a UTC offset (e.g. 2027-01-01T00:00:00Z), not a local time")
    return value.astimezone(UTC)


def format_expires(when: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` (what ``token add`` writes and ``token list`` shows)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _record(token_id: str, table: object, where: str) -> TokenRecord:
    if not _ID.match(token_id):
        raise TokenFileError(f"{where}: a token id is 1-64 letters, digits, '_' or '-'")
    if not isinstance(table, dict):
        raise TokenFileError(f"{where}: must be a table ([tokens.{token_id}])")
    unknown = sorted(set(table) - set(_RECORD_KEYS))
    if unknown:
        raise TokenFileError(f"{where}.{unknown[0]}: unknown key (accepted: {', '.join(_RECORD_KEYS)})")
    digest = table.get("sha256")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise TokenFileError(f"{where}.sha256: required, 64 hex digits (the SHA-256 of the secret, not the secret)")
    tenant = table.get("tenant")
    if not isinstance(tenant, str) or not tenant or len(tenant) > _MAX_TENANT or not tenant.isprintable():
        raise TokenFileError(f"{where}.tenant: required, 1-{_MAX_TENANT} printable characters")
    scopes = table.get("scopes", [])
    if not isinstance(scopes, list) or any(s not in SCOPES for s in scopes):
        raise TokenFileError(f"{where}.scopes: a list of {', '.join(repr(s) for s in SCOPES)}; got {scopes!r}")
    expires = table.get("expires")
    return TokenRecord(
        id=token_id,
        sha256=bytes.fromhex(digest),
        tenant=tenant,
        scopes=frozenset(scopes),
        expires=None if expires is None else parse_expires(expires, f"{where}.expires"),
    )


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, TokenRecord]:
    """Parse a tokens file's text into records by id.

    Raises:
        TokenFileError: TOML syntax, an unknown key, a bad value, or two ids with the same secret.
    """
    import tomllib  # only when a tokens file is read

    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - {"tokens"})
    if unknown:
        raise TokenFileError(f"{source}: {unknown[0]}: unknown key (tokens are [tokens.<id>] tables)")
    tables = raw.get("tokens", {})
    if not isinstance(tables, dict):
        raise TokenFileError(f"{source}: tokens: must be a table of [tokens.<id>] tables")
    records: dict[str, TokenRecord] = {}
    seen: dict[bytes, str] = {}
    for token_id, table in tables.items():
        record = _record(token_id, table, f"{source}: tokens.{token_id}")
        other = seen.setdefault(record.sha256, token_id)
        if other != token_id:
            raise TokenFileError(f"{source}: tokens.{token_id}.sha256: the same secret as tokens.{other}; give each its own")
        records[token_id] = record
    return records


def check_private(path: str, mode: int) -> None:
    """Refuse a tokens file whose mode gives group or others any access.

    Raises:
        TokenPermissionError: naming the file, its mode and the fix.
    """
    if mode & 0o077:
        raise TokenPermissionError(
            f"{path}: the tokens file is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"make it private to its owner: chmod 600 {path}"
        )


def load_tokens(path: str) -> dict[str, TokenRecord]:
    """Read, check and parse the tokens file at ``path``.

    The permission check is made on the opened descriptor, so the file checked is the file read.

    Raises:
        TokenFileError: unreadable, not a regular file, or not of the accepted form.
        TokenPermissionError: accessible by group or others.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot open the tokens file: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"{path}: the tokens file is not a regular file")
        check_private(path, st.st_mode)
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenFileError(f"{path}: the tokens file is not UTF-8") from None
    return parse_tokens(text, path)


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def render_tokens(records: Iterable[TokenRecord]) -> str:
    """The TOML text of ``records`` (what :func:`parse_tokens` reads back to the same records)."""
    lines = ["# acp-server tokens: SHA-256 digests of secrets, never the secrets. Keep this file mode 0600.", ""]
    for r in records:
        lines.append(f"[tokens.{r.id}]")
        lines.append(f'sha256 = "{r.sha256.hex()}"')
        lines.append(f"tenant = {_toml_string(r.tenant)}")
        if r.scopes:
            lines.append("scopes = [" + ", ".join(f'"{s}"' for s in sorted(r.scopes)) + "]")
        if r.expires is not None:
            lines.append(f"expires = {format_expires(r.expires)}")
        lines.append("")
    return "\n".join(lines)


def write_tokens(path: str, records: Iterable[TokenRecord]) -> None:
    """Replace the tokens file atomically: a 0600 temporary file beside it, synced, then renamed over it.

    A reader (the server on SIGHUP) sees the old file or the new one, never half of one.

    Raises:
        TokenFileError: the directory cannot be written.
    """
    import tempfile  # only writers need it: `acp-server --help` reads SCOPES from this module

    directory = os.path.dirname(os.path.abspath(path))
    text = render_tokens(records).encode("utf-8")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tokens-", dir=directory)  # mkstemp creates with mode 0600
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot write beside the tokens file: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise TokenFileError(f"{path}: cannot write the tokens file: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """What a :meth:`TokenStore.reload` did.

    Attributes:
        error: why the file was not taken (the old tokens stay), or ``None``.
        added: ids new in the file.
        removed: ids gone from the file (revoked).
        changed: ids whose record changed (a new secret, tenant, scopes or expiry).
    """

    error: str | None = None
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()


def _utcnow() -> datetime:
    return datetime.now(UTC)


class TokenStore:
    """The tokens in force, checked in constant time.

    Args:
        records: the initial records by id.
        path: the file :meth:`reload` reads (``None``: the records are fixed).
        clock: the wall clock expiry is measured against (aware datetimes; injectable for tests).
    """

    def __init__(
        self,
        records: Mapping[str, TokenRecord] | None = None,
        *,
        path: str | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self._records: dict[str, TokenRecord] = dict(records or {})
        self.path = path
        self._clock = clock

    @classmethod
    def from_file(cls, path: str, *, clock: Callable[[], datetime] = _utcnow) -> TokenStore:
        """Load the store from a tokens file.

        Raises:
            TokenFileError: as :func:`load_tokens`.
        """
        return cls(load_tokens(path), path=path, clock=clock)

    def __len__(self) -> int:
        return len(self._records)

    def ids(self) -> list[str]:
        """The ids of the tokens in force (expired ones included), sorted."""
        return sorted(self._records)

    def get(self, token_id: str) -> TokenRecord | None:
        """The record of ``token_id``, or ``None``."""
        return self._records.get(token_id)

    def authenticate(self, secret: object, now: datetime | None = None) -> Identity | None:
        """The identity a presented secret proves, or ``None`` (unknown, expired, or not a string).

        Every record is compared, whatever matched, with :func:`hmac.compare_digest`.
        """
        if not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_CHARS:
            return None
        digest = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
        found: TokenRecord | None = None
        for record in self._records.values():
            if hmac.compare_digest(digest, record.sha256) and found is None:
                found = record
        if found is None or found.expired(now or self._clock()):
            return None
        return Identity(token_id=found.id, tenant=found.tenant, scopes=found.scopes)

    def valid(self, identity: Identity, now: datetime | None = None) -> bool:
        """Whether ``identity`` still holds: the owner always; a token while it is in the file, unchanged
        in tenant and scopes, and not expired (what eviction after a reload asks)."""
        if identity.token_id is None:
            return True
        record = self._records.get(identity.token_id)
        if record is None or record.tenant != identity.tenant or record.scopes != identity.scopes:
            return False
        return not record.expired(now or self._clock())

    def reload(self) -> ReloadResult:
        """Re-read :attr:`path`; a file that cannot be used keeps the tokens in force and says why."""
        if self.path is None:
            return ReloadResult(error="no tokens file to reload")
        try:
            fresh = load_tokens(self.path)
        except TokenFileError as exc:
            return ReloadResult(error=str(exc))
        old = self._records
        self._records = fresh
        return ReloadResult(
            added=tuple(sorted(set(fresh) - set(old))),
            removed=tuple(sorted(set(old) - set(fresh))),
            changed=tuple(sorted(i for i in set(old) & set(fresh) if old[i] != fresh[i])),
        )
