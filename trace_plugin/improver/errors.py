"""What the improver raises when a cycle cannot go on."""

from __future__ import annotations

from trace_plugin.errors import TracePluginError


class ImproverError(TracePluginError, RuntimeError):
    """A cycle found the store or the gateway in a state it cannot continue from."""


class DeployError(ImproverError):
    """The gateway would not serve exactly what was evaluated: traffic stays where it was."""


class ConfigError(TracePluginError, ValueError):
    """A setting the improver cannot work with; ``setting`` names it (the CLI's option)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting
