"""A real improver process, killed with SIGKILL at several points, resumes without duplicates."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event, update
from sqlalchemy.engine import Connection

from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.records.deployment import Deployment
from trace_plugin.records.job import Job
from trace_plugin.store import Store
from trace_plugin.store import tables as t
from training.experts import ExpertResult

pytestmark = pytest.mark.slow
PROCESS = Path(__file__).with_name("improver_proc.py")


class Child:
    """An improver process whose output is read as it comes, so a test can wait for a line
    (and the process never stalls on a full pipe)."""

    def __init__(self, db: str, gateway: str, root: Path, pause_at: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # this checkout's code
        self.process = subprocess.Popen(
            [sys.executable, str(PROCESS), db, gateway, str(root), *([pause_at] if pause_at else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 900) -> None:
        """Until a line holds ``text``; fails when the process ends first."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, f"ended before {text!r}:\n{self.output}"
            self.lines.append(line)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def finish(self, timeout: float = 900) -> str:
        self.process.wait(timeout=timeout)
        while (line := self._queue.get(timeout=60)) is not None:
            self.lines.append(line)
        assert self.process.returncode == 0, self.output
        return self.output


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """The processes a test starts; those still running when it ends (it failed) are killed."""
    started: list[Child] = []
    yield started
    for child in started:
        if child.process.poll() is None:
            child.kill()


def trained_steps(output: str) -> list[int]:
    return [int(step) for step in re.findall(r"trained step (\d+)", output)]


@pytest.mark.timeout(1800)  # seven processes, each loading the model; training, evaluation twice
async def test_killed_at_every_stage_the_improver_finishes_once(
    planted: Store,  # noqa: F811
    embedded_backend: Any,
    tmp_path: Path,
    children: list[Child],
) -> None:
    store = planted
    root = tmp_path / "adapters"
    root.mkdir()
    config = GatewayConfig(adapter_root=root, agent="planted", record=False)
    with start_in_thread(create_app(embedded_backend, config=config)) as gateway:
        # What the agent was served before: the deployment a new one supersedes.
        baseline = Deployment(
            "baseline", "planted", "live", router=httpx.get(f"{gateway.url}/v1/router").json()
        )
        store.save_deployment(baseline)
        # It went live before the planted traffic, which it served: the traffic a cycle mines.
        with store.engine.begin() as conn:
            conn.execute(update(t.deployments).values(updated_at=datetime(2020, 1, 1, tzinfo=UTC)))

        def start(pause_at: str | None = None) -> Child:
            children.append(Child(store.url, gateway.url, root, pause_at))
            return children[-1]

        def paused(point: str) -> Child:
            child = start(point)
            child.wait_for(f"paused at {point}")
            return child

        def job(stage: str) -> Job:
            [found] = [j for j in store.jobs("planted") if j.stage == stage]
            return found

        paused("mine:done").kill()

        child = paused("synthesize:stored")
        assert job("synthesize").status == "running" and len(store.env_specs("planted")) == 1
        child.kill()

        child = paused("train:checkpoint")
        assert len(store.env_specs("planted")) == 1  # the stored environment was not synthesized again
        [checkpoint] = root.rglob("checkpoint-1")
        assert (checkpoint / "trainer_state.json").is_file() and job("train").status == "running"
        assert trained_steps(child.output) == [1]
        child.kill()

        child = paused("evaluate:played")
        assert trained_steps(child.output) == [2]  # resumed after the checkpoint's step, not from 0
        evaluation = job("evaluate")
        assert evaluation.status == "running" and evaluation.outputs is None  # interrupted midway
        child.kill()

        paused("verdict:done").kill()

        child = paused("deploy:commit")
        # Seen from another connection, mid-switch: the old deployment is live, and only it.
        assert [d.id for d in store.deployments("planted", status="live")] == ["baseline"]
        child.kill()
        assert [d.id for d in store.deployments("planted", status="live")] == ["baseline"]

        output = start().finish()
        assert trained_steps(output) == []  # the finished expert is not trained again
        router = httpx.get(f"{gateway.url}/v1/router").json()
        loaded = httpx.get(f"{gateway.url}/v1/lora_adapters").json()["loaded"]

    [cycle] = [j for j in store.jobs("planted") if j.stage == "cycle"]
    assert cycle.status == "done" and f"deployed {cycle.cycle}" in output
    jobs = {(j.stage, j.key): j for j in store.jobs("planted", cycle.cycle)}
    assert all(j.status == "done" for j in jobs.values())
    for stage in ("synthesize", "train", "evaluate", "deploy"):
        assert [j.attempts for (s, _), j in jobs.items() if s == stage] == [2], stage  # killed once in each
    [expert] = store.experts("planted")  # one expert, however often training was interrupted
    assert expert.status == "ready" and Path(expert.adapter_path).is_dir()
    assert ExpertResult.load(Path(expert.adapter_path)).resumed_from_step == 1
    assert not list(root.rglob(".*.partial"))  # no half-written adapter left behind
    evaluation = jobs[("evaluate", "all")].outputs
    assert set(evaluation["capabilities"]["argument_grounding"]) == {"base", "current", "candidate"}
    assert evaluation["target"]["candidate"]["n"] == 2  # the restarted evaluation ran to the end
    old, new = store.deployments("planted")
    assert (old.id, old.status) == ("baseline", "superseded")
    assert (new.id, new.status) == (cycle.cycle, "live") and new.evaluation == evaluation
    assert router == new.router
    assert sum(name.startswith("argument_grounding@") for name in loaded) == 1
    assert len(store.env_specs("planted")) == 1  # synthesized once


