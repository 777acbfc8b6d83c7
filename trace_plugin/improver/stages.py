"""The stages of a cycle that build a candidate: mine, synthesize, screen, train, route; and deploy.

Each takes the improver (its store, config and gateway) and typed inputs, and returns the
typed output (``trace_plugin.records.stage_outputs``) its job stores. Every stage is
idempotent when re-run after a kill: what it writes is keyed by ids derived from the cycle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_plugin.adapter_files import AdapterError, check_weights
from trace_plugin.chat_template import gate_input
from trace_plugin.environments.base import Environment, request_key, task_keys
from trace_plugin.environments.catalog import chat_player, env_factory, prepare_environment
from trace_plugin.environments.interpreter import SpecEnv, corpus_plays, turn_budget
from trace_plugin.environments.validation import Band, levels, plainly_asked, training_forms
from trace_plugin.export import Conversation, successful_conversations
from trace_plugin.improver.config import (
    CALIBRATION_SEEDS_START,
    CORPUS_SEEDS,
    GATE_SEEDS,
    HELD_OUT_SEEDS,
    TRAINING_SEEDS,
    ImproverConfig,
)
from trace_plugin.improver.errors import DeployError, ImproverError
from trace_plugin.improver.evaluation import episode_turns, mean_reward, reply_tokens
from trace_plugin.mining.miner import OfflineMiner
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.env_spec import EnvSpec, SpecError
from trace_plugin.records.expert import Expert, split_name
from trace_plugin.records.outcome import reward_succeeds
from trace_plugin.records.router_spec import (
    CanarySpec,
    ClassifierSpec,
    CorpusEntry,
    ExpertEntry,
    Retrieval,
    RouterSpec,
    StaticSpec,
)
from trace_plugin.records.stage_outputs import (
    Deployed,
    GateFit,
    Mined,
    Routing,
    Screened,
    Synthesized,
    Trained,
)
from trace_plugin.store import Store

if TYPE_CHECKING:
    from trace_plugin.improver.context import CycleContext


def mine(improver: CycleContext) -> Mined:
    """Mine the traffic the live deployment served (all of it before the first), and list
    the selected capabilities to try, best first, those no live expert covers before those
    one does: each cycle looks for the improved agent's next deficit, not for the failures an
    earlier cycle already answered. The cycle trains up to ``max_experts`` of them; one whose
    environment cannot train, or that the live agent already solves (``screen``), takes
    no place."""
    live = improver.live()
    since = live.updated_at if live else None  # when it went live
    capabilities = OfflineMiner(improver.store).mine(improver.config.agent, since=since)
    selected = [c.name for c in capabilities if c.selected]
    covered = set(live.adapters) if live else set()
    train = sorted(selected, key=lambda c: c in covered)  # stable: best first within each
    most = improver.config.max_experts
    improver.console.log(f"selected {selected or 'nothing'}; training up to {most} of {train or 'nothing'}")
    run = capabilities[0].mining_run if capabilities else None
    return Mined(selected=selected, covered=sorted(covered), train=train, mining_run=run)


async def synthesize(improver: CycleContext, capability: str) -> Synthesized:
    """The capability's environment, synthesized and (optionally) calibrated on the base model."""
    store, config = improver.store, improver.config
    found = [c for c in store.capabilities(config.agent) if c.name == capability]
    if len(found) != 1:
        raise ImproverError(f"capability {capability!r} is not in the latest mining pass of {config.agent!r}")
    [found_capability] = found
    # Stored already when a run was killed before its job was recorded done: not twice.
    mined = {"name": found_capability.name, "mining_run": found_capability.mining_run}
    record = next((r for r in store.env_specs(config.agent) if r.report.get("capability") == mined), None)
    if record is None:
        training = config.expert_training
        play = None
        if config.calibrate:
            play = chat_player(
                f"{config.gateway_url}/v1",
                "base",
                agent=f"calibration:{config.agent}",
                max_tokens=lambda spec: reply_tokens(config, spec),  # as training will generate
                max_turns=lambda spec: episode_turns(config, spec),
                examples=improver.examples(),
                recorder=improver.recorder,
            )
        try:
            record = await prepare_environment(
                store,
                config.agent,
                found_capability,
                play=play,
                seeds=range(CALIBRATION_SEEDS_START, CALIBRATION_SEEDS_START + config.calibration_seeds),
                samples=config.calibration_samples,
                band=Band(attempts=config.calibration_attempts),
                hint_fraction=training.hint_fraction,
                progress=improver.console.log,
            )
        except SpecError as exc:  # this capability cannot be exercised here; the next one may be
            return Synthesized(env="", version=0, status="unsynthesizable", reason=str(exc))
    verdict = (record.report.get("calibration") or {}).get("verdict")
    improver.console.log(
        f"{record.spec.name} v{record.version}: {record.status}" + (f"; {verdict}" if verdict else "")
    )
    return Synthesized(env=record.spec.name, version=record.version, status=record.status)


