"""The journal on both dialects: group commit, the audit chain, append-only, the projection."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone

import asyncpg
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from proxy import metrics
from proxy.contract import EventKind, Phase, project
from proxy.invocation_log import Identity, InvocationLog, new_invocation_id
from proxy.store import queries
from proxy.store.journal import GENESIS, EventRow, Journal, JournalUnavailable, LeaseLost, Write, canonical_time, chain_hash, make_engine
from proxy.store.schema import events, invocations
from tests.conftest import database_url
from tests.support.hostile import free_port
from tests.support.relay import TcpRelay


def identity(**overrides) -> Identity:
    values = dict(
        invocation_id=new_invocation_id(),
        agent="builder",
        route="payments.create",
        method="POST",
        target="https://api.payments.test:443/v1/charges",
        fingerprint="sha256:" + "0" * 64,
        idempotent=False,
    )
    values.update(overrides)
    return Identity(**values)


async def _full_history(journal: Journal, owner: str = "test") -> InvocationLog:
    entry = InvocationLog(journal, identity(), owner)
    entry.append(EventKind.ACTION_ACCEPTED, agent="builder")
    entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
    entry.submit_quietly()
    entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id="payments-key")
    entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
    await entry.commit()
    entry.append(EventKind.REQUEST_SENT)
    entry.append(EventKind.REMOTE_RESPONSE_COMPLETE, status=201, framing="content-length")
    entry.append(EventKind.RESULT_COMMITTED)
    await entry.commit(
        result={
            "invocation_id": entry.invocation_id,
            "stored_at": entry._created_at,
            "status": 201,
            "headers": "[]",
            "body": b"{}",
            "body_sha256": "x",
            "framing": "content-length",
            "key_id": None,
        }
    )
    entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
    await entry.commit()
    return entry


def test_group_commit_makes_every_write_durable_in_few_transactions(db):
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        entries = await asyncio.gather(*(_full_history(journal) for _ in range(100)))
        batches = journal.batches
        await journal.close()
        async with engine.connect() as conn:
            count = (await conn.execute(text("SELECT count(*) FROM events"))).scalar()
            rows = (await conn.execute(select(invocations))).mappings().all()
        await engine.dispose()
        return entries, batches, count, rows

    entries, batches, count, rows = asyncio.run(scenario())
    assert count == 100 * 8
    assert len(rows) == 100
    # 100 flows x 4 commits, gathered into far fewer transactions.
    assert batches < 300, batches
    for row in rows:
        assert row["stage"] == "delivered" and row["outcome"] == "committed" and row["last_seq"] == 8
        assert row["dispatch_seq"] == 4


def _accepted(journal: Journal) -> InvocationLog:
    entry = InvocationLog(journal, identity(), "test")
    entry.append(EventKind.ACTION_ACCEPTED, agent="builder")
    return entry


def test_an_event_whose_data_cannot_be_stored_leaves_the_record_as_it_was(db):
    """Encoding comes before the transition: a fact that cannot be written (a lone surrogate) is
    refused whole, and the record does not claim a stage the journal will never hold."""
    async def scenario():
        journal = Journal(make_engine(db), writer="w1")
        entry = _accepted(journal)
        before = entry.record
        with pytest.raises(Exception):
            entry.append(EventKind.PREFLIGHT_VALIDATED, route="r\ud800")
        assert entry.record == before and len(entry._buffer) == 1
        entry.append(EventKind.PREFLIGHT_VALIDATED, route="r")
        assert entry.record.last_seq == 2
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_a_lazy_write_does_not_wake_the_writer_and_goes_after_its_linger_or_with_the_next_commit(db):
    """Rows nobody waits for (an invocation's first facts, a delivery record) neither wake the
    writer nor wait for ever: they ride with the next write somebody waits for, or go alone once
    the oldest of them has waited the linger."""
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1", linger=0.3)
        await journal.start()
        await asyncio.sleep(0)  # the writer is waiting for work
        started = time.monotonic()
        alone = _accepted(journal).submit(lazy=True)
        for _ in range(5):
            await asyncio.sleep(0)
        assert journal._wakeup is not None and not journal._wakeup.done(), "a lazy write did not wake the writer"
        await asyncio.wait_for(alone, 10)
        waited = time.monotonic() - started
        assert waited >= 0.3 - 0.01, f"it went before its linger ({waited:.3f} s)"

        journal.linger = 30.0  # now only a commit can take it along within the test
        before = journal.batches
        riding = _accepted(journal).submit(lazy=True)
        await asyncio.sleep(0.05)
        assert not riding.done()
        await asyncio.wait_for(_accepted(journal).commit(), 10)
        assert riding.done() and journal.batches == before + 1, "the lazy rows rode with the commit"
        assert journal._lazy_timer is None, "the linger starts again with the next lazy write"
        await journal.close()
        await engine.dispose()

    asyncio.run(scenario())


def test_a_record_whose_lazy_first_write_landed_is_known_to_be_durable(db):
    """Its refusals then name it: at a stop, a request whose first facts had landed by write-behind
    and whose next write the closing journal refused was told 'No invocation was recorded', and
    its record stayed in flight (found by a probe)."""
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1", linger=0.01)
        await journal.start()
        entry = _accepted(journal)
        assert not entry.durable
        entry.submit_quietly()
        await asyncio.wait_for(entry._last, 10)
        await asyncio.sleep(0)  # the write's callbacks
        assert entry.durable
        await journal.close()
        await engine.dispose()

    asyncio.run(scenario())


def test_a_read_in_progress_holds_up_no_journal_write(db):
    """On SQLite every transaction began with BEGIN IMMEDIATE, reads too: a read (the side API's
    record, `invocations list`, a key lookup) held the write lock while it ran, so a dispatch
    commit waited behind it, and a read waited behind any writer (a probe saw the side API answer
    503 while another process held a write lock). Reads now take no lock."""
    from proxy.store.reading import reading

    async def scenario() -> float:
        engine = make_engine(db)
        journal = Journal(engine, writer="w1", timeout=3.0)
        await journal.start()
        await _accepted(journal).commit()
        try:
            async with reading(engine) as conn:
                assert (await conn.execute(select(invocations.c.invocation_id))).first() is not None  # a transaction is open
                started = time.monotonic()
                await asyncio.wait_for(_accepted(journal).commit(), 10)
                return time.monotonic() - started
        finally:
            await journal.close()
            await engine.dispose()

    assert asyncio.run(scenario()) < 1.0


def test_deferred_work_runs_while_the_writer_waits_on_the_database(db):
    """Work nobody waits for (a delivery record, the end-of-invocation log line) runs once the
    next batch is on its way to the database, before that batch's answer; with no batch going
    out it runs within ``defer_at_most``. One failing piece of work keeps no other from running."""
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1", defer_at_most=30.0)
        await journal.start()
        await asyncio.sleep(0)
        entry = _accepted(journal)
        seen: list[str] = []
        journal.defer(seen.append, "before the batch")
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == [], "deferred work ran although no batch went out and its time was not up"

        commit = entry.submit()
        answered_when_run: list[bool] = []
        journal.defer(lambda: answered_when_run.append(commit.done()))
        journal.defer(lambda: 1 / 0)
        journal.defer(seen.append, "after a failure")
        await asyncio.wait_for(commit, 10)
        assert seen == ["before the batch", "after a failure"]
        assert answered_when_run == [False], "it ran while the database worked on the batch"

        journal.defer_at_most = 0.05
        started = time.monotonic()
        ran = asyncio.get_running_loop().create_future()
        journal.defer(ran.set_result, None)
        await asyncio.wait_for(ran, 5)
        assert time.monotonic() - started < 2.0
        await journal.close()
        await engine.dispose()

    asyncio.run(scenario())


def test_closing_the_journal_first_runs_deferred_work_and_writes_what_it_submits(db):
    """A delivery record deferred just before a stop is still made: close runs the deferred work,
    then writes what it submitted."""
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1", defer_at_most=30.0)
        await journal.start()
        entry = _accepted(journal)
        await entry.commit()
        entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
        journal.defer(entry.submit_quietly)
        await journal.close()
        async with engine.connect() as conn:
            kinds = (await conn.execute(select(events.c.kind).order_by(events.c.seq))).scalars().all()
        await engine.dispose()
        return kinds

    assert asyncio.run(scenario()) == ["ACTION_ACCEPTED", "PREFLIGHT_VALIDATED"]


def test_closing_the_journal_answers_every_write_it_was_given(db):
    """Writes that arrive while the journal closes (a late delivery record, a background repair)
    are written or refused, never left waiting for ever."""
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        futures: list[asyncio.Future[None]] = []
        closed = asyncio.Event()

        async def keep_writing() -> None:
            while not closed.is_set():  # before, during and after close()
                futures.append(_accepted(journal).submit(lazy=len(futures) % 3 == 0))
                await asyncio.sleep(0)

        writer = asyncio.create_task(keep_writing())
        await asyncio.sleep(0.3)
        await journal.close()
        closed.set()
        await writer
        _, pending = await asyncio.wait(futures, timeout=10)
        refused = [f for f in futures if f.done() and f.exception() is not None]
        async with engine.connect() as conn:
            stored = (await conn.execute(text("SELECT count(*) FROM invocations"))).scalar()
        await engine.dispose()
        return len(futures), len(pending), refused, stored

    total, pending, refused, stored = asyncio.run(scenario())
    assert total > 20
    assert pending == 0, f"{pending} of {total} writes were never answered"
    assert refused and all(isinstance(f.exception(), JournalUnavailable) for f in refused)
    assert stored == total - len(refused), "every write answered as durable is stored, and no refused one"


def test_the_projection_row_is_the_fold_of_the_stored_events(db):
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        entry = await _full_history(journal)
        await journal.close()
        row = await queries.invocation(engine, entry.invocation_id)
        _, stored = await queries.events_of(engine, entry.invocation_id, journal.decode_payload)
        await engine.dispose()
        return row, stored

    row, stored = asyncio.run(scenario())
    record = project(stored)
    assert row["stage"] == record.stage.value
    assert row["outcome"] == record.outcome.value
    assert row["phase"] == record.phase.value
    assert row["dispatch_seq"] == record.dispatch_seq
    assert row["last_seq"] == record.last_seq == len(stored)


def test_each_writer_keeps_an_unbroken_hash_chain(db):
    async def scenario():
        engine = make_engine(db)
        for writer in ("w1", "w2"):
            journal = Journal(engine, writer=writer)
            await journal.start()
            await asyncio.gather(*(_full_history(journal) for _ in range(10)))
            await journal.close()
        async with engine.connect() as conn:
            rows = (await conn.execute(select(events).order_by(events.c.writer, events.c.writer_seq))).mappings().all()
        await engine.dispose()
        return [dict(r) for r in rows]

    rows = asyncio.run(scenario())
    by_writer: dict[str, list[dict]] = {}
    for row in rows:
        by_writer.setdefault(row["writer"], []).append(row)
    assert set(by_writer) == {"w1", "w2"}
    for chain in by_writer.values():
        previous = GENESIS
        for n, row in enumerate(chain, 1):
            assert row["writer_seq"] == n
            assert row["prev_hash"] == previous
            assert row["hash"] == chain_hash(row), "the stored hash must cover the stored bytes"
            previous = row["hash"]


@pytest.mark.parametrize("statement", ["UPDATE events SET kind = 'RECONCILED'", "DELETE FROM events", "UPDATE results SET status = 200", "DELETE FROM results"])
def test_events_and_results_are_append_only_in_the_database(db, statement):
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        await _full_history(journal)
        await journal.close()
        refused = False
        try:
            async with engine.begin() as conn:
                await conn.execute(text(statement))
        except Exception as exc:  # the trigger's error, whatever the driver calls it
            refused = "append-only" in str(exc)
        async with engine.connect() as conn:
            kinds = [r[0] for r in await conn.execute(text("SELECT kind FROM events ORDER BY seq"))]
            statuses = [r[0] for r in await conn.execute(text("SELECT status FROM results"))]
        await engine.dispose()
        return refused, kinds, statuses

    refused, kinds, statuses = asyncio.run(scenario())
    assert refused
    assert kinds[0] == "ACTION_ACCEPTED" and len(kinds) == 8 and "RECONCILED" not in kinds
    assert statuses == [201]


def test_an_unreachable_database_fails_fast_and_a_later_write_of_the_same_invocation_too(tmp_path):
    async def scenario():
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nothing"
        engine = make_engine(url, timeout=1.0)
        journal = Journal(engine, writer="w1", timeout=1.0)
        await journal.start()
        entry = InvocationLog(journal, identity(), "test")
        entry.append(EventKind.ACTION_ACCEPTED)
        first = entry.submit()
        entry.append(EventKind.FAILED, phase=Phase.VALIDATION.value, code="INVALID_TARGET")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(JournalUnavailable):
            await first
        with pytest.raises(JournalUnavailable):
            await entry.commit()
        elapsed = loop.time() - started
        healthy = journal.healthy
        await journal.close()
        await engine.dispose()
        return elapsed, healthy

    elapsed, healthy = asyncio.run(scenario())
    assert elapsed < 5
    assert not healthy


def test_writes_queued_behind_a_batch_the_database_does_not_answer_are_refused_unsent(request, tmp_path):
    """A database that stalls (takes the bytes, never answers): the batch on its way fails after
    the timeout, maybe landed; the writes queued behind it fail with it, unsent, instead of waiting
    for a batch of their own that would stall as long again. Lazy rows nobody waits for stay."""
    server = make_url(database_url("postgresql", tmp_path, request, migrated=True))

    async def scenario(relay: TcpRelay) -> None:
        engine = make_engine(server.set(host="127.0.0.1", port=relay.listen_port).render_as_string(hide_password=False),
                             timeout=1.0)
        journal = Journal(engine, writer="w1", timeout=1.0, linger=30.0)
        await journal.start()
        await _accepted(journal).commit()  # connected
        relay.blackhole()
        loop = asyncio.get_running_loop()
        started = loop.time()
        on_its_way = _accepted(journal).submit()
        await asyncio.sleep(0.3)  # taken into a batch that stalls
        queued = [_accepted(journal).submit() for _ in range(3)]
        lazy = _accepted(journal).submit(lazy=True)
        results = await asyncio.gather(on_its_way, *queued, return_exceptions=True)
        took = loop.time() - started
        assert all(isinstance(r, JournalUnavailable) for r in results), results
        assert not results[0].unwritten, "the stalled batch's own write may have landed"
        assert all(r.unwritten for r in results[1:]), [str(r) for r in results[1:]]
        assert took < 1.9, f"the queued writes waited for a batch of their own ({took:.1f} s)"
        assert not lazy.done() and journal._queue, "a lazy write stays for the next batch"
        relay.restore()
        await journal.close()
        assert lazy.done() and lazy.exception() is None, "written at the close, once the database answered"
        await engine.dispose()

    with TcpRelay(server.host or "127.0.0.1", server.port or 5432) as relay:
        asyncio.run(scenario(relay))


def test_a_write_the_database_refused_or_never_got_is_known_unwritten(request, tmp_path):
    """Which failures can have landed: a batch PostgreSQL answered with an error (here a read-only
    database) rolled back, and one that never reached it (nothing listens) wrote nothing; both say
    so, and a request's answer need not say that its write may have landed. A batch cut off on
    its way (the stalled test above) may have."""
    url = database_url("postgresql", tmp_path, request, migrated=True)
    name = make_url(url).database

    async def first_write_fails(url: str, timeout: float) -> JournalUnavailable:
        engine = make_engine(url, timeout=timeout)
        journal = Journal(engine, writer="w1", timeout=timeout)
        await journal.start()
        with pytest.raises(JournalUnavailable) as failed:
            await _accepted(journal).commit()
        await journal.close()
        await engine.dispose()
        return failed.value

    async def scenario() -> tuple[JournalUnavailable, JournalUnavailable]:
        admin = create_async_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
        async with admin.connect() as conn:
            await conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
        await admin.dispose()
        return (await first_write_fails(url, 2.0),
                await first_write_fails(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nothing", 1.0))

    refused, unreached = asyncio.run(scenario())
    assert "read-only" in str(refused) and refused.unwritten, refused
    assert unreached.unwritten, unreached


async def _error_of(engine: AsyncEngine, *statements: str) -> BaseException:
    """What running ``statements`` in one transaction raises (the test fails if nothing)."""
    try:
        async with engine.begin() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    except Exception as exc:
        return exc
    raise AssertionError(f"{statements} did not fail")


def test_only_errors_that_mean_the_database_is_away_are_unreachable(db, tmp_path):
    """``queries.unreachable`` decides between 503 JOURNAL_UNAVAILABLE and an internal error. Real
    errors of both kinds: queries the database answered with an error, and a database that is away."""
    postgres = db.startswith("postgresql")

    async def scenario() -> tuple[list[BaseException], list[BaseException]]:
        engine = make_engine(db)
        answered = [
            await _error_of(engine, "SELECT * FROM no_such_table"),
            await _error_of(engine, "SELECT no_such_column FROM invocations"),
            await _error_of(engine, "SELEC 1"),
        ]
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE probe (id INTEGER PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO probe VALUES (1)"))
        answered.append(await _error_of(engine, "INSERT INTO probe VALUES (1)"))  # a unique violation

        away = []
        one = create_async_engine(db, pool_size=1, max_overflow=0, pool_timeout=0.2)
        async with one.connect():
            away.append(await _error_of(one, "SELECT 1"))  # no pooled connection free in time
        await one.dispose()
        if postgres:
            gone = create_async_engine(make_url(db).set(port=free_port()))
            away.append(await _error_of(gone, "SELECT 1"))  # connection refused
            await gone.dispose()
            away.append(await _error_of(engine, "SET LOCAL statement_timeout = 100", "SELECT pg_sleep(2)"))
            async with engine.connect() as conn:  # an administrator ends the session mid-query
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar()
                sleeping = asyncio.ensure_future(conn.execute(text("SELECT pg_sleep(5)")))
                await asyncio.sleep(0.3)
                async with engine.connect() as admin:
                    await admin.execute(text(f"SELECT pg_terminate_backend({pid})"))
                try:
                    await sleeping
                except Exception as exc:
                    away.append(exc)
            assert len(away) == 4, away
        else:
            missing = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
            away.append(await _error_of(missing, "SELECT 1"))  # unable to open
            await missing.dispose()
            locked = create_async_engine(db, connect_args={"timeout": 0.2})
            holder = sqlite3.connect(make_url(db).database or "")
            holder.execute("BEGIN EXCLUSIVE")
            try:
                away.append(await _error_of(locked, "INSERT INTO probe VALUES (2)"))  # database is locked
            finally:
                holder.rollback()
                holder.close()
            await locked.dispose()
        await engine.dispose()
        return answered, away

    answered, away = asyncio.run(scenario())
    assert [e for e in answered if queries.unreachable(e)] == []
    assert [e for e in away if not queries.unreachable(e)] == []


def test_a_full_or_read_only_journal_says_so_and_what_to_do(db, tmp_path):
    """What to check, for the failures that are no outage of the server: a full disk and a journal
    this broker may not write. Before, both said to check that the database is up and reachable."""
    async def scenario() -> list[BaseException]:
        engine = make_engine(db)
        if db.startswith("postgresql"):  # a standby (or a read-only role) refuses writes so
            read_only = await _error_of(engine, "SET TRANSACTION READ ONLY", "CREATE TABLE refused (id INTEGER)")
        else:
            path = make_url(db).database
            read_only = await _error_of(create_async_engine(f"sqlite+aiosqlite:///file:{path}?mode=ro&uri=true"),
                                        "CREATE TABLE refused (id INTEGER)")
        await engine.dispose()
        return [read_only]

    [read_only] = asyncio.run(scenario())
    assert queries.what_to_check(read_only).startswith("it is read-only here"), read_only
    full = sqlite3.connect(tmp_path / "full.db")
    full.execute("CREATE TABLE t (b BLOB)")
    full.execute("PRAGMA max_page_count = 4")  # a disk that is full, for this connection
    with pytest.raises(sqlite3.OperationalError) as raised:
        full.execute("INSERT INTO t VALUES (zeroblob(100000))")
    for error in (raised.value, OSError(errno.ENOSPC, "No space left on device"), sqlite3.OperationalError("database or disk is full")):
        assert queries.what_to_check(error).startswith("the disk that holds it (or its quota) is full"), error
    assert queries.unreachable(raised.value) and queries.unreachable(read_only), "both are refused as JOURNAL_UNAVAILABLE"


@pytest.mark.parametrize(
    ("error", "away"),
    [
        (asyncpg.CannotConnectNowError("the database system is starting up"), True),
        (asyncpg.TooManyConnectionsError("sorry, too many clients already"), True),
        (asyncpg.AdminShutdownError("terminating connection due to administrator command"), True),
        (asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"), True),
        (asyncpg.ReadOnlySQLTransactionError("cannot execute UPDATE in a read-only transaction"), True),
        (asyncpg.InterfaceError("connection is closed"), True),
        (asyncpg.InvalidCachedStatementError("cached statement plan is invalid due to a database schema change"), True),
        (asyncpg.InternalClientError("cannot switch to state 11; another operation (None) is in progress"), True),
        (asyncpg.OutdatedSchemaCacheError("cache lookup failed for type 16386"), True),
        (ConnectionResetError("reset by peer"), True),
        (sqlite3.OperationalError("database is locked"), True),  # as the SQLite writer process passes it on
        (asyncpg.InterfaceError("cannot perform operation: another operation is in progress"), False),
        (asyncpg.DataError("invalid input for query argument $1"), False),
        (asyncpg.UniqueViolationError("duplicate key value violates unique constraint"), False),
        (sqlite3.OperationalError("no such column: events.payload"), False),
        (sqlite3.IntegrityError("UNIQUE constraint failed: invocations.invocation_id"), False),
        (KeyError("payload"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_errors_no_test_database_can_be_made_to_raise_are_classified_too(error: BaseException, away: bool):
    assert queries.unreachable(error) is away
    assert isinstance(error, queries.DATABASE_ERRORS) or not away, "an outage is caught as the journal's (a 503, not a 500)"
    wrapped = RuntimeError("wrapping")
    wrapped.__cause__ = error
    assert queries.unreachable(wrapped) is away, "the cause counts"


def test_payloads_are_json_and_hold_no_surprises(db):
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w1")
        await journal.start()
        entry = await _full_history(journal)
        await journal.close()
        rows = await queries.event_rows(engine, entry.invocation_id)
        await engine.dispose()
        return rows

    rows = asyncio.run(scenario())
    assert json.loads(bytes(rows[0]["payload"])) == {"agent": "builder"}


@pytest.mark.parametrize("at", [
    datetime(2026, 11, 30, 14, 0, 0, tzinfo=UTC),
    datetime(2026, 11, 30, 14, 0, 0, 7, tzinfo=UTC),
    datetime(2026, 1, 2, 3, 4, 5, 999999),  # SQLite hands times back without a zone: UTC
    datetime(2026, 6, 1, 1, 30, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    "2026-06-01T01:30:00.123456+05:30",
])
def test_canonical_time_is_utc_microseconds_and_z_whatever_it_is_given(at):
    # Hashes of stored events depend on this text: it must never change for the same instant.
    parsed = datetime.fromisoformat(at) if isinstance(at, str) else at
    reference = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert canonical_time(at) == reference


@pytest.mark.parametrize("at, key_id, expected", [
    (datetime(2026, 12, 1, 4, 5, 6, 789, tzinfo=UTC), None,
     "50d83a5bd47633d29336db0b936c6be6cd056637ce90f3593538e2f464e5f9b8"),
    (datetime(2026, 12, 1, 4, 5, 6, tzinfo=UTC), "k1",
     "4683daa0c9dc640b30e138a3445e1e68d5d852e27c15e826ff90859e837cdf53"),
])
def test_an_event_hash_is_the_same_as_ever(at, key_id, expected):
    # Golden values, computed by the first implementation: `audit verify` recomputes the hashes
    # of rows written years ago, so a faster encoding must give exactly these bytes.
    row = {
        "invocation_id": "act_01JXYZABCDEFGHJKMNPQRSTVWX", "seq": 3, "kind": "DISPATCH_STARTED", "at": at,
        "writer": "broker-1#w0", "writer_seq": 12345, "prev_hash": "a" * 64, "key_id": key_id,
        "payload": b'{"attempt":1,"connection":"reused"}',
    }
    assert chain_hash(row) == expected
    journal = Journal.__new__(Journal)
    journal.writer = "broker-1#w0"
    chain = [12344, "a" * 64]
    event = EventRow(row["invocation_id"], 3, "DISPATCH_STARTED", at, row["payload"], key_id)
    [chained] = journal._chain_rows([Write(events=[event])], chain)
    assert chained["hash"] == expected and chain == [12345, expected]


def _failed_once(journal: Journal, *, land: bool):
    """``journal.submit`` for one write: its future fails as if the acknowledgement were lost;
    with ``land`` its rows are committed first (a commit that landed unconfirmed)."""
    real = journal.submit

    def submit(write: Write) -> asyncio.Future[None]:
        journal.submit = real  # once
        landed = real(write) if land else None
        failed = asyncio.get_running_loop().create_future()

        async def fail() -> None:
            if landed is not None:
                await landed  # durable; then the broker is told otherwise
            write.future = failed
            failed.set_exception(JournalUnavailable("the acknowledgement was lost"))

        asyncio.get_running_loop().create_task(fail())
        return failed

    journal.submit = submit


async def _dispatched_then_refused(journal: Journal, *, land: bool) -> InvocationLog:
    """An invocation whose DISPATCH_STARTED is durable and whose next write the journal refused."""
    entry = _accepted(journal)
    entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
    entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id=None, injection="none")
    entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
    await entry.commit()
    _failed_once(journal, land=land)
    entry.append(EventKind.REMOTE_RESPONSE_COMPLETE, status=201, framing="content-length")
    with pytest.raises(JournalUnavailable):
        await entry.commit()
    return entry


def _stored_after_a_refusal(db: str, land: bool, then: Callable[[InvocationLog], Awaitable[None]]) -> list[int]:
    """The sequence numbers stored for an invocation whose write after DISPATCH_STARTED the journal
    refused (having made it, with ``land``), once ``then`` has done its part with the entry."""
    async def scenario() -> list[int]:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        try:
            entry = await _dispatched_then_refused(journal, land=land)
            await then(entry)
            _, stored = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
        finally:
            await journal.close()
            await journal.engine.dispose()
        return [e.seq for e in stored]

    return asyncio.run(scenario())


@pytest.mark.parametrize("land", [True, False])
def test_a_commit_after_a_failed_write_sends_it_again_first_and_counts_one_that_landed_as_done(db, land):
    """Not refused as coming after a failed write (which would leave the record stuck for good
    once the journal is back): every failed write goes again, in order, then this one."""
    async def then(entry: InvocationLog) -> None:
        entry.append(EventKind.RESULT_COMMITTED)
        await entry.commit()

    assert _stored_after_a_refusal(db, land, then) == [1, 2, 3, 4, 5, 6], "every event, once, in order"


@pytest.mark.parametrize("land", [True, False])
def test_a_write_after_a_resubmit_goes_after_the_resubmitted_one(db, land):
    """When the last write the journal failed had in fact landed, the next write (the delivery
    record, say) goes after it; it is not refused as coming after a failed write."""
    async def then(entry: InvocationLog) -> None:
        await entry.resubmit()
        entry.append(EventKind.RESULT_COMMITTED)
        await entry.commit()

    assert _stored_after_a_refusal(db, land, then) == [1, 2, 3, 4, 5, 6], "every event, once, in order"


@pytest.mark.parametrize("land", [True, False])
def test_two_commits_after_a_failed_write_resend_it_once_and_both_succeed(db, land):
    """Two coroutines commit one invocation after a write of it failed (the background finisher
    and the delivery repair, say): the failed writes go again once, not once per commit, and
    neither commit fails for the other's resend."""
    async def then(entry: InvocationLog) -> None:
        entry.append(EventKind.RESULT_COMMITTED)
        first = entry.commit()
        entry.append(EventKind.RESULT_DELIVERED)
        second = entry.commit()
        assert await asyncio.gather(first, second, return_exceptions=True) == [None, None]

    assert _stored_after_a_refusal(db, land, then) == [1, 2, 3, 4, 5, 6, 7], "every event, once, in order"


@pytest.mark.parametrize("land", [True, False])
def test_a_resend_waiting_on_another_commits_write_survives_that_commit_moving_on(db, land):
    """One commit resends a failed write and sends its own; another commit, at once, finds that
    write in flight and waits it out. The first commit's task wakes first and appends again
    (which prunes the now-durable write): the waiting resend must not fail for it."""
    async def then(entry: InvocationLog) -> None:
        entry.append(EventKind.RESULT_COMMITTED)

        async def moves_on() -> None:
            await entry.commit()
            entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
            entry.submit_quietly()

        assert await asyncio.gather(moves_on(), entry.commit(), return_exceptions=True) == [None, None]

    assert _stored_after_a_refusal(db, land, then)[:6] == [1, 2, 3, 4, 5, 6], "every event, once, in order"


def test_resubmit_refuses_when_other_events_took_those_sequence_numbers(db):
    """Another broker closed the record meanwhile (its owner looked dead): the held writes can
    never be made, and resubmit says so rather than count them as landed."""
    async def scenario() -> None:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        entry = await _dispatched_then_refused(journal, land=False)
        _, events_now = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
        other = InvocationLog(journal, entry.identity, "another-broker", record=project(events_now), persisted=True)
        other.append(EventKind.FAILED, phase=Phase.REMOTE_EXECUTION, code="REMOTE_OUTCOME_UNKNOWN")
        await other.commit()
        with pytest.raises(LeaseLost):
            await entry.resubmit()
        entry.append(EventKind.RESULT_COMMITTED)  # a commit sends them again first: refused as the outage it was
        with pytest.raises(JournalUnavailable, match="another broker has closed the record"):
            await entry.commit()
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


def _ends_reported(caplog: pytest.LogCaptureFixture, invocation_id: str) -> list[str | None]:
    """The diagnostic of each "invocation ended" line of ``invocation_id``."""
    return [r.diagnostic for r in caplog.records if r.getMessage() == "invocation ended" and r.invocation_id == invocation_id]


def _ends_counted() -> float:
    return metrics.REGISTRY.get_sample_value("affidavit_invocations_total", {
        "route": "payments.create", "phase": "remote_execution", "outcome": "unknown", "code": "REMOTE_OUTCOME_UNKNOWN",
    }) or 0.0


@pytest.mark.parametrize("then", ["resubmitted", "landed unconfirmed", "closed by another broker"])
def test_an_end_is_logged_and_counted_once_the_journal_holds_it_and_never_when_it_does_not(db, caplog, then):
    """The "invocation ended" line and affidavit_invocations_total report ends the journal holds:
    not while the end's write is refused, once when a resend lands (or finds it had landed), and
    never when another broker closed the record instead (that broker reports its own end)."""
    caplog.set_level(logging.INFO, logger="affidavit.invocations")

    async def scenario() -> None:
        journal = Journal(make_engine(db), writer="w1", defer_at_most=0.01)
        await journal.start()
        entry = _accepted(journal)
        entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
        entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id=None, injection="none")
        entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
        await entry.commit()
        counted = _ends_counted()
        _failed_once(journal, land=then == "landed unconfirmed")
        entry.append(EventKind.FAILED, phase=Phase.REMOTE_EXECUTION, code="REMOTE_OUTCOME_UNKNOWN")
        with pytest.raises(JournalUnavailable):
            await entry.commit()
        await asyncio.sleep(0.1)  # past defer_at_most: anything deferred has run
        assert _ends_reported(caplog, entry.invocation_id) == [] and _ends_counted() == counted, "refused: no end yet"

        if then == "closed by another broker":
            _, events_now = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
            other = InvocationLog(journal, entry.identity, "another-broker", record=project(events_now), persisted=True)
            other.append(EventKind.FAILED, phase=Phase.REMOTE_EXECUTION, code="REMOTE_OUTCOME_UNKNOWN",
                         diagnostic="closed by recovery")
            await other.commit()
            with pytest.raises(LeaseLost):
                await entry.resubmit()
        else:
            await entry.resubmit()
            await entry.resubmit()  # nothing left to send: reported once, not per call
        await journal.close()
        await journal.engine.dispose()
        reported = ["closed by recovery"] if then == "closed by another broker" else [None]
        assert _ends_reported(caplog, entry.invocation_id) == reported, "the one end the journal holds, reported once"
        assert _ends_counted() == counted + 1

    asyncio.run(scenario())


