"""``/v1/completions``: raw prompts completed, whole or streamed, each prompt recorded as a
step whose input is the prompt itself."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from trace_plugin.conversations import ModelCall, fingerprint
from trace_plugin.gateway.backend import BackendError, Completion, Delta, SamplingParams
from trace_plugin.gateway.protocol import CompletionRequest
from trace_plugin.gateway.routes.wire import (
    EventStream,
    envelope,
    head,
    legacy_logprobs,
    sampling_params,
    sse,
    usage,
)
from trace_plugin.gateway.state import (
    ADAPTER_HEADER,
    CANCELLED,
    ENDED_EARLY,
    EPISODE_HEADER,
    Gateway,
    GatewayError,
    GatewayState,
    Stream,
    gateway_error_of,
)
from trace_plugin.records.mixture import Mixture
from trace_plugin.records.trajectory import utcnow

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, gateway: Gateway) -> Any:
    backend = gateway.backend
    agent, episode, record = gateway.trace_ids(request, body)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    adapter, router = await gateway.select(
        body.model, [{"role": "user", "content": prompts[0]}], None, request
    )
    params = replace(sampling_params(body, body.max_tokens or 16), top_logprobs=body.logprobs or 0)

    def call_of(prompt: str, served: str | None) -> ModelCall:
        """A step per prompt, its input the prompt itself; grouped into episodes as the
        user turn the router read it as."""
        return ModelCall(
            agent=agent,
            messages=[{"role": "user", "content": prompt}],
            model=backend.model_id,
            input={"prompt": prompt},
            episode_id=episode,
            record=record,
            adapter=served,
            router=router,
            started_at=utcnow(),
        )

    if body.stream:
        first = await gateway.open_stream(prompts[0], params, adapter)
        chunks = completion_chunks(gateway, body, prompts, params, adapter, first, call_of)
        headers = {ADAPTER_HEADER: first.served or "", **({EPISODE_HEADER: episode} if episode else {})}
        return EventStream(chunks, media_type="text/event-stream", headers=headers)
    results: list[Completion] = []
    served = None
    calls: list[tuple[ModelCall, float, list[Completion]]] = []  # the call, its timer, its outputs
    for prompt in prompts:
        call, t0 = call_of(prompt, None), time.perf_counter()
        outs, served = await gateway.generate(prompt, params, adapter)
        results.extend(outs)
        calls.append((replace(call, adapter=served), t0, outs))
    choices = []
    for i, c in enumerate(results):
        choice: dict[str, Any] = {
            "index": i,
            "text": (prompts[i // params.n] if body.echo else "") + c.text,
            "finish_reason": c.finish_reason,
            "logprobs": legacy_logprobs(backend, c) if body.wants_logprobs() else None,
        }
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
            choice["prompt_token_ids"] = c.prompt_token_ids
        choices.append(choice)
    response = envelope(
        "text_completion", served or backend.model_id, choices, results, fingerprint(router, served)
    )
    recorded: set[str] = set()
    for call, t0, outs in calls if record else ():
        replies = [{"role": "assistant", "content": c.text} for c in outs]
        recorded.add(gateway.record_call(call, replies, outs, t0))
    headers = {ADAPTER_HEADER: served or ""}
    if len(recorded) == 1:
        headers[EPISODE_HEADER] = recorded.pop()
    return JSONResponse(response, headers=headers)


async def completion_chunks(
    gateway: GatewayState,
    body: CompletionRequest,
    prompts: list[str],
    params: SamplingParams,
    mixture: Mixture,
    first: Stream,
    call_of: Callable[[str, str | None], ModelCall],
) -> AsyncIterator[str]:
    """Each prompt's completions as they are generated, prompt after prompt."""
    finished: list[Completion] = []
    try:
        for number, prompt in enumerate(prompts):
            stream = first if number == 0 else await gateway.open_stream(prompt, params, mixture)
            call = call_of(prompt, stream.served)
            async for chunk in prompt_chunks(gateway, body, number * params.n, call, stream, finished):
                yield chunk
        if body.streams_usage():
            call = call_of("", first.served)
            model = first.served or gateway.backend.model_id
            base = head("text_completion", model, fingerprint(call.router, call.adapter))
            yield sse(base | {"choices": [], "usage": usage(finished)})
        yield sse("[DONE]")
    except (BackendError, GatewayError) as exc:
        error = exc if isinstance(exc, GatewayError) else gateway_error_of(exc)
        yield sse({"error": {"message": error.message, "type": error.type, "param": None, "code": None}})


async def prompt_chunks(
    gateway: GatewayState,
    body: CompletionRequest,
    first_index: int,
    call: ModelCall,
    stream: Stream,
    finished: list[Completion],
) -> AsyncIterator[str]:
    """One prompt's chunks (choices numbered from ``first_index``); its call is recorded
    when its stream ends, as cancelled if the client left before."""
    backend = gateway.backend
    t0, prompt = time.perf_counter(), call.messages[0]["content"]
    base = head("text_completion", stream.served or backend.model_id, fingerprint(call.router, call.adapter))
    texts, done = [""] * body.n, [None] * body.n
    recorded = False

    def chunk(index: int, text: str, finish: str | None = None, **extra: Any) -> str:
        choice = {"index": first_index + index, "text": text, "logprobs": None, "finish_reason": finish}
        return sse(base | {"choices": [choice | extra]})

    try:
        for index in range(body.n) if body.echo else ():
            yield chunk(index, prompt)
        async for event in stream.events:
            if isinstance(event, Delta):
                texts[event.index] += event.text
                yield chunk(event.index, event.text)
                continue
            completion = done[event.index] = event.completion
            sent = texts[event.index]
            tail = completion.text[len(sent) :] if completion.text.startswith(sent) else ""
            extra: dict[str, Any] = {}
            if body.wants_logprobs():
                extra["logprobs"] = legacy_logprobs(backend, completion)
            if body.return_token_ids:  # vLLM sends them per chunk; all at the end is the same sum
                extra |= {
                    "token_ids": completion.token_ids,
                    "prompt_token_ids": completion.prompt_token_ids,
                }
            yield chunk(event.index, tail, completion.finish_reason, **extra)
        complete = [c for c in done if c is not None]
        finished += complete
        if call.record and len(complete) == body.n:
            replies = [{"role": "assistant", "content": c.text} for c in complete]
            gateway.record_call(call, replies, complete, t0)
        elif call.record:
            gateway.record_unfinished(call, texts, t0, ENDED_EARLY)
        recorded = True
    except BackendError as exc:
        if call.record:
            gateway.record_unfinished(call, texts, t0, gateway_error_of(exc).message)
        recorded = True
        raise
    finally:
        await gateway.close(stream)
        if call.record and not recorded:
            gateway.record_unfinished(call, texts, t0, CANCELLED)
