"""What MCP and the recording proxy cost per tool call, side by side in one run.

The same read-only tool call (``get_order`` of the retail environment) made:
- in-process, straight to ``env.step``;
- over MCP (streamable HTTP) to the environment server (``trace-plugin envs serve``);
- over MCP to the recording proxy (``trace-plugin mcp-proxy``) in front of that server.
Server and proxy run as their own processes, as deployed. Latency is per sequential
call; throughput through the proxy uses 8 concurrent sessions.

Usage: python bench/mcp_proxy.py [--quick]   (not mcp.py: that name would shadow the mcp package)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from rich.console import Console
from rich.table import Table

from mcp_server.transport import run
from trace_plugin.environments import ToolCall
from trace_plugin.environments.retail import RetailEnv
from trace_plugin.gateway.server import free_port

SEED = 7


@asynccontextmanager
async def session_to(url: str):
    async with streamablehttp_client(url) as (read, write, _), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def order_id() -> str:
    return RetailEnv().reset(SEED).metadata["order_id"]


def direct_ms(calls: int) -> float:
    env = RetailEnv()
    env.reset(SEED)
    call = ToolCall("get_order", {"order_id": order_id()})
    start = time.perf_counter()
    for _ in range(calls):
        env.step(call)
    return (time.perf_counter() - start) / calls * 1000


async def mcp_ms(url: str, calls: int) -> float:
    async with session_to(url) as session:
        await session.list_tools()
        await session.call_tool("env_reset", {"seed": SEED})
        arguments = {"order_id": order_id()}
        for _ in range(10):  # warm the connection
            await session.call_tool("get_order", arguments)
        start = time.perf_counter()
        for _ in range(calls):
            await session.call_tool("get_order", arguments)
        return (time.perf_counter() - start) / calls * 1000


async def calls_per_s(url: str, sessions: int, calls: int) -> float:
    """Tool calls per second once every session is open (opening one is not a call)."""
    ready, times = asyncio.Barrier(sessions + 1), []

    async def one() -> None:
        async with session_to(url) as session:
            await session.call_tool("env_reset", {"seed": SEED})
            await ready.wait()
            for _ in range(calls):
                await session.call_tool("get_order", {"order_id": order_id()})
            times.append(time.perf_counter())

    clients = [asyncio.create_task(one()) for _ in range(sessions)]
    await ready.wait()
    start = time.perf_counter()
    await asyncio.gather(*clients)
    return sessions * calls / (max(times) - start)


def wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls, per_session = (100, 25) if args.quick else (1000, 150)

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'bench.db'}"
        env_port, proxy_port = free_port(), free_port()
        env_url, proxy_url = f"http://127.0.0.1:{env_port}/mcp", f"http://127.0.0.1:{proxy_port}/mcp"
        cli = [sys.executable, "-m", "trace_plugin"]
        env_server = subprocess.Popen(
            [*cli, "envs", "serve", "retail", "--transport", "http", "--port", str(env_port), "--db", db]
        )
        proxy = None
        try:
            wait_for_port(env_port)
            proxy = subprocess.Popen(
                [
                    *cli,
                    "mcp-proxy",
                    "--upstream",
                    env_url,
                    "--transport",
                    "http",
                    "--port",
                    str(proxy_port),
                    "--db",
                    db,
                ]
            )
            wait_for_port(proxy_port)
            direct = direct_ms(calls * 10)
            # The clients run on the event loop the servers run on (uvloop where installed).
            via_mcp = run(mcp_ms(env_url, calls))
            via_proxy = run(mcp_ms(proxy_url, calls))
            throughput = run(calls_per_s(proxy_url, 8, per_session))
        finally:
            for process in (proxy, env_server):
                if process is not None:
                    process.terminate()
                    process.wait(30)

    table = Table(title="One get_order tool call, three ways")
    for col in ("path", "ms per call", "target"):
        table.add_column(col)
    table.add_row("in-process env.step", f"{direct:.4f}", "")
    table.add_row("MCP over HTTP", f"{via_mcp:.2f}", "")
    table.add_row("MCP through the recording proxy", f"{via_proxy:.2f}", "")
    table.add_row("proxy ÷ direct MCP", f"{via_proxy / via_mcp:.2f}×", "≤ 2×")
    table.add_row("calls/s through the proxy (8 sessions)", f"{throughput:.0f}", "≥ 300")
    Console().print(table)
    print(
        json.dumps(
            {
                "bench": "mcp",
                "quick": args.quick,
                "direct_step_ms": round(direct, 5),
                "mcp_call_ms": round(via_mcp, 3),
                "proxy_call_ms": round(via_proxy, 3),
                "proxy_overhead_ratio": round(via_proxy / via_mcp, 3),
                "proxy_calls_per_s": round(throughput, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
