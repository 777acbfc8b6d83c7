"""Mined capabilities, per agent and mining run."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.params import text_value
from trace_plugin.dashboard.state import READ_METHODS, Dashboard

router = APIRouter()


@router.api_route("/capabilities", methods=READ_METHODS)
def capabilities(dashboard: Dashboard, agent: str | None = None, run: str | None = None) -> HTMLResponse:
    agent, run = text_value(agent, "agent"), text_value(run, "run")
    mined = q.capability_agents(dashboard.engine)
    chosen = agent or (mined[0] if mined else None)
    runs = q.mining_runs(dashboard.engine, chosen) if chosen else []
    # A run of the agent picked before may still be in the form: the latest run then.
    chosen_run = run if run in {r.id for r in runs} else (runs[0].id if runs else None)
    found = dashboard.store.capabilities(chosen, chosen_run) if chosen and chosen_run else []
    return dashboard.render(
        "capabilities.html",
        nav="capabilities",
        agents=q.facets(dashboard.engine).agents,
        agent=chosen,
        runs=runs,
        run=chosen_run,
        capabilities=found,
        stages=q.stage_tables(dashboard.engine, chosen),
    )
