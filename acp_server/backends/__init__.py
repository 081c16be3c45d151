"""Agent backends behind one Protocol; ``EchoBackend`` is the reference."""

from .acp_agent import AcpAgentBackend
from .base import (
    Backend,
    BaseBackend,
    ClientChannel,
    ClientGoneError,
    ClientRequestError,
    SessionSetup,
    Turn,
)
from .echo import EchoBackend

__all__ = [
    "AcpAgentBackend",
    "Backend",
    "BaseBackend",
    "ClientChannel",
    "ClientRequestError",
    "ClientGoneError",
    "EchoBackend",
    "SessionSetup",
    "Turn",
]
