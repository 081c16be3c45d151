"""An OpenAI-compatible chat-completions endpoint as an agent backend.

:class:`OpenAIBackend` is the backend; :mod:`.sse` reads the stream, :mod:`.retry` decides retries,
:mod:`.request` builds requests and keeps the conversation inside the model's window, :mod:`.tools`
runs the model's tool calls on the client.
"""

from .backend import OpenAIBackend, stop_reason_of

__all__ = ["OpenAIBackend", "stop_reason_of"]
