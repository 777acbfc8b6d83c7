"""The Improver page's view of the store: each cycle from its jobs, each expert's training
curves, each deployment with what it served.

The job ledger holds what each stage handed the next as plain dicts; the page reads them
back as the stage's typed output (``trace_plugin.records.stage_outputs``). A job this
version cannot read (older or newer) shows its stage as missing, never as a broken page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlencode

from sqlalchemy import Engine

from trace_plugin.dashboard import queries as q
from trace_plugin.dashboard.plot import Plot, build_curve_plot
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import SpecRecord
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job
from trace_plugin.records.router_spec import router_version
from trace_plugin.records.stage_outputs import (
    CycleEnd,
    Evaluation,
    Mined,
    Output,
    Routing,
    Screened,
    Summary,
    Synthesized,
    Trained,
    Verdict,
)
from trace_plugin.store import Store
from trace_plugin.store.store import EpisodeFilter

MAX_CYCLES = 50  # the newest shown; the job table keeps them all
ENDED = ("superseded", "rolled_back")  # took traffic, and no longer does
MS = timedelta(milliseconds=1)  # a datetime-local field holds milliseconds at most
OutputT = TypeVar("OutputT", bound=Output)


@dataclass(frozen=True, slots=True)
class MinedCapability:
    """A capability the cycle's mining selected, with its evidence from that mining pass."""

    name: str
    coverage: float | None
    contrast: float | None
    covered: bool  # the live deployment has an expert for it: not trained again


@dataclass(frozen=True, slots=True)
class Environment:
    """The environment synthesized for one capability, and its calibration on the base model."""

    capability: str
    name: str
    version: int
    status: str  # validated, out_of_band, rejected, or unsynthesizable
    reason: str
    band: tuple[float, float] | None  # the learnable mean reward, when calibrated
    mean_reward: float | None  # the last calibration attempt's
    verdict: str | None
    live: float | None = None  # the live agent's success there before training (the screen)
    trains: bool | None = None  # whether the screen let it train


@dataclass(frozen=True, slots=True)
class TrainedExpert:
    capability: str
    expert: str
    adapter_name: str
    noop: bool  # no gradient reached it: the base model again, not evaluated
    steps: int
    rollouts: int | None  # the budget it trained with
    reference_plays: int | None  # the verified plays that warm-started it (or at most this many)
    plays_exact: bool  # reference_plays is what it used, not only the most it might


@dataclass(frozen=True, slots=True)
class Composed:
    """The candidate router the cycle composed of the live experts and its own."""

    kind: str
    adapters: list[str]
    version: str
    gate: str | None  # for a learned gate: which choice won how many practice tasks


@dataclass(frozen=True, slots=True)
class FailedJob:
    stage: str
    key: str
    attempts: int
    error: str


@dataclass(slots=True)
class Cycle:
    id: str
    status: str
    started_at: datetime
    ended_at: datetime | None
    mined: list[MinedCapability] | None = None  # None until the mine stage is done
    environments: list[Environment] = field(default_factory=list)
    trained: list[TrainedExpert] = field(default_factory=list)
    composed: Composed | None = None
    accept: bool | None = None  # the verdict's; None before it (or when the cycle ended sooner)
    reasons: list[str] = field(default_factory=list)
    deployed: str | None = None
    ended_because: str | None = None  # why the cycle deployed nothing
    failed: list[FailedJob] = field(default_factory=list)
    running: str | None = None  # the stage a running job is in


@dataclass(frozen=True, slots=True)
class ExpertCurves:
    expert: Expert
    plot: Plot | None
    rollouts: int | None
    reference_plays: int | None
    plays_exact: bool


@dataclass(frozen=True, slots=True)
class Target:
    """One side of the target's held-out tasks: how many were played, the share solved."""

    n: int
    success: float


