"""Rollout-budget ablation (issue #20): does more GRPO budget make the un-hinted reward rise?

On the CPU our experts train on 24 rollouts and their un-hinted reward never rises; the
README supposes that more rollouts would make it rise. This measures it on a GPU, in one
device call: two LoRA runs of the same budget, each keeping its adapter at 32, 128 and all
of its rollouts (snapshots of one run),

- ``tool_call_format``: the expert for the synthesized environment the improver's demo
  mines first, trained as the improver trains it (``training.executors.run_job``: its
  worked example as the hint, the agent's few-shot before every prompt);
- ``grpo_target``: GRPO on the retail target itself, as ``bench/improvement.py`` trains its
  ``grpo_target`` row (``RetailEnv`` on ``TRAIN_SEEDS``, no hint, the agent's few-shot,
  the agent's horizon of 6 turns and 96 tokens);

and greedy evaluation (``training.experts.evaluate``) of the base model and of every
snapshot on 48 retail test tasks (six per kind) and on 32 held-out seeds of the
``tool_call_format`` environment. Each finished stage is appended to ``OUT/results.jsonl``
and ``OUT/summary.json`` is rewritten, so a run killed at its timeout still leaves what it
finished. Stages run most informative first and are skipped (null) when they would not fit
in ``--deadline-s``; a training run that would overrun its share stops early (at a whole
step) and says so.

``--shape improver`` trains each run as the CPU does instead (the ``cpu-small`` preset: one
group of 4 rollouts a step, so a budget buys optimizer steps, not bigger groups): the expert
with the demo's improver's settings (``trace_plugin.demo.EXPERT_TRAINING``: three turns),
GRPO on the target with the agent's horizon, as ``bench/improvement.py`` trains
both; snapshots at 24 and 48 rollouts (the demo's budget per expert, the bench's for GRPO).

    python scripts/gpu_budget_check.py [--model DIR] [--budget N] [--out DIR] [--deadline-s S]
                                       [--shape gpu|improver] [--runs NAME ...] [--quick]

The last line printed is one JSON object, ``{"bench": "gpu_budget", ...}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# transformers >= 5.2x kernelizes layers (RMSNorm on CUDA) with kernels it fetches from the Hub
# when ``kernels`` is installed, and refuses to load a model when it is not; every load here is
# offline (model_files), so keep PyTorch's own layers, as the CPU runs use them.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trace_plugin.environments.interpreter import SpecEnv, worked_example  # noqa: E402
from trace_plugin.environments.retail import POLICY, TEST_SEEDS, TOOLS, TRAIN_SEEDS, RetailEnv  # noqa: E402
from trace_plugin.environments.synthesis import synthesize  # noqa: E402
from trace_plugin.improver.config import HELD_OUT_SEEDS, TRAINING_SEEDS  # noqa: E402

# -- the one place for this run's settings ----------------------------------------------------------

# The support agent's horizon as served (bench/improvement.py: RETAIL_TURNS, RETAIL_TOKENS).
RETAIL_HORIZON = {"max_turns": 6, "max_completion_length": 96}
# --shape gpu: ExpertTrainingConfig.preset("gpu", **TRAINING) for both runs (plus rollout_budget,
# snapshots, precision and output_dir, set per run). The LoRA and learning rate are the cpu-small
# preset's, the horizon the support agent's as served (RETAIL_HORIZON).
TRAINING: dict[str, Any] = {
    "backend": "transformers",
    "gradient_checkpointing": False,
    "share_prompt": True,
    "num_generations": 8,
    "groups_per_step": 4,
    **RETAIL_HORIZON,
    "max_observation_chars": 800,
    "lora_rank": 8,
    "lora_alpha": 16,
    "learning_rate": 3e-4,
    # As the demo's and bench's improver trains experts ("Half the rollouts see a worked
    # example"); grpo_target has no hint, so it changes nothing there.
    "hint_fraction": 0.5,
    "checkpoint_every": 1_000_000,  # one device call: nothing to resume from
}
SNAPSHOT_ROLLOUTS = {"gpu": (32, 128), "improver": (24, 48)}  # besides the whole budget
BUDGET = 512
TEST_TASKS = 48  # bench/improvement.py's default preset: list(TEST_SEEDS)[:48], six per retail kind
HELD_OUT = 32  # the improver's held-out seeds of a synthesized environment: HELD_OUT_SEEDS[:n]
DEADLINE_S = 420.0
# --quick: a CPU smoke run of every stage.
QUICK = {
    "budget": 4,
    "test_tasks": 2,
    "held_out": 2,
    "snapshots": (2,),
    "training": {
        "num_generations": 2,
        "groups_per_step": 1,
        "max_turns": 2,
        "max_completion_length": 32,
        "resample_rounds": 0,
    },
    "deadline_s": 1200.0,
}
RUNS = ("tool_call_format", "grpo_target")  # in the order they train
EVAL_MARGIN = 1.5  # an adapter's episodes run longer than the base model's: its evaluation's time, estimated


def few_shot() -> list[dict[str, Any]]:
    """The support agent's few-shot (``FEW_SHOT`` in examples/support_agent/agent.py) in the
    form the bench's GRPO and evaluation put it before every prompt: ``improver.examples()``,
    the context its captured traffic shows, i.e. ``integrations.langgraph.message_to_openai``
    of ``few_shot_messages()``. Read from the source, since that module imports LangChain,
    which the GPU machine does not have; ``--quick`` checks it against LangChain's own."""
    tree = ast.parse((ROOT / "examples/support_agent/agent.py").read_text())
    node = next(
        n
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "FEW_SHOT"
    )
    messages: list[dict[str, Any]] = []
    for role, body in ast.literal_eval(node.value):
        if role == "user":
            messages.append({"role": "user", "content": body})
        elif role == "tool":
            messages.append(
                {"role": "tool", "content": body["content"], "tool_call_id": body["tool_call_id"]}
            )
        elif isinstance(body, dict):
            calls = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c.get("args", {}))},
                }
                for c in body["tool_calls"]
            ]
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            messages.append({"role": "assistant", "content": body})
    return messages


