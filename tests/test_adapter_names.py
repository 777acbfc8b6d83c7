"""Adapters cannot shadow what a request means by a reserved name, one name@version is one
set of files, and mixtures the router did not choose are the admin's to ask for, cached
within a count and a size on disk.

A scripted backend stands in for the model: it keeps which adapter served each request
and what was loaded and unloaded, which is the point here, not what it generates.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from support.backends import ScriptedBackend, lora_dir

from trace_plugin.gateway.adapters import MIXTURES_DIR
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.backend import Completion, SamplingParams
from trace_plugin.model_files import prepare_tokenizer, resolve_model

TOKEN = {"Authorization": "Bearer s3cret"}
PAIR = (np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))


class Serving(ScriptedBackend):
    """Loads adapters for real bookkeeping, and notes the adapter behind every generation."""

    def __init__(self, tokenizer: Any, root: Path) -> None:
        super().__init__(tokenizer)
        self.root = root
        self.loaded: set[str] = set()
        self.served: list[str | None] = []
        self.unloaded_while_on_disk: list[bool] = []  # per unload of a composed adapter

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        self.served.append(adapter)
        return await super().generate(prompt, params, adapter)

    async def load_adapter(self, name: str, path: Path) -> None:
        self.loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)
        if name.startswith("mix-"):
            self.unloaded_while_on_disk.append((self.root / MIXTURES_DIR / name).is_dir())

    async def adapters(self) -> set[str]:
        return set(self.loaded)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(None), local_files_only=True))


def gateway(tokenizer: Any, root: Path, **settings: Any) -> tuple[TestClient, Serving]:
    for name in ("alpha", "beta", "gamma"):
        if not (root / name).exists():
            lora_dir(root / name, 2, {"m.q": PAIR})
    backend = Serving(tokenizer, root)
    config = GatewayConfig(
        adapter_root=root,
        agent="support",
        agent_aliases={"helper"},
        admin_token="s3cret",
        allow_remote_admin=True,  # the test client is not a loopback address
        **settings,
    )
    return TestClient(create_app(backend, config=config)), backend


def load(client: TestClient, name: str, path: str = "alpha") -> Any:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=TOKEN)


def chat(client: TestClient, model: str, **headers: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize(
    "name",
    ["base", "base@1", "default@1", "scripted@1", "support@1", "helper"],
)
def test_a_reserved_name_cannot_be_loaded(tokenizer, tmp_path, name):
    client, backend = gateway(tokenizer, tmp_path)
    with client:
        refused = load(client, name)
        assert refused.status_code == 409 and "reserved" in refused.json()["error"]["message"]
        assert backend.loaded == set()


@pytest.mark.parametrize("name", ["a\x00b", "../../x", "a:b", "a@1@2", "a/b", "@1", "x" * 65, "é"])
def test_a_name_outside_the_tool_name_characters_is_refused(tokenizer, tmp_path, name):
    client, backend = gateway(tokenizer, tmp_path)
    with client:
        refused = load(client, name)
        assert refused.status_code == 400 and "invalid adapter name" in refused.json()["error"]["message"]
        assert backend.loaded == set()


def test_a_name_is_never_served_from_other_files_than_the_first_time(tokenizer, tmp_path):
    """vLLM's prefix cache keys blocks by adapter name: one name on other weights would serve
    blocks cached under the old ones."""
    client, backend = gateway(tokenizer, tmp_path)
    with client:
        assert load(client, "alpha@1", "alpha").status_code == 200
        assert load(client, "alpha@2", "beta").status_code == 200  # alpha@1 retires once drained
        _settled(lambda: [n for n in backend.loaded if n == "alpha@1"], 0)
        lora_dir(tmp_path / "other", 2, {"m.q": (PAIR[0], 3 * PAIR[1])})
        again = load(client, "alpha@1", "other")  # the same name, other files
        assert again.status_code == 409 and "new version" in again.json()["error"]["message"]
        lora_dir(tmp_path / "copy", 2, {"m.q": PAIR})  # alpha's very bytes, elsewhere: the same adapter
        assert load(client, "alpha@1", "copy").status_code == 200
        assert load(client, "alpha@3", "beta").status_code == 200
        _settled(lambda: [n for n in backend.loaded if n == "alpha@1"], 0)
        # alpha@1's files change on disk: rolling back to it is refused, alpha@3 stays live.
        lora_dir(tmp_path / "changed", 2, {"m.q": (PAIR[0], 2 * PAIR[1])})
        weights = "adapter_model.safetensors"
        (tmp_path / "changed" / weights).replace(tmp_path / "copy" / weights)
        refused = client.post("/v1/rollback_lora_adapter", json={"lora_name": "alpha"}, headers=TOKEN)
        assert refused.status_code == 409 and "changed since" in refused.json()["error"]["message"]
        backend.served.clear()
        assert chat(client, "alpha").status_code == 200 and backend.served == ["alpha@3"]


def test_a_half_written_adapter_is_refused_before_the_backend_reads_it(tokenizer, tmp_path):
    client, backend = gateway(tokenizer, tmp_path)
    weights = tmp_path / "alpha" / "adapter_model.safetensors"
    with client:
        assert load(client, "alpha@1", "alpha").status_code == 200
        lora_dir(tmp_path / "half", 2, {"m.q": PAIR})
        half = tmp_path / "half" / "adapter_model.safetensors"
        half.write_bytes(weights.read_bytes()[:-5])
        refused = load(client, "alpha@2", "half")
        assert refused.status_code == 400 and "incomplete" in refused.json()["error"]["message"]
        half.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
        refused = load(client, "alpha@2", "half")
        assert refused.status_code == 400 and "not a safetensors file" in refused.json()["error"]["message"]
        assert backend.loaded == {"alpha@1"}
        backend.served.clear()
        assert chat(client, "alpha").status_code == 200 and backend.served == ["alpha@1"]


def test_reserved_names_mean_what_they_say_whatever_is_loaded(tokenizer, tmp_path):
    client, backend = gateway(tokenizer, tmp_path)
    with client:
        assert load(client, "refunds@1").status_code == 200
        backend.served.clear()  # the load's probe went through it
        for model in ("base", "default", "support", "helper", "scripted"):
            assert chat(client, model).status_code == 200
        assert chat(client, "refunds").status_code == 200
        assert backend.served == [None] * 5 + ["refunds@1"]  # the router's choice here is the base


def test_a_mixture_the_router_did_not_choose_is_the_admins_to_ask_for(tokenizer, tmp_path):
    client, _ = gateway(tokenizer, tmp_path)
    with client:
        for name in ("alpha", "beta"):
            assert load(client, f"{name}@1", name).status_code == 200
        refused = chat(client, "alpha:0.5,beta:0.5")
        assert refused.status_code == 401 and "mixture" in refused.json()["error"]["message"]
        assert not (tmp_path / MIXTURES_DIR).exists()  # nothing composed for it
        assert chat(client, "alpha:0.5,beta:0.5", **TOKEN).status_code == 200
    opened, _ = gateway(tokenizer, tmp_path, open_mixtures=True)
    with opened:
        for name in ("alpha", "beta"):
            assert load(opened, f"{name}@1", name).status_code == 200
        assert chat(opened, "alpha:0.5,beta:0.5").status_code == 200


def test_composed_adapters_are_kept_within_a_count_and_a_size_and_deleted_once_unloaded(tokenizer, tmp_path):
    stale = tmp_path / MIXTURES_DIR / "mix-from-an-earlier-run"
    stale.mkdir(parents=True)
    client, backend = gateway(tokenizer, tmp_path)
    with client:
        assert not stale.exists()  # no earlier run's composition is loaded: cleared at start
        for name in ("alpha", "beta", "gamma"):
            assert load(client, f"{name}@1", name).status_code == 200
        for n in range(1, 12):  # eleven distinct labels: one composition each
            assert chat(client, f"alpha:{n},beta:{12 - n}", **TOKEN).status_code == 200
        folders = _settled(lambda: sorted((tmp_path / MIXTURES_DIR).iterdir()), 4)
        assert len(folders) == 4  # the cache's count
        assert len(backend.unloaded_while_on_disk) == 7 and all(backend.unloaded_while_on_disk)
        assert {f.name for f in folders} == {name for name in backend.loaded if name.startswith("mix-")}
    size = sum(f.stat().st_size for f in folders[0].iterdir())
    small, backend = gateway(tokenizer, tmp_path, mixture_bytes=2 * size)
    with small:
        for name in ("alpha", "beta", "gamma"):
            assert load(small, f"{name}@1", name).status_code == 200
        for n in range(1, 6):
            assert chat(small, f"beta:{n},gamma:{6 - n}", **TOKEN).status_code == 200
        assert len(_settled(lambda: list((tmp_path / MIXTURES_DIR).iterdir()), 2)) == 2  # the bytes


def _settled(probe: Any, expected: int) -> Any:
    """``probe()`` once it has ``expected`` items: evicted adapters go in the background."""
    deadline = time.monotonic() + 10
    while len(value := probe()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


async def test_a_mixture_past_the_servers_lora_rank_is_a_clear_error_before_anything_is_composed(tmp_path):
    from support.backends import Recording

    from trace_plugin.gateway.adapters import AdapterError, AdapterRegistry
    from trace_plugin.records.mixture import Mixture

    for name in ("a", "b", "c"):
        lora_dir(tmp_path / name, 2, {"m.q": PAIR})
    backend = Recording()
    backend.max_lora_rank = 4  # vLLM's --max-lora-rank: two rank-2 adapters fill it
    registry = AdapterRegistry(backend, tmp_path)
    for name in ("a", "b", "c"):
        await registry.load(f"{name}@1", name)
    served, _ = await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))
    registry.release(served)
    with pytest.raises(
        AdapterError, match=r"rank 6, .* over the 4 this server takes \(vLLM's --max-lora-rank\)"
    ):
        await registry.acquire_mixture(Mixture.of({"a": 0.4, "b": 0.3, "c": 0.3}))
    assert len(list((tmp_path / MIXTURES_DIR).iterdir())) == 1  # nothing composed for it


async def test_a_composed_mixture_is_checked_before_the_backend_loads_it(tmp_path):
    """Mixtures are composed from the parts' files on disk: files changed under the server
    (here: NaN weights) were composed and loaded unchecked. A composition is checked as a
    loaded adapter is, and nothing of it reaches the backend."""
    import shutil

    from support.backends import Recording

    from trace_plugin.gateway.adapters import AdapterError, AdapterRegistry
    from trace_plugin.records.mixture import Mixture

    for name in ("a", "b"):
        lora_dir(tmp_path / name, 2, {"m.q": PAIR})
    backend = Recording()
    registry = AdapterRegistry(backend, tmp_path)
    for name in ("a", "b"):
        await registry.load(f"{name}@1", name)
    shutil.rmtree(tmp_path / "b")  # b@1's files, changed under the server
    lora_dir(tmp_path / "b", 2, {"m.q": (PAIR[0], np.full((4, 2), np.nan, np.float32))})
    with pytest.raises(AdapterError, match="NaN or Inf") as refused:
        await registry.acquire_mixture(Mixture.of({"a": 0.5, "b": 0.5}))
    assert refused.value.status == 422
    assert backend.loaded == ["a@1", "b@1"] and not list((tmp_path / MIXTURES_DIR).iterdir())


def test_a_vllm_backend_knows_its_models_modules_and_broken_adapters_never_reach_vllm(tmp_path):
    """The module check ran only where the model was in this process (embedded): with vLLM,
    weights for layer 999 loaded and did nothing. The module names now come from the
    model's safetensors headers, and such an adapter is refused before any request to
    vLLM (none could be answered here: nothing listens)."""
    import asyncio

    from safetensors.numpy import load_file, save_file

    from trace_plugin.gateway.adapters import AdapterError, AdapterRegistry
    from trace_plugin.gateway.vllm import VLLMBackend
    from trace_plugin.model_files import module_names, resolve_model
    from training.lora import random_adapter

    backend = VLLMBackend("http://127.0.0.1:9", served_model="SmolLM2-135M-Instruct")
    assert (
        backend.lora_modules == module_names() and "model.layers.0.self_attn.q_proj" in backend.lora_modules
    )
    adapter = random_adapter(resolve_model(None), tmp_path / "far" / "1", seed=1, rank=2)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(n for n in weights if "layers.0." in n)
    weights[name.replace("layers.0.", "layers.999.")] = weights.pop(name)
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    registry = AdapterRegistry(backend, tmp_path)
    with pytest.raises(AdapterError, match="modules the base model lacks") as refused:
        asyncio.run(registry.load("far@1", "far/1"))
    assert refused.value.status == 422
