"""The listeners' address type, under the transports' name (it lives in :mod:`acp_server.listen_address`)."""

from __future__ import annotations

from ..listen_address import ListenAddress

__all__ = ["ListenAddress"]