def check_few_shot(examples: list[dict[str, Any]]) -> bool | None:
    """Whether ``few_shot()`` is what LangChain's conversion gives (None: LangChain missing)."""
    try:
        from examples.support_agent.agent import few_shot_messages
        from integrations.langgraph import message_to_openai
    except ImportError:
        return None
    return examples == [message_to_openai(m) for m in few_shot_messages()]


class Run:
    """The deadline, the results file, and the summary rewritten after every stage."""

    def __init__(self, out: Path, deadline_s: float, console: Console) -> None:
        self.out, self.console = out, console
        self.start = time.monotonic()
        self.deadline_s = deadline_s
        out.mkdir(parents=True, exist_ok=True)
        self.results = out / "results.jsonl"
        self.summary: dict[str, Any] = {"bench": "gpu_budget"}

    def remaining(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def record(self, stage: str, data: dict[str, Any] | None) -> None:
        line = {"stage": stage, "elapsed_s": round(time.monotonic() - self.start, 1), "result": data}
        with self.results.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
        self.write_summary()

    def write_summary(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))

    def skip(self, stage: str, needed: float) -> None:
        self.console.print(
            f"[yellow]skipped {stage}: needs about {needed:.0f} s, {self.remaining():.0f} s left[/]"
        )
        self.record(stage, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local HF model dir (default: the embedded SmolLM2-135M)")
    parser.add_argument("--budget", type=int, help=f"rollouts per training run (default {BUDGET})")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu-budget"))
    parser.add_argument("--deadline-s", type=float, help=f"wall-time cap (default {DEADLINE_S:.0f})")
    parser.add_argument("--shape", choices=("gpu", "improver"), default="gpu", help="how each run trains")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="the training runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run")
    args = parser.parse_args()

    import torch
    from transformers import TrainerCallback

    from trace_plugin.model_files import resolve_model
    from training.config import ExpertTrainingConfig
    from training.experts import ExpertResult, ExpertTrainer, evaluate

    console = Console(width=None if sys.stdout.isatty() else 160)
    cuda = torch.cuda.is_available()
    budget = args.budget or (QUICK["budget"] if args.quick else BUDGET)
    n_test = QUICK["test_tasks"] if args.quick else TEST_TASKS
    n_held = QUICK["held_out"] if args.quick else HELD_OUT
    deadline = args.deadline_s or (QUICK["deadline_s"] if args.quick else DEADLINE_S)
    run = Run(args.out, deadline, console)
    model = resolve_model(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-budget-"))  # adapters: never under --out

    quick = QUICK["training"] if args.quick else {}
    if args.shape == "gpu":
        preset, settings = "gpu", dict(TRAINING)
        per_run: dict[str, dict[str, Any]] = {}  # both runs as TRAINING says
    else:
        from trace_plugin.demo import EXPERT_TRAINING

        preset, settings = "cpu-small", {"checkpoint_every": 1_000_000}
        per_run = {"tool_call_format": EXPERT_TRAINING, "grpo_target": {**EXPERT_TRAINING, **RETAIL_HORIZON}}
    settings["precision"] = "bfloat16" if cuda else "auto"

    def config(name: str, snapshots: tuple[int, ...] = (), **overrides: Any) -> Any:
        return ExpertTrainingConfig.preset(
            preset,
            **{**settings, **per_run.get(name, {}), **overrides, **quick},
            rollout_budget=budget,
            snapshots=snapshots,
            output_dir=str(scratch / name),
        )

    # Evaluations play every environment with the agent's horizon, whatever the run trained with.
    base_config = config("base", **RETAIL_HORIZON)
    per_step = base_config.num_generations * base_config.groups_per_step
    trained = budget // per_step * per_step  # whole steps
    candidates = (*(QUICK["snapshots"] if args.quick else SNAPSHOT_ROLLOUTS[args.shape]), trained)
    snapshots = tuple(sorted({r for r in candidates if r % per_step == 0 and per_step <= r <= trained}))
    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)  # as scripts/gpu_train_check.py
    examples = few_shot()
    test_seeds = list(TEST_SEEDS)[:n_test]  # bench/improvement.py: list(TEST_SEEDS)[: preset.test_tasks]
    # trace_plugin/improver/evaluation.py: HELD_OUT_SEEDS[: config.eval_seeds]
    held_seeds = list(HELD_OUT_SEEDS[:n_held])
    envs = {
        "retail": (RetailEnv, test_seeds),
        "tool_call_format": (lambda: SpecEnv(spec), held_seeds),
    }
    # Both training runs: (env factory, training seeds, hint). The tool_call_format expert is
    # trained as training.executors.run_job trains the improver's experts; grpo_target as
    # bench/improvement.py trains its row (no hint: "its tickets carry no hint").
    runs = {
        "tool_call_format": (lambda: SpecEnv(spec), list(TRAINING_SEEDS), worked_example(spec) or spec.hint),
        "grpo_target": (RetailEnv, list(TRAIN_SEEDS), None),
    }
    runs = {name: runs[name] for name in RUNS if name in args.runs}
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    run.summary.update(
        {
            "quick": args.quick,
            "shape": args.shape,
            "device": device,
            "torch": torch.__version__,
            "model": str(model),
            "rollout_budget": budget,
            "snapshots": list(snapshots),
            "n_test_tasks": len(test_seeds),
            "n_held_out": len(held_seeds),
            "deadline_s": deadline,
            "config": {name: config(name, snapshots).to_dict() | {"output_dir": None} for name in runs},
            # Every training run's prompts and every evaluation's: the support agent's few-shot.
            "examples": "examples/support_agent/agent.py FEW_SHOT (improver.examples())",
            "models": {},
            "training": {},
        }
    )
    console.rule(
        f"rollout-budget ablation on {device}, {args.shape} shape: {budget} rollouts a run, "
        f"snapshots {list(snapshots)}"
    )
    console.print_json(json.dumps(run.summary["config"]))
    console.print(
        f"retail test tasks {len(test_seeds)} ({test_seeds[0]}…), tool_call_format held-out seeds "
        f"{len(held_seeds)} ({held_seeds[0]}…); few-shot of {len(examples)} messages; "
        f"deadline {deadline:.0f} s"
    )

    eval_seconds: dict[str, float] = {}  # per environment, the base model's

    def evaluate_model(label: str, adapter: Path | None, rollouts: int, order: tuple[str, ...]) -> None:
        row = run.summary["models"].setdefault(label, {"rollouts": rollouts})
        for env_name in order:
            factory, seeds = envs[env_name]
            stage = f"eval {label} on {env_name}"
            needed = eval_seconds.get(env_name, 0.0) * (EVAL_MARGIN if adapter else 1.0)
            if needed > run.remaining():
                row[env_name] = None
                run.skip(stage, needed)
                continue
            started = time.monotonic()
            result = evaluate(
                model, adapter, factory, seeds, config=base_config, examples=examples, batch_size=64
            )
            seconds = time.monotonic() - started
            if adapter is None:
                eval_seconds[env_name] = seconds
            row[env_name] = {
                "success": round(result.success_rate, 4),
                "mean_reward": round(result.mean_reward, 4),
                "seconds": round(seconds, 1),
                "rewards": {str(s): r for s, r in result.rewards.items()},
            }
            console.log(
                f"{stage}: success {result.success_rate:.3f}, "
                f"mean reward {result.mean_reward:.3f} ({seconds:.0f} s)"
            )
            run.record(stage, row[env_name])

    class Deadline(TrainerCallback):
        """Stops training at a whole step when another step would pass ``until``."""

        def __init__(self, until: float) -> None:
            self.until, self.started, self.stopped = until, time.monotonic(), False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            per_step_s = (time.monotonic() - self.started) / max(state.global_step, 1)
            if state.global_step < state.max_steps and time.monotonic() + per_step_s > self.until:
                control.should_training_stop = self.stopped = True

    def train(name: str, runs_left: int) -> ExpertResult | None:
        factory, seeds, hint = runs[name]
        evals = sum(eval_seconds.values()) * EVAL_MARGIN * len(snapshots) * runs_left
        share = (run.remaining() - evals) / runs_left  # this run's share of what the evaluations leave
        stage = f"train {name}"
        if share < 20:
            run.skip(stage, 20 + evals)
            run.summary["training"][name] = None
            return None
        console.rule(f"training {name}: {budget} rollouts, at most {share:.0f} s")
        deadline_cb = Deadline(time.monotonic() + share)
        started = time.monotonic()
        result = ExpertTrainer(
            config(name, snapshots),
            factory,
            seeds,
            model=model,
            hint=hint,
            examples=examples,
            callbacks=[deadline_cb],
            console=console,
        ).train()
        seconds = time.monotonic() - started
        resampled = sum(entry.get("dynamic_sampling/resampled_groups", 0.0) for entry in result.logs)
        done = result.steps * per_step
        data = {
            "hint": "worked_example" if hint else None,
            "steps": result.steps,
            "rollouts": done,  # trained on: whole steps
            "rollouts_played": int(done + resampled * base_config.num_generations),  # with resampled groups
            "stopped_early": deadline_cb.stopped,
            "seconds": round(seconds, 1),  # model load and adapter saves included
            "rollouts_per_s": round(done / seconds, 3),
            "reward_curve": [round(r, 4) for r in result.reward_curve],
            "unhinted_curve": [None if r is None else round(r, 4) for r in result.unhinted_curve],
            "success_curve": [round(e.get("episodes/success", 0.0), 4) for e in result.logs],
            "rollout_seconds": round(sum(e.get("timing/rollout_seconds", 0.0) for e in result.logs), 1),
            "zero_signal_groups": [int(e.get("dynamic_sampling/zero_signal_groups", 0)) for e in result.logs],
            "dropped_groups": [int(e.get("dynamic_sampling/dropped_groups", 0)) for e in result.logs],
            "snapshots": [r for r in result.snapshots if result.snapshot(r).is_dir()],
        }
        console.log(
            f"{name}: {result.steps} steps, {done} rollouts in {seconds:.0f} s "
            f"({data['rollouts_per_s']} rollouts/s); "
            f"un-hinted reward per step {data['unhinted_curve']}"
        )
        run.summary["training"][name] = data
        run.record(stage, data)
        return result

    def evaluate_snapshots(name: str, result: ExpertResult | None, order: tuple[str, ...]) -> None:
        if result is None:
            return
        kept = {r: result.snapshot(r) for r in result.snapshots if result.snapshot(r).is_dir()}
        done = result.steps * per_step
        if done not in kept:  # stopped at the deadline: the final adapter is the most trained one
            kept[done] = result.adapter_dir
        # The most rollouts first, then the fewest, then the ones between.
        for rollouts in sorted(kept, key=lambda r: (r != max(kept), r)):
            evaluate_model(f"{name}@{rollouts}", kept[rollouts], rollouts, order)

    both = ("retail", "tool_call_format")
    evaluate_model("base", None, 0, both)
    orders = {"tool_call_format": ("tool_call_format", "retail"), "grpo_target": both}
    for i, name in enumerate(runs):
        evaluate_snapshots(name, train(name, runs_left=len(runs) - i), orders[name])

    table = Table(title=f"Rollout budget ({budget} a run, {args.shape} shape) on {device}: greedy success")
    for column in (
        "model",
        "rollouts",
        f"retail ({len(test_seeds)} tasks)",
        f"tool_call_format held-out ({len(held_seeds)})",
    ):
        table.add_column(column)

    def cell(value: dict[str, Any] | None) -> str:
        return "skipped" if value is None else f"{value['success']:.3f}"

    for label, row in run.summary["models"].items():
        table.add_row(label, str(row["rollouts"]), cell(row.get("retail")), cell(row.get("tool_call_format")))
    console.print(table)
    for name, data in run.summary["training"].items():
        if data is not None:
            stopped = " (stopped at the deadline)" if data["stopped_early"] else ""
            console.print(
                f"{name}: {data['rollouts']} rollouts ({data['rollouts_played']} played) in "
                f"{data['seconds']} s, {data['rollouts_per_s']} rollouts/s{stopped}; "
                f"un-hinted reward per step {data['unhinted_curve']}"
            )
    flat = {
        "bench": "gpu_budget",
        "quick": args.quick,
        "shape": args.shape,
        "device": device,
        "rollout_budget": budget,
        "n_test_tasks": len(test_seeds),
        "n_held_out": len(held_seeds),
        "elapsed_s": round(time.monotonic() - run.start, 1),
    }
    labels = ["base", *(f"{n}@{r}" for n in runs for r in snapshots)]
    for label in [*labels, *(m for m in run.summary["models"] if m not in labels)]:
        row = run.summary["models"].get(label, {})
        for env_name in both:
            value = row.get(env_name)
            flat[f"{label}/{env_name}"] = None if value is None else value["success"]
    for name in runs:
        data = run.summary["training"].get(name)
        flat[f"{name}/rollouts_per_s"] = data and data["rollouts_per_s"]
        flat[f"{name}/rollouts"] = data and data["rollouts"]
        flat[f"{name}/unhinted_curve"] = data and data["unhinted_curve"]
        flat[f"{name}/reward_curve"] = data and data["reward_curve"]
    run.summary["final"] = flat
    run.write_summary()
    if args.quick:
        # The modules this run loaded (the GPU machine must have or carry each), and the few-shot
        # against LangChain's conversion: after the modules list, since that import adds LangChain.
        loaded = sorted({m.split(".")[0] for m in list(sys.modules) if not m.startswith("_")})
        (args.out / "modules.txt").write_text("\n".join(loaded) + "\n")
        console.print(f"few-shot matches LangChain's conversion: {check_few_shot(examples)}")
    print(json.dumps(flat), flush=True)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    main()
