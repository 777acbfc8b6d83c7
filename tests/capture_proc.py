"""A separate agent process for the multi-process and shutdown tests.

Usage: python capture_proc.py DB_URL AGENT RUNS. It never flushes explicitly: the
recorder's exit hook must store everything before the interpreter ends.
"""

import sys

from agents import build, model_for, user

import trace_plugin

db_url, agent, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
trace_plugin.configure(db_url)
graph = trace_plugin.capture(agent=agent)(
    build("create_agent", model_for(("get_order", {"order_id": "O-1"}), ("find_user", {"email": "a@b.io"})))
)
for i in range(runs):
    graph.invoke(user(f"{agent} run {i}"))
print("done", flush=True)
