"""Validation and calibration: whether a synthesized environment is fit to train on.

An environment is usable only when its reward means something:

- **checks**: the reference policy scores 1 on at least 99% of seeds, while doing nothing
  and acting at random average at most 0.2 (so reward measures the capability, not luck);
- **calibration**: the base model, sampled K times on each of M seeds, must land in a
  learnable band (mean reward 0.15–0.7 by default) with enough informative groups (K
  samples that do not all score the same: GRPO learns nothing from a constant group).
  Out of band, ``adjust`` turns a difficulty knob and calibration runs again, up to
  five attempts; every attempt is kept in the report. Easing never lets doing nothing or
  random calls pass: a step that would is skipped.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trace_plugin.environments.base import ToolCall
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.mining.kinds import KINDS
from trace_plugin.records.env_spec import WRITES, Check, EnvSpec, TaskTemplate
from trace_plugin.records.outcome import reward_succeeds

VALIDATION_SEEDS = range(1_000_000, 1_000_100)  # disjoint from training and calibration seeds
CALIBRATION_SEEDS = range(2_000_000, 2_000_100)


@dataclass(frozen=True, slots=True)
class PolicyCheck:
    reference_success: float
    do_nothing_mean: float
    random_mean: float
    seeds: int
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems


def check_policies(
    spec: EnvSpec,
    seeds: Sequence[int] = VALIDATION_SEEDS,
    *,
    min_reference: float = 0.99,
    max_baseline: float = 0.2,
) -> PolicyCheck:
    """Play the reference, do-nothing and random policies on ``seeds``."""
    env = SpecEnv(spec)
    reference = nothing = rand = 0.0
    errors: list[str] = []
    for seed in seeds:
        task = env.reset(seed)
        errors += task.metadata["reference_errors"][:1]
        for action in task.metadata["reference"]:
            env.step(ToolCall(action["name"], action["arguments"]))
        reference += reward_succeeds(env.reward(" ".join(str(f) for f in task.metadata["facts"])).total)
        env.reset(seed)
        nothing += env.reward("").total
        env.reset(seed)
        rand += _random_episode(env, random.Random(seed))
    n = len(seeds)
    check = (reference / n, nothing / n, rand / n)
    problems = []
    if check[0] < min_reference:
        problems.append(f"reference succeeds on {check[0]:.0%} of seeds (< {min_reference:.0%})")
        problems += [f"e.g. {e}" for e in errors[:1]]
    if check[1] > max_baseline:
        problems.append(f"doing nothing averages {check[1]:.2f} (> {max_baseline})")
    if check[2] > max_baseline:
        problems.append(f"random calls average {check[2]:.2f} (> {max_baseline})")
    return PolicyCheck(*(round(v, 4) for v in check), seeds=n, problems=tuple(problems))


def _random_episode(env: SpecEnv, rng: random.Random, calls: int = 3) -> float:
    """Random offered tools with arguments of the right types, but values the agent made up."""
    offered = [t for t in env.spec.tools if t.name in env.offered]
    for _ in range(calls):
        tool = rng.choice(offered)
        properties = tool.parameters.get("properties", {})
        env.step(ToolCall(tool.name, {name: made_up(schema, rng) for name, schema in properties.items()}))
    return env.reward("I could not help with that.").total


def made_up(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value of ``schema``'s type that nobody asked for (an enum's member at random)."""
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randrange(10**6)
    if kind == "number":
        return rng.randrange(10**6) / 100
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "object":
        return {k: made_up(v, rng) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [made_up(schema.get("items") or {}, rng)]
    return f"X{rng.randrange(10**6)}"


# -- calibration ----------------------------------------------------------------------------

# Plays one episode of ``env`` (already reset to ``seed``) and returns its reward.
Play = Callable[[SpecEnv, int], Awaitable[float]]


@dataclass(frozen=True, slots=True)
class Band:
    low: float = 0.15
    high: float = 0.7
    informative: float = 0.5
    attempts: int = 5


DEFAULT_BAND = Band()


@dataclass(slots=True)
class Calibration:
    """Every attempt's figures and the knobs it ran with; the last attempt decides."""

    attempts: list[dict[str, Any]] = field(default_factory=list)
    band: Band = DEFAULT_BAND

    @property
    def in_band(self) -> bool:
        return bool(self.attempts) and self.attempts[-1]["in_band"]

    @property
    def verdict(self) -> str:
        """In plain words, whether the base model gets a learning signal here, and if not why."""
        if not self.attempts:
            return "not calibrated"
        last, band = self.attempts[-1], self.band
        figures = f"mean reward {last['mean_reward']:.2f}, {last['informative']:.0%} of groups informative"
        if self.in_band:
            return f"learnable: {figures}"
        if last["mean_reward"] > band.high:
            why = f"the base model already solves it (above {band.high})"
        elif last["informative"] < band.informative:
            why = (
                f"too few groups differ for GRPO to learn from (needs {band.informative:.0%}): "
                "the base model's samples of a task almost always score alike"
            )
        else:
            why = f"the base model scores too little (below {band.low})"
        # Not "not learnable": the warm-started expert, not the base model, is what GRPO trains.
        return f"out of the base model's band after {len(self.attempts)} attempt(s): {figures}; {why}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "band": asdict(self.band),
            "attempts": self.attempts,
            "in_band": self.in_band,
            "verdict": self.verdict,
        }


