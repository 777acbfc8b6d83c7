"""Running the gateway: in the foreground for ``trace-plugin serve``, or on a background
thread for a script that runs its agent beside it (``serve_embedded``), the demo,
tests and benchmarks."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from trace_plugin.errors import TracePluginError
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.model_files import Precision
from trace_plugin.recorder import Recorder

HEADER_TIMEOUT = 15.0  # seconds a client may take to send a request's headers


class _HeaderDeadline:
    """A deadline for a request's headers, from the connection's start or the end of its
    last response: a client that never finishes them gives up its file descriptor.
    uvicorn's keep-alive timeout restarts on every byte received, so a client sending one
    byte at a time would hold a connection for as long as it liked."""

    header_timeout = HEADER_TIMEOUT
    _deadline: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if not in_flight and not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(seconds: float = HEADER_TIMEOUT) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with a deadline of
    ``seconds`` on each request's headers; pass it as uvicorn's ``http``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class HttpTools(_HeaderDeadline, HttpToolsProtocol):
            header_timeout = seconds

            def on_headers_complete(self) -> None:
                self._disarm()
                super().on_headers_complete()

        return HttpTools
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11(_HeaderDeadline, H11Protocol):
            header_timeout = seconds

            def handle_events(self) -> None:
                before = self.cycle
                super().handle_events()
                if self.cycle is not before:  # a request's headers arrived
                    self._disarm()

        return H11


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    """A uvicorn server on a daemon thread; ``stop()`` shuts it down gracefully. A gateway
    that serves a model here (``serve_embedded``) names it and its served precision."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int
    model: str | None = None  # the id requests name it by ("default" routes to it too)
    precision: str | None = None  # its weights' dtype, as "auto" resolved it: "bfloat16", "float32"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerStartError(TracePluginError, RuntimeError):
    """The server thread died or did not listen in time."""


def start_in_thread(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int | None = None,
    timeout: float = 30,
    header_timeout: float = HEADER_TIMEOUT,
) -> RunningServer:
    port = port or free_port(host)
    http = header_deadline_protocol(header_timeout)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", http=http)
    )
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServerStartError(f"gateway did not start on {host}:{port}")
        time.sleep(0.02)
    return RunningServer(server, thread, host, port)


def serve_embedded(
    model: str | Path | None = None,
    *,
    config: GatewayConfig | None = None,
    recorder: Recorder | None = None,
    precision: Precision = "auto",
    max_batch: int = 8,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> RunningServer:
    """The gateway in front of the embedded model, on a background thread of this process:
    what ``trace-plugin serve`` runs, for a script that also runs its agent and improver.

    ``model`` is a local Hugging Face directory or ``.gguf`` (default: the embedded
    SmolLM2-135M), loaded before this returns; ``port`` a free one when None. Stop it with
    ``stop()`` or by leaving its ``with`` block, which also ends the model's engine thread.
    """
    from trace_plugin.gateway.embedded import EmbeddedBackend  # torch: only for what serves the model here

    backend = EmbeddedBackend(model, max_batch=max_batch, precision=precision)
    running = start_in_thread(create_app(backend, config=config, recorder=recorder), host, port)
    running.model, running.precision = backend.model_id, str(backend.dtype).removeprefix("torch.")
    return running
