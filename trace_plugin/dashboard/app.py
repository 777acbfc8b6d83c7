"""The read-only web dashboard: episodes, success over time, mined capabilities, and the
improver's cycles, experts and deployments.

``create_dashboard(store)`` returns a FastAPI app rendering Jinja2 templates on the server,
with no script at all: filters are plain GET forms and the plot is inline SVG. Everything
captured is untrusted (prompts, tool arguments and results come from users and tools), so
templates autoescape and the Content-Security-Policy forbids scripts besides.

Every route only reads, and answers GET and HEAD. A request with any other method is
refused unless it carries the token (``admin_token``), so actions added later (relabel an
episode, promote a deployment) are admin-only from the start; without a token configured
the dashboard refuses them all. With a token, clients beyond loopback get no page at all
without it: exports are raw episodes. It travels as ``Authorization: Bearer <token>``, or
once as ``?token=`` in a browser, which then keeps it in a same-site, HTTP-only cookie.

Query values are checked before any query runs: a value the databases cannot hold (a NUL,
a page past a 64-bit offset) is a 400 page, never a database error. Every answer, the
guard's 403 and error pages included, carries the security headers.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import RequestResponseEndpoint

from trace_plugin.dashboard.routes import capabilities, episodes, improver, success
from trace_plugin.dashboard.state import MAX_PAGE, SAFE_METHODS, DashboardState
from trace_plugin.gateway.state import is_loopback
from trace_plugin.store import Store

__all__ = ["MAX_PAGE", "SECURITY_HEADERS", "TOKEN_COOKIE", "create_dashboard"]

TOKEN_COOKIE = "trace_dashboard_token"
SECURITY_HEADERS = {
    # No script may run: a payload that slipped past escaping would stay inert.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def create_dashboard(store: Store, admin_token: str | None = None) -> FastAPI:
    """The dashboard over ``store``: its routers over one ``DashboardState``, behind the
    guard. ``admin_token`` unlocks non-GET requests (none exist yet) and, once set, is
    needed by every client beyond loopback."""
    app = FastAPI(
        title="trace-plugin dashboard", version="1", docs_url=None, redoc_url=None, openapi_url=None
    )
    state = app.state.dashboard = DashboardState(store, admin_token)

    def secured(response: Response) -> Response:
        response.headers.update(SECURITY_HEADERS)
        return response

    def supplied(request: Request) -> tuple[str, bool]:
        """The token the request carries, and whether it came in the query (to keep)."""
        bearer = request.headers.get("authorization", "")
        if bearer.startswith("Bearer "):
            return bearer.removeprefix("Bearer "), False
        if "token" in request.query_params:
            return request.query_params["token"], True
        return request.cookies.get(TOKEN_COOKIE, ""), False

    @app.middleware("http")
    async def _guard(request: Request, call_next: RequestResponseEndpoint) -> Response:
        """Refuses changes without the token, and with a token set, every page to a client
        beyond loopback without it; every answer leaving here, the refusals included, gets
        the security headers."""
        token, in_query = supplied(request)
        authorized = state.holds_token(token)
        host = request.client.host if request.client else ""
        if admin_token is not None and not authorized and not is_loopback(host):
            return secured(
                state.error_page(401, "this dashboard needs its token (?token=, or 'Authorization: Bearer')")
            )
        if request.method not in SAFE_METHODS and not authorized:
            return secured(
                state.error_page(
                    403, "the dashboard is read-only; changes need 'Authorization: Bearer <token>'"
                )
            )
        response = await call_next(request)
        if in_query and authorized:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return secured(response)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's subclass and the router's 404/405
    async def _error(_: Request, exc: StarletteHTTPException) -> HTMLResponse:
        return state.error_page(exc.status_code, exc.detail, exc.headers)  # a 405 keeps its Allow

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> HTMLResponse:
        """A value its parameter's type refuses (``page=x``, a page past MAX_PAGE): a 400
        page like the other bad values, not FastAPI's 422 JSON."""
        return state.error_page(400, "; ".join(f"{e['loc'][-1]}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> Response:
        """Starlette answers an unhandled error outside every middleware (and logs it), so
        this page sets the security headers itself."""
        return secured(state.error_page(500, "internal error; the server's log has the details"))

    for module in (episodes, success, capabilities, improver):
        app.include_router(module.router)
    return app
