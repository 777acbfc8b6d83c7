"""The runner: agents through environment tasks, each episode recorded with its reward."""

from __future__ import annotations

import json

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage

import trace_plugin
from integrations.scripted_chat_model import ScriptedChatModel
from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.runner import (
    ChatLoopAgent,
    LangGraphAgent,
    Runner,
    do_nothing_baseline,
    summarize,
)

SEEDS = list(TRAIN_SEEDS)[:16]


def oracle_graph(env: RetailEnv, recorder):
    """A LangGraph agent whose scripted model replays the task's reference actions."""
    from examples.support_agent.agent import environment_tools

    reference, facts = env.task.metadata["reference"], env.task.metadata["facts"]

    def policy(messages):
        done = sum(1 for m in messages if m.type == "tool")
        if done < len(reference):
            call = reference[done]
            return AIMessage(
                "", tool_calls=[{"id": f"c{done}", "name": call["name"], "args": call["arguments"]}]
            )
        return AIMessage("All set. " + " ".join(facts))

    graph = create_agent(
        ScriptedChatModel(policy=policy), environment_tools(env), system_prompt=env.system_prompt
    )
    return trace_plugin.capture(agent="oracle", recorder=recorder)(graph)


async def test_runner_records_each_episode_with_its_reward(local_recorder):
    runner = Runner(
        RetailEnv,
        LangGraphAgent(lambda env: oracle_graph(env, local_recorder)),
        concurrency=4,
        recorder=local_recorder,
    )
    results = await runner.run(SEEDS)
    assert [r.seed for r in results] == SEEDS
    assert all(r.reward.total == 1.0 and r.error is None for r in results)
    assert local_recorder.flush(10)
    stats = {s.agent: s for s in local_recorder.store.stats()}["oracle"]
    assert (stats.episodes, stats.successes) == (len(SEEDS), len(SEEDS))
    episode = local_recorder.store.get_episode(results[0].episode_id)
    assert episode.label == "success" and episode.metadata["task_seed"] == SEEDS[0]
    [feedback] = local_recorder.store.feedback_for(results[0].episode_id)
    assert feedback.source == "environment" and json.loads(feedback.comment) == {"state": 1.0, "facts": 1.0}
    tool_names = [s.name for s in episode.steps if s.kind == "tool"]
    assert tool_names == [c["name"] for c in RetailEnv().reset(SEEDS[0]).metadata["reference"]]


def test_summary_and_do_nothing_baseline():
    baseline = do_nothing_baseline(RetailEnv, list(TRAIN_SEEDS))
    rate = sum(r.reward.total for r in baseline) / len(baseline)
    assert 0.2 < rate < 0.3  # the two refusal kinds out of eight
    table = summarize(baseline)
    assert table.row_count == 9  # eight kinds and "all"


async def test_a_crashing_agent_is_a_failed_result_not_a_crash(local_recorder):
    class Broken:
        async def solve(self, env, task, episode_id):
            raise RuntimeError("agent fell over")

    [result] = await Runner(RetailEnv, Broken(), recorder=local_recorder).run([1])
    assert "agent fell over" in result.error and result.reward.total in (0.0, 1.0)


async def test_a_looping_langgraph_agent_is_cut_off_after_max_turns(local_recorder):
    def build(env):
        def policy(messages):  # asks for the same order forever
            n = sum(1 for m in messages if m.type == "tool")
            return AIMessage(
                "", tool_calls=[{"id": f"c{n}", "name": "get_order", "args": {"order_id": "#W1"}}]
            )

        graph = create_agent(ScriptedChatModel(policy=policy), environment_tools(env), system_prompt="")
        return trace_plugin.capture(agent="looper", recorder=local_recorder)(graph)

    from examples.support_agent.agent import environment_tools

    [result] = await Runner(RetailEnv, LangGraphAgent(build, max_turns=3), recorder=local_recorder).run([1])
    assert "GraphRecursionError" in result.error and result.reward.total < 1.0
    assert local_recorder.flush(10)
    episode = local_recorder.store.get_episode(result.episode_id)
    assert [s.name for s in episode.steps if s.kind == "tool"] == ["get_order"] * 3


@pytest.mark.slow
async def test_chat_loop_agent_against_the_gateway(embedded_backend, local_recorder):
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as server:
        agent = ChatLoopAgent(
            server.url + "/v1", embedded_backend.model_id, max_turns=3, max_tokens=48, recorder=local_recorder
        )
        results = await Runner(RetailEnv, agent, recorder=local_recorder).run(SEEDS[:2])
    assert all(r.error is None for r in results)
    assert local_recorder.flush(10)
    for r in results:
        episode = local_recorder.store.get_episode(r.episode_id)
        assert episode.source == "runner" and episode.reward == r.reward.total
        assert episode.steps[0].kind == "llm" and episode.steps[0].input["tools"][0] == "find_user"


async def test_a_call_through_a_recording_gateway_is_one_episode_the_runners(local_recorder):
    """The chat loop records its own episodes and tells the gateway so: the same call is not
    stored a second time as a ``gateway`` episode. A client that says nothing is recorded."""
    import httpx
    from support.backends import ScriptedBackend
    from transformers import AutoTokenizer

    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread
    from trace_plugin.model_files import prepare_tokenizer, resolve_model

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))
    app = create_app(ScriptedBackend(tokenizer, "Done."), config=GatewayConfig(), recorder=local_recorder)
    with start_in_thread(app) as server:
        agent = ChatLoopAgent(server.url + "/v1", "scripted", agent="loop", recorder=local_recorder)
        [result] = await Runner(RetailEnv, agent, recorder=local_recorder).run(SEEDS[:1])
        body = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert local_recorder.flush(10)
    agents = {s.agent: s.episodes for s in local_recorder.store.stats()}
    assert agents == {"loop": 1, "gateway": 1}  # the loop's call once, the plain client's once
    assert [s.kind for s in local_recorder.store.get_episode(result.episode_id).steps] == ["llm"]
