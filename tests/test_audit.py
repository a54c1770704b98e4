"""The audit chain on both dialects: a real journal, real tampering, offline verification.

Events and checkpoints are append-only by trigger, so each tampering first gets past the
triggers the way an attacker with DDL rights would (PostgreSQL: ``ALTER TABLE ... DISABLE
TRIGGER USER``; SQLite: ``DROP TRIGGER``), then changes rows directly.
"""

from __future__ import annotations

import asyncio
import time
import json
import os
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import tomli_w
from sqlalchemy import insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from typer.testing import CliRunner

from proxy import audit
from proxy.audit import Break, Damage, checkpoint_row
from proxy.contract import EventKind
from proxy.crypto import KeyRing
from proxy.invocation_log import InvocationLog
from proxy.store.journal import GENESIS, Journal, chain_hash, make_engine, on_engine
from proxy.store.schema import events
from proxy.store.vault_schema import chain_checkpoints, vault_secrets
from tests.conftest import DIALECTS, database_url
from tests.support.broker import AFFIDAVIT
from tests.support.journal import query
from tests.test_journal import identity

WRITERS = ("w1", "w2")
INVOCATIONS_PER_WRITER = 5
EVENTS_PER_INVOCATION = 8


# -- a real journal --------------------------------------------------------------------------------


async def history(journal: Journal, owner: str) -> None:
    """Eight events of one invocation, committed in four steps as the broker does."""
    entry = InvocationLog(journal, identity(), owner)
    entry.append(EventKind.ACTION_ACCEPTED, agent="builder")
    entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
    entry.submit_quietly()
    entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id="payments-key", credential_version="v1")
    entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
    await entry.commit()
    entry.append(EventKind.REQUEST_SENT)
    entry.append(EventKind.REMOTE_RESPONSE_COMPLETE, status=201, framing="content-length")
    entry.append(EventKind.RESULT_COMMITTED)
    await entry.commit()
    entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
    await entry.commit()


async def write_journal(url: str) -> None:
    """Two writers (two broker processes) writing at the same time, each on its own chain."""
    engine = make_engine(url)
    journals = [Journal(engine, writer=name) for name in WRITERS]
    for journal in journals:
        await journal.start()
    await asyncio.gather(*(history(j, j.writer) for j in journals for _ in range(INVOCATIONS_PER_WRITER)))
    for journal in journals:
        await journal.close()
    await engine.dispose()


@pytest.fixture(params=DIALECTS)
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    url = database_url(request.param, tmp_path, request, migrated=True)
    asyncio.run(write_journal(url))
    return url


def chain(url: str, writer: str = "w1") -> list[tuple[int, str, int, str]]:
    """(writer_seq, invocation_id, seq, hash) of one writer, read independently of proxy.audit."""
    rows = query(url, f"SELECT writer_seq, invocation_id, seq, hash FROM events WHERE writer = '{writer}' ORDER BY writer_seq")
    return [(int(ws), inv, int(seq), h) for ws, inv, seq, h in rows]


def middle(url: str) -> tuple[int, str, int, str]:
    """A row in the middle of w1's chain whose invocation has events before and after it."""
    rows = chain(url)
    return next(r for r in rows[3:-3] if 2 <= r[2] <= EVENTS_PER_INVOCATION - 1)


def dialect(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"


def blob(url: str, data: bytes) -> str:
    return f"X'{data.hex()}'" if dialect(url) == "sqlite" else f"decode('{data.hex()}', 'hex')"


def tamper(url: str, *statements: str, tables: tuple[str, ...] = ("events",)) -> None:
    """Run ``statements`` past the append-only triggers, as an attacker with DDL rights would."""
    if dialect(url) == "sqlite":
        conn = sqlite3.connect(make_url(url).database, isolation_level=None)
        try:
            for table in tables:
                for verb in ("update", "delete"):
                    conn.execute(f"DROP TRIGGER IF EXISTS {table}_no_{verb}")
            conn.execute("BEGIN")
            for statement in statements:
                conn.execute(statement)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return

    async def run() -> None:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                for table in tables:
                    await conn.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER USER")
                for statement in statements:
                    await conn.exec_driver_sql(statement)
                for table in tables:
                    await conn.exec_driver_sql(f"ALTER TABLE {table} ENABLE TRIGGER USER")
        finally:
            await engine.dispose()

    asyncio.run(run())


def run_async(url: str, work):
    return asyncio.run(on_engine(url, work))


def add_checkpoint(url: str, writer: str, writer_seq: int, hash: str) -> None:
    """What the journal writer does every few hundred events, through the normal connection."""

    async def work(engine):
        async with engine.begin() as conn:
            c = chain_checkpoints.c
            existing = (await conn.execute(
                select(c.hash).where(c.writer == writer, c.writer_seq == writer_seq))).scalar()
            if existing is not None:  # the writer recorded this very checkpoint itself (at close)
                assert existing == hash
                return
            await conn.execute(insert(chain_checkpoints).values(checkpoint_row(writer, writer_seq, hash, datetime.now(UTC))))

    run_async(url, work)


def assert_first_break(result: audit.AuditResult, kind: Damage, writer: str | None, writer_seq: int | None, invocation_id: str | None, seq: int | None) -> Break:
    assert not result.ok, "the damage went unnoticed"
    first = result.first
    assert first is not None
    assert (first.kind, first.writer, first.writer_seq, first.invocation_id, first.seq) == (kind, writer, writer_seq, invocation_id, seq), first.describe()
    return first


# -- intact ----------------------------------------------------------------------------------------


def test_an_intact_journal_verifies_with_every_row_counted(journal):
    rows = chain(journal, "w1")
    add_checkpoint(journal, "w1", rows[-1][0], rows[-1][3])
    add_checkpoint(journal, "w2", 10, chain(journal, "w2")[9][3])
    result = audit.verify_database(journal)
    assert result.ok, [b.describe() for b in result.breaks]
    total = len(WRITERS) * INVOCATIONS_PER_WRITER * EVENTS_PER_INVOCATION
    stored_marks = int(query(journal, "SELECT count(*) FROM chain_checkpoints")[0][0])  # the writer's own, too
    assert stored_marks >= 2
    assert (result.events, result.writers, result.invocations, result.checkpoints) == (
        total, len(WRITERS), len(WRITERS) * INVOCATIONS_PER_WRITER, stored_marks,
    )
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))


