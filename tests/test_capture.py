"""The capture decorator on real LangGraph agents: what is recorded, and how."""

from __future__ import annotations

import asyncio
import threading

import pytest
from agents import build, last_text, model_for, user

import trace_plugin
from trace_plugin import Recorder

KINDS = ["create_agent", "create_react_agent"]


def episodes_of(rec: Recorder, agent: str | None = None):
    assert rec.flush(10)
    return [rec.store.get_episode(e.id) for e in rec.store.list_episodes(agent, limit=1000)]


def tool_steps(episode):
    return [s for s in episode.steps if s.kind == "tool"]


@pytest.mark.parametrize("kind", KINDS)
def test_invoke_records_one_episode_with_ordered_steps(kind, recorder):
    model = model_for(("get_order", {"order_id": "O-17"}), ("find_user", {"email": "ann@x.io"}))
    graph = trace_plugin.capture(agent="support", recorder=recorder)(build(kind, model))

    state = graph.invoke(user("where is O-17?"))

    [episode] = episodes_of(recorder)
    assert episode.agent == "support" and episode.status == "completed"
    assert episode.source == "langgraph" and episode.model == "scripted"
    seqs = [s.seq for s in episode.steps]  # start order; a node that only repeats its steps has none
    assert seqs == sorted(set(seqs))
    kinds = [s.kind for s in episode.steps]
    # The agent's model and tools nodes update the state with what their steps returned: no node steps.
    assert sorted(kinds) == ["llm", "llm", "tool", "tool"]
    first_llm = next(s for s in episode.steps if s.kind == "llm")
    assert first_llm.input["messages"] == [{"role": "user", "content": "where is O-17?"}]
    assert first_llm.input["tools"][:2] == ["get_order", "find_user"]
    assert [c["function"]["name"] for c in first_llm.output["tool_calls"]] == ["get_order", "find_user"]
    assert first_llm.prompt_tokens is not None and first_llm.latency_ms >= 0
    # The final state is recorded in OpenAI message format.
    assert episode.output["messages"][-1] == {"role": "assistant", "content": last_text(state)}
    assert {t["function"]["name"] for t in recorder.store.tool_schemas("support")} >= {
        "get_order",
        "find_user",
    }


def test_a_node_step_is_kept_when_its_update_says_more_than_its_model_step(local_recorder):
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    class State(MessagesState):
        note: str

    model = model_for()  # answers at once

    def plan(state: State) -> dict:  # its model's reply, and a key of its own
        return {"messages": [model.invoke(state["messages"])], "note": "planned"}

    def wrap(state: State) -> dict:  # only its model's reply: the LLM step is its record
        return {"messages": [model.invoke(state["messages"])]}

    def greet(state: State) -> dict:  # a message no step of its own returned
        return {"messages": [AIMessage("hello")]}

    graph = StateGraph(State)
    for name, node in (("plan", plan), ("wrap", wrap), ("greet", greet)):
        graph.add_node(name, node)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "wrap")
    graph.add_edge("wrap", "greet")
    graph.add_edge("greet", END)
    trace_plugin.capture(agent="nodes", recorder=local_recorder)(graph.compile()).invoke(user("hi"))

    [episode] = episodes_of(local_recorder, "nodes")
    # In start order; "wrap" took number 2 and has no step: its LLM step (3) is its record.
    assert [(s.seq, s.kind, s.name) for s in episode.steps] == [
        (0, "node", "plan"),
        (1, "llm", "scripted"),
        (3, "llm", "scripted"),
        (4, "node", "greet"),
    ]
    plan_step, plan_llm, _, greet_step = episode.steps
    assert plan_step.output["note"] == "planned" and plan_step.output["messages"] == [plan_llm.output]
    assert plan_llm.parent_run_id == plan_step.run_id
    assert greet_step.output == {"messages": [{"role": "assistant", "content": "hello"}]}


def test_parallel_tool_calls_are_paired_by_call_id_not_position(local_recorder):
    calls = [("get_order", {"order_id": f"O-{i}"}) for i in range(6)]
    graph = trace_plugin.capture(agent="par", recorder=local_recorder)(
        build("create_react_agent", model_for(*calls))
    )
    graph.invoke(user("check six orders"))

    [episode] = episodes_of(local_recorder)
    tools = tool_steps(episode)
    assert len(tools) == 6
    for step in tools:  # each result belongs to the call whose id it carries, in whatever order they ran
        index = int(step.tool_call_id.rsplit("_", 1)[1])
        assert step.input == {"order_id": f"O-{index}"}
        assert step.output == f"order O-{index} is pending"
    assert len({s.run_id for s in tools}) == 6