async def screen(improver: CycleContext, env: Synthesized) -> Screened:
    """The live agent, as it serves now, in the capability's new environment at its hardest
    level: trained only if it still fails there (success below ``retrain_below``). Selection
    reads the base model's failures in old traffic; this asks whether they are still the
    agent's. Not at the calibrated level: calibration eases it for the base model, and a
    headline's live expert solved every eased writes ticket (two cancellations, their tools
    named), and so skipped the writes the target still failed."""
    config = improver.config
    record = improver.store.env_spec(env.env, env.version)
    if record is None:
        raise ImproverError(f"environment {env.env} v{env.version} is not in the store")
    served = await improver.live_model()
    hardest = levels(record.spec)[0][-1]
    results = await improver.play_spec(hardest, served, HELD_OUT_SEEDS[: config.eval_seeds])
    success = sum(reward_succeeds(r.reward.total) for r in results) / len(results)
    screened = Screened(
        served=served,
        success=success,
        mean_reward=mean_reward(results),
        train=success < config.retrain_below,
    )
    improver.console.log(
        f"{env.env}: the live agent ({served}) succeeds {success:.2f}"
        + ("" if screened.train else f", not below {config.retrain_below}: nothing to teach")
    )
    return screened


def train(improver: CycleContext, cycle: str, capability: str, env: Synthesized) -> Trained:
    """Train the capability's expert in its environment (the executor may run it elsewhere)."""
    from training.executors import LocalExecutor, TrainingJob
    from training.lora import is_noop

    store, config = improver.store, improver.config
    record = store.env_spec(env.env, env.version)
    if record is None:
        raise ImproverError(f"environment {env.env} v{env.version} is not in the store")
    expert_id = derived_id(cycle, capability)
    output = config.adapter_root / capability / expert_id
    # A reply's length and the horizon come from the environment, as calibration's did.
    training = improver.training_config(
        output_dir=str(output),
        max_completion_length=reply_tokens(config, record.spec),
        max_turns=episode_turns(config, record.spec),
    )
    if training.max_turns < (needed := turn_budget(record.spec)):
        improver.console.log(
            f"[yellow]{capability}: max_turns {training.max_turns}, as training sets it, is fewer than "
            f"its longest reference play needs ({needed}): longer plays are dropped[/]"
        )
    expert = store.expert(expert_id) or Expert(
        config.agent,
        capability,
        record.spec.name,
        record.version,
        base_model=str(config.model or "embedded"),
        base_model_hash="",
        config=training.to_dict(),
        id=expert_id,
    )
    store.save_expert(expert)
    examples = improver.examples()
    source = "set in the config" if config.examples is not None else "the commonest in traffic"
    improver.console.log(f"{capability}: trains behind {len(examples)} few-shot message(s), {source}")
    rehearsed = rehearsal(improver, training.rehearsal_plays)
    if rehearsed:
        improver.console.log(f"{capability}: rehearses {len(rehearsed)} successes of the live agent")
    job = TrainingJob(
        record.spec.model_dump(mode="json", by_alias=True),
        list(TRAINING_SEEDS),
        training.to_dict(),
        config.model,
        examples,
        exclude=sorted(evaluated_task_keys(config, record.spec, improver.store)),
        rehearsal=rehearsed,
    )
    try:
        [result] = (improver.executor or LocalExecutor()).run([job])
    except Exception:
        expert.status = "failed"
        store.save_expert(expert)
        raise
    expert.status, expert.reward_curve = "ready", list(result.reward_curve)
    expert.unhinted_curve = list(result.unhinted_curve)
    expert.warm_start_plays = result.reference_plays
    expert.adapter_path, expert.adapter_sha256 = str(result.adapter_dir), result.adapter_sha256
    expert.base_model, expert.base_model_hash = str(result.base_model), result.base_model_sha256
    store.save_expert(expert)
    if not expert.learned_unhinted:
        improver.console.log(
            f"[yellow]{capability}: the un-hinted reward never rose[/] {expert.unhinted_curve}"
        )
    improver.console.log(
        f"{capability}: GRPO reached level {result.level_reached}; informative groups "
        f"{result.informative_group_frac if result.informative_group_frac is not None else '—'}"
    )
    noop = is_noop(result.adapter_dir)
    if noop:
        improver.console.log(f"[yellow]{capability}: no gradient reached its adapter (the base model)[/]")
    return Trained(
        expert_id,
        str(output),
        list(result.reward_curve),
        list(result.unhinted_curve),
        noop,
        expert.adapter_name,
        result.reference_plays,
        result.level_reached,
        result.informative_group_frac,
    )