# -- each damage kind, named at its first broken position -----------------------------------------------


def test_a_modified_payload_is_found_at_its_position(journal):
    ws, inv, seq, _ = middle(journal)
    forged = blob(journal, b'{"status":500}')
    tamper(journal, f"UPDATE events SET payload = {forged} WHERE writer = 'w1' AND writer_seq = {ws}")
    first = assert_first_break(audit.verify_database(journal), Damage.MODIFIED, "w1", ws, inv, seq)
    assert "content" in first.detail


def test_a_payload_rewritten_as_text_that_is_not_utf8_is_a_break_not_an_unreadable_journal(journal):
    """SQLite lets a forger store the payload as TEXT that is not UTF-8 (``x'ff' || payload``):
    reading it as text fails. That is damage at a position (exit 1), not a journal that could not
    be read (exit 2, which a script may take for "try again later")."""
    ws, inv, seq, _ = middle(journal)
    forged = ("CAST(x'ff' || payload AS TEXT)" if dialect(journal) == "sqlite" else "'\\xff'::bytea || payload")
    tamper(journal, f"UPDATE events SET payload = {forged} WHERE writer = 'w1' AND writer_seq = {ws}")
    assert_first_break(audit.verify_database(journal), Damage.MODIFIED, "w1", ws, inv, seq)


def test_a_modified_kind_is_found_at_its_position(journal):
    ws, inv, seq, _ = middle(journal)
    tamper(journal, f"UPDATE events SET kind = 'RECONCILED' WHERE writer = 'w1' AND writer_seq = {ws}")
    assert_first_break(audit.verify_database(journal), Damage.MODIFIED, "w1", ws, inv, seq)


def test_a_row_whose_writer_was_changed_is_named_so_in_both_chains(journal):
    """It once read as 'writer_seq 1 to 24 missing' on the writer it was moved to, and as a
    deleted row in its own chain. (Another broker's name at a position that broker holds is
    refused by the journal's unique (writer, writer_seq).)"""
    to = "forged"
    ws, inv, seq, _ = middle(journal)
    tamper(journal, f"UPDATE events SET writer = '{to}' WHERE writer = 'w1' AND writer_seq = {ws}")
    result = audit.verify_database(journal)
    said = {(b.kind, b.writer, b.writer_seq, b.invocation_id, b.seq): b.detail for b in result.breaks if b.writer is not None}
    assert said.get((Damage.MODIFIED, "w1", ws, inv, seq), "").startswith(f"the row written here is stored under writer {to} "), said
    assert said.get((Damage.MODIFIED, to, ws, inv, seq), "").startswith(f"this row was written by writer w1 (as its writer_seq {ws}) and now says writer {to}"), said
    assert len(said) == 2, said


def test_a_deleted_middle_row_is_found_and_its_invocation_named(journal):
    ws, inv, seq, _ = middle(journal)
    tamper(journal, f"DELETE FROM events WHERE writer = 'w1' AND writer_seq = {ws}")
    result = audit.verify_database(journal)
    assert_first_break(result, Damage.DELETED, "w1", ws, inv, seq)
    # The invocation's own seq shows the gap too, independently of the chain.
    assert Break(Damage.DELETED, None, None, inv, seq, "the invocation's events skip this seq: an event was removed") in result.breaks


def test_a_deleted_tail_row_is_caught_by_a_checkpoint(journal):
    rows = chain(journal)
    last_ws, _, _, last_hash = rows[-1]
    add_checkpoint(journal, "w1", last_ws, last_hash)
    tamper(journal, f"DELETE FROM events WHERE writer = 'w1' AND writer_seq = {last_ws}")
    stored, marks = asyncio.run(audit.load_database(journal))
    assert audit.verify(stored, []).ok, "control: without the checkpoint a cut tail leaves no trace"
    first = assert_first_break(audit.verify(stored, marks), Damage.DELETED, "w1", last_ws, None, None)
    assert f"reached writer_seq {last_ws}" in first.detail
    assert "at least its last 1 event(s) were removed" in first.detail, "only what the checkpoint proves"


def test_a_cut_tail_is_measured_from_the_newest_checkpoint(journal):
    """Several checkpoints past the cut: the loss is at least what the newest one proves."""
    rows = chain(journal)
    for ws, _, _, h in (rows[4], rows[9], rows[-1]):
        add_checkpoint(journal, "w1", ws, h)
    tamper(journal, f"DELETE FROM events WHERE writer = 'w1' AND writer_seq > {rows[2][0]}")
    first = assert_first_break(audit.verify_database(journal), Damage.DELETED, "w1", rows[2][0] + 1, None, None)
    assert f"reached writer_seq {rows[-1][0]}, but it ends at {rows[2][0]}" in first.detail, first.detail


def test_every_event_and_checkpoint_removed_while_invocations_remain_is_a_break(journal):
    """Emptying events and chain_checkpoints leaves chains with nothing to check; but every
    invocation's record starts with an event, so invocations without any are proof of removal."""
    tamper(journal, "DELETE FROM events", "DELETE FROM chain_checkpoints", tables=("events", "chain_checkpoints"))
    result = audit.verify_database(journal)
    assert not result.ok and result.first.kind is Damage.DELETED, result
    assert "invocation record(s) (" in result.first.detail and "have no events at all" in result.first.detail
    tamper(journal, "DELETE FROM invocations", tables=())  # a journal truly empty: nothing to say
    assert audit.verify_database(journal).ok


def test_a_whole_chain_deleted_with_its_checkpoints_is_found_by_the_records_it_leaves_without_events(journal):
    """One broker's chain and checkpoints gone whole: the chains that are left verify, and its
    invocations' rows stay, with no event; every record starts with one, so that is a removal."""
    w2 = sorted({inv for _, inv, _, _ in chain(journal, "w2")})
    tamper(journal, "DELETE FROM events WHERE writer = 'w2'", "DELETE FROM chain_checkpoints WHERE writer = 'w2'",
           tables=("events", "chain_checkpoints"))
    first = assert_first_break(audit.verify_database(journal), Damage.DELETED, None, None, w2[0], None)
    assert first.detail.startswith(f"{len(w2)} invocation record(s) ({', '.join(w2)}) have no events at all"), first.detail


