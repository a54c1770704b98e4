"""The journal's format: values a broker from before this revision cannot read.

No table changes. The events, the projection and the envelope codes hold values added since 0009
(the event kind ``CALLER_ANSWERED`` and the code ``MALFORMED_REQUEST`` among them). A broker that does not know them answered 500 on such a record and told an agent
repeating its key to reconcile an operation that was never sent. A broker checks the schema's
revision when it starts, and one that does not know this revision refuses to (``the schema is at
0010, which a newer broker made``): so a broker too old to read the journal is never started on it.

From here on, every new value of a closed enum that the journal stores comes with a revision of
its own (tests/test_journal_format.py fails until it does).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