@pytest.mark.parametrize("land", [True, False])
def test_settling_a_refused_end_reports_it_only_if_it_landed_and_writes_nothing(db, caplog, land):
    """The broker found the record ended after its end's write was refused (it closes such
    records once the journal answers): an end that landed unconfirmed is reported then; one that
    did not is neither reported nor written."""
    caplog.set_level(logging.INFO, logger="affidavit.invocations")

    async def scenario() -> list[int]:
        journal = Journal(make_engine(db), writer="w1", defer_at_most=0.01)
        await journal.start()
        entry = _accepted(journal)
        await entry.commit()
        _failed_once(journal, land=land)
        entry.append(EventKind.FAILED, phase=Phase.VALIDATION, code="INVALID_TARGET")
        with pytest.raises(JournalUnavailable):
            await entry.commit()
        await entry.settle_landed()
        await entry.settle_landed()
        _, stored = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
        await journal.close()
        await journal.engine.dispose()
        assert _ends_reported(caplog, entry.invocation_id) == ([None] if land else [])
        return [e.seq for e in stored]

    assert asyncio.run(scenario()) == ([1, 2] if land else [1])


def test_a_write_sent_alone_is_a_batch_of_its_own(db):
    async def scenario() -> None:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        before = journal.batches
        entries = [_accepted(journal) for _ in range(3)]
        futures = [e.submit() for e in entries[:2]]
        again = entries[2]._next_write(None, None, False, False)
        again.alone = True
        futures.append(journal.submit(again))
        await asyncio.gather(*futures)
        assert journal.batches - before == 2, "the two ordinary writes together, the one sent alone apart"
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_a_repaired_result_whose_hand_over_is_never_confirmed_ends_as_not_delivered(db, monkeypatch):
    """A complete answer the journal refused was handed to the caller flagged RESULT_STORE_FAILED
    and recorded once the journal took writes again; if the hand-over is never confirmed (a
    reader slower than the wait), the record still ends, as not delivered (fetch the result),
    instead of the repair dying on its timeout and the record staying 'committed' for good."""
    from proxy import broker as broker_module

    monkeypatch.setattr(broker_module, "DELIVERY_CONFIRM_WAIT", 0.2, raising=False)

    assert _stage_after_repair(db, monkeypatch, land=False, handed=False) == "delivery_failed"


