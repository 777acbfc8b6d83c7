"""The ``trace-plugin`` command line: one module per command group, each registering its
commands on ``app`` (the console script's entry point, ``trace_plugin.cli:app``), in the
order ``--help`` lists them. Heavy imports stay inside the commands, so ``--help`` stays
fast."""

import importlib

from trace_plugin.cli.common import app

for _group in ("records", "serving", "mining", "environments", "exports", "loop"):
    importlib.import_module(f"{__name__}.{_group}")

__all__ = ["app"]
