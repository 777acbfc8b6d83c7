"""What MCP and the recording proxy cost per tool call, side by side in one run.

The same read-only tool call (``get_order`` of the retail environment) made:
- in-process, straight to ``env.step``;
- over MCP (streamable HTTP) to the environment server;
- over MCP to the recording proxy in front of that server.
Latency is per sequential call; throughput through the proxy uses 8 concurrent sessions.

Usage: python bench/mcp_proxy.py [--quick]   (not mcp.py: that name would shadow the mcp package)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from rich.console import Console
from rich.table import Table

from mcp_server.environments import build_server
from mcp_server.proxy import start_proxy_in_thread
from mcp_server.transport import http_app
from trace_plugin import Recorder
from trace_plugin.environments import ToolCall
from trace_plugin.environments.retail import RetailEnv
from trace_plugin.gateway.server import start_in_thread

SEED = 7
# The SDK logs a traceback each time a client session closes its event stream; it is noise here.
logging.getLogger("mcp.server.streamable_http").setLevel(logging.CRITICAL)


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
    async def one() -> None:
        async with session_to(url) as session:
            await session.call_tool("env_reset", {"seed": SEED})
            for _ in range(calls):
                await session.call_tool("get_order", {"order_id": order_id()})

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(sessions)))
    return sessions * calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls, per_session = (100, 25) if args.quick else (1000, 150)

    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(f"sqlite:///{Path(tmp) / 'bench.db'}")
        env_app = http_app(build_server("retail", RetailEnv, recorder=recorder))
        with (
            start_in_thread(env_app) as env_server,
            start_proxy_in_thread(env_server.url + "/mcp", agent="bench", recorder=recorder) as proxy,
        ):
            proxy_url = proxy.url + "/mcp"
            direct = direct_ms(calls * 10)
            via_mcp = asyncio.run(mcp_ms(env_server.url + "/mcp", calls))
            via_proxy = asyncio.run(mcp_ms(proxy_url, calls))
            throughput = asyncio.run(calls_per_s(proxy_url, 8, per_session))
        recorder.close()

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
