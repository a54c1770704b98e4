"""PostgreSQL: one round trip per journal batch (``affidavit_write``).

The journal's group commit hands a whole batch (fences, idempotency claims, invocation rows,
events, projection updates, results, chain checkpoints) to this function as one JSON document; called in
autocommit mode, the call is one transaction and one network round trip instead of a BEGIN,
a statement per table and a COMMIT. Fences and claims are checked first; if any is refused,
the function raises SQLSTATE AF001 with the refused writes in DETAIL and nothing is written,
so the broker drops those writes, re-chains the rest and calls again. SQLite (in-process, no
round trips) keeps the plain statements.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from alembic import op

revision = "0006"
down_revision = "0005"
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
    op.execute(
        f"""
        CREATE FUNCTION affidavit_write(p jsonb) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            c jsonb;
            f jsonb;
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
            UPDATE invocations i SET ({columns}) = ({values})
              FROM jsonb_populate_recordset(NULL::invocations, coalesce(p->'updates', '[]'::jsonb)) u
             WHERE i.invocation_id = u.invocation_id;
            INSERT INTO results SELECT * FROM jsonb_populate_recordset(NULL::results, coalesce(p->'results', '[]'::jsonb));
            INSERT INTO chain_checkpoints
                SELECT * FROM jsonb_populate_recordset(NULL::chain_checkpoints, coalesce(p->'checkpoints', '[]'::jsonb));
        END $$
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION affidavit_write(jsonb)")
