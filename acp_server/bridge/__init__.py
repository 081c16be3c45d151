"""The session bridge: sessions, per-session prompt FIFOs, client ids, update fan-out."""

from .bridge import BridgeStatistics, PromptWaiter, SessionBridge
from .session import ClientReg, ForkTicket, Peer, PromptTicket, Session

__all__ = ["BridgeStatistics", "PromptWaiter", "ClientReg", "ForkTicket", "Peer", "PromptTicket", "Session", "SessionBridge"]
