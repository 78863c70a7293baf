"""A calculator tool environment for OpenEnv (an MCPEnvironment)."""

from .environment import RechnerEnvironment, RechnerState

__all__ = ["RechnerEnvironment", "RechnerState"]