class Killed(Exception):
    """Raised where a kill would land: just before a transaction's commit."""


def live_seen_mid_switch(store: Store, db_url: str, switch: Callable[[], None]) -> list[str]:
    """Run ``switch`` stopped just before its commit; what another connection saw live then."""
    other = Store(db_url)
    seen: list[list[str]] = []

    def stop(conn: Connection) -> None:
        seen.append([d.id for d in other.deployments("a", status="live")])
        raise Killed

    event.listen(store.engine, "commit", stop)
    with pytest.raises(Killed):
        switch()
    event.remove(store.engine, "commit", stop)
    other.close()
    [live] = seen
    return live


def test_a_deployment_switch_stopped_before_its_commit_leaves_the_old_one_live(db_url: str) -> None:
    """The switch is one transaction, on SQLite and PostgreSQL: stopped before its commit
    (as a kill would), another connection still sees the old deployment live, and only it."""
    store = Store(db_url)
    store.upgrade()
    old, new = Deployment("old", "a", "live"), Deployment("new", "a", "rejected")
    store.save_deployment(old)
    store.save_deployment(new)
    assert live_seen_mid_switch(store, db_url, lambda: store.make_live(new)) == ["old"]
    assert {d.id: d.status for d in store.deployments("a")} == {"old": "live", "new": "rejected"}
    store.make_live(new)
    store.make_live(new)  # a rerun after a kill past the commit changes nothing
    assert {d.id: d.status for d in store.deployments("a")} == {"old": "superseded", "new": "live"}
    store.close()


def test_a_rollback_stopped_before_its_commit_leaves_the_current_one_live(db_url: str) -> None:
    """A rollback is the same one-transaction switch: retiring the current deployment and
    restoring the previous one commit together or not at all."""
    store = Store(db_url)
    store.upgrade()
    previous, current = Deployment("c1", "a", "superseded"), Deployment("c2", "a", "live")
    store.save_deployment(previous)
    store.save_deployment(current)
    current.status, current.reasons = "rolled_back", ["live success fell"]
    rollback = lambda: store.make_live(previous, retire=current)  # noqa: E731
    assert live_seen_mid_switch(store, db_url, rollback) == ["c2"]
    assert {d.id: d.status for d in store.deployments("a")} == {"c1": "superseded", "c2": "live"}
    rollback()
    stored = {d.id: (d.status, d.reasons) for d in store.deployments("a")}
    assert stored == {"c1": ("live", []), "c2": ("rolled_back", ["live success fell"])}
    store.close()
