"""An agent process stopped the ways production stops it, for the shutdown tests.

Usage: python shutdown_proc.py DB_URL MODE RUNS. The recorder wakes only every 5 s, so
whatever is stored came through the exit or SIGTERM flush. MODE:
- ``sigterm``: runs, prints "done", waits to be sent SIGTERM (default action);
- ``sigterm-app``: the same, with a SIGTERM handler of the application's own that exits 3;
- ``exit``: records through an explicit ``Recorder`` and exits normally, without flushing.
"""

import signal
import sys
import time

from agents import build, model_for, user

db_url, mode, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "sigterm-app":

    def app_shutdown(signum, frame):
        print("app shutdown", flush=True)
        sys.exit(3)

    signal.signal(signal.SIGTERM, app_shutdown)

import trace_plugin  # noqa: E402

if mode == "exit":
    options = {"recorder": trace_plugin.Recorder(db_url, interval=5.0)}
else:
    trace_plugin.configure(db_url, interval=5.0)
    options = {}
graph = trace_plugin.capture(agent=mode, **options)(
    build("create_agent", model_for(("get_order", {"order_id": "O-1"}), ("find_user", {"email": "a@b.io"})))
)
for i in range(runs):
    graph.invoke(user(f"{mode} run {i}"))
print("done", flush=True)
if mode != "exit":
    time.sleep(120)
