"""The gateway's state, one per app, and the operations its routes share: which adapters
serve a request, holding them while it is served, generating, and recording the call.

It lives on ``app.state.gateway``; a route receives it as the ``Gateway`` dependency,
so that the routes are plain module functions rather than closures of ``create_app``.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request

from trace_plugin.conversations import IDLE_TIMEOUT, RECORD_HEADER, ConversationEpisodes, ModelCall
from trace_plugin.errors import TracePluginError
from trace_plugin.gateway.adapters import MAX_MIXTURE_BYTES, AdapterError, AdapterRegistry
from trace_plugin.gateway.backend import Backend, BackendError, Completion, Events, SamplingParams
from trace_plugin.gateway.protocol import MAX_EPISODE_ID, ChatCompletionRequest, CompletionRequest
from trace_plugin.gateway.routing import CanaryRouter, Router, router_version
from trace_plugin.recorder import Recorder
from trace_plugin.records.mixture import Mixture
from trace_plugin.records.trajectory import check_agent_name
from trace_plugin.tracer import Tracer

EPISODE_HEADER = "X-Trace-Episode"
AGENT_HEADER = "X-Trace-Agent"
ADAPTER_HEADER = "X-Trace-Adapter"
MAX_BODY_BYTES = 8 * 1024 * 1024
ROUTER_PREFIX = "router:"
CANCELLED = "cancelled: the client disconnected before the reply was complete"
ENDED_EARLY = "the backend's stream ended before every completion did"
BASE_MODEL = "base"  # the base model itself, whatever the router would choose
DEFAULT_MODEL = "default"  # whatever the router chooses


class GatewayError(TracePluginError):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


class GatewayConfigError(TracePluginError, ValueError):
    """A gateway setting that cannot be served with; ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


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

    def __post_init__(self) -> None:
        # nan stops the sweeper (and with it the ending of idle conversations); 0 spins it.
        timeout = self.conversation_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            message = f"conversation_timeout is seconds, a finite number above 0, not {timeout!r}"
            raise GatewayConfigError("conversation_timeout", message)


@dataclass(slots=True)
class Stream:
    """A request being streamed: the backend's events, the name its adapters are held under
    until it ends (None: the base model), and the label of what serves it."""

    events: Events
    held: str | None
    served: str | None