def test_an_invocation_record_deleted_while_its_events_remain_is_found(journal):
    """A probe deleted one `unknown` invocation's row: `invocations show` then said there was no
    such invocation, it left the reconciliation queue, and verify said intact."""
    _, inv, _, _ = middle(journal)
    tamper(journal, f"DELETE FROM invocations WHERE invocation_id = '{inv}'", tables=("invocations",))
    first = assert_first_break(audit.verify_database(journal), Damage.DELETED, None, None, inv, None)
    assert first.detail.startswith(f"1 invocation(s) ({inv}) have events in the chain but no record row"), first.detail


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_stored_result_replaced_after_it_was_recorded_is_found(make_broker, upstream, dialect):
    """RESULT_COMMITTED chains the stored body's SHA-256; a body changed in `results` (in the
    clear, without [crypto] keys) was served as the upstream's answer and verified intact."""
    broker = make_broker(dialect)
    with broker.client() as client:
        ids = [client.post("https://api.payments.test/h/status?code=201", content=b"{}").headers["affidavit-invocation-id"]
               for _ in range(2)]
    assert broker.stop() == 0
    assert audit.verify_database(broker.database_url).ok
    forged = "CAST('{\"forged\":true}' AS BLOB)" if dialect == "sqlite" else "convert_to('{\"forged\":true}', 'UTF8')"
    tamper(broker.database_url, f"UPDATE results SET body = {forged} WHERE invocation_id = '{ids[1]}'", tables=("results",))
    result = audit.verify_database(broker.database_url)
    first = assert_first_break(result, Damage.MODIFIED, None, None, ids[1], None)
    assert first.detail.startswith(f"1 stored result(s) ({ids[1]}) hold a body whose SHA-256 is not"), first.detail


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_record_edited_to_an_outcome_its_events_cannot_give_is_found(make_broker, upstream, dialect):
    """An operator-CLI probe set an `unknown` invocation's row to `committed`: it left the
    reconciliation queue (`invocations list --outcome unknown`, the metrics) and verify said
    intact. An outcome comes from evidence only, so its events' kinds show the edit, keylessly."""
    broker = make_broker(dialect)
    with broker.client() as client:
        done = client.post("https://api.payments.test/h/status?code=201", content=b"{}").headers["affidavit-invocation-id"]
        lost = client.post("https://api.payments.test/h/close_after_effect", content=b"{}")
        refused = client.get("https://nowhere.example.test/")
    lost_id, refused_id = lost.headers["affidavit-invocation-id"], refused.headers["affidavit-invocation-id"]
    assert (lost.headers["affidavit-outcome"], refused.headers["affidavit-outcome"]) == ("unknown", "not_attempted")
    assert broker.stop() == 0
    assert audit.verify_database(broker.database_url).ok, "a broker's own records, untouched, are consistent"
    tamper(broker.database_url, f"UPDATE invocations SET outcome = 'committed' WHERE invocation_id = '{lost_id}'",
           tables=("invocations",))
    first = assert_first_break(audit.verify_database(broker.database_url), Damage.MODIFIED, None, None, lost_id, None)
    assert first.detail.startswith(f"1 invocation record(s) ({lost_id}) hold an outcome their events cannot have"), first
    tamper(broker.database_url, f"UPDATE invocations SET outcome = 'unknown' WHERE invocation_id = '{lost_id}'",
           f"UPDATE invocations SET outcome = 'unknown' WHERE invocation_id = '{refused_id}'",
           f"UPDATE invocations SET outcome = 'not_attempted' WHERE invocation_id = '{done}'", tables=("invocations",))
    edited = sorted([refused_id, done])
    first = assert_first_break(audit.verify_database(broker.database_url), Damage.MODIFIED, None, None, edited[0], None)
    assert first.detail.startswith(f"2 invocation record(s) ({', '.join(edited)}) hold an outcome"), first
    said = subprocess.run([AFFIDAVIT, "audit", "verify", "--database", broker.database_url], capture_output=True,
                          text=True, timeout=60).stderr
    assert f"invocation {edited[0]}: modified: 2 invocation record(s)" in said and "seq None" not in said, said
    assert "The rows named above were altered" in said and "In a broken chain" not in said, said

    # An event edited, its row not: the chain's break, not "the record row was edited" besides.
    tamper(broker.database_url, f"UPDATE invocations SET outcome = 'not_attempted' WHERE invocation_id = '{refused_id}'",
           f"UPDATE invocations SET outcome = 'committed' WHERE invocation_id = '{done}'", tables=("invocations",))
    assert audit.verify_database(broker.database_url).ok
    tamper(broker.database_url, f"UPDATE events SET kind = 'REMOTE_RESPONSE_STARTED' WHERE invocation_id = '{done}' "
           "AND kind = 'REMOTE_RESPONSE_COMPLETE'")
    result = audit.verify_database(broker.database_url)
    assert [b.kind for b in result.breaks] == [Damage.MODIFIED] and result.breaks[0].writer is not None, result.breaks
    assert result.breaks[0].invocation_id == done and "hold an outcome" not in result.breaks[0].detail, result.breaks


