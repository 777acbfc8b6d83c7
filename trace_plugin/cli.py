"""The ``trace-plugin`` command line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import typer
from rich.console import Console
from rich.table import Table

from trace_plugin.gateway.backend import Engine
from trace_plugin.model_files import Precision
from trace_plugin.records.trajectory import Episode
from trace_plugin.store import DB_URL_ENV, Store, data_dir

app = typer.Typer(
    help="Capture agent trajectories and improve agents from them (TRACE).", no_args_is_help=True
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
episodes_app = typer.Typer(help="Recorded episodes.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(episodes_app, name="episodes")

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


def _precision(value: str) -> Precision:
    if value not in get_args(Precision):
        raise typer.BadParameter(f"precision {value!r} is not one of {', '.join(get_args(Precision))}")
    return value  # type: ignore[return-value]


@app.command("serve")
def serve(
    model: Annotated[
        str | None, typer.Option(help="Local HF model dir or .gguf; default: the embedded SmolLM2-135M.")
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="embedded (in this process, starts in seconds) or vllm (a local vLLM server from "
            ".venv-vllm, started, supervised and stopped with this one)."
        ),
    ] = "embedded",
    vllm_url: Annotated[
        str | None,
        typer.Option(help="Front a vLLM server someone else runs instead of running the model here."),
    ] = None,
    precision: Annotated[
        str,
        typer.Option(help="The embedded model's weights: auto (bf16 where native), float32 or bfloat16."),
    ] = "auto",
    host: str = "127.0.0.1",
    port: int = 8000,
    adapter_root: Annotated[
        Path | None, typer.Option(help="Adapters must live under this directory.")
    ] = None,
    adapter: Annotated[
        list[str] | None, typer.Option(help="NAME@VERSION=PATH to load at start (repeatable).")
    ] = None,
    route: Annotated[
        list[str] | None, typer.Option(help="KEYWORD[,KEYWORD...]=ADAPTER keyword-routing rule (repeatable).")
    ] = None,
    agent: Annotated[
        str, typer.Option(help="Agent name for calls that do not send X-Trace-Agent.")
    ] = "gateway",
    admin_token: Annotated[str | None, typer.Option(envvar="TRACE_PLUGIN_ADMIN_TOKEN")] = None,
    allow_remote_admin: bool = False,
    record: Annotated[bool, typer.Option(help="Record every call into the store.")] = True,
    conversation_timeout: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Seconds after a reply with tool calls before a conversation with no next call is ended.",
        ),
    ] = 600.0,
    db: DbOption = None,
) -> None:
    """Serve an OpenAI-compatible API with LoRA experts, routing and capture."""
    import uvicorn

    from trace_plugin.gateway.app import GatewayConfig, GatewayConfigError, create_app
    from trace_plugin.gateway.routing import KeywordRouter
    from trace_plugin.gateway.server import header_deadline_protocol
    from trace_plugin.recorder import configure

    if _engine(engine) == "vllm" and vllm_url:
        raise typer.BadParameter("--engine vllm starts its own vLLM: drop --vllm-url", param_hint="--engine")
    try:
        config = GatewayConfig(
            adapter_root=adapter_root or data_dir() / "adapters",
            agent=agent,
            admin_token=admin_token,
            allow_remote_admin=allow_remote_admin,
            record=record,
            adapters=dict(spec.partition("=")[::2] for spec in adapter or []),
            conversation_timeout=conversation_timeout,
        )
    except GatewayConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{exc.setting.replace('_', '-')}") from None
    engine_server = _start_vllm(model) if engine == "vllm" else None
    if engine_server is not None:
        backend: Any = engine_server.backend()
    elif vllm_url:
        from trace_plugin.gateway.vllm import VLLMBackend

        backend = VLLMBackend(vllm_url, model=model)
    else:
        from trace_plugin.gateway.embedded import EmbeddedBackend

        backend = EmbeddedBackend(model, precision=_precision(precision))
    rules = []
    for rule in route or []:
        words, _, target = rule.partition("=")
        if not target:
            raise typer.BadParameter(f"route {rule!r} is not KEYWORDS=ADAPTER")
        rules.append((words.split(","), target))
    config.adapter_root.mkdir(parents=True, exist_ok=True)
    application = create_app(backend, config=config, router=KeywordRouter(rules), recorder=configure(db))
    console.print(f"serving [bold]{backend.model_id}[/] at http://{host}:{port}/v1")
    try:
        uvicorn.run(application, host=host, port=port, log_level="info", http=header_deadline_protocol())
    finally:
        if engine_server is not None:
            engine_server.stop()


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


envs_app = typer.Typer(help="Training and target environments.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")


def _environment(name: str, db: str | None = None) -> Any:
    from trace_plugin.environments.catalog import TargetError, UnknownEnvironment, env_factory

    try:
        return env_factory(name, _store(db))
    except (UnknownEnvironment, TargetError) as exc:
        raise typer.BadParameter(str(exc)) from None


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


@app.command("mcp-proxy")
def mcp_proxy(
    upstream: Annotated[
        list[str], typer.Option(help="URL of a streamable-HTTP server, or a command (repeat for args).")
    ],
    transport: Annotated[str, typer.Option(help="stdio or http")] = "stdio",
    host: str = "127.0.0.1",
    port: int = 8200,
    agent: Annotated[str, typer.Option(help="Agent name for the recorded episodes.")] = "mcp-proxy",
    idle_timeout: IdleTimeoutOption = 1800.0,
    max_sessions: MaxSessionsOption = 64,
    db: DbOption = None,
) -> None:
    """Sit between an MCP client and an MCP server, recording every tool call."""

    from mcp_server.proxy import build_proxy
    from mcp_server.transport import run, serve_http, serve_stdio
    from trace_plugin.recorder import configure

    target = upstream[0] if len(upstream) == 1 and upstream[0].startswith("http") else upstream
    server = build_proxy(target, agent=agent, recorder=configure(db))
    run(
        serve_stdio(server)
        if transport == "stdio"
        else serve_http(server, host, port, idle_timeout, max_sessions)
    )


capabilities_app = typer.Typer(help="Capabilities mined from an agent's episodes.", no_args_is_help=True)
app.add_typer(capabilities_app, name="capabilities")


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


def _status_style(status: str) -> str:
    return {"validated": "[green]validated[/]", "rejected": "[red]rejected[/]"}.get(
        status, f"[yellow]{status}[/]"
    )


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


def _local_gateway(stack: Any, model: str | None) -> str:
    """The embedded model behind a gateway on a background thread, for the length of ``stack``."""
    from trace_plugin.gateway import GatewayConfig, serve_embedded

    with console.status("loading the base model…"):
        server = stack.enter_context(serve_embedded(model, config=GatewayConfig(record=False)))
    return f"{server.url}/v1"


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


@app.command("dashboard")
def dashboard(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8300,
    host: Annotated[
        str, typer.Option(help="Interface; keep loopback unless the network is trusted.")
    ] = "127.0.0.1",
    token: Annotated[
        str | None,
        typer.Option(
            envvar="TRACE_PLUGIN_DASHBOARD_TOKEN",
            help="Needed by every client beyond loopback (?token= once, or 'Authorization: Bearer').",
        ),
    ] = None,
    db: DbOption = None,
) -> None:
    """A read-only web view of the episodes, success over time and mined capabilities."""
    import uvicorn

    from trace_plugin.dashboard import create_dashboard
    from trace_plugin.gateway.state import is_loopback

    if token is not None and not token.strip():
        raise typer.BadParameter("a blank token", param_hint="--token")
    if not is_loopback(host) and not token:
        raise typer.BadParameter(
            f"{host} serves beyond loopback, and episodes are raw data: give --token", param_hint="--host"
        )
    application = create_dashboard(_store(db), admin_token=token)
    console.print(
        f"dashboard at http://{host}:{port}/ (read-only{', token required beyond loopback' if token else ''})"
    )
    uvicorn.run(application, host=host, port=port, log_level="info")


@app.command("demo")
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="The small preset (about 15 minutes here).")] = False,
    out: Annotated[Path | None, typer.Option(help="Where to write demo.md, demo.png and demo.json.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming.")] = False,
    engine: Annotated[
        str, typer.Option(help="embedded, or vllm: a local vLLM server from .venv-vllm serves the agent.")
    ] = "embedded",
) -> None:
    """The whole loop on the embedded model: before, traffic, improve, hot-swap, after.

    Each stage is kept under ~/.trace-plugin/demo/PRESET as it ends: run the same command
    again after a kill and it picks up where it stopped."""
    from trace_plugin.demo import DemoError, main

    try:
        main("quick" if quick else "default", out=out, fresh=fresh, engine=_engine(engine))
    except DemoError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None


@app.command("improve")
def improve(
    agent: Annotated[str, typer.Option(help="The agent to improve.")],
    gateway_url: Annotated[str, typer.Option(help="The gateway serving the agent (no /v1).")],
    adapter_root: Annotated[Path, typer.Option(help="The gateway's adapter root; experts are written here.")],
    watch: Annotated[bool, typer.Option("--watch/--once", help="Keep monitoring and improving.")] = False,
    target: Annotated[
        str | None,
        typer.Option(
            help="A target for held-out evaluation: retail, one a package registers"
            " (entry points trace_plugin.targets), or package.module:attribute."
        ),
    ] = None,
    target_tasks: Annotated[int, typer.Option(help="How many of its test tasks to evaluate on.")] = 32,
    rollouts: Annotated[int, typer.Option(help="GRPO rollout budget per expert.")] = 200,
    preset: Annotated[str, typer.Option(help="cpu-small or gpu")] = "cpu-small",
    ray: Annotated[str | None, typer.Option(help="Train on this Ray cluster ('auto' or an address).")] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Where the experts' GRPO rollouts are generated: embedded (in the training process)"
            " or vllm (a local vLLM server from .venv-vllm, started and stopped with this command;"
            " the policy's LoRA is loaded there by name at each step)."
        ),
    ] = "embedded",
    vllm_url: Annotated[
        str | None,
        typer.Option(
            help="Generate the rollouts on a vLLM server someone else runs: the same base model,"
            " --enable-lora with runtime LoRA updating, on this filesystem."
        ),
    ] = None,
    router: Annotated[
        str,
        typer.Option(
            help="How several experts are chosen: classifier (the base model over retrieved candidates,"
            " a top-p weighted mixture), top1 (its single best) or gate (learned)."
        ),
    ] = "classifier",
    min_new_episodes: Annotated[
        int, typer.Option(help="Trigger: labeled episodes since the last cycle.")
    ] = 50,
    canary: Annotated[
        float | None,
        typer.Option(
            help="Deploy as a canary on this share of the traffic (0.01 to 0.99); the monitor"
            " (--watch) promotes it or rolls it back against the rest of the traffic."
        ),
    ] = None,
    canary_deadline: Annotated[
        float,
        typer.Option(
            help="Seconds a canary trial may take to fill its window; then it is judged on what it"
            " has, or rolled back with too few episodes."
        ),
    ] = 86_400.0,
    admin_token: Annotated[str | None, typer.Option(envvar="TRACE_PLUGIN_ADMIN_TOKEN")] = None,
    db: DbOption = None,
) -> None:
    """Mine, synthesize, train, judge and deploy, once or continuously (one improver per agent)."""
    from trace_plugin.improver import ConfigError, Improver, ImproverConfig
    from trace_plugin.recorder import configure
    from trace_plugin.store.lease import LeaseHeld

    if _engine(engine) == "vllm" and vllm_url:
        raise typer.BadParameter("--engine vllm starts its own vLLM: drop --vllm-url", param_hint="--engine")
    try:  # the config checks the settings and loads the target: its errors, as the option's
        config = ImproverConfig(
            agent=agent,
            gateway_url=gateway_url,
            adapter_root=adapter_root,
            admin_token=admin_token,
            target=target,
            target_tasks=target_tasks,
            min_new_episodes=min_new_episodes,
            preset=preset,
            training={"rollout_budget": rollouts, **_rollout_server(vllm_url)},
            router=router,
            canary=canary,
            canary_deadline=canary_deadline,
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{exc.setting.replace('_', '-')}") from None
    executor = None
    if ray:
        from training.executors import RayExecutor

        executor = RayExecutor(None if ray == "auto" else ray)
    rollout_server = _start_rollout_vllm(config.model) if engine == "vllm" else None
    if rollout_server is not None:
        config.training = replace(config.training, **_rollout_server(rollout_server.url))
    try:
        improver = Improver(_store(db), config, executor=executor, recorder=configure(db), console=console)
        if watch:
            improver.watch()
        else:
            deployment = improver.run_once()
            console.print(
                f"{deployment.id}: {deployment.status}" if deployment else "nothing deployed this cycle"
            )
    except LeaseHeld as exc:
        console.print(f"[red]{exc}: another improver is running for {agent!r}[/]")
        raise typer.Exit(3) from None
    finally:
        if rollout_server is not None:
            rollout_server.stop()


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
