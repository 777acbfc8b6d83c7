"""What capture costs an agent, and how fast the recorder stores events.

Side by side in one run:
- the same LangGraph agent (``create_agent``, two tools, scripted model) undecorated and
  decorated, in alternating blocks, with a zero-latency model and with 50 ms latency.
  The decorated time includes draining the recorder's queue, so no work hides in a backlog.
  With the zero-latency model a third block binds an empty callback handler: what
  LangChain's callback dispatch costs on its own, before any capture work, and a fourth
  captures with ``redact=True``: what masking PII costs inside the agent. Each ratio comes
  with a 95% interval from resampling its blocks: what this run's own noise allows;
- sustained events/s from the recorder into SQLite and into PostgreSQL;
- events lost anywhere in the run (expected against stored rows);
- the kill -9 window: an agent process capturing flat out is killed with SIGKILL, and the
  oldest finished run missing from the store says how much work such a crash can lose.

Usage: python bench/capture_overhead.py [--quick] [--postgres URL]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tools import tool
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, text

import trace_plugin
from integrations.scripted_chat_model import ScriptedChatModel, call_tools_then_answer
from trace_plugin import Recorder
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Step, new_episode_id

EVENTS_PER_RUN = 5  # the episode, 2 LLM calls, 2 tool calls (the graph nodes only repeat them)


@tool
def get_order(order_id: str) -> str:
    """Look up an order by id."""
    return f"order {order_id}: pending, 2 items, ships to 12 Main St"


@tool
def find_user(email: str) -> str:
    """Find a user by e-mail."""
    return f"user_{email.split('@')[0]}"


def make_agent(latency: float):
    policy = call_tools_then_answer(
        ("find_user", {"email": "ann@example.com"}), ("get_order", {"order_id": "W123"})
    )
    return create_agent(ScriptedChatModel(policy=policy, latency=latency), [get_order, find_user])


def time_runs(graph, runs: int, recorder: Recorder | None) -> float:
    start = time.perf_counter()
    for i in range(runs):
        graph.invoke({"messages": [("user", f"where is my order? ticket {i}")]})
    if recorder is not None:
        assert recorder.flush(120)
    return time.perf_counter() - start


class EmptyHandler(BaseCallbackHandler):
    """Binds like the capture's handler and does nothing: LangChain's dispatch alone."""

    run_inline = True
    ignore_retriever = True
    ignore_custom_event = True

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        """Implemented, as the capture's is: else LangChain renders messages for ``on_llm_start``."""


