"""MCP servers of trace-plugin: the recording proxy and the environment server."""
