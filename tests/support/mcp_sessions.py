"""Shared by the tests: mcp_sessions."""

from __future__ import annotations

from contextlib import asynccontextmanager

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


@asynccontextmanager
async def stdio_session(*command: str, env: dict | None = None):
    params = StdioServerParameters(command=command[0], args=list(command[1:]), env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session
