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
from trace_plugin.payload import encode, to_jsonable
from trace_plugin.records.trajectory import Step
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
def test_a_self_referential_mapping_is_named_and_the_writer_goes_on(local_recorder):
    loop = Loop()
    graph = trace_plugin.capture(agent="loop", recorder=local_recorder)(graph_returning(loop))
    graph.invoke({"question": "q"})
    [episode] = stored(local_recorder, "loop")
    assert episode.status == "completed"
    [node] = [s for s in episode.steps if s.kind == "node"]
    cycle = {"__type__": "Loop", "repr": repr(loop)}
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
    assert episode.status == "completed" and '"__type__": "list"' in json.dumps(episode.output)
    assert [s.name for s in episode.steps if s.kind == "node"] == ["make"]
    assert local_recorder.dropped == 0 and "queue full" not in caplog.text


@pytest.mark.timeout(60)
def test_values_shared_along_exponentially_many_paths_are_bounded():
    out = encode(Chain(64))  # a Mapping: the C encoder refuses it, so the walk does it all
    assert out is not None and "__type__" in out and len(out) < 50_000_000
    shared: list = []
    for _ in range(64):
        shared = [shared, shared]
    walked = json.dumps(to_jsonable(shared))  # past the node budget the rest is named, not walked
    assert '"__type__": "list"' in walked and len(walked) < 50_000_000


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
