"""A client of the gateway's admin API: vLLM's adapter endpoints plus our router endpoints.

The improver loads candidate experts and switches routers through it; the benchmark does too.
"""

from __future__ import annotations

from typing import Any

from trace_plugin.errors import TracePluginError
from trace_plugin.records.router_spec import RouterSpec


class GatewayAdminError(TracePluginError, RuntimeError):
    """The gateway refused or failed an admin request."""


class GatewayAdmin:
    """The gateway's admin API (vLLM's adapter endpoints plus our router endpoints)."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def adapters(self) -> set[str]:
        data = await self._request("GET", "/v1/lora_adapters")
        return set(data.get("loaded", {})) if isinstance(data, dict) else set()

    async def ensure_adapter(self, name: str, path: str) -> None:
        if name not in await self.adapters():
            await self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def router(self, name: str | None = None) -> dict[str, Any]:
        """The router spec the gateway serves (a candidate's, with ``name``), in its wire form."""
        return await self._request("GET", "/v1/router", params={"name": name} if name else None)

    async def set_router(self, spec: RouterSpec | dict[str, Any], *, name: str | None = None) -> None:
        body = spec if isinstance(spec, dict) else spec.to_dict()  # the gateway validates it
        await self._request("POST", "/v1/router", json=body, params={"name": name} if name else None)

    async def route(
        self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The label of the mixture the gateway would serve these messages as ``model`` with
        ("" for the base model): its own routing decision, which it keeps for the request."""
        body = {"model": model, "messages": messages, "tools": tools}
        return (await self._request("POST", "/v1/route", json=body))["mixture"]

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The served base model's embeddings (what a learned gate reads), 64 texts a request."""
        vectors: list[list[float]] = []
        for start in range(0, len(texts), 64):
            body = {"model": "base", "input": texts[start : start + 64]}
            data = await self._request("POST", "/v1/embeddings", json=body)
            vectors += [item["embedding"] for item in sorted(data["data"], key=lambda d: d["index"])]
        return vectors

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=120) as client:
            response = await client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise GatewayAdminError(f"gateway {method} {path}: {response.status_code} {response.text[:300]}")
        return response.json() if "json" in response.headers.get("content-type", "") else response.text
