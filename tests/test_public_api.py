"""What a team's own code can reach without trace-plugin's internals: the gateway run in
this process (``trace_plugin.gateway.serve_embedded``), and what a cycle trained, whatever
it deployed (``Improver.run_cycle``), loaded by hand with ``GatewayAdmin.ensure_adapter``."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import pytest
from chat import chat

import trace_plugin.gateway
from trace_plugin.gateway import GatewayAdmin, GatewayConfig, RunningServer, serve_embedded
from trace_plugin.improver import (
    CycleEnd,
    Evaluation,
    Improver,
    ImproverConfig,
    Mined,
    Routing,
    Scores,
    Screened,
    Synthesized,
    Trained,
    stages,
)
from trace_plugin.improver import evaluation as evaluation_module
from trace_plugin.records.router_spec import StaticSpec
from trace_plugin.store import Store

LOOP = Path(__file__).parents[1] / "examples" / "function_agent" / "function_agent" / "loop.py"


def test_the_function_agent_reaches_the_gateway_by_its_public_names_only():
    """Its docstring says it reaches into no internals: no gateway module but the package."""
    imported: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(LOOP.read_text())):
        if isinstance(node, ast.Import):
            imported += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported += [(node.module, alias.name) for alias in node.names]
    gateway = [(module, name) for module, name in imported if module.startswith("trace_plugin.gateway")]
    assert gateway and all(module == "trace_plugin.gateway" for module, _ in gateway), gateway
    assert {name for _, name in gateway} <= set(trace_plugin.gateway.__all__)


def test_the_embedded_gateway_runs_in_process_and_stops(tmp_path):
    """The real embedded model behind the gateway on a thread: a chat completion, then its
    ``with`` block ends it, server thread and all."""
    config = GatewayConfig(adapter_root=tmp_path, agent="a", record=False)
    with serve_embedded(config=config, precision="float32", max_batch=2) as gateway:
        assert isinstance(gateway, RunningServer)
        # The handle names what it serves: the model id requests may use, and its precision.
        assert (gateway.model, gateway.precision) == ("SmolLM2-135M-Instruct", "float32")
        assert chat(gateway.url, gateway.model, "Say hello.", max_tokens=2).status_code == 200
        r = chat(gateway.url, "default", "Say hello.", max_tokens=4)
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        assert choice["message"]["role"] == "assistant" and r.json()["usage"]["completion_tokens"] >= 1
    assert not gateway.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.url}/health", timeout=5)


def _scripted(store: Store, improver: Improver, monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    """Mining selects ``capability``, synthesis gives it a validated retail environment, and
    the live agent fails there."""
    from trace_plugin.environments.retail import POLICY, TOOLS
    from trace_plugin.environments.synthesis import synthesize

    record = store.save_env_spec("a", synthesize(capability, TOOLS, system_prompt=POLICY), "validated", {})
    mined = Mined(selected=[capability], covered=[], train=[capability])
    monkeypatch.setattr(stages, "mine", lambda _: mined)

    async def synthesized(_: str) -> Synthesized:
        return Synthesized(env=record.spec.name, version=record.version, status="validated")

    async def screened(_: Synthesized) -> Screened:  # the live agent fails it
        return Screened("base", 0.0, 0.0, True)

    monkeypatch.setattr(improver, "synthesize", synthesized)
    monkeypatch.setattr(improver, "screen", screened)


def test_a_rejected_cycle_names_its_experts_and_candidate_router(sqlite_url, tmp_path, monkeypatch):
    """The gate rejects the candidate: the cycle's result still names the expert, its adapter
    and the router composed of it, and says why nothing was deployed."""
    store = Store(sqlite_url)
    store.upgrade()
    improver = Improver(store, ImproverConfig("a", "http://127.0.0.1:9", tmp_path))
    _scripted(store, improver, monkeypatch, "fmt")
    trained = Trained("e1", str(tmp_path / "fmt" / "e1"), [0.0], [0.0], adapter_name="fmt@e1")
    monkeypatch.setattr(stages, "train", lambda *_: trained)
    router = StaticSpec(adapter="fmt")

    async def routed(experts: dict[str, str]) -> Routing:
        return Routing(router)

    async def evaluated(improver, cycle, experts, routing) -> Evaluation:  # no better than the base
        return Evaluation({"fmt": "fmt@e1"}, routing.router, {"fmt": Scores(0.5, 0.5, 0.5)})

    monkeypatch.setattr(improver, "route", routed)
    monkeypatch.setattr(evaluation_module, "evaluate", evaluated)
    end = improver.run_cycle()
    assert end.deployed is None and end.reason == "no capability improved on its held-out seeds"
    assert end.trained == {"fmt": trained} and end.router == router
    [job] = [j for j in store.jobs("a") if j.stage == "cycle"]
    assert CycleEnd.from_dict(job.outputs) == end  # as stored with its job
    assert improver.run_once() is None  # a cycle like it through run_once: no deployment, as before


def test_an_expert_no_gradient_reached_is_named_and_loads_by_hand(sqlite_url, tmp_path, monkeypatch):
    """Training yields nothing (every lora_B zero): the cycle composes no candidate, yet its
    result names the expert and its adapter, which ``ensure_adapter`` loads into a running
    gateway, where a request names it."""
    from trace_plugin.model_files import resolve_model
    from training.experts import ExpertResult
    from training.lora import random_adapter

    class Flat:
        """An executor whose training never moved the adapter off its zero initialization."""

        def run(self, jobs: list) -> list[ExpertResult]:
            [job] = jobs
            base = resolve_model(None)
            adapter = random_adapter(base, Path(job.config["output_dir"]), seed=0, scale=0.0)
            return [
                ExpertResult(
                    adapter_dir=adapter,
                    adapter_sha256="",
                    reward_curve=[0.0],
                    unhinted_curve=[0.0],
                    config=job.config,
                    base_model=base,
                    base_model_sha256="",
                    steps=1,
                    logs=[],
                )
            ]

    store = Store(sqlite_url)
    store.upgrade()
    config = GatewayConfig(adapter_root=tmp_path, agent="a", record=False)
    with serve_embedded(config=config, precision="float32", max_batch=2) as gateway:
        improver = Improver(store, ImproverConfig("a", gateway.url, tmp_path), executor=Flat())
        _scripted(store, improver, monkeypatch, "tool_call_format")
        end = improver.run_cycle()
        assert end.deployed is None and end.router is None
        assert end.reason == "no gradient reached the adapters of ['tool_call_format']"
        [(capability, trained)] = end.trained.items()
        [expert] = store.experts("a")
        assert capability == "tool_call_format" and trained.noop and trained.expert == expert.id
        assert (trained.adapter_name, trained.adapter) == (expert.adapter_name, expert.adapter_path)
        admin = GatewayAdmin(gateway.url)
        assert trained.adapter_name not in asyncio.run(admin.adapters())  # no candidate was loaded
        asyncio.run(admin.ensure_adapter(trained.adapter_name, trained.adapter))
        assert trained.adapter_name in asyncio.run(admin.adapters())
        r = chat(gateway.url, trained.adapter_name, "Say hello.", max_tokens=2)
        assert r.status_code == 200 and r.json()["model"] == trained.adapter_name, r.text
