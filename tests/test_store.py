"""The SQL store on a real SQLite file and a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, insert, select

from trace_plugin import Recorder, Store
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step, new_episode_id, new_id
from trace_plugin.store import resolve_url, tables
from trace_plugin.tracer import Tracer

TOOL = {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}


def make_run(agent: str, reward: float | None, label: str | None = None, started: datetime | None = None):
    episode = Episode(id=new_id(), agent=agent, input={"q": "hi"}, started_at=started or datetime.now(UTC))
    steps = [
        Step(episode.id, 0, "llm", "m", input={"messages": []}, output={"role": "assistant"}, tools=[TOOL]),
        Step(episode.id, 1, "tool", "get_order", input={"order_id": "1"}, output="ok", tool_call_id="c1"),
    ]
    return [episode, *steps, EpisodeEnd(episode.id, "completed", output={"a": 1}, reward=reward, label=label)]


def test_round_trip_and_queries(db_url):
    store = Store(db_url)
    store.upgrade()
    store.upgrade()  # idempotent
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [
        make_run("a", 1.0, started=t0),
        make_run("a", 0.0, started=t0 + timedelta(seconds=1)),
        make_run("a", None, started=t0 + timedelta(seconds=2)),
        make_run("b", 0.5, "success", started=t0),
    ]
    for records in runs:
        store.write(records)

    newest = store.list_episodes("a")
    assert [e.id for e in newest] == [runs[2][0].id, runs[1][0].id, runs[0][0].id]
    assert newest[0].started_at.tzinfo is not None

    episode = store.get_episode(runs[0][0].id)
    assert episode.started_at == t0 and episode.input == {"q": "hi"}
    assert [s.kind for s in episode.steps] == ["llm", "tool"]
    assert episode.steps[1].tool_call_id == "c1" and episode.output == {"a": 1}
    assert store.get_episode("missing") is None

    # One schema row however many episodes offered the tool.
    assert store.count("tool_schemas") == 1 and store.count("episode_tools") == 4
    assert store.tool_schemas("a") == [TOOL]

    stats = {s.agent: s for s in store.stats()}
    assert (stats["a"].episodes, stats["a"].with_outcome, stats["a"].successes) == (3, 2, 1)
    assert stats["a"].success_rate == 0.5
    assert stats["b"].success_rate == 1.0  # the label decides over a partial reward

    store.write([Feedback(runs[1][0].id, reward=1.0, label="success", comment="fixed by hand")])
    assert store.get_episode(runs[1][0].id).label == "success"
    assert {s.agent: s for s in store.stats()}["a"].successes == 2
    store.close()


def test_a_tool_offered_in_two_batches_links_its_episode_once(db_url):
    store = Store(db_url)
    store.upgrade()
    episode, llm, tool, end = make_run("a", 1.0)
    store.write([episode, llm])
    store.write([Step(episode.id, 2, "llm", "m", input={"messages": []}, tools=[TOOL]), tool, end])
    assert store.count("episode_tools") == 1 and store.tool_schemas("a") == [TOOL]
    assert [s.seq for s in store.get_episode(episode.id).steps] == [0, 1, 2]
    store.close()


def test_new_episode_ids_sort_by_creation_time(sqlite_url):
    """Time-ordered ids append to the indexes keyed by episode instead of scattering over them."""
    first = new_episode_id()
    time.sleep(0.002)  # the next millisecond
    later = [new_episode_id() for _ in range(1_000)]
    assert all(first < i for i in later) and len(set(later)) == len(later)
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in later)
    recorder = Recorder(sqlite_url)
    minted = Tracer("ids", recorder=recorder).start_episode().id  # capture mints them
    assert abs(int(minted[:12], 16) - time.time() * 1000) < 60_000
    recorder.close()


def test_postgres_url_gets_psycopg3():
    assert resolve_url("postgresql://u@h/db").startswith("postgresql+psycopg://")
    assert resolve_url("sqlite:///x.db") == "sqlite:///x.db"


def test_default_url_lives_in_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TRACE_PLUGIN_DB_URL", raising=False)
    monkeypatch.setenv("TRACE_PLUGIN_HOME", str(tmp_path))
    assert resolve_url() == f"sqlite:///{tmp_path / 'trace.db'}"
    monkeypatch.setenv("TRACE_PLUGIN_DB_URL", "sqlite:///elsewhere.db")
    assert resolve_url() == "sqlite:///elsewhere.db"


def test_sqlite_is_in_wal_mode(sqlite_url):
    store = Store(sqlite_url)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_read_then_write_transactions_do_not_hit_database_is_locked(sqlite_url):
    """Four writers each reading the last seq and appending the next one.

    With a deferred BEGIN, a transaction that read first cannot upgrade to a write lock
    once another writer committed, and SQLite fails it with "database is locked".
    """
    store = Store(sqlite_url)
    store.upgrade()
    episode = Episode(id=new_id(), agent="seq")
    store.write([episode])
    errors: list[Exception] = []
    barrier = threading.Barrier(4)

    def writer() -> None:
        barrier.wait()
        for _ in range(40):
            try:
                with store.engine.begin() as conn:
                    last = conn.execute(
                        select(func.max(tables.steps.c.seq)).where(tables.steps.c.episode_id == episode.id)
                    ).scalar()
                    conn.execute(
                        insert(tables.steps).values(
                            episode_id=episode.id, seq=(last or 0) + 1, kind="node", name="n"
                        )
                    )
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.count("steps") == 160


def test_upgrades_of_two_databases_in_one_process_do_not_collide(tmp_path):
    """Alembic's context lives in module globals; concurrent upgrades used to corrupt it."""
    stores = [Store(f"sqlite:///{tmp_path / f'db{i}.db'}") for i in range(4)]
    errors: list[Exception] = []

    def upgrade(store: Store) -> None:
        try:
            store.upgrade()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=upgrade, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(s.count("episodes") == 0 for s in stores)
