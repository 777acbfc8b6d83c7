"""Between cycles: whether a cycle is due, and rolling back a deployment that made things worse.

Both read success rates straight from the store (:meth:`~trace_plugin.store.Store.outcome_windows`,
one query each, by the success rule of :mod:`trace_plugin.records.outcome`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from trace_plugin.records.deployment import Deployment
from trace_plugin.records.trajectory import utcnow

if TYPE_CHECKING:
    from trace_plugin.improver.loop import Improver


def due(improver: Improver) -> bool:
    """Whether a trigger fired: new labeled episodes, the failure rate, or the schedule."""
    store, config = improver.store, improver.config
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


def monitor(improver: Improver) -> Deployment | None:
    """Roll the live deployment back when its success rate fell below the previous one's."""
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