def unservable(trained: Trained) -> str | None:
    """Why a trained adapter cannot serve (NaN or Inf weights), or None: the gateway's
    check, run before the adapter is routed or reaches a verdict."""
    try:
        check_weights(Path(trained.adapter))
    except AdapterError as exc:
        return str(exc)
    return None


def evaluated_task_keys(config: ImproverConfig, spec: EnvSpec, store: Store) -> set[str]:
    """Every task an evaluation plays: the environment's held-out and gate seeds, in every
    form training may meet them (``training_forms``), and the target's tasks, the gate's
    and those a report measures. Training plays none of them, neither the warm start nor GRPO:
    requests phrased like the target's traffic may repeat one of its tasks."""
    seeds = [*HELD_OUT_SEEDS[: config.eval_seeds], *GATE_SEEDS[: config.gate_seeds]]
    keys = {key for form in training_forms(spec) for key in task_keys(lambda form=form: SpecEnv(form), seeds)}
    if target := evaluated_target(config, store):
        keys |= task_keys(*target)
    return keys


def evaluated_target(
    config: ImproverConfig, store: Store
) -> tuple[Callable[[], Environment], list[int]] | None:
    """The target's environment and the seeds its evaluations play (the gate's and the
    reports'), or None where there is no target to evaluate."""
    seeds = [*config.target_seeds, *config.reported_seeds]
    if config.target is None or not seeds:
        return None
    return env_factory(config.target, store), seeds


def rehearsal(improver: CycleContext, count: int) -> list[Conversation]:
    """Up to ``count`` successful conversations of the traffic the live deployment served (all of
    it before the first), none of them a request the target's evaluations play."""
    if not count:
        return []
    config, live = improver.config, improver.live()
    evaluated: set[str] = set()
    if target := evaluated_target(config, improver.store):
        factory, seeds = target
        evaluated = {request_key(factory().reset(seed).prompt) for seed in seeds}
    since = live.updated_at if live else None
    return successful_conversations(improver.store, config.agent, count, since=since, exclude=evaluated)


