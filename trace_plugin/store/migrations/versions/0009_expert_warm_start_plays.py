"""An expert's warm-start plays: how many verified reference plays it was fine-tuned on.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("experts", sa.Column("warm_start_plays", sa.Integer))


def downgrade() -> None:
    op.drop_column("experts", "warm_start_plays")
