"""The router version that chose each episode's adapter, beside the adapter itself.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("router", sa.String(64)))


def downgrade() -> None:
    op.drop_column("episodes", "router")
