"""The web apps' public surface, against a snapshot: the gateway's OpenAPI schema and the
dashboard's routes. A restructuring (the gateway's routers, the dashboard's) must leave
both as they were; a change meant to change them rewrites the snapshot on purpose:

    TRACE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_route_snapshots.py
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from support.backends import ScriptedBackend

from trace_plugin.dashboard import create_dashboard
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.model_files import load_tokenizer
from trace_plugin.store import Store

SNAPSHOTS = Path(__file__).parent / "snapshots"


def matches_snapshot(name: str, value: Any) -> None:
    path = SNAPSHOTS / name
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    if os.environ.get("TRACE_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path}: write it with TRACE_UPDATE_SNAPSHOTS=1"
    assert json.loads(path.read_text()) == value, f"{name} changed: see the module docstring"


def test_the_gateway_openapi_schema_is_the_snapshot(tmp_path: Path) -> None:
    app = create_app(ScriptedBackend(load_tokenizer()), config=GatewayConfig(adapter_root=tmp_path))
    schema = app.openapi()
    assert len(schema["paths"]) >= 10  # a schema, not an empty app
    matches_snapshot("gateway-openapi.json", schema)


def test_the_dashboards_routes_are_the_snapshot(sqlite_url: str) -> None:
    """The dashboard serves no OpenAPI schema, but builds one: its paths, methods and
    parameters are the snapshot (descriptions left out: a docstring may change)."""
    store = Store(sqlite_url)
    store.upgrade()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GET and HEAD share an operation id, as served
        schema = create_dashboard(store).openapi()
    store.close()
    routes = {
        path: {
            method: sorted(
                (p["name"], p["in"], p.get("required", False), json.dumps(p.get("schema"), sort_keys=True))
                for p in operation.get("parameters", [])
            )
            for method, operation in operations.items()
        }
        for path, operations in schema["paths"].items()
    }
    assert "/improver" in routes and "/episodes" in routes
    matches_snapshot("dashboard-routes.json", json.loads(json.dumps(routes)))


@pytest.fixture(autouse=True)
def _snapshots_dir() -> None:
    SNAPSHOTS.mkdir(exist_ok=True)
