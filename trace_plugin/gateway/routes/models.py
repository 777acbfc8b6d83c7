"""The model listing and health: the base model and the adapters served on it."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from trace_plugin.gateway.state import Gateway

router = APIRouter()


@router.get("/health")
async def health(gateway: Gateway) -> dict[str, Any]:
    return {"status": "ok", "model": gateway.backend.model_id, "adapters": gateway.registry.listing()}


@router.get("/v1/models")
async def models(gateway: Gateway) -> dict[str, Any]:
    model_id = gateway.backend.model_id
    now = int(time.time())
    data = [
        {
            "id": model_id,
            "object": "model",
            "created": now,
            "owned_by": "trace-plugin",
            "root": model_id,
            "parent": None,
        }
    ]
    for name, full in sorted(gateway.registry.listing().items()):
        data.append(
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "trace-plugin",
                "root": full,
                "parent": model_id,
            }
        )
    return {"object": "list", "data": data}
