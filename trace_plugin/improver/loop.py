"""The improver itself: the lease, the persisted jobs, and one cycle through the stages."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from rich.console import Console

from trace_plugin.environments.runner import EpisodeResult
from trace_plugin.environments.synthesis import CapturedInterface
from trace_plugin.gateway.admin_client import GatewayAdmin
from trace_plugin.improver import evaluation, monitor, stages
from trace_plugin.improver.config import ImproverConfig
from trace_plugin.improver.errors import ConfigError, ImproverError
from trace_plugin.recorder import Recorder, default_recorder
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job, job_id
from trace_plugin.records.stage_outputs import (
    OUTPUTS,
    CycleEnd,
    Deployed,
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
from trace_plugin.records.trajectory import utcnow
from trace_plugin.store import Store
from trace_plugin.store.lease import Lease, LeaseHeld
from training.config import ExpertTrainingConfig

# Runs the agent on ``seeds`` of the target, with the gateway serving it as ``model``.
Evaluator = Callable[[str, Sequence[int]], Awaitable[list[EpisodeResult]]]
OutputT = TypeVar("OutputT", bound=Output)


class Improver:
    def __init__(
        self,
        store: Store,
        config: ImproverConfig,
        *,
        executor: Any = None,
        evaluator: Evaluator | None = None,
        recorder: Recorder | None = None,
        console: Console | None = None,
    ) -> None:
        if evaluator is None and config.target is None and config.target_seeds:
            # Found here, not by the evaluate stage after a cycle's training.
            raise ConfigError("target", "target_seeds need a target to play them in, or an evaluator")
        self.store, self.config = store, config
        self.executor = executor
        self.recorder = recorder or default_recorder()
        self.console = console or Console()
        self.gateway = GatewayAdmin(config.gateway_url, config.admin_token)
        self.evaluator = evaluator or self._chat_evaluator

    # -- the loop --------------------------------------------------------------------------

    def run_once(self, *, wait: float = 0.0) -> Deployment | None:
        """One cycle (``run_cycle``): the deployment it made, None when it deployed
        nothing new, and then it says why (``run_cycle`` returns the reason as data)."""
        end = self.run_cycle(wait=wait)
        if end.deployed is None:
            self.console.log(f"[yellow]no deployment: {end.reason}[/]")
        return next((d for d in self.store.deployments(self.config.agent) if d.id == end.deployed), None)

    def run_cycle(self, *, wait: float = 0.0) -> CycleEnd:
        """One cycle (resuming an unfinished one), and what it came to: the deployment it made
        or why none, and either way the experts it trained and the router it composed.

        Waits up to ``wait`` seconds for another improver of this agent (or the lease of a
        killed one) to let go; LeaseHeld after that.
        """
        deadline = time.monotonic() + wait
        lease = Lease(self.store, f"improver:{self.config.agent}", ttl=self.config.lease_ttl)
        while True:
            try:
                lease.acquire()
                break
            except LeaseHeld:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, self.config.lease_ttl / 3))
        try:
            return asyncio.run(self._cycle(self._open_cycle()))
        finally:
            lease.release()

    def watch(self, poll_seconds: float = 60.0) -> None:
        """Monitor and improve until interrupted."""
        while True:
            self.monitor()
            if self.due():
                self.run_once(wait=poll_seconds)
            time.sleep(poll_seconds)

    def due(self) -> bool:
        """Whether a trigger fired: new labeled episodes, the failure rate, or the schedule."""
        return monitor.due(self)

    def monitor(self) -> Deployment | None:
        """Promote or roll back a canary once its window is full or its deadline passed; roll
        the live deployment back when its success rate fell below the previous one's."""
        return monitor.monitor(self)

    def _open_cycle(self) -> str:
        running = [
            j for j in self.store.jobs(self.config.agent) if j.stage == "cycle" and j.status == "running"
        ]
        if running:
            self.console.log(f"resuming cycle {running[-1].cycle}")
            return running[-1].cycle
        cycle = utcnow().strftime("%Y%m%d%H%M%S") + "-" + secrets.token_hex(3)
        self.store.save_job(Job(self.config.agent, cycle, "cycle", "all"))
        return cycle

    async def _cycle(self, cycle: str) -> CycleEnd:
        agent = self.config.agent
        mined: Mined = await self.run_job(cycle, "mine", "all", lambda: stages.mine(self))
        trained: dict[str, Trained] = {}
        screened: dict[str, Screened] = {}
        untrained: dict[str, str] = {}  # capability -> why it was not trained
        covered = {e.capability for e in self.store.experts(agent) if e.status == "ready"}
        cap = self.config.max_capabilities
        for capability in mined.train:
            if len(trained) == self.config.max_experts:
                break
            new = {c for c in [*trained, capability] if c not in covered}
            if cap is not None and len(covered) + len(new) > cap:
                untrained[capability] = f"the agent would have experts for more than {cap} capabilities"
                continue
            env: Synthesized = await self.run_job(
                cycle, "synthesize", capability, lambda c=capability: self.synthesize(c)
            )
            if not env.trainable:
                untrained[capability] = f"environment {env.status}" + (
                    f": {env.reason}" if env.reason else ""
                )
                self.console.log(f"[yellow]{capability}: {untrained[capability]}; not trained[/]")
                continue
            screened[capability] = await self.run_job(
                cycle, "screen", capability, lambda e=env: self.screen(e)
            )
            if not screened[capability].train:  # its slot goes to the next capability
                untrained[capability] = (
                    f"the live agent already succeeds {screened[capability].success:.2f} in its environment"
                )
                continue
            trained[capability] = await self.run_job(
                cycle, "train", capability, lambda c=capability, e=env: stages.train(self, cycle, c, e)
            )
        live_scores = {capability: s.success for capability, s in screened.items()}
        # An adapter that cannot serve (NaN or Inf weights: a diverged run) never reaches the
        # verdict; the gateway would refuse it anyway.
        for capability, t in trained.items():
            if not t.noop and (why := stages.unservable(t)) is not None:
                untrained[capability] = why
                self.console.log(f"[red]{capability}: {why}; not routed[/]")
        # A no-op expert is the base model again: evaluating it would change nothing.
        experts = {c: t.expert for c, t in trained.items() if not t.noop and c not in untrained}
        if not experts:
            reason = (
                f"no usable adapter among {list(trained)}: {untrained}"
                if any(c in untrained for c in trained)
                else f"no gradient reached the adapters of {list(trained)}"
                if trained
                else f"no environment to train in: {untrained}"
                if untrained
                else "nothing to train"
            )
            end = CycleEnd(None, reason, trained, live_scores=live_scores, passed_over=untrained)
            return self._finish(cycle, end)
        routing: Routing = await self.run_job(cycle, "route", "all", lambda: self.route(experts))
        scores: Evaluation = await self.run_job(
            cycle, "evaluate", "all", lambda: evaluation.evaluate(self, cycle, experts, routing)
        )
        verdict: Verdict = await self.run_job(cycle, "verdict", "all", lambda: self._judge(scores))
        # Recorded "rejected" until the deploy stage makes it live (a resumed cycle finds it).
        stored = scores.to_dict()
        deployment = next((d for d in self.store.deployments(agent) if d.id == cycle), None) or Deployment(
            cycle,
            agent,
            "rejected",
            adapters=dict(scores.adapters),
            router=stored["router"],
            evaluation=stored,
            reasons=list(verdict.reasons),
        )
        if verdict.accept:
            await self.run_job(cycle, "deploy", "all", lambda: self.deploy(deployment))
            if scores.target is not None:  # now the live deployment's measurement: not played again
                measured, key = scores.target.candidate, evaluation.live_key(cycle, self.config.target_seeds)
                await self.run_job("evaluations", "target", key, lambda: measured)
        else:
            self.store.save_deployment(deployment)
            self.console.log(f"[yellow]deployment {cycle} rejected: {'; '.join(verdict.reasons)}[/]")
        end = CycleEnd(
            deployed=cycle if verdict.accept else None,
            reason=None if verdict.accept else "; ".join(verdict.reasons),
            trained=trained,
            router=scores.router,  # the gate's choice, where it had one
            live_scores=live_scores,
            passed_over=untrained,
        )
        return self._finish(cycle, end)

    def _finish(self, cycle: str, end: CycleEnd) -> CycleEnd:
        job = self.store.job(job_id(cycle, "cycle", "all")) or Job(self.config.agent, cycle, "cycle", "all")
        job.status, job.outputs, job.ended_at = "done", end.to_dict(), utcnow()
        self.store.save_job(job)
        return end

    async def run_job(
        self, cycle: str, stage: str, key: str, work: Callable[[], OutputT | Awaitable[OutputT]]
    ) -> OutputT:
        """Run ``work`` as a persisted job, or return what a finished run of it produced.

        ``Job.outputs`` holds the stage's output (``OUTPUTS``)
        as a dict; a done job's is read back as that type.
        """
        job = self.store.job(job_id(cycle, stage, key))
        if job is not None and job.status == "done":
            return cast(OutputT, OUTPUTS[stage].from_dict(job.outputs or {}))
        if job is None:
            job = Job(self.config.agent, cycle, stage, key)
        else:  # it was running when its process died, or it failed: run it again
            job.status, job.attempts, job.error, job.started_at = "running", job.attempts + 1, None, utcnow()
        self.store.save_job(job)
        self.console.rule(f"[bold]{stage}[/] {key if key != 'all' else ''}")
        try:
            result = work()
            outputs = await result if asyncio.iscoroutine(result) else result
        except Exception as exc:
            job.status, job.error, job.ended_at = "failed", f"{type(exc).__name__}: {exc}", utcnow()
            self.store.save_job(job)
            raise
        if not isinstance(outputs, OUTPUTS[stage]):
            raise ImproverError(
                f"stage {stage} returned {type(outputs).__name__}, not {OUTPUTS[stage].__name__}"
            )
        job.status, job.outputs, job.ended_at = "done", outputs.to_dict(), utcnow()
        self.store.save_job(job)
        return cast(OutputT, outputs)

    # -- stages: public, so that a subclass or a test may step in ------------------------------

    async def synthesize(self, capability: str) -> Synthesized:
        return await stages.synthesize(self, capability)

    async def screen(self, env: Synthesized) -> Screened:
        return await stages.screen(self, env)

    async def load_candidates(self, experts: dict[str, str]) -> dict[str, str]:
        return await stages.load_candidates(self, experts)

    async def route(self, experts: dict[str, str]) -> Routing:
        return await stages.route(self, experts)

    async def learned_router(
        self, adapters: dict[str, str], experts: dict[str, str] | None = None
    ) -> Routing:
        """The candidate learned gate over ``adapters`` (see ``stages.learned_router``)."""
        return await stages.learned_router(self, adapters, experts)

    def _judge(self, scores: Evaluation) -> Verdict:
        verdict = evaluation.judge(scores, margin=self.config.margin, tolerance=self.config.tolerance)
        self.console.log(
            ("[green]accepted[/]" if verdict.accept else "[red]rejected[/]") + f": {verdict.to_dict()}"
        )
        return verdict

    async def deploy(self, deployment: Deployment) -> Deployed:
        return await stages.deploy(self, deployment)

    async def play_spec(self, spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        return await evaluation.play_spec(self, spec, model, seeds)

    async def _chat_evaluator(self, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        return await evaluation.chat_evaluator(self, model, seeds)

    async def restore(self) -> Deployment | None:
        """Serve the live deployment again on a restarted gateway; None when nothing is live."""
        return await stages.restore(self)

    async def live_summary(self, seeds: Sequence[int] | None = None) -> Summary:
        """The live deployment on the target's held-out tasks (``seeds``, else the reported
        ones, else the verdict's), measured once per deployment and set of tasks."""
        live = self.live()
        seeds = list(seeds if seeds is not None else self.config.reported_seeds or self.config.target_seeds)

        async def measure() -> Summary:
            return evaluation.summary(await self.evaluator(await self.live_model(), seeds))

        return await self.run_job(
            "evaluations", "target", evaluation.live_key(live.id if live else None, seeds), measure
        )

    # -- helpers --------------------------------------------------------------------------------

    def training_config(self, **overrides: Any) -> ExpertTrainingConfig:
        """The ExpertTrainingConfig it trains with (the config's), with ``overrides``."""
        return dataclasses.replace(self.config.expert_training, **overrides)

    def examples(self) -> list[dict[str, Any]]:
        """The few-shot context experts train and are measured behind: the config's
        ``examples``, else the agent's own as its traffic shows it (none without
        ``train_with_examples``)."""
        if not self.config.train_with_examples:
            return []
        if self.config.examples is not None:
            return [dict(m) for m in self.config.examples]
        return CapturedInterface.from_store(self.store, self.config.agent).examples

    def live(self) -> Deployment | None:
        """The agent's live deployment, if any."""
        live = self.store.deployments(self.config.agent, status="live")
        return live[-1] if live else None

    async def live_model(self) -> str:
        """The model name the live deployment answers to alone: its router, registered on
        the gateway under its id (``default`` would split a canary's traffic), or ``base``."""
        live = self.live()
        if live is None:
            return "base"
        await self.gateway.set_router(live.router, name=live.id)
        return f"router:{live.id}"

    def canary(self) -> Deployment | None:
        """The agent's deployment on trial beside the live one, if any."""
        trial = self.store.deployments(self.config.agent, status="canary")
        return trial[-1] if trial else None

    def spec(self, capability: str, experts: dict[str, str] | None = None) -> EnvSpec:
        """The environment ``capability``'s expert (``expert_of``) trained in."""
        return self.env_of(self.expert_of(capability, experts))

    def env_of(self, expert: Expert) -> EnvSpec:
        """The environment ``expert`` trained in."""
        record = self.store.env_spec(expert.env_name, expert.env_version)
        if record is None:
            raise ImproverError(f"environment {expert.env_name} v{expert.env_version} is not in the store")
        return record.spec

    def expert_of(self, capability: str, experts: dict[str, str] | None = None) -> Expert:
        """``capability``'s expert: this cycle's (``experts``: capability -> expert id) or
        else the latest ready one."""
        expert = self.store.expert(experts[capability]) if experts and capability in experts else None
        if expert is None:
            expert = next(
                (
                    e
                    for e in reversed(self.store.experts(self.config.agent, status="ready"))
                    if e.capability == capability
                ),
                None,
            )
        if expert is None:
            raise ImproverError(f"no ready expert of {capability!r} for {self.config.agent!r}")
        return expert
