"""The entities a capability's failures touched (orders, users, ...).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("capabilities", sa.Column("entities", Json, nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    op.drop_column("capabilities", "entities")
