"""The gateway's vLLM path against a real vLLM, on a GPU machine; run by gpu_check.sh.

Starts vLLM with runtime LoRA updating, puts the gateway (VLLMBackend) in front, loads two
adapters at runtime, routes requests to each, hot-swaps one under 8 concurrent clients and
prints a pass/fail table. Exits non-zero if any check fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import free_port, start_in_thread
from trace_plugin.gateway.vllm import VLLMBackend
from trace_plugin.model_files import resolve_model
from training.lora import random_adapter


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit("vLLM did not become ready in time")


def main() -> int:
    model = resolve_model(sys.argv[1] if len(sys.argv) > 1 else None)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    for name, seed in (("a/1", 1), ("a/2", 2), ("b/1", 3)):
        random_adapter(model, root / name, seed=seed)
    port = free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    vllm = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "16",
            "--gpu-memory-utilization",
            "0.3",
        ],
        env=env,
    )
    results: list[tuple[str, bool, str]] = []
    try:
        vllm_url = f"http://127.0.0.1:{port}"
        wait_ready(vllm_url, vllm, timeout=300)
        backend = VLLMBackend(vllm_url, model=model)
        config = GatewayConfig(adapter_root=root, record=False)
        with start_in_thread(create_app(backend, config=config)) as gateway:

            def chat(model_name: str) -> httpx.Response:
                return httpx.post(
                    f"{gateway.url}/v1/chat/completions",
                    timeout=60,
                    json={
                        "model": model_name,
                        "messages": [{"role": "user", "content": "Hello"}],
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )

            for name, path in (("a@1", "a/1"), ("b@1", "b/1")):
                r = httpx.post(
                    f"{gateway.url}/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": path},
                    timeout=120,
                )
                results.append((f"load {name} at runtime", r.status_code == 200, r.text[:80]))
            for alias, full in (("a", "a@1"), ("b", "b@1")):
                served = chat(alias).json().get("model")
                results.append((f"route to {alias}", served == full, str(served)))
            base = chat(backend.model_id).json()["choices"][0]["message"]["content"]
            other = chat("a").json()["choices"][0]["message"]["content"]
            results.append(("adapter changes the output", base != other, ""))

            failures, served, stop = [], [], threading.Event()

            def worker() -> None:
                while not stop.is_set():
                    r = chat("a")
                    if r.status_code == 200:
                        served.append(r.json()["model"])
                    else:
                        failures.append(r.text)

            threads = [threading.Thread(target=worker) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(2)
            r = httpx.post(
                f"{gateway.url}/v1/load_lora_adapter",
                json={"lora_name": "a@2", "lora_path": "a/2"},
                timeout=120,
            )
            time.sleep(3)
            stop.set()
            for t in threads:
                t.join()
            results.append(
                (
                    "hot-swap a@1 -> a@2 under 8 clients",
                    r.status_code == 200 and not failures,
                    f"{len(failures)} failed of {len(failures) + len(served)}",
                )
            )
            results.append(
                ("new version serves after swap", served[-1:] == ["a@2"], served[-1] if served else "")
            )
            time.sleep(1)
            loaded = {m["id"] for m in httpx.get(f"{vllm_url}/v1/models").json()["data"]}
            results.append(("old version unloaded from vLLM", "a@1" not in loaded, ",".join(sorted(loaded))))
    finally:
        vllm.terminate()
        vllm.wait(30)
    width = max(len(r[0]) for r in results)
    for check, ok, detail in results:
        print(f"{check:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
