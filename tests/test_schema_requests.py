"""Environments for agents nobody here wrote: synthesis from any JSON schema, tools per task."""

from __future__ import annotations

import json
import random

import pytest
from support.schemas import TOOLS, function

from trace_plugin.environments.base import ToolCall, offered_tools
from trace_plugin.environments.interpreter import SpecEnv, argument_credit
from trace_plugin.environments.synthesis import Observations, synthesize
from trace_plugin.environments.validation import check_policies, made_up
from trace_plugin.mining.kinds import KINDS
from trace_plugin.records.env_spec import SpecError, parse_spec


def test_any_schema_synthesizes_an_environment_that_passes_validation():
    spec = synthesize("tool_call_format", TOOLS, system_prompt="You are a helpful assistant.")
    assert {t.name for t in spec.tools} == {t["function"]["name"] for t in TOOLS}
    assert all(t.behaviour == "respond" for t in spec.tools) and not spec.tables  # no invented tables
    assert {t.schema_["function"]["name"]: t.schema_ for t in spec.tools} == {
        t["function"]["name"]: t for t in TOOLS
    }  # the schemas unchanged
    kinds = {t.kind for t in spec.tasks}
    assert {"call_circle_area", "call_convert_currency", "two_calls", "no_call"} <= kinds
    check = check_policies(spec, range(300))
    assert check.passed, check.problems
    assert check.reference_success == 1.0 and check.do_nothing_mean <= 0.2 and check.random_mean <= 0.2
    assert parse_spec(spec.to_json()) == spec  # typed pools survive JSON


def test_requests_state_values_of_the_right_type_within_enums_ranges_and_formats():
    env = SpecEnv(synthesize("tool_selection", TOOLS, system_prompt="Help."))
    by_tool: dict[str, list[dict]] = {}
    for seed in range(200):
        task = env.reset(seed)
        for call in task.metadata["reference"]:
            by_tool.setdefault(call["name"], []).append(call["arguments"])
            for value in _leaves(call["arguments"]):
                assert str(value) in task.prompt  # every value is stated in the request
    for arguments in by_tool["geometry.circleArea"]:
        assert isinstance(arguments["radius"], float | int) and 0.5 <= arguments["radius"] <= 20
        assert arguments["units"] in ("cm", "m")  # the first optional parameter, stated
    for arguments in by_tool["convertCurrency"]:
        assert isinstance(arguments["amount"], int) and 1 <= arguments["amount"] <= 5000
        assert arguments["from"] in ("USD", "EUR", "JPY") and isinstance(arguments["rounded"], bool)
    for arguments in by_tool["legal.search_cases"]:
        assert arguments["filters"]["court"] in ("supreme", "appeals")
        assert len(arguments["filters"]["after"]) == 10 and arguments["filters"]["after"][4] == "-"
        assert isinstance(arguments["tags"], list) and isinstance(arguments["query"], str)


def test_observed_values_fill_free_strings():
    observed = Observations.from_calls([({"city": "Lisbon"}, {}), ({"city": "Oslo"}, {})])
    env = SpecEnv(synthesize("tool_call_format", TOOLS[3:], system_prompt="Help.", observations=observed))
    references = [env.reset(s).metadata["reference"] for s in range(40)]
    cities = {r[0]["arguments"]["city"] for r in references if r}
    assert cities <= {"Lisbon", "Oslo"} and cities


def test_each_task_offers_its_own_tools_and_only_those_can_be_called():
    env = SpecEnv(synthesize("tool_selection", TOOLS, system_prompt="Help."))
    offered_sets = set()
    for seed in range(60):
        task = env.reset(seed)
        names = [t["function"]["name"] for t in offered_tools(env, task)]
        offered_sets.add(tuple(sorted(names)))
        assert 1 <= len(names) <= 3 and {r["name"] for r in task.metadata["reference"]} <= set(names)
        assert set(task.metadata["forbidden"]) <= set(names)  # distractors are offered and forbidden
        outside = next(t["function"]["name"] for t in TOOLS if t["function"]["name"] not in names)
        assert "unknown tool" in env.step(ToolCall(outside, {}))
    assert len(offered_sets) > 2  # the tool set differs per request


