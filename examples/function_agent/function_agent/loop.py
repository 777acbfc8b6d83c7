"""The whole loop on this agent, as a team would run it: ``python -m function_agent.loop``.

1. serve the embedded model behind trace-plugin's gateway;
2. run the agent on practice questions as its production traffic (captured by its decorator);
3. improve once: mine, synthesize, train, route, and gate on the ``functions`` target,
   which the improver finds by its entry point;
4. print the agent's success on the held-out questions with the base model and with the
   improved one, whatever the gate decided.

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
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.improver import Improver, ImproverConfig
from trace_plugin.store import Store

EVAL_AGENT = f"eval:{AGENT}"  # evaluations are recorded apart, so they never feed mining


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
    args = parser.parse_args(argv)

    console = Console()
    args.home.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{(args.home / 'trace.db').resolve()}"
    store = Store(db)
    store.upgrade()
    recorder = trace_plugin.configure(db)
    adapters = args.home / "adapters"
    backend = EmbeddedBackend(max_batch=16)
    server = start_in_thread(
        create_app(backend, config=GatewayConfig(adapter_root=adapters, agent=AGENT, record=False))
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
            target_seeds=test,
            min_new_episodes=0,
            max_experts=1,
            calibration_seeds=4,
            calibration_samples=2,
            calibration_attempts=2,  # the second may name the tools in the request
            training={
                "rollout_budget": args.rollouts,
                "warm_start_plays": args.plays,
                "hint_fraction": 0.5,
                "max_turns": 2,
                "max_completion_length": 64,
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
        improver.run_once()
    finally:
        server.stop()
        recorder.flush(30)
    decision = store.deployments(AGENT)[-1] if store.deployments(AGENT) else None
    target = (decision.evaluation.get("target") if decision else None) or {}
    report = {
        "held_out_questions": len(test),
        "base": (target.get("current") or {}).get("success"),
        "improved": (target.get("candidate") or {}).get("success"),
        "adapters": decision.adapters if decision else {},
        "decision": decision.status if decision else "nothing deployed",
        "reasons": decision.reasons if decision else [],
    }
    console.print(
        f"held-out success on {len(test)} questions: base {report['base']}, improved {report['improved']} "
        f"({report['decision']})"
    )
    (args.home / "loop.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
