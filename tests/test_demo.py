"""The README's main job, at the smallest size: the demo's whole flow on the real model."""

from __future__ import annotations

import json

import pytest

from trace_plugin import demo
from trace_plugin.demo import AGENT, Preset
from trace_plugin.store import Store


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a few minutes alone; mining may or may not select something from 4 tasks
def test_demo_measures_before_and_after_around_one_cycle_and_writes_its_reports(tmp_path, monkeypatch):
    tiny = Preset(
        test_tasks=2,
        traffic_tasks=4,
        rollouts=4,
        max_experts=1,
        calibration_seeds=1,
        calibration_samples=1,
        calibration_attempts=1,
        eval_seeds=1,
    )
    monkeypatch.setitem(demo.PRESETS, "tiny", tiny)
    home, out = tmp_path / "home", tmp_path / "out"
    report = demo.main("tiny", home=home, out=out)

    assert report["before"]["n"] == report["after"]["n"] == 2
    assert set(report["seconds"]) == {"before", "traffic", "improve", "after", "total"}
    store = Store(f"sqlite:///{home / 'trace.db'}")
    traffic = store.load_episodes(AGENT)
    assert len(traffic) == 4  # recorded by the decorated agent as deployed, each with its reward
    assert all(e.reward is not None for e in traffic)
    # Whatever the cycle decided is on record, and the reports agree with what is returned.
    assert [d["id"] for d in report["decisions"]] == [d.id for d in store.deployments(AGENT)]
    assert json.loads((out / "demo.json").read_text())["after"] == json.loads(json.dumps(report["after"]))
    assert f"**{report['after']['success']:.2f}**" in (out / "demo.md").read_text()
    assert (out / "demo.png").read_bytes().startswith(b"\x89PNG")
