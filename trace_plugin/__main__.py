"""``python -m trace_plugin``: the same CLI as ``trace-plugin``."""

from trace_plugin.cli import app

app()
