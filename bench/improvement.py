"""The headline comparison: does TRACE beat plain GRPO at the same rollouts spent?

On the demo's stack (the embedded SmolLM2-135M behind the gateway, the example LangGraph
support agent, the retail target), over the improver's cycles, each on fresh train-split
traffic from the agent as it then is:

1. ``base``: the agent as it is;
2. TRACE exactly as the improver runs it (mine, synthesize and calibrate, one warm-started
   expert per selected capability, route, evaluate, deploy; each cycle mines the traffic its
   live deployment served). ``trace_deployed``, **the default row, fixed in advance**, is
   the agent the improver left live after the last cycle; ``trace_mixture``, the paper's
   row, is what the last cycle composed, live or not;
3. ``grpo_target``: one LoRA trained by GRPO on the retail train split with the rollouts
   TRACE's experts spent in all cycles (resampled groups included, on both sides: its
   ``spend_limit`` is TRACE's count).

The gate decides on test tasks of its own, never on the reported ones, so the deployed row
is measured on tasks that did not let it through. Success rates come with 95% bootstrap
intervals over tasks, and ``trace_deployed`` with paired intervals of its gain over base and
over GRPO on the target. TRACE's calibration plays and warm-start plays are counted apart
from the rollouts. Success against rollouts is a curve for both: the deployed agent after
each cycle, and GRPO at its start and end (the ablations add its snapshots at a third and
two thirds of its steps).

Three speed figures, each measured side by side in this run: ``turn_kv_reuse_speedup`` (a
GRPO step of the last expert's rollouts without the conversation's keys and values kept
across turns ÷ with them), ``mixture_eval_ratio`` (the reported tasks through the last
router's mixtures ÷ through one expert; the gateway groups tasks by its own routing
decision) and the wall time, ``bench_seconds`` (summed over the parts of a resumed run).

The ablations (``bench/improvement_ablations.py``) read this run's folder and add their rows.
Every stage's result is kept under the run's folder (``--out``): run the same command again
after a kill and it picks up where it stopped (``--fresh`` starts over).

    python bench/improvement.py [--quick] [--tasks N] [--traffic N] [--cycles N] [--experts N]
                                [--budget ROLLOUTS]
                                [--precision auto|float32|bfloat16] [--out DIR] [--fresh]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any, get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trace_plugin.demo import (  # noqa: E402
    AGENT,
    CYCLE_COLUMNS,
    GATE_OFFSET,
    PRESETS,
    Preset,
    SupportStack,
    cycle_cells,
    cycle_report,
    peak_rss_gb,
)
from trace_plugin.environments.interpreter import SpecEnv, worked_example  # noqa: E402
from trace_plugin.environments.retail import TEST_SEEDS, TRAIN_SEEDS, RetailEnv  # noqa: E402
from trace_plugin.gateway.admin_client import GatewayAdmin  # noqa: E402
from trace_plugin.improver import TRAINING_SEEDS, Improver, bootstrap_interval, paired_gain  # noqa: E402
from trace_plugin.model_files import Precision, torch_dtype  # noqa: E402
from trace_plugin.records.deployment import Deployment  # noqa: E402
from trace_plugin.records.expert import Expert  # noqa: E402
from trace_plugin.records.outcome import reward_succeeds  # noqa: E402
from trace_plugin.stage_results import StageResults  # noqa: E402
from training.config import ExpertTrainingConfig  # noqa: E402
from training.lora import is_noop  # noqa: E402

# Quick is the demo's (one cycle). The default plays 48 test tasks (six per kind) over two
# cycles of 64 traffic tasks each (at 48 the mined deficit passed the rule in 7 of 10
# runs, one short of K), with one expert a cycle, two in all (the issue allows up to three:
# a third costs about 25 minutes on 2 cores, and one a cycle leaves the second cycle a slot
# to teach what the first left failing), 80 rollouts offered per expert (20 optimizer
# steps of one group of 4, fewer when GRPO stops flat), the gate deciding on 24 other
# test tasks. ``--experts 3`` is the earlier preset's cap.
BENCH_PRESETS = {
    "quick": PRESETS["quick"],
    "default": Preset(48, 64, 80, 1, 4, 2, 5, 8, cycles=2, gate_tasks=24, max_capabilities=2),
}
# The target's tasks need the support agent's whole horizon and reply length, as served.
HORIZON = {"max_turns": 6, "max_completion_length": 96}
FORMAT = 2  # of the run's folder: a folder of another format is refused, not misread


class Clock:
    """The bench's wall time, summed over the parts of a resumed run: each part adds what
    it ran to the folder's total as it goes (``tick``), so a killed part's time counts too."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.total = json.loads(path.read_text())["seconds"] if path.is_file() else 0.0
        self.mark = time.monotonic()

    def tick(self) -> float:
        now = time.monotonic()
        self.total += now - self.mark
        self.mark = now
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps({"seconds": self.total}))
        partial.replace(self.path)
        return self.total


