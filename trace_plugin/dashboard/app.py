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

import hmac
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, get_args
from urllib.parse import quote, urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import RequestResponseEndpoint

from trace_plugin import export
from trace_plugin.dashboard import improver_page as imp
from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.conversation import conversation, pretty
from trace_plugin.dashboard.plot import build_plot
from trace_plugin.gateway.state import is_loopback
from trace_plugin.payload import make_redactor
from trace_plugin.records.outcome import outcome_of
from trace_plugin.store import Store
from trace_plugin.store.store import EpisodeFilter

PAGE_SIZE = 50
TOKEN_COOKIE = "trace_dashboard_token"
# The last page whose offset both databases can take: OFFSET is a signed 64-bit integer.
MAX_PAGE = (2**63 - 1) // PAGE_SIZE
SAFE_METHODS = {"GET", "HEAD"}
READ_METHODS = sorted(SAFE_METHODS)  # every route's: HEAD runs as GET, and the server drops its body
SECURITY_HEADERS = {
    # No script may run: a payload that slipped past escaping would stay inert.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


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


def _blank(value: str | None) -> str | None:
    """Empty form fields arrive as ``name=``: they mean no filter."""
    if value is None:
        return None
    return value.strip() or None


def _text(value: str | None, name: str) -> str | None:
    """A free-text filter. PostgreSQL cannot hold a NUL, so no stored value has one (the
    store replaces it) and a filter with one is refused rather than sent to the database."""
    value = _blank(value)
    if value is not None and "\x00" in value:
        raise HTTPException(400, f"{name}: NUL characters are not allowed")
    return value


def _time(value: str | None, name: str) -> datetime | None:
    """A datetime-local field (or any ISO time) read as UTC unless it names its zone."""
    value = _blank(value)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
        # A zone can carry a time past year 1 or 9999, which no datetime holds in UTC.
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise HTTPException(400, f"{name}: not an ISO date or time in years 1 to 9999: {value!r}") from exc


def _choice(value: str | None, allowed: tuple[str, ...], name: str) -> Any:
    value = _blank(value)
    if value is not None and value not in allowed:
        raise HTTPException(400, f"{name} must be one of {', '.join(allowed)}")
    return value


class _Id(PathConvertor):
    """A path parameter that is the rest of the path, line breaks included (``path``'s
    ``.*`` stops at one, so an episode id holding CR or LF could not be reached)."""

    regex = "[\\s\\S]*"


register_url_convertor("id", _Id())


def create_dashboard(store: Store, admin_token: str | None = None) -> FastAPI:
    """The dashboard over ``store``; ``admin_token`` unlocks non-GET requests (none exist
    yet) and, once set, is needed by every client beyond loopback."""
    env = _environment()
    engine = store.engine.execution_options(sqlite_read=True)  # deferred BEGIN: never blocks writers
    app = FastAPI(
        title="trace-plugin dashboard", version="1", docs_url=None, redoc_url=None, openapi_url=None
    )

    def render(template: str, code: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render(**context), status_code=code)

    def error_page(code: int, message: str, headers: Mapping[str, str] | None = None) -> HTMLResponse:
        response = render("error.html", code, nav="", status=code, message=message)
        response.headers.update(headers or {})
        return response

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

    def holds_token(token: str) -> bool:
        # bytes: any header compares
        return admin_token is not None and hmac.compare_digest(token.encode(), admin_token.encode())

    @app.middleware("http")
    async def _guard(request: Request, call_next: RequestResponseEndpoint) -> Response:
        """Refuses changes without the token, and with a token set, every page to a client
        beyond loopback without it; every answer leaving here, the refusals included, gets
        the security headers."""
        token, in_query = supplied(request)
        authorized = holds_token(token)
        host = request.client.host if request.client else ""
        if admin_token is not None and not authorized and not is_loopback(host):
            return secured(
                error_page(401, "this dashboard needs its token (?token=, or 'Authorization: Bearer')")
            )
        if request.method not in SAFE_METHODS and not authorized:
            return secured(
                error_page(403, "the dashboard is read-only; changes need 'Authorization: Bearer <token>'")
            )
        response = await call_next(request)
        if in_query and authorized:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return secured(response)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's subclass and the router's 404/405
    async def _error(_: Request, exc: StarletteHTTPException) -> HTMLResponse:
        return error_page(exc.status_code, exc.detail, exc.headers)  # a 405 keeps its Allow

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> HTMLResponse:
        """A value its parameter's type refuses (``page=x``, a page past MAX_PAGE): a 400
        page like the other bad values, not FastAPI's 422 JSON."""
        return error_page(400, "; ".join(f"{e['loc'][-1]}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> Response:
        """Starlette answers an unhandled error outside every middleware (and logs it), so
        this page sets the security headers itself."""
        return secured(error_page(500, "internal error; the server's log has the details"))

    @app.api_route("/", methods=READ_METHODS, include_in_schema=False)
    def index() -> RedirectResponse:
        return RedirectResponse("/episodes", status_code=307)

    @app.api_route("/episodes", methods=READ_METHODS)
    def episodes(
        agent: str | None = None,
        outcome: str | None = None,
        status: str | None = None,
        source: str | None = None,
        adapter: str | None = None,
        router: str | None = None,
        since: str | None = None,
        until: str | None = None,
        page: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1,
    ) -> HTMLResponse:
        source = _text(source, "source")
        where = EpisodeFilter(
            agent=_text(agent, "agent"),
            outcome=_choice(outcome, q.OUTCOMES, "outcome"),
            status=_choice(status, q.STATUSES, "status"),
            sources=(source,) if source else (),
            adapter=_text(adapter, "adapter"),
            router=_text(router, "router"),
            since=_time(since, "since"),
            until=_time(until, "until"),
        )
        total = q.count_episodes(engine, where)
        rows = q.list_episodes(engine, where, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
        form = {
            "agent": where.agent,
            "outcome": where.outcome,
            "status": where.status,
            "source": source,
            "adapter": where.adapter,
            "router": where.router,
            "since": _blank(since),
            "until": _blank(until),
        }
        active = {k: v for k, v in form.items() if v is not None}

        def link(n: int) -> str:
            return "/episodes?" + urlencode({**active, "page": n})

        pages = max(1, -(-total // PAGE_SIZE))
        return render(
            "episodes.html",
            nav="episodes",
            rows=rows,
            total=total,
            form=form,
            facets=q.facets(engine),
            outcomes=q.OUTCOMES,
            statuses=q.STATUSES,
            page=page,
            pages=pages,
            prev_link=link(page - 1) if page > 1 else None,
            next_link=link(page + 1) if page < pages else None,
        )

    @app.api_route("/episodes/{episode_id:id}", methods=READ_METHODS)
    def episode(episode_id: str) -> HTMLResponse:
        found = store.get_episode(episode_id)
        if found is None:
            raise HTTPException(404, f"no episode {episode_id}")
        return render(
            "episode.html",
            nav="episodes",
            episode=found,
            outcome=outcome_of(found.label, found.reward),
            messages=conversation(found),
            feedback=store.feedback_for(episode_id),
            exports=get_args(export.Format),
        )

    @app.api_route("/export/{format}/{episode_id:id}", methods=READ_METHODS)
    def export_episode(format: str, episode_id: str, redact: bool = False) -> Response:
        """One episode as ``trace-plugin export dataset --format FORMAT [--redact]`` writes
        it, to download. The id is taken exactly as the page links it (spaces, CR and LF
        included): the store holds ids as given."""
        formats = get_args(export.Format)
        if format not in formats:
            raise HTTPException(400, f"format must be one of {', '.join(formats)}")
        if "\x00" in episode_id:
            raise HTTPException(400, "episode: NUL characters are not allowed")
        if redact and format == "tokens":
            raise HTTPException(400, "token ids cannot be redacted: export messages (openai or trl) instead")
        found = store.get_episode(episode_id)
        if found is None:
            raise HTTPException(404, f"no episode {episode_id}")
        rows = export.episode_rows(found, format, make_redactor(redact))
        if isinstance(rows, str):
            raise HTTPException(404, f"episode {episode_id} gives no {format} rows: {rows}")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", episode_id)[:100] + (".redacted" if redact else "")
        return Response(
            b"".join(map(export.jsonl, rows)),
            media_type="application/jsonl",
            headers={"Content-Disposition": f'attachment; filename="{name}.{format}.jsonl"'},
        )

    @app.api_route("/success", methods=READ_METHODS)
    def success(
        agent: str | None = None, bucket: str = "auto", since: str | None = None, until: str | None = None
    ) -> HTMLResponse:
        """Success over time; the ``auto`` bucket fits the data's time range."""
        agent = _text(agent, "agent")
        start, end = _time(since, "since"), _time(until, "until")
        chosen = _choice(bucket, ("auto", *get_args(q.Bucket)), "bucket") or "auto"
        size = q.fitting_bucket(engine, agent=agent, since=start, until=end) if chosen == "auto" else chosen
        canaries = q.canary_routers(engine, agent)
        stats = q.success_buckets(engine, size, agent=agent, since=start, until=end, canaries=canaries)
        markers = q.deployment_markers(engine, agent)
        return render(
            "success.html",
            nav="success",
            plot=build_plot(stats, size, markers),
            stats=stats,
            markers=markers,
            form={"agent": agent, "bucket": chosen, "since": _blank(since), "until": _blank(until)},
            agents=q.facets(engine).agents,
            buckets=("auto", *get_args(q.Bucket)),
            bucket=size,
        )

    @app.api_route("/capabilities", methods=READ_METHODS)
    def capabilities(agent: str | None = None, run: str | None = None) -> HTMLResponse:
        agent, run = _text(agent, "agent"), _text(run, "run")
        mined = q.capability_agents(engine)
        chosen = agent or (mined[0] if mined else None)
        runs = q.mining_runs(engine, chosen) if chosen else []
        # A run of the agent picked before may still be in the form: the latest run then.
        chosen_run = run if run in {r.id for r in runs} else (runs[0].id if runs else None)
        found = store.capabilities(chosen, chosen_run) if chosen and chosen_run else []
        return render(
            "capabilities.html",
            nav="capabilities",
            agents=q.facets(engine).agents,
            agent=chosen,
            runs=runs,
            run=chosen_run,
            capabilities=found,
            stages=q.stage_tables(engine, chosen),
        )

    @app.api_route("/improver", methods=READ_METHODS)
    def improver(agent: str | None = None) -> HTMLResponse:
        """The improver's work for one agent (the first it worked on by default): its cycles,
        the experts they trained and the deployments they made."""
        agents = q.improver_agents(engine)
        chosen = _text(agent, "agent") or (agents[0] if agents else None)
        deployments = imp.deployments(store, engine, chosen) if chosen else []
        return render(
            "improver.html",
            nav="improver",
            agents=agents,
            agent=chosen,
            cycles=imp.cycles(store, chosen) if chosen else [],
            experts=imp.expert_curves(store, chosen) if chosen else [],
            deployments=deployments,
            statuses={v.deployment.id: v.deployment.status for v in deployments},
            max_cycles=imp.MAX_CYCLES,
        )

    return app
