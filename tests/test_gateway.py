"""The gateway serving the real SmolLM2-135M: OpenAI contract, adapters, hot-swap, capture."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest
from load import swap_under_load
from openai import OpenAI
from support.requests import TOOLS, retail_ticket

from trace_plugin import Recorder
from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.routing import KeywordRouter, router_version
from trace_plugin.gateway.server import start_in_thread
from training.lora import random_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend(embedded_backend) -> EmbeddedBackend:
    return embedded_backend


@pytest.fixture(scope="module")
def adapter_root(backend, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    random_adapter(backend.model_dir, root / "alpha" / "1", seed=1)
    random_adapter(backend.model_dir, root / "alpha" / "2", seed=2)
    random_adapter(backend.model_dir, root / "beta" / "1", seed=3)
    return root


@pytest.fixture(scope="module")
def gateway(backend, adapter_root, tmp_path_factory):
    recorder = Recorder(f"sqlite:///{tmp_path_factory.mktemp('db') / 'gw.db'}")
    router = KeywordRouter([(["refund", "return"], "beta")])
    app = create_app(
        backend,
        config=GatewayConfig(adapter_root=adapter_root, agent="support", agent_aliases={"support-bot"}),
        router=router,
        recorder=recorder,
    )
    with start_in_thread(app) as server:
        server.recorder = recorder
        yield server
    recorder.close()


@pytest.fixture
def client(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def admin(gateway, path: str, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/{path}", json=body, timeout=60)


def ensure_loaded(gateway, name: str, path: str) -> None:
    live = httpx.get(f"{gateway.url}/v1/lora_adapters").json()["loaded"]
    if name not in live:
        r = admin(gateway, "load_lora_adapter", lora_name=name, lora_path=path)
        assert r.status_code == 200, r.text


def greedy(client, model: str, text: str, max_tokens: int = 12, **extra):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=max_tokens,
        **extra,
    )


# -- the OpenAI contract ------------------------------------------------------------------


def test_models_and_health(client, gateway, backend):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == backend.model_id
    assert httpx.get(gateway.url + "/health").json()["status"] == "ok"


def test_chat_with_tools_answers_in_openai_shape(client, backend):
    response = client.chat.completions.create(
        model=backend.model_id,
        messages=[
            {"role": "system", "content": "You help with orders."},
            {"role": "user", "content": "Where is W1?"},
        ],
        tools=TOOLS,
        temperature=0,
        max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant"
    assert (choice.message.content or choice.message.tool_calls) is not None
    assert response.usage.prompt_tokens > 100  # the tools section was rendered into the prompt
    assert response.model == backend.model_id


def test_api_output_equals_direct_generate(client, backend):
    """Same prompt, greedy: the gateway returns exactly the tokens model.generate returns."""
    import torch

    messages = [{"role": "user", "content": "Name three colors."}]
    response = greedy(
        client, backend.model_id, "Name three colors.", max_tokens=16, extra_body={"return_token_ids": True}
    )
    prompt = backend.render(messages, None)
    enc = backend.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        direct = backend.model.generate(
            **enc,
            max_new_tokens=16,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=backend.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
    direct_ids = direct[0, enc.input_ids.shape[1] :].tolist()
    data = response.model_dump()
    assert data["prompt_token_ids"] == enc.input_ids[0].tolist()
    assert data["choices"][0]["token_ids"] == direct_ids
    assert response.choices[0].message.content == backend.tokenizer.decode(
        direct_ids, skip_special_tokens=True
    )


def test_concurrent_requests_are_batched_without_changing_answers(client, backend):
    prompts = [f"Repeat the number {d}{d}{d}." for d in range(1, 7)]  # equal token lengths: no padding
    solo = [greedy(client, backend.model_id, p).choices[0].message.content for p in prompts]
    results: dict[int, str] = {}

    def run(i):
        results[i] = greedy(client, backend.model_id, prompts[i]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == solo


def test_streaming_and_completions(client, backend):
    chunks = list(
        client.chat.completions.create(
            model=backend.model_id,
            messages=[{"role": "user", "content": "Say hello."}],
            temperature=0,
            max_tokens=8,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(client, backend.model_id, "Say hello.", max_tokens=8).choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # more in test_streaming.py
    completion = client.completions.create(
        model=backend.model_id, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=True
    )
    assert "Paris" in completion.choices[0].text


def test_a_stop_string_ends_generation_there(client):
    free = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        max_tokens=48,
    )
    stopped = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        max_tokens=48,
        stop=[","],
    )
    assert "," in free.choices[0].message.content  # without the stop it runs on
    assert "," not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"
    assert (
        stopped.usage.completion_tokens < free.usage.completion_tokens
    )  # it stopped generating, not just cut


def test_a_reply_may_not_write_the_tools_answer(client, gateway, backend):
    """Given worked examples, SmolLM2 opens its reply with the template's tool-response marker
    (inventing the tool's answer); a chat reply may not, so it calls a tool instead."""
    messages, tools = retail_ticket()
    raw = {
        "model": backend.model_id,
        "prompt": backend.render(messages, tools),
        "max_tokens": 8,
        "temperature": 0,
    }
    free = httpx.post(gateway.url + "/v1/completions", json=raw, timeout=120).json()["choices"][0]["text"]
    assert free.startswith("<tool_response>")  # raw completions leave the model be
    banned = httpx.post(
        gateway.url + "/v1/completions", json={**raw, "bad_words": ["<tool_response"]}, timeout=120
    ).json()["choices"][0]["text"]
    assert "<tool_response" not in banned  # vLLM's bad_words, honoured by the embedded backend
    reply = client.chat.completions.create(
        model=backend.model_id, messages=messages, tools=tools, temperature=0, max_tokens=60
    )
    message = reply.choices[0].message
    assert message.tool_calls and reply.choices[0].finish_reason == "tool_calls", message
    assert "<tool_response" not in (message.content or "")


def test_n_choices_and_tool_choice_none(client, backend):
    messages = [{"role": "user", "content": "Where is W1?"}]
    sampled = client.chat.completions.create(
        model=backend.model_id, messages=messages, n=3, temperature=1.0, max_tokens=8, seed=7
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    with_tools = client.chat.completions.create(
        model=backend.model_id, messages=messages, tools=TOOLS, max_tokens=1
    )
    without = client.chat.completions.create(
        model=backend.model_id, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert without.usage.prompt_tokens == with_tools.usage.prompt_tokens  # "none" still shows the tools


def test_logprobs_and_token_ids(client, backend):
    response = greedy(
        client, backend.model_id, "Hi", max_tokens=5, logprobs=True, extra_body={"return_token_ids": True}
    )
    data = response.model_dump()
    entries = data["choices"][0]["logprobs"]["content"]
    assert [e["token_id"] for e in entries] == data["choices"][0]["token_ids"]
    assert all(e["logprob"] <= 0 for e in entries)


# -- malformed requests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "x"}, 400, "messages"),
        ({"model": "SmolLM2-135M-Instruct", "messages": []}, 400, "messages"),
        ({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        (
            {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "tool", "content": "x"}]},
            400,
            "tool_call_id",
        ),
        (
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10**6,
            },
            400,
            "max_tokens",
        ),
        (
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": -1,
            },
            400,
            "temperature",
        ),
        (
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            },
            400,
            "object",
        ),
        (
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            400,
            "name",
        ),
        (
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "bad_words": [""],
            },
            400,
            "bad_words",
        ),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ],
)
def test_malformed_requests_get_clear_4xx(gateway, body, status, needle):
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_non_json_and_oversized_bodies(gateway):
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"x" * (9 * 1024 * 1024),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


