"""Targets as plugins: bundled, registered by an installed package's entry point, or named
as ``package.module:attribute``; a broken one says what is wrong with it."""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from trace_plugin.cli import app
from trace_plugin.environments import ToolCall
from trace_plugin.environments.catalog import (
    TargetError,
    UnknownEnvironment,
    env_factory,
    load_target,
    registered_targets,
)
from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv

UNITS = '''
from trace_plugin.environments import RewardBreakdown, Target, Task


class UnitsEnv:
    """Stateless unit conversions: one call, then say the number."""

    tools = [{"type": "function", "function": {"name": "units.convert", "parameters": {
        "type": "object", "properties": {"km": {"type": "number"}}, "required": ["km"]}}}]
    system_prompt = "Convert units with the tool, then say the result."

    def reset(self, seed):
        self.km, self.said = seed % 50, None
        return Task(seed, f"How many miles is {self.km} km?", "convert", {})

    def step(self, call):
        self.said = round(call.arguments.get("km", 0) * 0.621, 2)
        return str(self.said)

    @property
    def done(self):
        return False

    def reward(self, answer=""):
        return RewardBreakdown(float(str(round(self.km * 0.621, 2)) in answer))


TARGET = Target("units", UnitsEnv, range(900, 940))


def make_target():
    return TARGET


NOT_A_TARGET = UnitsEnv
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed package (module + dist-info) registering ``units`` as a target."""
    (tmp_path / "units_target.py").write_text(textwrap.dedent(UNITS))
    info = tmp_path / "units_target-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: units-target\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[trace_plugin.targets]\nunits = units_target:make_target\nbroken = units_target:missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_retail_is_bundled():
    target = load_target("retail")
    assert target.factory is RetailEnv and list(target.test_seeds) == list(TEST_SEEDS)


def test_a_registered_target_is_found_by_name_and_served_like_any_environment(plugin):
    assert {"units", "broken"} <= set(registered_targets())
    target = load_target("units")
    assert target.name == "units" and list(target.test_seeds)[:2] == [900, 901]
    env = env_factory("units")()
    task = env.reset(907)
    env.step(ToolCall("units.convert", {"km": 7}))
    assert env.reward(f"That is {round(7 * 0.621, 2)} miles.").total == 1.0 and "7 km" in task.prompt


def test_a_target_named_by_module_and_attribute(plugin):
    assert load_target("units_target:TARGET").name == "units"
    assert load_target("units_target:make_target").name == "units"  # a function returning one


@pytest.mark.parametrize(
    ("name", "error", "says"),
    [
        ("no_such_package:TARGET", TargetError, "cannot import 'no_such_package'"),
        ("units_target:nothing", TargetError, "has no 'nothing'"),
        ("units_target:NOT_A_TARGET", TargetError, "not a trace_plugin.environments.Target"),
        ("broken", TargetError, "does not load"),
        ("nowhere", UnknownEnvironment, "known: retail"),
    ],
)
def test_a_bad_target_says_what_is_wrong(plugin, name, error, says):
    with pytest.raises(error, match=says):
        load_target(name)


def test_the_cli_takes_a_registered_target(plugin, tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    listing = CliRunner().invoke(app, ["envs", "list", "--db", db])
    assert listing.exit_code == 0 and "units" in listing.output and "registered" in listing.output
    refused = CliRunner().invoke(
        app,
        ["improve", "--agent", "a", "--gateway-url", "http://127.0.0.1:9", "--adapter-root", str(tmp_path),
         "--target", "units_target:nothing", "--db", db],
    )  # fmt: skip
    assert refused.exit_code == 2 and "has no 'nothing'" in refused.output


async def evaluate_scripted(reply: str, target: str, seeds: list[int], tmp_path) -> tuple[list, list[str]]:
    """The improver's target evaluation through a gateway whose model always says ``reply``:
    the results, and every prompt the model was asked."""
    from support.backends import ScriptedBackend
    from transformers import AutoTokenizer

    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread
    from trace_plugin.improver import Improver, ImproverConfig
    from trace_plugin.improver.evaluation import chat_evaluator
    from trace_plugin.model_files import prepare_tokenizer, resolve_model
    from trace_plugin.store import Store

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))
    backend = ScriptedBackend(tokenizer, reply)
    store = Store(f"sqlite:///{tmp_path / 'gate.db'}")
    store.upgrade()
    with start_in_thread(
        create_app(backend, config=GatewayConfig(adapter_root=tmp_path, record=False))
    ) as server:
        config = ImproverConfig("a", server.url, store.url, target=target, target_seeds=seeds)
        results = await chat_evaluator(Improver(store, config), "base", seeds)
    return results, backend.prompts


async def test_the_improvers_gate_evaluates_a_registered_target(plugin, tmp_path):
    """The improver's target evaluation (what its gate compares) plays the plugin's held-out
    tasks through the gateway, here a scripted model that answers with the right number."""
    from trace_plugin.improver.evaluation import summary

    reply = f"That is {round(900 % 50 * 0.621, 2)} miles."
    results, _ = await evaluate_scripted(reply, "units", [900, 901], tmp_path)
    assert [(r.seed, r.kind) for r in results] == [(900, "convert"), (901, "convert")]
    assert summary(results).success == 0.5  # the scripted answer is right for 900 only


async def test_the_target_evaluation_gives_the_agent_the_horizon_its_target_states(tmp_path, monkeypatch):
    """A model that always calls a tool plays exactly the target's turns, not the evaluator's 8."""
    import dataclasses

    from trace_plugin.environments import catalog

    retail = dataclasses.replace(catalog.BUNDLED["retail"], max_turns=3)
    monkeypatch.setitem(catalog.BUNDLED, "retail", retail)
    call = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>'
    _, prompts = await evaluate_scripted(call, "retail", [10_000, 10_001], tmp_path)
    assert len(prompts) == 2 * 3
