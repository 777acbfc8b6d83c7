"""The headline comparison, at small scale: does TRACE beat plain GRPO at the same budget?

On the demo's stack (the embedded SmolLM2-135M behind the gateway, the example LangGraph
support agent, the retail target), after capturing train-split traffic and mining it:

1. base: the agent as it is;
2. GRPO on the target: one LoRA trained on the retail train split, with the whole budget;
3. one LoRA on the union of the synthesized environments (the paper's single-adapter ablation);
4. TRACE: one expert per mined capability (the budget split between them), routed by the
   base model as classifier, and by a learned gate fitted on practice tasks of the
   synthesized environments (which choice won each);
5. the oracle: per test task, the best of the base and every expert.

All rows use the same test tasks, greedy decoding, and the same total rollout budget.
Success rates come with 95% bootstrap intervals over tasks; router accuracy is each
router's agreement with the oracle's choice on tasks where one choice was strictly best.

    python bench/improvement.py [--quick] [--budget ROLLOUTS] [--tasks N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trace_plugin.demo import AGENT, SupportStack  # noqa: E402
from trace_plugin.environments.base import RewardBreakdown, Task, ToolCall  # noqa: E402
from trace_plugin.environments.catalog import prepare_environment  # noqa: E402
from trace_plugin.environments.interpreter import SpecEnv  # noqa: E402
from trace_plugin.environments.retail import TEST_SEEDS, TRAIN_SEEDS, RetailEnv  # noqa: E402
from trace_plugin.environments.spec import EnvSpec  # noqa: E402
from trace_plugin.environments.synthesis import Target  # noqa: E402
from trace_plugin.gateway.adapters import split_name  # noqa: E402
from trace_plugin.gateway.routing import router_from_spec  # noqa: E402
from trace_plugin.improver import TRAINING_SEEDS, GatewayAdmin, router_spec  # noqa: E402
from trace_plugin.mining.miner import OfflineMiner  # noqa: E402


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


def bootstrap(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget", type=int, help="total GRPO rollouts per method")
    parser.add_argument("--tasks", type=int, help="retail test tasks")
    parser.add_argument("--traffic", type=int, help="retail train tasks captured as traffic")
    args = parser.parse_args()
    budget = args.budget or (24 if args.quick else 96)
    tasks = args.tasks or (8 if args.quick else 48)
    traffic = args.traffic or (24 if args.quick else 64)
    console = Console()
    started = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="trace-bench-"))
    stack = SupportStack(home / "stack", console)
    store = stack.store
    test = list(TEST_SEEDS)[:tasks]
    try:
        stack.traffic(list(TRAIN_SEEDS)[:traffic])
        selected = [c for c in OfflineMiner(store).mine(AGENT) if c.selected][:2]
        console.print(f"selected capabilities: {[c.name for c in selected]}")
        specs = []
        for capability in selected:
            record = asyncio.run(prepare_environment(store, AGENT, capability))
            if record.status != "rejected":
                specs.append(record.spec)
        examples = Target.from_store(store, AGENT).examples
        adapters: dict[str, str] = {}  # row or capability -> served adapter name

        def train(name: str, factory: Any, seeds: list[int], rollouts: int, hint: Any = None) -> str:
            from training.experts import ExpertTrainer, ExpertTrainingConfig

            out = stack.adapter_root / name / "1"
            config = ExpertTrainingConfig.preset("cpu-small", output_dir=str(out), rollout_budget=rollouts)
            console.rule(f"training {name}: {rollouts} rollouts")
            ExpertTrainer(config, factory, seeds, hint=hint, examples=examples).train()
            asyncio.run(GatewayAdmin(stack.server.url).ensure_adapter(f"{name}@1", str(out)))
            return f"{name}@1"

        per_expert = max(budget // max(len(specs), 1), 4)
        for spec in specs:
            adapters[spec.capability] = train(
                spec.capability, lambda s=spec: SpecEnv(s), list(TRAINING_SEEDS), per_expert, spec.hint
            )
        adapters["grpo_target"] = train("grpo_target", RetailEnv, list(TRAIN_SEEDS), budget)
        if specs:
            adapters["single_union"] = train(
                "single_union",
                lambda: UnionEnv(specs),
                list(TRAINING_SEEDS),
                budget,
                lambda t: t.metadata.get("hint"),
            )

        admin = GatewayAdmin(stack.server.url)
        experts = {s.capability: adapters[s.capability] for s in specs}
        routers = {
            "trace": router_spec(experts, store, AGENT) if experts else {"kind": "static", "adapter": None}
        }
        if experts:
            routers["gate"] = fit_router_gate(stack, specs, experts, examples, console)
        for name, router in [*routers.items(), ("base", {"kind": "static", "adapter": None})]:
            asyncio.run(admin.set_router(router, name=name))

        def success(model: str) -> list[float]:
            results = asyncio.run(stack.evaluate(model, test))
            return [float(r.reward.total >= 1.0) for r in results]

        rows: dict[str, list[float] | None] = {
            "base": success("router:base"),
            "grpo_target": success(adapters["grpo_target"]),
            "single_union": success(adapters["single_union"]) if specs else None,
            "trace_classifier": success("router:trace"),
            "trace_gate": success("router:gate") if "gate" in routers else None,
        }
        by_expert = {name: success(adapters[name]) for name in experts}
        choices = [rows["base"], *by_expert.values()]
        rows["oracle"] = [max(column) for column in zip(*choices, strict=True)]
        accuracy = {
            name: router_accuracy(stack, router, experts, by_expert, rows["base"], test)
            for name, router in routers.items()
        }
    finally:
        stack.stop()

    table = Table(title=f"Retail test tasks: {tasks}, rollout budget {budget} per method (SmolLM2-135M, CPU)")
    for column in ("method", "success", "95% CI"):
        table.add_column(column)
    figures: dict[str, Any] = {}
    for name, values in rows.items():
        if values is None:
            table.add_row(name, "—", "no environments")
            figures[name] = None
            continue
        low, high = bootstrap(values)
        figures[name] = round(sum(values) / len(values), 4)
        table.add_row(name, f"{figures[name]:.2f}", f"[{low:.2f}, {high:.2f}]")
    console.print(table)
    console.print(f"router accuracy against the oracle: {accuracy}")
    console.print(f"{time.monotonic() - started:.0f} s in all")
    plot(figures, budget, home / "improvement.png")
    console.print(f"plot: {home / 'improvement.png'}")
    print(
        json.dumps(
            {
                "bench": "improvement",
                "quick": args.quick,
                "rollout_budget": budget,
                **figures,
                "router_accuracy": accuracy.get("trace"),  # the classifier's
                "gate_router_accuracy": accuracy.get("gate"),
                "n_test_tasks": tasks,
            }
        )
    )


def fit_router_gate(
    stack: SupportStack, specs: list[EnvSpec], experts: dict[str, str], examples: list[Any], console: Console
) -> dict[str, Any]:
    """A learned gate over the base and the experts, fitted on practice tasks of the
    synthesized environments, as the improver's route stage does."""
    from trace_plugin.environments.runner import ChatLoopAgent, Runner
    from trace_plugin.improver import GATE_SEEDS
    from training.experts import ExpertTrainingConfig
    from training.gate import fit_gate

    turns = ExpertTrainingConfig.preset("cpu-small").max_turns

    async def play(spec: EnvSpec, model: str, seeds: list[int]) -> list[float]:
        agent = ChatLoopAgent(
            stack.base_url,
            model,
            agent="bench:gate",
            max_turns=turns,
            examples=examples,
            recorder=stack.recorder,
        )
        runner = Runner(lambda: SpecEnv(spec), agent, concurrency=8, recorder=stack.recorder, console=console)
        return [r.reward.total for r in await runner.run(seeds, description=f"{spec.name} as {model}")]

    names = [split_name(name)[0] for name in experts.values()]
    embed = GatewayAdmin(stack.server.url).embed
    router, report = asyncio.run(fit_gate(specs, names, play, embed, list(GATE_SEEDS[:16])))
    console.print(f"gate fitted on {report['tasks']} practice tasks: {report['labels']}")
    return router


