"""Agent backends behind one Protocol; ``EchoBackend`` is the reference."""

from .acp_agent import AcpAgentBackend
from .base import (
    Backend,
    BaseBackend,
    ClientChannel,
    ClientRequestError,
    ConnectionLostError,
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
    "ConnectionLostError",
    "EchoBackend",
    "SessionSetup",
    "Turn",
]