class MemoryTrace:
    """Where the run's memory goes: the process's resident memory sampled every ``every``
    seconds, each sample labelled with the bench's step and the improver's running jobs,
    and the peak per label, kept in ``path`` (merged over a resumed run's parts)."""

    def __init__(self, store: Any, path: Path, every: float = 2.0) -> None:
        self.store, self.path, self.every = store, path, every
        self.step = "start"
        self.peaks: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-trace", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            with contextlib.suppress(Exception):  # a sample lost is no reason to stop the bench
                rss = _resident_gb()
                running = [f"{j.stage} {j.key}" for j in self.store.jobs(AGENT) if j.status == "running"]
                label = " / ".join([self.step, *running])
                self.peaks[label] = max(self.peaks.get(label, 0.0), rss)

    def close(self) -> dict[str, float]:
        """Stop sampling; the peaks, largest first."""
        self._stop.set()
        self._thread.join()
        self.path.write_text(json.dumps(self.peaks))
        return dict(sorted(self.peaks.items(), key=lambda item: -item[1]))


def _resident_gb() -> float:
    """This process's resident memory now, in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024**2, 2)
    return 0.0


def arguments(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options both benches take: the ablations must name the headline's settings."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget", type=int, help="rollouts for GRPO on the target (default: TRACE's spent)")
    parser.add_argument("--tasks", type=int, help="retail test tasks")
    parser.add_argument("--traffic", type=int, help="retail train tasks captured as traffic per cycle")
    parser.add_argument("--cycles", type=int, help="improvement cycles")
    parser.add_argument(
        "--experts", type=int, help="experts in all, spread evenly over the cycles (default: the preset's)"
    )
    parser.add_argument("--out", type=Path, help="the run's folder (default: bench-out/improvement-PRESET)")
    parser.add_argument(
        "--precision",
        choices=get_args(Precision),
        default="auto",
        help="the weights', served and trained (auto: bfloat16 where the CPU computes it natively)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="start over instead of resuming the folder's run"
    )
    return parser.parse_args(argv)


def bench_preset(args: argparse.Namespace) -> Preset:
    """The preset the options name, with their overrides. ``--experts`` spreads the experts
    over the cycles, so that a later cycle still has one to teach what the first left failing."""
    preset = BENCH_PRESETS["quick" if args.quick else "default"]
    preset = replace(
        preset,
        test_tasks=args.tasks or preset.test_tasks,
        traffic_tasks=args.traffic or preset.traffic_tasks,
        cycles=args.cycles or preset.cycles,
    )
    if args.experts:
        per_cycle = -(-args.experts // preset.cycles)
        preset = replace(preset, max_experts=per_cycle, max_capabilities=args.experts)
    return preset


@dataclass
class Bench:
    """One run's folder and the stack it measures on: what the headline's steps and the
    ablations' share. Every evaluation is played once and kept (``evaluated``)."""

    quick: bool
    preset: Preset
    out: Path
    precision: str
    results: StageResults
    console: Console
    stack: SupportStack
    improver: Improver
    admin: GatewayAdmin
    test: list[int]
    gate: list[int]
    seconds: dict[str, float] = field(default_factory=dict)  # each evaluation's wall time, kept

    @classmethod
    def open(cls, args: argparse.Namespace, *, need_started: bool = False) -> Bench:
        """The run's folder, refused when it holds a run with other settings."""
        name = "quick" if args.quick else "default"
        preset = bench_preset(args)
        # Absolute: the gateway resolves a relative adapter path under its adapter root.
        out = (args.out or Path("bench-out") / f"improvement-{name}").resolve()
        if args.fresh and out.exists():
            shutil.rmtree(out)
        # Resolved: a run resumed on another machine must not mix precisions between its rows.
        precision = str(torch_dtype(args.precision)).removeprefix("torch.")
        settings = {"preset": asdict(preset), "budget": args.budget, "precision": precision, "format": FORMAT}
        stamp = out / "settings.json"
        if need_started and not stamp.is_file():
            raise SystemExit(
                f"{out} holds no headline run: run bench/improvement.py with these options first"
            )
        kept = json.loads(stamp.read_text()) if stamp.is_file() else settings
        if kept != settings:
            raise SystemExit(
                f"{out} holds a run with other settings ({kept}, not {settings}): "
                "pass the same options, --fresh, or another --out"
            )
        results = StageResults(out / "results")
        stamp.write_text(json.dumps(settings))
        console = Console(width=None if sys.stdout.isatty() else 160)  # a log keeps whole table cells
        begun = (out / "results" / "base-summary.json").is_file()  # a run to resume, its stack kept
        stack = SupportStack(out / "stack", console, fresh=not begun, precision=precision)
        test = list(TEST_SEEDS)[: preset.test_tasks]
        gate = list(TEST_SEEDS)[GATE_OFFSET : GATE_OFFSET + preset.gate_tasks]  # never a reported task
        assert not set(test) & set(gate), "the gate must not decide on the reported tasks"
        improver = stack.improver(preset, gate, test)
        bench = cls(
            args.quick, preset, out, precision, results, console, stack, improver,
            GatewayAdmin(stack.server.url), test, gate,
        )  # fmt: skip
        asyncio.run(improver.restore())  # a resumed run: the gateway serves what was live
        return bench

    @property
    def store(self) -> Any:
        return self.stack.store

    def evaluated(self, key: str, model: Callable[[], str]) -> list[float]:
        """Per-task results of ``model()`` on the reported tasks, played once: every row
        comes from these; the evaluation's wall time is kept beside them."""

        def play() -> dict[str, Any]:
            served = model()
            start = time.monotonic()
            values = successes(asyncio.run(self.stack.evaluate(served, self.test)))
            return {"success": values, "seconds": time.monotonic() - start}

        kept = self.results.get(f"eval-{key}", play)
        self.seconds[key] = kept["seconds"]
        return kept["success"]

    def serve(self, router: dict[str, Any], name: str, adapters: Any = ()) -> str:
        """``router`` as the candidate router ``router:name``, the experts behind ``adapters``
        (served names) loaded."""
        paths = {e.adapter_name: e.adapter_path for e in self.store.experts(AGENT)}
        for served in adapters:
            asyncio.run(self.admin.ensure_adapter(served, paths[served]))
        asyncio.run(self.admin.set_router(router, name=name))
        return f"router:{name}"

    def adapter_dir(self, name: str) -> Path:
        return self.stack.adapter_root / name / "1"

    def train(
        self, name: str, factory: Any, seeds: list[int], hint: Any = None, exclude: Any = (), **settings: Any
    ) -> str:
        """An adapter of the bench's own (GRPO on the target, an ablation's expert), trained
        once with the improver's settings and ``settings``, and loaded as ``name@1``."""
        from training.experts import ExpertTrainer

        out_dir = self.adapter_dir(name)
        if not out_dir.is_dir():  # else published by an earlier run (a killed one resumes its checkpoint)
            config = self.improver.training_config(output_dir=str(out_dir), **settings)
            self.console.rule(
                f"training {name}: {config.rollout_budget} rollouts offered, {config.warm_start_plays} plays"
            )
            examples = self.improver.examples()
            ExpertTrainer(config, factory, seeds, hint=hint, examples=examples, exclude=exclude).train()
        asyncio.run(self.admin.ensure_adapter(f"{name}@1", str(out_dir)))
        return f"{name}@1"

    def last_deployment(self) -> Deployment | None:
        """What the last cycle that composed something composed."""
        composed = [d for d in self.store.deployments(AGENT) if d.adapters]
        return composed[-1] if composed else None

    def experts(self) -> dict[str, Expert]:
        """The last composition's experts by capability, loaded in the gateway."""
        last = self.last_deployment()
        served_by = {e.adapter_name: e for e in self.store.experts(AGENT)}
        experts = {
            capability: served_by[served] for capability, served in (last.adapters if last else {}).items()
        }
        for expert in experts.values():  # a resumed run's gateway has only the live ones
            asyncio.run(self.admin.ensure_adapter(expert.adapter_name, expert.adapter_path))
        return experts

    def stop(self) -> None:
        self.stack.stop()


