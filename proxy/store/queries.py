"""Reads of the journal for the side API and the CLI (Core statements, no ORM)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, Iterator

import asyncio
import errno
import socket
import sqlite3

import asyncpg
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError, DisconnectionError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from ..contract import ENDED, Event, EventKind, UnreadableRecord
from ..crypto import PayloadDecoder, ResultDecoder
from ..invocation_view import owner_view
from .schema import brokers, events, invocations, results
from .reading import reading

#: What a read of the journal raises when it fails: because the database is away, or because it
#: answered the query with an error. :func:`unreachable` tells the two apart.
DATABASE_ERRORS = (SQLAlchemyError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                   sqlite3.Error, OSError, asyncio.TimeoutError)

#: PostgreSQL's SQLSTATE classes that mean it cannot serve now, whatever the query: a connection
#: exception (08), a login refused (28), insufficient resources (53: too many connections, disk
#: full), operator intervention (57: shutting down, starting up, a statement timeout) and system
#: errors (58: I/O).
_PG_AWAY_CLASSES = frozenset({"08", "28", "53", "57", "58"})
#: And single codes: no such database (3D000), a read-only one (25006: a standby), a lock not
#: granted in time (55P03).
_PG_AWAY_CODES = frozenset({"3D000", "25006", "55P03"})
#: SQLite's primary result codes for the same: another process holds the file, it cannot be
#: opened, written or read, or memory ran out.
_SQLITE_AWAY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_READONLY,
                          sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN})
#: Their messages, for an error that carries no code (one passed on from the SQLite writer process).
_SQLITE_AWAY_TEXT = ("database is locked", "database table is locked", "unable to open database", "disk I/O error",
                     "database or disk is full", "attempt to write a readonly database", "out of memory")
#: asyncpg's InterfaceError is mostly a misuse of the driver; these messages are a closed connection.
_ASYNCPG_CLOSED = ("connection is closed", "pool is closed", "pool is closing")


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a use of the journal, means the database cannot be reached or
    cannot serve now (down, restarting, out of connections, locked, too slow, its prepared
    statements stale after a migration), which waiting may cure. False when it answered with an error about the query itself (a missing table or column,
    a broken constraint, a bug): that is no outage, and must not be reported as one.

    SQLAlchemy and its drivers wrap the cause (``orig``, ``__cause__``): the whole chain is looked at.
    """
    return any(_away(error) for error in causes(exc))


def what_to_check(exc: BaseException) -> str:
    """For an error :func:`unreachable` says is an outage: which part of the database URL it points
    at (host, port, database name, credentials) and what to check, or all of them when it does not say."""
    for error in causes(exc):
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(error, socket.gaierror):
            return "its host name does not resolve; check the host (a typo, or DNS)"
        if isinstance(error, ConnectionRefusedError):
            return "nothing accepts connections at its host and port; check that the database is up and listening there"
        if sqlstate == "3D000":
            return "the server has no database of that name; check the database name"
        if isinstance(sqlstate, str) and sqlstate.startswith("28"):
            return ("the server refused the login; check the user name and the password (PGPASSWORD, or the URL's), "
                    "and that the server's pg_hba.conf lets this user reach this database from this host (and over SSL or not)")
        if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
            return "it did not answer in time; check that the database is up and that its host and port are right"
        if _is(error, sqlite3.SQLITE_FULL, errno.ENOSPC, "53100", "database or disk is full"):
            return ("the disk that holds it (or its quota) is full; free space there (the journal only grows: see "
                    "docs/operations.md, \"Disk\")")
        if read_only(error):
            return ("it is read-only here (a read-only mount or file, a directory this user cannot write, or a "
                    "PostgreSQL standby), and the broker must write its journal; give this user write access, or "
                    "point the URL at the primary")
        if _is(error, sqlite3.SQLITE_CANTOPEN, errno.EACCES, None, "unable to open database file"):
            return ("the SQLite file could not be opened; check that it and its directory exist and that this user "
                    "may read and write both (SQLite keeps its -wal and -shm files beside it)")
        if damaged(error):
            return ("its storage is damaged (a bad disk, a bad copy; for SQLite, also another file at that path, which "
                    f"is no database at all): check that it names the broker's journal; if it does, {DAMAGED_ADVICE}")
        if isinstance(error, sqlite3.Error):
            return "the SQLite file could not be used; check that no other process holds it locked and that it is readable"
    return "check that the database is up and that its host, port, database name and credentials are right"


