"""Environments: ``envs`` and ``synthesize``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.table import Table

from trace_plugin.cli.common import (
    DbOption,
    IdleTimeoutOption,
    MaxSessionsOption,
    _environment,
    _left_out,
    _local_gateway,
    _out_file,
    _short,
    _status_style,
    _store,
    _written,
    app,
    console,
)

envs_app = typer.Typer(help="Training and target environments.", no_args_is_help=True)


app.add_typer(envs_app, name="envs")


@envs_app.command("serve")
def envs_serve(
    name: str,
    transport: Annotated[str, typer.Option(help="stdio or http")] = "stdio",
    host: str = "127.0.0.1",
    port: int = 8100,
    idle_timeout: IdleTimeoutOption = 1800.0,
    max_sessions: MaxSessionsOption = 64,
    db: DbOption = None,
) -> None:
    """Serve an environment over MCP (each session gets its own instance)."""
    from mcp_server.environments import build_server
    from mcp_server.transport import run, serve_http, serve_stdio
    from trace_plugin.recorder import configure

    server = build_server(name, _environment(name, db), recorder=configure(db))
    run(
        serve_stdio(server)
        if transport == "stdio"
        else serve_http(server, host, port, idle_timeout, max_sessions)
    )


@envs_app.command("list")
def envs_list(db: DbOption = None) -> None:
    """Targets (bundled and registered) and the synthesized environments in the store
    (latest versions)."""
    from trace_plugin.environments.catalog import BUNDLED, registered_targets

    table = Table(title="Environments")
    for column in ("name", "version", "capability", "status", "tools", "templates", "agent"):
        table.add_column(column)
    for name, target in BUNDLED.items():
        table.add_row(name, "bundled", "—", "target", str(len(target.factory().tools)), "—", "—")
    for name in registered_targets():
        table.add_row(name, "registered", "—", "target", "—", "—", "—")
    seen: set[str] = set()
    for record in _store(db).env_specs():
        if record.spec.name not in seen:
            seen.add(record.spec.name)
            spec = record.spec
            table.add_row(
                spec.name,
                str(record.version),
                spec.capability,
                _status_style(record.status),
                str(len(spec.tools)),
                str(len(spec.tasks)),
                record.agent,
            )
    console.print(table)


@envs_app.command("show")
def envs_show(
    name: str,
    seed: Annotated[int, typer.Option(help="Show this seed's task.")] = 0,
    db: DbOption = None,
) -> None:
    """An environment's policy, tools and one task (and a synthesized one's reports)."""
    env = _environment(name, db)()
    task = env.reset(seed)
    console.print(f"[bold]{name}[/]\n{env.system_prompt}\n")
    console.print("tools: " + ", ".join(t["function"]["name"] for t in env.tools))
    console.print(f"task {seed} ({task.kind}): {task.prompt}")
    reference = task.metadata.get("reference") or []
    console.print("reference: " + " → ".join(f"{a['name']}({_short(a['arguments'], 60)})" for a in reference))
    record = _store(db).env_spec(name)
    if record is not None:
        console.print(f"version {record.version}, {_status_style(record.status)}; hint: {record.spec.hint!r}")
        console.print_json(data=record.report)


@envs_app.command("validate")
def envs_validate(
    name: str,
    seeds: Annotated[int, typer.Option(help="How many validation seeds to play.")] = 100,
    db: DbOption = None,
) -> None:
    """Re-run the policy checks on a synthesized environment: reference, do-nothing, random."""
    from trace_plugin.environments.validation import VALIDATION_SEEDS, check_policies

    record = _store(db).env_spec(name)
    if record is None:
        raise typer.BadParameter(f"no synthesized environment {name!r}")
    check = check_policies(record.spec, VALIDATION_SEEDS[:seeds])
    table = Table(title=f"{name} v{record.version}: {check.seeds} seeds")
    for column in ("policy", "score", "must be"):
        table.add_column(column)
    table.add_row("reference (success rate)", f"{check.reference_success:.2f}", "≥ 0.99")
    table.add_row("do nothing (mean reward)", f"{check.do_nothing_mean:.2f}", "≤ 0.20")
    table.add_row("random calls (mean reward)", f"{check.random_mean:.2f}", "≤ 0.20")
    console.print(table)
    for problem in check.problems:
        console.print(f"[red]✗ {problem}[/]")
    if not check.passed:
        raise typer.Exit(1)
    console.print("[green]valid[/]")


@envs_app.command("export-plays")
def envs_export_plays(
    name: str,
    seeds: Annotated[
        str, typer.Option(help="A:B, the seeds A to B-1 (an expert's warm start draws from 0:2000).")
    ],
    out: Annotated[Path, typer.Option(help="The JSON lines file to write.")],
    format: Annotated[
        Literal["trl", "openai"], typer.Option("--format", help="trl (SFTTrainer's rows) or openai.")
    ] = "trl",
    preset: Annotated[
        str,
        typer.Option(help="The training preset whose turn and tool-result limits apply: cpu-small or gpu."),
    ] = "cpu-small",
    db: DbOption = None,
) -> None:
    """Write an environment's verified reference solutions as the warm start trains on them,
    behind the agent's own few-shot examples, to inspect or to train with elsewhere."""
    from trace_plugin.environments.synthesis import CapturedInterface
    from trace_plugin.export import reference_plays, write_jsonl
    from training.config import ExpertTrainingConfig

    bounds = re.fullmatch(r"([0-9]+):([0-9]+)", seeds)  # not str.isdigit: it takes "²"
    if bounds is None or int(bounds[1]) >= int(bounds[2]):
        raise typer.BadParameter(f"{seeds!r} is not A:B with A < B", param_hint="--seeds")
    first, stop = bounds.groups()
    _out_file(out)
    try:
        config = ExpertTrainingConfig.preset(preset)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from None
    store = _store(db)
    factory = _environment(name, db)
    record = store.env_spec(name)
    examples = CapturedInterface.from_store(store, record.agent).examples if record else []
    plays = reference_plays(
        factory,
        range(int(first), int(stop)),
        format=format,
        max_turns=config.max_turns,
        max_observation_chars=config.max_observation_chars,
        examples=examples,
    )
    count = _written(plays, f"playing {name}", lambda rows: write_jsonl(rows, out))
    console.print(f"[green]wrote {count} reference play(s) of {plays.read} seed(s) to {out}[/]")
    _left_out(plays.left_out, "seed(s)")