class Overhead(NamedTuple):
    """Each block's seconds undecorated and decorated, and (if timed) the empty handler's
    and the redacting capture's in all."""

    blocks: tuple[tuple[float, float], ...]
    dispatch: float | None
    redacted: float | None = None

    @property
    def plain(self) -> float:
        return sum(plain for plain, _ in self.blocks)

    @property
    def decorated(self) -> float:
        return sum(decorated for _, decorated in self.blocks)

    @property
    def ratio(self) -> float:
        return self.decorated / self.plain

    def ratio_interval(self, resamples: int = 2_000, seed: int = 0) -> tuple[float, float]:
        """A 95% bootstrap interval of :attr:`ratio`, resampling blocks.

        The machine's speed drifts from block to block by as much as capture costs, and the
        k-th blocks of both variants ran in the same round, under the same drift: they are
        resampled as pairs.
        """
        rng = random.Random(seed)
        ratios = []
        for _ in range(resamples):
            sample = rng.choices(self.blocks, k=len(self.blocks))
            ratios.append(sum(d for _, d in sample) / sum(p for p, _ in sample))
        ratios.sort()
        return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def overhead(
    latency: float, runs: int, blocks: int, recorder: Recorder, *, dispatch: bool = False
) -> Overhead:
    """Alternate undecorated, decorated and (``dispatch``) empty-handler blocks, each block
    starting with the next of them in turn, so that no variant always follows the same one
    (the decorated block ends by draining the recorder, which the next block would inherit)."""
    variants: dict[str, tuple[Any, Recorder | None]] = {
        "plain": (make_agent(latency), None),
        "decorated": (
            trace_plugin.capture(agent=f"bench-{latency}", recorder=recorder)(make_agent(latency)),
            recorder,
        ),
    }
    if dispatch:
        variants["empty"] = (make_agent(latency).with_config(callbacks=[EmptyHandler()]), None)
        variants["redacted"] = (
            trace_plugin.capture(agent=f"bench-{latency}-redacted", recorder=recorder, redact=True)(
                make_agent(latency)
            ),
            recorder,
        )
    time_runs(variants["plain"][0], 5, None)  # warm every path (imports, first compile)
    time_runs(variants["decorated"][0], 5, recorder)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    names, per_block = list(variants), max(1, runs // blocks)
    for block in range(blocks):
        for name in names[block % len(names) :] + names[: block % len(names)]:
            graph, drained = variants[name]
            seconds[name].append(time_runs(graph, per_block, drained))
    blocks_seconds = tuple(zip(seconds["plain"], seconds["decorated"], strict=True))
    if not dispatch:
        return Overhead(blocks_seconds, None)
    return Overhead(blocks_seconds, sum(seconds["empty"]), sum(seconds["redacted"]))


def events_per_second(url: str, n_steps: int) -> tuple[float, int]:
    """Submit episodes of 10 realistic steps from one thread; time until all are stored."""
    recorder = Recorder(url, batch_size=5_000, max_queue=n_steps * 2)
    recorder.store.upgrade()
    args = {"order_id": "W2918841", "reason": "the customer asked to cancel because the item arrived late"}
    records = []
    for _ in range(n_steps // 10):
        episode = Episode(
            id=new_episode_id(), agent="throughput", input={"messages": [{"role": "user", "content": "hi"}]}
        )
        records.append(episode)
        for seq in range(10):
            records.append(
                Step(
                    episode.id,
                    seq,
                    "tool",
                    "cancel_pending_order",
                    input=args,
                    output={"status": "cancelled", "refund": 129.5},
                    tool_call_id=f"call_{seq}",
                )
            )
        records.append(EpisodeEnd(episode.id, "completed", output={"ok": True}, reward=1.0))
    start = time.perf_counter()
    for record in records:
        recorder.submit(record)
    assert recorder.flush(300)
    elapsed = time.perf_counter() - start
    stored = recorder.store.count("steps")
    recorder.close()
    recorder.store.close()
    return len(records) / elapsed, n_steps - stored


def kill9_child(url: str) -> None:
    """Run the decorated agent flat out, printing each finished run's id and wall time."""
    trace_plugin.configure(url)

    def finished(episode_id: str) -> None:
        print(episode_id, time.time(), flush=True)

    graph = trace_plugin.capture(agent="kill9", on_episode=finished)(make_agent(0.0))
    for i in range(10**9):
        graph.invoke({"messages": [("user", f"where is my order? ticket {i}")]})


def kill9_window(url: str, trials: int, seconds: float) -> tuple[float, int, int]:
    """SIGKILL a capturing agent mid-run; return (window s, lost runs, finished runs).

    The window is the kill's time minus the finish of the oldest finished run that was
    not stored: how far back a crash reaches, under the agent's full load.
    """
    store = Recorder(url).store
    store.upgrade()
    window, lost, finished = 0.0, 0, 0
    for _ in range(trials):
        child = subprocess.Popen(
            [sys.executable, __file__, "--kill9-child", url], stdout=subprocess.PIPE, text=True
        )
        child.stdout.readline()  # started: imports done, the first run stored or queued
        time.sleep(seconds)
        killed_at = time.time()
        os.kill(child.pid, signal.SIGKILL)
        runs = dict(line.split() for line in child.stdout.read().splitlines())
        child.wait()
        stored = {e.id for e in store.list_episodes("kill9", limit=10**6) if e.status != "running"}
        missing = [float(at) for episode_id, at in runs.items() if episode_id not in stored]
        finished += len(runs)
        lost += len(missing)
        if missing:
            window = max(window, killed_at - min(missing))
    store.close()
    return window, lost, finished


def fresh_postgres(server: str) -> tuple[str, callable] | None:
    admin = create_engine(server, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    name = f"trace_bench_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        print(f"PostgreSQL unavailable ({str(exc).splitlines()[0]}): skipping its figure", file=sys.stderr)
        return None

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    return server.rsplit("/", 1)[0] + f"/{name}", drop


def count_events(recorder: Recorder) -> int:
    """Rows stored: one per episode, one per step (ends update their episode's row)."""
    return recorder.store.count("episodes") + recorder.store.count("steps")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run (< 1 minute)")
    parser.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--kill9-child", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kill9_child:
        return kill9_child(args.kill9_child)
    runs_fast, runs_slow, n_events = (150, 20, 20_000) if args.quick else (3_000, 500, 200_000)
    console = Console()

    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(f"sqlite:///{Path(tmp) / 'bench.db'}")
        recorder.store.upgrade()
        fast = overhead(0.0, runs_fast, max(3, runs_fast // 100), recorder, dispatch=True)
        slow = overhead(0.05, runs_slow, 5, recorder)
        expected_runs = 2 * runs_fast + runs_slow + 10  # decorated and redacting runs, + 2 × 5 warm-up runs
        agent_lost = expected_runs * EVENTS_PER_RUN - count_events(recorder)
        recorder.close()
        sqlite_rate, sqlite_lost = events_per_second(f"sqlite:///{Path(tmp) / 'throughput.db'}", n_events)
        crash = kill9_window(f"sqlite:///{Path(tmp) / 'kill9.db'}", *((2, 2.0) if args.quick else (5, 4.0)))

    pg = fresh_postgres(args.postgres)
    pg_rate, pg_lost = None, 0
    if pg is not None:
        url, drop = pg
        try:
            pg_rate, pg_lost = events_per_second(url, n_events)
        finally:
            drop()

    lost = agent_lost + sqlite_lost + pg_lost
    table = Table(title="Capture overhead: decorated vs undecorated, same agent, same run")
    for col in ("model latency", "runs", "undecorated s", "decorated s", "ratio (95% CI)", "target"):
        table.add_column(col, justify="right")
    intervals = {}
    for label, runs, timed, target in (
        ("0 ms", runs_fast, fast, "≤ 1.10"),
        ("50 ms", runs_slow, slow, "≤ 1.01"),
    ):
        low, high = intervals[label] = timed.ratio_interval()
        cells = (f"{timed.plain:.2f}", f"{timed.decorated:.2f}", f"{timed.ratio:.3f} ({low:.3f}–{high:.3f})")
        table.add_row(label, str(runs), *cells, target)
    console.print(table)
    dispatch_only, beyond = fast.dispatch / fast.plain, fast.decorated / fast.dispatch
    redacted = fast.redacted / fast.plain
    console.print(
        f"0 ms, same run: an empty LangChain handler costs {dispatch_only:.3f}x undecorated "
        f"({fast.dispatch:.2f} s); capture costs {beyond:.3f}x that; capture with redact=True "
        f"{redacted:.3f}x undecorated"
    )
    table = Table(title="Recorder throughput (episodes of 10 steps, one submitting thread)")
    for col in ("store", "events", "events/s", "lost", "target"):
        table.add_column(col, justify="right")
    table.add_row("SQLite", str(n_events), f"{sqlite_rate:,.0f}", str(sqlite_lost), "≥ 30,000")
    table.add_row(
        "PostgreSQL", str(n_events), "—" if pg_rate is None else f"{pg_rate:,.0f}", str(pg_lost), "≥ 15,000"
    )
    console.print(table)
    console.print(
        f"events lost: {agent_lost} of {expected_runs * EVENTS_PER_RUN} from agent runs, "
        f"{sqlite_lost + pg_lost} from throughput runs"
    )
    console.print(
        f"kill -9 of an agent capturing flat out (SQLite, recorder interval 0.2 s): {crash[1]} of "
        f"{crash[2]} finished runs lost; the oldest finished {crash[0]:.2f} s before the kill"
    )

    print(
        json.dumps(
            {
                "bench": "capture_overhead",
                "quick": args.quick,
                "ratio_zero_latency": round(fast.ratio, 4),
                "ratio_zero_latency_ci_low": round(intervals["0 ms"][0], 4),
                "ratio_zero_latency_ci_high": round(intervals["0 ms"][1], 4),
                "ratio_50ms": round(slow.ratio, 4),
                "ratio_dispatch_only": round(dispatch_only, 4),
                "ratio_beyond_dispatch": round(beyond, 4),
                "ratio_redacted": round(redacted, 4),
                "sqlite_events_per_s": round(sqlite_rate),
                "postgres_events_per_s": None if pg_rate is None else round(pg_rate),
                "lost_events": lost,
                "kill9_window_s": round(crash[0], 3),
                "kill9_lost_runs": crash[1],
            }
        )
    )


if __name__ == "__main__":
    main()
