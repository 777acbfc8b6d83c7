"""SQL tables of the trajectory store (SQLAlchemy Core; migrations live in ``migrations/``).

Each stage adds its tables beside the trajectory ones (capabilities so far; environments,
training runs, experts and deployments to come), keyed to ``agents.name`` and created by
a migration.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from trace_plugin.records.trajectory import AGENT_NAME_LENGTH

metadata = MetaData()

# JSONB on PostgreSQL (indexable, compact); JSON text elsewhere.
Json = JSON().with_variant(JSONB(), "postgresql")
# 64-bit ids on PostgreSQL; SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Timestamp = DateTime(timezone=True)

agents = Table(
    "agents",
    metadata,
    Column("name", String(AGENT_NAME_LENGTH), primary_key=True),
    Column("created_at", Timestamp, nullable=False),
)

episodes = Table(
    "episodes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("source", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("input", Json),
    Column("output", Json),
    Column("reward", Float),
    Column("label", String(64)),
    Column("error", Text),
    Column("model", String(200)),
    Column("adapter", String(200)),
    Column("router", String(64)),
    Column("started_at", Timestamp, nullable=False),
    Column("ended_at", Timestamp),
    Column("metadata", Json),
    Index("ix_episodes_agent_started", "agent", "started_at"),
)

steps = Table(
    "steps",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("episode_id", String(64), ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("kind", String(8), nullable=False),
    Column("name", String(200), nullable=False),
    Column("input", Json),
    Column("output", Json),
    Column("error", Text),
    Column("tool_call_id", String(200)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("latency_ms", Float),
    Column("started_at", Timestamp),
    Column("ended_at", Timestamp),
    Column("run_id", String(64)),
    Column("parent_run_id", String(64)),
    Column("token_ids", Json),
    UniqueConstraint("episode_id", "seq", name="uq_steps_episode_seq"),
)

tool_schemas = Table(
    "tool_schemas",
    metadata,
    Column("hash", String(64), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("schema", Json, nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

episode_tools = Table(
    "episode_tools",
    metadata,
    Column("episode_id", String(64), ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True),
    Column("tool_hash", String(64), ForeignKey("tool_schemas.hash"), primary_key=True),
)

feedback = Table(
    "feedback",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("episode_id", String(64), ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False),
    Column("reward", Float),
    Column("label", String(64)),
    Column("source", String(64), nullable=False),
    Column("comment", Text),
    Column("created_at", Timestamp, nullable=False),
    Index("ix_feedback_episode", "episode_id"),
)

capabilities = Table(
    "capabilities",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("mining_run", String(64), nullable=False),  # the capabilities one mining pass found
    Column("name", String(200), nullable=False),
    Column("description", Text, nullable=False),
    Column("source", String(64), nullable=False),  # "detector" or "llm"
    Column("selected", Boolean, nullable=False),
    Column("metrics", Json, nullable=False),  # coverage, contrast, runs passed, per-run figures
    Column("examples", Json, nullable=False),  # failed episode ids that lack it
    Column("tools", Json, nullable=False),  # tools involved in those episodes
    Column("entities", Json, nullable=False, server_default=text("'[]'")),  # what those calls acted on
    Column("mined_at", Timestamp, nullable=False),
    Index("ix_capabilities_agent_run", "agent", "mining_run"),
)

env_specs = Table(
    "env_specs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("version", Integer, nullable=False),  # 1, 2, ... per name
    Column("capability", String(200), nullable=False),
    Column("spec", Json, nullable=False),  # the EnvSpec, as data
    Column("status", String(32), nullable=False),  # "validated" or "rejected"
    Column("report", Json, nullable=False),  # policy checks and calibration attempts
    Column("created_at", Timestamp, nullable=False),
    UniqueConstraint("name", "version", name="uq_env_specs_name_version"),
)

experts = Table(
    "experts",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("capability", String(200), nullable=False),
    Column("env_name", String(200), nullable=False),
    Column("env_version", Integer, nullable=False),
    Column("base_model", String(500), nullable=False),
    Column("base_model_hash", String(64), nullable=False),
    Column("config", Json, nullable=False),
    Column("reward_curve", Json, nullable=False),
    Column("unhinted_curve", Json),
    Column("warm_start_plays", Integer),  # NULL: from before it was kept
    Column("evaluation", Json, nullable=False),
    Column("adapter_path", Text),
    Column("adapter_sha256", String(64)),
    Column("corpus", Json),  # its retrieval corpus (records.router_spec.CorpusEntry), once computed
    Column("status", String(32), nullable=False),  # "training", "ready" or "failed"
    Column("created_at", Timestamp, nullable=False),
    Index("ix_experts_agent_capability", "agent", "capability"),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(200), primary_key=True),  # cycle/stage/key: one job per unit of work, ever
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("cycle", String(64), nullable=False),
    Column("stage", String(32), nullable=False),
    Column("key", String(200), nullable=False),
    Column("status", String(16), nullable=False),  # "running", "done" or "failed"
    Column("attempts", Integer, nullable=False),
    Column("inputs", Json, nullable=False),
    Column("outputs", Json),
    Column("error", Text),
    Column("started_at", Timestamp, nullable=False),
    Column("ended_at", Timestamp),
    Index("ix_jobs_agent_cycle", "agent", "cycle"),
)

deployments = Table(
    "deployments",
    metadata,
    Column("id", String(64), primary_key=True),  # the cycle that produced it
    Column("agent", String(AGENT_NAME_LENGTH), ForeignKey("agents.name"), nullable=False),
    Column("status", String(16), nullable=False),  # "live", "canary", "rejected", "superseded", "rolled_back"
    Column("adapters", Json, nullable=False),  # capability -> name@version
    Column("router", Json, nullable=False),  # the router spec the gateway runs
    Column("evaluation", Json, nullable=False),  # what the deploy verdict compared
    Column("reasons", Json, nullable=False),  # why it was rejected or rolled back
    Column("canary", Json),  # a canary's trial: its share of the traffic, how it ended
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Index("ix_deployments_agent_created", "agent", "created_at"),
)

leases = Table(
    "leases",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("owner", String(200), nullable=False),
    Column("expires_at", Timestamp, nullable=False),
)
