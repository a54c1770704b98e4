"""The outcome views count ended invocations only.

A request still in flight is stored as ``remote_execution``/``unknown`` (dispatched, no answer
yet), and one held for approval as ``validation``/``not_attempted``: both views counted them as if
they had ended that way, so ``unknown_outcomes``, the reconciliation queue, listed requests still
running (an operator could reconcile one whose answer was on its way), and ``invocation_outcomes``
disagreed with ``affidavit_invocations_total`` by the requests in flight.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

#: The stages of an ended record at this revision (proxy.contract.ENDED).
ENDED = "('delivered', 'delivery_failed', 'store_failed', 'ended_not_attempted', 'ended_unknown')"


def _bucket() -> str:
    if op.get_bind().dialect.name == "postgresql":
        return "date_trunc('hour', created_at AT TIME ZONE 'UTC')"
    return "strftime('%Y-%m-%d %H:00:00', created_at)"


def _views(where: str) -> None:
    bucket = _bucket()
    op.execute("DROP VIEW unknown_outcomes")
    op.execute("DROP VIEW invocation_outcomes")
    op.execute(
        f"""
        CREATE VIEW invocation_outcomes AS
        SELECT {bucket} AS bucket, route, phase, outcome, code, count(*) AS invocations
        FROM invocations
        {where}
        GROUP BY {bucket}, route, phase, outcome, code
        """
    )
    op.execute(
        f"""
        CREATE VIEW unknown_outcomes AS
        SELECT invocation_id, created_at, agent, route, method, target, code, retry, caller_disposition
        FROM invocations
        WHERE outcome = 'unknown'{where.replace('WHERE', ' AND')}
        """
    )


def upgrade() -> None:
    _views(f"WHERE stage IN {ENDED}")


def downgrade() -> None:
    _views("")
