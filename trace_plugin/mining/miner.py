"""The offline miner: detectors label every episode, the selection rule picks capabilities.

It needs no LLM. Episodes come from any capture source; their outcome is their label when
they have one, else whether their reward reached 1. Episodes with no outcome are skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from trace_plugin.mining.detectors import Call, Role, Trajectory
from trace_plugin.mining.kinds import KINDS, label_episode
from trace_plugin.mining.selection import (
    DEFAULT_RULE,
    Label,
    Selection,
    SelectionRule,
    bootstrap_runs,
    select,
)
from trace_plugin.records.capability import Capability
from trace_plugin.records.outcome import succeeded
from trace_plugin.records.trajectory import Episode, new_id
from trace_plugin.store import Store

MAX_EXAMPLES = 5


def outcome(episode: Episode) -> bool | None:
    """Success, failure, or unknown (None), by the one rule in ``trace_plugin.records.outcome``."""
    return succeeded(episode.label, episode.reward)


@dataclass
class OfflineMiner:
    """Mines an agent's stored episodes with the generic detectors and TRACE's rule."""

    store: Store
    rule: SelectionRule = DEFAULT_RULE
    roles: Mapping[str, Role] | None = None  # tool name -> read/write, where names mislead
    seed: int = 0

    def mine(
        self, agent: str, *, limit: int | None = None, since: datetime | None = None, save: bool = True
    ) -> list[Capability]:
        """Mine the agent's episodes with a known outcome (at most ``limit``, the newest,
        started at ``since`` or later)."""
        episodes = self.store.load_episodes(agent, limit=limit, since=since)
        episodes = [e for e in episodes if outcome(e) is not None]
        capabilities = mine_episodes(episodes, rule=self.rule, roles=self.roles, seed=self.seed)
        if save:
            self.store.save_capabilities(agent, capabilities)
        return capabilities


def mine_episodes(
    episodes: Sequence[Episode],
    *,
    rule: SelectionRule = DEFAULT_RULE,
    roles: Mapping[str, Role] | None = None,
    seed: int = 0,
) -> list[Capability]:
    """Label ``episodes`` (each with a known outcome) and apply the rule over bootstrap runs."""
    success = [bool(outcome(e)) for e in episodes]
    trajectories = [Trajectory.from_episode(e) for e in episodes]
    per_episode = [label_episode(t, roles) for t in trajectories]
    labels = {name: [labels[name] for labels in per_episode] for name in KINDS}
    run = new_id()
    capabilities = []
    for selection in select(bootstrap_runs(labels, success, rule.n, seed=seed), rule):
        lacking_failed = [
            i for i, ok in enumerate(success) if not ok and labels[selection.capability][i] is Label.LACKING
        ]
        tools, entities = involved([c for i in lacking_failed for c in trajectories[i].offered_calls()])
        capabilities.append(
            Capability(
                name=selection.capability,
                description=KINDS[selection.capability].description,
                source="detector",
                selected=selection.selected,
                metrics=_metrics(selection, rule),
                examples=[episodes[i].id for i in lacking_failed[:MAX_EXAMPLES]],
                tools=tools,
                entities=entities,
                mining_run=run,
            )
        )
    return capabilities


def involved(calls: Sequence[Call]) -> tuple[list[str], list[str]]:
    """The tools called and the entities they acted on (``order`` for ``order_id``), most
    frequent first."""
    tools = Counter(c.name for c in calls)
    entities = Counter(
        name.removesuffix("_ids").removesuffix("_id")
        for c in calls
        for name in c.arguments
        if name.endswith(("_id", "_ids"))
    )
    return [t for t, _ in tools.most_common()], [e for e, _ in entities.most_common()]


def _metrics(selection: Selection, rule: SelectionRule) -> dict:
    return {
        "coverage": round(selection.mean_coverage, 4),
        "contrast": round(selection.mean_contrast, 4),
        "passed": selection.passed,
        "runs": len(selection.runs),
        "selected_by": selection.reason if selection.selected else None,
        "rule": {"rho": rule.rho, "delta": rule.delta, "k": rule.k, "n": rule.n, "pervasive": rule.pervasive},
    }
