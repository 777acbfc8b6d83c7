"""Environments: the shared protocol, the bundled retail target, and the runner."""

from trace_plugin.environments.base import (
    Environment,
    RewardBreakdown,
    Target,
    Task,
    ToolCall,
    observation_error,
    offered_tools,
    task_key,
)

__all__ = [
    "Environment",
    "RewardBreakdown",
    "Target",
    "Task",
    "ToolCall",
    "observation_error",
    "offered_tools",
    "task_key",
]
