"""Every error trace-plugin defines has one root, and keeps its builtin base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from trace_plugin.errors import TracePluginError
from trace_plugin.records.env_spec import SpecError, parse_spec


def project_exceptions() -> list[type[BaseException]]:
    found = []
    for package in ("trace_plugin", "training", "integrations", "mcp_server"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if ".migrations" in info.name or info.name.endswith("__main__"):
                continue  # Alembic scripts; the CLI entry point runs on import
            module = importlib.import_module(info.name)
            found += [
                value
                for value in vars(module).values()
                if inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ]
    return found


def test_every_project_error_derives_from_the_root():
    errors = project_exceptions()
    assert len(errors) >= 10
    assert [e.__qualname__ for e in errors if not issubclass(e, TracePluginError)] == []


def test_an_error_still_matches_its_builtin_base():
    with pytest.raises(ValueError) as caught:
        parse_spec("{not json")
    assert isinstance(caught.value, SpecError) and isinstance(caught.value, TracePluginError)
