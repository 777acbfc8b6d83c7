"""A real improver process, killed with SIGKILL at several points, resumes without duplicates."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_synthesis_flow import planted  # noqa: F401  (a fixture: a store with a mined deficit)

from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread

pytestmark = pytest.mark.slow
PROCESS = Path(__file__).with_name("improver_proc.py")


def start(db: str, gateway: str, root: Path, pause_after: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen(
        [sys.executable, str(PROCESS), db, gateway, str(root), *([pause_after] if pause_after else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def kill_when(
    store, child: subprocess.Popen, stage: str, status: str, after: float, timeout: float = 600
) -> None:
    """SIGKILL ``child`` ``after`` seconds after a job of ``stage`` has ``status``."""
    deadline = time.monotonic() + timeout
    while not any(j.stage == stage and j.status == status for j in store.jobs("planted")):
        assert child.poll() is None, child.stdout.read()
        assert time.monotonic() < deadline, f"stage {stage} never started"
        time.sleep(0.1)
    time.sleep(after)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


async def test_killed_at_every_stage_the_improver_finishes_once(planted, embedded_backend, tmp_path):  # noqa: F811
    store = planted
    root = tmp_path / "adapters"
    root.mkdir()
    config = GatewayConfig(adapter_root=root, agent="planted", record=False)
    with start_in_thread(create_app(embedded_backend, config=config)) as gateway:
        points = [
            ("mine", "done", 0.0),
            ("train", "running", 8.0),
            ("evaluate", "running", 1.0),
            ("gate", "done", 0.0),
        ]
        for stage, status, after in points:
            kill_when(store, start(store.url, gateway.url, root, pause_after=stage), stage, status, after)
        final = start(store.url, gateway.url, root)
        output, _ = final.communicate(timeout=900)
        assert final.returncode == 0, output
        router = httpx.get(f"{gateway.url}/v1/router").json()
        loaded = httpx.get(f"{gateway.url}/v1/lora_adapters").json()["loaded"]

    [cycle] = [j for j in store.jobs("planted") if j.stage == "cycle"]
    assert cycle.status == "done" and f"deployed {cycle.cycle}" in output
    jobs = {(j.stage, j.key): j for j in store.jobs("planted", cycle.cycle)}
    assert all(j.status == "done" for j in jobs.values())
    assert jobs[("train", "argument_grounding")].attempts >= 2  # killed mid-training, then resumed
    [expert] = store.experts("planted")  # one expert, however often training was interrupted
    assert expert.status == "ready" and Path(expert.adapter_path).is_dir()
    assert not list(root.rglob(".*.partial"))  # no half-written adapter left behind
    [deployment] = store.deployments("planted")
    assert deployment.id == cycle.cycle and deployment.status == "live"
    assert router == deployment.router
    assert sum(name.startswith("argument_grounding@") for name in loaded) == 1
    assert len(store.env_specs("planted")) == 1  # synthesized once
