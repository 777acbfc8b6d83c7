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


def test_the_command_takes_the_targets_seeds_by_the_configs_rule(tmp_path, monkeypatch):
    """The command passes --target and --target-tasks on; the config picks the seeds."""
    import trace_plugin.improver
    import trace_plugin.recorder

    built = []

    class Recording:
        def __init__(self, store, config, **_):
            built.append(config)

        def run_once(self):
            return None

    monkeypatch.setattr(trace_plugin.improver, "Improver", Recording)
    monkeypatch.setattr(trace_plugin.recorder, "configure", lambda db: None)
    result = improve(tmp_path, "--target", "retail", "--target-tasks", "3")
    assert result.exit_code == 0, result.output
    assert list(built[0].target_seeds) == list(TEST_SEEDS)[:3]