def _is(error: BaseException, sqlite_code: int, os_errno: int | None, sqlstate: str | None, sqlite_text: str) -> bool:
    """Whether ``error`` is one failure as SQLite (by code, or by message when passed on from the
    SQLite writer process), the operating system, or PostgreSQL (by SQLSTATE) report it."""
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        return code & 0xFF == sqlite_code if code is not None else sqlite_text in str(error)
    if isinstance(error, OSError):
        return os_errno is not None and error.errno == os_errno
    return sqlstate is not None and getattr(error, "sqlstate", None) == sqlstate


#: What to do about a journal whose storage is damaged (see :func:`damaged`), wherever it is met.
DAMAGED_ADVICE = ("keep the damaged file or database, run `affidavit audit verify`, and restore the journal from a "
                  "backup (docs/operations.md, Backups)")


def read_only(exc: BaseException) -> bool:
    """Whether ``exc`` says the journal refuses writes for good: a PostgreSQL standby or
    read-only transaction (25006), a read-only SQLite file or mount."""
    return any(_is(error, sqlite3.SQLITE_READONLY, errno.EROFS, "25006", "attempt to write a readonly database")
               for error in causes(exc))


def damaged(exc: BaseException) -> bool:
    """Whether ``exc`` says the journal's storage is damaged: SQLite's "database disk image is
    malformed" (or a file that is no database), PostgreSQL's data or index corruption (XX001,
    XX002). No retry cures it; a backup does."""
    return any(_is(error, sqlite3.SQLITE_CORRUPT, None, "XX001", "database disk image is malformed")
               or _is(error, sqlite3.SQLITE_NOTADB, None, "XX002", "file is not a database") for error in causes(exc))


def schema_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the database has no such table or column: a journal never upgraded
    (or upgraded by an older version), which ``affidavit db upgrade`` cures."""
    return any(
        type(error).__name__ in ("UndefinedTableError", "UndefinedColumnError")
        or "no such table" in str(error) or "no such column" in str(error)
        for error in causes(exc)
    )


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every error it wraps (SQLAlchemy's ``orig``, ``__cause__``), each once."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        error = chain.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        chain += [getattr(error, "orig", None), error.__cause__]


def _away(error: BaseException) -> bool:
    if isinstance(error, (OSError, asyncio.TimeoutError, PoolTimeout, DisconnectionError)):
        return True  # refused, reset, unresolvable, timed out; no pooled connection free in time
    if isinstance(error, DBAPIError):
        return error.connection_invalidated  # SQLAlchemy's dialect saw the connection end
    if isinstance(error, asyncpg.InterfaceError):
        return str(error).startswith(_ASYNCPG_CLOSED)
    if isinstance(error, asyncpg.InvalidCachedStatementError):
        return True  # prepared before another process changed the schema (a migration): the next try prepares it anew
    if isinstance(error, asyncpg.InternalClientError):
        # The driver lost track of its connection's state: seen when the server ends the session
        # in the middle of a query (an administrator's pg_terminate_backend). A new connection cures it.
        return True
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in _SQLITE_AWAY
        return any(phrase in str(error) for phrase in _SQLITE_AWAY_TEXT)
    sqlstate = getattr(error, "sqlstate", None)  # asyncpg's errors, and SQLAlchemy's adapted ones
    return isinstance(sqlstate, str) and (sqlstate[:2] in _PG_AWAY_CLASSES or sqlstate in _PG_AWAY_CODES)


def _row(row: Any) -> dict[str, Any]:
    """A row as a dict, its times in UTC with their offset (SQLite returns them without one)."""
    return {k: _utc(v) if isinstance(v, datetime) else v for k, v in row.items()}


async def invocation(engine: AsyncEngine, invocation_id: str) -> dict[str, Any] | None:
    async with reading(engine) as conn:
        row = (await conn.execute(select(invocations).where(invocations.c.invocation_id == invocation_id))).mappings().first()
    return _row(row) if row else None


async def event_rows(engine: AsyncEngine, invocation_id: str) -> list[dict[str, Any]]:
    async with reading(engine) as conn:
        rows = (
            await conn.execute(select(events).where(events.c.invocation_id == invocation_id).order_by(events.c.seq))
        ).mappings().all()
    return [_row(r) for r in rows]


def decode_events(rows: list[dict[str, Any]], decode: PayloadDecoder) -> list[Event]:
    """Events from stored rows; ``decode`` opens encrypted payloads (``Journal.decode_payload``). An
    event kind this version does not know is :class:`~proxy.contract.UnreadableRecord`."""
    return [
        Event(_kind(row), decode(bytes(row["payload"]), row["key_id"], row["invocation_id"], row["seq"]), row["seq"])
        for row in rows
    ]


_ENDED_STAGES = frozenset(s.value for s in ENDED)


def _kind(row: dict[str, Any]) -> EventKind:
    try:
        return EventKind(row["kind"])
    except ValueError:
        raise UnreadableRecord(f"event {row['seq']} of kind {row['kind']!r}") from None


async def events_of(engine: AsyncEngine, invocation_id: str, decode: PayloadDecoder) -> tuple[list[dict[str, Any]], list[Event]]:
    """The stored rows of an invocation's events and the events they hold, in sequence order."""
    rows = await event_rows(engine, invocation_id)
    return rows, decode_events(rows, decode)