@app.command("synthesize")
def synthesize_command(
    capability: str,
    agent: Annotated[str, typer.Option(help="The agent whose traffic and mined capability to use.")],
    calibrate: Annotated[bool, typer.Option(help="Calibrate difficulty with the base model.")] = True,
    base_url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible endpoint of the base model; default: run it here.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model name (or local dir, when run here).")] = None,
    llm: Annotated[
        str | None, typer.Option(metavar="MODEL", help="Let this litellm model propose the spec (validated).")
    ] = None,
    db: DbOption = None,
) -> None:
    """Synthesize, check and calibrate a training environment for a mined capability."""
    import asyncio
    from contextlib import ExitStack

    from trace_plugin.environments.catalog import chat_player, prepare_environment

    store = _store(db)
    found = [c for c in store.capabilities(agent) if c.name == capability]
    if not found:
        raise typer.BadParameter(f"no capability {capability!r} in the latest mining run of {agent!r}")
    with ExitStack() as stack:
        play = None
        if calibrate:
            if base_url is None:
                base_url, model = _local_gateway(stack, model), "base"
            play = chat_player(base_url, model or "base", agent=f"calibration:{capability}", max_tokens=96)
        propose_with = None
        if llm is not None:
            from trace_plugin.mining.analyzer import LiteLLMComplete

            propose_with = LiteLLMComplete(llm)
        record = asyncio.run(
            prepare_environment(
                store,
                agent,
                found[0],
                play=play,
                propose_with=propose_with,
                progress=lambda m: console.print(m),
            )
        )
    console.print(
        f"{record.spec.name} v{record.version}: {_status_style(record.status)} "
        f"({len(record.spec.tools)} tools, {len(record.spec.tasks)} templates)"
    )
    for problem in record.report["policies"]["problems"]:
        console.print(f"[red]✗ {problem}[/]")
    proposal = record.report.get("proposal")
    if proposal is not None:
        verdict = (
            "[green]accepted[/]" if proposal["accepted"] else "[yellow]rejected; kept the offline spec[/]"
        )
        console.print(f"{llm}'s proposal: {verdict}")
        for problem in proposal["problems"]:
            console.print(f"  [yellow]✗ {_short(problem, 160)}[/]")
