"""Evaluation and the deploy verdict: the candidate against the live deployment, through the gateway.

Candidates are served beside the live experts (a candidate router answers as
``router:CYCLE``) and played on held-out seeds of every synthesized environment and on the
target's held-out tasks; ``judge`` lets only a clear improvement without regressions
take the traffic.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from trace_plugin.environments.base import Environment
from trace_plugin.environments.catalog import env_factory, target_turns
from trace_plugin.environments.interpreter import SpecEnv, reply_budget, turn_budget
from trace_plugin.environments.runner import ChatLoopAgent, EpisodeResult, Runner
from trace_plugin.environments.synthesis import CapturedInterface
from trace_plugin.environments.validation import plainly_asked
from trace_plugin.improver.config import HELD_OUT_SEEDS, ImproverConfig
from trace_plugin.improver.errors import ConfigError
from trace_plugin.mining.detectors import Trajectory
from trace_plugin.mining.kinds import label_episode
from trace_plugin.mining.selection import Label
from trace_plugin.model_files import load_tokenizer
from trace_plugin.records.env_spec import EnvSpec
from trace_plugin.records.outcome import reward_succeeds
from trace_plugin.records.router_spec import ClassifierSpec, RouterSpec
from trace_plugin.records.stage_outputs import (
    Evaluation,
    Routing,
    Scores,
    Summary,
    TargetScores,
    Verdict,
)

TOP1 = 1e-6  # a top-p so small that the nucleus is the likeliest label alone

if TYPE_CHECKING:
    from trace_plugin.improver.context import CycleContext
    from trace_plugin.store import Store


async def evaluate(
    improver: CycleContext,
    cycle: str,
    experts: dict[str, str],
    routing: Routing,
) -> Evaluation:
    """Score the candidate router and its experts against the live deployment, through the
    gateway, each capability at its calibrated level asked plainly, as the target's users
    ask (the screen played the live agent at the hardest): a level that names the tools
    measures a skill no user's request calls on."""
    config, console = improver.config, improver.console
    adapters = await improver.load_candidates(experts)  # again: the gateway may have restarted
    await improver.gateway.set_router(routing.router, name=cycle)
    live = await improver.live_model()
    capabilities: dict[str, Scores] = {}
    for capability, name in adapters.items():
        spec = plainly_asked(improver.spec(capability, experts))
        seeds = list(HELD_OUT_SEEDS[: config.eval_seeds])
        scored: dict[str, float] = {}
        for model in ("base", live, name):
            if model not in scored:
                scored[model] = mean_reward(await improver.play_spec(spec, model, seeds))
        base, current, candidate = scored["base"], scored[live], scored[name]
        capabilities[capability] = Scores(base=base, current=current, candidate=candidate)
        console.log(f"{capability}: base {base:.2f}, live {current:.2f}, candidate {candidate:.2f}")
    router, target, compared = routing.router, None, {}
    if config.target_seeds:
        seeds = list(config.target_seeds)
        current, candidate = (
            await improver.live_summary(seeds),
            summary(await improver.evaluator(f"router:{cycle}", seeds)),
        )
        if (hard := top1_variant(router)) is not None:
            # TRACE found one expert per request beat every merge: the gate's own tasks decide.
            await improver.gateway.set_router(hard, name=f"{cycle}-top1")
            alone = summary(await improver.evaluator(f"router:{cycle}-top1", seeds))
            compared = {"top_p": candidate.success, "top1": alone.success}
            console.log(f"top-p merge {candidate.success:.2f}, top-1 {alone.success:.2f} on the gate's tasks")
            if alone.success >= candidate.success:  # a tie goes to the simpler router
                router, candidate = hard, alone
                await improver.gateway.set_router(router, name=cycle)
        target = TargetScores(current=current, candidate=candidate)
        console.log(f"target: live {target.current.success:.2f}, candidate {target.candidate.success:.2f}")
    return Evaluation(adapters, router, capabilities, target, compared)


def top1_variant(router: RouterSpec) -> ClassifierSpec | None:
    """The same classifier choosing one expert per request instead of a top-p merge; None
    for a router that merges nothing."""
    if not isinstance(router, ClassifierSpec) or router.retrieval is None or len(router.experts) < 2:
        return None
    return router.model_copy(update={"retrieval": router.retrieval.model_copy(update={"top_p": TOP1})})


def live_key(deployment_id: str | None, seeds: Sequence[int]) -> str:
    """The key of the live deployment's one measurement on these target tasks."""
    return f"{deployment_id or 'base'}-{hashlib.sha256(str(list(seeds)).encode()).hexdigest()[:12]}"


def judge(evaluation: Evaluation | Mapping[str, Any], *, margin: float, tolerance: float) -> Verdict:
    """The deploy verdict: accept only a deployment that beats the live one on the target by
    more than ``margin`` and lets no capability fall more than ``tolerance``; the reasons say
    why not. ``evaluation`` is an ``Evaluation`` or its stored form (only its
    ``capabilities`` and ``target`` are read)."""
    if isinstance(evaluation, Evaluation):
        capabilities = {c: (s.current, s.candidate) for c, s in evaluation.capabilities.items()}
        target = evaluation.target
        success = (target.current.success, target.candidate.success) if target is not None else None
    else:
        capabilities = {c: (s["current"], s["candidate"]) for c, s in evaluation["capabilities"].items()}
        stored = evaluation.get("target")
        success = (stored["current"]["success"], stored["candidate"]["success"]) if stored else None
    reasons = []
    if success is not None:
        current, candidate = success
        if candidate - current <= margin:
            reasons.append(f"target success {candidate:.2f} does not beat the live {current:.2f} by {margin}")
    for capability, (current, candidate) in capabilities.items():
        if candidate < current - tolerance:
            reasons.append(f"{capability} regresses: {candidate:.2f} against the live {current:.2f}")
    if success is None and not any(candidate > current for current, candidate in capabilities.values()):
        reasons.append("no capability improved on its held-out seeds")
    return Verdict(accept=not reasons, reasons=reasons)