def expert_results(store: Any) -> list[Any]:
    """The finished training runs of every ready expert the cycles made."""
    from training.experts import ExpertResult

    return [ExpertResult.load(Path(e.adapter_path)) for e in store.experts(AGENT, status="ready")]


# -- the headline's steps ------------------------------------------------------------------------


def base_step(bench: Bench) -> dict[str, Any]:
    """Before any cycle the live agent is the base model; kept with its episodes (the
    transfer figures read their labels)."""
    return bench.results.get(
        "base-summary", lambda: asyncio.run(bench.improver.live_summary(bench.test)).to_dict()
    )


def cycle_step(bench: Bench, n: int) -> dict[str, Any]:
    """Cycle ``n``: fresh traffic from the live agent, the improver's cycle, then the live
    agent and what the cycle composed on the reported tasks."""

    def run() -> dict[str, Any]:
        store, preset = bench.store, bench.preset
        seeds = list(TRAIN_SEEDS)[(n - 1) * preset.traffic_tasks : n * preset.traffic_tasks]
        traffic = bench.results.get(f"traffic-{n}", lambda: successes(bench.stack.traffic(seeds)))
        # Resumes the cycle a killed run left unfinished, once that run's lease has lapsed.
        bench.improver.run_once(wait=2 * bench.improver.config.lease_ttl)
        cycle_id = [j.cycle for j in store.jobs(AGENT) if j.stage == "cycle"][-1]
        # The live agent, played once per deployment: a cycle that deployed nothing reads
        # the play of the one before it (the base model's is the base row's).
        serving = bench.improver.live()
        if serving is None:
            live_key, live = None, successes(base_step(bench)["episodes"])
        else:
            live_key = f"live-{serving.id}"
            live = bench.evaluated(live_key, lambda: asyncio.run(bench.improver.live_model()))
        report = cycle_report(store, cycle_id, mean(traffic), {"success": mean(live)})
        deployment = next((d for d in store.deployments(AGENT) if d.id == cycle_id), None)
        # What the cycle composed, whether or not it passed the gate; made live, it is what
        # was just measured.
        candidate_key, candidate = None, None
        if deployment is not None:
            candidate_key = live_key if report.deployed else f"candidate-{n}"
            candidate = bench.evaluated(
                candidate_key,
                lambda: bench.serve(deployment.router, f"candidate-{n}", deployment.adapters.values()),
            )
        spent = sum(r.rollouts_spent for r in expert_results(store))
        return {
            "report": asdict(report),
            "candidate": candidate,
            "live": live,
            "rollouts": spent,
            # Which kept evaluations played them, for the speed figure (``mixture_ratio_step``).
            "deployment": deployment.id if deployment else None,
            "candidate_key": candidate_key,
            "live_key": live_key,
            "live_alone": serving is not None and serving.router["kind"] == "static",
        }

    return bench.results.get(f"cycle-{n}", run)