def test_an_auditor_granted_only_the_chains_tables_verifies_them_and_is_told_what_was_not_checked(make_broker, upstream):
    """docs/audit.md's auditor role (SELECT on events and chain_checkpoints): verify read the
    invocations and results tables too, and failed on the first with "permission denied"."""
    broker = make_broker("postgresql")
    with broker.client() as client:
        assert client.get("https://api.payments.test/h/ok").status_code == 200
    assert broker.stop() == 0
    role = f"auditor_{os.getpid()}_{time.monotonic_ns()}"
    database = make_url(broker.database_url).database
    admin = "postgresql://postgres@127.0.0.1:5432/" + database
    subprocess.run(["psql", admin, "-qc", f"CREATE ROLE {role} LOGIN; GRANT SELECT ON events, chain_checkpoints TO {role};"],
                   check=True, capture_output=True, timeout=60)
    try:
        as_auditor = make_url(broker.database_url).set(username=role).render_as_string(hide_password=False)
        done = subprocess.run([AFFIDAVIT, "audit", "verify", "--database", as_auditor], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and "audit chain intact" in done.stdout, done.stdout + done.stderr
        assert "warning: this database role may not read invocations, results, so what is checked against them was " \
               "not" in done.stderr, done.stderr
    finally:
        subprocess.run(["psql", admin, "-qc", f"REVOKE ALL ON events, chain_checkpoints FROM {role}; DROP ROLE {role};"],
                       capture_output=True, timeout=60)


def test_a_forged_row_inserted_with_a_correct_hash_is_found(journal):
    """The careful attacker: a well-formed row linked in at position k, later rows moved up by one."""
    ws, _, _, _ = middle(journal)
    rows = chain(journal)
    forged = {
        "invocation_id": "act_forged",
        "seq": 1,
        "kind": "RECONCILED",
        "at": datetime.now(UTC),
        "writer": "w1",
        "writer_seq": ws,
        "prev_hash": rows[ws - 2][3],
        "key_id": None,
        "payload": b'{"source":"forged"}',
    }
    forged["hash"] = chain_hash(forged)
    tamper(
        journal,
        f"UPDATE events SET writer_seq = writer_seq + 1000000 WHERE writer = 'w1' AND writer_seq >= {ws}",
        "UPDATE events SET writer_seq = writer_seq - 999999 WHERE writer = 'w1' AND writer_seq >= 1000000",
    )

    async def work(engine):
        async with engine.begin() as conn:
            await conn.execute(insert(events).values(forged))

    run_async(journal, work)
    first = assert_first_break(audit.verify_database(journal), Damage.INSERTED, "w1", ws, "act_forged", 1)
    assert f"stored at writer_seq {ws + 1}" in first.detail


def test_a_row_inserted_at_a_taken_position_is_found(journal):
    """A fabricated event for an existing invocation, squeezed in beside a real row."""
    ws, inv, _, _ = middle(journal)
    rows = chain(journal)
    last_seq = max(int(s) for (s,) in query(journal, f"SELECT seq FROM events WHERE invocation_id = '{inv}'"))
    at = "2026-01-01 00:00:00.000000" + ("" if dialect(journal) == "sqlite" else "+00")
    tamper(
        journal,
        "DROP INDEX uq_events_writer_seq",
        "INSERT INTO events (invocation_id, seq, kind, at, writer, writer_seq, prev_hash, hash, key_id, payload) "
        f"VALUES ('{inv}', {last_seq + 1}, 'RECONCILED', '{at}', 'w1', {ws}, '{rows[ws - 2][3]}', '{'f' * 64}', NULL, "
        f"{blob(journal, b'[]')})",
    )
    assert_first_break(audit.verify_database(journal), Damage.INSERTED, "w1", ws, inv, last_seq + 1)


def test_two_swapped_rows_are_reported_as_reordered(journal):
    ws, _, _, _ = middle(journal)
    rows = chain(journal)
    _, next_inv, next_seq, _ = rows[ws]  # the row written at ws + 1
    tamper(
        journal,
        f"UPDATE events SET writer_seq = -1 WHERE writer = 'w1' AND writer_seq = {ws}",
        f"UPDATE events SET writer_seq = {ws} WHERE writer = 'w1' AND writer_seq = {ws + 1}",
        f"UPDATE events SET writer_seq = {ws + 1} WHERE writer = 'w1' AND writer_seq = -1",
    )
    first = assert_first_break(audit.verify_database(journal), Damage.REORDERED, "w1", ws, next_inv, next_seq)
    assert f"written at writer_seq {ws + 1}" in first.detail


def test_two_events_of_one_invocation_swapped_are_reported_as_reordered(journal):
    ws, inv, seq, _ = middle(journal)
    later = next(r for r in chain(journal) if r[1] == inv and r[2] == seq + 1)
    assert later[0] > ws
    tamper(
        journal,
        f"UPDATE events SET seq = 1000 WHERE invocation_id = '{inv}' AND seq = {seq}",
        f"UPDATE events SET seq = {seq} WHERE invocation_id = '{inv}' AND seq = {seq + 1}",
        f"UPDATE events SET seq = {seq + 1} WHERE invocation_id = '{inv}' AND seq = 1000",
    )
    # The row at ws now claims seq + 1; it was written as seq.
    first = assert_first_break(audit.verify_database(journal), Damage.REORDERED, "w1", ws, inv, seq + 1)
    assert f"written as seq {seq}" in first.detail


def test_a_chain_rewritten_with_recomputed_hashes_is_caught_only_by_an_earlier_export(journal, tmp_path):
    """No key protects the chain: a full re-hash passes the live check; an export kept elsewhere does not."""
    rows = chain(journal)
    add_checkpoint(journal, "w1", rows[-1][0], rows[-1][3])
    earlier = tmp_path / "earlier.jsonl"
    audit.export_events(journal, earlier)
    ws, inv, seq, _ = middle(journal)

    async def rewritten(engine):
        async with engine.connect() as conn:
            stored = (await conn.execute(select(events).where(events.c.writer == "w1").order_by(events.c.writer_seq))).mappings().all()
        out, prev = [], GENESIS
        for row in map(dict, stored):
            if row["writer_seq"] == ws:
                row["payload"] = b'{"status":500}'
            if row["writer_seq"] >= ws:
                row["prev_hash"] = prev
                row["hash"] = chain_hash(row)
            prev = row["hash"]
            out.append(row)
        return [r for r in out if r["writer_seq"] >= ws]

    forged = run_async(journal, rewritten)
    tamper(
        journal,
        *(f"UPDATE events SET payload = {blob(journal, r['payload'])}, prev_hash = '{r['prev_hash']}', hash = '{r['hash']}' "
          f"WHERE writer = 'w1' AND writer_seq = {r['writer_seq']}" for r in forged),
        "DELETE FROM chain_checkpoints",
        tables=("events", "chain_checkpoints"),
    )
    assert audit.verify_database(journal).ok, "control: a consistent re-hash is invisible without outside evidence"
    extra = audit.read_dump(earlier)[1]
    again = audit.verify_dump(earlier, extra)
    assert again.ok and again.checkpoints == len(extra), "an export checked against itself counts each checkpoint once"
    # The first checkpoint at or after the re-hashed row is where the rewrite shows.
    at = min(m["writer_seq"] for m in extra if m["writer"] == "w1" and m["writer_seq"] >= ws)
    _, at_inv, at_seq, _ = rows[at - 1]
    first = assert_first_break(audit.verify_database(journal, extra), Damage.REWRITTEN, "w1", at, at_inv, at_seq)
    assert "re-hashed" in first.detail


# -- dumps, keys and the command line ----------------------------------------------------------------------


def test_an_earlier_export_held_only_for_its_checkpoints_is_read_in_small_memory(journal, tmp_path):
    """`verify --checkpoints EXPORT` needs the export's checkpoints, not its events: reading it
    whole (as `read_dump` does) took ~1.5 KB per event, gigabytes for a large journal's export."""
    import tracemalloc

    export = tmp_path / "earlier.jsonl"
    events, checkpoints = audit.export_events(journal, export)
    *lines, end = export.read_text().splitlines()
    event = json.loads(next(line for line in lines if '"type": "event"' in line))
    event["payload"] = "A" * 800  # a payload of realistic size, base64
    with export.open("w") as out:  # many more events, before the checkpoints that follow them
        out.write("\n".join(lines) + "\n")
        for n in range(40_000):
            out.write(json.dumps({**event, "writer": "bulk", "writer_seq": n + 1, "seq": n + 1}) + "\n")
        out.write(next(line for line in lines if '"type": "checkpoint"' in line) + "\n")
        out.write(json.dumps({**json.loads(end), "events": events + 40_000, "checkpoints": checkpoints + 1}) + "\n")
    expected = audit.read_dump(export)[1]
    assert expected, "the export holds checkpoints"
    tracemalloc.start()
    try:
        marks = audit.read_checkpoints(export)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert marks == expected
    assert peak < 4 * 2**20, f"reading the checkpoints peaked at {peak / 2**20:.1f} MiB"
    with export.open("a") as out:
        out.write('{"type": "event", "seq": "one"}\n')  # events are still checked to be export lines
    with pytest.raises(audit.AuditInputError, match=r"earlier.jsonl:\d+: not a line of an audit export"):
        audit.read_checkpoints(export)


def test_verify_works_on_an_export_and_finds_the_same_break(journal, tmp_path):
    clean = tmp_path / "clean.jsonl"
    assert audit.export_events(journal, clean)[0] == len(WRITERS) * INVOCATIONS_PER_WRITER * EVENTS_PER_INVOCATION
    assert oct(clean.stat().st_mode & 0o777) == "0o600"
    assert audit.verify_dump(clean).ok
    ws, inv, seq, _ = middle(journal)
    tamper(journal, f"UPDATE events SET kind = 'FAILED' WHERE writer = 'w1' AND writer_seq = {ws}")
    broken = tmp_path / "broken.jsonl"
    audit.export_events(journal, broken)
    assert_first_break(audit.verify_dump(broken), Damage.MODIFIED, "w1", ws, inv, seq)
    # Editing the dump itself is caught the same way; its line order is not evidence.
    lines = clean.read_text().splitlines()
    edited = [lines[0], *reversed(lines[1:])]
    target = next(i for i, line in enumerate(edited) if json.loads(line).get("writer") == "w1" and json.loads(line)["writer_seq"] == ws)
    edited[target] = json.dumps({**json.loads(edited[target]), "kind": "RECONCILED"})
    (tmp_path / "edited.jsonl").write_text("\n".join(edited) + "\n")
    assert_first_break(audit.verify_dump(tmp_path / "edited.jsonl"), Damage.MODIFIED, "w1", ws, inv, seq)


def test_an_export_cut_short_or_missing_lines_is_refused_not_verified_as_intact(journal, tmp_path):
    """An export that lost its tail at a line boundary (a copy interrupted, a disk full) used to
    verify as intact: every event left still chains, and the cut took the checkpoints with it.
    Its end line counts what a whole export holds, so the cut is seen, by `--dump` and by
    `--checkpoints` alike. A format-1 export, which has no end line, still verifies, with a warning."""
    from proxy.cli_security import audit_app

    whole = tmp_path / "whole.jsonl"
    events, checkpoints = audit.export_events(journal, whole)
    lines = whole.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1]) == {"type": "affidavit-audit-export-end", "events": events, "checkpoints": checkpoints}
    assert checkpoints and audit.verify_dump(whole).ok
    first_mark = next(i for i, line in enumerate(lines) if '"type": "checkpoint"' in line)
    cuts = {
        "in the events": lines[: first_mark - 5],
        "before the end line": lines[:-1],
        "a middle event removed": lines[:3] + lines[4:],
        "a checkpoint removed": lines[:first_mark] + lines[first_mark + 1:],
    }
    for name, kept in cuts.items():
        cut = tmp_path / "cut.jsonl"
        cut.write_text("".join(kept))
        said = "cut short" if name in ("in the events", "before the end line") else "incomplete or was edited"
        with pytest.raises(audit.AuditInputError, match=said):
            audit.verify_dump(cut)
        with pytest.raises(audit.AuditInputError, match=said):
            audit.read_checkpoints(cut)
        for command in (["verify", "--dump", str(cut)], ["verify", "--database", journal, "--checkpoints", str(cut)]):
            result = CliRunner().invoke(audit_app, command)
            assert result.exit_code == 2 and said in result.output and "intact" not in result.output, (name, result.output)
            assert "Nothing was verified" in result.output
    mid_line = tmp_path / "mid-line.jsonl"
    mid_line.write_text("".join(lines[:6]) + lines[6][: len(lines[6]) // 2])
    with pytest.raises(audit.AuditInputError, match="ends in the middle of a line, so it was cut short"):
        audit.verify_dump(mid_line)
    headless = tmp_path / "headless.jsonl"
    headless.write_text("".join(lines[1:]))
    with pytest.raises(audit.AuditInputError, match="it has no header line"):
        audit.verify_dump(headless)
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(lines + lines[-1:]))
    with pytest.raises(audit.AuditInputError, match="a second end line"):
        audit.verify_dump(twice)
    newer = tmp_path / "newer.jsonl"
    newer.write_text("".join([json.dumps({**json.loads(lines[0]), "format": 3}) + "\n", *lines[1:]]))
    with pytest.raises(audit.AuditInputError, match="format 3, which this version does not know"):
        audit.verify_dump(newer)

    older = tmp_path / "older.jsonl"  # as exports were written before the end line
    older.write_text("".join([json.dumps({**json.loads(lines[0]), "format": 1}) + "\n", *lines[1:-1]]))
    assert audit.verify_dump(older).ok
    for command in (["verify", "--dump", str(older)], ["verify", "--database", journal, "--checkpoints", str(older)]):
        result = CliRunner().invoke(audit_app, command)
        assert result.exit_code == 0 and "intact" in result.output, result.output
        assert f"{older} has no end line" in result.output and "missing unseen" in result.output
    plain = CliRunner().invoke(audit_app, ["verify", "--dump", str(whole), "--checkpoints", str(whole)])
    assert plain.exit_code == 0 and "no end line" not in plain.output, plain.output


async def write_encrypted(url: str, ring: KeyRing) -> None:
    """Encrypted payloads through the real writer (each invocation's record row with its first
    events, as the broker writes them): the chain covers the ciphertext."""
    engine = make_engine(url)
    journal = Journal(engine, writer="enc", ring=ring)
    await journal.start()
    for _ in range(3):
        entry = InvocationLog(journal, identity(), "enc")
        entry.append(EventKind.ACTION_ACCEPTED, agent="audit-plaintext-canary")
        await entry.commit()
        entry.append(EventKind.PREFLIGHT_VALIDATED, route="audit-plaintext-canary")
        await entry.commit()
        entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id="audit-plaintext-canary", credential_version="v1")
        await entry.commit()
    await journal.close()
    await engine.dispose()


