"""Synthesized environment specs and trained experts.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "env_specs",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("capability", sa.String(200), nullable=False),
        sa.Column("spec", Json, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("report", Json, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("name", "version", name="uq_env_specs_name_version"),
    )
    op.create_table(
        "experts",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("capability", sa.String(200), nullable=False),
        sa.Column("env_name", sa.String(200), nullable=False),
        sa.Column("env_version", sa.Integer, nullable=False),
        sa.Column("base_model", sa.String(500), nullable=False),
        sa.Column("base_model_hash", sa.String(64), nullable=False),
        sa.Column("config", Json, nullable=False),
        sa.Column("reward_curve", Json, nullable=False),
        sa.Column("evaluation", Json, nullable=False),
        sa.Column("adapter_path", sa.Text),
        sa.Column("adapter_sha256", sa.String(64)),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_experts_agent_capability", "experts", ["agent", "capability"])


def downgrade() -> None:
    op.drop_table("experts")
    op.drop_table("env_specs")
