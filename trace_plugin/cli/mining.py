"""Mining: ``mine`` and ``capabilities``."""

from __future__ import annotations

from typing import Annotated

import typer

from trace_plugin.cli.common import (
    DbOption,
    _capability_table,
    _short,
    _store,
    app,
    console,
)

capabilities_app = typer.Typer(help="Capabilities mined from an agent's episodes.", no_args_is_help=True)


app.add_typer(capabilities_app, name="capabilities")


@app.command("mine")
def mine(
    agent: Annotated[str, typer.Option(help="The agent whose episodes to mine.")],
    db: DbOption = None,
    limit: Annotated[int | None, typer.Option(help="Mine only the newest N episodes.")] = None,
    llm: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL", help="Mine with this litellm model (e.g. gpt-4o-mini) instead of the detectors."
        ),
    ] = None,
    runs: Annotated[
        int | None, typer.Option(min=1, help="With --llm: labeling runs (default: the rule's N, 10).")
    ] = None,
) -> None:
    """Find the capabilities the agent lacks (offline detectors, or an LLM, + TRACE's selection rule)."""
    from trace_plugin.mining.miner import OfflineMiner

    if runs is not None and llm is None:
        raise typer.BadParameter("--runs needs --llm", param_hint="--runs")
    if llm is None:
        with console.status("labeling episodes and resampling…"):
            capabilities = OfflineMiner(_store(db)).mine(agent, limit=limit)
    else:
        from trace_plugin.mining.analyzer import LLMAnalyzer

        analyzer = LLMAnalyzer(_store(db), llm, runs=runs)
        with console.status(f"{llm} is proposing and labeling capabilities…"):
            capabilities = analyzer.mine(agent, limit=limit)
        s = analyzer.stats
        problem = f"; last problem: {_short(s.last_problem)}" if s.last_problem else ""
        console.print(
            f"{llm}: {s.calls} calls, {s.retries} retries, "
            f"{s.dropped} of {s.requests} questions dropped{problem}"
        )
    if not capabilities:
        usable = ", or no usable answers from the model" if llm else ""
        console.print(
            f"[yellow]no capabilities for agent {agent!r}: no finished episodes with an outcome{usable}[/]"
        )
        raise typer.Exit(1)
    console.print(
        _capability_table(capabilities, f"Capabilities of {agent} (run {capabilities[0].mining_run})")
    )


@capabilities_app.command("list")
def capabilities_list(agent: Annotated[str, typer.Option()], db: DbOption = None) -> None:
    """The capabilities of the latest mining run."""
    capabilities = _store(db).capabilities(agent)
    console.print(_capability_table(capabilities, f"Capabilities of {agent}"))


@capabilities_app.command("show")
def capabilities_show(name: str, agent: Annotated[str, typer.Option()], db: DbOption = None) -> None:
    """One capability of the latest mining run, with its evidence."""
    found = [c for c in _store(db).capabilities(agent) if c.name == name]
    if not found:
        console.print(f"[red]no capability {name!r} in the latest mining run of {agent!r}[/]")
        raise typer.Exit(1)
    c = found[0]
    console.print(
        f"[bold]{c.name}[/] ({'selected' if c.selected else 'not selected'}, {c.source}): {c.description}"
    )
    console.print(
        f"coverage {c.metrics['coverage']:.2f}, contrast Δ {c.metrics['contrast']:+.2f}, "
        f"passed {c.metrics['passed']}/{c.metrics['runs']} runs; rule {c.metrics['rule']}"
    )
    console.print(f"tools involved: {', '.join(c.tools) or '—'}")
    for episode_id in c.examples:
        console.print(f"  example failure: {episode_id}  (trace-plugin episodes show {episode_id})")