def test_a_prompt_the_context_cannot_hold_is_a_400_and_its_batch_is_served(gateway, backend):
    """Checked before batching: in a batch the over-long row failed every row beside it."""
    too_long = "word " * (backend.context + 10)  # one token each, at least
    far_too_long = "x" * (backend.context * 100)  # refused before it is even tokenized

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            return await asyncio.gather(
                http.post("/v1/completions", json={"model": "base", "prompt": too_long, "max_tokens": 4}),
                http.post("/v1/completions", json={"model": "base", "prompt": far_too_long, "max_tokens": 4}),
                http.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 4}),
            )

    long_one, longer, normal = asyncio.run(both())
    assert long_one.status_code == 400 and "context" in long_one.json()["error"]["message"]
    assert longer.status_code == 400 and "cannot fit" in longer.json()["error"]["message"]
    assert normal.status_code == 200, normal.text


# -- adapters --------------------------------------------------------------------------------


def test_two_adapters_selected_per_request(client, gateway, backend):
    ensure_loaded(gateway, "alpha@1", "alpha/1")
    ensure_loaded(gateway, "beta@1", "beta/1")
    ids = {m.id: m for m in client.models.list().data}
    assert {"alpha", "beta", "alpha@1", "beta@1"} <= set(ids) and ids["alpha"].model_dump()[
        "parent"
    ] == backend.model_id

    base = greedy(client, backend.model_id, "Tell me a fact.")
    alpha = greedy(client, "alpha", "Tell me a fact.")
    beta = greedy(client, "beta@1", "Tell me a fact.")
    assert alpha.model == "alpha@1" and beta.model == "beta@1" and base.model == backend.model_id
    contents = {
        base.choices[0].message.content,
        alpha.choices[0].message.content,
        beta.choices[0].message.content,
    }
    assert len(contents) == 3, "each adapter must change the output"

    # Mixed in one batch, each row still goes through its own adapter.
    results = {}

    def run(model):
        results[model] = greedy(client, model, "Tell me a fact.").choices[0].message.content

    threads = [threading.Thread(target=run, args=(m,)) for m in (backend.model_id, "alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {
        backend.model_id: base.choices[0].message.content,
        "alpha": alpha.choices[0].message.content,
        "beta": beta.choices[0].message.content,
    }


def test_an_all_zero_adapter_gives_the_base_models_tokens_in_mixed_batches(gateway, adapter_root):
    """A LoRA no step has reached (PEFT starts B at zero) is the base model: every request
    through it, batched with base requests in shuffled mixes, gets exactly the tokens the base
    model gives the same request alone (float32; bf16 is not batch-invariant)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from peft import LoraConfig, get_peft_model

    from trace_plugin.environments.retail import TOOLS as RETAIL_TOOLS
    from trace_plugin.model_files import load_model, resolve_model
    from training.lora import is_noop

    base, _ = load_model(resolve_model(), precision="float32")
    get_peft_model(base, LoraConfig(r=8, target_modules="all-linear")).save_pretrained(adapter_root / "zero")
    assert is_noop(adapter_root / "zero")
    ensure_loaded(gateway, "zero@1", "zero")
    env = RetailEnv()
    second_turn = [
        *env.opening(list(TEST_SEEDS)[1]),
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "find_user_id_by_email", "arguments": '{"email": "a@b.c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"error": "no user with that email"}'},
    ]  # fmt: skip
    conversations = [env.opening(seed) for seed in list(TEST_SEEDS)[:4]] + [
        second_turn,
        [{"role": "user", "content": "Where is my parcel?"}],
    ]

    def ask(job: tuple[int, str]) -> list[int]:
        i, model = job
        body = {"model": model, "messages": conversations[i], "tools": RETAIL_TOOLS, "temperature": 0}
        reply = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={**body, "max_tokens": 48, "return_token_ids": True},
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    alone = [ask((i, "base")) for i in range(len(conversations))]
    jobs = [(i, model) for i in range(len(conversations)) for model in ("zero", "base")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for mix in range(3):
            random.Random(mix).shuffle(jobs)
            batched = list(pool.map(ask, jobs))
            differing = [job for job, tokens in zip(jobs, batched, strict=True) if tokens != alone[job[0]]]
            assert differing == [], f"mix {mix}: these replies differ from the base model's alone"
    admin(gateway, "unload_lora_adapter", lora_name="zero")


def test_router_picks_the_adapter_for_agent_requests(client, gateway):
    ensure_loaded(gateway, "beta@1", "beta/1")
    routed = greedy(client, "support", "I want a refund for my order.")
    assert routed.model == "beta@1"
    unrouted = greedy(client, "support-bot", "Where is my order?")
    assert unrouted.model != "beta@1"
    raw = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "support", "messages": [{"role": "user", "content": "return this"}], "max_tokens": 2},
    )
    assert raw.headers["x-trace-adapter"] == "beta@1"


def test_the_router_is_swapped_by_spec_through_the_admin_api(client, gateway):
    ensure_loaded(gateway, "alpha@1", "alpha/1")
    ensure_loaded(gateway, "beta@1", "beta/1")  # the keyword router's, restored at the end
    original = httpx.get(f"{gateway.url}/v1/router").json()
    assert original["kind"] == "keyword"
    try:
        swapped = httpx.post(f"{gateway.url}/v1/router", json={"kind": "static", "adapter": "alpha"})
        assert swapped.status_code == 200 and swapped.json() == {"kind": "static", "adapter": "alpha"}
        assert greedy(client, "support", "Where is my order?").model.startswith("alpha@")
        assert greedy(client, "base", "Where is my order?").model == "SmolLM2-135M-Instruct"  # never routed
        missing = httpx.post(f"{gateway.url}/v1/router", json={"kind": "static", "adapter": "gamma"})
        assert missing.status_code == 409 and "gamma" in missing.text
        for bad in ({"kind": "neural"}, {"kind": "keyword"}, [1, 2]):
            assert httpx.post(f"{gateway.url}/v1/router", json=bad).status_code == 400
        assert httpx.post(f"{gateway.url}/v1/router", content=b"{nope").status_code == 400
        assert (
            httpx.get(f"{gateway.url}/v1/router").json()["adapter"] == "alpha"
        )  # failed swaps changed nothing
    finally:
        assert httpx.post(f"{gateway.url}/v1/router", json=original).status_code == 200


def test_the_route_endpoint_tells_the_gateways_own_decision_which_its_requests_then_get(client, gateway):
    from trace_plugin.gateway.admin_client import GatewayAdmin

    ensure_loaded(gateway, "beta@1", "beta/1")
    route = GatewayAdmin(gateway.url).route
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "return this"}]
    assert asyncio.run(route("support", opening)) == "beta"  # the live version serves it
    assert asyncio.run(route("support", [{"role": "user", "content": "Where is my order?"}])) == ""
    assert asyncio.run(route("beta", opening)) == "beta"  # a named adapter is its own decision
    served = greedy(client, "support", "return this")
    assert served.model == "beta@1"
    refused = httpx.post(f"{gateway.url}/v1/route", json={"model": "support", "messages": []})
    assert refused.status_code == 400
    unknown = httpx.post(
        f"{gateway.url}/v1/route", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert unknown.status_code == 404


def test_hot_swap_under_load_drops_nothing_and_rolls_back(client, gateway):
    ensure_loaded(gateway, "alpha@1", "alpha/1")

    def swap():
        r = admin(gateway, "load_lora_adapter", lora_name="alpha@2", lora_path="alpha/2")
        assert r.status_code == 200, r.text

    served, failures = swap_under_load(lambda: greedy(client, "alpha", "Hello!", max_tokens=3).model, swap)
    assert failures == []
    assert "alpha@1" in {s.model for s in served}
    late = [s.model for s in served if s.after_swap]
    assert late and all(m == "alpha@2" for m in late), "a call sent once the new version is live gets it"
    # The old version was unloaded once drained; rollback brings it back in one call.
    state = httpx.get(f"{gateway.url}/v1/lora_adapters").json()
    assert "alpha@1" not in state["loaded"] and state["live"]["alpha"] == "alpha@2"
    r = admin(gateway, "rollback_lora_adapter", lora_name="alpha")
    assert r.status_code == 200 and "alpha@1" in r.text
    assert greedy(client, "alpha", "Hello!", max_tokens=3).model == "alpha@1"


def test_unload_and_unknown_adapter(client, gateway):
    ensure_loaded(gateway, "beta@1", "beta/1")
    assert admin(gateway, "unload_lora_adapter", lora_name="beta").status_code == 200
    assert "beta" not in {m.id for m in client.models.list().data}
    assert admin(gateway, "unload_lora_adapter", lora_name="beta").status_code == 404


@pytest.mark.parametrize(
    ("path", "status"),
    [("../outside", 403), ("/etc", 403), ("missing/9", 404), ("escape", 403), ("broken", 400)],
)
def test_adapter_paths_are_confined_to_the_root(
    gateway, backend, adapter_root, tmp_path_factory, path, status
):
    if path == "escape" and not (adapter_root / "escape").exists():  # a symlink inside the root leading out
        outside = random_adapter(backend.model_dir, tmp_path_factory.mktemp("outside") / "a", seed=5)
        (adapter_root / "escape").symlink_to(outside)
    if path == "broken":
        (adapter_root / "broken").mkdir(exist_ok=True)
        (adapter_root / "broken" / "adapter_config.json").write_text("{not json")
    r = admin(gateway, "load_lora_adapter", lora_name=f"x{status}@1", lora_path=path)
    assert r.status_code == status, r.text


@pytest.mark.parametrize("broken", ["nan", "inf", "layer 999", "unknown module"])
def test_an_adapter_that_would_load_and_serve_nothing_is_refused_and_the_live_one_serves(
    client, gateway, backend, adapter_root, broken
):
    """NaN or Inf weights loaded with 200 and then served ""; weights for a module the base
    lacks (layer 999, another architecture's) loaded with 200 and did nothing."""
    import shutil

    from safetensors.numpy import load_file, save_file

    ensure_loaded(gateway, "alpha@1", "alpha/1")
    before = greedy(client, "alpha", "Say hello.").choices[0].message.content
    target = adapter_root / "alpha" / f"broken-{broken.replace(' ', '-')}"
    shutil.copytree(adapter_root / "alpha" / "1", target, dirs_exist_ok=True)
    weights = load_file(str(target / "adapter_model.safetensors"))
    name = next(n for n in weights if ".lora_B." in n)
    if broken in ("nan", "inf"):
        weights[name] = weights[name].copy()
        weights[name].flat[0] = float(broken)
    else:
        other = name.replace(".lora_B.", ".fused.lora_B.")  # a module no layer of this model has
        moved = name.replace("layers.0.", "layers.999.") if broken == "layer 999" else other
        weights[moved] = weights.pop(name)
    save_file(weights, str(target / "adapter_model.safetensors"))
    r = admin(
        gateway, "load_lora_adapter", lora_name="alpha@9", lora_path=str(target.relative_to(adapter_root))
    )
    assert r.status_code == 422, r.text
    assert ("NaN or Inf" if broken in ("nan", "inf") else "modules the base model lacks") in r.text
    assert greedy(client, "alpha", "Say hello.").choices[0].message.content == before  # alpha@1 still serves


async def test_admin_needs_the_token_and_loopback(backend, adapter_root):
    app = create_app(
        backend, config=GatewayConfig(adapter_root=adapter_root, admin_token="s3cret", record=False)
    )
    body = {"lora_name": "gamma@1", "lora_path": "beta/1"}
    local = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
    remote = httpx.ASGITransport(app=app, client=("10.1.2.3", 5000))
    async with httpx.AsyncClient(transport=local, base_url="http://gw") as c:
        r = await c.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 401
        r = await c.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    async with httpx.AsyncClient(transport=remote, base_url="http://gw") as c:
        r = await c.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 403
    async with httpx.AsyncClient(transport=local, base_url="http://gw") as c:
        r = await c.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        r = await c.post(
            "/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert r.status_code == 200
    await asyncio.sleep(0)


# -- capture -----------------------------------------------------------------------------


def test_calls_are_recorded_and_grouped_into_conversations(client, gateway, backend):
    recorder = gateway.recorder
    first = [
        {"role": "system", "content": "You look up orders."},
        {"role": "user", "content": "Where is W42?"},
    ]
    r1 = client.chat.completions.create(
        model=backend.model_id,
        messages=first,
        tools=TOOLS,
        temperature=0,
        max_tokens=30,
        extra_headers={"X-Trace-Agent": "conv-agent"},
    )
    reply = r1.choices[0].message.model_dump(exclude_none=True)
    follow = [*first, reply, {"role": "user", "content": "Thanks. And W43?"}]
    client.chat.completions.create(
        model=backend.model_id,
        messages=follow,
        temperature=0,
        max_tokens=10,
        extra_headers={"X-Trace-Agent": "conv-agent"},
    )
    other = client.chat.completions.create(
        model=backend.model_id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        extra_headers={"X-Trace-Agent": "conv-agent", "X-Trace-Episode": "ticket-9"},
    )
    assert recorder.flush(10)
    episodes = recorder.store.list_episodes("conv-agent")
    assert len(episodes) == 2
    conversation = recorder.store.get_episode(next(e.id for e in episodes if e.id != "ticket-9"))
    assert [s.kind for s in conversation.steps] == ["llm", "llm"]
    assert conversation.source == "gateway" and conversation.model == backend.model_id
    assert conversation.steps[0].input["messages"] == first and conversation.steps[0].input["tools"] == [
        "get_order"
    ]
    assert {t["function"]["name"] for t in recorder.store.tool_schemas("conv-agent")} == {"get_order"}
    assert (
        recorder.store.get_episode("ticket-9").steps[0].output["content"] == other.choices[0].message.content
    )
    assert json.loads(json.dumps(conversation.steps[1].output))["role"] == "assistant"


def test_a_decorated_langgraph_agent_on_chatopenai_is_captured_twice_consistently(
    gateway, backend, sqlite_url
):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    import trace_plugin

    @tool
    def get_order(order_id: str) -> str:
        """Look up an order."""
        return f"order {order_id} is pending"

    ensure_loaded(gateway, "beta@1", "beta/1")
    model = ChatOpenAI(
        base_url=gateway.url + "/v1",
        api_key="unused",
        model=backend.model_id,
        temperature=0,
        max_tokens=40,
        default_headers={"X-Trace-Agent": "lg-through-gateway"},
    )
    local = Recorder(sqlite_url)
    agent = trace_plugin.capture(agent="lg-agent", recorder=local)(create_agent(model, [get_order]))
    state = agent.invoke({"messages": [("user", "I want to return order W5. Where is it?")]})
    assert state["messages"][-1].type == "ai"

    assert local.flush(10) and gateway.recorder.flush(10)
    [decorated] = local.store.list_episodes("lg-agent")
    decorated = local.store.get_episode(decorated.id)
    llm_steps = [s for s in decorated.steps if s.kind == "llm"]
    served = gateway.recorder.store.list_episodes("lg-through-gateway")
    served_steps = [s for e in served for s in gateway.recorder.store.get_episode(e.id).steps]
    assert len(served_steps) == len(llm_steps) >= 1
    for ours, theirs in zip(llm_steps, sorted(served_steps, key=lambda s: s.started_at), strict=True):
        assert (ours.output.get("content") or "") == (theirs.output.get("content") or "")
        assert ours.input["messages"][-1]["content"] == theirs.input["messages"][-1]["content"]
    # both recordings say which adapter served it and which router version chose it
    keyword = router_version(httpx.get(f"{gateway.url}/v1/router").json())
    assert (decorated.adapter, decorated.router) == ("beta@1", keyword)
    assert {(e.adapter, e.router) for e in served} == {("beta@1", keyword)}
    local.close()
