"""PostgreSQL: ``affidavit_write`` updates projections one key at a time.

0006 updated the batch's projections with one ``UPDATE ... FROM jsonb_populate_recordset(...)``.
The planner cannot know how few rows the function returns, so on a large journal it chose a
sequential scan of ``invocations`` for every batch: the cost of a commit grew with the journal.
Updating row by row uses the primary key, so a commit costs the same on day one and day 300.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

PROJECTION = (
    "updated_at", "stage", "phase", "outcome", "retry", "code", "caller_disposition", "dispatch_started",
    "dispatch_seq", "status", "last_seq", "attempts_used", "credential_id", "credential_version", "injection",
    "owner", "lease_expires_at",
)


def _function(update_sql: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION affidavit_write(p jsonb) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            c jsonb;
            f jsonb;
            u invocations;
            refused jsonb := '[]'::jsonb;
        BEGIN
            FOR c IN SELECT value FROM jsonb_array_elements(coalesce(p->'checks', '[]'::jsonb)) LOOP
                f := c->'fence';
                IF f IS NOT NULL THEN
                    UPDATE invocations SET updated_at = (f->>'now')::timestamptz
                     WHERE invocation_id = f->>'invocation_id'
                       AND generation = (f->>'generation')::integer
                       AND owner = f->>'owner'
                       AND (NOT (f->>'check_expiry')::boolean OR lease_expires_at > (f->>'now')::timestamptz);
                    IF NOT FOUND THEN
                        refused := refused || jsonb_build_array(jsonb_build_object('write', c->'write', 'why', 'fence'));
                        CONTINUE;
                    END IF;
                END IF;
                IF c->'claim' IS NOT NULL THEN
                    INSERT INTO invocations SELECT * FROM jsonb_populate_record(NULL::invocations, c->'claim')
                        ON CONFLICT (agent, idempotency_scope, idempotency_key) DO NOTHING;
                    IF NOT FOUND THEN
                        refused := refused || jsonb_build_array(jsonb_build_object('write', c->'write', 'why', 'claim'));
                    END IF;
                END IF;
            END LOOP;
            IF jsonb_array_length(refused) > 0 THEN
                RAISE EXCEPTION 'affidavit: % journal write(s) refused', jsonb_array_length(refused)
                    USING ERRCODE = 'AF001', DETAIL = refused::text;
            END IF;
            INSERT INTO invocations SELECT * FROM jsonb_populate_recordset(NULL::invocations, coalesce(p->'inserts', '[]'::jsonb));
            INSERT INTO events SELECT * FROM jsonb_populate_recordset(NULL::events, coalesce(p->'events', '[]'::jsonb));
            {update_sql}
            INSERT INTO results SELECT * FROM jsonb_populate_recordset(NULL::results, coalesce(p->'results', '[]'::jsonb));
            INSERT INTO chain_checkpoints
                SELECT * FROM jsonb_populate_recordset(NULL::chain_checkpoints, coalesce(p->'checkpoints', '[]'::jsonb));
        END $$
    """


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    columns = ", ".join(PROJECTION)
    values = ", ".join(f"u.{c}" for c in PROJECTION)
    op.execute(_function(f"""
            FOR u IN SELECT * FROM jsonb_populate_recordset(NULL::invocations, coalesce(p->'updates', '[]'::jsonb)) LOOP
                UPDATE invocations SET ({columns}) = ({values}) WHERE invocation_id = u.invocation_id;
            END LOOP;"""))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    columns = ", ".join(PROJECTION)
    values = ", ".join(f"u.{c}" for c in PROJECTION)
    op.execute(_function(f"""
            UPDATE invocations i SET ({columns}) = ({values})
              FROM jsonb_populate_recordset(NULL::invocations, coalesce(p->'updates', '[]'::jsonb)) u
             WHERE i.invocation_id = u.invocation_id;""").replace("            u invocations;\n", ""))
