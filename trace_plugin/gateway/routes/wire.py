"""What the chat and completions routes share: a request's sampling parameters, and the
responses and stream events they send, in OpenAI's shapes."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from trace_plugin.gateway.backend import Backend, Completion, SamplingParams
from trace_plugin.gateway.state import GatewayError
from trace_plugin.tool_calls import ParsedCompletion


class EventStream(StreamingResponse):
    """A streamed response that closes its chunks however it ends. When the client has
    gone, sending the next chunk fails; closing the chunks then stops the generation at
    once (and records the call as cancelled), instead of whenever the garbage collector
    reaches them."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


def sampling_params(body: Any, max_tokens: int | None, forbidden: tuple[str, ...] = ()) -> SamplingParams:
    if body.min_tokens > (max_tokens or 256):
        raise GatewayError(400, f"min_tokens ({body.min_tokens}) is over max_tokens ({max_tokens or 256})")
    return SamplingParams(
        max_tokens=max_tokens or 256,
        min_tokens=body.min_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        n=body.n,
        seed=body.seed,
        stop=body.stops(),
        bad_words=(*forbidden, *(body.bad_words or ())),
        logprobs=body.wants_logprobs(),
    )


def envelope(
    kind: str,
    model: str,
    choices: list[dict[str, Any]],
    completions: list[Completion],
    system_fingerprint: str,
) -> dict[str, Any]:
    return head(kind, model, system_fingerprint) | {"choices": choices, "usage": usage(completions)}


def head(kind: str, model: str, system_fingerprint: str) -> dict[str, Any]:
    """The fields a response opens with, which each chunk of a streamed one repeats."""
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat.') else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system_fingerprint,
    }


def usage(completions: list[Completion]) -> dict[str, int]:
    prompt_tokens = len(completions[0].prompt_token_ids) if completions else 0
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(backend: Backend, completion: Completion) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    tokenizer = getattr(backend, "tokenizer", None)
    content = []
    for token_id, logprob in zip(completion.token_ids, completion.logprobs, strict=False):
        token = tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None else str(token_id)
        content.append(
            {"token": token, "token_id": token_id, "logprob": logprob, "bytes": None, "top_logprobs": []}
        )
    return {"content": content}


def legacy_logprobs(backend: Backend, completion: Completion) -> dict[str, Any] | None:
    """The completions API's older shape: parallel lists of tokens and their logprobs."""
    chat = chat_logprobs(backend, completion)
    if chat is None:
        return None
    return {
        "tokens": [e["token"] for e in chat["content"]],
        "token_logprobs": [e["logprob"] for e in chat["content"]],
        "top_logprobs": completion.top_logprobs,
        "text_offset": None,
    }


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def assistant_message(parsed: ParsedCompletion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message
