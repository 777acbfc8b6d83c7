"""``/v1/embeddings``: the base model's, what a learned gate reads."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from trace_plugin.gateway.backend import BackendError
from trace_plugin.gateway.protocol import EmbeddingRequest
from trace_plugin.gateway.state import BASE_MODEL, Gateway, GatewayError

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, gateway: Gateway) -> dict[str, Any]:
    """The base model's embeddings (last token, normalized): what a learned gate reads."""
    backend = gateway.backend
    if body.model not in {backend.model_id, BASE_MODEL}:
        raise GatewayError(400, f"embeddings come from the base model {backend.model_id!r} only")
    texts = [body.input] if isinstance(body.input, str) else body.input
    try:
        vectors = await backend.embed(texts)
    except BackendError as exc:
        raise GatewayError(exc.status, str(exc), "server_error") from exc
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": backend.model_id}
