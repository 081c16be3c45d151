"""acp-server: a gateway for the Agent Client Protocol with admission control and structured overload errors."""

__version__ = "0.1.0"

__all__ = ["__version__"]