def at_spent(bench: Bench, budget: int) -> dict[str, int]:
    """Training settings for ``budget`` rollouts spent: its steps offer as many (rounded up
    to a whole step) and resampling stays within them."""
    per_step = bench.improver.training_config().rollouts_per_step
    limit = max(budget, per_step)
    return {"rollout_budget": -(-limit // per_step) * per_step, "spend_limit": limit}


def grpo_step(bench: Bench, budget: int) -> str:
    """GRPO on the target at ``budget`` rollouts spent. Its adapter is also kept at a third
    and two thirds of its steps: the ablations put those points on its curve
    (``grpo_curve``), two evaluations of the target the headline leaves out."""
    spent = at_spent(bench, budget)
    config = bench.improver.training_config(**spent)
    return bench.train(
        "grpo_target",
        RetailEnv,
        list(TRAIN_SEEDS),
        snapshots=() if bench.quick else curve_rollouts(config),
        warm_start_plays=0,  # its tickets carry no hint, and production has no reference solutions
        **spent,
        **HORIZON,
    )


def grpo_curve(bench: Bench) -> list[tuple[int, list[float]]]:
    """GRPO on the target along its run: each kept snapshot it reached on the reported
    tasks, at the rollouts spent by then (a snapshot with no gradient yet is the base)."""
    from training.experts import ExpertResult

    result = ExpertResult.load(bench.adapter_dir("grpo_target"))
    points = []
    for rollouts in result.snapshots:
        name, path = f"grpo_target-{rollouts}", result.snapshot(rollouts)
        if is_noop(path):
            continue

        def load(name: str = name, path: Path = path) -> str:
            asyncio.run(bench.admin.ensure_adapter(f"{name}@1", str(path)))
            return f"{name}@1"

        points.append((result.spent_at(rollouts), bench.evaluated(name, load)))
    return points


def turn_kv_step(bench: Bench, expert: Expert) -> float:
    """A GRPO step's rollouts of ``expert`` in its environment, with its hint, played without
    and with the conversation's keys and values kept across turns, alternating; the ratio."""

    def measure() -> float:
        import torch
        from peft import PeftModel

        from trace_plugin.generation import folded
        from trace_plugin.model_files import load_model
        from training.episodes import EpisodePlayer, hf_generate

        config = bench.improver.training_config()
        spec = bench.improver.env_of(expert)
        base, tokenizer = load_model(None, precision=config.precision)
        model = PeftModel.from_pretrained(base, expert.adapter_path).eval()
        player = EpisodePlayer(
            tokenizer, lambda: SpecEnv(spec), max_turns=config.max_turns,
            max_observation_chars=config.max_observation_chars, examples=bench.improver.examples(),
        )  # fmt: skip
        seeds = [
            s for s in list(TRAINING_SEEDS)[: config.groups_per_step] for _ in range(config.num_generations)
        ]
        hinted = int(config.hint_fraction * config.num_generations)
        hint = worked_example(spec) or spec.hint
        hints = ([hint] * hinted + [None] * (config.num_generations - hinted)) * config.groups_per_step
        times = {False: 0.0, True: 0.0}
        with folded(model):
            for keep in (False, True, True, False):
                torch.manual_seed(0)
                generate = hf_generate(
                    model, tokenizer, max_new_tokens=config.max_completion_length,
                    temperature=config.temperature, keep_turns=keep,
                )  # fmt: skip
                start = time.monotonic()
                player.play(seeds, hints, generate)
                times[keep] += time.monotonic() - start
        return round(times[False] / times[True], 3)

    return bench.results.get("turn-kv-reuse", measure)


def mixture_ratio_step(
    bench: Bench, last: Deployment | None, experts: dict[str, Expert], cycles: list[dict[str, Any]]
) -> float | None:
    """The reported tasks through the last router's mixtures ÷ through one expert alone
    (None when the router makes no choice: one expert takes everything). The cycles played
    both already where they can: the composition as its cycle's candidate or live agent,
    one expert alone as a live agent of one expert; those plays are not played twice."""
    if last is None or last.router["kind"] == "static":
        return None
    first = next(iter(experts.values()))
    alone = next((c["live_key"] for c in cycles if c.get("live_alone")), None) or f"expert-{first.capability}"
    bench.evaluated(alone, lambda: first.adapter_name)
    played = (c.get("candidate_key") for c in cycles if c.get("deployment") == last.id)
    mixture = next(played, None) or "mixture"
    bench.evaluated(mixture, lambda: bench.serve(last.router, mixture, last.adapters.values()))
    return round(bench.seconds[mixture] / bench.seconds[alone], 3)


@dataclass
class Headline:
    """What the headline's steps measured, for its report."""

    base: list[float]
    cycles: list[dict[str, Any]]
    trace_mixture: list[float]
    trace_deployed: list[float]
    trace_spent: int
    budget: int
    grpo_rows: list[float]
    turn_kv: float | None
    mixture_ratio: float | None
    calibration_samples: int


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    bench = Bench.open(args)
    clock = Clock(bench.out / "seconds-improvement.json")
    memory = MemoryTrace(bench.store, bench.out / "memory-improvement.json")
    try:
        headline = run_steps(bench, args.budget, clock, memory)
    finally:
        bench.stop()
        clock.tick()
        peaks = memory.close()
    report(bench, headline, clock.total, peaks)


def run_steps(bench: Bench, budget: int | None, clock: Clock, memory: MemoryTrace) -> Headline:
    """The base, the improver's cycles, GRPO on the target at TRACE's spent rollouts, and
    the speed figures: each step kept in the folder as it ends."""
    memory.step = "base"
    base = successes(base_step(bench)["episodes"])
    cycles = []
    for n in range(1, bench.preset.cycles + 1):
        memory.step = f"cycle {n}"
        cycles.append(cycle_step(bench, n))
        clock.tick()
    composed = [c for c in cycles if c["candidate"] is not None]
    trace_mixture = composed[-1]["candidate"] if composed else base
    trace_spent = cycles[-1]["rollouts"]
    most = min(bench.preset.max_experts * bench.preset.cycles, bench.preset.max_capabilities or 10**6)
    budget = budget or trace_spent or bench.preset.rollouts * most
    memory.step = "grpo_target"
    grpo = grpo_step(bench, budget)
    clock.tick()
    grpo_rows = (
        base if is_noop(bench.adapter_dir("grpo_target")) else bench.evaluated("grpo_target", lambda: grpo)
    )
    last, experts = bench.last_deployment(), bench.experts()
    memory.step = "turn_kv_reuse"
    turn_kv = turn_kv_step(bench, next(iter(experts.values()))) if experts else None
    clock.tick()
    memory.step = "mixture_eval"
    mixture_ratio = mixture_ratio_step(bench, last, experts, cycles)
    calibration_samples = len(bench.store.list_episodes(f"calibration:{AGENT}", limit=10**6))
    bench.results.get("headline", lambda: {"base": base, "trace_mixture": trace_mixture, "budget": budget})
    return Headline(
        base, cycles, trace_mixture, cycles[-1]["live"], trace_spent, budget, grpo_rows,
        turn_kv, mixture_ratio, calibration_samples,
    )  # fmt: skip


def report(bench: Bench, h: Headline, seconds: float, peaks: dict[str, float]) -> None:
    """The tables, the paired intervals, the curves and the figures line."""
    from training.experts import ExpertResult

    console, test, cycles = bench.console, bench.test, h.cycles
    results = expert_results(bench.store)
    grpo_spent = ExpertResult.load(bench.adapter_dir("grpo_target")).rollouts_spent
    rows = {
        "base": h.base,
        "grpo_target": h.grpo_rows,
        "trace_deployed": h.trace_deployed,
        "trace_mixture": h.trace_mixture,
    }
    rollouts = {
        "base": 0,
        "grpo_target": grpo_spent,
        "trace_deployed": h.trace_spent,
        "trace_mixture": h.trace_spent,
    }
    cycles_table(console, cycles)
    figures = rows_table(
        console, rows, rollouts,
        f"Retail test tasks: {len(test)}; rollouts spent: GRPO {grpo_spent}, TRACE {h.trace_spent} "
        "(SmolLM2-135M, CPU)",
    )  # fmt: skip
    # Fixed in advance: the deployed agent against base and against GRPO on the target.
    gains = {name: paired_gain(rows["trace_deployed"], rows[name]) for name in ("base", "grpo_target")}
    for name, (low, high) in gains.items():
        console.print(f"trace_deployed − {name}, paired by task: 95% CI [{low:+.2f}, {high:+.2f}]")
    reference_plays = sum(r.reference_plays for r in results)
    informative = [r.informative_group_frac for r in results if r.informative_group_frac is not None]
    cycle_gains = [
        round(mean(c["live"]) - mean(p), 4)
        for c, p in zip(cycles, [h.base, *[c["live"] for c in cycles]][:-1], strict=True)
    ]
    console.print(f"calibration samples (TRACE's, outside the rollouts): {h.calibration_samples}")
    console.print(
        f"reference plays (warm starts, outside the rollouts): {reference_plays} for TRACE's experts"
    )
    for r in results:
        console.print(
            f"expert {r.adapter_dir.parent.name}: {r.steps} steps, {r.rollouts_spent} rollouts spent"
            + (f", stopped {r.stopped}" if r.stopped else "")
            + f", informative groups (un-hinted) {r.informative_group_frac}"
        )
    console.print(f"each cycle's gain on the reported tasks: {cycle_gains}")
    console.print(f"turn_kv_reuse_speedup {h.turn_kv}; mixture_eval_ratio {h.mixture_ratio}")
    table = Table(title="Peak resident memory (GB) by step and the improver's running jobs, largest first")
    for column in ("step / jobs", "GB"):
        table.add_column(column)
    for label, gb in list(peaks.items())[:10]:
        table.add_row(label, f"{gb:.2f}")
    console.print(table)
    curves = {
        "trace": [(0, figures["base"])] + [(c["rollouts"], mean(c["live"])) for c in cycles],
        "grpo": [(0, figures["base"]), (grpo_spent, figures["grpo_target"])],  # the ablations add its middle
    }
    curves_table(console, curves)
    plot(figures, rollouts, curves, bench.out / "improvement.png")
    console.print(f"plot: {bench.out / 'improvement.png'}; results kept in {bench.out}")
    print(
        json.dumps(
            {
                "bench": "improvement",
                "quick": bench.quick,
                "rollout_budget": h.budget,
                "rollouts_spent": h.trace_spent,
                "grpo_rollouts_spent": grpo_spent,
                "n_test_tasks": len(test),
                "cycles": len(cycles),
                **figures,
                "cycle_gains": cycle_gains,
                "informative_group_frac": round(mean(informative), 4) if informative else None,
                "calibration_samples": h.calibration_samples,
                "reference_plays": reference_plays,
                "gain_vs_base_ci_low": round(gains["base"][0], 4),
                "gain_vs_base_ci_high": round(gains["base"][1], 4),
                "gain_vs_grpo_ci_low": round(gains["grpo_target"][0], 4),
                "gain_vs_grpo_ci_high": round(gains["grpo_target"][1], 4),
                "turn_kv_reuse_speedup": h.turn_kv,
                "mixture_eval_ratio": h.mixture_ratio,
                "bench_seconds": round(seconds),
                # A resumed run's peak is its largest part's: this process's, or one its trace kept.
                "peak_rss_gb": max(peak_rss_gb(), *peaks.values()),
                **{
                    f"curve_{method}": [[n, round(s, 4)] for n, s in points]
                    for method, points in curves.items()
                },
            }
        )
    )


def cycles_table(console: Console, cycles: list[dict[str, Any]]) -> None:
    table = Table(title="Cycles: what each mined, trained and composed, and the test success after it")
    for column in ("cycle", *CYCLE_COLUMNS, "rollouts spent so far", "its candidate"):
        table.add_column(column)
    for n, c in enumerate(cycles, 1):
        candidate = "—" if c["candidate"] is None else f"{mean(c['candidate']):.2f}"
        table.add_row(str(n), *cycle_cells(c["report"]), str(c["rollouts"]), candidate)
    console.print(table)


def rows_table(
    console: Console, rows: dict[str, list[float] | None], rollouts: dict[str, int | None], title: str
) -> dict[str, float | None]:
    """Each row's success with its 95% interval; returns the rows' success rates."""
    table = Table(title=title)
    for column in ("method", "rollouts", "success", "95% CI"):
        table.add_column(column)
    figures: dict[str, float | None] = {}
    for name, values in rows.items():
        if values is None:
            table.add_row(name, "—", "—", "not measured in this run")
            figures[name] = None
            continue
        low, high = bootstrap_interval(values)
        figures[name] = round(mean(values), 4)
        table.add_row(name, str(rollouts.get(name, "—")), f"{figures[name]:.2f}", f"[{low:.2f}, {high:.2f}]")
    console.print(table)
    return figures


def curves_table(console: Console, curves: dict[str, list[tuple[int, float]]]) -> None:
    table = Table(title="Success against rollouts spent")
    for column in ("method", "rollouts → success"):
        table.add_column(column)
    for method, points in curves.items():
        table.add_row(method, ", ".join(f"{n} → {s:.2f}" for n, s in points))
    console.print(table)


def successes(episodes: Sequence[Any]) -> list[float]:
    """Per task, 1.0 for a solved one: from runner results or an evaluation's stored episodes."""
    rewards = [e["reward"] if isinstance(e, dict) else e.reward.total for e in episodes]
    return [float(reward_succeeds(r)) for r in rewards]


def curve_rollouts(config: ExpertTrainingConfig) -> tuple[int, ...]:
    """Where GRPO's run keeps its adapter for the curve: after a third and two thirds of its
    steps (whole steps, short of the last)."""
    steps = {config.steps * k // 3 for k in (1, 2)} - {0, config.steps}
    return tuple(sorted(step * config.rollouts_per_step for step in steps))


def plot(
    figures: dict[str, Any], rollouts: dict[str, int], curves: dict[str, list[tuple[int, float]]], path: Path
) -> None:
    """Success against rollouts used: every method's point, the deployed agent after each
    cycle, and GRPO on the target along its run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(figures["base"], color="grey", linestyle="--", label="base (0 rollouts)")
    ax.plot(
        *zip(*curves["trace"], strict=True),
        color="tab:red",
        marker="o",
        label="TRACE deployed (trace_deployed), cycle by cycle",
    )
    ax.plot(
        *zip(*curves["grpo"], strict=True),
        color="tab:blue",
        marker="s",
        label="GRPO on the target, along its run",
    )
    for name in ("grpo_target", "trace_mixture"):
        if figures.get(name) is not None:
            ax.scatter([rollouts[name]], [figures[name]], label=name, s=60)
    ax.set_xlabel("rollouts spent")
    ax.set_ylabel("success on retail test tasks")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