def test_llm_called_inside_a_tool_belongs_to_the_same_episode(local_recorder):
    graph = trace_plugin.capture(agent="nested", recorder=local_recorder)(
        build("create_agent", model_for(("summarize", {"order_id": "O-9"})))
    )
    graph.invoke(user("summarize O-9"))

    [episode] = episodes_of(local_recorder)
    [tool] = tool_steps(episode)
    inner = [s for s in episode.steps if s.kind == "llm" and s.name == "summarizer"]
    assert len(inner) == 1
    assert inner[0].parent_run_id == tool.run_id and inner[0].seq > tool.seq
    assert tool.output == "summary: all good"


def test_tool_errors_are_recorded_raised_and_handled(local_recorder):
    from agents import TOOLS
    from langgraph.prebuilt import ToolNode

    model = model_for(("broken", {"order_id": "O-1"}), ("refuse", {"order_id": "O-2"}))
    tools = ToolNode(TOOLS, handle_tool_errors=True)  # the agent turns errors into messages
    graph = trace_plugin.capture(agent="errors", recorder=local_recorder)(
        build("create_react_agent", model, tools)
    )
    graph.invoke(user("cancel both"))

    [episode] = episodes_of(local_recorder)
    by_name = {s.name: s for s in tool_steps(episode)}
    assert "RuntimeError: database exploded on O-1" in by_name["broken"].error
    assert by_name["refuse"].error == "order O-2 cannot be cancelled"
    assert by_name["refuse"].tool_call_id == "call_1_1"
    assert episode.status == "completed"  # the agent itself survived both


def test_unhandled_tool_error_fails_the_episode(local_recorder):
    graph = trace_plugin.capture(agent="errors", recorder=local_recorder)(
        build("create_agent", model_for(("broken", {"order_id": "O-1"})))
    )
    with pytest.raises(RuntimeError, match="database exploded"):
        graph.invoke(user("cancel"))
    [episode] = episodes_of(local_recorder)
    assert episode.status == "error" and "database exploded on O-1" in episode.error
    assert "database exploded on O-1" in tool_steps(episode)[0].error


def test_graph_exception_marks_episode_error_and_still_raises(local_recorder):
    from integrations.scripted_chat_model import ScriptedChatModel

    def explode(messages):
        raise ValueError("model backend down")

    graph = trace_plugin.capture(agent="crash", recorder=local_recorder)(
        build("create_agent", ScriptedChatModel(policy=explode))
    )
    with pytest.raises(ValueError, match="model backend down"):
        graph.invoke(user("hi"))
    [episode] = episodes_of(local_recorder)
    assert episode.status == "error" and "model backend down" in episode.error
    [llm] = [s for s in episode.steps if s.kind == "llm"]
    assert "model backend down" in llm.error


def test_episode_id_inside_run_callback_feedback_and_reward(local_recorder):
    seen: list[str] = []
    graph = trace_plugin.capture(
        agent="ids",
        recorder=local_recorder,
        on_episode=seen.append,
        reward=lambda state: "pending" in state["messages"][-1].content,
    )(build("create_agent", model_for(("whoami", {}), ("get_order", {"order_id": "O-1"}))))

    state = graph.invoke(user("who am i"))
    inside = state["messages"][-3].content  # the whoami tool's result
    assert seen == [inside]
    [episode] = episodes_of(local_recorder)
    assert episode.id == inside and episode.reward == 1.0

    trace_plugin.configure(local_recorder.store.url)  # feedback() goes through the default recorder
    try:
        trace_plugin.feedback(inside, reward=0.25, label="failure", comment="user complained")
        assert trace_plugin.flush(10)
    finally:
        trace_plugin.configure(None)
    episode = local_recorder.store.get_episode(inside)
    assert (episode.reward, episode.label) == (0.25, "failure")
    [fb] = local_recorder.store.feedback_for(inside)
    assert fb.comment == "user complained" and fb.source == "api"


def test_caller_can_choose_the_episode_id(local_recorder):
    graph = trace_plugin.capture(agent="chosen", recorder=local_recorder)(build("create_agent", model_for()))
    graph.invoke(user("hello"), config={"metadata": {"trace_episode_id": "ticket-4711", "team": "eu"}})
    [episode] = episodes_of(local_recorder)
    assert episode.id == "ticket-4711" and episode.metadata == {"team": "eu"}


