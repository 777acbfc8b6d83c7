"""The improver's cycles, experts and deployments, per agent."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from trace_plugin.dashboard import improver_page as imp
from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.params import text_value
from trace_plugin.dashboard.state import READ_METHODS, Dashboard

router = APIRouter()


@router.api_route("/improver", methods=READ_METHODS)
def improver(dashboard: Dashboard, agent: str | None = None) -> HTMLResponse:
    """The improver's work for one agent (the first it worked on by default): its cycles,
    the experts they trained and the deployments they made."""
    agents = q.improver_agents(dashboard.engine)
    chosen = text_value(agent, "agent") or (agents[0] if agents else None)
    deployments = imp.deployments(dashboard.store, dashboard.engine, chosen) if chosen else []
    return dashboard.render(
        "improver.html",
        nav="improver",
        agents=agents,
        agent=chosen,
        cycles=imp.cycles(dashboard.store, chosen) if chosen else [],
        experts=imp.expert_curves(dashboard.store, chosen) if chosen else [],
        deployments=deployments,
        statuses={v.deployment.id: v.deployment.status for v in deployments},
        max_cycles=imp.MAX_CYCLES,
    )
