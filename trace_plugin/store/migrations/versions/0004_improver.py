"""The improver's persisted jobs, deployments and leases.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("cycle", sa.String(64), nullable=False),
        sa.Column("stage", sa.String(32), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("inputs", Json, nullable=False),
        sa.Column("outputs", Json),
        sa.Column("error", sa.Text),
        sa.Column("started_at", Timestamp, nullable=False),
        sa.Column("ended_at", Timestamp),
    )
    op.create_index("ix_jobs_agent_cycle", "jobs", ["agent", "cycle"])
    op.create_table(
        "deployments",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("adapters", Json, nullable=False),
        sa.Column("router", Json, nullable=False),
        sa.Column("evaluation", Json, nullable=False),
        sa.Column("reasons", Json, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
    )
    op.create_index("ix_deployments_agent_created", "deployments", ["agent", "created_at"])
    op.create_table(
        "leases",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("expires_at", Timestamp, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
    op.drop_table("deployments")
    op.drop_table("jobs")
