"""Every example runs, as a user would run it (the GPU recipe is scripts/gpu_check.sh's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run(*args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_quickstart():
    out = run("examples/quickstart.py")
    assert "get_order_details" in out and "cancel_pending_order" in out


def test_mcp_client_plays_a_synthesized_environment_over_http():
    out = run("examples/mcp_client.py")
    assert "tools: ['find_user', 'get_user', 'env_reset', 'env_reward']" in out
    assert "reward: {'total': 1.0" in out and "recorded episode" in out


def test_litellm_agent_is_captured_by_the_callback():
    out = run("examples/litellm_agent.py")
    assert "answer: Your order W100 has been delivered." in out and "2 model calls" in out


@pytest.mark.slow
def test_support_agent_on_the_real_model(tmp_path):
    out = run("examples/support_agent/agent.py", "--tasks", "2", "--concurrency", "2", timeout=600)
    assert '"tasks": 2' in out and "Support agent (SmolLM2-135M-Instruct)" in out


@pytest.mark.slow
def test_the_function_agent_runs_the_whole_loop_from_its_own_folder(tmp_path):
    """The second example, smallest size: its traffic captured, mined, an environment
    synthesized from its stateless tools, an expert trained and routed, the gate judged on
    its own suite (found by entry point); the held-out success of base and improved printed.
    Budget: about 6 minutes on 2 cores."""
    from trace_plugin import Store

    home = tmp_path / "run"
    out = run(
        "-m", "function_agent.loop", "--home", str(home), "--traffic", "16", "--tests", "4",
        "--rollouts", "8", "--plays", "2", "--eval-seeds", "2", "--gate", "2", timeout=900,
    )  # fmt: skip
    assert "held-out success on 4 questions: base" in out
    report = json.loads((home / "loop.json").read_text())
    last = json.loads(out.strip().splitlines()[-1])  # the bench contract: one JSON object, last
    assert last["bench"] == "function_agent" and last["n_test_tasks"] == 4 and last["reference_plays"] == 2
    assert last["gain_ci_low"] <= last["improved"] - last["base"] <= last["gain_ci_high"]
    store = Store(f"sqlite:///{home / 'trace.db'}")
    assert store.list_episodes("function-agent")  # captured by the decorator
    assert any(c.selected for c in store.capabilities("function-agent"))  # mined
    [spec] = [r.spec for r in store.env_specs("function-agent")][-1:]
    assert {t.behaviour for t in spec.tools} == {"respond"} and any(t.tools for t in spec.tasks)
    assert store.experts("function-agent")  # trained
    [decision] = store.deployments("function-agent")
    assert decision.router and decision.evaluation["target"]["current"]["n"] == 2  # routed, gated apart
    assert report["base"] is not None and report["improved"] is not None
