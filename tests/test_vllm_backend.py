"""The vLLM backend, tested against the embedded gateway, which speaks vLLM's HTTP contract
(completions with token ids, runtime LoRA loading). The real-vLLM run is scripts/gpu_check.sh."""

from __future__ import annotations

import httpx
import pytest
from chat import chat as served
from fastapi import FastAPI, Request
from load import http_swap_under_load

from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.backend import BackendError
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.gateway.vllm import VLLMBackend
from trace_plugin.records.mixture import Mixture
from training.lora import random_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A stand-in vLLM server (the embedded gateway) and our gateway in front of it."""
    root = tmp_path_factory.mktemp("adapters")
    inner_backend = EmbeddedBackend(precision="float32")
    random_adapter(inner_backend.model_dir, root / "alpha" / "1", seed=11)
    random_adapter(inner_backend.model_dir, root / "alpha" / "2", seed=12)
    vllm_like = GatewayConfig(adapter_root=root, record=False, hot_swap=False)  # vLLM: names are independent
    inner = start_in_thread(create_app(inner_backend, config=vllm_like))
    outer_backend = VLLMBackend(inner.url)
    outer = start_in_thread(create_app(outer_backend, config=GatewayConfig(adapter_root=root, record=False)))
    yield inner, outer
    outer.stop()
    inner.stop()


def chat(url: str, model: str, text: str, **extra) -> dict:
    r = served(url, model, text, **extra)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_tokens_through_the_vllm_backend(stack):
    inner, outer = stack
    direct, fronted = (
        chat(inner.url, "SmolLM2-135M-Instruct", "Name a fruit."),
        chat(outer.url, "SmolLM2-135M-Instruct", "Name a fruit."),
    )
    assert fronted["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert fronted["prompt_token_ids"] == direct["prompt_token_ids"]
    assert fronted["choices"][0]["message"] == direct["choices"][0]["message"]


async def test_top_logprobs_through_the_vllm_contract(stack):
    """What the classifier router reads: the likeliest next tokens, as vLLM returns them."""
    from trace_plugin.gateway.backend import SamplingParams

    inner, _ = stack
    backend = VLLMBackend(inner.url)
    prompt = backend.render([{"role": "user", "content": "Reply with one letter: A or B?"}], None)
    [completion] = await backend.generate(prompt, SamplingParams(max_tokens=1, top_logprobs=5), None)
    [top] = completion.top_logprobs
    assert len(top) == 5 and all(v <= 0 for v in top.values())
    assert max(top, key=top.__getitem__) == completion.text  # greedy took the likeliest token
    await backend.close()


async def test_bad_words_reach_the_model_server(stack):
    """The gateway's ban on writing a tool's answer must hold when vLLM generates."""
    from trace_plugin.gateway.backend import SamplingParams

    inner, _ = stack
    backend = VLLMBackend(inner.url)
    prompt = backend.render([{"role": "user", "content": "Say: hello hello hello"}], None)
    [free] = await backend.generate(prompt, SamplingParams(max_tokens=8), None)
    word = free.text.split()[0]
    [banned] = await backend.generate(prompt, SamplingParams(max_tokens=8, bad_words=(word,)), None)
    assert word and word not in banned.text and banned.token_ids != free.token_ids
    await backend.close()


def test_runtime_lora_through_the_vllm_contract_and_hot_swap(stack):
    inner, outer = stack
    r = httpx.post(
        f"{outer.url}/v1/load_lora_adapter", json={"lora_name": "alpha@1", "lora_path": "alpha/1"}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert "alpha@1" in {m["id"] for m in httpx.get(f"{inner.url}/v1/models").json()["data"]}
    served = chat(outer.url, "alpha", "Tell me a fact.")
    assert served["model"] == "alpha@1"
    assert (
        served["choices"][0]["token_ids"]
        == chat(inner.url, "alpha@1", "Tell me a fact.")["choices"][0]["token_ids"]
    )

    served, failures = http_swap_under_load(outer.url, "alpha", "2", "alpha/2", before=8)
    assert failures == [] and all(s.model == "alpha@2" for s in served if s.after_swap)
    loaded = {m["id"] for m in httpx.get(f"{inner.url}/v1/models").json()["data"]}
    assert "alpha@1" not in loaded, "the old version was unloaded from vLLM once drained"


def test_a_mixture_is_one_composed_adapter_loaded_once_through_the_vllm_contract(stack):
    """vLLM serves one adapter per request: a mixture reaches it as the rank-concatenation of
    its weighted adapters, registered under a name derived from the weights, and reused."""
    inner, outer = stack
    for name, path in (("gamma@1", "alpha/1"), ("delta@1", "alpha/2")):
        body = {"lora_name": name, "lora_path": path}
        assert httpx.post(f"{outer.url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    mixed = [chat(outer.url, "gamma:0.6,delta:0.4", "Tell me a fact.") for _ in range(2)]
    assert mixed[0]["model"] == "delta@1:0.4,gamma@1:0.6"
    composed = Mixture.parse(mixed[0]["model"]).served_name()
    listed = httpx.get(f"{inner.url}/v1/models").json()["data"]
    assert [m["id"] for m in listed if m["id"].startswith("mix-")] == [composed]  # loaded once, by its name
    assert mixed[0]["choices"][0]["token_ids"] == mixed[1]["choices"][0]["token_ids"]
    direct = chat(inner.url, composed, "Tell me a fact.")  # what vLLM itself serves under that name
    assert mixed[0]["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    single = chat(outer.url, "gamma", "Tell me a fact.")["choices"][0]["token_ids"]
    assert single != mixed[0]["choices"][0]["token_ids"]


def test_a_named_tool_choice_is_forced_through_the_vllm_contract(stack):
    """vLLM completes the prompt it is sent: a call tool_choice requires starts in the prompt."""
    from support.requests import retail_ticket

    _, outer = stack
    messages, tools = retail_ticket()
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "find_user"}},
        "temperature": 0,
        "max_tokens": 60,
    }
    r = httpx.post(f"{outer.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["find_user"]


async def test_the_vllm_backend_streams_deltas_then_each_whole_completion(stack):
    """vLLM's stream (text and token ids per chunk) becomes our deltas, then the same
    completion ``generate`` returns."""
    from trace_plugin.gateway.backend import Delta, Finished, SamplingParams

    inner, _ = stack
    backend = VLLMBackend(inner.url)
    prompt = backend.render([{"role": "user", "content": "Tell me about the sea."}], None)
    params = SamplingParams(max_tokens=24)
    [whole] = await backend.generate(prompt, params, None)
    events = [event async for event in await backend.stream(prompt, params, None)]
    deltas = [e.text for e in events if isinstance(e, Delta)]
    [finished] = [e for e in events if isinstance(e, Finished)]
    assert len(deltas) >= 10 and "".join(deltas) == whole.text == finished.completion.text
    assert finished.completion.token_ids == whole.token_ids
    assert finished.completion.prompt_token_ids == whole.prompt_token_ids
    with pytest.raises(BackendError) as refused:  # refused before anything streams: a status code
        await backend.stream(prompt, params, "no-such-adapter")
    assert refused.value.status == 404
    await backend.close()


def test_a_stream_through_the_vllm_backend_and_a_client_that_leaves_it(stack):
    """Through our gateway on vLLM, chunks arrive as vLLM generates them; a client that
    hangs up closes the connection to vLLM, whose generation of that row stops."""
    import time

    from support.requests import content_of

    inner, outer = stack
    ask = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24}
    ask["messages"] = [{"role": "user", "content": "Tell me about the sea."}]
    whole = chat(outer.url, ask["model"], "Tell me about the sea.", max_tokens=24)
    with httpx.stream(
        "POST", f"{outer.url}/v1/chat/completions", json={**ask, "stream": True}, timeout=120
    ) as r:
        pieces = [content_of(line) for line in r.iter_lines()]
    assert len([p for p in pieces if p]) >= 10
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    vllm = inner.server.config.app.state.backend
    before = vllm.cancelled_rows
    story = {**ask, "max_tokens": 400, "stream": True}
    story["messages"] = [{"role": "user", "content": "Write a very long story about a lighthouse."}]
    with httpx.stream("POST", f"{outer.url}/v1/chat/completions", json=story, timeout=120) as r:
        next(line for line in r.iter_lines() if content_of(line))
    for _ in range(100):  # the hang-up travels through two servers
        if vllm.cancelled_rows > before:
            break
        time.sleep(0.1)
    assert vllm.cancelled_rows == before + 1


def test_a_learned_gate_routes_through_the_vllm_contract(stack):
    """The gate reads the base model's embeddings from vLLM's /v1/embeddings and weighs the
    adapters per layer, through the outer gateway."""
    inner, outer = stack
    texts = ["Where is my order #W1?", "I want to return a lamp."]
    direct = httpx.post(f"{inner.url}/v1/embeddings", json={"model": "base", "input": texts}, timeout=60)
    fronted = httpx.post(
        f"{outer.url}/v1/embeddings", json={"model": "SmolLM2-135M-Instruct", "input": texts}, timeout=60
    )
    assert direct.status_code == fronted.status_code == 200, fronted.text
    for a, b in zip(direct.json()["data"], fronted.json()["data"], strict=True):
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-5)
    size = len(direct.json()["data"][0]["embedding"])
    assert httpx.post(f"{outer.url}/v1/embeddings", json={"model": "alpha", "input": "x"}).status_code == 400
    empty = httpx.post(f"{outer.url}/v1/embeddings", json={"model": "base", "input": [""]})
    assert empty.status_code == 400 and "non-empty" in empty.text

    r = httpx.post(
        f"{outer.url}/v1/load_lora_adapter", json={"lora_name": "alpha@3", "lora_path": "alpha/1"}, timeout=60
    )
    assert r.status_code == 200, r.text
    layers = 30  # SmolLM2-135M's: the inner server's model
    gate = {  # whatever the request: even layers half base, half alpha; odd layers all alpha
        "kind": "gate",
        "choices": [None, "alpha"],
        "mean": [0.0] * size,
        "scale": [1.0] * size,
        "projection": [[0.0] * size],
        "weight": [[[0.0], [0.0]]] * layers,
        "bias": [[0.0, 0.0] if layer % 2 == 0 else [-50.0, 0.0] for layer in range(layers)],
    }
    assert httpx.post(f"{outer.url}/v1/router", json=gate, timeout=60).status_code == 200
    routed = chat(outer.url, "default", "Tell me a fact.")
    # Served exactly, per layer: composed into one ordinary LoRA that vLLM loads like any other.
    assert routed["model"].startswith("alpha@3:0.75;layers=")
    composed = [
        m["id"] for m in httpx.get(f"{inner.url}/v1/models").json()["data"] if m["id"].startswith("mix-")
    ]
    direct = [chat(inner.url, name, "Tell me a fact.")["choices"][0]["token_ids"] for name in composed]
    assert routed["choices"][0]["token_ids"] in direct
    plain = chat(outer.url, "alpha", "Tell me a fact.")["choices"][0]["token_ids"]
    assert plain != routed["choices"][0]["token_ids"]
    wrong_size = {**gate, "projection": [[0.0] * 3], "mean": [0.0] * 3, "scale": [1.0] * 3}
    r = httpx.post(f"{outer.url}/v1/router", json=wrong_size, timeout=60)
    assert r.status_code == 400 and "expects 3-d" in r.text
    assert httpx.get(f"{outer.url}/v1/router").json() == gate  # the rejected gate never went live
    httpx.post(f"{outer.url}/v1/router", json={"kind": "static", "adapter": None})


async def test_a_vllm_without_embeddings_says_how_to_serve_them(stack):
    inner, _ = stack
    backend = VLLMBackend(inner.url, embed_url=inner.url + "/nowhere")
    with pytest.raises(BackendError, match="--runner pooling"):
        await backend.embed(["hello"])
    await backend.close()


def test_a_dead_vllm_is_a_clear_502_and_the_gateway_keeps_serving(tmp_path):
    dead = start_in_thread(
        create_app(EmbeddedBackend(precision="float32"), config=GatewayConfig(record=False))
    )
    backend = VLLMBackend(dead.url)
    dead.stop()
    with start_in_thread(
        create_app(backend, config=GatewayConfig(adapter_root=tmp_path, record=False))
    ) as outer:
        r = httpx.post(
            f"{outer.url}/v1/chat/completions",
            json={
                "model": backend.model_id,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        assert httpx.get(f"{outer.url}/health").status_code == 200


def test_a_json_response_format_goes_to_vllms_structured_outputs(tmp_path):
    """vLLM holds a reply to JSON (its structured outputs) when a completions request carries
    ``response_format``: the gateway hands a client's on as sent, and so streams it too. (The
    embedded backend, which cannot, refuses it: tests/test_tool_choice.py.)"""
    sent: list[dict] = []
    vllm = FastAPI()

    @vllm.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "fake-base", "parent": None}]}

    @vllm.post("/v1/completions")
    async def completions(request: Request) -> dict:
        sent.append(await request.json())
        return {"choices": [{"index": 0, "text": '{"answer": 4}', "finish_reason": "stop", "token_ids": [7]}]}

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    formats = [
        {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}},
        {"type": "json_object"},
    ]
    with start_in_thread(vllm) as server:
        backend = VLLMBackend(server.url)
        with start_in_thread(
            create_app(backend, config=GatewayConfig(adapter_root=tmp_path, record=False))
        ) as outer:
            for response_format in formats:
                body = {"model": "fake-base", "messages": [{"role": "user", "content": "2 + 2?"}]}
                r = httpx.post(
                    f"{outer.url}/v1/chat/completions", json={**body, "response_format": response_format}
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == '{"answer": 4}'
                assert sent[-1]["response_format"] == response_format
            r = httpx.post(
                f"{outer.url}/v1/completions", json={"model": "fake-base", "prompt": "x", "min_tokens": 5}
            )
            assert r.status_code == 200 and sent[-1]["min_tokens"] == 5  # vLLM's own parameter, passed on
            bad = {"type": "json_schema"}  # no schema
            r = httpx.post(f"{outer.url}/v1/chat/completions", json={**body, "response_format": bad})
            assert r.status_code == 400 and len(sent) == 3
