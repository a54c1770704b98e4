"""An index on (stage, created_at): finding the records in flight without reading every row.

Every broker's recovery sweep (every ``recovery.sweep_every``, 10 s) looks for records in flight,
oldest first, and the approvals list for held ones; both walked the whole table by ``created_at``.
On a journal of 770,000 invocations the sweep took ~1 s of PostgreSQL's CPU every 10 s on every
broker, growing with the journal; with this index, 2 ms.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_invocations_stage_created_at", "invocations", ["stage", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_invocations_stage_created_at", table_name="invocations")
