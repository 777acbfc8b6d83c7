"""The admin API: vLLM's runtime LoRA endpoints, and ours for the router (vLLM has none).

Each route checks its caller (``GatewayState.check_admin``) itself rather than as a
dependency, so that a malformed request is refused (400) before its caller is checked."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from trace_plugin.gateway.adapters import AdapterError
from trace_plugin.gateway.backend import BackendError
from trace_plugin.gateway.protocol import LoadAdapterRequest, RouteRequest, UnloadAdapterRequest
from trace_plugin.gateway.routing import RouterSpecError, referenced_adapters, router_from_spec
from trace_plugin.gateway.state import Gateway, GatewayError, GatewayState

router = APIRouter()

# -- runtime LoRA administration (vLLM's API shapes) ---------------------------------


async def adapter_op(gateway: GatewayState, request: Request, op: Callable[[], Awaitable[Any]]) -> Any:
    gateway.check_admin(request)
    try:
        return await op()
    except AdapterError as exc:
        raise GatewayError(exc.status, str(exc)) from exc


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    body: LoadAdapterRequest, request: Request, gateway: Gateway
) -> PlainTextResponse:
    full = await adapter_op(gateway, request, lambda: gateway.registry.load(body.lora_name, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{full}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadAdapterRequest, request: Request, gateway: Gateway
) -> PlainTextResponse:
    removed = await adapter_op(gateway, request, lambda: gateway.registry.unload(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{', '.join(removed)}' removed successfully.")


@router.post("/v1/rollback_lora_adapter")
async def rollback_lora_adapter(
    body: UnloadAdapterRequest, request: Request, gateway: Gateway
) -> PlainTextResponse:
    live = await adapter_op(gateway, request, lambda: gateway.registry.rollback(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' rolled back to '{live}'.")


@router.get("/v1/lora_adapters")
async def lora_adapters(request: Request, gateway: Gateway) -> dict[str, Any]:
    gateway.check_admin(request)
    return gateway.registry.describe()


# -- the router version (ours; vLLM has no router) ------------------------------------


@router.get("/v1/router")
async def get_router(request: Request, gateway: Gateway, name: str | None = None) -> dict[str, Any]:
    gateway.check_admin(request)
    if name is None:
        return gateway.router.spec
    if name not in gateway.candidates:
        raise GatewayError(404, f"no candidate router {name!r}")
    return gateway.candidates[name].spec


@router.post("/v1/router")
async def set_router(request: Request, gateway: Gateway, name: str | None = None) -> dict[str, Any]:
    """Swap the live router for the one a spec describes, or with ``?name=`` add a
    candidate served as model ``router:NAME``. Its adapters must be loaded first."""
    gateway.check_admin(request)
    try:
        spec = json.loads(await request.body())
        new = router_from_spec(spec, gateway.backend)
    # ValueError: not decodable, not JSON or a bad spec; RecursionError: nested too deep
    except (ValueError, AttributeError, RecursionError) as exc:
        raise GatewayError(400, f"bad router spec: {exc}") from exc
    missing = sorted(n for n in referenced_adapters(new.spec) if n not in gateway.registry.listing())
    if missing:
        raise GatewayError(409, f"router names adapters that are not loaded: {missing}")
    try:  # one decision before it takes traffic: a gate that cannot read embeddings fails here
        await new.route([{"role": "user", "content": "Hello."}], None)
    except RouterSpecError as exc:
        raise GatewayError(400, f"bad router spec: {exc}") from exc
    except BackendError as exc:
        raise GatewayError(502, f"the router cannot decide: {exc}", "server_error") from exc
    if name is None:
        gateway.router = new
    else:
        gateway.candidates[name] = new
    return new.spec


@router.post("/v1/route")
async def route(body: RouteRequest, request: Request, gateway: Gateway) -> dict[str, Any]:
    """The gateway's own decision for a request, without serving it: the mixture's label
    ("" for the base model) and the router version that chose it (None: the model named
    it). A router remembers its decisions, so the request, sent later, is served the same:
    an evaluation groups its tasks by this to run each group through one adapter."""
    gateway.check_admin(request)
    messages = [m.to_openai() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    mixture, version = await gateway.select(body.model, messages, tools, request)
    return {"mixture": mixture.label(), "router": version}
