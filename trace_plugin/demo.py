"""``trace-plugin demo``: the whole loop on this machine, with the embedded model.

1. start the gateway (the embedded SmolLM2-135M, runtime LoRA, routing);
2. run the example LangGraph support agent (the one-line decorator) on the retail test
   split: the "before" number;
3. run it on train-split tasks: production traffic, captured with its rewards;
4. improve: mine, synthesize and validate, train, judge, hot-swap into the running gateway;
5. measure the same agent on the same test tasks again;
6. repeat 3-5 for each further cycle (the default preset runs two): fresh traffic from the
   agent as it now is, so each cycle mines the improved agent's next deficit;
7. print before/after per task kind, per capability and per cycle; write a markdown
   report and a plot.

Test runs are recorded as agent ``eval:support-agent`` so they never feed mining.
Every number is measured in this run; nothing is fixed in advance. Each stage is kept
under the run's folder as it ends, and the improver's own job ledger keeps its progress
within a cycle, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import trace_plugin
from trace_plugin.environments.retail import TEST_SEEDS, TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.runner import EpisodeResult, LangGraphAgent, Runner, summarize
from trace_plugin.errors import TracePluginError
from trace_plugin.gateway.backend import Engine
from trace_plugin.improver import Improver, ImproverConfig
from trace_plugin.improver.evaluation import TOP1, lacking_transfer, live_key
from trace_plugin.model_files import Precision
from trace_plugin.records.job import job_id
from trace_plugin.records.outcome import reward_succeeds
from trace_plugin.records.stage_outputs import Mined
from trace_plugin.stage_results import StageResults
from trace_plugin.store import Store, data_dir

AGENT = "support-agent"
EVAL_AGENT = f"eval:{AGENT}"
# How the demo's improver trains its experts, on top of the cpu-small preset. Where no warm
# start ran, half the rollouts see a worked example: the base model rarely calls a tool
# without one. The horizon is the target's (retail's six turns) and a reply's length comes
# from each environment's reference plays: the target's writes take four or five turns, and
# a preset of three cut them off.
EXPERT_TRAINING: dict[str, Any] = {"hint_fraction": 0.5}


class DemoError(TracePluginError):
    """The demo cannot resume the run its folder holds."""


@dataclass(frozen=True)
class Preset:
    test_tasks: int  # retail test tasks, the same ones before and after: the reported ones
    traffic_tasks: int  # retail train tasks played as production traffic
    rollouts: int  # GRPO rollout budget per expert
    max_experts: int
    calibration_seeds: int
    calibration_samples: int
    calibration_attempts: int
    eval_seeds: int  # held-out seeds per synthesized environment
    cycles: int = 1  # improvement cycles, each on fresh traffic from the agent as it then is
    # Retail test tasks the deploy gate decides on: other tasks than the reported ones, so
    # the "after" is not measured on the tasks that let the candidate through.
    gate_tasks: int = 8
    reference_plays: int = 48  # the warm start's plays per expert, apart from the rollouts
    max_capabilities: int | None = None  # experts in all, over every cycle (None: no cap)


PRESETS = {
    "quick": Preset(8, 24, 24, 1, 4, 2, 3, 4),
    "default": Preset(24, 64, 24, 2, 4, 2, 5, 8, cycles=2, gate_tasks=24),
}
GATE_OFFSET = 48  # the gate's tasks start here in the retail test split: one per kind, after the reported


@dataclass(frozen=True)
class CycleReport:
    """One improvement cycle as the demo reports it."""

    cycle: str
    traffic_success: float  # the captured traffic it mined, served by the agent as it was
    mined: list[str]  # capabilities selected by mining
    trained: list[str]  # those it trained experts for
    adapters: dict[str, str]  # what it composed: capability -> adapter
    router: str | None  # the router kind it composed them with
    deployed: bool
    outcome: str  # made live, or why not
    after: dict[str, Any]  # the live agent on the test tasks afterwards (summary, no episodes)


def cycle_report(store: Store, cycle: str, traffic_success: float, after: dict[str, Any]) -> CycleReport:
    """What the improver's jobs recorded for ``cycle``."""
    end = store.job(job_id(cycle, "cycle", "all"))
    mine = store.job(job_id(cycle, "mine", "all"))
    mined = Mined.from_dict(mine.outputs) if mine and mine.outputs else Mined([], [], [])
    deployment = next((d for d in store.deployments(AGENT) if d.id == cycle), None)
    deployed = bool(end and end.outputs and end.outputs.get("deployed"))
    if deployed:
        outcome = "made live"
    elif deployment is not None:
        outcome = "rejected: " + "; ".join(deployment.reasons)
    else:
        outcome = "nothing deployed: " + str((end.outputs or {}).get("reason") if end else "unfinished")
    return CycleReport(
        cycle=cycle,
        traffic_success=traffic_success,
        mined=mined.selected,
        trained=[j.key for j in store.jobs(AGENT, cycle) if j.stage == "train" and j.status == "done"],
        adapters=dict(deployment.adapters) if deployment else {},
        router=router_label(deployment.router) if deployment else None,
        deployed=deployed,
        outcome=outcome,
        after=after,
    )


