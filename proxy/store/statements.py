"""The plain statements of a journal transaction, on either kind of connection.

The journal writer (:mod:`proxy.store.journal`) decides what a batch writes and in which order;
these classes only say how: :class:`CoreStatements` through SQLAlchemy Core on a synchronous
connection (PostgreSQL's path for large results and isolated retries), :class:`SqliteStatements`
through Python's ``sqlite3`` directly (the embedded journal's every commit, in its writer process,
see :mod:`proxy.store.sqlite_writer`, and its isolated retries, in a thread). The second skips
SQLAlchemy's per-row parameter processing; it stores values exactly as SQLAlchemy does for these
tables (times as UTC text ``YYYY-MM-DD HH:MM:SS.ffffff``, booleans as 0/1), so every reader sees
the same rows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, bindparam, insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from .schema import events, invocations, results


@dataclass(slots=True)
class Fence:
    """Write only if the invocation is still at ``generation`` and owned by ``owner``.

    ``check_expiry`` adds "and the lease has not run out": required for the dispatch write (a
    worker whose lease expired is fenced before it dispatches), not for later facts about an
    exchange that already started.
    """

    invocation_id: str
    generation: int
    owner: str
    now: datetime
    check_expiry: bool = False


#: The projection columns every update rewrites (see proxy.contract.Record).
PROJECTION_COLUMNS = (
    "updated_at",
    "stage",
    "phase",
    "outcome",
    "retry",
    "code",
    "caller_disposition",
    "dispatch_started",
    "dispatch_seq",
    "status",
    "last_seq",
    "attempts_used",
    "credential_id",
    "credential_version",
    "injection",
    "owner",
    "lease_expires_at",
)

_IDEMPOTENCY = ("agent", "idempotency_scope", "idempotency_key")


class CoreStatements:
    """The journal's statements through SQLAlchemy Core on a synchronous connection."""

    integrity_errors: tuple[type[Exception], ...] = (IntegrityError,)

    _update_projection = (
        update(invocations)
        .where(invocations.c.invocation_id == bindparam("b_invocation_id"))
        .values({name: bindparam(name) for name in PROJECTION_COLUMNS})
    )

    def __init__(self, conn: Connection):
        self.conn = conn

    @contextmanager
    def transaction(self) -> Iterator[None]:
        outer = None if self.conn.in_transaction() else self.conn.begin()
        try:
            yield
        except BaseException:
            if outer is not None:
                outer.rollback()
            raise
        if outer is not None:
            outer.commit()

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        with self.conn.begin_nested():
            yield

    def holds(self, fence: Fence) -> bool:
        c = invocations.c
        condition = and_(c.invocation_id == fence.invocation_id, c.generation == fence.generation, c.owner == fence.owner)
        if fence.check_expiry:
            condition = and_(condition, c.lease_expires_at > fence.now)
        return self.conn.execute(update(invocations).where(condition).values(updated_at=fence.now)).rowcount == 1

    def claim(self, row: dict[str, Any]) -> bool:
        statement = (pg_insert if self.conn.dialect.name == "postgresql" else sqlite_insert)(invocations).values(row)
        statement = statement.on_conflict_do_nothing(index_elements=list(_IDEMPOTENCY)).returning(invocations.c.invocation_id)
        return self.conn.execute(statement).first() is not None

    def insert(self, table: Table, rows: list[dict[str, Any]]) -> None:
        self.conn.execute(insert(table), rows)

    def update_projections(self, rows: list[dict[str, Any]]) -> None:
        self.conn.execute(self._update_projection, rows)


#: Bound variables per statement: SQLite's limit before 3.32, safe on every build.
_SQLITE_VARIABLES = 999


