"""The headline's ablations: what each part of TRACE adds, read off a finished headline run.

Run after ``bench/improvement.py`` with the same options; it refuses a folder made with
other settings. On the headline's reported tasks, its adapters and its router:

- ``trace_no_warm_start``: the same cycles, environments and router, each expert retrained
  by GRPO alone (the paper's form);
- ``grpo_target_warm``: GRPO on the target after a warm start on as many of the target's own
  reference solutions as TRACE's experts had (labels production lacks), none of them a
  reported or gate task, at the headline's rollouts spent;
- ``single_union``: one LoRA on the union of the synthesized environments at the same rollouts;
- ``trace_classifier``: the base model as a hard top-1 classifier (no retrieval);
  ``trace_mixture_top1``: the improver's retrieval router, one expert per request;
  ``trace_gate``: the learned per-layer gate fitted on practice tasks;
- each expert alone, and the ``oracle``: per task, the best of the base, every expert and
  the mixture the improver's router chose;
- router accuracy: how often each router's choice, as the gateway itself decides it, is the
  oracle's, on tasks where one choice was strictly best (a mixture counts as its largest share);
- GRPO on the target along its run: its snapshots at a third and two thirds of its steps,
  the middle of the curve whose ends the headline printed.

Every result is kept under the run's folder beside the headline's: a killed run resumes.

    python bench/improvement_ablations.py [the headline's options]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from improvement import (  # noqa: E402
    AGENT,
    HORIZON,
    Bench,
    Clock,
    arguments,
    at_spent,
    expert_results,
    grpo_curve,
    peak_rss_gb,
    rows_table,
)

from trace_plugin.environments.base import RewardBreakdown, Task, ToolCall, task_keys  # noqa: E402
from trace_plugin.environments.interpreter import SpecEnv, worked_example  # noqa: E402
from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv  # noqa: E402
from trace_plugin.improver import TRAINING_SEEDS, router_spec  # noqa: E402
from trace_plugin.improver.evaluation import lacking_transfer  # noqa: E402
from trace_plugin.records.env_spec import EnvSpec  # noqa: E402
from trace_plugin.records.expert import (
    Expert,  # noqa: E402
    split_name,  # noqa: E402
)
from trace_plugin.records.mixture import LAYERS, Mixture  # noqa: E402


class UnionEnv:
    """Every synthesized environment as one: seed ``s`` plays environment ``s mod k``."""

    def __init__(self, specs: list[EnvSpec]) -> None:
        self.envs = [SpecEnv(spec) for spec in specs]
        self.tools = list({t["function"]["name"]: t for env in self.envs for t in env.tools}.values())
        self.system_prompt = specs[0].system_prompt
        self.current = self.envs[0]

    def reset(self, seed: int) -> Task:
        self.current = self.envs[seed % len(self.envs)]
        return self.current.reset(seed)

    @property
    def done(self) -> bool:
        return self.current.done

    def step(self, call: ToolCall) -> str:
        return self.current.step(call)

    def reward(self, answer: str = "") -> RewardBreakdown:
        return self.current.reward(answer)


def union_hint(specs: list[EnvSpec]) -> Any:
    """Each union task's hint as its own environment's expert gets it (the worked example)."""
    hints = [worked_example(spec) or spec.hint for spec in specs]
    return lambda task: hints[task.seed % len(specs)]


def without_warm_start(bench: Bench, expert: Expert) -> str:
    """``expert`` retrained by GRPO alone, with its own settings and hint."""
    spec = bench.improver.env_of(expert)
    settings = {k: v for k, v in expert.config.items() if k not in ("output_dir", "snapshots")}
    return bench.train(
        f"nowarm_{expert.capability}",
        lambda: SpecEnv(spec),
        list(TRAINING_SEEDS),
        hint=worked_example(spec) or spec.hint,  # as the improver's executor trains it
        **{**settings, "warm_start_plays": 0},
    )


def rename_adapters(router: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``router`` serving other adapters: every adapter it names (served ``name@version`` to
    the new served name) replaced, everything else (capability labels, corpus) as it was."""
    bare = {split_name(old)[0]: split_name(new)[0] for old, new in names.items()}

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        return bare.get(value, value) if key in ("adapter", "adapters") and isinstance(value, str) else value

    return walk(router)


def top1(router: dict[str, Any]) -> dict[str, Any]:
    """The improver's retrieval router keeping one expert per request (a nucleus of one)."""
    return {**router, "retrieval": {**router["retrieval"], "top_p": 1e-6}}


def dominant(label: str) -> str:
    """A routing decision's label as one choice: a mixture counts as its largest share."""
    mixture = Mixture.parse(label.split(LAYERS)[0])
    return mixture.dominant().label()


def choices(bench: Bench, experts: dict[str, Expert], rows: dict[str, list[float]]) -> list[dict[str, float]]:
    """Per reported task, the oracle's finite set and each option's success, keyed by the
    gateway's label: the base model, every expert, and the improver's router's choice."""
    options = []
    for i, seed in enumerate(bench.test):
        scores = {"": rows["base"][i]}
        for capability, expert in experts.items():
            scores[split_name(expert.adapter_name)[0]] = rows[f"expert-{capability}"][i]
        if "mixture" in rows:
            chosen = asyncio.run(bench.admin.route("router:mixture", RetailEnv().opening(seed)))
            scores.setdefault(chosen, rows["trace_mixture"][i])
        options.append(scores)
    return options


