"""Capture against hostile values: it never hangs, never loses an episode's end, and stores
the same thing on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from agents import TOOLS, build, model_for, user
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

import trace_plugin
from trace_plugin import Recorder
from trace_plugin.payload import encode, encode_now, shape
from trace_plugin.records.trajectory import EpisodeEnd, Feedback, Step
from trace_plugin.store.store import fit_string
from trace_plugin.tracer import Tracer


class Loop(Mapping):
    """A mapping (not a dict) whose two keys both point back at it."""

    def __getitem__(self, key: str) -> Loop:
        return self

    def __iter__(self) -> Iterator[str]:
        return iter(("a", "b"))

    def __len__(self) -> int:
        return 2


class Chain(Mapping):
    """No cycle, but 2^depth paths: both keys lead to the same next link."""

    def __init__(self, depth: int) -> None:
        self.next = Chain(depth - 1) if depth else None

    def __getitem__(self, key: str) -> Any:
        return self.next

    def __iter__(self) -> Iterator[str]:
        return iter(("left", "right"))

    def __len__(self) -> int:
        return 2


class State(TypedDict, total=False):
    question: str
    thing: Any


def graph_returning(value: Any):
    graph = StateGraph(State)
    graph.add_node("make", lambda state: {"thing": value})
    graph.add_edge(START, "make")
    graph.add_edge("make", END)
    return graph.compile()


def stored(rec: Recorder, agent: str):
    assert rec.flush(15)
    return [rec.store.get_episode(e.id) for e in rec.store.list_episodes(agent, limit=100)]


# -- self-referential values -------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_self_referential_mapping_is_marked_and_the_writer_goes_on(local_recorder):
    loop = Loop()
    graph = trace_plugin.capture(agent="loop", recorder=local_recorder)(graph_returning(loop))
    graph.invoke({"question": "q"})
    [episode] = stored(local_recorder, "loop")
    assert episode.status == "completed"
    [node] = [s for s in episode.steps if s.kind == "node"]
    cycle = {"__ref__": "/thing"}  # where the payload holds it first
    assert node.output == {"thing": {"a": cycle, "b": cycle}}
    # the writer is free: a later, ordinary episode is stored too
    trace_plugin.capture(agent="after", recorder=local_recorder)(graph_returning(1)).invoke({})
    assert [e.status for e in stored(local_recorder, "after")] == ["completed"]


@pytest.mark.timeout(120)
def test_a_self_referential_list_keeps_its_step_and_the_episode_end(local_recorder, caplog):
    loop: list = []
    loop.append(loop)
    graph = trace_plugin.capture(agent="list-loop", recorder=local_recorder)(graph_returning(loop))
    with caplog.at_level(logging.WARNING, logger="trace_plugin"):
        graph.invoke({"question": "q"})
        [episode] = stored(local_recorder, "list-loop")
    assert episode.status == "completed" and '"__ref__"' in json.dumps(episode.output)
    assert [s.name for s in episode.steps if s.kind == "node"] == ["make"]
    assert local_recorder.dropped == 0 and "queue full" not in caplog.text


def diamond(levels: int) -> dict[str, Any]:
    """No cycle, but 2^levels paths: each level's two keys share one child."""
    node: dict[str, Any] = {"leaf": "x" * 100}
    for _ in range(levels):
        node = {"left": node, "right": node}
    return node