@dataclass(frozen=True, slots=True)
class DeploymentView:
    deployment: Deployment
    version: str  # the router version stamped on every episode it served
    promoted: bool  # went out as a canary and was promoted
    sent: float | None  # a canary's share of the traffic, as configured
    served: int | None  # the agent's episodes its router served while it was out; None: never out
    episodes: str | None  # the episode list of those
    share: tuple[int, int] | None  # a canary's: its episodes and all routed ones since it went out
    before: Target | None  # the live deployment on the target when this was evaluated
    after: Target | None  # this one there
    scores: dict[str, dict[str, float]]  # capability -> base, current, candidate on held-out seeds


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _training(expert: Expert | None) -> tuple[int | None, int | None, bool]:
    """Its rollout budget and warm-start plays: those it used, or for an expert from before
    they were kept the most its training config allowed (and False)."""
    config = expert.config if expert is not None else {}
    if expert is not None and expert.warm_start_plays is not None:
        return _int(config.get("rollout_budget")), expert.warm_start_plays, True
    return _int(config.get("rollout_budget")), _int(config.get("warm_start_plays")), False


def _read(kind: type[OutputT], outputs: dict[str, Any]) -> OutputT | None:
    """A done job's output as its stage's type; None for one this version cannot read."""
    try:
        return kind.from_dict(outputs)
    except (TypeError, KeyError, ValueError):  # RouterSpecError and pydantic's are ValueErrors
        return None


def _composed(outputs: dict[str, Any]) -> Composed:
    routing = _read(Routing, outputs)
    if routing is None:  # a router format this dashboard predates: its kind and version still show
        router = _dict(outputs.get("router"))
        return Composed(str(router.get("kind", "?")), [], router_version(router), None)
    gate = routing.gate
    labels = ", ".join(f"{k} {v}" for k, v in gate.labels.items()) if gate else ""
    fit = f"fitted on {gate.tasks} practice tasks: {labels}" if gate else None
    adapters = [a for a in routing.router.adapters() if a is not None]
    return Composed(routing.router.kind, adapters, router_version(routing.router), fit)


def _environment(
    specs: Mapping[tuple[str, int], SpecRecord], capability: str, synthesized: Synthesized
) -> Environment:
    record = specs.get((synthesized.env, synthesized.version))
    calibration = _dict(record.report.get("calibration")) if record is not None else {}
    band = _dict(calibration.get("band"))
    attempts = calibration.get("attempts") or [{}]
    low, high = _float(band.get("low")), _float(band.get("high"))
    return Environment(
        capability,
        synthesized.env,
        synthesized.version,
        synthesized.status,
        synthesized.reason,
        (low, high) if low is not None and high is not None else None,
        _float(_dict(attempts[-1]).get("mean_reward")),
        str(calibration["verdict"]) if calibration.get("verdict") else None,
    )


def cycles(store: Store, agent: str) -> list[Cycle]:
    """The agent's improver cycles, newest first: one per ``cycle`` job, filled in from the
    jobs of its stages and the records they name."""
    jobs: dict[str, list[Job]] = {}
    for job in store.jobs(agent):
        jobs.setdefault(job.cycle, []).append(job)
    heads = [j for js in jobs.values() for j in js if j.stage == "cycle"]
    heads.sort(key=lambda j: (j.started_at, j.cycle), reverse=True)
    experts = {e.id: e for e in store.experts(agent)}
    specs = {(r.spec.name, r.version): r for r in store.env_specs(agent)}  # each parsed once
    found = []
    for head in heads[:MAX_CYCLES]:
        cycle = Cycle(head.cycle, head.status, head.started_at, head.ended_at)
        screened: dict[str, tuple[float | None, bool]] = {}  # capability -> live success, trains
        for job in jobs[head.cycle]:
            if job.status == "failed":
                cycle.failed.append(FailedJob(job.stage, job.key, job.attempts, job.error or ""))
            elif job.status == "running" and job.stage != "cycle":
                cycle.running = job.stage if job.key == "all" else f"{job.stage} {job.key}"
            if job.status != "done" or job.outputs is None:
                continue
            _fill(cycle, job, screened, specs, experts, store, agent)
        cycle.environments = [
            replace(e, live=screened[e.capability][0], trains=screened[e.capability][1])
            if e.capability in screened
            else e
            for e in cycle.environments
        ]
        found.append(cycle)
    return found