def test_a_repair_whose_read_back_of_a_landed_write_fails_tries_again_and_records_the_result(db, monkeypatch):
    """The result's write had landed unconfirmed; re-sent, it is refused as a conflict and the
    repair reads back whether the rows are its own. When that read fails (the database away
    again), the repair waits and tries again, as for a refused write, instead of dying with the
    read's error and leaving the record 'dispatched' until a restart."""
    real = queries.event_rows
    failed: list[bool] = []

    async def event_rows(engine, invocation_id):
        if not failed:
            failed.append(True)
            raise ConnectionRefusedError(111, "Connect call failed (injected)")
        return await real(engine, invocation_id)

    def break_the_read_back() -> None:
        monkeypatch.setattr(queries, "event_rows", event_rows)

    assert _stage_after_repair(db, monkeypatch, land=True, handed=True, then=break_the_read_back) == "delivered"
    assert failed == [True], "the read back failed once, as injected"


def _stage_after_repair(db: str, monkeypatch, *, land: bool, handed: bool, then: Callable[[], None] = lambda: None) -> str:
    """The stage an invocation's record reaches once the broker's repair has recorded its result,
    the result's write having been refused (and made, with ``land``). ``handed``: the caller had
    the whole answer (else the hand-over is never confirmed). ``then`` runs just before the repair."""
    async def scenario() -> str:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        try:
            broker = _in_process_broker(db, monkeypatch, journal)
            entry = await _dispatched_then_refused(journal, land=land)
            entry.append(EventKind.RESULT_COMMITTED)
            then()
            hand_over: asyncio.Future = asyncio.get_running_loop().create_future()
            if handed:
                hand_over.set_result(None)
            await asyncio.wait_for(broker._repair(entry, 201, hand_over), 20)
            _, stored = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
            return project(stored).stage.value
        finally:
            await journal.close()
            await journal.engine.dispose()

    return asyncio.run(scenario())


