"""The embedded backend: one transformers model plus PEFT LoRA adapters, on CPU by default.

Concurrent requests are collected for a few milliseconds and generated together: rows
that share sampling settings go through one ``generate`` call, and PEFT's mixed-batch
``adapter_names`` routes each row through its own adapter (or ``__base__``); a batch with
one adapter runs on the base weights with that adapter folded in, one with none on the
base weights alone. All torch work, generation and adapter
(un)loading, runs on one worker thread in turn, so swapping an adapter never races a
generation. Each request's results reach its event loop as events: a streamed request's
new text at every step (:class:`RowWatch`), then each completion whole; a request whose
consumer stops listening has its rows stopped at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_plugin.chat_template import forbidden_token_ids, render
from trace_plugin.gateway.backend import (
    BackendError,
    Completion,
    Delta,
    Events,
    Finished,
    SamplingParams,
    StreamEvent,
)
from trace_plugin.gateway.prefix_cache import PrefixCache, line_end_tokens
from trace_plugin.gateway.stops import StopMatcher
from trace_plugin.generation import (
    Fold,
    Ids,
    Layers,
    generate_batch,
    layers,
    prefill,
    stacked_cache,
    until_eos,
)
from trace_plugin.model_files import Precision, load_model, resolve_model

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


@dataclass(slots=True)
class _Request:
    """A queued request, and the queue its events reach its event loop through."""

    prompt: str
    params: SamplingParams
    adapter: str | None
    loop: asyncio.AbstractEventLoop
    streams: bool  # deltas too, not only each completion once it is done
    events: asyncio.Queue[StreamEvent | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # its consumer went away: its rows stop at the next token

    def put(self, event: StreamEvent | BaseException) -> None:
        """From the worker thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(slots=True)
class RowOutput:
    """Where a row's text goes as it is generated, and whether anyone still wants it."""

    emit: Callable[[str], None] | None = None  # None: the row is not streamed
    cancelled: Callable[[], bool] = field(default=lambda: False)


