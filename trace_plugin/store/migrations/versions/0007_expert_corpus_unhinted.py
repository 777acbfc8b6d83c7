"""Each expert's retrieval corpus (what TRACE's router retrieves it by), and its un-hinted
reward per step (whether it learned to act without its hints).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("experts", sa.Column("unhinted_curve", Json))
    op.add_column("experts", sa.Column("corpus", Json))


def downgrade() -> None:
    op.drop_column("experts", "corpus")
    op.drop_column("experts", "unhinted_curve")
