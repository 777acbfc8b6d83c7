"""The recorder never breaks the agent: unreachable or read-only databases, bad payloads."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
from agents import build, model_for, user
from langgraph.graph import END, START, StateGraph
from sqlalchemy import create_engine, text
from typing_extensions import TypedDict

import trace_plugin
from trace_plugin import Recorder, Store
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Step, new_id
from trace_plugin.tracer import Tracer

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:9/nowhere"


def test_unreachable_database_never_reaches_the_agent(caplog):
    rec = Recorder(UNREACHABLE, max_queue=50, retry_interval=0.05)
    graph = trace_plugin.capture(agent="offline", recorder=rec)(
        build("create_agent", model_for(("get_order", {"order_id": "O-1"})))
    )
    with caplog.at_level(logging.WARNING, logger="trace_plugin"):
        for _ in range(20):
            state = graph.invoke(user("where is O-1?"))
            assert "pending" in state["messages"][-1].content
        assert rec.flush(timeout=0.5) is False
    assert rec.written == 0 and rec.dropped > 0  # the queue of 50 overflowed and counted it
    outage = [r for r in caplog.records if "cannot write to" in r.getMessage()]
    assert len(outage) == 1, "one warning per outage, not one per record"
    assert "127.0.0.1:9" in outage[0].getMessage()


def test_read_only_database_file(tmp_path, caplog):
    path = tmp_path / "ro.db"
    Store(f"sqlite:///{path}").upgrade()
    rec = Recorder(f"sqlite:///file:{path}?mode=ro&uri=true", retry_interval=0.05)
    graph = trace_plugin.capture(agent="ro", recorder=rec)(build("create_agent", model_for()))
    with caplog.at_level(logging.WARNING, logger="trace_plugin"):
        graph.invoke(user("hello"))
        assert rec.flush(timeout=0.5) is False
    assert any("readonly" in r.getMessage() for r in caplog.records)
    assert Store(f"sqlite:///{path}").count("episodes") == 0
    # Closing within its timeout (it took timeout + 5 s), it counts what it could not store
    # (they were lost uncounted).
    pending = rec.written + rec.dropped
    started = time.monotonic()
    assert rec.close(0.5) is False
    assert time.monotonic() - started < 0.9
    assert rec.written == 0 and rec.dropped - pending >= 2  # the episode and its model step, at least
    counted = rec.dropped
    time.sleep(0.2)  # the writer, past its deadline, neither writes nor counts them again
    assert rec.dropped == counted and Store(f"sqlite:///{path}").count("episodes") == 0


def test_buffered_records_are_written_when_the_database_comes_back(pg_url):
    admin = create_engine(pg_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    late_db = pg_url + "_late"
    rec = Recorder(late_db, retry_interval=0.05)
    graph = trace_plugin.capture(agent="late", recorder=rec)(
        build("create_agent", model_for(("get_order", {"order_id": "O-4"})))
    )
    for _ in range(5):
        graph.invoke(user("O-4"))
    assert rec.flush(timeout=0.3) is False  # the database does not exist yet
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{late_db.rsplit("/", 1)[1]}"'))
    try:
        assert rec.flush(timeout=20) is True
        assert rec.dropped == 0
        stored = rec.store.list_episodes("late")
        assert len(stored) == 5 and all(e.status == "completed" for e in stored)
    finally:
        rec.close()
        rec.store.close()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{late_db.rsplit("/", 1)[1]}" WITH (FORCE)'))


class Bag(TypedDict):
    request: str
    thing: object


def test_non_json_state_and_tool_results_are_stored_as_typed_repr(local_recorder):
    def node(state: Bag) -> dict:
        return {"thing": threading.Lock()}

    builder = StateGraph(Bag)
    builder.add_node("make", node)
    builder.add_edge(START, "make")
    builder.add_edge("make", END)
    graph = trace_plugin.capture(agent="opaque", recorder=local_recorder)(builder.compile())
    graph.invoke({"request": "x", "thing": None})

    assert local_recorder.flush(10)
    [summary] = local_recorder.store.list_episodes("opaque")
    episode = local_recorder.store.get_episode(summary.id)
    assert episode.output["thing"]["__type__"] == "lock"
    assert "unlocked" in episode.output["thing"]["repr"]
    [node_step] = episode.steps
    assert node_step.output["thing"]["__type__"] == "lock"


def test_oversized_payloads_are_truncated_with_a_marker(local_recorder):
    huge = "x" * 300_000
    graph = trace_plugin.capture(agent="big", recorder=local_recorder, max_payload_bytes=10_000)(
        build("create_agent", model_for(("get_order", {"order_id": huge})))
    )
    graph.invoke(user("big one"))
    assert local_recorder.flush(10)
    episode = local_recorder.store.get_episode(local_recorder.store.list_episodes("big")[0].id)
    [tool] = [s for s in episode.steps if s.kind == "tool"]
    assert tool.input["__truncated__"] is True and tool.input["bytes"] > 300_000
    assert len(tool.input["preview"]) < 10_000
    assert tool.output["__truncated__"] is True


def test_redacted_values_never_reach_the_database(db_url):
    secrets = ["jane.doe@example.com", "+1 (415) 555-0134", "4111 1111 1111 1111"]
    rec = Recorder(db_url)
    graph = trace_plugin.capture(agent="pii", recorder=rec, redact=True)(
        build("create_agent", model_for(("find_user", {"email": secrets[0]})))
    )
    graph.invoke(user(f"I am {secrets[0]}, call {secrets[1]}, card {secrets[2]}; order O-1 on 2026-11-29"))
    assert rec.flush(10)

    engine = create_engine(rec.store.url)
    with engine.connect() as conn:
        dump = " ".join(
            str(row)
            for table in ("episodes", "steps", "tool_schemas")
            for row in conn.execute(text(f"SELECT * FROM {table}"))
        )
    engine.dispose()
    for secret in secrets:
        assert secret not in dump
    assert "[EMAIL]" in dump and "[PHONE]" in dump and "[CARD]" in dump
    assert "O-1 on 2026-11-29" in dump  # ordinary ids and dates survive
    rec.close()
    rec.store.close()


def test_records_the_database_rejects_are_dropped_alone(local_recorder):
    good = Episode(id=new_id(), agent="a")
    orphan = Step(episode_id="no-such-episode", seq=0, kind="tool", name="t")
    for record in (
        good,
        orphan,
        Step(episode_id=good.id, seq=0, kind="tool", name="t"),
        EpisodeEnd(good.id, "completed"),
    ):
        local_recorder.submit(record)
    assert local_recorder.flush(10)
    assert local_recorder.dropped == 1 and local_recorder.written == 3
    stored = local_recorder.store.get_episode(good.id)
    assert stored.status == "completed" and len(stored.steps) == 1


def test_feedback_needs_an_outcome():
    with pytest.raises(ValueError, match="reward or a label"):
        trace_plugin.feedback("some-episode")


def test_non_json_tool_result_is_recorded_and_the_agent_continues(local_recorder):
    graph = trace_plugin.capture(agent="opaque-tool", recorder=local_recorder)(
        build("create_agent", model_for(("opaque", {"order_id": "O-1"})))
    )
    state = graph.invoke(user("give me the thing"))
    assert "<Opaque thing>" in state["messages"][-1].content
    assert local_recorder.flush(10)
    episode = local_recorder.store.get_episode(local_recorder.store.list_episodes("opaque-tool")[0].id)
    [tool] = [s for s in episode.steps if s.kind == "tool"]
    assert tool.error is None and "<Opaque thing>" in str(tool.output)
    assert episode.status == "completed"


def test_a_forked_child_records_through_its_own_writer(sqlite_url):
    import os

    rec = Recorder(sqlite_url)
    rec.submit(Episode(id=new_id(), agent="parent"))
    assert rec.flush(10)  # the parent's writer thread and connections exist before the fork
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        rec.submit(Episode(id=new_id(), agent="child"))
        os._exit(0 if rec.flush(10) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert {s.agent for s in rec.store.stats()} == {"parent", "child"}
    rec.close()


def test_the_writer_keeps_its_cadence_however_long_a_drain_takes(sqlite_url, monkeypatch):
    """What bounds the kill -9 window (bench/capture_overhead.py measures it): the next drain
    is due one interval after the last one started, not after it finished."""
    from trace_plugin import recorder as recorder_module

    now = [0.0]
    monkeypatch.setattr(recorder_module, "_clock", lambda: now[0])
    rec = Recorder(sqlite_url, interval=0.2)
    waits: list[float] = []

    class Wake(threading.Event):
        def wait(self, timeout=None):
            waits.append(round(timeout, 6))
            return super().wait(0.01)

    rec._wake = Wake()
    store_write = rec.store.write

    def slow_write(records):
        store_write(records)
        now[0] += 0.15  # this drain took 0.15 s of the 0.2 s interval

    rec.store.write = slow_write
    try:
        rec.submit(Episode(id=new_id(), agent="cadence"))
        assert rec.flush(10) and rec.written == 1
        assert waits[0] == 0.2 and 0.05 in waits
    finally:
        rec.close(5)
        rec.store.close()


def test_queued_records_are_invisible_to_the_garbage_collector(sqlite_url):
    """Records waiting for the writer are tuples of strings, numbers and datetimes, which the
    collector stops tracking at its first pass. Queued as objects, they aged into the oldest
    generation and set off full collections of a busy agent's heap (bench/capture_overhead.py)."""
    rec = Recorder(sqlite_url, interval=3600)  # drains only when flushed
    tracer = Tracer("gc-agent", recorder=rec)
    active = tracer.start_episode({"messages": [{"role": "user", "content": "hi"}]}, metadata={"k": [1, 2]})
    schema = {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}
    with tracer.step(active, "llm", "m", input={"messages": []}, tools=[schema]) as step:
        step.output = {"role": "assistant", "content": "ok"}
    with tracer.step(active, "tool", "get_order", input={"id": 1}) as step:
        step.error = "ValueError: no such order"
    tracer.end_episode(active, output={"answer": 42})

    gc.collect()
    queued = list(rec._queue)
    assert len(queued) == 4 and not any(gc.is_tracked(item) for item in queued)

    assert rec.flush(10)
    episode = rec.store.get_episode(active.id)
    assert episode.input == {"messages": [{"role": "user", "content": "hi"}]}
    assert episode.metadata == {"k": [1, 2]}
    assert episode.output == {"answer": 42} and episode.status == "completed"
    llm, tool = episode.steps
    assert llm.output == {"role": "assistant", "content": "ok"} and tool.error == "ValueError: no such order"
    assert [s["function"]["name"] for s in rec.store.tool_schemas("gc-agent")] == ["get_order"]
    rec.close()


def test_a_read_only_postgres_database_counts_what_it_could_not_store(pg_url):
    """The same on PostgreSQL, where a read-only transaction refuses each record: closing
    within its timeout, nothing written, everything counted."""
    Store(pg_url).upgrade()
    rec = Recorder(f"{pg_url}?options=-c%20default_transaction_read_only%3Don", retry_interval=0.05)
    episodes = [Episode(new_id(), "ro") for _ in range(3)]
    for episode in episodes:
        rec.submit(episode)
    started = time.monotonic()
    rec.close(2.0)
    assert time.monotonic() - started < 2.5
    assert rec.written == 0 and rec.dropped == len(episodes)
    assert Store(pg_url).count("episodes") == 0
