"""The journal: invocations (projection), events (append-only), results.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ts = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "invocations",
        sa.Column("invocation_id", sa.String(40), nullable=False),
        sa.Column("created_at", ts, nullable=False),
        sa.Column("updated_at", ts, nullable=False),
        sa.Column("agent", sa.String(100), nullable=False),
        sa.Column("route", sa.String(200)),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.String(80), nullable=False),
        sa.Column("idempotent", sa.Boolean, nullable=False),
        sa.Column("credential_id", sa.String(100)),
        sa.Column("credential_version", sa.String(100)),
        sa.Column("injection", sa.String(20)),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("idempotency_scope", sa.String(200)),
        sa.Column("idempotency_expires_at", ts),
        sa.Column("remote_contract", sa.Boolean, nullable=False),
        sa.Column("stage", sa.String(32), nullable=False),
        sa.Column("phase", sa.String(32), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("retry", sa.String(32)),
        sa.Column("code", sa.String(64)),
        sa.Column("caller_disposition", sa.String(32), nullable=False),
        sa.Column("dispatch_started", sa.Boolean, nullable=False),
        sa.Column("dispatch_seq", sa.Integer),
        sa.Column("status", sa.Integer),
        sa.Column("last_seq", sa.Integer, nullable=False),
        sa.Column("owner", sa.String(100), nullable=False),
        sa.Column("lease_expires_at", ts),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("attempts_used", sa.Integer, nullable=False),
        sa.Column("retry_budget", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("invocation_id", name="pk_invocations"),
    )
    op.create_index("ix_invocations_created_at", "invocations", ["created_at"])
    op.create_index("ix_invocations_outcome_route", "invocations", ["outcome", "route"])
    op.create_index("ix_invocations_owner_stage", "invocations", ["owner", "stage"])
    op.create_index(
        "uq_invocations_idempotency",
        "invocations",
        ["agent", "idempotency_scope", "idempotency_key"],
        unique=True,
    )

    op.create_table(
        "events",
        sa.Column("invocation_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("at", ts, nullable=False),
        sa.Column("writer", sa.String(100), nullable=False),
        sa.Column("writer_seq", sa.BigInteger, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(64)),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("invocation_id", "seq", name="pk_events"),
    )
    op.create_index("uq_events_writer_seq", "events", ["writer", "writer_seq"], unique=True)

    op.create_table(
        "results",
        sa.Column("invocation_id", sa.String(40), nullable=False),
        sa.Column("stored_at", ts, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("headers", sa.Text, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("framing", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(64)),
        sa.PrimaryKeyConstraint("invocation_id", name="pk_results"),
    )


def downgrade() -> None:
    op.drop_table("results")
    op.drop_index("uq_events_writer_seq", table_name="events")
    op.drop_table("events")
    op.drop_index("uq_invocations_idempotency", table_name="invocations")
    op.drop_index("ix_invocations_owner_stage", table_name="invocations")
    op.drop_index("ix_invocations_outcome_route", table_name="invocations")
    op.drop_index("ix_invocations_created_at", table_name="invocations")
    op.drop_table("invocations")
