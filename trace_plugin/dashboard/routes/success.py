"""Success over time, per agent, with deployments marked."""

from __future__ import annotations

from typing import get_args

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.params import blank, choice_value, text_value, time_value
from trace_plugin.dashboard.plot import build_plot
from trace_plugin.dashboard.state import READ_METHODS, Dashboard

router = APIRouter()


@router.api_route("/success", methods=READ_METHODS)
def success(
    dashboard: Dashboard,
    agent: str | None = None,
    bucket: str = "auto",
    since: str | None = None,
    until: str | None = None,
) -> HTMLResponse:
    """Success over time; the ``auto`` bucket fits the data's time range."""
    agent = text_value(agent, "agent")
    start, end = time_value(since, "since"), time_value(until, "until")
    chosen = choice_value(bucket, ("auto", *get_args(q.Bucket)), "bucket") or "auto"
    size = (
        q.fitting_bucket(dashboard.engine, agent=agent, since=start, until=end)
        if chosen == "auto"
        else chosen
    )
    canaries = q.canary_routers(dashboard.engine, agent)
    stats = q.success_buckets(dashboard.engine, size, agent=agent, since=start, until=end, canaries=canaries)
    markers = q.deployment_markers(dashboard.engine, agent)
    return dashboard.render(
        "success.html",
        nav="success",
        plot=build_plot(stats, size, markers),
        stats=stats,
        markers=markers,
        form={"agent": agent, "bucket": chosen, "since": blank(since), "until": blank(until)},
        agents=q.facets(dashboard.engine).agents,
        buckets=("auto", *get_args(q.Bucket)),
        bucket=size,
    )
