"""Broker heartbeats: which broker processes are alive, so abandoned work can be recovered.

Each broker process (an *owner*: ``<instance>/<incarnation>``) refreshes its row every few
seconds. An invocation left in flight by an owner whose heartbeat stopped is recovered by
another broker (or by the same instance after a restart: it recognises its own earlier
incarnations), and never while its owner is alive.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "brokers",
        sa.Column("owner", sa.String(100), nullable=False),
        sa.Column("instance", sa.String(100), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name="pk_brokers"),
    )


def downgrade() -> None:
    op.drop_table("brokers")