async def load_candidates(improver: CycleContext, experts: dict[str, str]) -> dict[str, str]:
    """The live experts plus this cycle's, every one loaded: capability -> served name."""
    live = improver.live()
    adapters = dict(live.adapters) if live else {}
    for capability, expert_id in experts.items():
        expert = improver.store.expert(expert_id)
        if expert is None or not expert.adapter_path:
            raise ImproverError(f"expert {expert_id} ({capability}) has no trained adapter to load")
        await improver.gateway.ensure_adapter(expert.adapter_name, expert.adapter_path)
        adapters[capability] = expert.adapter_name
    return adapters


async def route(improver: CycleContext, experts: dict[str, str]) -> Routing:
    """The candidate router: a gate fitted to which choice (the base model or an expert)
    won each practice task; or else one expert takes everything, and several are classified
    by the base model (``top1``: hard; ``classifier``: TRACE's retrieval and top-p mixture)."""
    adapters = await improver.load_candidates(experts)
    config = improver.config
    if config.router == "gate":
        return await improver.learned_router(adapters, experts)
    corpus = None
    if config.router == "classifier" and len(adapters) > 1:
        corpus = []
        for capability in adapters:  # each expert's corpus is computed once and kept with it
            expert = improver.expert_of(capability, experts)
            if not expert.corpus:
                specs = {capability: improver.env_of(expert)}
                expert.corpus = await retrieval_corpus(specs, improver.gateway.embed, config.corpus_seeds)
                improver.store.save_expert(expert)
            corpus += expert.corpus
    live = improver.live()
    return Routing(
        router=router_spec(
            adapters,
            improver.store,
            config.agent,
            corpus,
            top_p=config.top_p,
            fallback=live.router if live is not None else None,
        )
    )


async def retrieval_corpus(
    specs: Mapping[str, EnvSpec],
    embed: Callable[[list[str]], Awaitable[list[list[float]]]],
    count: int,
) -> list[CorpusEntry]:
    """Each capability's successful trajectories (``count`` reference plays of its
    environment, its kinds of task in turn), embedded by the serving base model as the
    router will embed requests. Their requests are asked plainly, as the target's users
    ask: a request that names its tools (a level GRPO may train at) is like every other
    such request, whatever its kind."""
    plays = [
        (capability, *play)
        for capability, spec in specs.items()
        for play in corpus_plays(plainly_asked(spec), CORPUS_SEEDS, count)
    ]
    embeddings = await embed([gate_input(request) for _, request, _ in plays])
    return [
        CorpusEntry(capability=capability, request=request, solution=solution, embedding=embedding)
        for (capability, request, solution), embedding in zip(plays, embeddings, strict=True)
    ]


async def learned_router(
    improver: CycleContext, adapters: dict[str, str], experts: dict[str, str] | None = None
) -> Routing:
    """A learned per-layer gate over the base model and ``adapters`` (capability -> served
    name), fitted on practice tasks of their environments: which choice won each.

    ``experts`` (capability -> expert id) names this cycle's experts; any other
    capability's environment is its latest ready expert's.
    """
    from trace_plugin.model_files import num_layers
    from training.gate import fit_gate

    async def play(spec: EnvSpec, model: str, seeds: Sequence[int]) -> list[float]:
        return [r.reward.total for r in await improver.play_spec(spec, model, seeds)]

    names = {capability: split_name(name)[0] for capability, name in adapters.items()}
    router, report = await fit_gate(
        [plainly_asked(improver.spec(capability, experts)) for capability in names],  # as users ask
        list(names.values()),
        play,
        improver.gateway.embed,
        list(GATE_SEEDS[: improver.config.gate_seeds]),
        layers=num_layers(improver.config.model),
    )
    improver.console.log(f"gate fitted on {report['tasks']} practice tasks: {report['labels']}")
    return Routing(router=router, gate=GateFit(tasks=report["tasks"], labels=report["labels"]))


