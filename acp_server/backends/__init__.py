"""Agent backends behind one Protocol; ``EchoBackend`` is the reference."""

from .base import Backend, Turn
from .echo import EchoBackend

__all__ = ["Backend", "EchoBackend", "Turn"]