def test_the_reward_gives_partial_credit_per_argument_and_nothing_for_invented_ones():
    env = SpecEnv(synthesize("tool_call_format", TOOLS, system_prompt="Help."))
    seed = next(s for s in range(100) if env.reset(s).kind == "call_convert_currency")
    task = env.reset(seed)
    [call] = task.metadata["reference"]
    wanted = call["arguments"]
    env.step(ToolCall(call["name"], {**wanted, "amount": str(wanted["amount"])}))  # one value mistyped
    partial = env.reward("done").total
    assert 0.0 < partial < 1.0
    env.reset(seed)
    answer = json.loads(env.step(ToolCall(call["name"], wanted)))["result"]
    assert task.metadata["facts"] == [answer]  # the call's answer is what the user must be told
    assert env.reward(f"It comes to {answer}.").total == 1.0
    assert env.reward("done").total < 1.0
    assert argument_credit({**wanted, "extra": 1}, wanted) == len(wanted) / (len(wanted) + 1)
    assert argument_credit({"amount": 7.0}, {"amount": 7}) == 1.0  # a whole float is its integer
    env.reset(seed)
    distractor = task.metadata["forbidden"][0]
    env.step(ToolCall(distractor, {}))
    assert env.reward("done").total == 0.0  # the wrong tool earns nothing


def test_when_no_tool_fits_the_right_answer_is_no_call():
    env = SpecEnv(synthesize("tool_selection", TOOLS, system_prompt="Help."))
    seed = next(s for s in range(300) if env.reset(s).kind == "no_call")
    task = env.reset(seed)
    assert task.metadata["reference"] == [] and task.tools
    assert env.reward("Hello! I am an assistant.").total == 1.0
    tool = task.tools[0]["function"]
    env.step(ToolCall(tool["name"], made_up(tool["parameters"], random.Random(0))))
    assert env.reward("Hello!").total == 0.0


@pytest.mark.parametrize("capability", sorted(KINDS))
def test_every_selectable_capability_has_an_environment_on_stateless_tools(capability):
    spec = synthesize(capability, TOOLS, system_prompt="Help.")
    assert check_policies(spec, range(100)).passed


def test_a_tool_set_with_nothing_to_call_is_a_clear_spec_error():
    not_an_object = {"type": "function", "function": {"name": "bad", "parameters": {"type": "array"}}}
    with pytest.raises(SpecError, match="nothing to exercise"):
        synthesize("tool_selection", [not_an_object], system_prompt="Help.")


def test_a_template_must_offer_what_its_reference_calls():
    data = json.loads(synthesize("tool_call_format", TOOLS, system_prompt="Help.").to_json())
    call = next(t for t in data["tasks"] if t["kind"] == "call_circle_area")
    call["tools"] = ["weather.now"]
    with pytest.raises(SpecError, match="does not offer"):
        parse_spec(data)
    call["tools"] = ["os.system"]
    with pytest.raises(SpecError, match="offers missing tool"):
        parse_spec(data)


