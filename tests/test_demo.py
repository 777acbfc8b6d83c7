"""The README's main job, at the smallest size: the demo's whole flow on the real model."""

from __future__ import annotations

import json

import pytest

from trace_plugin import demo
from trace_plugin.demo import AGENT, EVAL_AGENT, Preset
from trace_plugin.improver import Improver
from trace_plugin.store import Store


@pytest.mark.slow
@pytest.mark.timeout(2400)  # six minutes alone; mining may or may not select something from 4 tasks
def test_demo_measures_before_and_after_each_of_two_cycles_and_writes_its_reports(tmp_path, monkeypatch):
    tiny = Preset(
        test_tasks=2,
        traffic_tasks=4,
        rollouts=4,
        max_experts=1,
        calibration_seeds=1,
        calibration_samples=1,
        calibration_attempts=1,
        eval_seeds=1,
        cycles=2,
        gate_tasks=2,
        reference_plays=2,
    )
    monkeypatch.setitem(demo.PRESETS, "tiny", tiny)
    home, out = tmp_path / "home", tmp_path / "out"

    # Killed as its first cycle's improvement starts: the run before it is kept.
    def killed(self, **kwargs):
        raise KeyboardInterrupt

    run_once = Improver.run_once
    monkeypatch.setattr(Improver, "run_once", killed)
    with pytest.raises(KeyboardInterrupt):
        demo.main("tiny", home=home, out=out)
    monkeypatch.setattr(Improver, "run_once", run_once)
    report = demo.main("tiny", home=home, out=out)  # resumed

    assert report["before"]["n"] == report["after"]["n"] == 2
    assert set(report["seconds"]) == {
        "gateway",
        "before",
        *(f"{stage} {n}" for stage in ("traffic", "improve", "after") for n in (1, 2)),
        "transfer",
        "total",
    }
    store = Store(f"sqlite:///{home / 'trace.db'}")
    traffic = store.load_episodes(AGENT)
    assert len(traffic) == 8  # two cycles of 4, recorded by the decorated agent as deployed, with rewards
    # Each expert alone on the reported tasks its capability was lacking in (at most both).
    ready = {e.capability for e in store.experts(AGENT, status="ready")}
    assert set(report["transfer"]) == ready and all(0 <= t["tasks"] <= 2 for t in report["transfer"].values())
    played = len(store.list_episodes(EVAL_AGENT, limit=1000))
    again = demo.main("tiny", home=home, out=out)  # a finished run reports again, playing nothing
    assert again["cycles"] == report["cycles"] and again["before"] == report["before"]
    assert len(store.load_episodes(AGENT)) == 8 and len(store.list_episodes(EVAL_AGENT, limit=1000)) == played
    with pytest.raises(demo.DemoError, match="--fresh"):
        demo.main("quick", home=home, out=out)
    assert all(e.reward is not None for e in traffic)
    # Each cycle is reported as its jobs recorded it; the last one's "after" is the report's.
    cycles = report["cycles"]
    assert [c["cycle"] for c in cycles] == [j.cycle for j in store.jobs(AGENT) if j.stage == "cycle"]
    assert cycles[-1]["after"] == report["after"]
    for c in cycles:
        assert set(c["trained"]) <= set(c["mined"]) and c["deployed"] == (c["outcome"] == "made live")
    # Whatever the cycles decided is on record, and the reports agree with what is returned.
    assert [d["id"] for d in report["decisions"]] == [d.id for d in store.deployments(AGENT)]
    assert json.loads((out / "demo.json").read_text())["after"] == json.loads(json.dumps(report["after"]))
    markdown = (out / "demo.md").read_text()
    assert f"**{report['after']['success']:.2f}**" in markdown and "| 2 | " in markdown
    assert (out / "demo.png").read_bytes().startswith(b"\x89PNG")


def test_the_report_flags_an_expert_whose_unhinted_reward_never_rose_and_shows_each_cycle():
    expert = {
        "id": "e1",
        "capability": "tool_call_format",
        "status": "ready",
        "reward_curve": [0.04, 0.18],
        "unhinted_curve": [0.0, None, 0.0],
        "learned_unhinted": False,
        "held_out": {"base": 0.0, "current": 0.0, "candidate": 0.57},
    }
    learned = {**expert, "id": "e2", "unhinted_curve": [0.0, 0.25], "learned_unhinted": True}
    learned["held_out"] = None
    report = {
        "preset": "tiny",
        "model": "m",
        "seconds": {"total": 60.0},
        "before": {"n": 2, "success": 0.5, "by_kind": {"lookup": 0.5}},
        "after": {"n": 2, "success": 0.5, "by_kind": {"lookup": 0.5}},
        "capabilities": [],
        "environments": [],
        "experts": [expert, learned],
        "decisions": [],
        "cycles": [
            {
                "cycle": "c1",
                "traffic_success": 0.25,
                "mined": ["tool_call_format", "termination"],
                "trained": ["tool_call_format"],
                "adapters": {"tool_call_format": "tool_call_format@e1"},
                "router": "static",
                "deployed": False,
                "outcome": "rejected: target success 0.25 does not beat the live 0.25 by 0.0",
                "after": {"success": 0.25},
            }
        ],
    }
    lines = demo.markdown(report).splitlines()
    [flagged] = [line for line in lines if "(e1)" in line]
    assert "un-hinted [0.0, None, 0.0] (never rose: flagged)" in flagged and "0.00 → 0.57" in flagged
    [fine] = [line for line in lines if "(e2)" in line]
    assert fine.endswith("un-hinted [0.0, 0.25]")
    [cycle] = [line for line in lines if line.startswith("| 1 |")]
    assert cycle == (
        "| 1 | 0.25 | tool_call_format, termination | tool_call_format | tool_call_format@e1 (static) "
        "| rejected: target success 0.25 does not beat the live 0.25 by 0.0 | 0.25 |"
    )


def test_an_evaluation_runs_one_routing_decision_at_a_time_and_keeps_the_tasks_order():
    import asyncio

    from trace_plugin.environments.base import RewardBreakdown
    from trace_plugin.environments.runner import EpisodeResult

    decisions = {1: "lookup", 2: "", 3: "lookup", 4: "writes:0.6,lookup:0.4", 5: ""}
    runs: list[tuple[list[int], str | None]] = []

    async def route(seed: int) -> str:
        return decisions[seed]

    async def run(group: list[int], served: str | None) -> list[EpisodeResult]:
        runs.append((group, served))
        return [EpisodeResult(s, "k", RewardBreakdown(s / 10), f"ep{s}", "") for s in reversed(group)]

    results = asyncio.run(demo.grouped_by_route([1, 2, 3, 4, 5], route, run))
    assert [r.seed for r in results] == [1, 2, 3, 4, 5]  # each task's own result, in the tasks' order
    assert runs == [([1, 3], "lookup"), ([2, 5], ""), ([4], "writes:0.6,lookup:0.4")]
    runs.clear()
    asyncio.run(demo.grouped_by_route([1, 3], route, run))
    assert runs == [([1, 3], None)]  # one decision: one run, labelled as the model
