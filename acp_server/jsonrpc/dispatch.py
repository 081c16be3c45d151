"""Dispatch of requests and notifications to an explicit method table.

A handler is a plain function ``handler(ctx, params)``. It runs synchronously, at the moment its
request is taken off the wire and in arrival order, which is what makes admission atomic: no other
request can run between a check and the count it changes. A handler that has to wait returns a
coroutine; the transport shell awaits it in a task of its own (see :meth:`Dispatcher.finish`).

Errors are answered in jsonrpcserver's error response shape (``code``, ``message``, ``data``; a test
holds the bytes to jsonrpcserver's own serializer), without importing it: its async dispatch cannot
run under trio, and its jsonschema request check is replaced by msgspec decoding into each method's
params Struct. This module imports no event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from types import CoroutineType
from typing import Any, NamedTuple

import msgspec

from ..errors import (
    AcpError,
    InternalError,
    InvalidParamsError,
    MethodNotFoundError,
    NotInitializedError,
)
from ..logtext import clip
from ..types.base import validation_location
from .connection import EncodedError, Id, Notification, Request, _ResultMsg, encode_result
from .connection import _encoder as _connection_encoder
from .guard import error_of

__all__ = ["Deferred", "Dispatcher", "HandlerContext", "Method", "invalid_params_from"]

log = logging.getLogger("acp_server.dispatch")

_ARRAY = ord("[")


class HandlerContext:
    """What every handler may read about the connection it serves; the server subclasses it."""

    initialized: bool = False


class Deferred:
    """A result that arrives later by callback, with no task of its own (a prompt waiting its turn).

    The cheapest way to answer a request that waits: the shell subscribes once and the owner of the
    work calls back, synchronously, with ``(result, None)`` or ``(None, error)`` exactly once.
    """

    __slots__ = ()

    def subscribe(self, done: Callable[[Any, AcpError | None], None]) -> None:
        """Call ``done`` once with the outcome (at once if it is already known)."""
        raise NotImplementedError

    def cancel(self, *, connection_lost: bool) -> None:
        """The request was cancelled (``$/cancel_request``), or its connection is gone."""
        raise NotImplementedError

    def stop(self) -> None:
        """End the work now, as a shutdown would (a prompt: ``stopReason: "cancelled"``); by default,
        as :meth:`cancel` for a connection that stays."""
        self.cancel(connection_lost=False)

    def on_settled(self, settled: Callable[[], None]) -> None:
        """Call ``settled`` once if the work ends before its answer can go out (a prompt whose outcome
        waits for the store's commit): from then on the request no longer counts as running. By
        default the answer itself is the end."""


class Method(NamedTuple):
    """One entry of the method table.

    Attributes:
        params_type: the Struct its params decode into, or ``None`` when it reads none.
        handler: ``handler(ctx, params)``; returns the result, or a coroutine that produces it.
        requires_init: answer ``not_initialized`` before ``initialize`` has succeeded.
        sees_cancel: the handler runs even when its request was cancelled before it started, so that it
            can check what comes before cancellation in its own admission order (``ctx.cancelled``).
    """

    params_type: type[Any] | None
    handler: Callable[[Any, Any], Any]
    requires_init: bool = True
    sees_cancel: bool = False


_encode = _connection_encoder.encode


def _decodes_no_array(params_type: type[Any]) -> bool:
    """Whether a JSON array can never decode into ``params_type`` (a Struct that is not array-like), so
    that its params may be decoded before they are checked for an array (by-position params)."""
    return (
        isinstance(params_type, type)
        and issubclass(params_type, msgspec.Struct)
        and not params_type.__struct_config__.array_like
    )


def invalid_params_from(exc: msgspec.ValidationError) -> InvalidParamsError:
    """Turn msgspec's message into ``invalid_params`` with the dotted path of the offending field."""
    path, detail = validation_location(exc)
    return InvalidParamsError(path=path or "params", detail=detail)


class _Decoders(dict[type[Any], Callable[[bytes], Any]]):
    """params type -> its msgspec decoder, each built at its first use.

    Building a decoder walks its Struct's fields (msgspec keeps what it learns per type): ~1.5 ms for
    the whole method table, which a process that serves a few methods (a stdio agent's client sends
    ``initialize``, ``session/new`` and prompts) paid at start-up for all of them. A type that an array
    never decodes into also goes into ``eager`` (the dispatcher's fast path) once its decoder exists.
    """

    __slots__ = ("eager",)

    def __init__(self, eager: dict[type[Any] | None, Callable[[bytes], Any]]) -> None:
        super().__init__()
        self.eager = eager

    def __missing__(self, params_type: type[Any]) -> Callable[[bytes], Any]:
        decode = self[params_type] = msgspec.json.Decoder(params_type).decode
        if _decodes_no_array(params_type):
            self.eager[params_type] = decode
        return decode


class Dispatcher:
    """Routes requests and notifications by name.

    Args:
        requests: method name -> :class:`Method`, for requests.
        notifications: method name -> :class:`Method`, for notifications (their handlers must not
            return coroutines; unknown notifications are ignored, as JSON-RPC requires).
    """

    def __init__(self, requests: Mapping[str, Method], notifications: Mapping[str, Method]) -> None:
        self.requests = dict(requests)
        self.notifications = dict(notifications)
        #: params type -> its decoder, for the types an array never decodes into (see
        #: :func:`_decodes_no_array`): their params are decoded at once, and checked for an array only
        #: if that fails. Looked up by the entry's type at each call: the table may change after this.
        #: Filled as :attr:`_decoders` builds each decoder, at its type's first request.
        self._eager: dict[type[Any] | None, Callable[[bytes], Any]] = {}
        self._decoders = _Decoders(self._eager)

    def _params(self, method: Method, raw: msgspec.Raw | None) -> Any:
        if method.params_type is None:
            return None
        data = b"{}" if raw is None else raw
        if memoryview(data)[0] == _ARRAY:
            raise InvalidParamsError(path="params", detail="params must be an object (by-name); arrays are not supported")
        try:
            return self._decoders[method.params_type](data)
        except msgspec.ValidationError as exc:
            raise invalid_params_from(exc) from None
        except (msgspec.DecodeError, RecursionError) as exc:
            # Only text the envelope skipped can fail here: invalid UTF-8 inside params, nesting that
            # this deeper stack cannot decode.
            raise error_of(exc, data) from None

    def call(self, ctx: HandlerContext, req: Request) -> bytes | Coroutine[Any, Any, Any] | Deferred:
        """Run a request's synchronous part: the response bytes, a coroutine for :meth:`finish`, or a
        :class:`Deferred` whose outcome :meth:`shape` turns into the response.

        An error the handler raised comes back as :class:`EncodedError` (bytes that keep the error).
        """
        method = self.requests.get(req.method)
        try:
            if method is None:
                raise MethodNotFoundError(method=req.method)
            if method.requires_init and not ctx.initialized:
                raise NotInitializedError(method=req.method)
            raw = req.params
            decode = self._eager.get(method.params_type)
            if decode is not None and raw is not None:
                # _params' usual case, inline (this runs for every request). An array cannot decode
                # into a Struct that is not array-like: it is told apart only once decoding failed.
                try:
                    params = decode(raw)
                except msgspec.ValidationError as exc:
                    if memoryview(raw)[0] == _ARRAY:
                        params = self._params(method, raw)  # raises its by-name error
                    raise invalid_params_from(exc) from None
                except (msgspec.DecodeError, RecursionError):
                    params = self._params(method, raw)  # its error, as _params words it
            else:
                params = self._params(method, raw)
            out = method.handler(ctx, params)
        except AcpError as exc:
            return EncodedError.of(req.id, exc)
        except Exception:
            log.exception("handler of %s (request id %s) failed", clip(req.method), clip(req.id))
            return EncodedError.of(req.id, InternalError())
        if type(out) is CoroutineType or isinstance(out, Deferred):
            return out
        return _encode(_ResultMsg("2.0", req.id, out)) + b"\n"  # encode_result's, inline

    @staticmethod
    def shape(req_id: Id, result: Any, error: AcpError | None) -> bytes:
        """The response to a :class:`Deferred`'s outcome."""
        return EncodedError.of(req_id, error) if error is not None else encode_result(req_id, result)

    async def finish(self, req_id: Id, method: str, pending: Awaitable[Any]) -> bytes:
        """Await a handler's coroutine and shape its response (cancellation propagates to the caller)."""
        try:
            result = await pending
        except AcpError as exc:
            return EncodedError.of(req_id, exc)
        except Exception:
            log.exception("handler of %s (request id %s) failed", clip(method), clip(req_id))
            return EncodedError.of(req_id, InternalError())
        return encode_result(req_id, result)

    def notify(self, ctx: HandlerContext, note: Notification) -> None:
        """Run a notification's handler; nothing is ever sent back, whatever happens."""
        method = self.notifications.get(note.method)
        if method is None:
            log.debug("ignoring unknown notification %s", clip(note.method))
            return
        if method.requires_init and not ctx.initialized:
            log.warning("ignoring %s before initialize", clip(note.method))
            return
        try:
            method.handler(ctx, self._params(method, note.params))
        except AcpError as exc:
            log.warning("notification %s refused: %s", clip(note.method), clip(str(exc)))
        except Exception:
            log.exception("notification handler of %s failed", clip(note.method))
