"""A canary deployment's trial: the share of the traffic it was sent, and how it ended.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("deployments", sa.Column("canary", Json))


def downgrade() -> None:
    op.drop_column("deployments", "canary")
