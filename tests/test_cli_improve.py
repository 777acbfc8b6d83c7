"""``trace-plugin improve``: every bad setting is one error box naming the option and what is
wrong (rc 2), never a traceback; and the command builds its config by the library's rules."""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from trace_plugin.cli import app
from trace_plugin.environments.retail import TEST_SEEDS

BAD_TARGETS = """
from trace_plugin.environments.base import Target
from trace_plugin.environments.retail import RetailEnv

def raises():
    raise RuntimeError("no credentials for the suite")

def needs(path):
    return Target("units", RetailEnv, [1])

def number():
    return 3

seeds_not_a_sequence = Target("units", RetailEnv, 5)
"""


def improve(tmp_path, *options: str):
    args = ["improve", "--agent", "a", "--gateway-url", "http://127.0.0.1:9", "--adapter-root", str(tmp_path)]
    return CliRunner().invoke(app, [*args, *options, "--db", f"sqlite:///{tmp_path / 'cli.db'}"])


def said(output: str) -> str:
    """The error box's text on one line: rich wraps it inside borders."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("json:loads", "target 'json:loads': 'loads' needs arguments (missing a required argument: 's')"),
        ("bad_targets_cli:needs", "'needs' needs arguments (missing a required argument: 'path')"),
        ("bad_targets_cli:raises", "calling it failed: RuntimeError: no credentials for the suite"),
        ("bad_targets_cli:seeds_not_a_sequence", "test_seeds must be a non-empty sequence of ints"),
        ("bad_targets_cli:number", "is a int, not a trace_plugin.environments.Target"),  # refused before
    ],
)
def test_a_bad_target_is_one_error_box_that_says_what_is_wrong(tmp_path, monkeypatch, target, says):
    (tmp_path / "bad_targets_cli.py").write_text(textwrap.dedent(BAD_TARGETS))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = improve(tmp_path, "--target", target)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("╭─ Error") == 1
    assert "Invalid value for --target: target " in said(result.output) and says in said(result.output)


SERVERS: list = []  # the stand-in vLLM servers started, in order


@pytest.fixture
def built(monkeypatch):
    """What the command hands the improver, which runs nothing: each config, with the URLs
    of the stand-in servers running when its cycle ran."""
    import trace_plugin.improver
    import trace_plugin.recorder

    runs = []

    class Recording:
        def __init__(self, store, config, **_):
            self.config = config

        def run_once(self):
            runs.append((self.config, {server.url for server in SERVERS if server.running}))

    monkeypatch.setattr(trace_plugin.improver, "Improver", Recording)
    monkeypatch.setattr(trace_plugin.recorder, "configure", lambda db: None)
    SERVERS.clear()
    return runs


class StandInServer:
    """vLLM's server as the command sees it (the real one: test_vllm_real.py)."""

    def __init__(self, model_dir, *, served_name, log_path, **_):
        self.url, self.running = f"http://127.0.0.1:{9100 + len(SERVERS)}", False
        SERVERS.append(self)

    def start(self):
        self.running = True
        return self

    def stop(self):
        self.running = False


def test_the_command_takes_the_targets_seeds_by_the_configs_rule(tmp_path, built):
    """The command passes --target and --target-tasks on; the config picks the seeds."""
    result = improve(tmp_path, "--target", "retail", "--target-tasks", "3")
    assert result.exit_code == 0, result.output
    assert list(built[0][0].target_seeds) == list(TEST_SEEDS)[:3]


def test_rollouts_go_to_a_vllm_server_someone_runs(tmp_path, built):
    assert improve(tmp_path, "--vllm-url", "http://10.0.0.7:8000").exit_code == 0
    assert improve(tmp_path).exit_code == 0
    (given, _), (default, _) = built
    assert (given.training.backend, given.training.vllm_url) == ("vllm-server", "http://10.0.0.7:8000")
    assert (default.training.backend, default.training.vllm_url) == ("transformers", None)


def test_engine_vllm_starts_a_rollout_server_for_the_run_and_stops_it(tmp_path, built, monkeypatch):
    import trace_plugin.gateway.vllm_server

    monkeypatch.setattr(trace_plugin.gateway.vllm_server, "VLLMServer", StandInServer)
    result = improve(tmp_path, "--engine", "vllm")
    assert result.exit_code == 0, result.output
    [(config, running)] = built
    assert config.training.backend == "vllm-server" and running == {config.training.vllm_url}
    assert [server.url for server in SERVERS] == [config.training.vllm_url]
    assert not SERVERS[0].running  # stopped when the command ended


def test_engine_vllm_is_one_clear_error_without_its_environment_or_beside_a_url(tmp_path, monkeypatch):
    from trace_plugin.gateway.vllm_server import PYTHON_ENV

    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "no-python"))
    missing = improve(tmp_path, "--engine", "vllm")
    both = improve(tmp_path, "--engine", "vllm", "--vllm-url", "http://10.0.0.7:8000")
    for result, says in ((missing, "no vLLM environment"), (both, "drop --vllm-url")):
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert says in said(result.output)
