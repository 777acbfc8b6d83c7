"""The schema and recorded episodes: ``db``, ``episodes``, ``stats``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from trace_plugin.cli.common import (
    DbOption,
    _fmt_num,
    _fmt_time,
    _short,
    _store,
    app,
    console,
)
from trace_plugin.records.trajectory import Episode
from trace_plugin.store import Store

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)


episodes_app = typer.Typer(help="Recorded episodes.", no_args_is_help=True)


app.add_typer(db_app, name="db")


app.add_typer(episodes_app, name="episodes")


@db_app.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Create or migrate the schema to the latest version."""
    store = Store(db)
    store.upgrade()
    console.print(f"[green]schema up to date[/] at {store.engine.url.render_as_string(hide_password=True)}")


@episodes_app.command("list")
def episodes_list(
    db: DbOption = None,
    agent: Annotated[str | None, typer.Option(help="Only this agent's episodes.")] = None,
    status: Annotated[str | None, typer.Option(help="running, completed, error or interrupted.")] = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
) -> None:
    """The newest episodes."""
    episodes = _store(db).list_episodes(agent, status=status, limit=limit)
    table = Table(title=f"{len(episodes)} episode(s)")
    for column in ("id", "agent", "started", "status", "reward", "label", "model", "source"):
        table.add_column(column, no_wrap=column == "id")
    for e in episodes:
        table.add_row(
            e.id,
            e.agent,
            _fmt_time(e.started_at),
            _status(e),
            _fmt_num(e.reward),
            e.label or "—",
            e.model or "—",
            e.source,
        )
    console.print(table)


def _status(e: Episode) -> str:
    color = {"completed": "green", "error": "red", "running": "yellow"}.get(e.status, "magenta")
    return f"[{color}]{e.status}[/]"


@episodes_app.command("show")
def episodes_show(episode_id: str, db: DbOption = None) -> None:
    """One episode with its steps."""
    store = _store(db)
    episode = store.get_episode(episode_id)
    if episode is None:
        console.print(f"[red]no episode {episode_id}[/]")
        raise typer.Exit(1)
    console.print(
        f"[bold]{episode.id}[/]  agent={episode.agent}  status={_status(episode)}  "
        f"reward={_fmt_num(episode.reward)}  label={episode.label or '—'}  model={episode.model or '—'}"
    )
    console.print(f"input:  {_short(episode.input, 160)}")
    console.print(f"output: {_short(episode.output, 160)}")
    if episode.error:
        console.print(f"[red]error: {episode.error}[/]")
    table = Table(title=f"{len(episode.steps)} step(s)")
    for column in ("#", "kind", "name", "call id", "ms", "input", "output / error"):
        table.add_column(column)
    for s in episode.steps:
        result = f"[red]{_short(s.error, 60)}[/]" if s.error else _short(s.output, 60)
        table.add_row(
            str(s.seq),
            s.kind,
            s.name,
            s.tool_call_id or "",
            _fmt_num(s.latency_ms, 1),
            _short(s.input, 50),
            result,
        )
    console.print(table)
    for f in store.feedback_for(episode_id):
        console.print(
            f"feedback ({f.source}): reward={_fmt_num(f.reward)} label={f.label or '—'} {f.comment or ''}"
        )


@app.command("stats")
def stats(db: DbOption = None) -> None:
    """Success rate per agent."""
    rows = _store(db).stats()
    table = Table(title="Agents")
    for column in ("agent", "episodes", "finished", "with outcome", "success rate", "mean reward"):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for r in rows:
        rate = "—" if r.success_rate is None else f"{r.success_rate:.1%}"
        table.add_row(
            r.agent, str(r.episodes), str(r.finished), str(r.with_outcome), rate, _fmt_num(r.mean_reward)
        )
    console.print(table)