@pytest.mark.parametrize("levels", [24, 60])
def test_shaping_a_value_shared_along_exponentially_many_paths_costs_one_step_per_object(levels):
    value = diamond(levels)
    shaped = shape(value)
    assert not shaped.cut and shaped.nodes == levels + 1  # each object once
    assert shaped.value["right"] == {"__ref__": "/left"}
    assert len(json.dumps(shaped.value)) < 20_000  # pointers grow with depth, and depth is capped at 64
    assert shape(Chain(levels // 2)).nodes == levels // 2 + 1  # a Mapping, which orjson refuses: the same


def test_a_string_referenced_many_times_is_shaped_up_to_the_budget_only():
    big = "y" * 1_000_000
    shaped = shape([big] * 300, max_bytes=1_000_000)
    assert shaped.cut and shaped.nodes == 1
    assert len(shaped.value) == 1 and len(shaped.value[0]) <= 1_000_000  # then the walk stopped
    redactions: list[int] = []
    redacted = shape([big] * 300, max_bytes=10_000, redact=lambda s: redactions.append(len(s)) or s)
    assert redacted.cut and sum(redactions) <= 10_000  # the redactor saw no more than is kept
    stored = json.loads(encode([big] * 300, max_bytes=10_000))
    assert stored["__truncated__"] is True and stored["bytes"] > 1_000_000 and len(stored["preview"]) < 10_000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("levels", [26, 60])
def test_capture_of_a_shared_dag_blocks_nothing_and_loses_nothing(levels, local_recorder):
    """At 26 levels orjson's whole dump raised MemoryError and dropped records; at 60 the OS
    killed the process. Now the agent's thread looks at 10 000 objects at most and the
    writer shapes each object once."""
    graph = trace_plugin.capture(agent="dag", recorder=local_recorder)(graph_returning(diamond(levels)))
    graph.invoke({"question": "q"})
    [episode] = stored(local_recorder, "dag")
    assert episode.status == "completed" and local_recorder.dropped == 0
    [node] = [s for s in episode.steps if s.kind == "node"]
    thing = node.output["thing"]
    assert thing["right"] == {"__ref__": "/thing/left"}
    for _ in range(levels - 1):
        thing = thing["left"]
    assert thing["left"] == {"leaf": "x" * 100}


def test_the_agents_thread_hands_a_shared_or_oversized_payload_to_the_writer_unread():
    assert encode_now({"a": [1, "two", None]}) == '{"a":[1,"two",null]}'
    assert encode_now(diamond(60)) is None  # shared: the writer's walk shapes it
    assert encode_now({"x": "y" * 2_000}, max_bytes=1_000) is None  # over the budget, not dumped whole
    assert encode_now([[i] for i in range(20_000)]) is None  # past the 10 000 objects it looks at


# -- the episode's end is always recorded ------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 10**400, float("nan")], ids=["text", "huge-int", "nan"])
def test_a_reward_that_is_no_number_is_a_scoring_error_not_a_lost_end(value, local_recorder, caplog):
    graph = trace_plugin.capture(agent="scored", recorder=local_recorder, reward=lambda state: value)(
        build("create_agent", model_for(("get_order", {"order_id": "O-1"})))
    )
    with caplog.at_level(logging.WARNING, logger="trace_plugin"):
        graph.invoke(user("where is O-1?"))
        [episode] = stored(local_recorder, "scored")
    assert episode.status == "completed" and episode.reward is None
    assert episode.error.startswith("scoring failed")
    assert "reward" in caplog.text and "queue full" not in caplog.text


def stop(exc: type[BaseException]):
    def raising(*_: Any) -> None:
        raise exc("stopped")

    return raising


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_reward_function_that_stops_the_process_still_ends_its_episode(exc, local_recorder):
    graph = trace_plugin.capture(agent="stopped", recorder=local_recorder, reward=stop(exc))(
        build("create_agent", model_for(("get_order", {"order_id": "O-1"})))
    )
    with pytest.raises(exc):  # it goes on up, as Python intends
        graph.invoke(user("where is O-1?"))
    [episode] = stored(local_recorder, "stopped")
    assert episode.status == "error" and episode.error == f"{exc.__name__}: stopped"
    assert episode.reward is None and episode.ended_at is not None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_tool_that_stops_the_process_ends_its_episode_the_same_way(exc, local_recorder):
    @tool
    def get_order(order_id: str) -> str:
        """Look up an order."""
        stop(exc)()

    graph = trace_plugin.capture(agent="tool-stopped", recorder=local_recorder)(
        build("create_agent", model_for(("get_order", {"order_id": "O-1"})), tools=[get_order])
    )
    with pytest.raises(exc):
        graph.invoke(user("where is O-1?"))
    [episode] = stored(local_recorder, "tool-stopped")
    assert episode.status == "error" and episode.error == f"{exc.__name__}: stopped"


@pytest.mark.parametrize("value", [1.5, -3])
def test_a_reward_outside_0_1_is_refused_and_the_record_says_why(value, local_recorder):
    """One rule wherever a reward comes in: refused, never clamped, and the reason kept."""
    graph = trace_plugin.capture(agent="out-of-range", recorder=local_recorder, reward=lambda state: value)(
        build("create_agent", model_for(("get_order", {"order_id": "O-1"})))
    )
    graph.invoke(user("where is O-1?"))
    [episode] = stored(local_recorder, "out-of-range")
    assert episode.status == "completed" and episode.reward is None
    assert episode.error == f"scoring failed: the reward {float(value)!r} is outside [0, 1]"
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        trace_plugin.feedback(episode.id, reward=value)
    # Another producer (an environment of one's own, say) submitting such a record directly:
    local_recorder.submit(Feedback(episode.id, reward=value, source="environment"))
    local_recorder.submit(EpisodeEnd(episode.id, "completed", reward=value))
    assert local_recorder.flush(15)
    [fb] = local_recorder.store.feedback_for(episode.id)
    refused = f"reward refused: the reward {value!r} is outside [0, 1]"
    assert fb.reward is None and fb.comment == refused
    again = local_recorder.store.get_episode(episode.id)
    assert again.reward is None and again.error.endswith(refused)


# -- one corpus, two backends, the same rows -----------------------------------------------

LONG_ID = "ticket-" + "7" * 93  # 100 characters: over the 64 an episode id column holds


@tool
def nul_result(order_id: str) -> str:
    """Returns text with a NUL character, which PostgreSQL cannot store."""
    return f"order {order_id}\x00 is pending"


def play_hostile_corpus(rec: Recorder) -> None:
    graph = trace_plugin.capture(agent="hostile", recorder=rec)(
        build(
            "create_agent",
            model_for(("nul_result", {"order_id": "O-\x00"}), ("get_order", {"order_id": "O-2"})),
            tools=[nul_result, *TOOLS],
        )
    )
    graph.invoke(
        user("where is O-\x00?"),
        config={"metadata": {"trace_episode_id": LONG_ID, "note\x00": "x\x00y"}},
    )
    tracer = Tracer("a" * 200, recorder=rec)  # the longest name the store takes
    active = tracer.start_episode({"text": "\x00"}, episode_id="direct", model="m" * 300)
    step = Step(
        active.id, 0, "tool", "n" * 300, input={"k": "\ud800"}, error="bad\x00", tool_call_id="c" * 300
    )
    tracer.record_step(step)
    tracer.end_episode(active, output="done\x00")


# Parallel tool calls start in either order, so their seq is run-specific too.
RUN_SPECIFIC = {"seq", "started_at", "ended_at", "latency_ms", "run_id", "parent_run_id"}


def everything_stored(rec: Recorder) -> dict[str, dict[str, Any]]:
    """Every episode with its steps, less what differs from run to run (times, run ids)."""
    assert rec.flush(15)
    out = {}
    for summary in rec.store.list_episodes(limit=100):
        row = dataclasses.asdict(rec.store.get_episode(summary.id))
        steps = [{k: v for k, v in s.items() if k not in RUN_SPECIFIC} for s in row["steps"]]
        row["steps"] = sorted(steps, key=json.dumps)
        out[summary.id] = {k: v for k, v in row.items() if k not in RUN_SPECIFIC}
    return out


def test_hostile_payloads_store_the_same_on_sqlite_and_postgres(sqlite_url, pg_url):
    results = {}
    for url in (sqlite_url, pg_url):
        rec = Recorder(url, retry_interval=0.05)
        try:
            play_hostile_corpus(rec)
            results[url] = everything_stored(rec)
            assert rec.dropped == 0
            # a caller's over-long id finds its episode again, with every step
            episode = rec.store.get_episode(LONG_ID)
            assert episode is not None and episode.status == "completed"
            assert len(episode.steps) == 4 and episode.id == fit_string(LONG_ID, 64)  # 2 model, 2 tool calls
        finally:
            rec.close(10)
            rec.store.close()
    assert results[sqlite_url] == results[pg_url]
    run, direct = results[sqlite_url][fit_string(LONG_ID, 64)], results[sqlite_url]["direct"]
    assert run["metadata"] == {"note\ufffd": "x\ufffdy"}
    [nul_step] = [s for s in run["steps"] if s["name"] == "nul_result"]
    assert nul_step["output"] == "order O-\ufffd\ufffd is pending"
    assert direct["agent"] == "a" * 200 and direct["output"] == "done\ufffd" and len(direct["model"]) == 200
    [step] = direct["steps"]
    assert step["error"] == "bad\ufffd" and step["input"] == {"k": "\ufffd"}  # a lone surrogate
    assert len(step["name"]) == 200 and len(step["tool_call_id"]) == 200


def test_an_over_long_agent_name_is_refused_before_any_agent_runs():
    with pytest.raises(ValueError, match="201 characters"):
        trace_plugin.capture(agent="x" * 201)
    with pytest.raises(ValueError, match="non-empty"):
        Tracer("")


def test_over_long_values_keep_distinct_deterministic_keys():
    a, b = "t" * 70 + "a", "t" * 70 + "b"
    assert fit_string(a, 64) == fit_string(a, 64) != fit_string(b, 64)
    assert len(fit_string(a, 64)) == 64 and fit_string("short", 64) == "short"
