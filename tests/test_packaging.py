"""The package promises: a light capture path and a working CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agents import build, model_for, user
from typer.testing import CliRunner

import trace_plugin
from trace_plugin.cli import app

ROOT = Path(__file__).parent.parent
HEAVY = ("torch", "transformers", "vllm", "litellm", "trl", "peft")


def test_import_and_capture_path_load_no_heavy_modules(tmp_path):
    code = f"""
import sys
import trace_plugin
assert 'langchain_core' not in sys.modules, 'import trace_plugin pulled in LangChain'
from agents import build, model_for, user
trace_plugin.configure('sqlite:///{tmp_path / "light.db"}')
model = model_for(('get_order', {{'order_id': '1'}}))
graph = trace_plugin.capture(agent='light')(build('create_agent', model))
graph.invoke(user('hi'))
assert trace_plugin.flush(10)
print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or 'LIGHT')
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "LIGHT"


def test_cli_upgrade_list_show_stats(sqlite_url):
    rec = trace_plugin.Recorder(sqlite_url)
    graph = trace_plugin.capture(agent="cli-agent", recorder=rec, reward=lambda s: 1.0)(
        build("create_agent", model_for(("get_order", {"order_id": "O-42"})))
    )
    graph.invoke(user("where is O-42"))
    assert rec.flush(10)
    episode_id = rec.store.list_episodes()[0].id

    runner = CliRunner()
    env = {"COLUMNS": "200"}
    result = runner.invoke(app, ["db", "upgrade", "--db", sqlite_url], env=env)
    assert result.exit_code == 0 and "schema up to date" in result.output

    result = runner.invoke(app, ["episodes", "list", "--db", sqlite_url], env=env)
    assert result.exit_code == 0 and episode_id in result.output and "cli-agent" in result.output

    result = runner.invoke(app, ["episodes", "show", episode_id, "--db", sqlite_url], env=env)
    assert result.exit_code == 0 and "get_order" in result.output and "O-42" in result.output

    result = runner.invoke(app, ["episodes", "show", "nope", "--db", sqlite_url], env=env)
    assert result.exit_code == 1 and "no episode nope" in result.output

    result = runner.invoke(app, ["stats"], env={**env, "TRACE_PLUGIN_DB_URL": sqlite_url})
    assert result.exit_code == 0 and "cli-agent" in result.output and "100.0%" in result.output
