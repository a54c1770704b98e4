"""The journal's plain statements: sqlite3 directly and SQLAlchemy Core store the same rows, and
refused writes (lost fences, taken keys, colliding rows) fail alone on both dialects."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select

from proxy.invocation_log import new_invocation_id
from proxy.store import migrate
from proxy.store.journal import EventRow, Fence, IdempotencyConflict, Journal, LeaseLost, make_engine, projection_row
from proxy.store.schema import events, invocations, results
from proxy.store.statements import CoreStatements, SqliteStatements

NOW = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def invocation_row(invocation_id: str, key: str | None = None, **overrides) -> dict:
    row = {
        "invocation_id": invocation_id,
        "created_at": NOW,
        "updated_at": NOW,
        "agent": "builder",
        "route": "payments.create",
        "method": "POST",
        "target": "https://api.payments.test:443/v1/charges",
        "fingerprint": "sha256:" + "1" * 64,
        "idempotent": False,
        "credential_id": None,
        "credential_version": None,
        "injection": None,
        "idempotency_key": key,
        "idempotency_scope": "payments" if key else None,
        "idempotency_expires_at": NOW + timedelta(days=1) if key else None,
        "remote_contract": True,
        "stage": "validated",
        "phase": "validation",
        "outcome": "not_attempted",
        "retry": None,
        "code": None,
        "caller_disposition": "waiting",
        "dispatch_started": False,
        "dispatch_seq": None,
        "status": None,
        "last_seq": 1,
        "owner": "broker-a",
        "lease_expires_at": NOW + timedelta(seconds=30),
        "generation": 2,
        "attempts_used": 0,
        "retry_budget": 3,
        "replays": 0,
    }
    row.update(overrides)
    return row


def event_row(invocation_id: str, seq: int, writer_seq: int) -> dict:
    return {
        "invocation_id": invocation_id, "seq": seq, "kind": "ACTION_ACCEPTED", "at": NOW + timedelta(microseconds=seq),
        "writer": "w1", "writer_seq": writer_seq, "prev_hash": "0" * 64, "hash": f"{writer_seq:064x}", "key_id": None,
        "payload": b'{"agent":"builder"}\x00\xff',
    }


def _exercise(statements: CoreStatements | SqliteStatements) -> list[bool]:
    """The same statements through either implementation; returns what each check answered."""
    answers = []
    with statements.transaction():
        statements.insert(invocations, [invocation_row("act_a", key="k1"), invocation_row("act_b")])
        statements.insert(events, [event_row("act_a", 1, 1), event_row("act_b", 1, 2)])
        statements.insert(results, [{
            "invocation_id": "act_a", "stored_at": NOW, "status": 201, "headers": "[]", "body": b"\x00{}",
            "body_sha256": "2" * 64, "framing": "chunked", "key_id": "k2026",
        }])
        projection = {k: v for k, v in invocation_row("act_b").items()}
        projection.update(stage="dispatched", phase="remote_execution", outcome="unknown", dispatch_started=True,
                          dispatch_seq=2, last_seq=2, attempts_used=1, updated_at=NOW + timedelta(seconds=1))
        statements.update_projections([projection_row("act_b", projection)])
    with statements.transaction():
        answers.append(statements.holds(Fence("act_a", 2, "broker-a", NOW, check_expiry=True)))
        answers.append(statements.holds(Fence("act_a", 2, "broker-b", NOW)))  # another owner
        answers.append(statements.holds(Fence("act_a", 1, "broker-a", NOW)))  # an older generation
        answers.append(statements.holds(Fence("act_a", 2, "broker-a", NOW + timedelta(minutes=1), check_expiry=True)))
        answers.append(statements.claim(invocation_row("act_c", key="k1")))  # the key is taken
        answers.append(statements.claim(invocation_row("act_d", key="k2")))
    return answers


def _stored(path: Path) -> dict[str, list[dict]]:
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            return {
                table.name: [dict(row) for row in conn.execute(select(table).order_by(*table.primary_key.columns)).mappings()]
                for table in (invocations, events, results)
            }
    finally:
        engine.dispose()


def test_sqlite3_statements_store_exactly_what_sqlalchemy_stores(tmp_path):
    stored = {}
    for name in ("core", "sqlite3"):
        path = tmp_path / f"{name}.db"
        migrate.upgrade(f"sqlite+aiosqlite:///{path}")
        if name == "core":
            engine = create_engine(f"sqlite:///{path}")
            with engine.connect() as conn:
                answers = _exercise(CoreStatements(conn))
            engine.dispose()
        else:
            statements = SqliteStatements.connect(str(path), 5.0)
            answers = _exercise(statements)
            statements.close()
        assert answers == [True, False, False, False, False, True], name
        stored[name] = _stored(path)
    assert stored["sqlite3"] == stored["core"]
    rows = {row["invocation_id"]: row for row in stored["sqlite3"]["invocations"]}
    assert set(rows) == {"act_a", "act_b", "act_d"}
    # Times come back as the same instant (SQLite keeps UTC text without the zone), flags as booleans.
    assert rows["act_a"]["created_at"] == NOW.replace(tzinfo=None)
    assert rows["act_a"]["remote_contract"] is True and rows["act_b"]["dispatch_started"] is True
    assert rows["act_b"]["stage"] == "dispatched" and rows["act_b"]["updated_at"] == (NOW + timedelta(seconds=1)).replace(tzinfo=None)
    assert stored["sqlite3"]["events"][0]["payload"] == b'{"agent":"builder"}\x00\xff'


def test_a_big_batch_is_split_under_sqlites_variable_limit(tmp_path):
    path = tmp_path / "big.db"
    migrate.upgrade(f"sqlite+aiosqlite:///{path}")
    statements = SqliteStatements.connect(str(path), 5.0)
    statements.conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # as builds before 3.32 have it
    with statements.transaction():
        statements.insert(invocations, [invocation_row(f"act_{n:04d}") for n in range(200)])  # 33 columns each
        statements.insert(events, [event_row(f"act_{n:04d}", 1, n + 1) for n in range(200)])
    statements.close()
    stored = _stored(path)
    assert len(stored["invocations"]) == 200 and len(stored["events"]) == 200


def test_many_updates_in_one_batch_land_like_one_statement_each(tmp_path):
    """sqlite3 updates a batch's projections with a few ``UPDATE ... FROM (VALUES ...)``
    statements; the rows must end exactly as SQLAlchemy's one-update-per-row leaves them, past
    the variable limit and with two updates of one invocation (the later wins)."""
    count = 130  # 18 variables per row: 55 rows per statement, so three statements
    stored = {}
    for name in ("core", "sqlite3"):
        path = tmp_path / f"{name}.db"
        migrate.upgrade(f"sqlite+aiosqlite:///{path}")
        updates = []
        for n in range(count):
            projection = invocation_row(f"act_{n:04d}")
            projection.update(stage="committed", phase="result_delivery", outcome="committed", status=200 + n % 3,
                              last_seq=n, updated_at=NOW + timedelta(milliseconds=n))
            updates.append(projection_row(f"act_{n:04d}", projection))
        later = dict(updates[7], stage="delivered", last_seq=999)
        if name == "core":
            engine = create_engine(f"sqlite:///{path}")
            with engine.connect() as conn:
                statements: CoreStatements | SqliteStatements = CoreStatements(conn)
                with statements.transaction():
                    statements.insert(invocations, [invocation_row(f"act_{n:04d}") for n in range(count + 1)])
                    for row in [*updates, later]:  # one at a time, in order
                        statements.update_projections([row])
            engine.dispose()
        else:
            statements = SqliteStatements.connect(str(path), 5.0)
            statements.conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # as old builds have it
            with statements.transaction():
                statements.insert(invocations, [invocation_row(f"act_{n:04d}") for n in range(count + 1)])
                statements.update_projections([*updates, later])
            statements.close()
        stored[name] = _stored(path)["invocations"]
    assert stored["sqlite3"] == stored["core"]
    rows = {row["invocation_id"]: row for row in stored["sqlite3"]}
    assert rows["act_0007"]["stage"] == "delivered" and rows["act_0007"]["last_seq"] == 999
    assert rows["act_0129"]["stage"] == "committed" and rows["act_0129"]["status"] == 200 + 129 % 3
    assert rows[f"act_{count:04d}"]["stage"] == invocation_row("x")["stage"]  # not in the batch: untouched


def test_refused_writes_fail_alone_and_the_rest_of_their_batch_lands(db):
    from proxy.store.journal import Write

    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        first, keyed = new_invocation_id(), new_invocation_id()
        await journal.commit(Write(events=[EventRow(first, 1, "ACTION_ACCEPTED", NOW, b"{}")],
                                   insert_invocation=invocation_row(first, generation=0)))
        await journal.commit(Write(insert_invocation=invocation_row(keyed, key="taken"), claim=True))
        # One batch: a row that collides with a stored one, a claim of a taken key, a write fenced
        # by a generation the invocation is not at, and an innocent write.
        innocent = new_invocation_id()
        futures = [
            journal.submit(Write(events=[EventRow(first, 1, "PREFLIGHT_VALIDATED", NOW, b"{}")])),
            journal.submit(Write(insert_invocation=invocation_row(new_invocation_id(), key="taken"), claim=True)),
            journal.submit(Write(events=[EventRow(first, 2, "PREFLIGHT_VALIDATED", NOW, b"{}")],
                                 fence=Fence(first, 5, "broker-a", NOW))),
            journal.submit(Write(events=[EventRow(innocent, 1, "ACTION_ACCEPTED", NOW, b"{}")],
                                 insert_invocation=invocation_row(innocent, generation=0))),
        ]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        await journal.close()
        async with engine.connect() as conn:
            stored = (await conn.execute(select(events.c.invocation_id, events.c.seq, events.c.kind))).all()
        await engine.dispose()
        return first, innocent, outcomes, stored

    first, innocent, outcomes, stored = asyncio.run(scenario())
    assert isinstance(outcomes[0], LeaseLost) and "conflicting write" in str(outcomes[0])
    assert isinstance(outcomes[1], IdempotencyConflict)
    assert isinstance(outcomes[2], LeaseLost)
    assert outcomes[3] is None
    assert sorted((i, s, k) for i, s, k in stored) == sorted(
        [(first, 1, "ACTION_ACCEPTED"), (innocent, 1, "ACTION_ACCEPTED")]
    )


@pytest.mark.parametrize("fold", ["insert then update", "update only"])
def test_an_invocation_inserted_and_updated_in_one_batch_is_stored_at_its_last_projection(db, fold):
    from proxy.store.journal import Write

    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        invocation_id = new_invocation_id()
        writes = [Write(insert_invocation=invocation_row(invocation_id, generation=0), lazy=True)]
        if fold == "update only":
            await journal.commit(writes.pop())
        later = invocation_row(invocation_id, stage="dispatched", phase="remote_execution", outcome="unknown",
                               dispatch_started=True, dispatch_seq=2, last_seq=2, updated_at=NOW + timedelta(seconds=2))
        last = invocation_row(invocation_id, stage="committed", phase="result_delivery", outcome="committed",
                              dispatch_started=True, dispatch_seq=2, last_seq=4, status=201, updated_at=NOW + timedelta(seconds=3))
        writes += [Write(update_invocation=projection_row(invocation_id, later)),
                   Write(update_invocation=projection_row(invocation_id, last))]
        await asyncio.gather(*(journal.submit(w) for w in writes))
        await journal.close()
        async with engine.connect() as conn:
            row = (await conn.execute(select(invocations).where(invocations.c.invocation_id == invocation_id))).mappings().one()
        await engine.dispose()
        return dict(row)

    row = asyncio.run(scenario())
    assert (row["stage"], row["outcome"], row["last_seq"], row["status"]) == ("committed", "committed", 4, 201)
    assert row["created_at"].replace(tzinfo=None) == NOW.replace(tzinfo=None)
    assert row["retry_budget"] == 3 and row["remote_contract"] is True


def test_a_failed_sqlite_transaction_leaves_nothing_and_the_next_one_starts_clean(tmp_path):
    path = tmp_path / "rollback.db"
    migrate.upgrade(f"sqlite+aiosqlite:///{path}")
    statements = SqliteStatements.connect(str(path), 5.0)
    with pytest.raises(RuntimeError):
        with statements.transaction():
            statements.insert(invocations, [invocation_row("act_lost")])
            raise RuntimeError("a bug between two statements")
    with pytest.raises(sqlite3.IntegrityError):
        with statements.transaction():
            statements.insert(invocations, [invocation_row("act_dup"), invocation_row("act_dup")])
    with statements.transaction():
        statements.insert(invocations, [invocation_row("act_kept")])
    statements.close()
    assert [row["invocation_id"] for row in _stored(path)["invocations"]] == ["act_kept"]
