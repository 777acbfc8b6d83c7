"""Exports: ``export otel`` and ``export dataset``."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

import typer

from trace_plugin.cli.common import (
    DbOption,
    _left_out,
    _out_file,
    _store,
    _written,
    app,
    console,
)

export_app = typer.Typer(help="Send recorded episodes to other tools.", no_args_is_help=True)


app.add_typer(export_app, name="export")


@export_app.command("otel")
def export_otel(
    db: DbOption = None,
    agent: Annotated[str | None, typer.Option(help="Only this agent's episodes.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the newest N episodes.")] = None,
    content: Annotated[
        bool, typer.Option("--content", help="Include messages, tool arguments and results (may hold PII).")
    ] = False,
) -> None:
    """Send finished episodes as OpenTelemetry GenAI spans over OTLP/HTTP (set OTEL_EXPORTER_OTLP_*)."""
    try:
        from integrations.otel import export_episodes
    except ImportError:
        console.print("[red]needs the otel extra:[/] pip install 'trace-plugin[otel]'")
        raise typer.Exit(1) from None
    try:
        count = export_episodes(_store(db), agent, limit=limit, include_content=content)
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    console.print(f"[green]exported {count} episode(s)[/]")


@export_app.command("dataset")
def export_dataset(
    agent: Annotated[str, typer.Option(help="The agent whose episodes to export.")],
    out: Annotated[Path, typer.Option(help="The JSON lines file to write (a directory for --format hf).")],
    format: Annotated[
        Literal["openai", "trl", "tokens", "hf"],
        typer.Option(
            "--format",
            help="openai (its chat fine-tuning lines), trl (SFTTrainer's conversational rows), tokens"
            " (one row of ids per gateway call, for off-policy RL) or hf (the trl rows, save_to_disk).",
        ),
    ] = "trl",
    outcome: Annotated[
        Literal["success", "failure", "any"], typer.Option(help="Only these outcomes.")
    ] = "any",
    since: Annotated[datetime | None, typer.Option(help="Episodes started at or after this (UTC).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Episodes started before this (UTC).")] = None,
    min_reward: Annotated[float | None, typer.Option(help="Only episodes with at least this reward.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the newest N episodes.")] = None,
    source: Annotated[
        list[str] | None,
        typer.Option(
            help="Only episodes this source recorded (repeatable): langgraph, gateway, mcp-proxy,"
            " mcp-env, runner, environment, litellm or api."
        ),
    ] = None,
    redact: Annotated[
        bool,
        typer.Option(
            "--redact",
            help="Mask e-mails, phone and card numbers in messages and tool arguments, as capture's"
            " redact=True does (what a capture redacted is not stored: this is not 'as at capture').",
        ),
    ] = False,
    db: DbOption = None,
) -> None:
    """Write an agent's finished episodes as a fine-tuning dataset, a page at a time."""
    from trace_plugin.export import ExportError, dataset, save_hf, write_jsonl

    _out_file(out, folder=format == "hf")
    try:
        rows = dataset(
            _store(db),
            agent,
            format="trl" if format == "hf" else format,
            outcome=outcome,
            since=since,
            until=until,
            min_reward=min_reward,
            limit=limit,
            sources=source or (),
            redact=redact,
        )
    except ExportError as exc:
        raise typer.BadParameter(str(exc)) from None
    if format == "hf":
        try:
            import datasets  # noqa: F401
        except ImportError:
            console.print("[red]--format hf needs the train extra:[/] pip install 'trace-plugin[train]'")
            raise typer.Exit(1) from None
    write = save_hf if format == "hf" else write_jsonl
    count = _written(rows, f"exporting {agent}", lambda written: write(written, out))
    console.print(f"[green]wrote {count} row(s) from {rows.read} episode(s) to {out}[/]")
    _left_out(rows.left_out, "episode(s)")