def summary(results: Sequence[EpisodeResult]) -> Summary:
    """Episodes of one model on the target: the success rate, mean reward by task kind, each episode."""
    by_kind: dict[str, list[float]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r.reward.total)
    return Summary(
        n=len(results),
        success=sum(reward_succeeds(r.reward.total) for r in results) / max(len(results), 1),
        by_kind={k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        episodes=[asdict(r) | {"reward": r.reward.total} for r in results],
    )


def mean_reward(results: Sequence[EpisodeResult]) -> float:
    return sum(r.reward.total for r in results) / len(results)


def reply_tokens(config: ImproverConfig, spec: EnvSpec) -> int:
    """How many tokens a reply in ``spec`` may take: the ``max_completion_length`` that
    ``training`` sets, else from its reference plays, in the served model's tokens. One
    source for calibration, training and held-out play."""
    if "max_completion_length" in config.pinned:
        return config.expert_training.max_completion_length
    return reply_budget(spec, load_tokenizer(config.model))


def episode_turns(config: ImproverConfig, spec: EnvSpec) -> int:
    """Model turns an episode in ``spec`` may take: the ``max_turns`` that ``training`` sets,
    else the target's stated horizon (or the preset's), and never fewer than the longest
    reference play needs: no play is cut for a preset's sake. One source for calibration,
    training and held-out play."""
    if "max_turns" in config.pinned:
        return config.expert_training.max_turns
    stated = target_turns(config.target) if config.target is not None else None
    return max(stated or config.expert_training.max_turns, turn_budget(spec))


async def play_spec(
    improver: CycleContext, spec: EnvSpec, model: str, seeds: Sequence[int]
) -> list[EpisodeResult]:
    """Play a synthesized environment as ``model`` through the gateway, as the expert was trained."""
    config = improver.config
    agent = ChatLoopAgent(
        f"{config.gateway_url}/v1",
        model,
        agent=f"eval:{config.agent}",
        max_tokens=reply_tokens(config, spec),  # as the expert was trained
        max_turns=episode_turns(config, spec),  # the horizon the expert was trained on
        examples=improver.examples(),
        recorder=improver.recorder,
    )
    runner = Runner(
        lambda: SpecEnv(spec), agent, concurrency=8, recorder=improver.recorder, console=improver.console
    )
    return await runner.run(seeds, description=f"{spec.name} as {model}")


async def chat_evaluator(improver: CycleContext, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
    """The default target evaluation: a chat loop with the agent's prompt and few-shot."""
    config = improver.config
    if config.target is None:
        raise ConfigError("target", "target_seeds need a target environment")
    factory: Callable[[], Environment] = env_factory(config.target, improver.store)
    horizon = target_turns(config.target)
    interface = CapturedInterface.from_store(improver.store, config.agent)
    agent = ChatLoopAgent(
        f"{config.gateway_url}/v1",
        model,
        agent=f"eval:{config.agent}",
        max_tokens=config.max_tokens,
        examples=interface.examples,
        recorder=improver.recorder,
        **({"max_turns": horizon} if horizon is not None else {}),
    )
    runner = Runner(factory, agent, concurrency=8, recorder=improver.recorder, console=improver.console)
    return await runner.run(seeds, description=f"{config.target} as {model}")


def bootstrap_interval(values: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of the mean of ``values`` (fixed seed: a run prints it again)."""
    rng = random.Random(seed)
    values = list(values)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def paired_gain(method: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """The 95% bootstrap interval of ``method`` minus ``baseline``, resampling tasks as pairs."""
    return bootstrap_interval([m - b for m, b in zip(method, baseline, strict=True)])


def lacking_transfer(
    store: Store,
    base_episodes: Sequence[Mapping[str, Any]],
    by_expert: Mapping[str, Sequence[float]],
    agent: str,
) -> dict[str, dict[str, float]]:
    """What each expert carries over to the target: on the tasks whose base episode its
    capability's detector labels LACKING, the base model's success and the expert's.

    ``base_episodes`` are a target summary's episodes (``Summary.episodes``, recorded as
    ``agent``); ``by_expert`` maps a capability to its expert's success per task, in the
    same order."""
    stored = {e.id: e for e in store.load_episodes(agent)}
    labels = [label_episode(Trajectory.from_episode(stored[e["episode_id"]])) for e in base_episodes]
    base = [float(reward_succeeds(e["reward"])) for e in base_episodes]
    out = {}
    for capability, values in by_expert.items():
        lacking = [i for i, label in enumerate(labels) if label.get(capability) is Label.LACKING]
        n = max(len(lacking), 1)
        out[capability] = {
            "tasks": len(lacking),
            "base": sum(base[i] for i in lacking) / n,
            "expert": sum(values[i] for i in lacking) / n,
        }
    return out