async def calibrate(
    spec: EnvSpec,
    play: Play,
    *,
    seeds: Sequence[int] = CALIBRATION_SEEDS[:8],
    samples: int = 4,
    hint_fraction: float = 0.0,
    band: Band = DEFAULT_BAND,
    progress: Callable[[str], None] | None = None,
) -> tuple[EnvSpec, Calibration]:
    """Measure the base model on ``spec``; adjust difficulty until it is learnable.

    Returns the last spec tried and the report. ``hint_fraction`` of the samples see the
    hint, as they will in training.
    """
    report = Calibration(band=band)
    for attempt in range(band.attempts):

        async def sample(seed: int, k: int, spec: EnvSpec = spec) -> float:
            env = SpecEnv(spec, hinted=k < round(hint_fraction * samples))
            env.reset(seed)
            return await play(env, seed)

        # Every sample at once, so the model server can batch them.
        rewards = await asyncio.gather(*(sample(seed, k) for seed in seeds for k in range(samples)))
        groups = [rewards[i : i + samples] for i in range(0, len(rewards), samples)]
        flat = [r for g in groups for r in g]
        mean = sum(flat) / len(flat)
        informative = sum(len(set(g)) > 1 for g in groups) / len(groups)
        in_band = band.low <= mean <= band.high and informative >= band.informative
        report.attempts.append(
            {
                "attempt": attempt + 1,
                "mean_reward": round(mean, 4),
                "informative": round(informative, 4),
                "in_band": in_band,
                "difficulty": spec.difficulty.model_dump(),
                "templates": [t.kind for t in spec.tasks],
                "checks": [c.label for c in spec.checks],
            }
        )
        if progress:
            progress(f"calibration {attempt + 1}: mean {mean:.2f}, informative {informative:.0%}")
        if in_band or attempt == band.attempts - 1:  # the spec returned is the one measured
            break
        adjusted = adjust(spec, mean, band)
        if adjusted is None:
            break
        spec = adjusted
    return spec, report


def levels(spec: EnvSpec) -> tuple[list[EnvSpec], int]:
    """The environment's difficulty levels, easiest first, and the index of ``spec`` among
    them: the easing ladder's steps below it, then the harder steps above it (the tools
    named in half the requests, then in none; more distractor rows). Easing keeps the
    calls that are the capability, so every level exercises it."""
    easier: list[EnvSpec] = []
    harder: list[EnvSpec] = []
    step: EnvSpec | None = spec
    while (step := adjust(step, 0.0)) is not None:
        easier.append(step)
    step = spec
    while (step := adjust(step, 1.0)) is not None:
        harder.append(step)
    return [*reversed(easier), spec, *harder], len(easier)


def plainly_asked(spec: EnvSpec) -> EnvSpec:
    """``spec`` with requests that name no tool, as the target's users write them: the
    tickets the warm start plays, whatever level GRPO starts at."""
    return spec.model_copy(update={"difficulty": spec.difficulty.model_copy(update={"name_tools": 0.0})})


def plain_level(ladder: Sequence[EnvSpec], start: int) -> int:
    """The first of ``ladder``'s levels from ``start`` up whose requests name no tool, as the
    target's users ask (``start`` where none is)."""
    return next((i for i in range(start, len(ladder)) if not ladder[i].difficulty.name_tools), start)


