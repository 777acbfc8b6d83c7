"""Mined capabilities.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "capabilities",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("agent", sa.String(200), sa.ForeignKey("agents.name"), nullable=False),
        sa.Column("mining_run", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("description", sa.Text, nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("selected", sa.Boolean, nullable=False),
        sa.Column("metrics", Json, nullable=False),
        sa.Column("examples", Json, nullable=False),
        sa.Column("tools", Json, nullable=False),
        sa.Column("mined_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_capabilities_agent_run", "capabilities", ["agent", "mining_run"])


def downgrade() -> None:
    op.drop_table("capabilities")
