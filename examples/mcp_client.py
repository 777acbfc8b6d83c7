"""Practise in a synthesized training environment from any MCP client, over streamable HTTP.

A synthesized environment is data (an ``EnvSpec``); ``trace-plugin envs serve NAME
--transport http`` serves it. This script does the same in-process so it runs anywhere:
it synthesizes the ``argument_grounding`` environment from the retail target's tool
schemas, stores it, serves it, and then, as an ordinary MCP client would, resets an
episode, reads the ticket, calls tools and asks for the reward.

Run: python examples/mcp_client.py
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from pathlib import Path

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client

from mcp_server.environments import build_server
from mcp_server.transport import http_app
from trace_plugin.environments.catalog import env_factory
from trace_plugin.environments.retail import POLICY, TOOLS
from trace_plugin.environments.synthesis import synthesize
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.recorder import Recorder
from trace_plugin.store import Store


async def play(url: str) -> dict:
    async with streamablehttp_client(url) as (read, write, _), ClientSession(read, write) as session:
        await session.initialize()
        tools = [t.name for t in (await session.list_tools()).tools]
        print("tools:", tools)
        ticket = (await session.call_tool("env_reset", {"seed": 7})).structuredContent
        print("ticket:", ticket["prompt"])
        # A hand-written policy: search by what the user said, then look the id up.
        field, value = re.match(r"My (.+?) is (\S+)\.", ticket["prompt"]).groups()
        found = await session.call_tool("find_user", {field.replace(" ", "_"): value})
        user_id = json.loads(found.content[0].text)[0]
        record = await session.call_tool("get_user", {"user_id": user_id})
        print("get_user:", record.content[0].text)
        answer = f"Here is what we have: {record.content[0].text}"
        return (await session.call_tool("env_reward", {"answer": answer})).structuredContent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'trace.db'}"
        store = Store(db)
        store.upgrade()
        spec = synthesize("argument_grounding", TOOLS, system_prompt=POLICY)
        record = store.save_env_spec("support-agent", spec, "validated", {})
        print(f"synthesized {spec.name} v{record.version}: {len(spec.tasks)} templates")
        recorder = Recorder(db)
        server = build_server(spec.name, env_factory(spec.name, store), recorder=recorder)
        with start_in_thread(http_app(server)) as running:
            reward = asyncio.run(play(f"{running.url}/mcp"))
        recorder.close()
        print("reward:", reward)
        [episode] = store.list_episodes(f"env:{spec.name}")
        print(f"recorded episode {episode.id}: reward {episode.reward}")


if __name__ == "__main__":
    main()
