"""Between cycles: whether a cycle is due, and rolling back a deployment that made things worse.

Both read success rates straight from the store (``outcome_windows``,
one query each, by the success rule of ``trace_plugin.records.outcome``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from trace_plugin.records.deployment import Deployment
from trace_plugin.records.router_spec import StaticSpec, router_version
from trace_plugin.records.trajectory import utcnow

if TYPE_CHECKING:
    from trace_plugin.improver.context import CycleContext


def due(improver: CycleContext) -> bool:
    """Whether a trigger fired: new labeled episodes, the failure rate, or the schedule.
    Never while a canary is on trial: its verdict comes first."""
    store, config = improver.store, improver.config
    if improver.canary() is not None:
        return False
    cycles = [j for j in store.jobs(config.agent) if j.stage == "cycle"]
    if any(j.status == "running" for j in cycles):
        return True
    since = cycles[-1].started_at if cycles else None
    [recent] = store.outcome_windows(config.agent, [since])
    if recent.labeled >= config.min_new_episodes:
        return True
    if config.max_failure_rate is not None and recent.labeled:
        failures = (recent.labeled - recent.successes) / recent.labeled
        if failures >= config.max_failure_rate:
            return True
    if config.every_seconds is not None and since is not None:
        return (utcnow() - since).total_seconds() >= config.every_seconds
    return False


def monitor(improver: CycleContext) -> Deployment | None:
    """Judge a canary on trial (``judge_canary``), else roll the live deployment back
    when its success rate fell below the previous one's. Returns what is live after a change."""
    trial = improver.canary()
    if trial is not None:
        return judge_canary(improver, trial)
    store, config = improver.store, improver.config
    deployments = store.deployments(config.agent)
    live = [d for d in deployments if d.status == "live"]
    if not live:
        return None
    current = live[-1]
    earlier = [d for d in deployments if d.created_at < current.created_at and d.status == "superseded"]
    if not earlier:
        return None
    previous = earlier[-1]
    before, now = store.outcome_windows(
        config.agent, [previous.created_at, current.created_at], last=config.monitor_window
    )
    now_rate, before_rate, window = now.success_rate, before.success_rate, now.labeled
    if window < config.monitor_window or now_rate is None or before_rate is None:
        return None
    if now_rate >= before_rate - config.rollback_drop:
        return None
    asyncio.run(improver.gateway.set_router(previous.router))
    current.status = "rolled_back"
    current.reasons = [
        *current.reasons,
        f"live success {now_rate:.2f} over {window} episodes fell below {before_rate:.2f} "
        f"(the previous deployment) by more than {config.rollback_drop}",
    ]
    store.make_live(previous, retire=current)  # one transaction: never no live deployment
    improver.console.log(f"[red]rolled back {current.id}[/]: {current.reasons[-1]}")
    return previous


def judge_canary(improver: CycleContext, trial: Deployment) -> Deployment | None:
    """Once the canary and the rest of the traffic each have ``monitor_window`` episodes
    with an outcome since it went out, promote it, or roll it back when its success rate
    is more than ``rollback_drop`` below the rest's. None while the window fills, until
    ``canary_deadline``: then it is judged on what it has when each arm has half the
    window, and rolled back otherwise."""
    store, config = improver.store, improver.config
    window = config.monitor_window
    served, rest = store.arm_outcomes(
        config.agent, trial.updated_at, router_version(trial.router), last=window
    )
    episodes = min(served.labeled, rest.labeled)
    at_deadline = ""
    if episodes < window:
        if (utcnow() - trial.updated_at).total_seconds() < config.canary_deadline:
            return None
        if episodes < (window + 1) // 2:
            return _roll_back_canary(
                improver, trial, f"rolled back: deadline passed with {episodes} of {window} episodes"
            )
        at_deadline = f"decided at deadline on {episodes} of {window} episodes: "
    canary_rate, rest_rate = served.success_rate or 0.0, rest.success_rate or 0.0
    figures = (
        f"canary success {canary_rate:.2f} over {served.recent} episodes against {rest_rate:.2f}"
        f" over {rest.recent} for the rest"
    )
    if canary_rate < rest_rate - config.rollback_drop:
        return _roll_back_canary(
            improver, trial, f"{at_deadline}{figures}: more than {config.rollback_drop} below"
        )
    asyncio.run(improver.gateway.set_router(trial.router))
    trial.reasons = [*trial.reasons, f"{at_deadline}promoted: {figures}"]
    trial.end_trial("promoted")
    store.make_live(trial)  # one transaction: the live one before is superseded
    improver.console.log(f"[green]promoted canary {trial.id}[/]: {trial.reasons[-1]}")
    return trial


def _roll_back_canary(improver: CycleContext, trial: Deployment, reason: str) -> Deployment | None:
    """All the traffic back to the live deployment (the base model without one); returns it."""
    live = improver.live()
    asyncio.run(improver.gateway.set_router(live.router if live else StaticSpec().to_dict()))
    trial.status, trial.reasons = "rolled_back", [*trial.reasons, reason]
    trial.end_trial("rolled_back")
    improver.store.save_deployment(trial)
    improver.console.log(f"[red]rolled back canary {trial.id}[/]: {reason}")
    return live
