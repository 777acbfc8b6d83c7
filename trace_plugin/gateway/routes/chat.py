"""``/v1/chat/completions``: a reply rendered, generated and parsed into content and tool
calls, whole or streamed, and recorded as a step of its episode."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.conversations import ModelCall, fingerprint
from trace_plugin.gateway.backend import BackendError, Completion, Delta
from trace_plugin.gateway.protocol import ChatCompletionRequest
from trace_plugin.gateway.routes.wire import (
    EventStream,
    assistant_message,
    chat_logprobs,
    envelope,
    head,
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
from trace_plugin.records.trajectory import utcnow
from trace_plugin.tool_calls import (
    CLOSE,
    OPEN,
    ParsedCompletion,
    ReplyStream,
    forced_opening,
    forced_reply,
    parse_completion,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, gateway: Gateway) -> Any:
    backend = gateway.backend
    started, t0 = utcnow(), time.perf_counter()
    agent, episode, record = gateway.trace_ids(request, body)
    messages = [m.to_openai() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    adapter, router = await gateway.select(body.model, messages, tools, request)
    # The reply is an assistant turn of the template we rendered: it may not write a tool's
    # answer, nor, under tool_choice "none", open a call. The tools are rendered either way, as
    # OpenAI does; a call that tool_choice requires is forced by starting the turn with it.
    forbidden = (*REPLY_FORBIDDEN, *((OPEN[:-1],) if body.tool_choice == "none" else ()))
    opening = forced_opening(body.forced_call())
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, forbidden=forbidden)
    if body.response_format is not None and body.response_format.type != "text":
        if not backend.structured_output:
            raise GatewayError(
                400,
                f"response_format {body.response_format.type} needs decoding held to JSON, which this "
                "backend does not do; serve through vLLM (trace-plugin serve --vllm-url)",
            )
        params = replace(params, response_format=body.response_format.constrained())
    if opening:
        params = replace(params, stop=(*params.stop, CLOSE))
    try:
        prompt = backend.render(messages, tools) + opening
    except Exception as exc:  # a template that cannot render these messages
        raise GatewayError(400, f"cannot render the conversation: {exc}") from exc
    call = ModelCall(
        agent=agent,
        messages=messages,
        model=backend.model_id,
        tools=tools,
        episode_id=episode,
        record=record,
        router=router,
        started_at=started,
    )
    if body.stream:
        stream = await gateway.open_stream(prompt, params, adapter)
        chunks = chat_chunks(gateway, body, replace(call, adapter=stream.served), stream, opening, t0)
        headers = {ADAPTER_HEADER: stream.served or "", **({EPISODE_HEADER: episode} if episode else {})}
        return EventStream(chunks, media_type="text/event-stream", headers=headers)
    completions, served = await gateway.generate(prompt, params, adapter)
    choices = []
    for i, c in enumerate(completions):
        parsed = parse_reply(body, opening, c)
        choice: dict[str, Any] = {
            "index": i,
            "message": assistant_message(parsed),
            "finish_reason": parsed.finish_reason,
        }
        if body.logprobs:
            choice["logprobs"] = chat_logprobs(backend, c)
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    response = envelope(
        "chat.completion", served or backend.model_id, choices, completions, fingerprint(router, served)
    )
    if body.return_token_ids:
        response["prompt_token_ids"] = completions[0].prompt_token_ids
    episode_id = None
    if call.record:
        replies = [c["message"] for c in choices]
        episode_id = gateway.record_call(replace(call, adapter=served), replies, completions, t0)
    headers = {ADAPTER_HEADER: served or "", **({EPISODE_HEADER: episode_id} if episode_id else {})}
    return JSONResponse(response, headers=headers)


def parse_reply(body: ChatCompletionRequest, opening: str, completion: Completion) -> ParsedCompletion:
    return parse_completion(
        forced_reply(opening, completion.text, stopped=completion.finish_reason == "stop"),
        truncated=completion.finish_reason == "length",
        max_calls=body.max_calls(),
    )


async def chat_chunks(
    gateway: GatewayState,
    body: ChatCompletionRequest,
    call: ModelCall,
    stream: Stream,
    opening: str,
    t0: float,
) -> AsyncIterator[str]:
    """The reply's chunks as they are generated (``ReplyStream``); once the stream
    ends, the call is recorded as a non-streamed one would be, or as cancelled if the
    client left before the end."""
    backend = gateway.backend
    n = body.n
    base = head(
        "chat.completion.chunk", call.adapter or backend.model_id, fingerprint(call.router, call.adapter)
    )
    readers = [ReplyStream(opening, max_calls=body.max_calls()) for _ in range(n)]
    completions: list[Completion | None] = [None] * n
    replies: list[dict[str, Any]] = [{"role": "assistant", "content": None} for _ in range(n)]

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse(base | {"choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]})

    recorded = False
    try:
        for index in range(n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for event in stream.events:
            index = event.index
            if isinstance(event, Delta):
                for delta in readers[index].feed(event.text):
                    yield chunk(index, delta)
                continue
            completion = completions[index] = event.completion
            parsed = parse_reply(body, opening, completion)
            reply = forced_reply(opening, completion.text, stopped=completion.finish_reason == "stop")
            for delta in readers[index].finish(parsed, reply):
                yield chunk(index, delta)
            replies[index] = assistant_message(parsed)
            extra: dict[str, Any] = {}
            if body.logprobs:
                extra["logprobs"] = chat_logprobs(backend, completion)
            if body.return_token_ids:
                extra["token_ids"] = completion.token_ids
            yield chunk(index, {}, parsed.finish_reason, **extra)
        finished = [c for c in completions if c is not None]
        if call.record:  # before [DONE]: a client that reads to the end finds it recorded
            if len(finished) == n:
                gateway.record_call(call, replies, finished, t0)
            else:
                gateway.record_unfinished(call, [r.seen for r in readers], t0, ENDED_EARLY)
        recorded = True
        if body.streams_usage():
            yield sse(base | {"choices": [], "usage": usage(finished)})
        yield sse("[DONE]")
    except BackendError as exc:  # after the status line went out: an error event, as vLLM sends
        error = gateway_error_of(exc)
        if call.record:
            gateway.record_unfinished(call, [r.seen for r in readers], t0, error.message)
        recorded = True
        yield sse({"error": {"message": error.message, "type": error.type, "param": None, "code": None}})
    finally:
        await gateway.close(stream)
        if call.record and not recorded:
            gateway.record_unfinished(call, [r.seen for r in readers], t0, CANCELLED)
