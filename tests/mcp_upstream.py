"""A small upstream MCP server for the proxy tests (stdio): echo, a huge result, a crash, its pid."""

import os

from mcp.server.fastmcp import FastMCP

server = FastMCP("upstream")


@server.tool()
def echo(text: str) -> str:
    """Echo the text."""
    return text


@server.tool()
def huge(size: int) -> str:
    """A result of `size` bytes."""
    return "x" * size


@server.tool()
def fail(reason: str) -> str:
    """Raise an error."""
    raise ValueError(reason)


@server.tool()
def pid() -> int:
    """This server's process id: which upstream a session reached."""
    return os.getpid()


@server.tool()
def die() -> str:
    """Kill the server mid-call."""
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
