"""A light, read-only web view of the store: ``trace-plugin dashboard``."""

from trace_plugin.dashboard.app import create_dashboard

__all__ = ["create_dashboard"]
