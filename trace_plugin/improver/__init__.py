"""The improver: an agent that gets better from its own production traffic, unattended.

One cycle runs mine → synthesize → screen → train → route → evaluate → verdict → deploy. Every unit of
work is a ``Job`` in the store, so a process killed at any
point resumes the same cycle where it stopped, without training or deploying anything twice:
expert ids, adapter names and deployment ids are all derived from the cycle id. A lease
keeps a second improver for the same agent out.

Nothing unsafe is deployed. Candidates are loaded into the gateway beside the live
experts and evaluated through it (a candidate router answers as ``router:CYCLE``), on the
target's held-out tasks and on held-out seeds of every synthesized environment; only a
deployment that beats the current one by more than ``margin``, with no capability
regressing beyond ``tolerance``, takes the traffic (``judge``, the deploy verdict).
Between cycles, ``Improver.monitor`` compares the live success rate with the previous
deployment's and rolls back when it fell.

- ``.config``: ``ImproverConfig`` and the seed ranges;
- ``.outputs``: each stage's typed output, stored as ``Job.outputs``;
- ``.stages``: mine, synthesize, screen, train, route, deploy;
- ``.evaluation``: evaluate and the verdict;
- ``.monitor``: the triggers and rollback;
- ``.loop``: ``Improver``, the lease, the jobs and the cycle.
"""

from trace_plugin.improver.config import GATE_SEEDS, HELD_OUT_SEEDS, TRAINING_SEEDS, ImproverConfig
from trace_plugin.improver.errors import ConfigError, DeployError, ImproverError
from trace_plugin.improver.evaluation import bootstrap_interval, judge, paired_gain, summary
from trace_plugin.improver.loop import Evaluator, Improver
from trace_plugin.improver.stages import router_spec
from trace_plugin.records.stage_outputs import (
    CycleEnd,
    Deployed,
    Evaluation,
    GateFit,
    Mined,
    Routing,
    Scores,
    Screened,
    Summary,
    Synthesized,
    TargetScores,
    Trained,
    Verdict,
)

__all__ = [
    "GATE_SEEDS",
    "HELD_OUT_SEEDS",
    "TRAINING_SEEDS",
    "ConfigError",
    "CycleEnd",
    "DeployError",
    "Deployed",
    "Evaluation",
    "Evaluator",
    "GateFit",
    "Improver",
    "ImproverConfig",
    "ImproverError",
    "Mined",
    "Routing",
    "Scores",
    "Screened",
    "Summary",
    "Synthesized",
    "TargetScores",
    "Trained",
    "Verdict",
    "bootstrap_interval",
    "judge",
    "paired_gain",
    "router_spec",
    "summary",
]
