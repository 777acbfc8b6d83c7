"""Continuous batching in the embedded backend, on the real model: rows join a running decode
batch as slots free up and leave it as they end, and that changes no token of any reply."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from trace_plugin.gateway.backend import Delta, Finished, SamplingParams
from trace_plugin.gateway.embedded import EmbeddedBackend

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name three colours.",
    "What is 2+2? Answer briefly.",
    "Write a haiku about the sea.",
    "Say hello in French.",
    "List two fruits.",
    "Describe a lighthouse keeper's day.",
    # Longer than the slots first made room for: joining grows them under the running rows.
    "Count the words in this text: " + "the sea is calm today and the boats are out " * 40,
]


@pytest.fixture
def backend(embedded_backend: EmbeddedBackend) -> Iterator[EmbeddedBackend]:
    """The session's backend with two slots: five requests must join and leave one batch."""
    embedded_backend.max_batch = 2
    yield embedded_backend
    embedded_backend.max_batch = 8


def prompt(backend: EmbeddedBackend, question: str) -> str:
    return backend.render([{"role": "user", "content": question}], None)


def alone(backend: EmbeddedBackend, text: str, max_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` on the prompt by itself, on the base weights
    (earlier tests may have left adapters loaded, one folded in)."""
    ids = backend.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with backend._torch, torch.inference_mode():
        backend._fold(None)
        base = backend.model.disable_adapter() if backend._adapters else contextlib.nullcontext()
        with base:
            out = backend.model.generate(
                **ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=backend._eos_id,
                pad_token_id=backend.tokenizer.pad_token_id,
            )
    return out[0, ids.input_ids.shape[1] :].tolist()


def test_rows_that_join_and_leave_a_running_batch_get_the_tokens_they_would_alone(backend):
    """Seven requests of different lengths through two slots: each row starts beside one
    that is part-way through, rows move between slots as others end, and the long prompt
    grows the slots while a row is running."""
    lengths = [40, 6, 24, 12, 32, 18, 8]
    prompts = [prompt(backend, q) for q in QUESTIONS]

    async def run() -> list[list[int]]:
        replies = await asyncio.gather(
            *(
                backend.generate(p, SamplingParams(max_tokens=n), None)
                for p, n in zip(prompts, lengths, strict=True)
            )
        )
        return [r[0].token_ids for r in replies]

    batched = asyncio.run(run())
    assert batched == [alone(backend, p, n) for p, n in zip(prompts, lengths, strict=True)]


def test_a_short_reply_does_not_wait_for_a_long_one_beside_it(backend):
    """A long reply is decoding when a short request arrives: the short one joins the
    running batch and is done while the long one still runs (a static batch would make it
    wait for the long one to end)."""
    long = SamplingParams(max_tokens=200, min_tokens=200)
    short = SamplingParams(max_tokens=4)
    order: list[str] = []

    async def run() -> None:
        events = await backend.stream(prompt(backend, QUESTIONS[5]), long, None)

        async def read_long() -> None:
            async for event in events:
                if isinstance(event, Delta) and not order:
                    order.append("long started")
                    short_task.set()
                if isinstance(event, Finished):
                    order.append("long done")

        async def ask_short() -> None:
            await short_task.wait()
            await backend.generate(prompt(backend, QUESTIONS[0]), short, None)
            order.append("short done")

        short_task = asyncio.Event()
        await asyncio.gather(read_long(), ask_short())

    asyncio.run(run())
    assert order == ["long started", "short done", "long done"]


def test_a_seeded_request_draws_the_same_reply_whatever_runs_beside_it(backend):
    """Each seeded request draws from its own generator: its company changes nothing."""
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    text = prompt(backend, QUESTIONS[2])

    async def run(with_company: bool) -> list[int]:
        others = QUESTIONS[:3] if with_company else []
        company = [
            backend.generate(prompt(backend, q), SamplingParams(max_tokens=16, temperature=1.0), None)
            for q in others
        ]
        replies = await asyncio.gather(backend.generate(text, params, None), *company)
        return replies[0][0].token_ids

    by_itself = asyncio.run(run(False))
    assert asyncio.run(run(True)) == by_itself
    assert asyncio.run(run(False)) == by_itself


def test_close_returns_once_the_engine_thread_has_ended_and_a_later_request_starts_another(backend):
    """A server stopping waits for the engine: an engine thread still inside torch while the
    interpreter exits aborted the process (exit 134) on a 2-core AVX2 machine."""

    async def ask_then_close() -> threading.Thread:
        await backend.generate(prompt(backend, QUESTIONS[0]), SamplingParams(max_tokens=4), None)
        engine = backend._engine
        assert engine is not None and engine.is_alive()
        await backend.close()
        return engine

    engine = asyncio.run(ask_then_close())
    assert not engine.is_alive() and backend._engine is None
    [again] = asyncio.run(backend.generate(prompt(backend, QUESTIONS[1]), SamplingParams(max_tokens=2), None))
    assert again.token_ids  # a request after close starts a new engine


def test_a_busy_engine_hands_freed_memory_back_every_trim_every_s(backend, monkeypatch):
    """The engine's keys and values come and go in every size, and glibc keeps what they
    freed: a busy engine trims the heap every ``trim_every_s``, and no more often."""
    import trace_plugin.gateway.embedded as embedded

    calls: list[bool] = []
    monkeypatch.setattr(embedded, "trim", lambda *, collect=True: calls.append(collect))
    params = SamplingParams(max_tokens=8, min_tokens=8)
    prompts = [prompt(backend, q) for q in QUESTIONS[:2]]
    monkeypatch.setattr(backend, "trim_every_s", 3600.0)
    backend.generate_rows(prompts, [None, None], params)
    assert calls == []
    monkeypatch.setattr(backend, "trim_every_s", 0.0)
    backend.generate_rows(prompts, [None, None], params)
    assert len(calls) >= 7  # every turn of the loop: a step per token after the prompt run's
    assert not any(calls)  # no garbage collection on the engine's turns
