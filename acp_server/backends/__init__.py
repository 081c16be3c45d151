"""Agent backends behind one Protocol; ``EchoBackend`` is the reference.

``AcpAgentBackend`` (an ACP agent run as a subprocess) loads on first use (PEP 562): a server with only
the echo or OpenAI backends does not import the subprocess relay.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
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

if TYPE_CHECKING:
    from .acp_agent import AcpAgentBackend

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

__getattr__, __dir__ = lazy_exports(globals(), {"AcpAgentBackend": ".acp_agent"})