def _leaves(value):
    if isinstance(value, dict):
        for inner in value.values():
            yield from _leaves(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _leaves(inner)
    else:
        yield value


# -- the tools of each task, where agents meet them: the runner and gateway, MCP ---------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))


def _names(tools) -> set[str]:
    return {t["function"]["name"] for t in tools}


async def test_the_runner_offers_each_task_its_own_tools_through_the_gateway(tokenizer, local_recorder):
    from support.backends import ScriptedBackend

    from trace_plugin.environments.runner import ChatLoopAgent, Runner
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")
    seeds = list(range(6))
    backend = ScriptedBackend(tokenizer, "I cannot help with that.")
    with start_in_thread(create_app(backend, config=GatewayConfig(record=False))) as server:
        agent = ChatLoopAgent(server.url + "/v1", "scripted", max_turns=1, recorder=local_recorder)
        results = await Runner(lambda: SpecEnv(spec), agent, concurrency=1, recorder=local_recorder).run(
            seeds
        )
    assert local_recorder.flush(10)
    everything = _names(TOOLS)
    for seed, result, prompt in zip(seeds, results, backend.prompts, strict=True):
        offered = _names(SpecEnv(spec).reset(seed).tools)
        assert all(f'"{name}"' in prompt for name in offered)  # the gateway rendered these
        assert not any(f'"{name}"' in prompt for name in everything - offered)  # and only these
        [llm] = [s for s in local_recorder.store.get_episode(result.episode_id).steps if s.kind == "llm"]
        assert set(llm.input["tools"]) == offered


async def test_a_langgraph_agent_receives_the_tasks_tools_in_its_input(local_recorder):
    from trace_plugin.environments.runner import LangGraphAgent, Runner

    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")
    seen: dict[int, set[str]] = {}

    class Graph:
        def __init__(self, env):
            self.env = env

        async def ainvoke(self, inputs, config):
            seen[config["metadata"]["task_seed"]] = _names(inputs["tools"])
            return {"messages": [AIMessageLike("")]}

    await Runner(lambda: SpecEnv(spec), LangGraphAgent(Graph), recorder=local_recorder).run([0, 1, 2])
    assert seen == {seed: _names(SpecEnv(spec).reset(seed).tools) for seed in (0, 1, 2)}


class AIMessageLike:
    def __init__(self, content: str) -> None:
        self.content = content


@pytest.mark.slow
async def test_mcp_sessions_list_their_tasks_tools_and_hear_when_they_change(tmp_path):
    import os
    import sys

    import mcp.types as types
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from trace_plugin import Store

    db = f"sqlite:///{tmp_path / 'env.db'}"
    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")
    store = Store(db)
    store.upgrade()
    store.save_env_spec("fn-agent", spec, "validated", {})
    changed: list[str] = []

    async def on_message(message) -> None:
        if isinstance(message, types.ServerNotification) and isinstance(
            message.root, types.ToolListChangedNotification
        ):
            changed.append(message.root.method)

    command = [sys.executable, "-m", "trace_plugin", "envs", "serve", spec.name]
    params = StdioServerParameters(
        command=command[0], args=command[1:], env={**os.environ, "TRACE_PLUGIN_DB_URL": db}
    )
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, message_handler=on_message) as session,
    ):
        initialized = await session.initialize()
        assert initialized.capabilities.tools.listChanged
        before = {t.name for t in (await session.list_tools()).tools}
        assert before == _names(TOOLS) | {"env_reset", "env_reward"}
        seed = next(s for s in range(50) if len(SpecEnv(spec).reset(s).tools) < len(TOOLS))
        reset = (await session.call_tool("env_reset", {"seed": seed})).structuredContent
        offered = _names(SpecEnv(spec).reset(seed).tools)
        assert set(reset["tools"]) == offered
        after = {t.name for t in (await session.list_tools()).tools}
        assert after == offered | {"env_reset", "env_reward"} and changed
        outside = next(iter(_names(TOOLS) - offered))
        result = await session.call_tool(outside, {})
        assert result.isError


async def test_calibration_returns_the_spec_it_measured_and_never_only_no_call_requests():
    from trace_plugin.environments.validation import Band, adjust, calibrate, check_policies

    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")

    async def never_calls(env: SpecEnv, seed: int) -> float:  # a new deployment's base model
        return env.reward("I think it is about 12.").total

    calibrated, report = await calibrate(spec, never_calls, seeds=range(8), samples=2, band=Band(attempts=1))
    assert calibrated == spec and len(report.attempts) == 1  # one attempt: nothing adjusted after it
    # It says why, and of the base model: the warm-started expert GRPO trains may be in band.
    assert report.verdict.startswith("out of the base model's band after 1 attempt(s): mean reward")
    assert "too few groups differ for GRPO to learn from" in report.to_dict()["verdict"]
    easier = spec
    while (step := adjust(easier, 0.0)) is not None:
        easier = step
        assert any(t.reference for t in easier.tasks)  # easier keeps requests that need a call
    # One template fewer would leave no-call requests a third of the tickets: doing nothing
    # would average 0.34, so easing stops before it.
    assert {t.kind for t in easier.tasks} == {"call_circle_area", "call_convert_currency", "no_call"}
    assert check_policies(easier).passed


