"""A vLLM server as the gateway's backend, with runtime LoRA loading.

Start vLLM with ``--enable-lora --max-loras N --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. The gateway renders prompts with the shared
tool template (from the same model directory's tokenizer) and sends them to vLLM's
``/v1/completions``, so vLLM never applies a template of its own and both backends give
the same tokens. Adapters go through vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``; ``/v1/models`` tells what is loaded.

A learned routing gate reads the base model's embeddings. vLLM serves those from a second
instance of the same base model, ``vllm serve BASE --runner pooling --convert embed`` (its
default pooling, the last token normalized, is what the embedded backend computes); pass
its URL as ``embed_url`` (``LocalVLLM`` in ``trace_plugin.gateway.vllm_server`` starts
both).

Paths sent to vLLM are the gateway's resolved adapter paths: the two must share a
filesystem (the usual single-host deployment) or mount the adapter root at the same place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx

from trace_plugin.chat_template import render
from trace_plugin.gateway.backend import (
    BackendError,
    Completion,
    Delta,
    Events,
    Finished,
    SamplingParams,
)
from trace_plugin.model_files import module_names, prepare_tokenizer, resolve_model


class VLLMBackend:
    """Talks to a vLLM (or any server with the same HTTP contract) at ``base_url``."""

    structured_output = True  # vLLM's completions take ``response_format`` (structured outputs)

    def __init__(
        self,
        base_url: str,
        *,
        model: str | Path | None = None,
        served_model: str | None = None,
        api_key: str | None = None,
        max_lora_rank: int = 64,
        timeout: float = 300.0,
        embed_url: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.base_url = base_url.rstrip("/")
        self.model_dir = resolve_model(model)
        self.tokenizer = prepare_tokenizer(
            AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        )
        self.max_lora_rank = max_lora_rank
        # What an adapter's LoRA weights may adapt, checked before vLLM sees its files.
        self.lora_modules = module_names(self.model_dir)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_id = served_model or self._base_model_id(headers)
        self.embed_url = (embed_url or self.base_url).rstrip("/")

    def _base_model_id(self, headers: dict[str, str]) -> str:
        try:
            models = httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=30).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise BackendError(f"cannot list models at {self.base_url}: {exc}", 502) from exc
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise BackendError(f"{self.base_url} lists no base model", 502)
        return bases[0]

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return render(self.tokenizer, messages, tools)

    async def generate(self, prompt: str, params: SamplingParams, adapter: str | None) -> list[Completion]:
        data = await self._post_json("/v1/completions", self._body(prompt, params, adapter))
        return [self._completion(choice, data) for choice in data["choices"]]

    async def stream(self, prompt: str, params: SamplingParams, adapter: str | None) -> Events:
        """vLLM's own stream, passed through; closing it closes the connection, which
        makes vLLM abort the request."""
        body = self._body(prompt, params, adapter) | {"stream": True}
        try:
            response = await self._client.send(
                self._client.build_request("POST", "/v1/completions", json=body), stream=True
            )
        except httpx.HTTPError as exc:
            raise BackendError(f"vLLM at {self.base_url} unreachable: {exc}", 502) from exc
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")
            await response.aclose()
            raise BackendError(f"vLLM /v1/completions failed: {text[:300]}", response.status_code)
        return self._events(response, params.n)

    async def _events(self, response: httpx.Response, n: int) -> Events:
        texts, ids = [""] * n, [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        prompt_ids: list[int] = []
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    raise BackendError(f"vLLM streamed a chunk that is not JSON: {data[:200]}", 502) from exc
                if "error" in chunk:
                    raise BackendError(f"vLLM failed mid-stream: {json.dumps(chunk['error'])[:300]}", 502)
                prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
                for choice in chunk.get("choices") or ():
                    i, text = choice["index"], choice.get("text") or ""
                    prompt_ids = choice.get("prompt_token_ids") or prompt_ids
                    ids[i] += choice.get("token_ids") or []
                    logprobs[i] += (choice.get("logprobs") or {}).get("token_logprobs") or []
                    if text:
                        texts[i] += text
                        yield Delta(i, text)
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "stop"
                        yield Finished(
                            i, Completion(texts[i], ids[i], finish, list(prompt_ids), logprobs[i] or None)
                        )
        except httpx.HTTPError as exc:
            raise BackendError(f"vLLM's stream broke off: {exc}", 502) from exc
        finally:
            with anyio.CancelScope(shield=True):  # close even when the consumer was cancelled
                await response.aclose()

    def _body(self, prompt: str, params: SamplingParams, adapter: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": adapter or self.model_id,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": params.n,
            "return_token_ids": True,
            "add_special_tokens": False,  # the template already holds every special token
        }
        if params.min_tokens:
            body["min_tokens"] = params.min_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.bad_words:
            body["bad_words"] = list(params.bad_words)
        if params.logprobs or params.top_logprobs:
            body["logprobs"] = params.top_logprobs
        if params.response_format is not None:
            body["response_format"] = json.loads(params.response_format)
        return body

    def _completion(self, choice: dict[str, Any], data: dict[str, Any]) -> Completion:
        logprobs = top = None
        if choice.get("logprobs"):
            logprobs = choice["logprobs"].get("token_logprobs")
            top = choice["logprobs"].get("top_logprobs")
        prompt_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids") or []
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Completion(
            choice["text"], list(choice.get("token_ids") or []), finish, list(prompt_ids), logprobs, top
        )

    async def embed(self, texts: list[str]) -> list[list[float]]:
        url = f"{self.embed_url}/v1/embeddings"
        try:
            data = await self._post_json(url, {"model": self.model_id, "input": texts})
            return [item["embedding"] for item in sorted(data["data"], key=lambda d: d["index"])]
        except (KeyError, TypeError) as exc:
            raise BackendError(f"{url} answered without embeddings: {exc}", 502) from exc
        except BackendError as exc:
            raise BackendError(
                f"no embeddings at {url} ({exc}); serve the base model with "
                "`vllm serve BASE --runner pooling --convert embed` and pass its URL as embed_url",
                exc.status,
            ) from exc

    async def load_adapter(self, name: str, path: Path) -> None:
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def unload_adapter(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    async def adapters(self) -> set[str]:
        response = await self._request("GET", "/v1/models")
        return {m["id"] for m in response.json()["data"] if m.get("parent")}

    async def close(self) -> None:
        await self._client.aclose()

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._post(path, body)
        try:
            return response.json()
        except ValueError as exc:
            raise BackendError(f"{path} answered with non-JSON: {response.text[:200]}", 502) from exc

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self._request("POST", path, json=body)

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BackendError(f"vLLM at {self.base_url} unreachable: {exc}", 502) from exc
        if response.status_code >= 400:
            raise BackendError(f"vLLM {path} failed: {response.text[:300]}", response.status_code)
        return response
