"""The dashboard's state, which every route reads: the store, its read engine, the
templates, and the token; routes take it as a parameter (``Dashboard``), as the
gateway's take ``GatewayState``."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from sqlalchemy import Engine

from trace_plugin.dashboard.conversation import pretty
from trace_plugin.store import Store

PAGE_SIZE = 50
# The last page whose offset both databases can take: OFFSET is a signed 64-bit integer.
MAX_PAGE = (2**63 - 1) // PAGE_SIZE
SAFE_METHODS = {"GET", "HEAD"}
READ_METHODS = sorted(SAFE_METHODS)  # every route's: HEAD runs as GET, and the server drops its body


@dataclass
class DashboardState:
    store: Store
    admin_token: str | None = None
    engine: Engine = field(init=False)  # reads only: a deferred BEGIN never blocks writers
    env: Environment = field(init=False)

    def __post_init__(self) -> None:
        self.engine = self.store.engine.execution_options(sqlite_read=True)
        self.env = _environment()

    def render(self, template: str, code: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(self.env.get_template(template).render(**context), status_code=code)

    def error_page(self, code: int, message: str, headers: Mapping[str, str] | None = None) -> HTMLResponse:
        response = self.render("error.html", code, nav="", status=code, message=message)
        response.headers.update(headers or {})
        return response

    def holds_token(self, token: str) -> bool:
        # bytes: any header compares
        return self.admin_token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode())


def dashboard_state(request: Request) -> DashboardState:
    return request.app.state.dashboard


Dashboard = Annotated[DashboardState, Depends(dashboard_state)]  # a route's parameter: the app's state


def _when(value: datetime | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return value.astimezone(UTC).strftime(fmt) if value else "—"


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(Path(__file__).with_name("templates")),
        autoescape=True,  # every template, SVG included: labels come from captured data
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=_when, num=_num, pretty=pretty, quote=lambda s: quote(str(s), safe=""))
    return env
