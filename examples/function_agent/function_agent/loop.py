"""The whole loop on this agent, as a team would run it: ``python -m function_agent.loop``.

1. serve the embedded model behind trace-plugin's gateway;
2. run the agent on practice questions as its production traffic (captured by its decorator);
3. improve once: mine, synthesize, warm-start and train, route, and gate on practice
   questions of the ``functions`` target (found by its entry point);
4. measure the agent on the held-out questions, which the gate never saw, with the base
   model and with the improved one, whatever the gate decided, and print both with a paired
   bootstrap interval of the gain; the last line is the result as one JSON object.

Nothing here reaches into trace-plugin's internals: the agent, its suite and this script
are all the code a team writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

import trace_plugin
from function_agent.agent import AGENT, build_function_agent
from function_agent.suite import TEST_SEEDS, FunctionsEnv
from trace_plugin.environments import ToolCall
from trace_plugin.environments.runner import EpisodeResult, LangGraphAgent, Runner, summarize
from trace_plugin.gateway import GatewayAdmin, GatewayConfig, serve_embedded
from trace_plugin.improver import Improver, ImproverConfig, paired_gain
from trace_plugin.store import Store

EVAL_AGENT = f"eval:{AGENT}"  # evaluations are recorded apart, so they never feed mining
GATE_SEEDS = range(9_000, 9_100)  # practice questions the gate decides on: neither traffic nor held out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path("function-agent-run"))
    parser.add_argument("--traffic", type=int, default=48, help="practice questions played as traffic")
    parser.add_argument("--tests", type=int, default=len(TEST_SEEDS), help="held-out questions")
    parser.add_argument("--rollouts", type=int, default=64, help="GRPO rollouts for the expert")
    parser.add_argument("--plays", type=int, default=32, help="reference plays the expert is warm-started on")
    parser.add_argument(
        "--eval-seeds", type=int, default=8, help="held-out seeds of the synthesized environment"
    )
    parser.add_argument("--gate", type=int, default=16, help="practice questions the gate decides on")
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run: 24 traffic, 16 rollouts and plays"
    )
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(traffic=24, rollouts=16, plays=16, gate=8)
        args = parser.parse_args(argv)

    console = Console()
    args.home.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{(args.home / 'trace.db').resolve()}"
    store = Store(db)
    store.upgrade()
    recorder = trace_plugin.configure(db)
    adapters = args.home / "adapters"
    server = serve_embedded(
        config=GatewayConfig(adapter_root=adapters, agent=AGENT, record=False), max_batch=16
    )
    base_url = f"{server.url}/v1"

    def agent(model: str, *, evaluation: bool) -> LangGraphAgent:
        def build(env: Any) -> Any:
            def run(name: str, arguments: dict[str, Any]) -> str:
                return env.step(ToolCall(name, arguments))

            if not evaluation:  # as deployed: the decorator records it as the agent
                return build_function_agent(run, base_url=base_url, model=model)
            graph = build_function_agent.__wrapped__(run, base_url=base_url, model=model)
            return trace_plugin.capture(agent=EVAL_AGENT, recorder=recorder)(graph)

        return LangGraphAgent(build, max_turns=3)

    async def evaluate(model: str, seeds: Sequence[int]) -> list[EpisodeResult]:
        runner = Runner(
            FunctionsEnv, agent(model, evaluation=True), concurrency=16, recorder=recorder, console=console
        )
        return await runner.run(seeds, description=f"held-out questions as {model}")

    test = list(TEST_SEEDS)[: args.tests]
    improver = Improver(
        store,
        ImproverConfig(
            agent=AGENT,
            gateway_url=server.url,
            adapter_root=adapters,
            target="functions",
            target_seeds=list(GATE_SEEDS)[: args.gate],
            min_new_episodes=0,
            max_experts=1,
            calibration_seeds=4,
            calibration_samples=2,
            calibration_attempts=2,  # the second may name the tools in the request
            training={
                "rollout_budget": args.rollouts,
                "warm_start_plays": args.plays,
                "hint_fraction": 0.5,
            },
            eval_seeds=args.eval_seeds,
        ),
        evaluator=evaluate,
        recorder=recorder,
        console=console,
    )
    try:
        console.rule("[bold]production traffic")
        runner = Runner(
            FunctionsEnv,
            agent("default", evaluation=False),
            concurrency=16,
            recorder=recorder,
            console=console,
        )
        traffic = asyncio.run(runner.run(range(args.traffic), description="traffic"))
        recorder.flush(30)
        console.print(summarize(traffic, "Captured traffic"))
        console.rule("[bold]improve")
        end = improver.run_cycle()
        decision = store.deployments(AGENT)[-1] if store.deployments(AGENT) else None
        # The improved agent: its one expert by name, whatever the gate decided (loaded here
        # too, for a cycle that composed no candidate of it), else what is live.
        trained = list(end.trained.values())
        improved_model = "default"
        if len(trained) == 1:
            asyncio.run(GatewayAdmin(server.url).ensure_adapter(trained[0].adapter_name, trained[0].adapter))
            improved_model = trained[0].adapter_name
        console.rule("[bold]held-out questions")
        base = asyncio.run(evaluate("base", test))
        improved = asyncio.run(evaluate(improved_model, test))
    finally:
        server.stop()
        recorder.flush(30)
    base_rewards = [float(r.reward.total == 1.0) for r in sorted(base, key=lambda r: r.seed)]
    improved_rewards = [float(r.reward.total == 1.0) for r in sorted(improved, key=lambda r: r.seed)]
    low, high = paired_gain(improved_rewards, base_rewards)
    experts = store.experts(AGENT)
    report = {
        "bench": "function_agent",
        "quick": args.quick,
        "n_test_tasks": len(test),
        "base": sum(base_rewards) / len(test),
        "improved": sum(improved_rewards) / len(test),
        "gain_ci_low": low,
        "gain_ci_high": high,
        "reference_plays": sum(e.config.get("warm_start_plays", 0) for e in experts),
        "rollout_budget": sum(e.config["rollout_budget"] for e in experts),
        "improved_model": improved_model,
        "decision": decision.status if decision else "nothing deployed",
        "reasons": decision.reasons if decision else [],
    }
    console.print(
        f"held-out success on {len(test)} questions: base {report['base']:.2f}, "
        f"improved {report['improved']:.2f} (gain, 95% CI [{low:+.2f}, {high:+.2f}]; "
        f"gate: {report['decision']})"
    )
    (args.home / "loop.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in list(report)[:9]}))
    return report


if __name__ == "__main__":
    main()
