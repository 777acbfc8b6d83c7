"""The root of every error trace-plugin raises, so that callers can catch ours in one clause.

Each error is defined where it happens and keeps a builtin base too
(``class SpecError(TracePluginError, ValueError)``), so ``except ValueError`` still holds.
"""


class TracePluginError(Exception):
    """Something trace-plugin refused or could not do."""
