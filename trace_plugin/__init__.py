"""trace-plugin: capture an agent's trajectories and turn its recurrent failures into
capability-targeted training environments, experts and deployments (TRACE).

The capture path imports only the standard library and SQLAlchemy; LangChain is imported
when a capture is applied, and the heavy ML stack only by training and serving.
"""

from trace_plugin.capture import Capture, capture, current_episode_id
from trace_plugin.recorder import Recorder, configure, feedback, flush
from trace_plugin.store import Store
from trace_plugin.tracer import Tracer
from trace_plugin.trajectory import Episode, EpisodeEnd, Feedback, Step

__all__ = [
    "Capture",
    "Episode",
    "EpisodeEnd",
    "Feedback",
    "Recorder",
    "Step",
    "Store",
    "Tracer",
    "capture",
    "configure",
    "current_episode_id",
    "feedback",
    "flush",
]
__version__ = "0.1.0"
