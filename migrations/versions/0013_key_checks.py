"""Key checks: which key material stands behind each [crypto] key id.

A key id is a name in the configuration; the key behind it is a file or an environment variable
on each host. Another file behind the same id (a copied config, a regenerated key) encrypted new
rows that no broker with the right file could read, and ``secrets set`` could only notice it where
vault rows under that id already existed. ``key_checks`` holds, per id, a known text sealed with
that id's key by the first broker or command that used it; the others open it before they write
(proxy.keychecks). Append-only, like the vault.

``key_ids_before_checks`` lists the ids rows were stored under at this upgrade (one read through
``events``, ``results`` and ``vault_secrets``, here rather than at every broker's start): such an
id is bound only once its key opens one of them. Rows stored afterwards are all under ids bound
first, so for any other id nothing need be read.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "key_checks",
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("sealed", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
        sa.PrimaryKeyConstraint("key_id", name="pk_key_checks"),
    )
    op.create_table(
        "key_ids_before_checks",
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("key_id", name="pk_key_ids_before_checks"),
    )
    op.execute(
        "INSERT INTO key_ids_before_checks (key_id) "
        "SELECT key_id FROM events WHERE key_id IS NOT NULL "
        "UNION SELECT key_id FROM results WHERE key_id IS NOT NULL "
        "UNION SELECT key_id FROM vault_secrets"
    )
    if op.get_bind().dialect.name == "postgresql":
        # affidavit_refuse_change() exists since 0002.
        op.execute("CREATE TRIGGER key_checks_append_only BEFORE UPDATE OR DELETE ON key_checks "
                   "FOR EACH ROW EXECUTE FUNCTION affidavit_refuse_change()")
        op.execute("CREATE TRIGGER key_checks_no_truncate BEFORE TRUNCATE ON key_checks "
                   "FOR EACH STATEMENT EXECUTE FUNCTION affidavit_refuse_change()")
    else:
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER key_checks_no_{verb.lower()} BEFORE {verb} ON key_checks "
                f"BEGIN SELECT RAISE(ABORT, 'affidavit: key_checks is append-only; {verb} refused'); END"
            )


def downgrade() -> None:
    op.drop_table("key_ids_before_checks")
    op.drop_table("key_checks")  # its triggers go with it