def _in_process_broker(db: str, monkeypatch, journal: Journal):
    from proxy.broker import Broker
    from proxy.config import Settings
    from proxy.credentials import Credentials
    from proxy.upstream import Upstream

    monkeypatch.setenv("AFFIDAVIT_TEST_BUILDER", "tok-" + "0" * 16)
    settings = Settings(agents=[{"name": "builder", "token": "env:AFFIDAVIT_TEST_BUILDER"}], database={"url": db},
                        routes=[{"name": "r", "host": "r.example.test", "methods": ["POST"], "agents": ["builder"]}])
    return Broker(settings, journal, Upstream(), Credentials(settings), "test")


@pytest.mark.parametrize("since", ["an operator's finding", "a re-send"])
def test_the_answer_a_cut_off_broker_saw_is_never_appended_over_what_came_after(db, monkeypatch, caplog, since):
    """Another broker closed the record as unknown while this one was cut off; since then an
    operator reconciled it, or a re-send took it (a new generation). The answer this broker holds
    is about its own, earlier attempt: appending it as a finding would overturn the operator's,
    or speak for an attempt it never saw."""
    from proxy import decisions
    from proxy.contract import Outcome
    from proxy.recovery import closing_events

    async def scenario() -> tuple[object, int]:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        try:
            broker = _in_process_broker(db, monkeypatch, journal)
            entry = _accepted(journal)
            entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
            entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id=None, injection="none")
            entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
            await entry.commit()
            closer = InvocationLog(journal, entry.identity, "broker-a/1", record=entry.record, persisted=True)
            for kind, data in closing_events(closer.record, cause="silent"):
                closer.append(kind, **data)
            await closer.commit()
            row = await queries.invocation(journal.engine, entry.invocation_id)
            if since == "a re-send":  # what take_lease does for the repeat a re-send serves
                async with journal.engine.begin() as conn:
                    await conn.execute(invocations.update().where(invocations.c.invocation_id == entry.invocation_id)
                                       .values(generation=row["generation"] + 1, owner="broker-a/1"))
            else:
                await decisions.reconcile(journal, row, Outcome.REJECTED, "remote_query", "ref-1", "no charge", "op")
            await broker._reconcile_from_what_was_seen(entry, 500, None)  # 500 would say committed
            _, stored = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
            return project(stored), sum(e.kind is EventKind.RECONCILED for e in stored)
        finally:
            await journal.close()
            await journal.engine.dispose()

    caplog.set_level("ERROR", logger="affidavit.broker")
    record, findings = asyncio.run(scenario())
    if since == "a re-send":
        assert findings == 0 and record.reconciled_outcome is None
    else:
        assert findings == 1 and record.reconciled_outcome is Outcome.REJECTED, "the operator's finding stands"
    assert "did not append what it saw" in caplog.text and "this broker re-sent nothing" in caplog.text


