"""The JSON-RPC 2.0 core: framing, the sans-I/O connection and dispatch. It imports no event loop."""

from .connection import (
    NEED_DATA,
    Batch,
    Connection,
    EncodedError,
    ErrorReply,
    Event,
    Notification,
    Request,
    Response,
    TooLarge,
    encode_error,
    encode_result,
)
from .dispatch import Deferred, Dispatcher, HandlerContext, Method, invalid_params_from
from .framing import TOO_LARGE, LineBuffer
from .guard import MAX_DEPTH, DecodeFailure, safe_decode

__all__ = [
    "MAX_DEPTH",
    "NEED_DATA",
    "TOO_LARGE",
    "Batch",
    "Connection",
    "DecodeFailure",
    "Deferred",
    "Dispatcher",
    "EncodedError",
    "ErrorReply",
    "Event",
    "HandlerContext",
    "LineBuffer",
    "Method",
    "Notification",
    "Request",
    "Response",
    "TooLarge",
    "encode_error",
    "encode_result",
    "invalid_params_from",
    "safe_decode",
]
