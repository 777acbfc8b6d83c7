"""The improver: an agent that gets better from its own production traffic, unattended.

One cycle runs mine → synthesize → train → route → evaluate → gate → deploy. Every unit of work
is a :class:`~trace_plugin.records.job.Job` in the store, so a process killed at any point
resumes the same cycle where it stopped, without training or deploying anything twice:
expert ids, adapter names and deployment ids are all derived from the cycle id. A lease
keeps a second improver for the same agent out.

Nothing unsafe is deployed. Candidates are loaded into the gateway beside the live
experts and evaluated through it (a candidate router answers as ``router:CYCLE``), on the
target's held-out tasks and on held-out seeds of every synthesized environment; only a
deployment that beats the current one by more than ``margin``, with no capability
regressing beyond ``tolerance``, takes the traffic. Between cycles, :meth:`Improver.monitor` compares the
live success rate with the previous deployment's and rolls back when it fell.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from trace_plugin.environments.base import Environment
from trace_plugin.environments.catalog import chat_player, env_factory, prepare_environment
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.runner import ChatLoopAgent, EpisodeResult, Runner
from trace_plugin.environments.synthesis import CapturedInterface as Target
from trace_plugin.environments.validation import Band
from trace_plugin.gateway.adapters import split_name
from trace_plugin.mining.miner import OfflineMiner, outcome
from trace_plugin.recorder import Recorder, default_recorder
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec
from trace_plugin.records.expert import Expert
from trace_plugin.records.job import Job, job_id
from trace_plugin.records.trajectory import new_id, utcnow
from trace_plugin.store import Store
from trace_plugin.store.lease import Lease, LeaseHeld

HELD_OUT_SEEDS = range(3_000_000, 3_000_200)  # synthesized environments' evaluation seeds
GATE_SEEDS = range(4_000_000, 4_000_200)  # the practice tasks a learned gate is fitted on
TRAINING_SEEDS = range(0, 2_000)
TRAINABLE = ("validated", "out_of_band")

# Runs the agent on ``seeds`` of the target, with the gateway serving it as ``model``.
Evaluator = Callable[[str, Sequence[int]], Awaitable[list[EpisodeResult]]]


@dataclass
class ImproverConfig:
    """What the improver watches, how hard it trains, and how careful it deploys."""

    agent: str
    gateway_url: str  # the gateway serving the agent (no /v1)
    adapter_root: Path  # the gateway's adapter root: experts are written under it
    admin_token: str | None = None
    target: str | None = None  # a registered target environment, for held-out evaluation
    target_seeds: Sequence[int] = ()  # its held-out tasks
    # triggers
    min_new_episodes: int = 50  # labeled episodes since the last cycle
    max_failure_rate: float | None = None  # or: the recent failure rate reached this
    every_seconds: float | None = None  # or: a schedule
    # mining and synthesis
    max_experts: int = 2  # capabilities trained per cycle, best ranked first
    calibrate: bool = True
    calibration_seeds: int = 8
    calibration_samples: int = 4
    calibration_attempts: int = 5
    # training
    preset: str = "cpu-small"
    training: dict[str, Any] = field(default_factory=dict)  # ExpertTrainingConfig overrides
    train_with_examples: bool = True  # behind the agent's own few-shot context, as it is served
    model: str | None = None  # local base model dir; None is the embedded default
    # routing: several experts are chosen by the base model as "classifier", or a learned "gate"
    router: Literal["classifier", "gate"] = "classifier"
    gate_seeds: int = 16  # practice tasks per environment the gate is fitted on
    # evaluation, gate, monitor
    eval_seeds: int = 16  # held-out seeds per synthesized environment
    margin: float = 0.0  # the candidate must beat the live one on the target by more than this
    tolerance: float = 0.05  # no capability may fall more than this
    retrain_below: float = 0.9  # a covered capability is retrained only when its expert scores below
    monitor_window: int = 50  # episodes compared when monitoring
    rollback_drop: float = 0.1  # roll back when live success falls this far below the previous
    max_tokens: int = 160
    lease_ttl: float = 30.0  # on SQLite, how long a killed improver keeps others out


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
        self.store, self.config = store, config
        self.executor = executor
        self.recorder = recorder or default_recorder()
        self.console = console or Console()
        self.gateway = GatewayAdmin(config.gateway_url, config.admin_token)
        self.evaluator = evaluator or self._chat_evaluator

    # -- the loop --------------------------------------------------------------------------

    def run_once(self, *, wait: float = 0.0) -> Deployment | None:
        """One cycle (resuming an unfinished one); None when the cycle deploys nothing new.

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
        cycles = [j for j in self.store.jobs(self.config.agent) if j.stage == "cycle"]
        if any(j.status == "running" for j in cycles):
            return True
        since = cycles[-1].started_at if cycles else None
        recent = [e for e in self._labeled(since) if outcome(e) is not None]
        if len(recent) >= self.config.min_new_episodes:
            return True
        if self.config.max_failure_rate is not None and recent:
            failures = sum(not outcome(e) for e in recent) / len(recent)
            if failures >= self.config.max_failure_rate:
                return True
        if self.config.every_seconds is not None and since is not None:
            return (utcnow() - since).total_seconds() >= self.config.every_seconds
        return False

    def _open_cycle(self) -> str:
        running = [
            j for j in self.store.jobs(self.config.agent) if j.stage == "cycle" and j.status == "running"
        ]
        if running:
            self.console.log(f"resuming cycle {running[-1].cycle}")
            return running[-1].cycle
        cycle = utcnow().strftime("%Y%m%d%H%M%S") + "-" + new_id()[:6]
        self.store.save_job(Job(self.config.agent, cycle, "cycle", "all"))
        return cycle

    async def _cycle(self, cycle: str) -> Deployment | None:
        agent = self.config.agent
        mined = await self._job(cycle, "mine", "all", self._mine)
        experts: dict[str, str] = {}
        for capability in mined["train"]:
            env = await self._job(cycle, "synthesize", capability, lambda c=capability: self._synthesize(c))
            if env["status"] not in TRAINABLE:
                self.console.log(f"[yellow]{capability}: environment {env['status']}; not trained[/]")
                continue
            trained = await self._job(
                cycle, "train", capability, lambda c=capability, e=env: self._train(cycle, c, e)
            )
            experts[capability] = trained["expert"]
        if not experts:
            self._finish(cycle, {"deployed": None, "reason": "nothing to train"})
            return None
        routing = await self._job(cycle, "route", "all", lambda: self._route(experts))
        evaluation = await self._job(
            cycle, "evaluate", "all", lambda: self._evaluate(cycle, experts, routing)
        )
        verdict = await self._job(cycle, "gate", "all", lambda: self._gate(evaluation))
        # Recorded "rejected" until the deploy stage makes it live (a resumed cycle finds it).
        deployment = next((d for d in self.store.deployments(agent) if d.id == cycle), None) or Deployment(
            cycle,
            agent,
            "rejected",
            adapters=evaluation["adapters"],
            router=evaluation["router"],
            evaluation=evaluation,
            reasons=verdict["reasons"],
        )
        if verdict["accept"]:
            await self._job(cycle, "deploy", "all", lambda: self._deploy(deployment))
        else:
            self.store.save_deployment(deployment)
            self.console.log(f"[yellow]deployment {cycle} rejected: {'; '.join(verdict['reasons'])}[/]")
        self._finish(cycle, {"deployed": cycle if verdict["accept"] else None})
        return deployment if verdict["accept"] else None

    def _finish(self, cycle: str, outputs: dict[str, Any]) -> None:
        job = self.store.job(job_id(cycle, "cycle", "all")) or Job(self.config.agent, cycle, "cycle", "all")
        job.status, job.outputs, job.ended_at = "done", outputs, utcnow()
        self.store.save_job(job)

    async def _job(self, cycle: str, stage: str, key: str, work: Callable[[], Any]) -> dict[str, Any]:
        """Run ``work`` as a persisted job, or return what a finished run of it produced."""
        job = self.store.job(job_id(cycle, stage, key))
        if job is not None and job.status == "done":
            return job.outputs or {}
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
        job.status, job.outputs, job.ended_at = "done", outputs, utcnow()
        self.store.save_job(job)
        return outputs

    # -- stages ----------------------------------------------------------------------------

    def _mine(self) -> dict[str, Any]:
        capabilities = OfflineMiner(self.store).mine(self.config.agent)
        selected = [c.name for c in capabilities if c.selected]
        live = self._live()
        covered = set(live.adapters) if live else set()
        train = [c for c in selected if c not in covered][: self.config.max_experts]
        self.console.log(f"selected {selected or 'nothing'}; training {train or 'nothing'}")
        return {"selected": selected, "covered": sorted(covered), "train": train}

    async def _synthesize(self, capability: str) -> dict[str, Any]:
        [found] = [c for c in self.store.capabilities(self.config.agent) if c.name == capability]
        # Stored already when a run was killed before its job was recorded done: not twice.
        mined = {"name": found.name, "mining_run": found.mining_run}
        record = next(
            (r for r in self.store.env_specs(self.config.agent) if r.report.get("capability") == mined), None
        )
        if record is None:
            play = None
            if self.config.calibrate:
                play = chat_player(
                    f"{self.config.gateway_url}/v1",
                    "base",
                    agent=f"calibration:{self.config.agent}",
                    max_tokens=self.training_config().max_completion_length,  # as training will generate
                    max_turns=self.training_config().max_turns,
                    examples=self.examples(),
                    recorder=self.recorder,
                )
            record = await prepare_environment(
                self.store,
                self.config.agent,
                found,
                play=play,
                seeds=range(2_000_000, 2_000_000 + self.config.calibration_seeds),
                samples=self.config.calibration_samples,
                band=Band(attempts=self.config.calibration_attempts),
                hint_fraction=self.training_config().hint_fraction,
                progress=self.console.log,
            )
        self.console.log(f"{record.spec.name} v{record.version}: {record.status}")
        return {"env": record.spec.name, "version": record.version, "status": record.status}

    def _train(self, cycle: str, capability: str, env: dict[str, Any]) -> dict[str, Any]:
        from training.executors import LocalExecutor, TrainingJob

        record = self.store.env_spec(env["env"], env["version"])
        assert record is not None
        expert_id = _derived_id(cycle, capability)
        output = self.config.adapter_root / capability / expert_id
        config = self.training_config(output_dir=str(output))
        examples = self.examples()
        expert = self.store.expert(expert_id) or Expert(
            self.config.agent,
            capability,
            record.spec.name,
            record.version,
            base_model=str(self.config.model or "embedded"),
            base_model_hash="",
            config=config.to_dict(),
            id=expert_id,
        )
        self.store.save_expert(expert)
        job = TrainingJob(
            record.spec.model_dump(mode="json", by_alias=True),
            list(TRAINING_SEEDS),
            config.to_dict(),
            self.config.model,
            examples,
        )
        try:
            [result] = (self.executor or LocalExecutor()).run([job])
        except Exception:
            expert.status = "failed"
            self.store.save_expert(expert)
            raise
        expert.status, expert.reward_curve = "ready", list(result.reward_curve)
        expert.adapter_path, expert.adapter_sha256 = str(result.adapter_dir), result.adapter_sha256
        expert.base_model, expert.base_model_hash = str(result.base_model), result.base_model_sha256
        self.store.save_expert(expert)
        return {"expert": expert_id, "adapter": str(output), "reward_curve": result.reward_curve}

    async def _load_candidates(self, experts: dict[str, str]) -> dict[str, str]:
        """The live experts plus this cycle's, every one loaded: capability -> served name."""
        live = self._live()
        adapters = dict(live.adapters) if live else {}
        for capability, expert_id in experts.items():
            expert = self.store.expert(expert_id)
            assert expert is not None and expert.adapter_path
            await self.gateway.ensure_adapter(expert.adapter_name, expert.adapter_path)
            adapters[capability] = expert.adapter_name
        return adapters

    async def _route(self, experts: dict[str, str]) -> dict[str, Any]:
        """The candidate router: a gate fitted to which choice (the base model or an expert)
        won each practice task; or else one expert takes everything, several are classified."""
        adapters = await self._load_candidates(experts)
        if self.config.router != "gate":
            return {"router": router_spec(adapters, self.store, self.config.agent)}
        return await self.fit_gate(adapters, experts)

    async def fit_gate(
        self, adapters: dict[str, str], experts: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """A learned gate over the base model and ``adapters`` (capability -> served name),
        fitted on practice tasks of their environments: which choice won each.

        ``experts`` (capability -> expert id) names this cycle's experts; any other
        capability's environment is its latest ready expert's.
        """
        from training.gate import fit_gate

        async def play(spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[float]:
            return [r.reward.total for r in await self._play_spec(spec, model, seeds)]

        names = {capability: split_name(name)[0] for capability, name in adapters.items()}
        router, report = await fit_gate(
            [self.spec(capability, experts) for capability in names],
            list(names.values()),
            play,
            self.gateway.embed,
            list(GATE_SEEDS[: self.config.gate_seeds]),
        )
        self.console.log(f"gate fitted on {report['tasks']} practice tasks: {report['labels']}")
        return {"router": router, "gate": report}

    async def _evaluate(self, cycle: str, experts: dict[str, str], routing: dict[str, Any]) -> dict[str, Any]:
        """Score the candidate router and its experts against the live deployment, through the gateway."""
        live = self._live()
        adapters = await self._load_candidates(experts)  # again: the gateway may have restarted
        router = routing["router"]
        await self.gateway.set_router(router, name=cycle)
        report: dict[str, Any] = {"adapters": adapters, "router": router, "capabilities": {}}
        for capability, name in adapters.items():
            spec = self.spec(capability, experts)
            seeds = list(HELD_OUT_SEEDS[: self.config.eval_seeds])
            base = _mean_reward(await self._play_spec(spec, "base", seeds))
            candidate = _mean_reward(await self._play_spec(spec, name, seeds))
            current = _mean_reward(await self._play_spec(spec, "default", seeds)) if live else base
            report["capabilities"][capability] = {"base": base, "current": current, "candidate": candidate}
            self.console.log(f"{capability}: base {base:.2f}, live {current:.2f}, candidate {candidate:.2f}")
        if self.config.target_seeds:
            report["target"] = {
                "current": await self.evaluate_live(),
                "candidate": _summary(
                    await self.evaluator(f"router:{cycle}", list(self.config.target_seeds))
                ),
            }
            self.console.log(
                f"target: live {report['target']['current']['success']:.2f}, "
                f"candidate {report['target']['candidate']['success']:.2f}"
            )
        return report

    async def evaluate_live(self) -> dict[str, Any]:
        """The live deployment on the target's held-out tasks, measured once per deployment."""
        live = self._live()
        seeds = list(self.config.target_seeds)
        key = f"{live.id if live else 'base'}-{hashlib.sha256(str(seeds).encode()).hexdigest()[:12]}"

        async def measure() -> dict[str, Any]:
            return _summary(await self.evaluator("default", seeds))

        return await self._job("evaluations", "target", key, measure)

    def _gate(self, evaluation: dict[str, Any]) -> dict[str, Any]:
        verdict = gate(evaluation, margin=self.config.margin, tolerance=self.config.tolerance)
        self.console.log(("[green]accepted[/]" if verdict["accept"] else "[red]rejected[/]") + f": {verdict}")
        return verdict

    async def _deploy(self, deployment: Deployment) -> dict[str, Any]:
        """Switch the live router; confirm the gateway serves exactly what was evaluated."""
        for name in deployment.adapters.values():
            if name not in await self.gateway.adapters():
                raise RuntimeError(f"adapter {name} is not loaded; refusing to switch traffic")
        await self.gateway.set_router(deployment.router)
        if await self.gateway.router() != deployment.router:
            raise RuntimeError("the gateway did not take the new router")
        self.store.make_live(deployment)
        self.console.log(f"[green]deployed {deployment.id}[/]: {deployment.adapters}")
        return {"deployment": deployment.id}

    # -- monitoring ---------------------------------------------------------------------------

    def monitor(self) -> Deployment | None:
        """Roll the live deployment back when its success rate fell below the previous one's."""
        deployments = self.store.deployments(self.config.agent)
        live = [d for d in deployments if d.status == "live"]
        if not live:
            return None
        current = live[-1]
        earlier = [d for d in deployments if d.created_at < current.created_at and d.status == "superseded"]
        if not earlier:
            return None
        previous = earlier[-1]
        now_rate = _success_rate(self._labeled(current.created_at)[-self.config.monitor_window :])
        before = [e for e in self._labeled(previous.created_at) if e.started_at < current.created_at]
        before_rate = _success_rate(before[-self.config.monitor_window :])
        window = len(self._labeled(current.created_at))
        if window < self.config.monitor_window or now_rate is None or before_rate is None:
            return None
        if now_rate >= before_rate - self.config.rollback_drop:
            return None
        asyncio.run(self.gateway.set_router(previous.router))
        current.status = "rolled_back"
        current.reasons = [
            *current.reasons,
            f"live success {now_rate:.2f} over {window} episodes fell below {before_rate:.2f} "
            f"(the previous deployment) by more than {self.config.rollback_drop}",
        ]
        self.store.make_live(previous, retire=current)  # one transaction: never no live deployment
        self.console.log(f"[red]rolled back {current.id}[/]: {current.reasons[-1]}")
        return previous

    # -- helpers --------------------------------------------------------------------------------

    def training_config(self, **overrides: Any) -> Any:
        """The ExpertTrainingConfig it trains with: the preset, config overrides, then ``overrides``."""
        from training.config import ExpertTrainingConfig

        return ExpertTrainingConfig.preset(self.config.preset, **{**self.config.training, **overrides})

    def examples(self) -> list[dict[str, Any]]:
        """The agent's own few-shot context, which experts train and are measured behind."""
        return (
            Target.from_store(self.store, self.config.agent).examples
            if self.config.train_with_examples
            else []
        )

    def _live(self) -> Deployment | None:
        live = self.store.deployments(self.config.agent, status="live")
        return live[-1] if live else None

    def _labeled(self, since: Any) -> list[Any]:
        episodes = self.store.load_episodes(self.config.agent, limit=10_000)
        return sorted(
            (e for e in episodes if outcome(e) is not None and (since is None or e.started_at >= since)),
            key=lambda e: e.started_at,
        )

    def spec(self, capability: str, experts: dict[str, str] | None = None) -> EnvSpec:
        """The environment ``capability``'s expert trained in: this cycle's (``experts``:
        capability -> expert id) or else the latest ready one's."""
        expert = self.store.expert(experts[capability]) if experts and capability in experts else None
        if expert is None:
            expert = next(
                e
                for e in reversed(self.store.experts(self.config.agent, status="ready"))
                if e.capability == capability
            )
        record = self.store.env_spec(expert.env_name, expert.env_version)
        assert record is not None
        return record.spec

    async def _play_spec(self, spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        agent = ChatLoopAgent(
            f"{self.config.gateway_url}/v1",
            model,
            agent=f"eval:{self.config.agent}",
            max_tokens=self.config.max_tokens,
            max_turns=self.training_config().max_turns,  # the horizon the expert was trained on
            examples=self.examples(),
            recorder=self.recorder,
        )
        runner = Runner(
            lambda: SpecEnv(spec), agent, concurrency=8, recorder=self.recorder, console=self.console
        )
        return await runner.run(seeds, description=f"{spec.name} as {model}")

    async def _chat_evaluator(self, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        """The default target evaluation: a chat loop with the agent's prompt and few-shot."""
        if self.config.target is None:
            raise ValueError("target_seeds need a target environment")
        factory: Callable[[], Environment] = env_factory(self.config.target, self.store)
        target = Target.from_store(self.store, self.config.agent)
        agent = ChatLoopAgent(
            f"{self.config.gateway_url}/v1",
            model,
            agent=f"eval:{self.config.agent}",
            max_tokens=self.config.max_tokens,
            examples=target.examples,
            recorder=self.recorder,
        )
        runner = Runner(factory, agent, concurrency=8, recorder=self.recorder, console=self.console)
        return await runner.run(seeds, description=f"{self.config.target} as {model}")


def gate(evaluation: dict[str, Any], *, margin: float, tolerance: float) -> dict[str, Any]:
    """Accept only a deployment that beats the live one on the target by more than
    ``margin`` and lets no capability fall more than ``tolerance``; the reasons say why not."""
    reasons = []
    target = evaluation.get("target")
    if target is not None:
        current, candidate = target["current"]["success"], target["candidate"]["success"]
        if candidate - current <= margin:
            reasons.append(f"target success {candidate:.2f} does not beat the live {current:.2f} by {margin}")
    for capability, scores in evaluation["capabilities"].items():
        if scores["candidate"] < scores["current"] - tolerance:
            reasons.append(
                f"{capability} regresses: {scores['candidate']:.2f} against the live {scores['current']:.2f}"
            )
    if target is None and not any(s["candidate"] > s["current"] for s in evaluation["capabilities"].values()):
        reasons.append("no capability improved on its held-out seeds")
    return {"accept": not reasons, "reasons": reasons}


def router_spec(adapters: dict[str, str], store: Store, agent: str) -> dict[str, Any]:
    """One expert takes every request; several are chosen by the base model as classifier."""
    names = {capability: split_name(name)[0] for capability, name in adapters.items()}
    if len(names) == 1:
        return {"kind": "static", "adapter": next(iter(names.values()))}
    descriptions = {c.name: c.description for c in store.capabilities(agent)}
    experts = [
        {"adapter": n, "name": c, "description": descriptions.get(c, c)} for c, n in sorted(names.items())
    ]
    return {"kind": "classifier", "experts": experts, "threshold": 0.5}


class GatewayAdmin:
    """The gateway's admin API (vLLM's adapter endpoints plus our router endpoints)."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def adapters(self) -> set[str]:
        data = await self._request("GET", "/v1/lora_adapters")
        return set(data.get("loaded", {})) if isinstance(data, dict) else set()

    async def ensure_adapter(self, name: str, path: str) -> None:
        if name not in await self.adapters():
            await self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def router(self, name: str | None = None) -> dict[str, Any]:
        return await self._request("GET", "/v1/router", params={"name": name} if name else None)

    async def set_router(self, spec: dict[str, Any], *, name: str | None = None) -> None:
        await self._request("POST", "/v1/router", json=spec, params={"name": name} if name else None)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The served base model's embeddings (what a learned gate reads), 64 texts a request."""
        vectors: list[list[float]] = []
        for start in range(0, len(texts), 64):
            body = {"model": "base", "input": texts[start : start + 64]}
            data = await self._request("POST", "/v1/embeddings", json=body)
            vectors += [item["embedding"] for item in sorted(data["data"], key=lambda d: d["index"])]
        return vectors

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=120) as client:
            response = await client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"gateway {method} {path}: {response.status_code} {response.text[:300]}")
        return response.json() if "json" in response.headers.get("content-type", "") else response.text


def _derived_id(cycle: str, capability: str) -> str:
    return hashlib.sha256(f"{cycle}/{capability}".encode()).hexdigest()[:16]


def _summary(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r.reward.total)
    return {
        "n": len(results),
        "success": sum(r.reward.total >= 1.0 for r in results) / max(len(results), 1),
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "episodes": [asdict(r) | {"reward": r.reward.total} for r in results],
    }


def _mean_reward(results: Sequence[EpisodeResult]) -> float:
    return sum(r.reward.total for r in results) / len(results)


def _success_rate(episodes: Sequence[Any]) -> float | None:
    known = [outcome(e) for e in episodes if outcome(e) is not None]
    return sum(known) / len(known) if known else None