@pytest.mark.parametrize("closed", [False, True])
def test_a_failed_write_behind_is_resent_until_it_lands_but_not_after_the_broker_closed(db, monkeypatch, closed):
    """The delivery fact's write-behind failed: it is sent again in the background (the record
    then says delivered). Once the broker is closing, nothing new is started: the journal closes
    next, and a resend would only knock on it for result_horizon."""
    async def scenario() -> tuple[int, list[str]]:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        try:
            broker = _in_process_broker(db, monkeypatch, journal)
            entry = _accepted(journal)
            await entry.commit()
            if closed:
                await broker.close()
            _failed_once(journal, land=False)
            entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
            broker._write_behind(entry)
            await asyncio.sleep(0.1)
            started = len(broker._behind)
            if started:
                await asyncio.wait_for(asyncio.gather(*broker._behind), 10)
            _, stored = await queries.events_of(journal.engine, entry.invocation_id, journal.decode_payload)
            return started, [e.kind.value for e in stored]
        finally:
            await journal.close()
            await journal.engine.dispose()

    started, kinds = asyncio.run(scenario())
    if closed:
        assert (started, kinds) == (0, ["ACTION_ACCEPTED"])
    else:
        assert (started, kinds) == (1, ["ACTION_ACCEPTED", "PREFLIGHT_VALIDATED"])