def router_label(router: dict[str, Any]) -> str:
    """A router's kind, and for TRACE's classifier whether the gate kept its top-p merge or
    chose one expert per request."""
    retrieval = router.get("retrieval") or {}
    if router.get("kind") != "classifier" or not retrieval:
        return str(router.get("kind"))
    return "classifier, top-1" if retrieval.get("top_p", 1.0) <= TOP1 else "classifier, top-p"


def peak_rss_gb() -> float:
    """The peak resident memory of this process or of any child it waited for, in GB: a
    run's whole cost, since moving work into a subprocess hides memory without saving it."""
    import resource

    kilobytes = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return round(kilobytes / 1024**2, 2)


async def grouped_by_route(
    seeds: Sequence[int],
    route: Callable[[int], Awaitable[str]],
    run: Callable[[list[int], str | None], Awaitable[list[EpisodeResult]]],
) -> list[EpisodeResult]:
    """``run`` over ``seeds`` one routing decision at a time (``route``: a seed's mixture
    label), the results in the order of ``seeds``. ``run`` gets the group's label, or None
    when every seed had the same one."""
    groups: dict[str, list[int]] = {}
    # Asked together: a router's decisions (a classifier's prefill each) batch in the backend.
    for seed, label in zip(seeds, await asyncio.gather(*map(route, seeds)), strict=True):
        groups.setdefault(label, []).append(seed)
    results: dict[int, EpisodeResult] = {}
    for served, group in groups.items():
        for result in await run(group, served if len(groups) > 1 else None):
            results[result.seed] = result
    return [results[seed] for seed in seeds]


