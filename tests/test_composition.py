"""Mixtures of adapters: the record type, the composed adapter, and serving one exactly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest
from chat import chat as served
from support.backends import Recording, lora_dir

from trace_plugin import Recorder
from trace_plugin.adapter_files import AdapterError, read_safetensors, write_safetensors
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.composition import compose_adapter
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.records.mixture import Mixture
from training.lora import random_adapter

# -- the record type ------------------------------------------------------------------------


def test_a_mixture_is_normalized_and_quantized_to_the_grid():
    assert Mixture.of({"b": 3.0, "a": 1.0}) == Mixture((("a", 0.25), ("b", 0.75)))
    assert Mixture.of({"a": 0.333, "b": 0.333, "c": 0.334}).weights == (("a", 0.35), ("b", 0.3), ("c", 0.35))
    assert sum(w for _, w in Mixture.of({"a": 0.333, "b": 0.333, "c": 0.334}).weights) == pytest.approx(1)
    assert Mixture.of({"a": 0.99, "b": 0.01}) == Mixture.of("a")  # below half a grid step: dropped
    assert Mixture.of({"a": 0.0}) == Mixture() == Mixture.of(None) and not Mixture()
    with pytest.raises(ValueError, match="non-negative"):
        Mixture.of({"a": -1.0})
    with pytest.raises(ValueError, match="non-negative"):
        Mixture.of({"a": float("nan")})


def test_a_mixture_label_round_trips_and_names_one_composition():
    mixture = Mixture.of({"refunds@3": 0.6, "lookup@1": 0.4})
    assert mixture.label() == "lookup@1:0.4,refunds@3:0.6"
    assert Mixture.parse(mixture.label()) == mixture
    assert Mixture.of("refunds@3").label() == "refunds@3" and Mixture.parse("refunds@3") == Mixture.of(
        "refunds@3"
    )
    assert Mixture().label() == "" and Mixture.parse("") == Mixture()
    assert mixture.served_name() == Mixture.of({"refunds@3": 0.61, "lookup@1": 0.39}).served_name()
    assert mixture.served_name() != Mixture.of({"refunds@3": 0.7, "lookup@1": 0.3}).served_name()
    assert mixture.resolved({"lookup@1": "lookup@1"}) == mixture
    assert Mixture.of({"a": 0.5, "b": 0.5}).resolved({"a": "a@2", "b": "b@7"}).label() == "a@2:0.5,b@7:0.5"
    assert Mixture.parse("a:3,b:1") == Mixture.of({"a": 0.75, "b": 0.25})
    for bad in ("a:half,b:0.5", "a:-1,b:2"):
        with pytest.raises(ValueError, match="not a mixture label"):
            Mixture.parse(bad)


# -- the composed adapter -------------------------------------------------------------------


def test_safetensors_round_trip_and_bf16_is_widened(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {"x.lora_A.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    write_safetensors(tmp_path / "a.safetensors", tensors)
    assert np.array_equal(
        read_safetensors(tmp_path / "a.safetensors")["x.lora_A.weight"], tensors["x.lora_A.weight"]
    )
    save_file({"t": torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)}, tmp_path / "b.safetensors")
    assert read_safetensors(tmp_path / "b.safetensors")["t"].tolist() == [[1.5, -2.25]]
    (tmp_path / "bad.safetensors").write_bytes((2**40).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="not a safetensors header"):
        read_safetensors(tmp_path / "bad.safetensors")


def test_the_composed_adapter_is_the_weighted_sum_of_the_deltas(tmp_path):
    rng = np.random.default_rng(0)

    def pair(rank: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.normal(size=(rank, 5)).astype(np.float32), rng.normal(size=(7, rank)).astype(np.float32)

    q1, v1, q2 = pair(2), pair(2), pair(3)
    lora_dir(tmp_path / "one", 2, {"m.q": q1, "m.v": v1})
    lora_dir(tmp_path / "two", 3, {"m.q": q2}, use_rslora=True)  # scaling alpha / sqrt(r)
    compose_adapter([(tmp_path / "one", 0.7), (tmp_path / "two", 0.3)], tmp_path / "mix")
    config = json.loads((tmp_path / "mix" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 5 and not config["use_rslora"]
    assert config["target_modules"] == ["q", "v"]
    out = read_safetensors(tmp_path / "mix" / "adapter_model.safetensors")

    def delta(module: str) -> np.ndarray:
        return out[f"{module}.lora_B.weight"] @ out[f"{module}.lora_A.weight"]

    expected_q = 0.7 * 2.0 * q1[1] @ q1[0] + 0.3 * (6 / 3**0.5) * q2[1] @ q2[0]
    assert np.allclose(delta("m.q"), expected_q, atol=1e-5)
    assert np.allclose(delta("m.v"), 0.7 * 2.0 * v1[1] @ v1[0], atol=1e-5)  # "two" adds zero blocks here
    assert not (tmp_path / "mix.partial").exists()


def test_per_layer_weights_weigh_each_layers_modules_with_their_own(tmp_path):
    """The gate's composition: layer l's modules get weight[l], also from a single adapter."""
    rng = np.random.default_rng(1)
    pairs = {
        f"model.layers.{layer}.self_attn.{kind}": (
            rng.normal(size=(2, 5)).astype(np.float32),
            rng.normal(size=(7, 2)).astype(np.float32),
        )
        for layer in (0, 1)
        for kind in ("q_proj", "v_proj")
    }
    lora_dir(tmp_path / "one", 2, pairs)
    compose_adapter([(tmp_path / "one", (0.25, 0.9))], tmp_path / "mix")
    out = read_safetensors(tmp_path / "mix" / "adapter_model.safetensors")
    for module, (a, b) in pairs.items():
        weight = 0.25 if ".layers.0." in module else 0.9
        composed = out[f"{module}.lora_B.weight"] @ out[f"{module}.lora_A.weight"]
        assert np.allclose(composed, weight * 2.0 * b @ a, atol=1e-5), module
    with pytest.raises(AdapterError, match="do not cover the module model.layers.1"):
        compose_adapter([(tmp_path / "one", (0.5,))], tmp_path / "short")
    lora_dir(tmp_path / "flat", 2, {"lm_head": pairs["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(AdapterError, match="lm_head"):
        compose_adapter([(tmp_path / "flat", (0.5, 0.5))], tmp_path / "nolayer")


def test_only_plain_loras_are_composed(tmp_path):
    pair = (np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
    lora_dir(tmp_path / "plain", 2, {"m.q": pair})
    lora_dir(tmp_path / "dora", 2, {"m.q": pair}, use_dora=True)
    lora_dir(tmp_path / "wrong-rank", 3, {"m.q": pair})
    for other, needle in (("dora", "not a plain LoRA"), ("wrong-rank", "rank other than 3")):
        with pytest.raises(AdapterError, match=needle):
            compose_adapter([(tmp_path / "plain", 0.5), (tmp_path / other, 0.5)], tmp_path / "mix")
    with pytest.raises(AdapterError, match="cannot compose"):
        compose_adapter([(tmp_path / "plain", 0.5), (tmp_path / "missing", 0.5)], tmp_path / "mix")


# -- serving a mixture, exactly -------------------------------------------------------------


@pytest.fixture(scope="module")
def mixing(tmp_path_factory):
    """A float32 embedded gateway with two random adapters of different ranks, recording."""
    root = tmp_path_factory.mktemp("adapters")
    backend = EmbeddedBackend(precision="float32")
    random_adapter(backend.model_dir, root / "alpha" / "1", seed=21, scale=4.0)
    random_adapter(backend.model_dir, root / "beta" / "1", seed=22, rank=4, scale=4.0)
    recorder = Recorder(f"sqlite:///{tmp_path_factory.mktemp('db') / 'mix.db'}")
    config = GatewayConfig(
        adapter_root=root, agent="support", adapters={"alpha@1": "alpha/1", "beta@1": "beta/1"}
    )
    with start_in_thread(create_app(backend, config=config, recorder=recorder)) as server:
        server.root, server.backend, server.recorder = root, backend, recorder
        yield server
    recorder.close()


def chat(url: str, model: str, text: str = "Say something about the weather.") -> httpx.Response:
    return served(url, model, text, max_tokens=16, logprobs=True)


def explicit_logprobs(backend: EmbeddedBackend, root, weights: dict[str, Any], ids: list[int]):
    """Log-probabilities of ``ids`` under W + Σ weight·scale·BA, summed into a fresh copy of the
    base weights from the adapters' own files: the mixture spelled out, with no PEFT. A weight
    is one number, or one per decoder layer."""
    import torch
    from safetensors.torch import load_file

    from trace_plugin.model_files import load_model

    model, _ = load_model(backend.model_dir, precision="float32")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in weights.items():
            config = json.loads((root / name / "adapter_config.json").read_text())
            tensors = load_file(root / name / "adapter_model.safetensors")
            scale = config["lora_alpha"] / config["r"]
            for key, a in tensors.items():
                if key.endswith(".lora_A.weight"):
                    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = tensors[key.replace("lora_A", "lora_B")]
                    layer = int(module.split(".layers.")[1].split(".")[0])
                    w = weight if isinstance(weight, float) else weight[layer]
                    params[module + ".weight"] += w * scale * (b @ a)
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)


def test_a_mixture_is_served_as_the_explicit_weighted_sum_of_its_adapters(mixing):
    response = chat(mixing.url, "alpha:0.7,beta:0.3")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == "alpha@1:0.7,beta@1:0.3" == response.headers["x-trace-adapter"]
    prompt, completion = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    served = [e["logprob"] for e in data["choices"][0]["logprobs"]["content"]]
    reference = explicit_logprobs(
        mixing.backend, mixing.root, {"alpha/1": 0.7, "beta/1": 0.3}, prompt + completion
    )
    expected = [float(reference[len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]
    assert max(abs(s - e) for s, e in zip(served, expected, strict=True)) < 1e-3
    alone = chat(mixing.url, "alpha").json()["choices"][0]["logprobs"]["content"]
    assert alone[0]["token_id"] != completion[0] or abs(alone[0]["logprob"] - served[0]) > 1e-2  # a real mix


def test_a_per_layer_gate_is_served_as_the_explicit_per_layer_sum(mixing):
    """The gate's mixture through the real gateway: a gate whose layers ignore the request
    (biases only) gives even layers half base, half alpha, and odd ones 0.3 alpha, 0.7 beta;
    the served log-probabilities are those of W_l + Σ α_{l,c}·scale·BA, spelled out."""
    import math

    config = mixing.backend.model.config
    layers, size = config.num_hidden_layers, config.hidden_size
    rows = [(0.5, 0.5, 0.0) if layer % 2 == 0 else (0.0, 0.3, 0.7) for layer in range(layers)]
    spec = {
        "kind": "gate",
        "choices": [None, "alpha", "beta"],
        "mean": [0.0] * size,
        "scale": [1.0] * size,
        "projection": [[0.0] * size],
        "weight": [[[0.0]] * 3] * layers,
        "bias": [[math.log(p) if p else -50.0 for p in row] for row in rows],
    }
    assert httpx.post(f"{mixing.url}/v1/router", json=spec, params={"name": "gate"}).status_code == 200
    response = chat(mixing.url, "router:gate")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"].startswith("alpha@1:0.4,beta@1:0.35;layers=")  # the means, and the layers' digest
    prompt, completion = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    served = [e["logprob"] for e in data["choices"][0]["logprobs"]["content"]]
    per_layer = {"alpha/1": [row[1] for row in rows], "beta/1": [row[2] for row in rows]}
    reference = explicit_logprobs(mixing.backend, mixing.root, per_layer, prompt + completion)
    expected = [float(reference[len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]
    assert max(abs(s - e) for s, e in zip(served, expected, strict=True)) < 1e-3
    again = chat(mixing.url, "router:gate", "Hello there.").json()
    assert again["model"] == data["model"]  # the same layers: the same composed adapter
    assert chat(mixing.url, data["model"]).status_code == 400  # named by its router, not by a label


def test_rows_through_different_adapters_in_one_batch_get_what_each_gets_alone(mixing, monkeypatch):
    """A batch that really mixes adapters (two ranks, a composed mixture, the base) runs as
    one forward pass through the stacked weights, never PEFT's per-adapter split, and each
    row gets the log-probabilities it gets in a batch of its own (its adapter folded in)."""
    from peft.tuners.lora import Linear

    from trace_plugin.gateway.backend import SamplingParams

    backend = mixing.backend
    assert chat(mixing.url, "alpha:0.6,beta:0.4").status_code == 200  # composes and loads it
    adapters = [None, *sorted(asyncio.run(backend.adapters()))]
    assert len(adapters) >= 4
    prompts = [
        backend.render([{"role": "user", "content": f"Tell me about the number {i}."}], None)
        for i in range(len(adapters))
    ]
    params = SamplingParams(max_tokens=12, logprobs=True)
    split = []
    monkeypatch.setattr(Linear, "_mixed_batch_forward", lambda *a, **k: split.append(1))
    together = backend.generate_rows(prompts, adapters, params)
    assert not split
    for prompt, adapter, row in zip(prompts, adapters, together, strict=True):
        alone = backend.generate_rows([prompt], [adapter], params)[0]
        assert alone.token_ids == row.token_ids, adapter
        assert max(abs(a - b) for a, b in zip(alone.logprobs, row.logprobs, strict=True)) < 1e-3
    assert len({tuple(row.token_ids) for row in together}) == len(adapters)  # each really adapted


def test_an_adapter_the_stacks_cannot_hold_is_refused_and_the_others_kept(mixing, tmp_path):
    from peft import LoraConfig, get_peft_model

    from trace_plugin.gateway.backend import BackendError
    from trace_plugin.model_files import load_model

    base, _ = load_model(mixing.backend.model_dir)
    config = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(tmp_path / "dora")
    before = asyncio.run(mixing.backend.adapters())
    with pytest.raises(BackendError, match="DoRA") as refused:
        asyncio.run(mixing.backend.load_adapter("dora", tmp_path / "dora"))
    assert refused.value.status == 400
    assert asyncio.run(mixing.backend.adapters()) == before
    assert chat(mixing.url, "alpha:0.5,beta:0.5").status_code == 200


def test_a_mixture_is_composed_once_and_recorded_as_its_pairs(mixing):
    for _ in range(2):
        assert chat(mixing.url, "beta:0.5,alpha:0.5", "Hello there.").status_code == 200
    described = httpx.get(f"{mixing.url}/v1/lora_adapters").json()
    composed = Mixture.parse("alpha@1:0.5,beta@1:0.5").served_name()
    assert composed in described["mixtures"] and composed not in described["loaded"]
    assert (mixing.root / ".mixtures" / composed / "adapter_model.safetensors").is_file()
    models = httpx.get(f"{mixing.url}/v1/models").json()["data"]
    assert not any(m["id"].startswith("mix-") for m in models)  # an implementation detail, not a model
    assert mixing.recorder.flush(10)
    adapters = {e.adapter for e in mixing.recorder.store.list_episodes("support")}
    assert "alpha@1:0.5,beta@1:0.5" in adapters


def test_a_bad_mixture_is_a_clear_4xx(mixing):
    assert chat(mixing.url, "alpha:0.5,gamma:0.5").status_code == 404
    assert "gamma" in chat(mixing.url, "alpha:0.5,gamma:0.5").text
    assert chat(mixing.url, "alpha:half,beta:0.5").status_code == 400
    assert chat(mixing.url, "alpha:-1,beta:2").status_code == 400


# -- the registry's composed adapters -------------------------------------------------------


async def test_composed_adapters_are_cached_pinned_and_unloaded_only_once_drained(tmp_path):
    import asyncio

    from trace_plugin.gateway.adapters import AdapterRegistry

    pair = (np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
    for name in ("a", "b", "c"):
        lora_dir(tmp_path / name / "1", 2, {"m.q": pair})
    lora_dir(tmp_path / "a" / "2", 2, {"m.q": pair})
    backend = Recording()
    registry = AdapterRegistry(backend, tmp_path, mixtures=2)
    for name in ("a", "b", "c"):
        await registry.load(f"{name}@1", f"{name}/1")
    first, served = await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))
    assert served.label() == "a@1:0.5,b@1:0.5" and first == served.served_name()
    again, _ = await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))
    assert again == first and backend.loaded.count(first) == 1  # composed and loaded once
    registry.release(again)
    second, _ = await registry.acquire_mixture(Mixture.of({"a": 0.5, "c": 0.5}))
    registry.release(second)
    third, _ = await registry.acquire_mixture(Mixture.of({"b": 0.5, "c": 0.5}))  # evicts the first
    registry.release(third)
    await asyncio.sleep(0)
    assert first not in backend.unloaded  # one request still holds it
    back, _ = await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))  # asked for again
    assert back == first and backend.loaded.count(first) == 1  # kept, not composed again
    registry.release(back)
    registry.release(first)
    await asyncio.sleep(0.01)
    assert backend.unloaded == [second]  # the least recent one went instead, once idle
    assert set(registry.describe()["mixtures"]) == {first, third}
    await registry.load("a@2", "a/2")  # a new version: a new composition for the same weights
    fourth, on_new = await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))
    assert on_new.label() == "a@2:0.5,b@1:0.5" and fourth != first
    assert await registry.acquire_mixture(Mixture.of("c")) == ("c@1", Mixture.of("c@1"))  # itself
    registry.release("c@1")
    assert await registry.acquire_mixture(Mixture()) == (None, Mixture())
    with pytest.raises(AdapterError, match="not loaded"):
        await registry.acquire_mixture(Mixture.of({"a": 0.5, "zzz": 0.5}))
    # A failed mixture released the parts it had pinned.
    assert [v["in_flight"] for v in registry.describe()["loaded"].values()] == [0, 0, 0]  # a@1 retired
