"""What the improver raises when a cycle cannot go on."""

from __future__ import annotations

from trace_plugin.errors import TracePluginError


class ImproverError(TracePluginError, RuntimeError):
    """A cycle found the store or the gateway in a state it cannot continue from."""


class DeployError(ImproverError):
    """The gateway would not serve exactly what was evaluated: traffic stays where it was."""
