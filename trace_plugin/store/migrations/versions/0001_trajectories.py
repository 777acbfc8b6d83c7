"""Trajectory store: agents, episodes, steps, tool schemas, feedback.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_table(
        "episodes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("input", Json),
        sa.Column("output", Json),
        sa.Column("reward", sa.Float),
        sa.Column("label", sa.String(64)),
        sa.Column("error", sa.Text),
        sa.Column("model", sa.String(200)),
        sa.Column("adapter", sa.String(200)),
        sa.Column("started_at", Timestamp, nullable=False),
        sa.Column("ended_at", Timestamp),
        sa.Column("metadata", Json),
    )
    op.create_index("ix_episodes_agent_started", "episodes", ["agent", "started_at"])
    op.create_table(
        "steps",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "episode_id",
            sa.String(64),
            sa.ForeignKey("episodes.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("input", Json),
        sa.Column("output", Json),
        sa.Column("error", sa.Text),
        sa.Column("tool_call_id", sa.String(200)),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("latency_ms", sa.Float),
        sa.Column("started_at", Timestamp),
        sa.Column("ended_at", Timestamp),
        sa.Column("run_id", sa.String(64)),
        sa.Column("parent_run_id", sa.String(64)),
        sa.Column("token_ids", Json),
        sa.UniqueConstraint("episode_id", "seq", name="uq_steps_episode_seq"),
    )
    op.create_table(
        "tool_schemas",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("schema", Json, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_table(
        "episode_tools",
        sa.Column(
            "episode_id",
            sa.String(64),
            sa.ForeignKey("episodes.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("tool_hash", sa.String(64), sa.ForeignKey("tool_schemas.hash"), primary_key=True),
    )
    op.create_table(
        "feedback",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column(
            "episode_id",
            sa.String(64),
            sa.ForeignKey("episodes.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("reward", sa.Float),
        sa.Column("label", sa.String(64)),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("comment", sa.Text),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_feedback_episode", "feedback", ["episode_id"])


def downgrade() -> None:
    for table in ("feedback", "episode_tools", "tool_schemas", "steps", "episodes", "agents"):
        op.drop_table(table)
