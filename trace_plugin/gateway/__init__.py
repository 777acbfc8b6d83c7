"""The OpenAI-compatible gateway (needs the ``serve`` extra; the embedded backend, ``train``).

Its public face: ``serve_embedded`` runs the gateway in front of the embedded model on
a background thread of this process (a ``RunningServer``), configured by a
``GatewayConfig``; ``GatewayAdmin`` is a client of its admin API (loading
adapters, setting routers). Each is imported on first use, so that what imports only the
admin client or adapter names does not load the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trace_plugin.gateway.admin_client import GatewayAdmin
    from trace_plugin.gateway.app import GatewayConfig, GatewayConfigError
    from trace_plugin.gateway.server import RunningServer, serve_embedded

_HOME = {
    "GatewayAdmin": "admin_client",
    "GatewayConfig": "app",
    "GatewayConfigError": "app",
    "RunningServer": "server",
    "serve_embedded": "server",
}
__all__ = ["GatewayAdmin", "GatewayConfig", "GatewayConfigError", "RunningServer", "serve_embedded"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