class EmbeddedBackend:
    """Serves a local model (the embedded SmolLM2-135M by default) and its LoRA adapters."""

    structured_output = False  # transformers' generate has no JSON-schema decoding

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_batch: int = 8,
        batch_window_s: float = 0.005,
        max_lora_rank: int = 64,
        prefix_cache: int = 8,
        precision: Precision = "auto",
    ) -> None:
        self.model_dir = resolve_model(model)
        self.model_id = self.model_dir.name
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.max_lora_rank = max_lora_rank
        self.model, self.tokenizer = load_model(self.model_dir, precision=precision)
        self.dtype = self.model.dtype  # the weights'; adapters stay float32, as PEFT loads them
        self.context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        # No token decodes to more characters than the longest vocabulary entry: a prompt
        # longer than context x that cannot fit, and is refused before it is tokenized.
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self._eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(self._eos_id, int) or self._eos_id == self.tokenizer.unk_token_id:
            self._eos_id = self.tokenizer.eos_token_id
        self._adapters: dict[str, Path] = {}
        self._folded: tuple[str, Fold] | None = None  # the adapter in the base weights now
        # vLLM-style automatic prefix caching: this many prefixes' keys and values (0: off).
        # Prefixes end at a turn of the shared ChatML template, or at the end of a line.
        turn = self.tokenizer.convert_tokens_to_ids("<|im_start|>")
        usable = prefix_cache and isinstance(turn, int) and turn != self.tokenizer.unk_token_id
        self.prefix_cache = (
            PrefixCache(turn, line_ends=line_end_tokens(self.tokenizer), capacity=prefix_cache)
            if usable
            else None
        )
        self.cancelled_rows = 0  # rows stopped mid-generation because their client left
        self._torch = threading.Lock()
        self._workers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[asyncio.Queue, asyncio.Task]
        ]
        self._workers = weakref.WeakKeyDictionary()

    # -- the Backend protocol --------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return render(self.tokenizer, messages, tools)

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        request = await self._submit(prompt, params, adapter, streams=False)
        done = {event.index: event.completion async for event in self._events(request)}
        return [done[i] for i in range(params.n)]

    async def stream(self, prompt: str, params: SamplingParams, adapter: str | None) -> Events:
        return self._events(await self._submit(prompt, params, adapter, streams=True))

    async def _submit(
        self, prompt: str, params: SamplingParams, adapter: str | None, *, streams: bool
    ) -> _Request:
        if adapter is not None and adapter not in self._adapters:
            raise BackendError(f"adapter {adapter!r} is not loaded", status=404)
        await self._check_fits(prompt, params.max_tokens)
        loop = asyncio.get_running_loop()
        queue, worker = self._workers.get(loop, (None, None))
        if queue is None or worker is None or worker.done():  # one batching worker per event loop
            queue = asyncio.Queue()
            worker = loop.create_task(self._batch_loop(queue), name="embedded-generate")
            self._workers[loop] = (queue, worker)
        request = _Request(prompt, params, adapter, loop, streams)
        await queue.put(request)
        return request

    @staticmethod
    async def _events(request: _Request) -> Events:
        """The request's events until its last completion; leaving early cancels its rows."""
        finished = 0
        try:
            while finished < request.params.n:
                event = await request.events.get()
                if isinstance(event, BaseException):
                    raise event
                finished += isinstance(event, Finished)
                yield event
        finally:
            request.cancelled = finished < request.params.n

    async def _check_fits(self, prompt: str, max_tokens: int) -> None:
        """A 400 for a prompt the model's context cannot hold, before it joins a batch:
        in one, it would fail every request generated beside it."""
        if self.context is None:
            return
        if len(prompt) > self.context * self._max_token_chars:
            raise BackendError(f"the prompt ({len(prompt)} characters) cannot fit the model's context", 400)
        tokens = len(await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=False))
        if tokens + max_tokens > self.context:
            raise BackendError(
                f"the prompt is {tokens} tokens and max_tokens {max_tokens}: "
                f"over the model's {self.context}-token context",
                400,
            )

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self._embed, texts)

    async def load_adapter(self, name: str, path: Path) -> None:
        await asyncio.to_thread(self._load_adapter, name, Path(path))

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self._unload_adapter, name)

    async def adapters(self) -> set[str]:
        return set(self._adapters)

    async def close(self) -> None:
        _, worker = self._workers.pop(asyncio.get_running_loop(), (None, None))
        if worker is not None:
            worker.cancel()

    # -- batching ------------------------------------------------------------------------

    async def _batch_loop(self, queue: asyncio.Queue[_Request]) -> None:
        while True:
            batch = [await queue.get()]
            deadline = asyncio.get_running_loop().time() + self.batch_window_s
            while len(batch) < self.max_batch:
                timeout = deadline - asyncio.get_running_loop().time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), timeout))
                except TimeoutError:
                    break
            groups: dict[SamplingParams, list[_Request]] = defaultdict(list)
            for request in batch:
                if not request.cancelled:  # its client left while it was queued
                    groups[request.params].append(request)
            for params, requests in groups.items():
                try:
                    results = await asyncio.to_thread(self._generate_group, requests, params)
                except Exception as exc:  # one bad group must not take the worker down
                    error = (
                        exc if isinstance(exc, BackendError) else BackendError(f"generation failed: {exc}")
                    )
                    for request in requests:
                        request.events.put_nowait(error)
                    continue
                for request, completions in zip(requests, results, strict=True):
                    for index, completion in enumerate(completions):
                        request.events.put_nowait(Finished(index, completion))

    # -- torch work (worker thread) ------------------------------------------------------------

    def generate_rows(
        self,
        prompts: list[str],
        adapters: list[str | None],
        params: SamplingParams,
        outputs: Sequence[RowOutput] | None = None,
    ) -> list[Completion]:
        """One ``generate`` call over ``prompts``, row i through ``adapters[i]``, its text
        streamed to ``outputs[i]`` as it is generated."""
        import torch
        from transformers import StoppingCriteriaList

        rows = [tuple(ids) for ids in self.tokenizer(prompts, add_special_tokens=False).input_ids]
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "min_new_tokens": params.min_tokens or None,
            "do_sample": params.temperature > 0,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self._eos_id,
            "return_dict_in_generate": True,
            "output_logits": params.logprobs or params.top_logprobs > 0,
        }
        stops = StopMatcher(params.stop) if params.stop else None
        # A stop string ends generating there, not just the text afterwards.
        watch = RowWatch(self.tokenizer, len(rows), stops, outputs, eos=self._eos_id)
        kwargs["stopping_criteria"] = StoppingCriteriaList([watch])
        if params.bad_words:
            kwargs["bad_words_ids"] = forbidden_token_ids(self.tokenizer, params.bad_words)
        if params.temperature > 0:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:  # greedy: silence sampling defaults from generation_config
            kwargs.update(temperature=None, top_p=None, top_k=None)
        with self._torch, torch.inference_mode():
            skips, cache = self._cached_prefix(rows, adapters)
            if params.seed is not None:
                torch.manual_seed(params.seed)
            routing, route = self._route(adapters)
            with routing:
                out, width = generate_batch(
                    self.model, rows, kwargs["pad_token_id"], skip=skips, cache=cache, **kwargs, **route
                )
        self.cancelled_rows += watch.cancelled
        return [
            self._completion(sequence[width:].tolist(), list(ids), out, row, params, stops)
            for row, (sequence, ids) in enumerate(zip(out.sequences, rows, strict=True))
        ]

    def _cached_prefix(self, rows: list[Ids], adapters: list[str | None]) -> tuple[list[int], Any]:
        """How many leading tokens each row skips, and their keys and values as one batch
        cache (no cache when the prefix cache is off).

        Each row takes its longest cached prefix, first extending or building the entry when
        the row shares a longer one with its batch or a recent prompt. Rows reuse different
        lengths (requests offering their own tools part inside the system turn), and a batch
        pads every row to its longest remainder and computes the padding too: so each row
        first runs alone what it has beyond the shortest remainder.
        """
        if self.prefix_cache is None:
            return [0] * len(rows), None
        found = []
        for i, (ids, adapter) in enumerate(zip(rows, adapters, strict=True)):
            entry = self.prefix_cache.longest(adapter, ids)
            wanted = self.prefix_cache.wanted(ids, rows[:i] + rows[i + 1 :])
            if wanted > (len(entry[0]) if entry else 0):
                entry = (ids[:wanted], self._prefill(ids[:wanted], adapter, entry))
                self.prefix_cache.put(adapter, *entry)
            found.append(entry)
        for ids in rows:
            self.prefix_cache.seen(ids)
        reused = [len(entry[0]) if entry else 0 for entry in found]
        stats = self.prefix_cache.stats
        stats.lookups += len(rows)
        stats.hits += sum(1 for n in reused if n)
        stats.tokens_reused += sum(reused)
        # Every row runs on its own what it has beyond the batch's shortest remainder, so the
        # batch runs as many tokens in every row and computes no padding.
        rest = min(len(ids) - n for ids, n in zip(rows, reused, strict=True))
        skips = [len(ids) - rest for ids in rows]
        kvs = [
            self._prefill(ids[:skip], adapter, entry) if skip > n else (entry[1] if entry else None)
            for ids, adapter, entry, n, skip in zip(rows, adapters, found, reused, skips, strict=True)
        ]
        return skips, stacked_cache(self.model, kvs, skips) if any(skips) else None

    def _prefill(self, prefix: Ids, adapter: str | None, base: tuple[Ids, Any] | None) -> Layers:
        """The keys and values of ``prefix`` under ``adapter``, continuing from ``base``'s."""
        start = len(base[0]) if base else 0
        routing, route = self._route([adapter])
        with routing:
            return layers(prefill(self.model, prefix[start:], past=base[1] if base else None, **route))

    def _route(self, adapters: list[str | None]) -> tuple[contextlib.AbstractContextManager, dict[str, Any]]:
        """How to run rows through their adapters: a context to run in, and model kwargs.

        PEFT's mixed batch (``adapter_names``) splits every LoRA layer's input by adapter,
        which makes one expert's batch 1.21x slower than with that adapter active
        (``bench/gateway.py``), and an active adapter's own low-rank path costs more again.
        So a batch with a single adapter (the common case: one deployment, or an evaluation
        through one expert) runs on the base weights with that adapter folded in, and stays
        folded for the batches after it; a batch with none runs with every adapter disabled.
        """
        if not self._adapters:
            return contextlib.nullcontext(), {}
        names = set(adapters)
        self._fold(next(iter(names)) if len(names) == 1 else None)
        if len(names) > 1:
            return contextlib.nullcontext(), {"adapter_names": [a or BASE for a in adapters]}
        return self.model.disable_adapter(), {}  # the base weights, ``_folded``'s adapter in them

    def _fold(self, name: str | None) -> None:
        """Have ``name``'s adapter, and no other, folded into the base weights (None: none)."""
        if self._folded is not None and self._folded[0] == name:
            return
        if self._folded is not None:
            self._folded[1].restore()
            self._folded = None
        if name is not None:
            self.model.set_adapter(name, inference_mode=True)  # stay frozen, as loaded
            self._folded = (name, Fold(self.model))

    def _completion(
        self,
        ids: list[int],
        prompt_ids: list[int],
        out: Any,
        row: int,
        params: SamplingParams,
        stops: StopMatcher | None,
    ) -> Completion:
        finish = "stop" if self._eos_id in ids else "length"
        ids = until_eos(ids, self._eos_id)  # keep the stop token: training needs it
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = stops.cut(text) if stops is not None else None
        if cut is not None:
            text, finish = cut, "stop"
        logprobs = top = None
        if params.logprobs:
            logprobs = [
                float(out.logits[i][row].float().log_softmax(-1)[token]) for i, token in enumerate(ids)
            ]
        if params.top_logprobs:
            top = []
            for i in range(len(ids)):
                values, indices = out.logits[i][row].float().log_softmax(-1).topk(params.top_logprobs)
                tokens = self.tokenizer.convert_ids_to_tokens(indices.tolist())
                text_of = self.tokenizer.convert_tokens_to_string
                top.append({text_of([t]): float(v) for t, v in zip(tokens, values, strict=True)})
        return Completion(text, ids, finish, prompt_ids, logprobs, top)

    def _embed(self, texts: list[str]) -> list[list[float]]:
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        # The index of each row's last real token, whichever side the padding is on.
        last = (enc.attention_mask * torch.arange(enc.attention_mask.shape[1])).argmax(dim=1)
        with self._torch, torch.inference_mode():
            base_model, _ = self._route([None])  # the frozen base model's states, whatever is loaded
            with base_model:
                out = self.model(**enc, output_hidden_states=True, logits_to_keep=1)
        states = out.hidden_states[-1][torch.arange(len(texts)), last]
        return torch.nn.functional.normalize(states.float(), dim=-1).tolist()

    def _generate_group(self, requests: list[_Request], params: SamplingParams) -> list[list[Completion]]:
        prompts = [r.prompt for r in requests for _ in range(params.n)]
        adapters = [r.adapter for r in requests for _ in range(params.n)]
        missing = {a for a in adapters if a is not None and a not in self._adapters}
        if missing:
            raise BackendError(f"adapter(s) unloaded while queued: {sorted(missing)}", status=404)
        outputs = [_row_output(r, i) for r in requests for i in range(params.n)]
        rows = self.generate_rows(prompts, adapters, params, outputs)
        return [rows[i * params.n : (i + 1) * params.n] for i in range(len(requests))]

    def _load_adapter(self, name: str, path: Path) -> None:
        from peft import PeftModel

        with self._torch:
            if name in self._adapters:
                raise BackendError(f"adapter {name!r} is already loaded", status=400)
            try:
                if isinstance(self.model, PeftModel):
                    self.model.load_adapter(str(path), adapter_name=name)
                else:
                    self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
            except Exception as exc:
                raise BackendError(f"could not load adapter {name!r} from {path}: {exc}", status=400) from exc
            self.model.eval()
            self._adapters[name] = path

    def _unload_adapter(self, name: str) -> None:
        with self._torch:
            if name not in self._adapters:
                raise BackendError(f"adapter {name!r} is not loaded", status=404)
            self._fold(None)
            if len(self._adapters) == 1:  # PEFT cannot delete its last adapter; unwrap instead
                self.model = self.model.unload()
            else:
                self.model.delete_adapter(name)
            del self._adapters[name]
            if self.prefix_cache is not None:
                self.prefix_cache.drop(name)