def training_forms(spec: EnvSpec) -> list[EnvSpec]:
    """Every form in which training may meet ``spec``'s tasks: its levels and the warm
    start's plain requests. The same task asked another way is the same task, so an
    evaluated seed is kept out of training in all of them."""
    ladder, _ = levels(spec)
    return [*ladder, plainly_asked(spec)]


def adjust(spec: EnvSpec, mean: float, band: Band = DEFAULT_BAND) -> EnvSpec | None:
    """One step easier or harder, or None when no knob is left to turn.

    Easier, in order: no distractor rows; requests that name the tools to call; one call
    per ticket (for kinds whose point is that last call); partial credit for calls of the
    right tool with some right arguments; fewer templates. A step whose spec would let
    doing nothing or random calls pass (``check_policies``) is skipped."""
    difficulty = spec.difficulty
    if mean > band.high:
        if difficulty.name_tools:  # all tickets named, then half, then none: no cliff between
            fewer = 0.5 if difficulty.name_tools > 0.5 else 0.0
            return spec.model_copy(update={"difficulty": difficulty.model_copy(update={"name_tools": fewer})})
        if difficulty.distractor_rows >= 12:
            return None
        harder = difficulty.model_copy(update={"distractor_rows": difficulty.distractor_rows + 4})
        return spec.model_copy(update={"difficulty": harder})
    return next((s for s in _easier(spec) if check_policies(s).passed), None)


def _grouped(
    templates: list[TaskTemplate], key: Callable[[TaskTemplate], Hashable]
) -> dict[Hashable, list[TaskTemplate]]:
    """``templates`` by ``key``, each group in their order."""
    groups: dict[Hashable, list[TaskTemplate]] = {}
    for template in templates:
        groups.setdefault(key(template), []).append(template)
    return groups


def _easier(spec: EnvSpec) -> Iterator[EnvSpec]:
    """The easing ladder's steps that change ``spec``, in order."""
    difficulty = spec.difficulty
    if difficulty.distractor_rows:
        yield spec.model_copy(update={"difficulty": difficulty.model_copy(update={"distractor_rows": 0})})
    if difficulty.name_tools < 1.0:  # a model that calls nothing may call what it is told to
        yield spec.model_copy(update={"difficulty": difficulty.model_copy(update={"name_tools": 1.0})})
    kind = KINDS.get(spec.capability)
    multi_step = any(len(t.reference) > 1 for t in spec.tasks)
    if kind is not None and kind.single_step_keeps_it and not difficulty.single_step and multi_step:
        yield spec.model_copy(update={"difficulty": difficulty.model_copy(update={"single_step": True})})
    if all(c.kind != "arguments" for c in spec.checks):
        yield spec.model_copy(update={"checks": [*spec.checks, Check(kind="arguments")]})
    # Fewer templates: the shortest, then half of them. Where some tickets write, only
    # writing ones are kept, and every kind of write stays, made every way its tickets make
    # it (each keeps its shortest, then half its phrasings, down to one template a kind and
    # way): the writes are what such an environment teaches. Halving across kinds once left
    # a writes environment with cancellations alone, which the live expert already solved,
    # while the target's returns and exchanges still failed; halving a kind's phrasings
    # left its tickets identifying users by email alone, and the expert invented an email
    # for every target user who gave a name and a zip. The shortest tickets (a lookup)
    # would ease it into another capability. Templates whose right answer is no call stay:
    # a minority by design.
    writes = {t.name for t in spec.tools if t.behaviour in WRITES}
    acting = [t for t in spec.tasks if t.reference]
    idle = [t for t in spec.tasks if not t.reference]
    writing = [t for t in acting if any(a.tool in writes for a in t.reference)]
    kinds = list(_grouped(writing, lambda t: t.kind).values()) or [acting]  # no writes: kinds may go
    easier = [t for ts in kinds for t in ts if len(t.reference) == min(len(u.reference) for u in ts)]
    if len(easier) == len(acting) and writing:
        ways = _grouped(writing, lambda t: (t.kind, *(f"{a.tool}{sorted(a.arguments)}" for a in t.reference)))
        easier = [t for ts in ways.values() for t in ts[: max(1, len(ts) // 2)]]
    elif len(easier) == len(acting):
        easier = acting[: max(1, len(acting) // 2)]
    if len(easier) < len(acting):
        yield spec.model_copy(update={"tasks": easier + idle})
