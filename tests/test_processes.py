"""Several agent processes writing into one database, and shutdown without loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trace_plugin import Store

HERE = Path(__file__).parent
STEPS_PER_RUN = 4  # 2 LLM calls + 2 tools (the graph's model and tools nodes only repeat them)


def run_agents(db_url: str, processes: int, runs: int) -> list[subprocess.CompletedProcess]:
    Store(db_url).upgrade()  # as `trace-plugin db upgrade` would before a fleet starts
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "capture_proc.py"), db_url, f"proc{i}", str(runs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def assert_all_stored(db_url: str, processes: int, runs: int, results) -> None:
    for r in results:
        assert r.returncode == 0 and "done" in r.stdout, r.stderr
        assert "locked" not in r.stderr and "cannot write" not in r.stderr, r.stderr
    store = Store(db_url)
    stats = {s.agent: s for s in store.stats()}
    for i in range(processes):
        assert stats[f"proc{i}"].episodes == runs
        assert stats[f"proc{i}"].finished == runs
    assert store.count("steps") == processes * runs * STEPS_PER_RUN
    store.close()


@pytest.mark.slow
def test_four_processes_one_sqlite_file(sqlite_url):
    results = run_agents(sqlite_url, processes=4, runs=60)
    assert_all_stored(sqlite_url, 4, 60, results)


@pytest.mark.slow
def test_four_processes_one_postgres(pg_url):
    results = run_agents(pg_url, processes=4, runs=60)
    assert_all_stored(pg_url, 4, 60, results)


def test_exit_without_flush_loses_nothing(db_url):
    results = run_agents(db_url, processes=1, runs=40)
    assert_all_stored(db_url, 1, 40, results)


def test_concurrent_first_use_creates_the_schema_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "capture_proc.py"), url, f"p{i}", "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert Store(url).count("episodes") == 12


@pytest.mark.parametrize(
    ("mode", "returncode"), [("sigterm", -signal.SIGTERM), ("sigterm-app", 3), ("exit", 0)]
)
def test_sigterm_and_exit_store_every_finished_episode(mode, returncode, db_url):
    """SIGTERM flushes, then hands the signal on: to the default action (the process still
    dies of SIGTERM) or to the application's own handler. A normal exit flushes explicit
    recorders as well as the default one."""
    Store(db_url).upgrade()
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "shutdown_proc.py"), db_url, mode, "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "done"
    if mode != "exit":
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == returncode, err
    assert ("app shutdown" in out) == (mode == "sigterm-app")
    store = Store(db_url)
    [stats] = [s for s in store.stats() if s.agent == mode]
    assert (stats.episodes, stats.finished) == (20, 20)
    assert store.count("steps") == 20 * STEPS_PER_RUN
    store.close()