def test_a_finished_run_keeps_none_of_its_messages(local_recorder):
    """Message conversions are reused within a run only: kept longer, the agent's messages
    aged into the collector's oldest generation (bench/capture_overhead.py)."""
    from integrations import langgraph

    model = model_for(("get_order", {"order_id": "O-9"}))
    graph = trace_plugin.capture(agent="forgets", recorder=local_recorder)(build("create_agent", model))
    graph.invoke(user("where is O-9?"))
    assert langgraph._converted == {}
    [episode] = episodes_of(local_recorder)
    assert [m["role"] for m in episode.output["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_decorator_on_a_builder_function_and_default_agent_name(local_recorder):
    @trace_plugin.capture(recorder=local_recorder)
    def support_bot():
        return build("create_agent", model_for(("get_order", {"order_id": "O-3"})))

    graph = support_bot()
    assert type(graph).__name__ == "CompiledStateGraph"  # still a graph: get_state etc. keep working
    graph.invoke(user("O-3?"))
    [episode] = episodes_of(local_recorder)
    assert episode.agent == "support_bot"


def test_context_manager_captures_undecorated_graphs(local_recorder):
    graph = build("create_react_agent", model_for(("get_order", {"order_id": "O-5"})))
    graph.invoke(user("before"))  # outside the block: not recorded
    with trace_plugin.capture(agent="scoped", recorder=local_recorder):
        graph.invoke(user("inside"))
    graph.invoke(user("after"))
    [episode] = episodes_of(local_recorder)
    assert episode.agent == "scoped"
    assert episode.input["messages"][0][1] == "inside"


@pytest.mark.parametrize("mode", ["updates", "values", "messages"])
def test_streaming_records_the_same_episode(mode, local_recorder):
    graph = trace_plugin.capture(agent="stream", recorder=local_recorder)(
        build("create_agent", model_for(("get_order", {"order_id": "O-8"})))
    )
    chunks = list(graph.stream(user("stream it"), stream_mode=mode))
    assert chunks
    [episode] = episodes_of(local_recorder)
    assert episode.status == "completed" and len(tool_steps(episode)) == 1
    assert "pending" in episode.output["messages"][-1]["content"]


async def test_astream_and_ainvoke(local_recorder):
    graph = trace_plugin.capture(agent="async", recorder=local_recorder)(
        build("create_react_agent", model_for(("get_order", {"order_id": "O-2"})))
    )
    await graph.ainvoke(user("a"))
    chunks = [c async for c in graph.astream(user("b"), stream_mode="updates")]
    assert chunks
    episodes = episodes_of(local_recorder)
    assert len(episodes) == 2 and all(e.status == "completed" for e in episodes)
    assert all(len(tool_steps(e)) == 1 for e in episodes)


def _assert_separated(episodes, n):
    assert len(episodes) == n
    for episode in episodes:
        order_id = episode.input["messages"][0][1]
        [tool] = tool_steps(episode)
        assert tool.input == {"order_id": order_id}, "a step landed in another run's episode"
        seqs = [s.seq for s in episode.steps]
        assert seqs == sorted(set(seqs))
        assert episode.output["messages"][-1]["content"].endswith(f"order {order_id} is pending")


def _echo_order_model(latency: float):
    from langchain_core.messages import AIMessage

    from integrations.scripted_chat_model import ScriptedChatModel

    def policy(messages):
        if messages[-1].type == "tool":
            return AIMessage(content=f"Done. {messages[-1].content}")
        order_id = messages[0].content
        return AIMessage(
            content="", tool_calls=[{"name": "get_order", "args": {"order_id": order_id}, "id": "c1"}]
        )

    return ScriptedChatModel(policy=policy, latency=latency)


@pytest.mark.parametrize("kind", KINDS)
def test_eight_concurrent_threads_stay_separate(kind, recorder):
    graph = trace_plugin.capture(agent="threads", recorder=recorder)(build(kind, _echo_order_model(0.01)))
    barrier = threading.Barrier(8)

    def run(i):
        barrier.wait()
        for j in range(3):
            graph.invoke(user(f"T{i}-{j}"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _assert_separated(episodes_of(recorder), 24)


async def test_eight_concurrent_tasks_stay_separate(recorder):
    graph = trace_plugin.capture(agent="tasks", recorder=recorder)(
        build("create_agent", _echo_order_model(0.01))
    )
    await asyncio.gather(*(graph.ainvoke(user(f"A{i}")) for i in range(8)))
    await asyncio.gather(*(_consume(graph.astream(user(f"S{i}"))) for i in range(8)))
    _assert_separated(episodes_of(recorder), 16)


async def _consume(stream):
    return [chunk async for chunk in stream]
