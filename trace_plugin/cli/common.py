"""What every command group shares: the app, the console, options and helpers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.console import Console
from rich.table import Table

from trace_plugin.gateway.backend import Engine
from trace_plugin.model_files import Precision
from trace_plugin.store import DB_URL_ENV, Store, data_dir

app = typer.Typer(
    help="Capture agent trajectories and improve agents from them (TRACE).", no_args_is_help=True
)


console = Console()


DbOption = Annotated[
    str | None,
    typer.Option(
        "--db", envvar=DB_URL_ENV, help="SQLAlchemy URL; default: a SQLite file in ~/.trace-plugin."
    ),
]


# Their defaults are mcp_server.transport's IDLE_TIMEOUT and MAX_SESSIONS, not imported here:
# mcp is an optional extra.
IdleTimeoutOption = Annotated[
    float,
    typer.Option(
        min=0.001, help="Over HTTP, seconds a session may sit idle before it is closed and its state freed."
    ),
]


MaxSessionsOption = Annotated[
    int,
    typer.Option(min=1, help="Over HTTP, the most sessions open at once; past it a new one is refused."),
]


def _store(db: str | None) -> Store:
    store = Store(db)
    store.upgrade()
    return store


def _fmt_time(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "—"


def _fmt_num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _short(value: Any, width: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _precision(value: str) -> Precision:
    if value not in get_args(Precision):
        raise typer.BadParameter(f"precision {value!r} is not one of {', '.join(get_args(Precision))}")
    return value  # type: ignore[return-value]


def _engine(value: str) -> Engine:
    if value not in get_args(Engine):
        choices = ", ".join(get_args(Engine))
        raise typer.BadParameter(f"engine {value!r} is not one of {choices}", param_hint="--engine")
    return value  # type: ignore[return-value]


def _start_vllm(model: str | None) -> Any:
    """Local vLLM servers for ``model`` (generation and embeddings), healthy; logs under the
    data directory."""
    from trace_plugin.gateway.vllm_server import LocalVLLM, VLLMStartError
    from trace_plugin.model_files import resolve_model

    log_dir = data_dir() / "logs"
    with console.status(f"starting vLLM (about 2 minutes on 2 cores; logs: {log_dir}/vllm*.log)…"):
        try:
            return LocalVLLM(resolve_model(model), log_dir=log_dir).start()
        except VLLMStartError as exc:
            raise typer.BadParameter(str(exc), param_hint="--engine") from None


def _environment(name: str, db: str | None = None) -> Any:
    from trace_plugin.environments.catalog import TargetError, UnknownEnvironment, env_factory

    try:
        return env_factory(name, _store(db))
    except (UnknownEnvironment, TargetError) as exc:
        raise typer.BadParameter(str(exc)) from None


def _capability_table(capabilities: list[Any], title: str) -> Table:
    table = Table(title=title)
    for column in ("capability", "selected", "coverage", "contrast Δ", "runs passed", "examples", "tools"):
        table.add_column(column)
    for c in capabilities:
        table.add_row(
            c.name,
            "[green]selected[/]" if c.selected else "—",
            f"{c.metrics['coverage']:.2f}",
            f"{c.metrics['contrast']:+.2f}",
            f"{c.metrics['passed']}/{c.metrics['runs']}",
            str(len(c.examples)),
            ", ".join(c.tools[:3]),
        )
    return table


def _status_style(status: str) -> str:
    return {"validated": "[green]validated[/]", "rejected": "[red]rejected[/]"}.get(
        status, f"[yellow]{status}[/]"
    )


def _local_gateway(stack: Any, model: str | None) -> str:
    """The embedded model behind a gateway on a background thread, for the length of ``stack``."""
    from trace_plugin.gateway import GatewayConfig, serve_embedded

    with console.status("loading the base model…"):
        server = stack.enter_context(serve_embedded(model, config=GatewayConfig(record=False)))
    return f"{server.url}/v1"


def _out_file(out: Path, *, folder: bool = False) -> None:
    """Refuse an ``--out`` that cannot be written before any work: in a folder that does not
    exist, or naming a folder where a file goes (or a file where a folder goes)."""
    if not out.parent.is_dir():
        raise typer.BadParameter(f"the folder {out.parent} does not exist", param_hint="--out")
    if out.is_dir() != folder and out.exists():
        what = "a file" if folder else "a folder"
        raise typer.BadParameter(f"{out} is {what}", param_hint="--out")


def _written(rows: Any, description: str, write: Callable[[Iterable[dict[str, Any]]], int]) -> int:
    """``write(rows)``, with a progress bar over the sources (episodes, seeds) ``rows`` reads."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(description, total=rows.total)

        def advancing() -> Iterator[dict[str, Any]]:
            for row in rows:
                progress.update(bar, completed=rows.read)
                yield row
            progress.update(bar, completed=rows.read)

        return write(advancing())


def _left_out(reasons: dict[str, int], what: str) -> None:
    for reason, count in sorted(reasons.items()):
        console.print(f"[yellow]left out {count} {what}: {reason}[/]")


def _rollout_server(url: str | None) -> dict[str, Any]:
    """Training settings that generate GRPO's rollouts on the vLLM server at ``url``, if any."""
    return {"backend": "vllm-server", "vllm_url": url} if url else {}


def _start_rollout_vllm(model: str | None) -> Any:
    """A local vLLM server generating rollouts for ``model``, healthy; its log under the data
    directory."""
    from trace_plugin.gateway.vllm_server import VLLMServer, VLLMStartError
    from trace_plugin.model_files import resolve_model

    model_dir, log_path = resolve_model(model), data_dir() / "logs" / "vllm-rollouts.log"
    with console.status(f"starting vLLM for rollouts (about 2 minutes on 2 cores; log: {log_path})…"):
        try:
            return VLLMServer(model_dir, served_name=model_dir.name, log_path=log_path).start()
        except VLLMStartError as exc:
            raise typer.BadParameter(str(exc), param_hint="--engine") from None