def test_settling_ends_each_unconfirmed_writes_session_once_and_no_one_elses(request, tmp_path):
    """``Journal.settle`` ends the server sessions that writes the database did not confirm were
    sent on, before the broker reads whether they landed. Promptly: inside one transaction the
    activity view shows an ended session alive, and the wait for it ran to its bound. Each once,
    when two callers settle at once (the second struck off a session nobody had ended). And never
    a session not tagged as the writer's: a pooler may have handed that pid to another client."""
    url = database_url("postgresql", tmp_path, request, migrated=True)
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)

    async def session_of(conn: asyncpg.Connection, tag: str) -> tuple[int, datetime, str]:
        started = await conn.fetchval("SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        return conn.get_server_pid(), started, tag

    async def scenario() -> float:
        engine = make_engine(url)
        journal = Journal(engine, writer="w1")
        await journal.start()
        await _full_history(journal)  # the writer's connection is open, and named
        assert journal._session is not None and journal._session[2].startswith("affidavit-journal-"), journal._session
        victims = [await asyncpg.connect(dsn) for _ in range(2)]
        bystander = await asyncpg.connect(dsn)
        try:
            sessions = []
            for n, victim in enumerate(victims):
                await victim.execute(f"SET application_name = 'affidavit-journal-victim{n}'")
                sessions.append(await session_of(victim, f"affidavit-journal-victim{n}"))
            journal._unsettled[:] = [*sessions, await session_of(bystander, "affidavit-journal-handed-on")]
            began = time.monotonic()
            await asyncio.gather(journal.settle(), journal.settle())
            took = time.monotonic() - began
            assert journal._unsettled == []
            # Asked of the server, not of the victims' own connections: a query on a connection
            # whose session the server has just ended races asyncpg's reading of that news, and
            # may fail with a client-state error instead of a connection error.
            alive = await bystander.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])",
                                             [pid for pid, _, _ in sessions])
            assert alive == 0, "settle returned while an unconfirmed write's session was still alive"
            assert await bystander.fetchval("SELECT 1") == 1, "a session without the tag was left alone"
        finally:
            for conn in (*victims, bystander):
                conn.terminate()
            await journal.close()
            await engine.dispose()
        return took

    assert asyncio.run(scenario()) < 2.0