def router_spec(
    adapters: dict[str, str],
    store: Store,
    agent: str,
    corpus: list[CorpusEntry] | None = None,
    *,
    top_p: float = 0.9,
    fallback: dict[str, Any] | None = None,
) -> RouterSpec:
    """One expert takes every request; several are chosen by the base model as classifier,
    over the candidates ``corpus`` retrieves and weighted by top-p (without one: hard top-1),
    and where it chooses none ``fallback`` (the live router) decides, not the bare base model."""
    names = {capability: split_name(name)[0] for capability, name in adapters.items()}
    if len(names) == 1:
        return StaticSpec(adapter=next(iter(names.values())))
    descriptions = {c.name: c.description for c in store.capabilities(agent)}
    experts = [
        ExpertEntry(adapter=n, name=c, description=descriptions.get(c, c)) for c, n in sorted(names.items())
    ]
    if corpus is None:
        return ClassifierSpec(experts=experts, threshold=0.5, fallback=fallback)
    return ClassifierSpec(experts=experts, retrieval=Retrieval(corpus=corpus, top_p=top_p), fallback=fallback)


async def deploy(improver: CycleContext, deployment: Deployment) -> Deployed:
    """Switch the live router, or with ``canary`` set send that share of the traffic to the
    deployment on trial; confirm the gateway serves exactly what was evaluated."""
    gateway = improver.gateway
    for name in deployment.adapters.values():
        if name not in await gateway.adapters():
            raise DeployError(f"adapter {name} is not loaded; refusing to switch traffic")
    share = improver.config.canary
    router = deployment.router if share is None else canary_router(improver.live(), deployment, share)
    await gateway.set_router(router)
    if await gateway.router() != router:
        raise DeployError("the gateway did not take the new router")
    if share is None:
        improver.store.make_live(deployment)
        improver.console.log(f"[green]deployed {deployment.id}[/]: {deployment.adapters}")
    else:
        deployment.status, deployment.canary = "canary", {"share": share}
        improver.store.save_deployment(deployment)
        improver.console.log(
            f"[green]canary {deployment.id}[/] on {share:.0%} of the traffic: {deployment.adapters}"
        )
    return Deployed(deployment=deployment.id)


def canary_router(live: Deployment | None, canary: Deployment, share: float) -> dict[str, Any]:
    """The router that tries ``canary`` on ``share`` of the traffic beside the live one."""
    main = live.router if live is not None else StaticSpec().to_dict()
    return CanarySpec(share=share, main=main, candidate=canary.router).to_dict()


async def restore(improver: CycleContext) -> Deployment | None:
    """Serve the live deployment again on a gateway that restarted (one starts on the base
    model): its adapters, then its router, with a canary on trial beside it. None when
    nothing is live or on trial."""
    live, trial, share = improver.live(), improver.canary(), improver.config.canary
    if trial is not None and share is None:  # this improver runs no canaries: end the trial
        trial.status, trial.reasons = "rolled_back", [*trial.reasons, "restored without a canary share"]
        trial.end_trial("rolled_back")
        improver.store.save_deployment(trial)
        trial = None
    if live is None and trial is None:
        return None
    paths = {e.adapter_name: e.adapter_path for e in improver.store.experts(improver.config.agent)}
    for deployment in (d for d in (live, trial) if d is not None):
        for name in deployment.adapters.values():
            if not paths.get(name):
                raise DeployError(f"the adapter {name} has no trained expert in the store to load")
            await improver.gateway.ensure_adapter(name, paths[name])
    if trial is not None and share is not None:
        await improver.gateway.set_router(canary_router(live, trial, share))
    elif live is not None:
        await improver.gateway.set_router(live.router)
    return live


def derived_id(cycle: str, capability: str) -> str:
    """An expert's id, the same whenever the cycle is resumed."""
    return hashlib.sha256(f"{cycle}/{capability}".encode()).hexdigest()[:16]