def router_accuracy(
    stack: SupportStack,
    spec: dict[str, Any],
    experts: dict[str, str],
    by_expert: dict[str, list[float]],
    base: list[float],
    seeds: list[int],
) -> float | None:
    """How often a router picks the oracle's choice, where one choice was strictly best."""
    if spec["kind"] == "static":  # one expert takes everything: the router makes no choice
        return None
    router = router_from_spec(spec, stack.backend)
    options = [None, *(split_name(name)[0] for name in experts.values())]  # what the router answers
    agreed = counted = 0
    for i, seed in enumerate(seeds):
        scores = [base[i], *(by_expert[c][i] for c in experts)]
        if scores.count(max(scores)) != 1:
            continue  # no single best choice: nothing to be right about
        task = RetailEnv().reset(seed)
        choice = asyncio.run(router.route([{"role": "user", "content": task.prompt}], None))
        counted += 1
        agreed += choice == options[scores.index(max(scores))]
    return round(agreed / counted, 4) if counted else None


def plot(figures: dict[str, Any], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(figures["base"], color="grey", linestyle="--", label="base (0 rollouts)")
    for name in ("grpo_target", "single_union", "trace_classifier", "trace_gate", "oracle"):
        if figures.get(name) is not None:
            ax.scatter([budget], [figures[name]], label=name, s=60)
    ax.set_xlabel("rollouts used")
    ax.set_ylabel("success on retail test tasks")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