class SqliteStatements:
    """The journal's statements through ``sqlite3`` (one connection, its writer's own)."""

    integrity_errors: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)

    _update_projection = (
        f"UPDATE invocations SET {', '.join(f'{name} = ?' for name in PROJECTION_COLUMNS)} WHERE invocation_id = ?"
    )
    # The rows of a VALUES list are named column1, column2, ... in SQLite.
    _update_from = (
        f"UPDATE invocations SET {', '.join(f'{name} = v.column{i}' for i, name in enumerate(PROJECTION_COLUMNS, 1))}"
        " FROM (VALUES"
    )
    _update_group = f"({', '.join('?' * (len(PROJECTION_COLUMNS) + 1))})"
    _update_where = f") AS v WHERE invocation_id = v.column{len(PROJECTION_COLUMNS) + 1}"

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    @classmethod
    def connect(cls, path: str, timeout: float) -> SqliteStatements:
        """WAL (readers beside the writer), FULL (each commit durable), explicit transactions."""
        conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, cached_statements=256)
        sqlite_pragmas(conn, timeout)
        return cls(conn)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        # IMMEDIATE: take the write lock up front so concurrent broker processes queue, not deadlock.
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        self.conn.execute("SAVEPOINT journal_write")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK TO journal_write")
            self.conn.execute("RELEASE journal_write")
            raise
        self.conn.execute("RELEASE journal_write")

    def holds(self, fence: Fence) -> bool:
        sql = "UPDATE invocations SET updated_at = ? WHERE invocation_id = ? AND generation = ? AND owner = ?"
        values: list[Any] = [_stored(fence.now), fence.invocation_id, fence.generation, fence.owner]
        if fence.check_expiry:
            sql += " AND lease_expires_at > ?"
            values.append(_stored(fence.now))
        return self.conn.execute(sql, values).rowcount == 1

    def claim(self, row: dict[str, Any]) -> bool:
        sql, values = _multi_row_insert("invocations", list(row), [row])
        return self.conn.execute(f"{sql} ON CONFLICT ({', '.join(_IDEMPOTENCY)}) DO NOTHING", values).rowcount == 1

    def insert(self, table: Table, rows: list[dict[str, Any]]) -> None:
        """All rows in as few statements as the variable limit allows (one step each, rather than
        one per row: fewer statements to prepare and, in a thread, fewer GIL hand-overs)."""
        columns = list(rows[0])
        for chunk in _chunks(rows, len(columns)):
            self.conn.execute(*_multi_row_insert(table.name, columns, chunk))

    def update_projections(self, rows: list[dict[str, Any]]) -> None:
        """All updates in as few statements as the variable limit allows (``UPDATE ... FROM
        (VALUES ...)``, SQLite 3.33+): one statement instead of one per row (in a thread beside
        the event loop, every statement waits for the GIL). Of two updates of one invocation the
        later wins, as it would one statement after the other."""
        latest = list({row["b_invocation_id"]: row for row in rows}.values())
        if sqlite3.sqlite_version_info < (3, 33):
            self.conn.executemany(self._update_projection, [_update_values(row) for row in latest])
            return
        for chunk in _chunks(latest, len(PROJECTION_COLUMNS) + 1):
            sql = f"{self._update_from} {', '.join([self._update_group] * len(chunk))}{self._update_where}"
            self.conn.execute(sql, [value for row in chunk for value in _update_values(row)])


def store_rows(
    statements: CoreStatements | SqliteStatements,
    inserts: list[dict[str, Any]],
    event_rows: list[dict[str, Any]],
    updates: list[dict[str, Any]],
    stored: list[dict[str, Any]],
) -> None:
    """A batch's rows, in the order every journal path writes them: new invocations, events,
    projection updates (keyed by ``b_invocation_id``), stored results."""
    if inserts:
        statements.insert(invocations, inserts)
    if event_rows:
        statements.insert(events, event_rows)
    if updates:
        statements.update_projections(updates)
    if stored:
        statements.insert(results, stored)


def sqlite_pragmas(target: sqlite3.Connection | sqlite3.Cursor, timeout: float) -> None:
    """Every journal connection: WAL (readers beside the writer), FULL (each commit durable),
    and a busy timeout (other broker processes hold the write lock briefly)."""
    target.execute("PRAGMA journal_mode=WAL")
    target.execute("PRAGMA synchronous=FULL")
    target.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")


def _chunks(rows: list[dict[str, Any]], variables_per_row: int) -> Iterator[list[dict[str, Any]]]:
    """``rows`` in slices that each fit one statement under the variable limit."""
    per_statement = max(1, _SQLITE_VARIABLES // variables_per_row)
    for start in range(0, len(rows), per_statement):
        yield rows[start : start + per_statement]


def _multi_row_insert(table: str, columns: list[str], rows: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    group = f"({', '.join('?' * len(columns))})"
    sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([group] * len(rows))}"
    return sql, [_stored(row[name]) for row in rows for name in columns]


def _update_values(row: dict[str, Any]) -> list[Any]:
    return [*(_stored(row[name]) for name in PROJECTION_COLUMNS), row["b_invocation_id"]]


def _stored(value: Any) -> Any:
    """A value as SQLAlchemy's SQLite dialect stores it (times: naive text, the zone dropped)."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=None).isoformat(" ", "microseconds")
    return value
