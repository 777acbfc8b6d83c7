"""How well the offline miner finds planted deficits, and what it finds on the real base agent.

- Planted: scripted policies on the retail environment, each lacking one known capability,
  mixed with a competent policy and a harmless distractor (``trace_plugin.environments.planted``).
  Precision and recall of the selected capabilities against the planted ones.
- Base agent: the example LangGraph support agent on the embedded SmolLM2-135M, through the
  gateway, on test tasks; the capabilities the miner selects from those episodes.

Usage: python bench/mining.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples/ package
import trace_plugin  # noqa: E402
from examples.support_agent.agent import build_support_agent, few_shot_messages  # noqa: E402
from trace_plugin.environments.planted import PLANTED, corpus  # noqa: E402
from trace_plugin.environments.retail import TEST_SEEDS, TRAIN_SEEDS, RetailEnv  # noqa: E402
from trace_plugin.environments.runner import LangGraphAgent, Runner  # noqa: E402
from trace_plugin.gateway.app import GatewayConfig, create_app  # noqa: E402
from trace_plugin.gateway.embedded import EmbeddedBackend  # noqa: E402
from trace_plugin.gateway.server import start_in_thread  # noqa: E402
from trace_plugin.mining.miner import OfflineMiner, mine_episodes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    planted_seeds, base_tasks = (32, 4) if args.quick else (200, 40)
    console = Console()

    capabilities = mine_episodes(corpus(list(TRAIN_SEEDS)[:planted_seeds]))
    selected = {c.name for c in capabilities if c.selected}
    planted = {kind for kinds in PLANTED.values() for kind in kinds}
    precision = len(selected & planted) / len(selected) if selected else 0.0
    recall = len(selected & planted) / len(planted)
    table = Table(title=f"Planted deficits ({planted_seeds} seeds x {len(PLANTED) + 2} policies)")
    for column in ("capability", "planted", "selected", "coverage", "contrast Δ", "runs passed"):
        table.add_column(column)
    for c in capabilities:
        table.add_row(
            c.name,
            "yes" if c.name in planted else "",
            "yes" if c.selected else "",
            f"{c.metrics['coverage']:.2f}",
            f"{c.metrics['contrast']:+.2f}",
            f"{c.metrics['passed']}/10",
        )
    console.print(table)

    with tempfile.TemporaryDirectory() as tmp:
        recorder = trace_plugin.configure(f"sqlite:///{Path(tmp) / 'base.db'}")
        backend = EmbeddedBackend()
        with start_in_thread(create_app(backend, config=GatewayConfig(record=False))) as server:
            agent = LangGraphAgent(
                lambda env: build_support_agent(env, base_url=server.url + "/v1", model=backend.model_id),
                examples=few_shot_messages(),
            )
            asyncio.run(
                Runner(RetailEnv, agent, concurrency=4).run(
                    list(TEST_SEEDS)[:base_tasks], description="base agent"
                )
            )
        trace_plugin.flush()
        found = [c for c in OfflineMiner(recorder.store).mine("support-agent") if c.selected]
        recorder.close()
    console.print(f"selected on the base agent's {base_tasks} episodes: {[c.name for c in found] or 'none'}")

    print(
        json.dumps(
            {
                "bench": "mining",
                "quick": args.quick,
                "planted_precision": round(precision, 4),
                "planted_recall": round(recall, 4),
                "distractors_selected": len(selected - planted),
                "capabilities_found_on_base_agent": len(found),
            }
        )
    )


if __name__ == "__main__":
    main()