class SupportStack:
    """The demo's world: a store, the model behind the gateway (the embedded backend, or a
    local vLLM server it starts and stops), and the example support agent pointed at it.
    The improvement benchmark runs on the same stack."""

    def __init__(
        self,
        home: Path,
        console: Console,
        *,
        fresh: bool = True,
        precision: Precision = "auto",
        engine: Engine = "embedded",
    ) -> None:
        from trace_plugin.gateway.app import GatewayConfig, create_app
        from trace_plugin.gateway.server import start_in_thread
        from trace_plugin.model_files import torch_dtype

        if fresh and home.exists():
            shutil.rmtree(home)  # an empty store and no experts; else a resumed run keeps both
        self.adapter_root = home / "adapters"
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.db = f"sqlite:///{home / 'trace.db'}"
        self.store = Store(self.db)
        self.store.upgrade()
        self.recorder = trace_plugin.configure(self.db)
        self.support = _support_agent_module()
        # What "auto" resolves to: experts train in the precision the model is served in.
        self.precision: Precision = str(torch_dtype(precision)).removeprefix("torch.")  # type: ignore[assignment]
        self.engine = None
        if engine == "vllm":
            from trace_plugin.gateway.vllm_server import LocalVLLM, VLLMSettings
            from trace_plugin.model_files import resolve_model

            with console.status(f"starting vLLM (logs: {home}/vllm*.log)…"):
                self.engine = LocalVLLM(
                    resolve_model(None), log_dir=home, settings=VLLMSettings(dtype=self.precision)
                ).start()
            self.backend: Any = self.engine.backend()
        else:
            from trace_plugin.gateway.embedded import EmbeddedBackend

            with console.status("loading SmolLM2-135M…"):
                self.backend = EmbeddedBackend(max_batch=16, precision=self.precision)
        config = GatewayConfig(adapter_root=self.adapter_root, agent=AGENT, record=False)
        self.server = start_in_thread(create_app(self.backend, config=config))
        self.base_url = f"{self.server.url}/v1"
        console.print(
            f"gateway at {self.base_url}, model {self.backend.model_id} in {self.precision} ({engine})"
        )

    def agent(self, model: str, *, evaluation: bool) -> LangGraphAgent:
        support, base_url = self.support, self.base_url

        def build(env: Any) -> Any:
            if not evaluation:  # the agent exactly as deployed: decorated, recording as support-agent
                return support.build_support_agent(env, base_url=base_url, model=model)
            graph = support.build_support_agent.__wrapped__(env, base_url=base_url, model=model)
            return trace_plugin.capture(agent=EVAL_AGENT, recorder=self.recorder)(graph)

        # The longest retail task takes four tool calls and an answer; one turn to spare.
        return LangGraphAgent(build, examples=support.few_shot_messages(), max_turns=6)

    async def evaluate(self, model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        """The support agent on retail tasks, served as ``model``; recorded as an evaluation.

        Tasks run grouped by the mixture the gateway routes each ticket to (its own
        decision, which it keeps for the conversation), one group after another: rows of
        one adapter decode with it folded into the weights, where rows of several adapters
        in one batch take the mixed path, several times slower."""
        from trace_plugin.gateway.admin_client import GatewayAdmin

        admin = GatewayAdmin(self.server.url)
        runner = Runner(
            RetailEnv,
            self.agent(model, evaluation=True),
            concurrency=16,
            recorder=self.recorder,
            console=self.console,
        )

        async def route(seed: int) -> str:
            return await admin.route(model, RetailEnv().opening(seed))

        async def run(group: list[int], served: str | None) -> list[EpisodeResult]:
            label = f" ({served or 'base'})" if served is not None else ""
            return await runner.run(group, description=f"test tasks as {model}{label}")

        return await grouped_by_route(seeds, route, run)

    def traffic(self, seeds: Sequence[int]) -> list[EpisodeResult]:
        """The support agent as deployed, on retail train tasks: production traffic."""
        agent = self.agent("default", evaluation=False)
        runner = Runner(RetailEnv, agent, concurrency=16, recorder=self.recorder, console=self.console)
        results = asyncio.run(runner.run(seeds, description="traffic"))
        self.recorder.flush(30)
        return results

    def improver(self, preset: Preset, gate: Sequence[int], reported: Sequence[int] = ()) -> Improver:
        """The improver as the demo runs it: its gate decides on the retail ``gate`` tasks,
        and it trains on none of those or of the ``reported`` ones."""
        return Improver(
            self.store,
            ImproverConfig(
                agent=AGENT,
                gateway_url=self.server.url,
                adapter_root=self.adapter_root,
                target="retail",
                target_seeds=gate,
                reported_seeds=reported,
                min_new_episodes=0,
                max_experts=preset.max_experts,
                max_capabilities=preset.max_capabilities,
                calibration_seeds=preset.calibration_seeds,
                calibration_samples=preset.calibration_samples,
                calibration_attempts=preset.calibration_attempts,
                training={
                    "rollout_budget": preset.rollouts,
                    "warm_start_plays": preset.reference_plays,
                    **EXPERT_TRAINING,
                    "precision": self.precision,
                },
                eval_seeds=preset.eval_seeds,
            ),
            evaluator=self.evaluate,
            recorder=self.recorder,
            console=self.console,
        )

    def stop(self) -> None:
        self.server.stop()
        if self.engine is not None:
            self.engine.stop()
        self.recorder.flush(30)


def main(
    preset_name: str = "quick",
    *,
    home: Path | None = None,
    out: Path | None = None,
    fresh: bool = False,
    engine: Engine = "embedded",
) -> dict[str, Any]:
    """Run the demo, or resume the one ``home`` holds (each stage is kept there as it ends:
    a killed run picks up where it stopped, a finished one prints its report again);
    ``fresh`` starts over."""
    preset = PRESETS[preset_name]
    console = Console()
    home = home or data_dir() / "demo" / preset_name
    out = out or home
    started = time.monotonic()
    console.rule("[bold]1. gateway")
    settings_file = home / "stages" / "settings.json"
    kept = json.loads(settings_file.read_text()) if not fresh and settings_file.is_file() else None
    if kept is not None and kept["preset"] != asdict(preset):
        raise DemoError(f"{home} holds a demo run with other settings ({kept['preset']}): pass --fresh")
    # A resumed run serves in the precision it started in, whatever this machine's "auto" is.
    precision = kept["precision"] if kept else "auto"
    stack = SupportStack(home, console, fresh=kept is None, precision=precision, engine=engine)
    store, backend = stack.store, stack.backend
    stages = StageResults(home / "stages")
    stages.get("settings", lambda: {"preset": asdict(preset), "precision": stack.precision})

    test = list(TEST_SEEDS)[: preset.test_tasks]
    gate = list(TEST_SEEDS)[GATE_OFFSET : GATE_OFFSET + preset.gate_tasks]
    improver = stack.improver(preset, gate, test)
    timings: dict[str, float] = {"gateway": time.monotonic() - started}

    def timed(stage: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` kept as ``stage``, with the seconds it took when it ran."""

        def run() -> dict[str, Any]:
            mark = time.monotonic()
            value = compute()
            return {"value": value, "seconds": time.monotonic() - mark}

        result = stages.get(stage, run)
        timings[stage.replace("-", " ")] = result["seconds"]
        return result["value"]

    try:
        asyncio.run(improver.restore())  # a resumed run: the gateway serves what was live
        console.rule("[bold]2. before: the support agent on the test split")
        before = timed("before", lambda: _strip(asyncio.run(improver.live_summary(test)).to_dict()))

        cycles: list[CycleReport] = []
        for n in range(1, preset.cycles + 1):
            console.rule(f"[bold]3. cycle {n}: production traffic, train-split tasks not seen before")
            seeds = list(TRAIN_SEEDS)[(n - 1) * preset.traffic_tasks : n * preset.traffic_tasks]

            def traffic(seeds: list[int] = seeds, n: int = n) -> float:
                results = stack.traffic(seeds)
                console.print(summarize(results, f"Captured traffic, cycle {n}"))
                return sum(reward_succeeds(r.reward.total) for r in results) / len(seeds)

            traffic_success = timed(f"traffic-{n}", traffic)

            console.rule(f"[bold]4. cycle {n}: mine, synthesize, train, route, evaluate, deploy")

            # Resumes the cycle a killed run left unfinished, once that run's lease has lapsed.
            def improve() -> str | None:
                deployment = improver.run_once(wait=2 * improver.config.lease_ttl)
                return deployment.id if deployment else None

            timed(f"improve-{n}", improve)

            console.rule(f"[bold]5. cycle {n}: after, the same test tasks")

            def after(traffic_success: float = traffic_success) -> dict[str, Any]:
                summary = _strip(asyncio.run(improver.live_summary(test)).to_dict())
                cycle = [j.cycle for j in store.jobs(AGENT) if j.stage == "cycle"][-1]
                return asdict(cycle_report(store, cycle, traffic_success, summary))

            cycles.append(CycleReport(**timed(f"after-{n}", after)))

        def transfer() -> dict[str, Any]:
            """Each expert alone on the reported tasks its capability was lacking in before."""
            before_job = store.job(job_id("evaluations", "target", live_key(None, test)))
            assert before_job is not None and before_job.outputs is not None
            by_expert = {}
            for expert in store.experts(AGENT, status="ready"):
                asyncio.run(improver.gateway.ensure_adapter(expert.adapter_name, expert.adapter_path))
                results = asyncio.run(stack.evaluate(expert.adapter_name, test))
                by_expert[expert.capability] = [float(reward_succeeds(r.reward.total)) for r in results]
            return lacking_transfer(store, before_job.outputs["episodes"], by_expert, EVAL_AGENT)

        console.rule("[bold]6. transfer: each expert on the test tasks its capability was lacking in")
        transferred = timed("transfer", transfer)
    finally:
        stack.stop()

    held_out = {  # the latest evaluation of each capability
        capability: scores
        for d in store.deployments(AGENT)
        for capability, scores in (d.evaluation.get("capabilities") or {}).items()
    }
    report = {
        "preset": preset_name,
        "settings": asdict(preset),
        "model": backend.model_id,
        "before": _strip(before),
        "after": cycles[-1].after,
        # The live agent's success on the reported tasks after each cycle, less before it.
        "cycle_gains": [
            round(c.after["success"] - previous, 4)
            for c, previous in zip(
                cycles, [before["success"], *(c.after["success"] for c in cycles[:-1])], strict=True
            )
        ],
        "cycles": [asdict(c) for c in cycles],
        "capabilities": [
            {
                "name": c.name,
                "selected": c.selected,
                **{k: c.metrics[k] for k in ("coverage", "contrast", "selected_by")},
            }
            for c in store.capabilities(AGENT)
        ],
        "environments": [
            {"name": r.spec.name, "version": r.version, "status": r.status, "report": r.report}
            for r in store.env_specs(AGENT)
        ],
        "experts": [
            {
                "id": e.id,
                "capability": e.capability,
                "status": e.status,
                "reward_curve": e.reward_curve,
                "unhinted_curve": e.unhinted_curve,
                "learned_unhinted": e.learned_unhinted,
                "held_out": held_out.get(e.capability),  # its environment's held-out seeds: base, candidate
            }
            for e in store.experts(AGENT)
        ],
        "transfer": transferred,
        "decisions": [
            asdict(d) | {"created_at": str(d.created_at), "updated_at": str(d.updated_at)}
            for d in store.deployments(AGENT)
        ],
        # Stages a resumed run read back count with the seconds they took when they ran.
        "seconds": {k: round(v, 1) for k, v in timings.items()} | {"total": round(sum(timings.values()), 1)},
        "peak_rss_gb": peak_rss_gb(),
    }
    _print(console, report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "demo.md").write_text(markdown(report))
    plot(report, out / "demo.png")
    console.print(f"report: {out / 'demo.md'}, plot: {out / 'demo.png'}")
    return report


@functools.cache
def _support_agent_module() -> Any:
    """The example agent lives in the source checkout's ``examples/``, not in the package: it
    is loaded from its file, once, without putting the checkout on ``sys.path``."""
    path = Path(__file__).resolve().parents[1] / "examples" / "support_agent" / "agent.py"
    if not path.is_file():
        raise SystemExit("the demo runs from a source checkout (it uses examples/support_agent)")
    spec = importlib.util.spec_from_file_location("trace_plugin_demo_support_agent", path)
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    return agent


def _strip(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "episodes"}


def _print(console: Console, report: dict[str, Any]) -> None:
    before, after = report["before"], report["after"]
    table = Table(title=f"Support agent on {before['n']} retail test tasks ({report['model']})")
    for column in ("task kind", "before", "after", "change"):
        table.add_column(column, justify="left" if column == "task kind" else "right")
    for kind in sorted(before["by_kind"]):
        b, a = before["by_kind"][kind], after["by_kind"].get(kind, 0.0)
        table.add_row(kind, f"{b:.2f}", f"{a:.2f}", f"{a - b:+.2f}")
    table.add_row(
        "[bold]success rate",
        f"{before['success']:.2f}",
        f"{after['success']:.2f}",
        f"{after['success'] - before['success']:+.2f}",
    )
    console.print(table)
    experts = Table(title="Capabilities")
    for column in (
        "capability",
        "selected",
        "coverage",
        "contrast Δ",
        "environment",
        "expert reward (first → last)",
        "un-hinted reward per step",
        "held-out: base → expert",
    ):
        experts.add_column(column)
    envs = {e["name"].removesuffix("-env"): e for e in report["environments"]}
    trained = {e["capability"]: e for e in report["experts"]}
    for c in report["capabilities"]:
        env = envs.get(c["name"])
        expert = trained.get(c["name"]) or {}
        curve = expert.get("reward_curve") or []
        experts.add_row(
            c["name"],
            c["selected_by"] or "—",
            f"{c['coverage']:.2f}",
            f"{c['contrast']:+.2f}",
            f"{env['status']}" if env else "—",
            f"{curve[0]:.2f} → {curve[-1]:.2f}" if curve else "—",
            _unhinted(expert) if expert else "—",
            _held_out(expert) if expert.get("held_out") else "—",
        )
    console.print(experts)
    cycles = Table(title="Cycles")
    for column in ("cycle", *CYCLE_COLUMNS):
        cycles.add_column(column)
    for n, c in enumerate(report["cycles"], 1):
        cycles.add_row(str(n), *cycle_cells(c))
    console.print(cycles)
    transfer = Table(title="Transfer: each expert on the test tasks whose base episode its capability lacked")
    for column in ("expert", "tasks", "base", "with the expert"):
        transfer.add_column(column)
    for capability, row in report.get("transfer", {}).items():
        transfer.add_row(capability, str(row["tasks"]), f"{row['base']:.2f}", f"{row['expert']:.2f}")
    console.print(transfer)
    for d in report["decisions"]:
        console.print(f"deployment {d['id']}: {d['status']} {'; '.join(d['reasons'])}")


def markdown(report: dict[str, Any]) -> str:
    before, after = report["before"], report["after"]
    lines = [
        f"# trace-plugin demo ({report['preset']})",
        "",
        f"Model: {report['model']}. Every number below was measured in this run "
        f"({report['seconds']['total'] / 60:.1f} minutes).",
        "",
        "| task kind | before | after |",
        "|---|---:|---:|",
        *(
            f"| {k} | {before['by_kind'][k]:.2f} | {after['by_kind'].get(k, 0.0):.2f} |"
            for k in sorted(before["by_kind"])
        ),
        f"| **success rate** ({before['n']} tasks) | **{before['success']:.2f}** "
        f"| **{after['success']:.2f}** |",
        "",
        "## Capabilities",
        "",
        "| capability | selected | coverage | contrast Δ |",
        "|---|---|---:|---:|",
        *(
            f"| {c['name']} | {c['selected_by'] or '—'} | {c['coverage']:.2f} | {c['contrast']:+.2f} |"
            for c in report["capabilities"]
        ),
        "",
        "## Cycles",
        "",
        "| cycle | " + " | ".join(CYCLE_COLUMNS) + " |",
        "|---|---:|---|---|---|---|---:|",
        *(f"| {n} | " + " | ".join(cycle_cells(c)) + " |" for n, c in enumerate(report["cycles"], 1)),
        "",
        "## Environments, experts and deployments",
        "",
        *(f"- environment {e['name']} v{e['version']}: {e['status']}" for e in report["environments"]),
        *(
            f"- expert {e['capability']} ({e['id']}): {e['status']}, "
            f"reward per step {[round(r, 2) for r in e['reward_curve']]}, un-hinted {_unhinted(e)}"
            + (f"; held-out seeds, base → expert: {_held_out(e)}" if e["held_out"] else "")
            for e in report["experts"]
        ),
        *(f"- deployment {d['id']}: {d['status']} {'; '.join(d['reasons'])}" for d in report["decisions"]),
        "",
        "## Transfer",
        "",
        "Each expert alone on the test tasks whose base episode its capability's detector labels LACKING.",
        "",
        "| expert | tasks | base | with the expert |",
        "|---|---:|---:|---:|",
        *(
            f"| {c} | {row['tasks']} | {row['base']:.2f} | {row['expert']:.2f} |"
            for c, row in report.get("transfer", {}).items()
        ),
        "",
        f"Stage times (s): {report['seconds']}",
        "",
    ]
    return "\n".join(lines)


CYCLE_COLUMNS = ("traffic success", "mined", "trained", "composed", "outcome", "test success after")


def cycle_cells(cycle: dict[str, Any]) -> list[str]:
    """A cycle's row (a ``CycleReport`` as a dict): its traffic's success, what it
    mined, trained and composed, its outcome, and the live agent's test success after it."""
    adapters = ", ".join(cycle["adapters"].values())
    return [
        f"{cycle['traffic_success']:.2f}",
        ", ".join(cycle["mined"]) or "—",
        ", ".join(cycle["trained"]) or "—",
        f"{adapters} ({cycle['router']})" if adapters else "—",
        cycle["outcome"],
        f"{cycle['after']['success']:.2f}",
    ]


def _unhinted(expert: dict[str, Any]) -> str:
    """An expert's un-hinted reward per step, flagged when it never rose: hints alone carried it."""
    curve = [None if v is None else round(v, 2) for v in expert["unhinted_curve"]]
    return f"{curve}" + ("" if expert["learned_unhinted"] else " (never rose: flagged)")


def _held_out(expert: dict[str, Any]) -> str:
    return f"{expert['held_out']['base']:.2f} → {expert['held_out']['candidate']:.2f}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = sorted(report["before"]["by_kind"])
    x = range(len(kinds))
    left.bar([i - 0.2 for i in x], [report["before"]["by_kind"][k] for k in kinds], 0.4, label="before")
    left.bar(
        [i + 0.2 for i in x], [report["after"]["by_kind"].get(k, 0.0) for k in kinds], 0.4, label="after"
    )
    left.set_xticks(list(x), kinds, rotation=30, ha="right")
    left.set_ylim(0, 1)
    left.set_title(
        f"Success by task kind: {report['before']['success']:.2f} → {report['after']['success']:.2f}"
    )
    left.legend()
    for expert in report["experts"]:
        right.plot(
            range(1, len(expert["reward_curve"]) + 1),
            expert["reward_curve"],
            marker="o",
            label=expert["capability"],
        )
    right.set_xlabel("GRPO step")
    right.set_ylabel("mean episode reward")
    right.set_title("Expert training")
    if report["experts"]:
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
