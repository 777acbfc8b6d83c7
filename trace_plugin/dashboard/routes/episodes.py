"""The episode list, one episode's page, and its exports."""

from __future__ import annotations

import re
from typing import Annotated, get_args
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.convertors import PathConvertor, register_url_convertor

from trace_plugin import export
from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.conversation import conversation
from trace_plugin.dashboard.params import blank, choice_value, text_value, time_value
from trace_plugin.dashboard.state import MAX_PAGE, PAGE_SIZE, READ_METHODS, Dashboard
from trace_plugin.payload import make_redactor
from trace_plugin.records.outcome import outcome_of
from trace_plugin.store.store import EpisodeFilter


class _Id(PathConvertor):
    """A path parameter that is the rest of the path, line breaks included (``path``'s
    ``.*`` stops at one, so an episode id holding CR or LF could not be reached)."""

    regex = "[\\s\\S]*"


register_url_convertor("id", _Id())


router = APIRouter()


@router.api_route("/", methods=READ_METHODS, include_in_schema=False)
def index() -> RedirectResponse:
    return RedirectResponse("/episodes", status_code=307)


@router.api_route("/episodes", methods=READ_METHODS)
def episodes(
    dashboard: Dashboard,
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
    source = text_value(source, "source")
    where = EpisodeFilter(
        agent=text_value(agent, "agent"),
        outcome=choice_value(outcome, q.OUTCOMES, "outcome"),
        status=choice_value(status, q.STATUSES, "status"),
        sources=(source,) if source else (),
        adapter=text_value(adapter, "adapter"),
        router=text_value(router, "router"),
        since=time_value(since, "since"),
        until=time_value(until, "until"),
    )
    total = q.count_episodes(dashboard.engine, where)
    rows = q.list_episodes(dashboard.engine, where, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
    form = {
        "agent": where.agent,
        "outcome": where.outcome,
        "status": where.status,
        "source": source,
        "adapter": where.adapter,
        "router": where.router,
        "since": blank(since),
        "until": blank(until),
    }
    active = {k: v for k, v in form.items() if v is not None}

    def link(n: int) -> str:
        return "/episodes?" + urlencode({**active, "page": n})

    pages = max(1, -(-total // PAGE_SIZE))
    return dashboard.render(
        "episodes.html",
        nav="episodes",
        rows=rows,
        total=total,
        form=form,
        facets=q.facets(dashboard.engine),
        outcomes=q.OUTCOMES,
        statuses=q.STATUSES,
        page=page,
        pages=pages,
        prev_link=link(page - 1) if page > 1 else None,
        next_link=link(page + 1) if page < pages else None,
    )


@router.api_route("/episodes/{episode_id:id}", methods=READ_METHODS)
def episode(dashboard: Dashboard, episode_id: str) -> HTMLResponse:
    found = dashboard.store.get_episode(episode_id)
    if found is None:
        raise HTTPException(404, f"no episode {episode_id}")
    return dashboard.render(
        "episode.html",
        nav="episodes",
        episode=found,
        outcome=outcome_of(found.label, found.reward),
        messages=conversation(found),
        feedback=dashboard.store.feedback_for(episode_id),
        exports=get_args(export.Format),
    )


@router.api_route("/export/{format}/{episode_id:id}", methods=READ_METHODS)
def export_episode(dashboard: Dashboard, format: str, episode_id: str, redact: bool = False) -> Response:
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
    found = dashboard.store.get_episode(episode_id)
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
