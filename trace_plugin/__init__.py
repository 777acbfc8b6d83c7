"""trace-plugin: capture an agent's trajectories and turn its recurrent failures into
capability-targeted training environments, experts and deployments (TRACE).

The capture path imports only the standard library and SQLAlchemy; LangChain is imported
when a capture is applied, and the heavy ML stack only by training and serving.
"""

from trace_plugin.capture import Capture, capture, current_episode_id
from trace_plugin.errors import TracePluginError
from trace_plugin.recorder import Recorder, configure, feedback, flush
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Feedback, Step
from trace_plugin.store import Store
from trace_plugin.tracer import Tracer

__all__ = [
    "Capture",
    "Episode",
    "EpisodeEnd",
    "Feedback",
    "Recorder",
    "Step",
    "Store",
    "Tracer",
    "TracePluginError",
    "capture",
    "configure",
    "current_episode_id",
    "feedback",
    "flush",
]
__version__ = "0.1.0"
