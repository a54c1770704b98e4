"""The vault (encrypted secret versions) and audit chain checkpoints, both append-only.

``vault_secrets`` keeps every version of every secret as AES-GCM ciphertext; a new value is a
new version, never an update. ``chain_checkpoints`` records, per journal writer, how far its
hash chain reached and the hash at that point, so ``audit verify`` can tell a deleted tail or a
re-hashed chain. Like ``events`` (0002), a trigger refuses UPDATE and DELETE on both tables.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ts = sa.DateTime(timezone=True)
TABLES = ("vault_secrets", "chain_checkpoints")


def upgrade() -> None:
    op.create_table(
        "vault_secrets",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("version", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary, nullable=False),
        sa.Column("created_at", ts, nullable=False),
        sa.PrimaryKeyConstraint("name", "version", name="pk_vault_secrets"),
    )
    op.create_table(
        "chain_checkpoints",
        sa.Column("writer", sa.String(100), nullable=False),
        sa.Column("writer_seq", sa.BigInteger, nullable=False, autoincrement=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("at", ts, nullable=False),
        sa.PrimaryKeyConstraint("writer", "writer_seq", name="pk_chain_checkpoints"),
    )
    if op.get_bind().dialect.name == "postgresql":
        # affidavit_refuse_change() exists since 0002.
        for table in TABLES:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION affidavit_refuse_change()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION affidavit_refuse_change()"
            )
    else:
        for table in TABLES:
            for verb in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, 'affidavit: {table} is append-only; {verb} refused'); END"
                )


def downgrade() -> None:
    # Dropping a table drops its triggers on both dialects.
    op.drop_table("chain_checkpoints")
    op.drop_table("vault_secrets")