def config_without_keys(workdir: Path, url: str) -> Path:
    path = workdir / "affidavit.toml"
    path.write_text(tomli_w.dumps({"database": {"url": url}}))
    return path


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``affidavit audit ...`` as a real process, with no key anywhere in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    return subprocess.run(
        [sys.executable, "-c", "from proxy.cli_security import audit_app; audit_app(prog_name='affidavit')", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=60,
    )


def test_the_cli_verifies_ciphertext_without_any_key_and_names_the_break(journal, tmp_path):
    ring = KeyRing([("k1", os.urandom(32))])
    asyncio.run(write_encrypted(journal, ring))
    stored = query(journal, "SELECT key_id, payload FROM events WHERE writer = 'enc'")
    assert len(stored) == 9 and all(k == "k1" and "audit-plaintext-canary" not in str(p) and b"audit-plaintext-canary" not in (p if isinstance(p, bytes) else b"") for k, p in stored), stored
    config = config_without_keys(tmp_path, journal)

    intact = run_cli("verify", "-c", str(config), cwd=tmp_path)
    assert intact.returncode == 0, intact.stderr
    assert "intact" in intact.stdout and "without any key" in intact.stdout

    dump = tmp_path / "export.jsonl"
    exported = run_cli("export", "--out", str(dump), "-c", str(config), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "audit-plaintext-canary" not in dump.read_text()
    from_dump = run_cli("verify", "--dump", str(dump), cwd=tmp_path)
    assert from_dump.returncode == 0, from_dump.stderr

    enc = chain(journal, "enc")
    ws, inv, seq, _ = enc[4]
    tamper(journal, f"UPDATE events SET payload = {blob(journal, b'x' * 60)} WHERE writer = 'enc' AND writer_seq = {ws}")
    broken = run_cli("verify", "--database", journal, cwd=tmp_path)
    assert broken.returncode == 1
    assert f"writer enc writer_seq {ws}, invocation {inv} seq {seq}: modified" in broken.stderr

    from proxy.cli_security import audit_app

    result = CliRunner().invoke(audit_app, ["verify", "-c", str(config)])
    assert result.exit_code == 1 and f"writer enc writer_seq {ws}" in result.output
    both = CliRunner().invoke(audit_app, ["verify", "--database", journal, "--dump", str(dump)])
    assert both.exit_code == 2


def test_verify_warns_when_a_newer_version_made_the_journals_schema(journal, tmp_path):
    """A newer release may store events in a form this one does not know: its verdict then says
    so, rather than passing or failing the chain in silence."""
    known = run_cli("verify", "--database", journal, cwd=tmp_path)
    assert known.returncode == 0 and "warning" not in known.stderr, known.stderr
    tamper(journal, "UPDATE alembic_version SET version_num = 'f00dfeed0099'", tables=())
    newer = run_cli("verify", "--database", journal, cwd=tmp_path)
    assert newer.returncode == 0, newer.stderr
    assert "intact" in newer.stdout
    assert "schema revision f00dfeed0099, which a newer affidavit made" in newer.stderr, newer.stderr


# -- append-only for the new tables -------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["vault_secrets", "chain_checkpoints"])
@pytest.mark.parametrize("verb", ["UPDATE", "DELETE"])
def test_vault_and_checkpoints_refuse_update_and_delete(journal, table, verb):
    async def work(engine):
        async with engine.begin() as conn:
            if table == "vault_secrets":
                await conn.execute(insert(vault_secrets).values(name="payments-key", version=1, key_id="k1", ciphertext=b"\x00" * 40, created_at=datetime.now(UTC)))
            else:
                await conn.execute(insert(chain_checkpoints).values(checkpoint_row("tester", 3, "a" * 64, datetime.now(UTC))))
        target = vault_secrets if table == "vault_secrets" else chain_checkpoints
        mine = target.c.name == "payments-key" if table == "vault_secrets" else target.c.writer == "tester"
        statement = (
            update(target).values(key_id="k2") if table == "vault_secrets" else update(target).values(hash="b" * 64)
        ).where(mine) if verb == "UPDATE" else target.delete().where(mine)
        refused = False
        try:
            async with engine.begin() as conn:
                await conn.execute(statement)
        except Exception as exc:  # the trigger's error, whatever the driver calls it
            refused = "append-only" in str(exc)
        async with engine.connect() as conn:
            rows = (await conn.execute(select(target).where(mine))).all()
        return refused, rows

    refused, rows = run_async(journal, work)
    assert refused
    assert len(rows) == 1
    assert ("k1" in rows[0]) if table == "vault_secrets" else ("a" * 64 in rows[0])


# -- the rules on synthetic chains (pure: no database) ----------------------------------------------------


def synthetic(writer: str = "w1", length: int = 12, invocations: int = 3) -> list[dict]:
    """A well-formed chain: ``invocations`` invocations interleaved round-robin."""
    rows, prev, seqs = [], GENESIS, [0] * invocations
    for ws in range(1, length + 1):
        i = (ws - 1) % invocations
        seqs[i] += 1
        row = {
            "invocation_id": f"act_{i}", "seq": seqs[i], "kind": "REQUEST_SENT",
            "at": datetime(2026, 11, 30, 12, 0, ws, tzinfo=UTC), "writer": writer, "writer_seq": ws,
            "prev_hash": prev, "key_id": "k1", "payload": os.urandom(24),
        }
        row["hash"] = prev = chain_hash(row)
        rows.append(row)
    return rows


def rehash_from(rows: list[dict], start: int) -> None:
    """What an attacker without a key can do: recompute every hash from position ``start`` on."""
    prev = rows[start - 2]["hash"] if start > 1 else GENESIS
    for row in rows[start - 1:]:
        row["prev_hash"] = prev
        row["hash"] = prev = chain_hash(row)


def test_pure_an_intact_synthetic_chain_verifies():
    assert audit.verify(synthetic()).ok


def test_pure_deleted_rows_renumbered_to_close_the_gap_are_still_deleted():
    rows = synthetic()
    gone = rows.pop(4)  # writer_seq 5
    for row in rows[4:]:
        row["writer_seq"] -= 1
    first = assert_first_break(audit.verify(rows), Damage.DELETED, "w1", 5, gone["invocation_id"], gone["seq"])
    assert "renumbered" in first.detail


def test_pure_a_row_replaced_with_a_recomputed_hash_is_modified_at_its_own_position():
    rows = synthetic()
    rows[5]["payload"] = b"forged"
    rows[5]["hash"] = chain_hash(rows[5])  # intact by itself; the next row still points at the original
    assert_first_break(audit.verify(rows), Damage.MODIFIED, "w1", 6, rows[5]["invocation_id"], rows[5]["seq"])


def test_pure_a_row_moved_to_another_writer_at_the_start_of_a_chain_is_named():
    rows = synthetic("w1")
    rows[0]["writer"] = "w9"
    result = audit.verify(rows)
    assert [(b.kind, b.writer, b.writer_seq) for b in result.breaks] == [(Damage.MODIFIED, "w1", 1), (Damage.MODIFIED, "w9", 1)]


def test_pure_a_writer_deleted_entirely_is_found_through_its_checkpoint():
    rows = synthetic("w1") + synthetic("w2")
    mark = {"writer": "w2", "writer_seq": 12, "hash": rows[-1]["hash"]}
    survivors = [r for r in rows if r["writer"] == "w1"]
    assert audit.verify(survivors).ok
    assert_first_break(audit.verify(survivors, [mark]), Damage.DELETED, "w2", 1, None, None)


def test_pure_a_checkpoint_hash_that_disagrees_is_a_rewrite_even_when_the_chain_links():
    rows = synthetic()
    mark = {"writer": "w1", "writer_seq": 8, "hash": rows[7]["hash"]}
    rows[2]["payload"] = b"forged"
    rehash_from(rows, 3)
    assert audit.verify(rows).ok
    assert_first_break(audit.verify(rows, [mark]), Damage.REWRITTEN, "w1", 8, rows[7]["invocation_id"], rows[7]["seq"])


@pytest.mark.parametrize("position", [1, 2, 6, 11])
def test_pure_each_single_row_damage_is_named_at_its_position(position):
    """Every kind at several positions, including the first row and the next to last."""
    base = synthetic()
    cases: dict[Damage, list[dict]] = {}

    modified = [dict(r) for r in base]
    modified[position - 1]["kind"] = "RECONCILED"
    cases[Damage.MODIFIED] = modified

    deleted = [dict(r) for r in base if r["writer_seq"] != position]
    cases[Damage.DELETED] = deleted

    swapped = [dict(r) for r in base]
    swapped[position - 1]["writer_seq"], swapped[position]["writer_seq"] = position + 1, position
    cases[Damage.REORDERED] = swapped

    extra = dict(base[position - 1], payload=b"forged", invocation_id="act_forged", seq=1)
    cases[Damage.INSERTED] = [dict(r) for r in base] + [extra]

    for kind, rows in cases.items():
        result = audit.verify(rows)
        assert not result.ok and result.first is not None, kind
        assert (result.first.kind, result.first.writer, result.first.writer_seq) == (kind, "w1", position), (kind, result.first.describe())


def test_a_file_that_is_not_an_export_is_an_input_error_not_a_verdict(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "event", "writer": "w1"}\n')
    with pytest.raises(audit.AuditInputError, match="bad.jsonl:1"):
        audit.verify_dump(bad)
    from proxy.cli_security import audit_app

    result = CliRunner().invoke(audit_app, ["verify", "--dump", str(bad)])
    assert result.exit_code == 2 and "not a line of an audit export" in result.output
    missing = CliRunner().invoke(audit_app, ["verify", "--database", f"sqlite+aiosqlite:///{tmp_path / 'nothing.db'}"])
    assert missing.exit_code == 2 and "no such database file" in missing.output
    assert not (tmp_path / "nothing.db").exists(), "verifying must not create a database"
    # A URL the broker would not take (no async driver named, or no URL at all) is a typo, not a broken chain.
    for url in ("postgresql://postgres@127.0.0.1:5432/x", "garbage", f"sqlite:///{tmp_path / 'j.db'}"):
        for command in (["verify", "--database", url], ["export", "--out", str(tmp_path / "x.jsonl"), "--database", url]):
            typo = CliRunner().invoke(audit_app, command)
            assert typo.exit_code == 2 and "--database must be a URL the broker uses" in typo.output, (command, typo.output)
    for path, said in ((tmp_path, "is a directory"), (tmp_path / "no-such-dir" / "j.db", "does not exist")):
        wrong = CliRunner().invoke(audit_app, ["verify", "--database", f"sqlite+aiosqlite:///{path}"])
        assert wrong.exit_code == 2 and said in wrong.output, wrong.output
    # The setting to fix is the URL given, which may be --database rather than database.url.
    assert "point the URL (--database, or database.url) at a file" in wrong.output, wrong.output


def test_a_journal_with_no_events_verifies_but_is_said_to_hold_nothing(request, tmp_path):
    """An empty journal (a copy made without its -wal file, say) has an intact chain of nothing:
    the verdict stands, with a warning that there was nothing to check."""
    from proxy.cli_security import audit_app

    empty = database_url("sqlite", tmp_path, request, migrated=True)
    result = CliRunner().invoke(audit_app, ["verify", "--database", empty])
    assert result.exit_code == 0 and "intact" in result.output and "0 event(s)" in result.output, result.output
    assert "holds no events at all, so there was nothing to verify" in result.output
    full = tmp_path / "full"
    full.mkdir()
    journal = database_url("sqlite", full, request, migrated=True)
    asyncio.run(write_journal(journal))
    result = CliRunner().invoke(audit_app, ["verify", "--database", journal])
    assert result.exit_code == 0 and "nothing to verify" not in result.output, result.output


def test_a_database_that_accepts_but_never_answers_is_given_up_on_in_seconds(tmp_path):
    """asyncpg would wait a minute, in silence, on a server that takes the connection and says
    nothing; the commands that run beside the broker give up after migrate.CONNECT_TIMEOUT."""
    import socket

    from proxy.store import migrate

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{listener.getsockname()[1]}/x"
        started = time.monotonic()
        with pytest.raises(Exception):
            migrate.current(url)
        with pytest.raises(audit.AuditInputError, match="could not be read"):
            asyncio.run(audit.load_database(url))
        assert time.monotonic() - started < 2 * migrate.CONNECT_TIMEOUT + 10
    finally:
        listener.close()


def test_a_journal_in_a_directory_the_auditor_cannot_write_is_still_verified(request, tmp_path):
    """SQLite needs to create a WAL reader's shared-memory file beside the journal: on a read-only
    file system, or in a directory the auditor cannot write, `audit verify` failed with "attempt to
    write a readonly database" (exit 2), though anyone with read access should be able to check
    (found by a probe). It now reads the file as immutable, and says so. The auditor here is root
    without CAP_DAC_OVERRIDE (setpriv), as a user without write access is."""
    import shutil

    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's override of file permissions"
    directory = tmp_path / "readonly"
    directory.mkdir()
    url = database_url("sqlite", directory, request, migrated=True)  # directory / journal.db
    asyncio.run(write_journal(url))
    for leftover in directory.glob("journal.db-*"):
        leftover.unlink()  # a cleanly closed journal: everything is in the main file
    (directory / "journal.db").chmod(0o444)
    directory.chmod(0o555)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
        done = subprocess.run(
            ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c",
             "from proxy.cli_security import audit_app; audit_app(prog_name='affidavit')", "verify", "--database", url],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    finally:
        directory.chmod(0o755)
    assert done.returncode == 0, done.stdout + done.stderr
    total = len(WRITERS) * INVOCATIONS_PER_WRITER * EVENTS_PER_INVOCATION
    assert f"audit chain intact in {url}: {total} event(s)" in done.stdout, done.stdout + done.stderr
    assert "could not be opened for shared reading" in done.stderr and "read as an immutable file" in done.stderr


def test_the_journal_commands_read_a_journal_in_a_directory_this_user_cannot_write(request, tmp_path):
    """`invocations list/show` and `metrics` failed as they do for `audit verify` above ("attempt to
    write a readonly database ... the broker must write its journal"), though the operator at 3 a.m.
    only reads. They read the file as it is on disk, and say so, when no -wal file holds commits it
    lacks; with one, they refuse as before (reading the file alone would miss those commits)."""
    import shutil

    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's override of file permissions"
    directory = tmp_path / "readonly"
    directory.mkdir()
    url = database_url("sqlite", directory, request, migrated=True)
    asyncio.run(write_journal(url))
    with sqlite3.connect(directory / "journal.db") as conn:  # as a broker's journal is (its writer sets it)
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    for leftover in directory.glob("journal.db-*"):
        leftover.unlink()
    [[invocation_id]] = query(url, "SELECT invocation_id FROM invocations LIMIT 1")
    config = tmp_path / "affidavit.toml"
    config.write_text(tomli_w.dumps({"database": {"url": url}}))
    (directory / "journal.db").chmod(0o444)
    directory.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}

    def as_reader(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m", "proxy", *args,
             "--config", str(config)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    try:
        listed = as_reader("invocations", "list", "--since", "1h")
        shown = as_reader("invocations", "show", invocation_id)
        counted = as_reader("metrics", "--since", "1h")
        directory.chmod(0o755)
        (directory / "journal.db-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(60))  # commits the file lacks
        directory.chmod(0o555)
        refused = as_reader("invocations", "show", invocation_id)
    finally:
        directory.chmod(0o755)
    for done in (listed, shown, counted):
        assert done.returncode == 0, done.stdout + done.stderr
        assert "could not be opened for shared reading" in done.stderr and "read as it is on disk" in done.stderr
    assert invocation_id in listed.stdout and invocation_id in shown.stdout, listed.stdout + shown.stdout
    assert refused.returncode == 1 and "may read and write both" in refused.stderr, refused.stdout + refused.stderr
    assert "read as it is on disk" not in refused.stderr