class _ScriptedJournal:
    """A journal whose writes the test settles one by one: a unit test of InvocationLog's order
    of writes, beside the tests above on real databases."""

    def __init__(self) -> None:
        from proxy.crypto import KeyRing, payload_codec

        self.encode_payload = payload_codec(KeyRing.empty())
        self.writes: list[Write] = []

    def submit(self, write: Write) -> asyncio.Future[None]:
        write.future = asyncio.get_running_loop().create_future()
        self.writes.append(write)
        return write.future

    def defer(self, fn: Callable[..., object], *args: object) -> None:
        pass

    def settle(self, write: Write, error: Exception | None = None) -> None:
        if error is None:
            write.future.set_result(None)
        else:
            write.future.set_exception(error)

    async def next_write(self, after: int) -> Write:
        for _ in range(200):
            if len(self.writes) > after:
                return self.writes[after]
            await asyncio.sleep(0.005)
        raise AssertionError(f"no write after the {after} seen")


RESULT = {"invocation_id": "x", "status": 201, "headers": "[]", "body": b"{}", "body_sha256": "x",
          "framing": "content-length", "key_id": None}


def _dispatched(journal: _ScriptedJournal) -> InvocationLog:
    entry = InvocationLog(journal, identity(), "test")  # type: ignore[arg-type]
    entry.append(EventKind.ACTION_ACCEPTED, agent="builder")
    entry.append(EventKind.PREFLIGHT_VALIDATED, route="payments.create")
    entry.append(EventKind.CREDENTIAL_AUTHORIZED, credential_id="payments-key")
    entry.append(EventKind.DISPATCH_STARTED, attempt=1, connection="new")
    return entry