def router_accuracy(bench: Bench, model: str, options: list[dict[str, float]]) -> float | None:
    """How often the gateway's own choice as ``model`` is the oracle's, where one was strictly best."""
    agreed = counted = 0
    for scores, seed in zip(options, bench.test, strict=True):
        best = max(scores.values())
        winners = [option for option, score in scores.items() if score == best]
        if len(winners) != 1:
            continue  # no single best option: nothing to be right about
        counted += 1
        chosen = asyncio.run(bench.admin.route(model, RetailEnv().opening(seed)))
        agreed += (chosen if chosen in scores else dominant(chosen)) == winners[0]
    return round(agreed / counted, 4) if counted else None


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    if args.fresh:
        raise SystemExit("the ablations add to a headline run: --fresh belongs to bench/improvement.py")
    bench = Bench.open(args, need_started=True)
    if not (bench.out / "results" / "headline.json").is_file():
        bench.stop()
        raise SystemExit(f"{bench.out}'s headline run has not finished: run bench/improvement.py first")
    clock = Clock(bench.out / "seconds-ablations.json")
    headline = json.loads((bench.out / "results" / "headline.json").read_text())
    base, budget = headline["base"], headline["budget"]
    store, console = bench.store, bench.console
    try:
        last, experts = bench.last_deployment(), bench.experts()
        specs = [bench.improver.env_of(e) for e in experts.values()]
        rows: dict[str, Any] = {"base": base, "trace_mixture": headline["trace_mixture"]}
        for capability, expert in experts.items():
            rows[f"expert-{capability}"] = bench.evaluated(
                f"expert-{capability}", lambda e=expert: e.adapter_name
            )
            clock.tick()
        routed = last is not None and last.router["kind"] != "static"
        routers: dict[str, dict[str, Any]] = {}
        if routed:
            routers["mixture"] = last.router
            bench.serve(last.router, "mixture", last.adapters.values())
            adapters = {c: e.adapter_name for c, e in experts.items()}
            routers["top1"] = router_spec(adapters, store, AGENT).to_dict()  # no corpus: hard top-1
            if last.router.get("retrieval"):
                routers["mixture_top1"] = top1(last.router)
            routers["gate"] = bench.results.get(
                "router-gate", lambda: asyncio.run(bench.improver.learned_router(adapters)).router.to_dict()
            )
            for name, spec in routers.items():
                asyncio.run(bench.admin.set_router(spec, name=name))
            rows["trace_classifier"] = bench.evaluated("trace_classifier", lambda: "router:top1")
            if "mixture_top1" in routers:
                rows["trace_mixture_top1"] = bench.evaluated(
                    "trace_mixture_top1", lambda: "router:mixture_top1"
                )
            rows["trace_gate"] = bench.evaluated("trace_gate", lambda: "router:gate")
            clock.tick()
        if last is not None and not args.quick:  # the quick run keeps within its minutes
            renamed = {e.adapter_name: without_warm_start(bench, e) for e in experts.values()}
            rows["trace_no_warm_start"] = bench.evaluated(
                "trace_no_warm_start", lambda: bench.serve(rename_adapters(last.router, renamed), "no_warm")
            )
            clock.tick()
        reference_plays = sum(r.reference_plays for r in expert_results(store))
        if reference_plays and not args.quick:
            warm = bench.train(
                "grpo_target_warm", RetailEnv, list(TRAIN_SEEDS),
                warm_start_plays=reference_plays, exclude=task_keys(RetailEnv, [*bench.test, *bench.gate]),
                **at_spent(bench, budget), **HORIZON,
            )  # fmt: skip
            rows["grpo_target_warm"] = bench.evaluated("grpo_target_warm", lambda: warm)
            clock.tick()
        if specs and not (len(specs) == 1 and not routed):  # one environment is its own union: that expert
            union = bench.train(
                "single_union",
                lambda: UnionEnv(specs),
                list(TRAINING_SEEDS),
                union_hint(specs),
                **at_spent(bench, budget),
            )
            rows["single_union"] = bench.evaluated("single_union", lambda: union)
            clock.tick()
        curve = [(n, round(mean(v), 4)) for n, v in grpo_curve(bench)]
        clock.tick()
        options = choices(bench, experts, rows)
        rows["oracle"] = [max(scores.values()) for scores in options]
        accuracy = {name: router_accuracy(bench, f"router:{name}", options) for name in routers}
        by_expert = {c: rows[f"expert-{c}"] for c in experts}
        transfer = lacking_transfer(
            store, bench.results.get("base-summary", lambda: None)["episodes"], by_expert, f"eval:{AGENT}"
        )
    finally:
        bench.stop()
        clock.tick()

    figures = rows_table(console, rows, {}, f"Ablations on the {len(bench.test)} reported retail tasks")
    console.print(f"router accuracy against the oracle: {accuracy}")
    console.print(
        "GRPO on the target along its run (rollouts spent → success): "
        + (", ".join(f"{n} → {s:.2f}" for n, s in curve) or "no snapshot reached")
    )
    console.print(
        "transfer, each expert on the reported tasks whose base episode its detector labels LACKING: "
        + ", ".join(
            f"{c} {t['base']:.2f} → {t['expert']:.2f} ({t['tasks']} tasks)" for c, t in transfer.items()
        )
    )
    print(
        json.dumps(
            {
                "bench": "improvement_ablations",
                "quick": args.quick,
                **{
                    name: figures.get(name)
                    for name in (
                        "trace_no_warm_start",
                        "grpo_target_warm",
                        "single_union",
                        "trace_classifier",
                        "trace_gate",
                        "trace_mixture_top1",
                        "oracle",
                    )
                },  # fmt: skip
                "experts": {c: round(mean(rows[f"expert-{c}"]), 4) for c in experts},
                "router_accuracy": accuracy.get("mixture"),
                "router_accuracy_top1": accuracy.get("top1"),
                "router_accuracy_gate": accuracy.get("gate"),
                "curve_grpo_snapshots": [[n, s] for n, s in curve],
                "bench_seconds": round(clock.total),
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    )


if __name__ == "__main__":
    main()
