"""From mined capability to a validated, calibrated environment served over MCP."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from support.mcp_sessions import stdio_session
from typer.testing import CliRunner

from trace_plugin.cli import app
from trace_plugin.environments.catalog import chat_player, env_factory, prepare_environment
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import RetailEnv
from trace_plugin.environments.validation import Band
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.records.env_spec import Check

COLUMNS = {"COLUMNS": "200"}


async def test_a_mined_capability_becomes_an_environment_served_over_mcp(planted):
    runner, db = CliRunner(), planted.url
    command = ["synthesize", "argument_grounding", "--agent", "planted", "--no-calibrate", "--db", db]
    result = await asyncio.to_thread(runner.invoke, app, command, env=COLUMNS)  # the CLI runs its own loop
    assert result.exit_code == 0 and "validated" in result.output, result.output
    record = planted.env_spec("argument_grounding-env")
    assert record is not None and record.version == 1 and record.status == "validated"
    captured = {t["function"]["name"]: t for t in planted.tool_schemas("planted")}
    assert all(captured[t.name] == t.schema_ for t in record.spec.tools)  # the schemas the agent was given
    user_id = record.spec.tables["user"].columns["user_id"].pattern
    assert "{d4}" in user_id and "_" in user_id  # the observed format (ava_lopez_1234), not the default
    assert record.spec.system_prompt == RetailEnv.system_prompt  # the target's own, from its LLM steps

    listed = runner.invoke(app, ["envs", "list", "--db", db], env=COLUMNS)
    assert (
        listed.exit_code == 0 and "argument_grounding-env" in listed.output and "validated" in listed.output
    )
    validated = runner.invoke(
        app, ["envs", "validate", "argument_grounding-env", "--seeds", "40", "--db", db]
    )
    assert validated.exit_code == 0 and "valid" in validated.output
    shown = runner.invoke(app, ["envs", "show", "argument_grounding-env", "--db", db], env=COLUMNS)
    assert shown.exit_code == 0 and "find_user" in shown.output and "reference" in shown.output
    missing = runner.invoke(app, ["synthesize", "no_such_capability", "--agent", "planted", "--db", db])
    assert missing.exit_code != 0

    local = env_factory("argument_grounding-env", planted)()
    assert isinstance(local, SpecEnv)
    task = local.reset(11)
    env = {**os.environ, "TRACE_PLUGIN_DB_URL": db}
    async with stdio_session(
        sys.executable, "-m", "trace_plugin", "envs", "serve", "argument_grounding-env", env=env
    ) as session:
        names = {t.name for t in (await session.list_tools()).tools}
        assert names == {"find_user", "get_user", "env_reset", "env_reward"}
        served = (await session.call_tool("env_reset", {"seed": 11})).structuredContent
        assert served["prompt"] == task.prompt
        for call in task.metadata["reference"]:
            assert not (await session.call_tool(call["name"], call["arguments"])).isError
        answer = " ".join(map(str, task.metadata["facts"]))
        reward = (await session.call_tool("env_reward", {"answer": answer})).structuredContent
    assert reward["total"] == 1.0


async def test_a_broken_reward_is_rejected_and_stored_with_its_reasons(planted, monkeypatch):
    from trace_plugin.environments import catalog

    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    real = catalog.synthesize

    def backwards(*args, **kwargs):  # rewards an order its own reference cannot follow
        spec = real(*args, **kwargs)
        check = Check(kind="order", before="get_user", after="find_user")
        return spec.model_copy(update={"checks": [check]})

    monkeypatch.setattr(catalog, "synthesize", backwards)
    record = await prepare_environment(planted, "planted", capability)
    assert record.status == "rejected" and planted.env_spec("argument_grounding-env").status == "rejected"
    # The family's spec, then the generic one it fell back to: both broken, both reported.
    assert any("reference succeeds on 0%" in p for p in record.report["fallback"]["family_problems"])
    assert any("reference succeeds on" in p for p in record.report["policies"]["problems"])


async def test_a_family_spec_rejected_by_its_policy_check_falls_back_to_the_generic_family(
    planted, monkeypatch
):
    from trace_plugin.environments import catalog
    from trace_plugin.environments.synthesis import is_generic

    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    real = catalog.synthesize

    def broken_family(*args, generic=False, **kwargs):  # only the family's spec is broken
        spec = real(*args, generic=generic, **kwargs)
        check = Check(kind="order", before="get_user", after="find_user")
        return spec if generic else spec.model_copy(update={"checks": [check]})

    monkeypatch.setattr(catalog, "synthesize", broken_family)
    record = await prepare_environment(planted, "planted", capability)
    assert record.status == "validated" and is_generic(record.spec)
    assert record.report["fallback"]["to"] == "generic"
    assert any("reference succeeds on 0%" in p for p in record.report["fallback"]["family_problems"])
    assert not record.report["policies"]["problems"]


async def test_a_spec_exercises_the_tools_the_failing_traffic_called_first_and_says_how_many(planted):
    """The generic family exercises at most MAX_CALLED tools: an agent with more than that
    trains on the ones its failures called, not on the first ones it happens to list."""
    from dataclasses import replace

    from trace_plugin.environments.schema_requests import MAX_CALLED

    def tool(name: str) -> dict:
        parameters = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    listed = [tool(f"misc.tool{i}") for i in range(MAX_CALLED)] + [tool("units.convert"), tool("rates.fetch")]
    planted.tool_schemas = lambda agent: listed
    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    failing = replace(capability, tools=["rates.fetch", "units.convert"])
    record = await prepare_environment(planted, "planted", failing)
    names = [t.name for t in record.spec.tools]
    assert len(names) == MAX_CALLED and {"units.convert", "rates.fetch"} <= set(names)
    assert record.report["tools"] == {"exercised": MAX_CALLED, "offered": MAX_CALLED + 2}


async def test_a_rejected_llm_proposal_leaves_the_offline_spec_and_is_reported(planted):
    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    answers = iter(["not json", '{"name": "x"}', "```json\n{}\n```"])
    record = await prepare_environment(
        planted, "planted", capability, propose_with=lambda messages, schema: next(answers)
    )
    assert record.status == "validated" and record.spec.name == "argument_grounding-env"
    assert record.report["proposal"]["accepted"] is False and len(record.report["proposal"]["problems"]) == 3


async def test_calibration_plays_the_seeds_and_samples_it_is_given(planted):
    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    played: list[int] = []

    async def play(env: SpecEnv, seed: int) -> float:
        played.append(seed)
        return 0.0

    record = await prepare_environment(
        planted, "planted", capability, play=play, seeds=range(7, 10), samples=2, band=Band(attempts=1)
    )
    assert sorted(played) == [7, 7, 8, 8, 9, 9]  # not calibrate's own default of 8 seeds x 4
    [attempt] = record.report["calibration"]["attempts"]
    assert record.status == "out_of_band" and attempt["mean_reward"] == 0.0


@pytest.mark.slow
async def test_calibration_with_the_real_base_model(planted, local_recorder, embedded_backend):
    [capability] = [c for c in planted.capabilities("planted") if c.name == "argument_grounding"]
    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as server:
        play = chat_player(
            f"{server.url}/v1",
            "base",
            agent="calibration",
            max_tokens=64,
            max_turns=3,
            recorder=local_recorder,
        )
        record = await prepare_environment(
            planted, "planted", capability, play=play, seeds=range(2), samples=2, band=Band(attempts=2)
        )
    attempts = record.report["calibration"]["attempts"]
    assert 1 <= len(attempts) <= 2
    assert all(0.0 <= a["mean_reward"] <= 1.0 and 0.0 <= a["informative"] <= 1.0 for a in attempts)
    assert record.status == ("validated" if record.report["calibration"]["in_band"] else "out_of_band")
    assert local_recorder.flush(20)
    calibration_episodes = planted.list_episodes("calibration")
    assert len(calibration_episodes) == 2 * 2 * len(attempts)  # every sample played was recorded