async def _result_after_a_lost_progress_write() -> tuple[_ScriptedJournal, InvocationLog, asyncio.Future[None]]:
    """A dispatched invocation whose progress write was lost, and its result's commit under way
    (it resends the lost write first: the journal's third write)."""
    journal = _ScriptedJournal()
    entry = _dispatched(journal)
    commit = asyncio.ensure_future(entry.commit())
    journal.settle(await journal.next_write(0))
    await commit
    entry.append(EventKind.REQUEST_SENT)
    entry.submit_quietly()
    journal.settle(journal.writes[1], JournalUnavailable("away"))  # the progress write is lost
    await asyncio.sleep(0)
    entry.append(EventKind.REMOTE_RESPONSE_COMPLETE, status=201, framing="content-length")
    entry.append(EventKind.RESULT_COMMITTED)
    return journal, entry, asyncio.ensure_future(entry.commit(result=RESULT))


def test_a_result_whose_resend_failed_goes_with_its_events_in_the_next_write():
    asyncio.run(_test_a_result_whose_resend_failed_goes_with_its_events_in_the_next_write())


async def _test_a_result_whose_resend_failed_goes_with_its_events_in_the_next_write():
    """A lost progress write must be sent again before the result's; when that resend fails, the
    result's own write is never made: the result stays with its RESULT_COMMITTED for the next
    write of the buffered events (the delivery repair's), which carries it exactly once."""
    journal, entry, commit = await _result_after_a_lost_progress_write()
    journal.settle(await journal.next_write(2), JournalUnavailable("still away"))  # its resend fails
    with pytest.raises(JournalUnavailable):
        await commit
    assert len(journal.writes) == 3, "the result's own write was not made"
    repair = asyncio.ensure_future(entry.resubmit())
    journal.settle(await journal.next_write(3))
    await repair
    entry.append(EventKind.RESULT_DELIVERED, channel="proxy")
    commit = asyncio.ensure_future(entry.commit())
    write = await journal.next_write(4)
    journal.settle(write)
    await commit
    assert write.result is RESULT and [e.kind for e in write.events] == ["REMOTE_RESPONSE_COMPLETE", "RESULT_COMMITTED",
                                                                         "RESULT_DELIVERED"]
    assert [w for w in journal.writes if w.result is not None] == [write], "once"


def test_a_result_taken_by_a_write_nobody_waits_for_during_its_resend_is_not_written_again():
    asyncio.run(_test_a_result_taken_by_a_write_nobody_waits_for_during_its_resend_is_not_written_again())


async def _test_a_result_taken_by_a_write_nobody_waits_for_during_its_resend_is_not_written_again():
    """The caller leaves while the result's commit resends a lost write: the write of its leaving
    (nobody waits for it) takes the buffered events and the result with them; the commit then
    writes what is left, without the result."""
    journal, entry, commit = await _result_after_a_lost_progress_write()
    resend = await journal.next_write(2)
    entry.append(EventKind.CALLER_CANCELLED, disposition="disconnected")
    entry.submit_quietly()
    journal.settle(resend)
    journal.settle(await journal.next_write(3))
    journal.settle(await journal.next_write(4))
    await commit
    carrying = [w for w in journal.writes if w.result is not None]
    assert carrying == [journal.writes[3]], [(len(w.events), w.result is not None) for w in journal.writes]
    assert "RESULT_COMMITTED" in [e.kind for e in carrying[0].events]


def test_a_write_the_stop_refuses_is_told_the_broker_is_stopping_not_to_check_the_database(db, monkeypatch, caplog):
    """A request that reaches a journal write after the stop closed the journal (accepted just
    before the proxy stopped listening) was told 'The broker cannot write its journal ...;
    operators: check the database', and nothing was logged (found by a probe)."""
    async def scenario() -> tuple[dict, dict]:
        journal = Journal(make_engine(db), writer="w1")
        await journal.start()
        try:
            broker = _in_process_broker(db, monkeypatch, journal)
            broker.stopping = True  # the stop has begun, but its journal still takes writes: a failure is the database's
            before = json.loads(broker._journal_unavailable().body)
            await journal.close()
            return before, json.loads(broker._journal_unavailable().body)
        finally:
            await journal.close()
            await journal.engine.dispose()

    caplog.set_level("INFO", logger="affidavit.broker")
    before, during = asyncio.run(scenario())
    assert "operators: check the database" in before["error"]["message"]
    message = during["error"]["message"]
    assert message.startswith("The broker is stopping (a restart or a scale-down) and its journal takes no more writes, "
                              "so it sent nothing"), message
    assert "check the database" not in message and during["error"]["retry"] == "backoff"
    assert "after the stop had closed the journal" in caplog.text