def test_the_easier_knob_names_the_tools_to_call_in_the_request():
    from trace_plugin.environments.validation import adjust

    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")
    easier = adjust(spec, 0.0)
    assert easier is not None and easier.difficulty.name_tools and easier.tasks == spec.tasks
    seed = next(s for s in range(50) if SpecEnv(spec).reset(s).kind == "call_convert_currency")
    assert SpecEnv(easier).reset(seed).prompt == SpecEnv(spec).reset(seed).prompt + " Use convertCurrency."
    assert check_policies(easier, range(100)).passed
    # Back when too easy: the tools named in half the tickets, then in none (the headline's
    # experts met the whole step at once and succeeded in no rollout after it).
    half = adjust(easier, 0.95)
    assert half is not None and half.difficulty.name_tools == 0.5
    assert adjust(half, 0.95).difficulty.name_tools == 0.0
    prompts = [(SpecEnv(spec).reset(s).prompt, SpecEnv(half).reset(s).prompt) for s in range(200)]
    named = [(plain, hard) for plain, hard in prompts if hard != plain]
    assert 0.35 < len(named) / len(prompts) < 0.65  # the seed decides which
    assert all(hard.startswith(plain + " Use ") for plain, hard in named)
    assert [p for p, _ in prompts] == [SpecEnv(spec).reset(s).prompt for s in range(200)]  # values unchanged


def test_tools_with_many_arguments_still_synthesize_within_the_spec_limits():
    wide = [
        function(f"api.op{i}", {f"a{j}": {"type": "string"} for j in range(5)}, [f"a{j}" for j in range(5)])
        for i in range(3)
    ]
    spec = synthesize("tool_call_format", wide, system_prompt="Help.")  # two calls would need 10 values
    assert "two_calls" not in {t.kind for t in spec.tasks} and check_policies(spec, range(50)).passed


def test_requests_are_worded_as_the_tools_users_worded_them_with_other_values():
    """The generic family's requests paraphrased the tool's description and dictated every
    argument ("Use amount: 57; from: USD"), which no user does: reading the values out of
    plain phrasing is the task. Where traffic shows a request one call answered, tickets
    take its wording with other values in it."""
    from trace_plugin.environments.synthesis import observed_phrasings
    from trace_plugin.mining.detectors import Call, Trajectory

    asked = Trajectory(
        "How much is 120 USD in EUR these days?",
        [Call("convertCurrency", {"amount": 120, "from": "USD", "to": "EUR"}, "{}")],
    )
    twice = Trajectory(
        "Convert 7 USD to JPY and 7 EUR to JPY.",
        [Call("convertCurrency", {"amount": 7, "from": "USD", "to": "JPY"})],
    )
    phrasings = observed_phrasings([asked, twice, asked])
    assert phrasings == {
        "convertCurrency": ["How much is {amount} {from} in {to} these days?"]
    }  # 7 stated twice
    spec = synthesize(
        "tool_call_format", TOOLS, system_prompt="Help.", observations=Observations(phrasings=phrasings)
    )
    [template] = [t for t in spec.tasks if t.kind == "call_convert_currency"]
    assert "Use " not in template.prompt and template.prompt.startswith("How much is {p")
    env = SpecEnv(spec)
    for seed in range(40):
        task = env.reset(seed)
        if task.kind != "call_convert_currency":
            continue
        (call,) = task.metadata["reference"]
        assert set(call["arguments"]) == {"amount", "from", "to"}  # exactly what the wording states
        assert f"How much is {call['arguments']['amount']} {call['arguments']['from']} in " in task.prompt
    assert check_policies(spec, range(200)).passed
    dictated = synthesize("tool_call_format", TOOLS, system_prompt="Help.")
    assert "Use " in next(t.prompt for t in dictated.tasks if t.kind == "call_convert_currency")