def _fill(
    cycle: Cycle,
    job: Job,
    screened: dict[str, tuple[float | None, bool]],
    specs: Mapping[tuple[str, int], SpecRecord],
    experts: Mapping[str, Expert],
    store: Store,
    agent: str,
) -> None:
    """What a done stage job adds to its cycle's view."""
    out = job.outputs or {}
    if job.stage == "route":
        cycle.composed = _composed(out)
    elif job.stage == "mine" and (mined := _read(Mined, out)):
        cycle.mined = _mined(store, agent, mined)
    elif job.stage == "synthesize" and (synthesized := _read(Synthesized, out)):
        cycle.environments.append(_environment(specs, job.key, synthesized))
    elif job.stage == "screen" and (screen := _read(Screened, out)):
        screened[job.key] = (screen.success, screen.train)
    elif job.stage == "train" and (trained := _read(Trained, out)):
        cycle.trained.append(
            TrainedExpert(
                job.key,
                trained.expert,
                trained.adapter_name,
                trained.noop,
                len(trained.reward_curve),
                *_training(experts.get(trained.expert)),
            )
        )
    elif job.stage == "verdict" and (verdict := _read(Verdict, out)):
        cycle.accept, cycle.reasons = verdict.accept, list(verdict.reasons)
    elif job.stage == "cycle" and (end := _read(CycleEnd, out)):
        cycle.deployed, cycle.ended_because = end.deployed, end.reason


def _mined(store: Store, agent: str, mined: Mined) -> list[MinedCapability]:
    """The selected capabilities, with coverage and contrast from the mining pass the job
    names (a job from before it named one shows them as missing)."""
    run = mined.mining_run
    metrics = {c.name: c.metrics for c in store.capabilities(agent, run)} if run else {}
    return [
        MinedCapability(
            name,
            _float(metrics.get(name, {}).get("coverage")),
            _float(metrics.get(name, {}).get("contrast")),
            name in mined.covered,
        )
        for name in mined.selected
    ]


def expert_curves(store: Store, agent: str) -> list[ExpertCurves]:
    """Every expert of the agent, newest first, with its reward and un-hinted reward per step."""
    found = []
    for expert in reversed(store.experts(agent)):
        curves = {"reward": list(expert.reward_curve), "un-hinted reward": list(expert.unhinted_curve)}
        found.append(ExpertCurves(expert, build_curve_plot(curves), *_training(expert)))
    return found


def _target(summary: Summary) -> Target:
    return Target(summary.n, summary.success)


def _ms(at: datetime) -> datetime:
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def _local(at: datetime) -> str:
    """An instant as a datetime-local field takes it, in UTC (as the episode list reads it)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]


def deployments(store: Store, engine: Engine, agent: str) -> list[DeploymentView]:
    """The agent's deployments, newest first, each with the episodes its router served.

    Routers are named by their adapters' capabilities, so two deployments of the same
    capabilities share a router version: the episodes one served are those of its version
    from when it was recorded until it ended (when it was last updated)."""
    found = []
    for d in reversed(store.deployments(agent)):
        version, trial = router_version(d.router), d.canary or {}
        served, episodes, share = None, None, None
        if d.status != "rejected":
            # To the millisecond a field holds; the end is exclusive, so the next one.
            since, until = _ms(d.created_at), _ms(d.updated_at) + MS if d.status in ENDED else None
            where = EpisodeFilter(agent=agent, router=version, since=since, until=until)
            served = q.count_episodes(engine, where)
            window = {"since": _local(since), **({"until": _local(until)} if until else {})}
            episodes = "/episodes?" + urlencode({"agent": agent, "router": version, **window})
        if d.status == "canary":
            since = q.episodes_per_router(engine, agent, since=d.updated_at)
            share = (since.get(version, 0), sum(since.values()))
        evaluation = _read(Evaluation, d.evaluation)
        scores = {c: asdict(s) for c, s in evaluation.capabilities.items()} if evaluation else {}
        target = evaluation.target if evaluation else None
        found.append(
            DeploymentView(
                d,
                version,
                trial.get("outcome") == "promoted",
                trial.get("share"),
                served,
                episodes,
                share,
                _target(target.current) if target else None,
                _target(target.candidate) if target else None,
                scores,
            )
        )
    return found
