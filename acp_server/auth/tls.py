"""TLS contexts for our listeners and our clients, and a bounded server-side handshake.

- :class:`ServerTls`: the server context built from ``--tls-cert``/``--tls-key``, with ALPN
  (``h2``, ``http/1.1``) for HTTP listeners and none for NDJSON; :meth:`ServerTls.reload` swaps in
  new certificates (SIGHUP), keeping the old ones when the new files do not load, for itself and the
  siblings :meth:`ServerTls.with_alpn` made (the HTTPS listeners'). Connections already open keep the
  context they shook hands with; the next handshake uses the new one.
- :func:`client_context`: what our SDK verifies servers with: the system trust store, or ``--ca-file``.
- :func:`accept_tls`: wrap an accepted stream in ``trio.SSLStream(server_side=True,
  https_compatible=True)`` and complete the handshake within ``--tls-handshake-timeout-s``; a client
  that is silent, speaks plain TCP or fails verification is closed there, and only that connection.
- :func:`tls_handler`: a listener handler that does :func:`accept_tls` before the real one.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from .settings import DEFAULT_HANDSHAKE_TIMEOUT_S  # the flag's default, read by the parser without trio

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "HTTP_ALPN",
    "ServerTls",
    "TlsConfigError",
    "TlsHandshakeError",
    "accept_tls",
    "client_context",
    "describe_tls_failure",
    "open_tls_stream",
    "server_context",
    "tls_handler",
]

log = logging.getLogger("acp_server.auth.tls")

#: The protocols an HTTPS listener offers, preferred first.
HTTP_ALPN = ("h2", "http/1.1")


class TlsConfigError(ValueError):
    """A certificate, key or CA file cannot be used; the message names the flag and the file."""


class TlsHandshakeError(Exception):
    """A server-side handshake did not complete (the connection was closed).

    Attributes:
        reason: ``timeout`` or ``failed``.
        detail: what went wrong, for the log (never the peer's bytes).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"TLS handshake {reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _strerror(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def server_context(cert: str, key: str, *, alpn: Sequence[str] = ()) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) holding the certificate chain ``cert`` and its key ``key``.

    Args:
        cert: PEM file: the certificate, then any intermediates.
        key: PEM file: the private key (unencrypted).
        alpn: protocols to offer (:data:`HTTP_ALPN` for HTTP listeners; none for NDJSON).

    Raises:
        TlsConfigError: a file is missing, unreadable, not PEM, or the key does not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise TlsConfigError(f"--tls-cert {cert} / --tls-key {key}: {exc.filename or cert}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(
            f"--tls-cert {cert} / --tls-key {key}: cannot load the certificate and its key: {_strerror(exc)} "
            "(both PEM; the key unencrypted and matching the certificate)"
        ) from None
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


class ServerTls:
    """The server's TLS context, reloadable from the same files.

    Args:
        cert: the ``--tls-cert`` file.
        key: the ``--tls-key`` file.
        alpn: ALPN protocols to offer.
        handshake_timeout_s: how long :func:`accept_tls` waits for a handshake.

    Raises:
        TlsConfigError: the files do not load (at construction only; :meth:`reload` reports instead).
    """

    def __init__(
        self,
        cert: str,
        key: str,
        *,
        alpn: Sequence[str] = (),
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        if not handshake_timeout_s > 0:
            raise TlsConfigError(f"--tls-handshake-timeout-s must be a positive number of seconds; got {handshake_timeout_s}")
        self.cert = cert
        self.key = key
        self.alpn = tuple(alpn)
        self.handshake_timeout_s = handshake_timeout_s
        self.context = server_context(cert, key, alpn=self.alpn)
        self._siblings: dict[tuple[str, ...], ServerTls] = {}

    def with_alpn(self, alpn: Sequence[str]) -> ServerTls:
        """A sibling for another listener kind (same files and timeout, other ALPN), reloaded with this one.

        Asking twice for the same protocols gives the same sibling.
        """
        wanted = tuple(alpn)
        if wanted == self.alpn:
            return self
        sibling = self._siblings.get(wanted)
        if sibling is None:
            sibling = self._siblings[wanted] = ServerTls(
                self.cert, self.key, alpn=wanted, handshake_timeout_s=self.handshake_timeout_s
            )
        return sibling

    def reload(self) -> str | None:
        """Load the files again, for this context and its siblings; on failure keep the current ones.

        Returns:
            ``None`` when the new certificates are in use; else why they were not taken.
        """
        try:
            fresh = server_context(self.cert, self.key, alpn=self.alpn)
            siblings = {alpn: server_context(self.cert, self.key, alpn=alpn) for alpn in self._siblings}
        except TlsConfigError as exc:
            return str(exc)
        self.context = fresh
        for alpn, context in siblings.items():
            self._siblings[alpn].context = context
        return None


def client_context(ca_file: str | None = None, *, alpn: Sequence[str] = ()) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and host name.

    Args:
        ca_file: PEM file of the CAs to trust (``--ca-file``); ``None``: the system trust store.
        alpn: protocols to offer.

    Raises:
        TlsConfigError: ``ca_file`` cannot be read or holds no certificate.
    """
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except FileNotFoundError:
        raise TlsConfigError(f"--ca-file {ca_file}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"--ca-file {ca_file}: not a PEM file of CA certificates: {_strerror(exc)}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def describe_tls_failure(exc: BaseException) -> str:
    """A one-line reason for a failed client handshake, with the likely fix when it is verification.

    ``trio.SSLStream`` raises ``trio.BrokenResourceError`` with the ``ssl`` error as its cause.
    """
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (
            f"the server's certificate is not trusted ({cause.verify_message or cause.reason}); "
            "pass the CA that signed it with --ca-file, or check the host name"
        )
    if isinstance(cause, ssl.SSLError):
        return f"TLS handshake failed: {cause.reason or cause}"
    return f"TLS handshake failed: the server closed the connection ({exc!r})"


async def open_tls_stream(host: str, port: int, ca_file: str | None = None) -> trio.SSLStream[trio.SocketStream]:
    """Connect to ``host:port`` and complete a verified TLS handshake (what our SDK and relay use).

    Raises:
        TlsConfigError: ``ca_file`` cannot be used.
        ConnectionError: the handshake failed; the message says why and, for an untrusted certificate,
            names ``--ca-file``.
        OSError: nothing listens there.
    """
    context = client_context(ca_file)
    tcp = await trio.open_tcp_stream(host, port)
    stream = trio.SSLStream(tcp, context, server_hostname=host)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tcp)
        raise ConnectionError(f"tls://{host}:{port}: {describe_tls_failure(exc)}") from exc
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return stream


async def accept_tls(
    stream: trio.abc.Stream, tls: ServerTls | ssl.SSLContext, *, timeout_s: float | None = None
) -> trio.SSLStream[trio.abc.Stream]:
    """Wrap an accepted stream in TLS and complete the handshake within the timeout.

    Args:
        stream: the accepted transport stream (ours to close on failure).
        tls: the server's :class:`ServerTls` (its current context and timeout) or a bare context.
        timeout_s: the handshake's time limit (default: ``tls.handshake_timeout_s``, else
            :data:`DEFAULT_HANDSHAKE_TIMEOUT_S` with a bare context).

    Raises:
        TlsHandshakeError: timeout or failure; ``stream`` is closed by then.
    """
    if isinstance(tls, ServerTls):
        context, limit = tls.context, tls.handshake_timeout_s
    else:
        context, limit = tls, DEFAULT_HANDSHAKE_TIMEOUT_S
    if timeout_s is not None:
        limit = timeout_s
    wrapped = trio.SSLStream(stream, context, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(limit):
            await wrapped.do_handshake()
    except trio.TooSlowError:
        failure = TlsHandshakeError("timeout", f"no handshake within {limit:g} s")
    except trio.BrokenResourceError as exc:  # plain TCP, a bad client certificate, a reset
        failure = TlsHandshakeError("failed", describe_tls_failure(exc))
    else:
        return wrapped
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(stream)
    raise failure


def tls_handler(
    handler: Callable[[trio.abc.Stream], Awaitable[Any]], tls: ServerTls, name: str = "tls"
) -> Callable[[trio.abc.Stream], Awaitable[None]]:
    """A connection handler that shakes hands first, then runs ``handler`` on the TLS stream.

    A failed handshake is logged (info: scanners and plain-TCP clients are routine) and closes that
    connection only; the TLS stream is closed when ``handler`` returns.
    """

    async def run(stream: trio.abc.Stream) -> None:
        try:
            secure = await accept_tls(stream, tls)
        except TlsHandshakeError as exc:
            log.info("%s: %s; connection closed", name, exc)
            return
        try:
            await handler(secure)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(secure)

    return run
