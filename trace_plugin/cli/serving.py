"""Serving: ``serve`` (the gateway), ``mcp-proxy`` and ``dashboard``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from trace_plugin.cli.common import (
    DbOption,
    IdleTimeoutOption,
    MaxSessionsOption,
    _engine,
    _precision,
    _start_vllm,
    _store,
    app,
    console,
)
from trace_plugin.store import data_dir


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
