"""The loop: ``demo`` and ``improve``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from trace_plugin.cli.common import (
    DbOption,
    _engine,
    _rollout_server,
    _start_rollout_vllm,
    _store,
    app,
    console,
)


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
