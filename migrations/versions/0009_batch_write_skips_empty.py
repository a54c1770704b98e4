"""PostgreSQL: ``affidavit_write`` runs only the statements a batch needs.

A batch of one request's dispatch has no results and often no checks; the result's batch has no
inserts. Each skipped ``INSERT ... SELECT FROM jsonb_populate_recordset`` is an executor start
the database no longer pays on every commit (the writer leaves empty parts out of the document).
Otherwise the same function as 0008.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

PROJECTION = (
    "updated_at", "stage", "phase", "outcome", "retry", "code", "caller_disposition", "dispatch_started",
    "dispatch_seq", "status", "last_seq", "attempts_used", "credential_id", "credential_version", "injection",
    "owner", "lease_expires_at",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    columns = ", ".join(PROJECTION)
    values = ", ".join(f"u.{c}" for c in PROJECTION)
    op.execute(f"""
        CREATE OR REPLACE FUNCTION affidavit_write(p jsonb) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            c jsonb;
            f jsonb;
            u invocations;
            refused jsonb := '[]'::jsonb;
        BEGIN
            IF p ? 'checks' THEN
                FOR c IN SELECT value FROM jsonb_array_elements(p->'checks') LOOP
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
            END IF;
            IF p ? 'inserts' THEN
                INSERT INTO invocations SELECT * FROM jsonb_populate_recordset(NULL::invocations, p->'inserts');
            END IF;
            IF p ? 'events' THEN
                INSERT INTO events SELECT * FROM jsonb_populate_recordset(NULL::events, p->'events');
            END IF;
            IF p ? 'updates' THEN
                FOR u IN SELECT * FROM jsonb_populate_recordset(NULL::invocations, p->'updates') LOOP
                    UPDATE invocations SET ({columns}) = ({values}) WHERE invocation_id = u.invocation_id;
                END LOOP;
            END IF;
            IF p ? 'results' THEN
                INSERT INTO results SELECT * FROM jsonb_populate_recordset(NULL::results, p->'results');
            END IF;
            IF p ? 'checkpoints' THEN
                INSERT INTO chain_checkpoints
                    SELECT * FROM jsonb_populate_recordset(NULL::chain_checkpoints, p->'checkpoints');
            END IF;
        END $$
    """)


def downgrade() -> None:
    # Nothing to undo: this function also takes every document 0008's writer sends (it sends all
    # parts, empty ones as []), so an older broker runs on it unchanged.
    pass