class GatewayState:
    """What the routes serve with: the backend, the adapters loaded on it, the live and
    candidate routers, and the episodes calls are recorded into."""

    __slots__ = (
        "backend",
        "candidates",
        "config",
        "episodes",
        "recorder",
        "registry",
        "router",
        "routing_seconds",
        "tracers",
    )

    def __init__(
        self, backend: Backend, config: GatewayConfig, router: Router, recorder: Recorder | None
    ) -> None:
        self.backend, self.config, self.router, self.recorder = backend, config, router, recorder
        # What a request means by these names is not an adapter: none may be loaded under them.
        reserved = frozenset(
            {BASE_MODEL, DEFAULT_MODEL, backend.model_id, config.agent, *config.agent_aliases}
        )
        self.registry = AdapterRegistry(
            backend,
            config.adapter_root,
            hot_swap=config.hot_swap,
            mixture_bytes=config.mixture_bytes,
            reserved=reserved,
        )
        self.tracers: dict[str, Tracer] = {}
        self.episodes = ConversationEpisodes(self.tracer_for, idle_timeout=config.conversation_timeout)
        # Candidate routers, served under the model name "router:NAME" so that a deployment can be
        # evaluated before it takes the live traffic.
        self.candidates: dict[str, Router] = {}
        self.routing_seconds = 0.0  # time spent in router.route, for the benchmark

    def tracer_for(self, agent: str) -> Tracer:
        if agent not in self.tracers:
            self.tracers[agent] = Tracer(agent, source="gateway", recorder=self.recorder)
        return self.tracers[agent]

    async def select(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        request: Request,
    ) -> tuple[Mixture, str | None]:
        """The adapters a request asks for (an adapter's name, or a mixture's label), or
        that the router picks, and the version of the router that picked them (None when the
        request named them). Reserved names come first: no adapter can shadow them."""
        if model == BASE_MODEL:
            return Mixture(), None
        config = self.config
        routed = model in {self.backend.model_id, config.agent, DEFAULT_MODEL, *config.agent_aliases}
        candidate = (
            self.candidates.get(model.removeprefix(ROUTER_PREFIX))
            if model.startswith(ROUTER_PREFIX)
            else None
        )
        if routed or candidate is not None:
            router = candidate or self.router
            if isinstance(router, CanaryRouter):  # the request's arm is the router it records
                router = router.arm(messages)
            start = time.perf_counter()
            choice = await router.route(messages, tools)
            self.routing_seconds += time.perf_counter() - start
            # An adapter unloaded since the router was set serves nobody; the rest keep their shares.
            return choice.restricted(self.registry.listing()), router_version(router.spec)
        listing = self.registry.listing()
        if model in listing:
            return Mixture.of(model), None
        if ":" in model and not model.startswith(ROUTER_PREFIX):
            if not config.open_mixtures:  # composing costs disk and a load: the admin's to ask
                self.check_admin(request, "a mixture the router did not choose")
            try:
                mixture = Mixture.parse(model)
            except ValueError as exc:
                raise GatewayError(400, str(exc)) from exc
            missing = [name for name in mixture.adapters if name not in listing]
            if missing:
                raise GatewayError(404, f"mixture names adapters that are not loaded: {missing}")
            return mixture, None
        raise GatewayError(404, f"model {model!r} does not exist", "invalid_request_error", "model_not_found")

    async def acquire(self, mixture: Mixture) -> tuple[str | None, str | None]:
        """The backend's name for ``mixture`` (None: the base model), held until released,
        and the label of what serves it (None: the base model)."""
        try:
            full, served = await self.registry.acquire_mixture(mixture)
        except AdapterError as exc:
            raise GatewayError(exc.status, str(exc)) from exc
        return full, served.label() or None

    def release(self, full: str | None) -> None:
        if full:
            self.registry.release(full)

    async def generate(
        self, prompt: str, params: SamplingParams, mixture: Mixture
    ) -> tuple[list[Completion], str | None]:
        """The completions, and the label of what served them (None: the base model)."""
        full, served = await self.acquire(mixture)
        try:
            return await self.backend.generate(prompt, params, full), served
        except BackendError as exc:
            raise gateway_error_of(exc) from exc
        finally:
            self.release(full)

    async def open_stream(self, prompt: str, params: SamplingParams, mixture: Mixture) -> Stream:
        """The backend's stream for ``prompt``. A request that cannot be served fails here,
        while it can still get its status code."""
        full, served = await self.acquire(mixture)
        try:
            return Stream(await self.backend.stream(prompt, params, full), full, served)
        except BackendError as exc:
            self.release(full)
            raise gateway_error_of(exc) from exc

    async def close(self, stream: Stream) -> None:
        """End a stream however it went: its generation stops, its adapters are released."""
        self.release(stream.held)
        with anyio.CancelScope(shield=True):  # the client's disconnect may be cancelling us
            await stream.events.aclose()

    def trace_ids(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[str, str | None, bool]:
        """The agent and the episode a call is recorded under, checked before it is served,
        and whether it is recorded here at all."""
        config = self.config
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

    def record_call(
        self,
        call: ModelCall,
        replies: list[dict[str, Any]],
        completions: list[Completion],
        t0: float,
    ) -> str:
        """Record ``call`` with its replies (one per choice) and the token ids the backend
        generated them from, whether or not the client asked to see them: training and the
        ``tokens`` export read these ids, never a retokenization of the text. The sampled
        tokens' log-probabilities come along where the call asked for them (computing them
        for every call would cost every decode step). Returns the episode id."""
        first = completions[0]
        token_ids: dict[str, Any] = {
            "prompt": first.prompt_token_ids,
            "completions": [c.token_ids for c in completions],
        }
        if first.logprobs is not None:
            token_ids["logprobs"] = [c.logprobs for c in completions]
        return self.episodes.record(
            replace(
                call,
                reply=replies[0],
                output=replies[0] if len(replies) == 1 else {"choices": replies},
                prompt_tokens=len(first.prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in completions),
                latency_ms=(time.perf_counter() - t0) * 1000,
                token_ids=token_ids,
            )
        )

    def record_unfinished(self, call: ModelCall, texts: list[str], t0: float, error: str) -> None:
        """A stream that ended before its reply did (its client left, or the backend failed):
        a step with the text generated by then, and why it ended; its episode ends
        ``cancelled`` or ``error``, since no reply will continue it."""
        partial = [{"role": "assistant", "content": text} for text in texts]
        self.episodes.record(
            replace(
                call,
                output=partial[0] if len(partial) == 1 else {"choices": partial},
                error=error,
                latency_ms=(time.perf_counter() - t0) * 1000,
                end="cancelled" if error == CANCELLED else "error",
            )
        )

    def check_admin(self, request: Request, what: str = "admin endpoints") -> None:
        config = self.config
        supplied = request.headers.get("authorization", "")
        if config.admin_token is not None and not hmac.compare_digest(
            supplied, f"Bearer {config.admin_token}"
        ):
            raise GatewayError(401, f"{what} needs 'Authorization: Bearer <token>'", "authentication_error")
        host = request.client.host if request.client else ""
        if not config.allow_remote_admin and not is_loopback(host):
            raise GatewayError(403, f"{what} is for loopback clients only", "permission_error")


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


Gateway = Annotated[GatewayState, Depends(gateway_state)]  # a route's parameter: the app's state


def gateway_error_of(exc: BackendError) -> GatewayError:
    return GatewayError(
        exc.status, str(exc), "server_error" if exc.status >= 500 else "invalid_request_error"
    )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
