"""Who may connect and as whom: tokens bound to tenants, TLS, Host/Origin rules, rate limits, audit.

This room knows no ACP method beyond ``initialize``/``authenticate``: transports and handlers ask it
whether a credential holds (:class:`TokenStore`), what identity it grants (:class:`Identity`), whether a
request may proceed now (:class:`RateLimiter`, :class:`AuthFailureLimiter`), and they write what
happened to the :class:`AuditLog`.

The names below load with their module on first use (PEP 562): the command line reads its flags from
``auth.settings`` and ``auth.hosts`` without importing TLS and trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .audit import AuditLog
    from .binds import RemoteBindError, check_remote_bind
    from .identity import OWNER, Identity
    from .ratelimit import AuthFailureLimiter, RateLimiter, TokenBucket, is_local_address
    from .tls import ServerTls, TlsConfigError, TlsHandshakeError, accept_tls, client_context, tls_handler
    from .tokens import (
        ReloadResult,
        TokenFileError,
        TokenPermissionError,
        TokenRecord,
        TokenStore,
        hash_secret,
        new_secret,
    )

#: The id of the gateway's own auth method in ``initialize`` ``authMethods``.
TOKEN_METHOD_ID = "acp-server-token"

#: Each public name -> the module that defines it.
_HOMES = {
    "AuditLog": ".audit",
    "RemoteBindError": ".binds",
    "check_remote_bind": ".binds",
    "AuthFailureLimiter": ".ratelimit",
    "RateLimiter": ".ratelimit",
    "TokenBucket": ".ratelimit",
    "is_local_address": ".ratelimit",
    "ServerTls": ".tls",
    "TlsConfigError": ".tls",
    "TlsHandshakeError": ".tls",
    "accept_tls": ".tls",
    "client_context": ".tls",
    "tls_handler": ".tls",
    "OWNER": ".identity",
    "Identity": ".identity",
    "ReloadResult": ".tokens",
    "TokenFileError": ".tokens",
    "TokenPermissionError": ".tokens",
    "TokenRecord": ".tokens",
    "TokenStore": ".tokens",
    "hash_secret": ".tokens",
    "new_secret": ".tokens",
}

__all__ = [
    "OWNER",
    "TOKEN_METHOD_ID",
    "AuditLog",
    "AuthFailureLimiter",
    "Identity",
    "RateLimiter",
    "ReloadResult",
    "RemoteBindError",
    "ServerTls",
    "TlsConfigError",
    "TlsHandshakeError",
    "TokenBucket",
    "TokenFileError",
    "TokenPermissionError",
    "TokenRecord",
    "TokenStore",
    "accept_tls",
    "check_remote_bind",
    "client_context",
    "hash_secret",
    "is_local_address",
    "new_secret",
    "tls_handler",
]


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)

