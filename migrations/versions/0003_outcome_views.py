"""SQL views for outcome metrics, so operators can query without the application.

``invocation_outcomes``: invocations per hour bucket, route, phase, outcome and code. Phase and
outcome stay separate columns: `connection_setup/not_attempted` rising means routing,
certificates or auth; `remote_execution/unknown` rising means reconciliation work.
``unknown_outcomes``: every invocation whose effect is unknown, oldest first.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        bucket = "date_trunc('hour', created_at AT TIME ZONE 'UTC')"
    else:
        bucket = "strftime('%Y-%m-%d %H:00:00', created_at)"
    op.execute(
        f"""
        CREATE VIEW invocation_outcomes AS
        SELECT {bucket} AS bucket, route, phase, outcome, code, count(*) AS invocations
        FROM invocations
        GROUP BY {bucket}, route, phase, outcome, code
        """
    )
    op.execute(
        """
        CREATE VIEW unknown_outcomes AS
        SELECT invocation_id, created_at, agent, route, method, target, code, retry, caller_disposition
        FROM invocations
        WHERE outcome = 'unknown'
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW unknown_outcomes")
    op.execute("DROP VIEW invocation_outcomes")