async def events_after(engine: AsyncEngine, invocation_id: str, seq: int, decode: PayloadDecoder) -> list[Event]:
    """Events appended after ``seq`` (by another process, e.g. an operator's decision)."""
    query = select(events).where(events.c.invocation_id == invocation_id, events.c.seq > seq).order_by(events.c.seq)
    async with reading(engine) as conn:
        rows = [_row(r) for r in (await conn.execute(query)).mappings().all()]
    return decode_events(rows, decode)


async def held(engine: AsyncEngine, after: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
    """Invocations waiting for an operator's approval, oldest first (by id, which grows with time),
    those after the invocation id ``after`` (paging)."""
    c = invocations.c
    query = select(invocations).where(c.stage == "held").order_by(c.invocation_id).limit(limit)
    if after is not None:
        query = query.where(c.invocation_id > after)
    async with reading(engine) as conn:
        return [_row(r) for r in (await conn.execute(query)).mappings().all()]


async def approval_requests(engine: AsyncEngine, invocation_ids: list[str], decode: PayloadDecoder) -> dict[str, dict[str, Any]]:
    """The card of each of ``invocation_ids``: the data of its latest ``APPROVAL_REQUESTED``
    event, in one query for them all (an invocation with none is absent)."""
    if not invocation_ids:
        return {}
    query = (select(events)
             .where(events.c.invocation_id.in_(invocation_ids), events.c.kind == EventKind.APPROVAL_REQUESTED.value)
             .order_by(events.c.invocation_id, events.c.seq))
    async with reading(engine) as conn:
        rows = [_row(r) for r in (await conn.execute(query)).mappings().all()]
    latest = {row["invocation_id"]: row for row in rows}  # in seq order: the last one stays
    return {invocation_id: event.data for invocation_id, event in zip(latest, decode_events(list(latest.values()), decode))}


_RESULT_COLUMNS = (
    results.c.invocation_id.label("result_of"),
    results.c.status.label("result_status"),
    results.c.headers.label("result_headers"),
    results.c.body.label("result_body"),
    results.c.key_id.label("result_key_id"),
)


async def invocation_with_result(engine: AsyncEngine, invocation_id: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The invocation's row and its stored result (still sealed: ``open_result``), one query."""
    query = (
        select(invocations, *_RESULT_COLUMNS)
        .select_from(invocations.outerjoin(results, results.c.invocation_id == invocations.c.invocation_id))
        .where(invocations.c.invocation_id == invocation_id)
    )
    async with reading(engine) as conn:
        found = (await conn.execute(query)).mappings().first()
    if found is None:
        return None, None
    row = {k: v for k, v in found.items() if not k.startswith("result_")}
    if found["result_of"] is None:
        return row, None
    stored = {"status": found["result_status"], "headers": found["result_headers"], "body": found["result_body"],
              "key_id": found["result_key_id"]}
    return row, stored


def open_result(invocation_id: str, stored: dict[str, Any], decode: ResultDecoder) -> tuple[bytes, list[tuple[str, str]]]:
    """The body and header pairs of a stored result (decrypted when it was sealed)."""
    body, headers = decode(invocation_id, bytes(stored["body"]), stored["headers"], stored["key_id"])
    return body, json.loads(headers)


async def stored_result(engine: AsyncEngine, invocation_id: str, decode: ResultDecoder) -> dict[str, Any] | None:
    """The stored result with its body and headers opened; ``headers`` as a list of pairs."""
    row = await result(engine, invocation_id)
    if row is None:
        return None
    body, headers = decode(invocation_id, bytes(row["body"]), row["headers"], row["key_id"])
    return {**row, "body": body, "headers": json.loads(headers)}


async def result(engine: AsyncEngine, invocation_id: str) -> dict[str, Any] | None:
    async with reading(engine) as conn:
        row = (await conn.execute(select(results).where(results.c.invocation_id == invocation_id))).mappings().first()
    return _row(row) if row else None


#: No invocation is older than this: a window reaching further back (even past year 1, where
#: datetime ends) starts here, and lists everything.
NOTHING_EARLIER = datetime(1970, 1, 1, tzinfo=UTC)


def window_start(seconds: float) -> datetime:
    """The start of a time window of ``seconds`` that ends now (``since`` for list_invocations)."""
    now = datetime.now(UTC)
    if seconds >= (now - NOTHING_EARLIER).total_seconds():
        return NOTHING_EARLIER
    return now - timedelta(seconds=seconds)


async def outcome_counts(engine: AsyncEngine, since: datetime, route: str | None = None) -> list[tuple[str, str, int]]:
    """(phase, outcome, count) of the invocations created since ``since`` that have ended: what
    the invocation_outcomes view holds, read through the index on created_at rather than the
    view's hour buckets (an expression no index serves: on a big journal, every row)."""
    c = invocations.c
    query = (select(c.phase, c.outcome, func.count()).where(c.created_at >= since, c.stage.in_(_ENDED_STAGES))
             .group_by(c.phase, c.outcome))
    if route is not None:
        query = query.where(c.route == route)
    async with reading(engine) as conn:
        return [(phase, outcome, int(n)) for phase, outcome, n in (await conn.execute(query)).all()]


async def list_invocations(
    engine: AsyncEngine,
    *,
    agent: str | None = None,
    outcome: str | None = None,
    phase: str | None = None,
    route: str | None = None,
    code: str | None = None,
    since: datetime | None = None,
    before: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    c = invocations.c
    query = select(invocations).order_by(c.invocation_id.desc()).limit(limit)
    for column, value in ((c.agent, agent), (c.outcome, outcome), (c.phase, phase), (c.route, route), (c.code, code)):
        if value is not None:
            query = query.where(column == value)
    if since is not None:
        query = query.where(c.created_at >= since)
    if before is not None:
        query = query.where(c.invocation_id < before)
    async with reading(engine) as conn:
        return [_row(r) for r in (await conn.execute(query)).mappings().all()]


async def holder(engine: AsyncEngine, row: dict[str, Any], stale_after: float) -> dict[str, Any] | None:
    """For an operator's view of ``row``'s record while it is in flight: who holds it and whether
    that broker still beats (:func:`~proxy.invocation_view.owner_view`); None once it has ended."""
    if row["stage"] in _ENDED_STAGES:
        return None
    beat, now = await heartbeat_of(engine, row["owner"])
    return owner_view(row["owner"], beat, now, stale_after)


async def heartbeat_of(engine: AsyncEngine, owner: str) -> tuple[datetime | None, datetime]:
    """When ``owner`` last wrote its heartbeat (None: never, or not under that name), and now, by
    the clock that stamps heartbeats: PostgreSQL's own, this host's on SQLite."""
    async with reading(engine) as conn:
        beat = (await conn.execute(select(brokers.c.heartbeat_at).where(brokers.c.owner == owner))).scalar()
        now = (await conn.execute(select(func.now()))).scalar() if conn.dialect.name == "postgresql" else None
    return _utc(beat), _utc(now) or datetime.now(UTC)


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without a zone; they were written in UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


async def ping(engine: AsyncEngine) -> None:
    async with reading(engine) as conn:
        await conn.execute(text("SELECT 1"))