def _row_output(request: _Request, index: int) -> RowOutput:
    emit = (lambda text: request.put(Delta(index, text))) if request.streams else None
    return RowOutput(emit, lambda: request.cancelled)


class RowWatch:
    """A stopping criterion that reads each row's newest text as it is generated.

    It stops a row once a stop string completes in it or once nobody wants it any more,
    and hands a streamed row's new text on, holding back what may yet begin a stop string.
    Each step decodes only the row's newest tokens (vLLM's incremental detokenization: the
    text of the tokens since the last complete character, less what was already read) and
    feeds that to the row's matcher state, so a step costs the same however many stop
    strings there are and however long the reply has grown.
    """

    def __init__(
        self,
        tokenizer: Any,
        rows: int,
        stops: StopMatcher | None = None,
        outputs: Sequence[RowOutput] | None = None,
        *,
        eos: int | None = None,
    ) -> None:
        self.stops, self.tokenizer, self.eos = stops, tokenizer, eos
        self.outputs = list(outputs) if outputs else [RowOutput() for _ in range(rows)]
        self._ids: list[list[int]] = [[] for _ in range(rows)]
        self._offsets = [(0, 0)] * rows  # per row: where the decoded window starts, where reading ended
        self._states = [0] * rows
        self._texts = [""] * rows  # each decoded row's text so far
        self._sent = [0] * rows  # how much of it was handed on
        self._done = [False] * rows
        self.cancelled = 0  # rows stopped because nobody wanted them any more

    def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
        import torch

        for row, token in enumerate(input_ids[:, -1].tolist()):
            if self._done[row]:
                continue
            if self.outputs[row].cancelled():
                self._done[row] = True
                self.cancelled += 1
            elif token == self.eos:  # generate ends the row itself; nothing more to read
                self._flush(row, len(self._texts[row]))
                self._done[row] = True
            elif self.stops is not None or self.outputs[row].emit is not None:
                self._done[row] = self._step(row, token)
        return torch.tensor(self._done, device=input_ids.device)

    def _step(self, row: int, token: int) -> bool:
        ids = self._ids[row]
        ids.append(token)
        start, read = self._offsets[row]
        before = self.tokenizer.decode(ids[start:read], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):  # a character still incomplete
            return False
        self._offsets[row] = (read, len(ids))
        piece = after[len(before) :]
        self._texts[row] += piece
        if self.stops is None:
            self._flush(row, len(self._texts[row]))
            return False
        self._states[row], end = self.stops.feed(piece, self._states[row])
        if end is not None:  # hand on the text before the stop string, never the stop itself
            completed = len(self._texts[row]) - len(piece) + end
            self._flush(row, completed - self.stops.stop_length(self._states[row]))
            return True
        self._flush(row, len(self._texts[row]) - self.stops.pending(self._states[row]))
        return False

    def _flush(self, row: int, upto: int) -> None:
        emit = self.outputs[row].emit
        if emit is not None and upto > self._sent[row]:
            emit(self._texts[row][self._sent[row] : upto])
            self._sent[row] = upto
