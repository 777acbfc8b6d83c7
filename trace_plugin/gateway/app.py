"""The OpenAI-compatible gateway: serving, per-request expert routing, hot-swap, capture.

``create_app(backend, ...)`` returns a FastAPI app with ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings`` (the base model's), ``/v1/models`` and
``/health``, plus vLLM's runtime LoRA admin endpoints. A request's ``model`` picks an
adapter by name (the vLLM convention); a request naming the base model or the agent is
routed by the router; ``base`` is always the base model itself, and ``router:NAME`` a
candidate router. Every call is recorded as a step of an episode in the store.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.conversations import (
    IDLE_TIMEOUT,
    RECORD_HEADER,
    ConversationEpisodes,
    ModelCall,
    fingerprint,
)
from trace_plugin.errors import TracePluginError
from trace_plugin.gateway.adapters import MAX_MIXTURE_BYTES, AdapterError, AdapterRegistry
from trace_plugin.gateway.backend import Backend, BackendError, Completion, Delta, Events, SamplingParams
from trace_plugin.gateway.protocol import (
    MAX_EPISODE_ID,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
)
from trace_plugin.gateway.routing import (
    CanaryRouter,
    Router,
    RouterSpecError,
    StaticRouter,
    referenced_adapters,
    router_from_spec,
    router_version,
)
from trace_plugin.recorder import Recorder
from trace_plugin.records.mixture import Mixture
from trace_plugin.records.trajectory import check_agent_name, utcnow
from trace_plugin.tool_calls import (
    CLOSE,
    OPEN,
    ParsedCompletion,
    ReplyStream,
    forced_opening,
    forced_reply,
    parse_completion,
)
from trace_plugin.tracer import Tracer

EPISODE_HEADER = "X-Trace-Episode"
AGENT_HEADER = "X-Trace-Agent"
ADAPTER_HEADER = "X-Trace-Adapter"
MAX_BODY_BYTES = 8 * 1024 * 1024


class GatewayError(TracePluginError):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


@dataclass
class GatewayConfig:
    """How the gateway serves, routes, protects its admin API and records."""

    adapter_root: Path = field(default_factory=lambda: Path.cwd() / "adapters")
    agent: str = "gateway"  # the agent name for calls that do not say theirs
    agent_aliases: set[str] = field(default_factory=set)  # extra model names that mean "route it"
    admin_token: str | None = None
    allow_remote_admin: bool = False
    record: bool = True
    max_body_bytes: int = MAX_BODY_BYTES
    # name@version hot-swap; False keeps vLLM's semantics (each adapter name independent).
    hot_swap: bool = True
    adapters: dict[str, str] = field(default_factory=dict)  # name@version -> path, loaded at start
    # Seconds after a reply with tool calls before a conversation with no further call is
    # ended (completed): a terminating tool, a turn cap or a client that gave up sends none.
    conversation_timeout: float = IDLE_TIMEOUT
    # Who may name a mixture the router did not choose ("a:0.5,b:0.5"): False, the admin
    # (the token, from loopback unless allow_remote_admin); True, any client.
    open_mixtures: bool = False
    mixture_bytes: int = MAX_MIXTURE_BYTES  # composed adapters on disk; at most 4 are kept


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


@dataclass(slots=True)
class Stream:
    """A request being streamed: the backend's events, the name its adapters are held under
    until it ends (None: the base model), and the label of what serves it."""

    events: Events
    held: str | None
    served: str | None


def create_app(
    backend: Backend,
    *,
    config: GatewayConfig | None = None,
    router: Router | None = None,
    recorder: Recorder | None = None,
) -> FastAPI:
    config = config or GatewayConfig()
    router = router or StaticRouter(None)
    # What a request means by these names is not an adapter: none may be loaded under them.
    reserved = frozenset({BASE_MODEL, DEFAULT_MODEL, backend.model_id, config.agent, *config.agent_aliases})
    registry = AdapterRegistry(
        backend,
        config.adapter_root,
        hot_swap=config.hot_swap,
        mixture_bytes=config.mixture_bytes,
        reserved=reserved,
    )
    tracers: dict[str, Tracer] = {}

    def tracer_for(agent: str) -> Tracer:
        if agent not in tracers:
            tracers[agent] = Tracer(agent, source="gateway", recorder=recorder)
        return tracers[agent]

    episodes = ConversationEpisodes(tracer_for, idle_timeout=config.conversation_timeout)

    async def sweep() -> None:
        """End conversations left open past the timeout while no new call comes to do it."""
        while True:
            await anyio.sleep(min(config.conversation_timeout / 4, 30.0))
            episodes.sweep()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        registry.clear_mixtures()
        for name, path in config.adapters.items():
            await registry.load(name, path)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sweep)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                episodes.close()  # none left running
                await backend.close()

    app = FastAPI(title="trace-plugin gateway", version="1", lifespan=lifespan)
    app.state.backend, app.state.registry, app.state.router = backend, registry, router
    # Candidate routers, served under the model name "router:NAME" so that a deployment can be
    # evaluated before it takes the live traffic.
    app.state.candidates = {}
    app.state.routing_seconds = 0.0  # time spent in router.route, for the benchmark

    # -- errors in OpenAI's shape --------------------------------------------------------------

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        return _error(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's and FastAPI's own errors (unknown path, a body that cannot be parsed,
        such as one nested too deep) in OpenAI's shape too."""
        response = _error(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    # -- model listing and health ------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": backend.model_id, "adapters": registry.listing()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        data = [
            {
                "id": backend.model_id,
                "object": "model",
                "created": now,
                "owned_by": "trace-plugin",
                "root": backend.model_id,
                "parent": None,
            }
        ]
        for name, full in sorted(registry.listing().items()):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "trace-plugin",
                    "root": full,
                    "parent": backend.model_id,
                }
            )
        return {"object": "list", "data": data}

    # -- completions ---------------------------------------------------------------------

    async def select(
        model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, request: Request
    ) -> tuple[Mixture, str | None]:
        """The adapters a request asks for (an adapter's name, or a mixture's label), or
        that the router picks, and the version of the router that picked them (None when the
        request named them). Reserved names come first: no adapter can shadow them."""
        if model == BASE_MODEL:
            return Mixture(), None
        routed = model in {backend.model_id, config.agent, DEFAULT_MODEL, *config.agent_aliases}
        candidate = (
            app.state.candidates.get(model.removeprefix(ROUTER_PREFIX))
            if model.startswith(ROUTER_PREFIX)
            else None
        )
        if routed or candidate is not None:
            router = candidate or app.state.router
            if isinstance(router, CanaryRouter):  # the request's arm is the router it records
                router = router.arm(messages)
            start = time.perf_counter()
            choice = await router.route(messages, tools)
            app.state.routing_seconds += time.perf_counter() - start
            # An adapter unloaded since the router was set serves nobody; the rest keep their shares.
            return choice.restricted(registry.listing()), router_version(router.spec)
        listing = registry.listing()
        if model in listing:
            return Mixture.of(model), None
        if ":" in model and not model.startswith(ROUTER_PREFIX):
            if not config.open_mixtures:  # composing costs disk and a load: the admin's to ask
                check_admin(request, "a mixture the router did not choose")
            try:
                mixture = Mixture.parse(model)
            except ValueError as exc:
                raise GatewayError(400, str(exc)) from exc
            missing = [name for name in mixture.adapters if name not in listing]
            if missing:
                raise GatewayError(404, f"mixture names adapters that are not loaded: {missing}")
            return mixture, None
        raise GatewayError(404, f"model {model!r} does not exist", "invalid_request_error", "model_not_found")

    async def acquire(mixture: Mixture) -> tuple[str | None, str | None]:
        """The backend's name for ``mixture`` (None: the base model), held until released,
        and the label of what serves it (None: the base model)."""
        try:
            full, served = await registry.acquire_mixture(mixture)
        except AdapterError as exc:
            raise GatewayError(exc.status, str(exc)) from exc
        return full, served.label() or None

    def release(full: str | None) -> None:
        if full:
            registry.release(full)

    async def generate(
        prompt: str, params: SamplingParams, mixture: Mixture
    ) -> tuple[list[Completion], str | None]:
        """The completions, and the label of what served them (None: the base model)."""
        full, served = await acquire(mixture)
        try:
            return await backend.generate(prompt, params, full), served
        except BackendError as exc:
            raise _gateway_error_of(exc) from exc
        finally:
            release(full)

    async def open_stream(prompt: str, params: SamplingParams, mixture: Mixture) -> Stream:
        """The backend's stream for ``prompt``. A request that cannot be served fails here,
        while it can still get its status code."""
        full, served = await acquire(mixture)
        try:
            return Stream(await backend.stream(prompt, params, full), full, served)
        except BackendError as exc:
            release(full)
            raise _gateway_error_of(exc) from exc

    def trace_ids(
        request: Request, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[str, str | None, bool]:
        """The agent and the episode a call is recorded under, checked before it is served,
        and whether it is recorded here at all."""
        record = config.record and request.headers.get(RECORD_HEADER, "").strip().lower() != "false"
        meta = body.metadata
        agent = request.headers.get(AGENT_HEADER) or (meta and meta.trace_agent) or config.agent
        episode = request.headers.get(EPISODE_HEADER) or (meta and meta.trace_episode_id) or None
        try:
            check_agent_name(agent)
        except ValueError as exc:
            raise GatewayError(400, f"{AGENT_HEADER} / metadata.trace_agent: {exc}") from exc
        if episode is not None and len(episode) > MAX_EPISODE_ID:
            raise GatewayError(400, f"{EPISODE_HEADER}: an episode id is at most {MAX_EPISODE_ID} characters")
        return agent, episode, record

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        started, t0 = utcnow(), time.perf_counter()
        agent, episode, record = trace_ids(request, body)
        messages = [m.to_openai() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        adapter, router = await select(body.model, messages, tools, request)
        # The reply is an assistant turn of the template we rendered: it may not write a tool's
        # answer, nor, under tool_choice "none", open a call. The tools are rendered either way, as
        # OpenAI does; a call that tool_choice requires is forced by starting the turn with it.
        forbidden = (*REPLY_FORBIDDEN, *((OPEN[:-1],) if body.tool_choice == "none" else ()))
        opening = forced_opening(body.forced_call())
        params = _sampling(body, body.max_completion_tokens or body.max_tokens, forbidden=forbidden)
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
            stream = await open_stream(prompt, params, adapter)
            chunks = chat_chunks(body, replace(call, adapter=stream.served), stream, opening, t0)
            headers = {ADAPTER_HEADER: stream.served or "", **({EPISODE_HEADER: episode} if episode else {})}
            return EventStream(chunks, media_type="text/event-stream", headers=headers)
        completions, served = await generate(prompt, params, adapter)
        choices = []
        for i, c in enumerate(completions):
            parsed = parse_reply(body, opening, c)
            choice: dict[str, Any] = {
                "index": i,
                "message": _message(parsed),
                "finish_reason": parsed.finish_reason,
            }
            if body.logprobs:
                choice["logprobs"] = _logprobs(backend, c)
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = _envelope(
            "chat.completion", served or backend.model_id, choices, completions, fingerprint(router, served)
        )
        if body.return_token_ids:
            response["prompt_token_ids"] = completions[0].prompt_token_ids
        episode_id = None
        if call.record:
            replies = [c["message"] for c in choices]
            episode_id = record_call(
                replace(call, adapter=served), replies, completions, body.return_token_ids, t0
            )
        headers = {ADAPTER_HEADER: served or "", **({EPISODE_HEADER: episode_id} if episode_id else {})}
        return JSONResponse(response, headers=headers)

    def parse_reply(body: ChatCompletionRequest, opening: str, completion: Completion) -> ParsedCompletion:
        return parse_completion(
            forced_reply(opening, completion.text, stopped=completion.finish_reason == "stop"),
            truncated=completion.finish_reason == "length",
            max_calls=body.max_calls(),
        )

    async def chat_chunks(
        body: ChatCompletionRequest,
        call: ModelCall,
        stream: Stream,
        opening: str,
        t0: float,
    ) -> AsyncIterator[str]:
        """The reply's chunks as they are generated (:class:`ReplyStream`); once the stream
        ends, the call is recorded as a non-streamed one would be, or as cancelled if the
        client left before the end."""
        n = body.n
        base = _head(
            "chat.completion.chunk", call.adapter or backend.model_id, fingerprint(call.router, call.adapter)
        )
        readers = [ReplyStream(opening, max_calls=body.max_calls()) for _ in range(n)]
        completions: list[Completion | None] = [None] * n
        replies: list[dict[str, Any]] = [{"role": "assistant", "content": None} for _ in range(n)]

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            return _sse(
                base | {"choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}]}
            )

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
                replies[index] = _message(parsed)
                extra: dict[str, Any] = {}
                if body.logprobs:
                    extra["logprobs"] = _logprobs(backend, completion)
                if body.return_token_ids:
                    extra["token_ids"] = completion.token_ids
                yield chunk(index, {}, parsed.finish_reason, **extra)
            finished = [c for c in completions if c is not None]
            if call.record:  # before [DONE]: a client that reads to the end finds it recorded
                if len(finished) == n:
                    record_call(call, replies, finished, body.return_token_ids, t0)
                else:
                    record_unfinished(call, [r.seen for r in readers], t0, ENDED_EARLY)
            recorded = True
            if body.streams_usage():
                yield _sse(base | {"choices": [], "usage": _usage(finished)})
            yield _sse("[DONE]")
        except BackendError as exc:  # after the status line went out: an error event, as vLLM sends
            error = _gateway_error_of(exc)
            if call.record:
                record_unfinished(call, [r.seen for r in readers], t0, error.message)
            recorded = True
            yield _sse({"error": {"message": error.message, "type": error.type, "param": None, "code": None}})
        finally:
            await close(stream)
            if call.record and not recorded:
                record_unfinished(call, [r.seen for r in readers], t0, CANCELLED)

    async def close(stream: Stream) -> None:
        """End a stream however it went: its generation stops, its adapters are released."""
        release(stream.held)
        with anyio.CancelScope(shield=True):  # the client's disconnect may be cancelling us
            await stream.events.aclose()

    def record_call(
        call: ModelCall,
        replies: list[dict[str, Any]],
        completions: list[Completion],
        with_ids: bool,
        t0: float,
    ) -> str:
        """Record ``call`` with its replies (one per choice), the completions' token counts
        and, when the client asked for them, their token ids; returns the episode id."""
        token_ids = None
        if with_ids:
            token_ids = {
                "prompt": completions[0].prompt_token_ids,
                "completions": [c.token_ids for c in completions],
            }
        return episodes.record(
            replace(
                call,
                reply=replies[0],
                output=replies[0] if len(replies) == 1 else {"choices": replies},
                prompt_tokens=len(completions[0].prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in completions),
                latency_ms=(time.perf_counter() - t0) * 1000,
                token_ids=token_ids,
            )
        )

    def record_unfinished(call: ModelCall, texts: list[str], t0: float, error: str) -> None:
        """A stream that ended before its reply did (its client left, or the backend failed):
        a step with the text generated by then, and why it ended; its episode ends
        ``cancelled`` or ``error``, since no reply will continue it."""
        partial = [{"role": "assistant", "content": text} for text in texts]
        episodes.record(
            replace(
                call,
                output=partial[0] if len(partial) == 1 else {"choices": partial},
                error=error,
                latency_ms=(time.perf_counter() - t0) * 1000,
                end="cancelled" if error == CANCELLED else "error",
            )
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        agent, episode, record = trace_ids(request, body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        adapter, router = await select(body.model, [{"role": "user", "content": prompts[0]}], None, request)
        params = replace(_sampling(body, body.max_tokens or 16), top_logprobs=body.logprobs or 0)

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
            first = await open_stream(prompts[0], params, adapter)
            chunks = completion_chunks(body, prompts, params, adapter, first, call_of)
            headers = {ADAPTER_HEADER: first.served or "", **({EPISODE_HEADER: episode} if episode else {})}
            return EventStream(chunks, media_type="text/event-stream", headers=headers)
        results: list[Completion] = []
        served = None
        calls: list[tuple[ModelCall, float, list[Completion]]] = []  # the call, its timer, its outputs
        for prompt in prompts:
            call, t0 = call_of(prompt, None), time.perf_counter()
            outs, served = await generate(prompt, params, adapter)
            results.extend(outs)
            calls.append((replace(call, adapter=served), t0, outs))
        choices = []
        for i, c in enumerate(results):
            choice: dict[str, Any] = {
                "index": i,
                "text": (prompts[i // params.n] if body.echo else "") + c.text,
                "finish_reason": c.finish_reason,
                "logprobs": _legacy_logprobs(backend, c) if body.wants_logprobs() else None,
            }
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = c.prompt_token_ids
            choices.append(choice)
        response = _envelope(
            "text_completion", served or backend.model_id, choices, results, fingerprint(router, served)
        )
        recorded: set[str] = set()
        for call, t0, outs in calls if record else ():
            replies = [{"role": "assistant", "content": c.text} for c in outs]
            recorded.add(record_call(call, replies, outs, body.return_token_ids, t0))
        headers = {ADAPTER_HEADER: served or ""}
        if len(recorded) == 1:
            headers[EPISODE_HEADER] = recorded.pop()
        return JSONResponse(response, headers=headers)

    async def completion_chunks(
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
                stream = first if number == 0 else await open_stream(prompt, params, mixture)
                call = call_of(prompt, stream.served)
                async for chunk in prompt_chunks(body, number * params.n, call, stream, finished):
                    yield chunk
            if body.streams_usage():
                call = call_of("", first.served)
                model = first.served or backend.model_id
                head = _head("text_completion", model, fingerprint(call.router, call.adapter))
                yield _sse(head | {"choices": [], "usage": _usage(finished)})
            yield _sse("[DONE]")
        except (BackendError, GatewayError) as exc:
            error = exc if isinstance(exc, GatewayError) else _gateway_error_of(exc)
            yield _sse({"error": {"message": error.message, "type": error.type, "param": None, "code": None}})

    async def prompt_chunks(
        body: CompletionRequest,
        first_index: int,
        call: ModelCall,
        stream: Stream,
        finished: list[Completion],
    ) -> AsyncIterator[str]:
        """One prompt's chunks (choices numbered from ``first_index``); its call is recorded
        when its stream ends, as cancelled if the client left before."""
        t0, prompt = time.perf_counter(), call.messages[0]["content"]
        base = _head(
            "text_completion", stream.served or backend.model_id, fingerprint(call.router, call.adapter)
        )
        texts, done = [""] * body.n, [None] * body.n
        recorded = False

        def chunk(index: int, text: str, finish: str | None = None, **extra: Any) -> str:
            choice = {"index": first_index + index, "text": text, "logprobs": None, "finish_reason": finish}
            return _sse(base | {"choices": [choice | extra]})

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
                    extra["logprobs"] = _legacy_logprobs(backend, completion)
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
                record_call(call, replies, complete, body.return_token_ids, t0)
            elif call.record:
                record_unfinished(call, texts, t0, ENDED_EARLY)
            recorded = True
        except BackendError as exc:
            if call.record:
                record_unfinished(call, texts, t0, _gateway_error_of(exc).message)
            recorded = True
            raise
        finally:
            await close(stream)
            if call.record and not recorded:
                record_unfinished(call, texts, t0, CANCELLED)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        """The base model's embeddings (last token, normalized): what a learned gate reads."""
        if body.model not in {backend.model_id, BASE_MODEL}:
            raise GatewayError(400, f"embeddings come from the base model {backend.model_id!r} only")
        texts = [body.input] if isinstance(body.input, str) else body.input
        try:
            vectors = await backend.embed(texts)
        except BackendError as exc:
            raise GatewayError(exc.status, str(exc), "server_error") from exc
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": backend.model_id}

    # -- runtime LoRA administration (vLLM's API shapes) ---------------------------------

    def check_admin(request: Request, what: str = "admin endpoints") -> None:
        supplied = request.headers.get("authorization", "")
        if config.admin_token is not None and not hmac.compare_digest(
            supplied, f"Bearer {config.admin_token}"
        ):
            raise GatewayError(401, f"{what} needs 'Authorization: Bearer <token>'", "authentication_error")
        host = request.client.host if request.client else ""
        if not config.allow_remote_admin and not _is_loopback(host):
            raise GatewayError(403, f"{what} is for loopback clients only", "permission_error")

    async def adapter_op(request: Request, op: Callable[[], Awaitable[Any]]) -> Any:
        check_admin(request)
        try:
            return await op()
        except AdapterError as exc:
            raise GatewayError(exc.status, str(exc)) from exc

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest, request: Request) -> PlainTextResponse:
        full = await adapter_op(request, lambda: registry.load(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{full}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request) -> PlainTextResponse:
        removed = await adapter_op(request, lambda: registry.unload(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{', '.join(removed)}' removed successfully.")

    @app.post("/v1/rollback_lora_adapter")
    async def rollback_lora_adapter(body: UnloadAdapterRequest, request: Request) -> PlainTextResponse:
        live = await adapter_op(request, lambda: registry.rollback(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' rolled back to '{live}'.")

    @app.get("/v1/lora_adapters")
    async def lora_adapters(request: Request) -> dict[str, Any]:
        check_admin(request)
        return registry.describe()

    # -- the router version (ours; vLLM has no router) ------------------------------------

    @app.get("/v1/router")
    async def get_router(request: Request, name: str | None = None) -> dict[str, Any]:
        check_admin(request)
        if name is None:
            return app.state.router.spec
        if name not in app.state.candidates:
            raise GatewayError(404, f"no candidate router {name!r}")
        return app.state.candidates[name].spec

    @app.post("/v1/router")
    async def set_router(request: Request, name: str | None = None) -> dict[str, Any]:
        """Swap the live router for the one a spec describes, or with ``?name=`` add a
        candidate served as model ``router:NAME``. Its adapters must be loaded first."""
        check_admin(request)
        try:
            spec = json.loads(await request.body())
            new = router_from_spec(spec, backend)
        # ValueError: not decodable, not JSON or a bad spec; RecursionError: nested too deep
        except (ValueError, AttributeError, RecursionError) as exc:
            raise GatewayError(400, f"bad router spec: {exc}") from exc
        missing = sorted(n for n in referenced_adapters(new.spec) if n not in registry.listing())
        if missing:
            raise GatewayError(409, f"router names adapters that are not loaded: {missing}")
        try:  # one decision before it takes traffic: a gate that cannot read embeddings fails here
            await new.route([{"role": "user", "content": "Hello."}], None)
        except RouterSpecError as exc:
            raise GatewayError(400, f"bad router spec: {exc}") from exc
        except BackendError as exc:
            raise GatewayError(502, f"the router cannot decide: {exc}", "server_error") from exc
        if name is None:
            app.state.router = new
        else:
            app.state.candidates[name] = new
        return new.spec

    return app


# -- helpers ---------------------------------------------------------------------------------


ROUTER_PREFIX = "router:"
CANCELLED = "cancelled: the client disconnected before the reply was complete"
ENDED_EARLY = "the backend's stream ended before every completion did"
BASE_MODEL = "base"  # the base model itself, whatever the router would choose
DEFAULT_MODEL = "default"  # whatever the router chooses


def _error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


class BodyLimit:
    """Refuses a request body over ``max_bytes`` with a 413: at once when its Content-Length
    says so, else as soon as the bytes read pass it (a chunked body declares no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body over {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _error(413, too_large)(scope, receive, send)
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:  # FastAPI passes an HTTPException from here on as it is
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _sampling(body: Any, max_tokens: int | None, forbidden: tuple[str, ...] = ()) -> SamplingParams:
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


def _envelope(
    kind: str,
    model: str,
    choices: list[dict[str, Any]],
    completions: list[Completion],
    system_fingerprint: str,
) -> dict[str, Any]:
    return _head(kind, model, system_fingerprint) | {"choices": choices, "usage": _usage(completions)}


def _head(kind: str, model: str, system_fingerprint: str) -> dict[str, Any]:
    """The fields a response opens with, which each chunk of a streamed one repeats."""
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat.') else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system_fingerprint,
    }


def _usage(completions: list[Completion]) -> dict[str, int]:
    prompt_tokens = len(completions[0].prompt_token_ids) if completions else 0
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprobs(backend: Backend, completion: Completion) -> dict[str, Any] | None:
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


def _legacy_logprobs(backend: Backend, completion: Completion) -> dict[str, Any] | None:
    """The completions API's older shape: parallel lists of tokens and their logprobs."""
    chat = _logprobs(backend, completion)
    if chat is None:
        return None
    return {
        "tokens": [e["token"] for e in chat["content"]],
        "token_logprobs": [e["logprob"] for e in chat["content"]],
        "top_logprobs": completion.top_logprobs,
        "text_offset": None,
    }


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _message(parsed: ParsedCompletion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def _gateway_error_of(exc: BackendError) -> GatewayError:
    return GatewayError(
        exc.status, str(exc), "server_error" if exc.status >= 500 else "invalid_request_error"
    )
