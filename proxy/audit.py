"""Offline verification of the audit chain, over the stored bytes, without any key.

Each journal writer (one broker process incarnation) keeps its own hash chain: its events carry
``writer``, ``writer_seq`` (1, 2, 3...), ``prev_hash`` (the previous event's ``hash``, or
:data:`GENESIS` for the first) and ``hash`` = :func:`~proxy.store.journal.chain_hash` of every
other stored column, ciphertext included. Checkpoints (``chain_checkpoints``) say how far a
chain reached and with which hash.

:func:`verify` is pure (no I/O). It walks each chain through positions 1, 2, 3... and stops at
the first position ``n`` that does not hold what the writer wrote there. Two notions decide:

* a row *fits at* ``n`` when its hash recomputes with ``writer_seq = n``;
* the *rightful* row for ``n`` fits at ``n`` and links (``prev_hash``) to the hash accepted at
  ``n - 1``; of two such rows, the one the chain continues through wins.

The damage at ``n`` is named from that evidence, in this order:

=================================================  ===========================================
what position ``n`` holds                          finding
=================================================  ===========================================
nothing; the rightful row is stored elsewhere      reordered (it was moved away from ``n``)
nothing, and no row fits here                      deleted (``n``.. up to the next stored row)
several rows                                       inserted (the one that is not rightful)
a row, while the rightful row is stored elsewhere  reordered if the row fits at another
                                                   position (rows swapped), else inserted
                                                   (the rightful row was pushed along)
a row that hashes only with another ``seq`` of     reordered (events of one invocation
its invocation                                     swapped)
a row that fits at a later position                deleted (rows removed, later ones
                                                   renumbered to close the gap)
a row that fits at an earlier position             inserted (a copy of a taken position)
an intact row chained to another predecessor       modified at ``n - 1`` (that row was replaced
                                                   by one with a recomputed hash); at ``n = 1``:
                                                   modified (a chain starts at GENESIS)
a row that does not hash to its ``hash``           modified (content changed after writing)
=================================================  ===========================================

Before those rules, a row whose ``writer`` was changed is named as such (modified) in both
chains: in its own chain, where its position is empty and the row that fits there is stored
under another writer, and in the chain its ``writer`` now names, where it hashes only with the
writer it was written by.

Checkpoints then: one beyond the chain's last row means the tail was cut (deleted, at the first
missing position); one inside the verified prefix whose hash differs means the chain was
re-hashed after the checkpoint (rewritten, at the checkpoint's position).

Separately, each invocation's ``seq`` must run 1, 2, 3... without gaps or doubles.

:func:`verify` holds and indexes every row it is given. :func:`verify_database` does not give
it a live journal whole (millions of events would take gigabytes): it streams the chains and
checks each in constant memory, lets the database check the invocations' seqs, and hands
:func:`verify` only the damaged part, with the same findings (see :class:`_Walk`).

A chain has no key, so an attacker who can write the database can append well-formed rows to
the end of a chain, or re-hash a whole chain; only checkpoints kept elsewhere (an earlier
``audit export``) show the latter. docs/audit.md says what each finding means.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Set
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, NamedTuple

from sqlalchemy import LargeBinary, String, and_, cast, distinct, exists, func, inspect, not_, or_, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from .store.journal import GENESIS, brief, canonical_time, chain_hash
from .store.migrate import connect_args
from .store.schema import events, invocations as invocations_table, results as results_table
from .store.vault_schema import (
    CHECKPOINT_EVERY_EVENTS,
    CHECKPOINT_EVERY_SECONDS,
    chain_checkpoints,
    checkpoint_due,
    checkpoint_row,
)

__all__ = [
    "CHECKPOINT_EVERY_EVENTS",
    "CHECKPOINT_EVERY_SECONDS",
    "AuditInputError",
    "AuditResult",
    "Break",
    "Damage",
    "Export",
    "checkpoint_due",
    "checkpoint_row",
    "export_events",
    "load_database",
    "read_checkpoints",
    "read_dump",
    "read_export",
    "verify",
    "verify_database",
    "verify_dump",
]

Row = Mapping[str, Any]
EXPORT_FORMAT = "affidavit-audit-export"
#: 2: the file ends with a line counting its events and checkpoints (1 had none).
EXPORT_VERSION = 2
_EXPORT_END = "affidavit-audit-export-end"


class Damage(StrEnum):
    MODIFIED = "modified"
    DELETED = "deleted"
    INSERTED = "inserted"
    REORDERED = "reordered"
    REWRITTEN = "rewritten"


class AuditInputError(Exception):
    """The database or dump cannot be read as a journal (not the same as a broken chain)."""


@dataclass(frozen=True, slots=True)
class Break:
    """The first position in one chain (or one invocation) that is not what was written."""

    kind: Damage
    writer: str | None
    writer_seq: int | None
    invocation_id: str | None
    seq: int | None
    detail: str

    def position(self) -> str:
        parts = []
        if self.writer is not None:
            parts.append(f"writer {self.writer} writer_seq {self.writer_seq}")
        if self.invocation_id is not None:
            parts.append(f"invocation {self.invocation_id}" + (f" seq {self.seq}" if self.seq is not None else ""))
        return ", ".join(parts) or "unknown position"

    def describe(self) -> str:
        return f"{self.position()}: {self.kind.value}: {self.detail}"


@dataclass(slots=True)
class AuditResult:
    events: int = 0
    writers: int = 0
    invocations: int = 0
    checkpoints: int = 0
    #: The first break of each broken chain (by writer name), then invocation-level breaks.
    breaks: list[Break] = field(default_factory=list)
    #: The SQLite file was read as immutable: it could not be opened for shared reading (a
    #: read-only file system or directory), so a -wal file beside it went unread.
    read_immutable: bool = False
    #: The dump has no end line (an older affidavit's export): a cut at a line boundary is unseen.
    unended: bool = False
    #: Tables beside the chain that this database role may not read (an auditor granted only
    #: ``events`` and ``chain_checkpoints``): the checks that read them were not made.
    unreadable: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def first(self) -> Break | None:
        return self.breaks[0] if self.breaks else None


# -- the pure part -------------------------------------------------------------------------


def verify(rows: Iterable[Row], checkpoints: Iterable[Row] = (), *, writers: Iterable[str] | None = None) -> AuditResult:
    """Check every writer's chain, every invocation's ``seq`` and every checkpoint. No key needed.

    ``writers``: walk only these chains (their every row must be in ``rows``; rows of other
    writers are there only as their invocations' other events). The counts are then those of
    ``rows``, not of a journal: :func:`verify_database` diagnoses the damaged part this way.
    """
    rows = list(rows)
    checkpoints = list(checkpoints)
    by_writer: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_writer[row["writer"]].append(row)
    marks: dict[str, list[Row]] = defaultdict(list)
    for mark in checkpoints:
        marks[mark["writer"]].append(mark)
    invocations = _Invocations(rows)
    elsewhere = _Elsewhere(rows, set(by_writer) | set(marks))
    distinct = {(str(m["writer"]), int(m["writer_seq"]), str(m["hash"])) for m in checkpoints}  # an earlier export repeats the database's own
    result = AuditResult(events=len(rows), writers=len(by_writer), invocations=len(invocations.seqs), checkpoints=len(distinct))
    for writer in sorted(set(by_writer) | set(marks) if writers is None else set(writers)):
        found = _Chain(writer, by_writer.get(writer, []), invocations, elsewhere).check(marks.get(writer, []))
        if found is not None:
            result.breaks.append(found)
    result.breaks.extend(invocations.breaks())
    return result


def _fits(row: Row, **position: Any) -> bool:
    """Whether ``row`` hashes to its stored ``hash`` with ``position`` (e.g. writer_seq=5) in place."""
    try:
        return chain_hash({**row, **position}) == row["hash"]
    except (KeyError, TypeError, ValueError):
        return False


def _who(row: Row | None) -> tuple[str | None, int | None]:
    return (row["invocation_id"], int(row["seq"])) if row is not None else (None, None)


class _Invocations:
    """Each invocation's stored seqs, for the contiguity check and to name a deleted row."""

    def __init__(self, rows: list[Row]):
        seqs: dict[str, dict[int, list[Row]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            seqs[row["invocation_id"]][int(row["seq"])].append(row)
        self.seqs = {invocation_id: dict(by_seq) for invocation_id, by_seq in seqs.items()}

    def others(self, row: Row) -> list[int]:
        return [s for s in self.seqs[row["invocation_id"]] if s != int(row["seq"])]

    def gaps(self) -> list[tuple[str, int]]:
        out = []
        for invocation_id, by_seq in self.seqs.items():
            out.extend((invocation_id, s) for s in range(1, max(by_seq) + 1) if s not in by_seq)
        return out

    def deleted_between(self, writer: str, first: int, last: int) -> tuple[str | None, int | None]:
        """The one (invocation, seq) missing whose neighbours in ``writer`` bracket ``first..last``."""
        found = []
        for invocation_id, s in self.gaps():
            before = [r for r in self.seqs[invocation_id].get(s - 1, []) if r["writer"] == writer]
            after = [r for r in self.seqs[invocation_id].get(s + 1, []) if r["writer"] == writer]
            if all(int(r["writer_seq"]) < first for r in before) and all(int(r["writer_seq"]) > last for r in after):
                found.append((invocation_id, s))
        return found[0] if len(found) == 1 else (None, None)

    def breaks(self) -> list[Break]:
        """The first seq of each invocation that is missing, doubled or below 1."""
        out = []
        for invocation_id in sorted(self.seqs):
            by_seq = self.seqs[invocation_id]
            for s in range(min(min(by_seq), 1), max(by_seq) + 1):
                rows = by_seq.get(s, [])
                if s < 1 and rows:
                    out.append(Break(Damage.INSERTED, rows[0]["writer"], int(rows[0]["writer_seq"]), invocation_id, s, "an event with a seq below 1, which no broker writes"))
                elif s >= 1 and not rows:
                    out.append(Break(Damage.DELETED, None, None, invocation_id, s, "the invocation's events skip this seq: an event was removed"))
                elif len(rows) > 1:
                    out.append(Break(Damage.INSERTED, rows[1]["writer"], int(rows[1]["writer_seq"]), invocation_id, s, "two events claim this seq"))
                else:
                    continue
                break
        return out


class _Elsewhere:
    """Every chain's rows by the hash they link to, and every writer's name: a row whose ``writer``
    column was changed is stored in another chain than the one it was written in."""

    def __init__(self, rows: list[Row], writers: Set[str]):
        self.by_prev: dict[str, list[Row]] = defaultdict(list)
        for row in rows:
            self.by_prev[row["prev_hash"]].append(row)
        self.writers = sorted(writers)

    def moved_from(self, writer: str, n: int, prev: str) -> Row | None:
        """The row written by ``writer`` at ``n`` (after ``prev``), now stored under another writer."""
        return next((r for r in self.by_prev.get(prev, []) if r["writer"] != writer and _fits(r, writer=writer, writer_seq=n)), None)

    def written_by(self, row: Row) -> str | None:
        """The other writer ``row`` hashes as (its ``writer`` column was changed), if any."""
        return next((w for w in self.writers if w != row["writer"] and _fits(row, writer=w)), None)


class _Chain:
    """One writer's rows, indexed by stored position and by the hashes they link."""

    def __init__(self, writer: str, rows: list[Row], invocations: _Invocations, elsewhere: _Elsewhere):
        self.writer = writer
        self.invocations = invocations
        self.elsewhere = elsewhere
        by_ws: dict[int, list[Row]] = defaultdict(list)
        by_prev: dict[str, list[Row]] = defaultdict(list)
        by_hash: dict[str, list[Row]] = defaultdict(list)
        for row in sorted(rows, key=lambda r: (int(r["writer_seq"]), str(r["hash"]))):
            by_ws[int(row["writer_seq"])].append(row)
            by_prev[row["prev_hash"]].append(row)
            by_hash[row["hash"]].append(row)
        self.by_ws, self.by_prev, self.by_hash = dict(by_ws), dict(by_prev), dict(by_hash)
        self.last = max(self.by_ws, default=0)
        #: position -> hash, for the verified prefix of the chain
        self.verified: dict[int, str] = {}

    def _break(self, kind: Damage, n: int, row: Row | None, detail: str) -> Break:
        invocation_id, seq = _who(row)
        return Break(kind, self.writer, n, invocation_id, seq, detail)

    def check(self, marks: list[Row]) -> Break | None:
        """The first break of the walk, unless a checkpoint shows an earlier one (or a cut tail)."""
        found = self._walk()
        for mark in sorted(marks, key=lambda m: int(m["writer_seq"])):
            n = int(mark["writer_seq"])
            if found is not None and n >= found.writer_seq:  # type: ignore[operator]
                break  # past the first break nothing can be judged
            if n > self.last:
                reached = max(int(m["writer_seq"]) for m in marks)  # the newest says the most
                return self._break(
                    Damage.DELETED, self.last + 1, None,
                    f"a checkpoint records that this chain reached writer_seq {reached}, but it ends at "
                    f"{self.last}: at least its last {reached - self.last} event(s) were removed",
                )
            if self.verified.get(n) != mark["hash"]:
                row = self.by_ws[n][0]
                return self._break(
                    Damage.REWRITTEN, n, row,
                    f"the chain links up, but a checkpoint recorded hash {str(mark['hash'])[:16]}... here and the "
                    f"row has {row['hash'][:16]}...: the chain up to here was re-hashed after the checkpoint",
                )
        return found

    def _walk(self) -> Break | None:
        """Accept positions 1, 2, 3... while each holds its rightful row; diagnose the first that does not."""
        below = sorted(k for k in self.by_ws if k < 1)
        if below:
            return self._break(Damage.INSERTED, below[0], self.by_ws[below[0]][0], "a row at a position below 1, which no writer produces")
        prev = GENESIS
        for n in range(1, self.last + 1):
            here = self.by_ws.get(n, [])
            rightful = self._rightful(n, prev)
            if len(here) != 1 or here[0] is not rightful:
                return self._diagnose(n, prev, here, rightful)
            prev = self.verified[n] = rightful["hash"]
        return None

    def _rightful(self, n: int, prev: str) -> Row | None:
        """The row written at ``n``: it links to ``prev`` and hashes with writer_seq ``n``.

        Of two such rows (one forged with a correct hash), the one the chain continues
        through is the original; then the one stored at ``n``.
        """
        fitting = [r for r in self.by_prev.get(prev, []) if _fits(r, writer_seq=n)]
        fitting.sort(key=lambda r: (r["hash"] not in self.by_prev, int(r["writer_seq"]) != n))
        return fitting[0] if fitting else None

    def _diagnose(self, n: int, prev: str, here: list[Row], rightful: Row | None) -> Break:
        """Name the damage at position ``n`` from the evidence (rules in the module docstring)."""
        if (renamed := self._renamed(n, prev, here)) is not None:
            return renamed
        if not here:
            if rightful is not None:
                return self._break(
                    Damage.REORDERED, n, rightful,
                    f"position {n} is empty; the row written here is stored at writer_seq {rightful['writer_seq']}",
                )
            following = min(k for k in self.by_ws if k > n)
            invocation_id, seq = self.invocations.deleted_between(self.writer, n, following - 1)
            span = f"writer_seq {n}" + (f" to {following - 1}" if following - n > 1 else "")
            return Break(Damage.DELETED, self.writer, n, invocation_id, seq, f"{span} missing: {following - n} event(s) removed from the chain")
        if len(here) > 1:
            intruder = next(r for r in here if r is not rightful)
            return self._break(Damage.INSERTED, n, intruder, f"{len(here)} rows claim this position; the chain does not pass through this one")
        row = here[0]
        home = self._home(row, n)
        if rightful is not None:
            if home is not None:
                return self._break(
                    Damage.REORDERED, n, row,
                    f"this row was written at writer_seq {home}, and the row written here is stored at "
                    f"writer_seq {rightful['writer_seq']}: rows were swapped",
                )
            return self._break(
                Damage.INSERTED, n, row,
                f"this row is not part of the chain; the row written here (invocation {rightful['invocation_id']} "
                f"seq {rightful['seq']}) is stored at writer_seq {rightful['writer_seq']}, pushed along by the insertion",
            )
        other_seq = next((s for s in self.invocations.others(row) if _fits(row, seq=s)), None)
        if other_seq is not None:
            return self._break(
                Damage.REORDERED, n, row,
                f"this event was written as seq {other_seq} of its invocation and is now stored as seq {row['seq']}: "
                "events of the invocation were swapped",
            )
        if home is not None and home > n:
            invocation_id, seq = self.invocations.deleted_between(self.writer, n, n - 1)
            return Break(
                Damage.DELETED, self.writer, n, invocation_id, seq,
                f"the row stored here was written at writer_seq {home}: {home - n} event(s) from writer_seq {n} on "
                "were removed and the later rows renumbered to close the gap",
            )
        if home is not None:
            return self._break(
                Damage.INSERTED, n, row,
                f"this row hashes as writer_seq {home}, a position already taken: a copy or a forgery",
            )
        if _fits(row, writer_seq=n):
            if n == 1:
                return self._break(Damage.MODIFIED, n, row, "the first row of a chain must link to the genesis hash, and this one does not")
            return self._break(
                Damage.MODIFIED, n - 1, self.by_ws[n - 1][0],
                f"the row at writer_seq {n} is intact but was chained to another predecessor: the row here was "
                "replaced by one with a recomputed hash",
            )
        return self._break(
            Damage.MODIFIED, n, row,
            "the stored row no longer hashes to its recorded hash: its content (kind, payload, time, key id, "
            "invocation or seq) was changed after it was written" + ("" if row["prev_hash"] == prev else ", and so was its link"),
        )

    def _renamed(self, n: int, prev: str, here: list[Row]) -> Break | None:
        """A row whose ``writer`` column was changed: missing here and stored under another writer,
        or stored here (or as this chain's next row) and written by another writer."""
        if not here and (moved := self.elsewhere.moved_from(self.writer, n, prev)) is not None:
            return self._break(
                Damage.MODIFIED, n, moved,
                f"the row written here is stored under writer {moved['writer']} at writer_seq {moved['writer_seq']}: "
                "its writer was changed after it was written",
            )
        following = min((k for k in self.by_ws if k > n), default=None)
        for row in here or (self.by_ws[following] if following is not None else []):
            if (origin := self.elsewhere.written_by(row)) is not None:
                return self._break(
                    Damage.MODIFIED, int(row["writer_seq"]), row,
                    f"this row was written by writer {origin} (as its writer_seq {row['writer_seq']}) and now says "
                    f"writer {self.writer}: its writer was changed after it was written",
                )
        return None

    def _home(self, row: Row, n: int) -> int | None:
        """Another position at which ``row`` hashes, judged from its neighbours' links."""
        candidates = {n - 1, n + 1}
        if row["prev_hash"] == GENESIS:
            candidates.add(1)
        candidates.update(int(p["writer_seq"]) + 1 for p in self.by_hash.get(row["prev_hash"], []))
        candidates.update(int(s["writer_seq"]) - 1 for s in self.by_prev.get(row["hash"], []))
        return next((k for k in sorted(candidates) if k != n and k >= 1 and _fits(row, writer_seq=k)), None)


# -- reading a database or a dump ---------------------------------------------------------

#: Events fetched per round trip when streaming (what verify and export hold at a time).
BATCH = 2000
#: Values per ``IN (...)`` when loading the damaged part of a journal.
_IN_CHUNK = 500


def _check_url(url: str) -> str:
    """The URL as shown (password hidden). Raises :class:`AuditInputError` for a URL the broker
    would not take, or a SQLite file that is not there (connecting would create an empty one)."""
    if not url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
        raise AuditInputError("--database must be a URL the broker uses, 'sqlite+aiosqlite:///path.db' or "
                              "'postgresql+asyncpg://user@host/db' (as database.url in its configuration)")
    try:
        where = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise AuditInputError("--database could not be read as a database URL") from None
    database = make_url(url).database
    if url.startswith("sqlite") and database not in (None, "", ":memory:") and not Path(database).is_file():
        from .store.migrate import sqlite_file_problem, sqlite_where

        # Connecting would create an empty one. A directory, or a missing one, is said as such.
        problem = sqlite_file_problem(url, setting="the URL (--database, or database.url)")
        raise AuditInputError(f"{where}: {problem or f'no such database file: {sqlite_where(database)}'}")
    return where


@asynccontextmanager
async def _snapshot(url: str) -> AsyncIterator[tuple[AsyncConnection, set[str], bool]]:
    """One connection that reads one snapshot of the journal, whatever brokers commit meanwhile
    (PostgreSQL: a REPEATABLE READ transaction; SQLite: one read transaction), so that every
    query of a verify or an export sees the same rows. Yields the connection, the database's
    table names, and whether it is SQLite (whose text is read as bytes: :func:`_as_stored`).

    Raises :class:`AuditInputError` when the database cannot be read as a journal."""
    where = _check_url(url)
    engine = create_async_engine(url, connect_args=connect_args(url))
    try:
        try:
            conn, tables = await _open_snapshot(engine)
        except (SQLAlchemyError, OSError) as exc:
            if (immutable := immutable_url(url, exc)) is None:
                raise AuditInputError(f"{where}: the journal could not be read ({brief(exc)})") from None
            # A journal on a read-only file system, or in a directory this user cannot write:
            # SQLite cannot make the shared-memory file a WAL reader needs; read the file as it is.
            await engine.dispose()
            engine = create_async_engine(immutable)
            try:
                conn, tables = await _open_snapshot(engine)
            except (SQLAlchemyError, OSError):
                raise AuditInputError(f"{where}: the journal could not be read ({brief(exc)})") from None
            conn.info[IMMUTABLE] = True
        raw = conn.dialect.name == "sqlite"
        try:
            if "events" not in tables:
                raise AuditInputError("this database has no events table; is it an Affidavit journal? (`affidavit db upgrade`)")
            yield conn, tables, raw
        except SQLAlchemyError as exc:  # not OSError: an export's own file is written meanwhile
            raise AuditInputError(f"{where}: the journal could not be read ({brief(exc)})") from None
        finally:
            with suppress(SQLAlchemyError, OSError):
                await conn.close()  # rolls the read transaction back
    finally:
        await engine.dispose()


#: Set in a snapshot connection's ``info`` when the SQLite file was read as immutable (see _snapshot).
IMMUTABLE = "affidavit_immutable"
#: Set in a snapshot connection's ``info``: the tables of :data:`_BESIDE_THE_CHAIN` its role may not read.
UNREADABLE = "affidavit_unreadable"
#: What a verify reads beside ``events`` (which it needs): checked only where the role may read them.
_BESIDE_THE_CHAIN = frozenset({"chain_checkpoints", "invocations", "results"})


async def _open_snapshot(engine: Any) -> tuple[AsyncConnection, set[str]]:
    conn = await engine.connect()
    try:
        if conn.dialect.name == "sqlite":
            await conn.exec_driver_sql("BEGIN")  # the driver opens none for a SELECT
        else:
            await conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
        if conn.dialect.name == "postgresql":  # a query of a table this role may not read would end the snapshot
            privilege = text("SELECT has_table_privilege(CAST(:t AS text), 'SELECT')")
            unreadable = {t for t in sorted(tables & _BESIDE_THE_CHAIN) if not (await conn.execute(privilege, {"t": t})).scalar()}
            tables -= unreadable
            conn.info[UNREADABLE] = tuple(sorted(unreadable))
    except BaseException:
        with suppress(SQLAlchemyError, OSError):
            await conn.close()
        raise
    return conn, tables


def immutable_url(url: str, exc: BaseException) -> str | None:
    """The URL that reads the SQLite journal at ``url`` as an immutable file, when ``exc`` says it
    could not be opened for shared reading (a read-only file system or directory); else None."""
    from urllib.parse import quote

    from .store.migrate import sqlite_file

    said = str(exc).lower()
    if (database := sqlite_file(url)) is None or not ("readonly" in said or "unable to open database file" in said):
        return None
    path = Path(database).absolute()
    if not path.is_file():
        return None
    return f"sqlite+aiosqlite:///file:{quote(str(path))}?immutable=1&uri=true"


async def _read_marks(conn: AsyncConnection, tables: set[str]) -> list[dict[str, Any]]:
    if "chain_checkpoints" not in tables:
        return []
    query = select(chain_checkpoints).order_by(chain_checkpoints.c.writer, chain_checkpoints.c.writer_seq)
    return [dict(r) for r in (await conn.execute(query)).mappings()]


def _events_query(raw: bool, *where: Any, types: bool = False) -> Any:
    """Events as stored, in chain order (the ``uq_events_writer_seq`` index). ``types``: on
    SQLite also the storage class of the columns that group rows (see :meth:`_Walk.add`)."""
    columns = _as_stored(events, raw)
    if raw and types:
        columns += [func.typeof(events.c[name]).label(f"typeof_{name}") for name in _GROUPING]
    return select(*columns).where(*where).order_by(events.c.writer, events.c.writer_seq)


async def _stream(conn: AsyncConnection, query: Any) -> AsyncIterator[list[Any]]:
    """``query``'s rows in batches of :data:`BATCH`, through a server-side cursor."""
    result = await conn.stream(query.execution_options(yield_per=BATCH))
    async for batch in result.mappings().partitions():
        yield batch


async def load_database(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every event row and every checkpoint, as stored (payload bytes untouched), in memory.

    For a journal small enough to hold (tools, tests): :func:`verify_database` and
    :func:`export_events` stream instead. Raises :class:`AuditInputError` when the database
    cannot be read at all.
    """
    async with _snapshot(url) as (conn, tables, raw):
        # Checkpoints first: with brokers writing, one committed later could point past the
        # events read, which would look like a cut tail. (The snapshot makes that moot too.)
        marks = await _read_marks(conn, tables)
        rows = [_decoded(dict(r), raw) async for batch in _stream(conn, _events_query(raw)) for r in batch]
    return rows, marks


def _as_stored(table: Any, raw: bool) -> list[Any]:
    """The table's columns, on SQLite each text or binary one as the bytes it holds: SQLite lets
    a forger store any column as TEXT that is not UTF-8, which reading as text would fail on (a
    journal that "could not be read") rather than show as the damage it is."""
    if not raw:
        return list(table.c)
    return [cast(c, LargeBinary).label(c.name) if isinstance(c.type, (String, LargeBinary)) else c for c in table.c]


def _decoded(row: dict[str, Any], raw: bool) -> dict[str, Any]:
    """Text columns read as bytes (see :func:`_as_stored`) back as text; bytes that are not UTF-8
    are replaced, so the row no longer hashes as it was written, and the walk finds it."""
    if raw:
        for name in _TEXT_COLUMNS:
            value = row.get(name)
            if isinstance(value, (bytes, memoryview)):
                row[name] = bytes(value).decode("utf-8", "replace")
    return row


_COLUMNS = tuple(c.name for c in events.c)
_TEXT_COLUMNS = tuple(c.name for c in events.c if isinstance(c.type, String))


# -- verifying a live database, streamed ---------------------------------------------------
#
# verify() indexes every row, which for a journal of millions of events takes gigabytes. A live
# database is instead read once in chain order and each chain checked as it streams past, in
# O(1) state (_Walk); each invocation's seqs are checked by the database (_odd_invocations).
# Only what that flags is read again, with what its diagnosis needs (the chain's rows and every
# row of their invocations, the flagged invocations' rows), and handed to verify(), which names
# the damage exactly as it would over the whole journal: a chain the walk accepts is one that
# verify() walks to its end without a break, and an invocation the database passes has no gap
# (so it cannot matter to naming a deleted row either).

#: The columns that group rows into chains and invocations.
_GROUPING = ("writer", "invocation_id", "seq")
_TYPES = {"writer": "text", "invocation_id": "text", "seq": "integer"}


class _Walk:
    """Every chain, streamed in (writer, writer_seq) order, checked with O(1) state per chain.

    It only flags a writer whose chain is not exactly: rows at writer_seq 1, 2, 3..., one
    each, each hashing with its stored columns and linking to the one before, every checkpoint
    of the writer naming a position of it with that row's hash. (Each such row is the one
    :meth:`_Chain._rightful` picks: no other row hashes at its position, as each hashes at its
    own.) Memory: the writer names and the checkpoints.
    """

    def __init__(self, marks: Iterable[Row]):
        self.marks: dict[str, list[Row]] = defaultdict(list)
        for mark in marks:
            self.marks[str(mark["writer"])].append(mark)
        self.events = 0
        self.writers: set[str] = set()
        self.flagged: set[str] = set()
        #: SQLite: name -> the stored bytes of rows whose writer or invocation_id is stored unlike
        #: the broker stores it (not TEXT, or not UTF-8), which grouping by text would miss.
        self.odd: dict[str, dict[str, set[bytes]]] = {"writer": defaultdict(set), "invocation_id": defaultdict(set)}
        self._writer: str | None = None
        self._ok = True
        self._n = 0
        self._prev = GENESIS
        self._wanted: set[int] = set()
        self._at_marks: dict[int, str] = {}

    def add(self, stored: Mapping[str, Any], raw: bool) -> None:
        row = _decoded({name: stored[name] for name in _COLUMNS}, raw)
        if row["writer"] != self._writer:
            self._end()
            self._start(row["writer"])
        self.events += 1
        if raw and any(stored[f"typeof_{name}"] != kind for name, kind in _TYPES.items()) or not _utf8(stored, raw):
            self.flagged.add(row["writer"])
            for name in self.odd:
                self.odd[name][row[name]].add(bytes(stored[name]) if raw else str(stored[name]).encode())
        if not self._ok:
            return
        n = self._n + 1
        try:
            self._ok = int(row["writer_seq"]) == n and row["prev_hash"] == self._prev and _fits(row)
        except (TypeError, ValueError):
            self._ok = False
        if self._ok:
            self._n, self._prev = n, row["hash"]
            if n in self._wanted:
                self._at_marks[n] = row["hash"]

    def _start(self, writer: str) -> None:
        if writer in self.writers:  # its rows are not together: stored unlike the broker stores them
            self.flagged.add(writer)
        self.writers.add(writer)
        self._writer, self._ok, self._n, self._prev = writer, True, 0, GENESIS
        self._wanted = {int(m["writer_seq"]) for m in self.marks.get(writer, ())}
        self._at_marks = {}

    def _end(self) -> None:
        if self._writer is None:
            return
        # A checkpoint past the end (a cut tail) or on another hash (a re-hash) is damage.
        if not self._ok or any(self._at_marks.get(int(m["writer_seq"])) != m["hash"] for m in self.marks.get(self._writer, ())):
            self.flagged.add(self._writer)

    def finish(self) -> None:
        self._end()
        self._writer = None
        self.flagged.update(w for w in self.marks if w not in self.writers)  # checkpoints of a chain with no rows


def _utf8(stored: Mapping[str, Any], raw: bool) -> bool:
    if not raw:
        return True
    try:
        for name in ("writer", "invocation_id"):
            bytes(stored[name]).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        return False
    return True


async def _odd_invocations(conn: AsyncConnection, raw: bool, walk: _Walk) -> tuple[set[str], int]:
    """The invocations whose seqs do not run 1, 2, 3... (by the database, rows not read), and how
    many invocations the journal holds."""
    inv, seq, rows = events.c.invocation_id, events.c.seq, func.count()
    query = (select(cast(inv, LargeBinary) if raw else inv).group_by(inv)
             .having(or_(func.min(seq) != 1, func.max(seq) != rows, func.count(distinct(seq)) != rows)))
    flagged = {bytes(k).decode("utf-8", "replace") if raw else k for (k,) in (await conn.execute(query)).all()}
    odd = walk.odd["invocation_id"]
    if not odd:
        return flagged, int((await conn.execute(select(func.count(distinct(inv))))).scalar() or 0)
    # SQLite, ids stored unlike the broker stores them: count by the bytes, then those that
    # read as the same text (bytes that are not UTF-8, read with replacement) as one.
    count = int((await conn.execute(select(func.count(distinct(cast(inv, LargeBinary)))))).scalar() or 0)
    for name, keys in odd.items():
        spellings = {k for k in keys if not _is_utf8(k)}
        present = (await conn.execute(select(events.c.seq).where(cast(inv, LargeBinary) == name.encode()).limit(1))).first()
        count -= max(0, len(spellings) + (present is not None) - 1)
    return flagged, count


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def _rows_where(
    conn: AsyncConnection, raw: bool, column: str, names: set[str], odd: Mapping[str, set[bytes]], but: Set[str] = frozenset(),
) -> list[dict[str, Any]]:  # fmt: skip
    """Every row whose ``column`` reads as one of ``names`` (through the indexes), and on SQLite
    those stored unlike the broker stores them (``odd``: their bytes; a full scan, forged
    journals only); ``but`` those of these writers."""
    col, out = events.c[column], []
    others = [events.c.writer.not_in(sorted(but))] if but else []

    def wanted(query: Any) -> Any:
        return (_decoded(dict(r), raw) for r in query.mappings())

    ordered = sorted(names)
    for start in range(0, len(ordered), _IN_CHUNK):
        query = _events_query(raw, col.in_(ordered[start:start + _IN_CHUNK]), *others)
        out.extend(r for r in wanted(await conn.execute(query)) if r["writer"] not in but)
    spellings = sorted({k for name in names for k in odd.get(name, ())})
    if raw and spellings:
        # Not those the query above found: TEXT holding exactly the UTF-8 of a name.
        texts = [k.decode("utf-8") for k in spellings if _is_utf8(k)]
        query = _events_query(raw, cast(col, LargeBinary).in_(spellings), not_(and_(func.typeof(col) == "text", col.in_(texts))))
        out.extend(r for r in wanted(await conn.execute(query)) if r["writer"] not in but)
    return [r for r in out if r[column] in names]


async def _verify_live(url: str, extra: list[Row]) -> AuditResult:
    async with _snapshot(url) as (conn, tables, raw):
        marks = [*await _read_marks(conn, tables), *extra]
        walk = _Walk(marks)
        async for batch in _stream(conn, _events_query(raw, types=True)):
            for stored in batch:
                walk.add(stored, raw)
        walk.finish()
        flagged_invocations, invocations = await _odd_invocations(conn, raw, walk)
        result = AuditResult(
            events=walk.events, writers=len(walk.writers), invocations=invocations,
            checkpoints=len({(str(m["writer"]), int(m["writer_seq"]), str(m["hash"])) for m in marks}),
            read_immutable=bool(conn.info.get(IMMUTABLE)), unreadable=conn.info.get(UNREADABLE, ()),
        )
        beyond = [*await _records_without_events(conn, tables, raw), *await _events_without_records(conn, tables, raw),
                  *await _results_not_chained(conn, tables, raw)]
        outcomes = await _outcomes_without_evidence(conn, tables, raw)
        if not walk.flagged and not flagged_invocations:
            result.breaks.extend([*beyond, *_outcome_break(outcomes)])
            return result
        # The damaged part: the flagged chains whole, and every row of the invocations they
        # hold events of, and of the flagged invocations (for their seqs and to name a deleted row).
        chains = await _rows_where(conn, raw, "writer", walk.flagged, walk.odd["writer"])
        wanted = {r["invocation_id"] for r in chains} | flagged_invocations | set(walk.odd["invocation_id"])
        others = await _rows_where(conn, raw, "invocation_id", wanted, walk.odd["invocation_id"], but=walk.flagged)
    walked = verify([*chains, *others], marks, writers=walk.flagged).breaks
    untrusted = _untrusted([*chains, *others], walked)
    result.breaks = [*walked, *beyond, *_outcome_break([i for i in outcomes if i not in untrusted])]
    return result


def _untrusted(rows: Iterable[Row], breaks: list[Break]) -> set[str]:
    """The invocations whose events a break puts in doubt: those named by one, and those with an
    event in a broken chain. Their events can show any outcome: that is the events' break, not an
    edit of their record row (:func:`_outcome_break` leaves them out)."""
    broken = {b.writer for b in breaks if b.writer is not None}
    return ({str(r["invocation_id"]) for r in rows if r["writer"] in broken}
            | {b.invocation_id for b in breaks if b.invocation_id is not None})


#: How many invocations a finding about many names before it says "and N more".
_NAMED = 5


def _named(ids: list[str]) -> str:
    return ", ".join(ids[:_NAMED]) + (f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")


async def _records_without_events(conn: AsyncConnection, tables: set[str], raw: bool) -> list[Break]:
    """Invocation rows with no event left. Every record starts with an event, written in the
    same transaction as the row, so their events were removed: with a whole chain and its
    checkpoints deleted, the chains that are left verify, and only this shows the loss."""
    if "invocations" not in tables:
        return []
    inv = invocations_table.c.invocation_id
    query = select(cast(inv, LargeBinary) if raw else inv).where(~exists().where(events.c.invocation_id == inv)).order_by(inv)
    return await _deleted(conn, query, raw, lambda ids: (
        f"{len(ids)} invocation record(s) ({_named(ids)}) have no events at all: every record starts with an event "
        "written with it, so their events were removed (a whole chain and its checkpoints, say, which leaves the "
        "other chains intact; an outside checkpoint file names the chain)"))


async def _events_without_records(conn: AsyncConnection, tables: set[str], raw: bool) -> list[Break]:
    """Invocations whose events are there but whose record row is not. Every event is written in
    the same transaction as its invocation's row, so the row was removed: ``invocations show``
    and the side API then know nothing of an invocation the chain still holds (an ``unknown`` one
    drops out of the reconciliation queue), while every chain verifies."""
    if "invocations" not in tables:
        return []
    ev = events.c.invocation_id
    query = (select(cast(ev, LargeBinary) if raw else ev).distinct()
             .where(~exists().where(invocations_table.c.invocation_id == ev)).order_by(ev))
    return await _deleted(conn, query, raw, lambda ids: (
        f"{len(ids)} invocation(s) ({_named(ids)}) have events in the chain but no record row: every event is written "
        "with its invocation's row, so the row was removed, and `invocations show` and the side API no longer know the "
        "invocation; its events say what it was (`audit export`)"))


async def _deleted(conn: AsyncConnection, query: Any, raw: bool, detail: Callable[[list[str]], str]) -> list[Break]:
    """One ``deleted`` break naming the invocation ids ``query`` finds (the first as its position),
    or none."""
    ids = [bytes(i).decode("utf-8", "replace") if raw else i for (i,) in (await conn.execute(query)).all()]
    return [Break(Damage.DELETED, None, None, ids[0], None, detail(ids))] if ids else []


async def _results_not_chained(conn: AsyncConnection, tables: set[str], raw: bool) -> list[Break]:
    """Stored results whose body is not the one their ``RESULT_COMMITTED`` event chained
    (``stored_body_sha256``). Only where both are stored in the clear: an encrypted body is
    bound by its authenticated encryption instead (a read of an altered one fails), and an
    encrypted event's hash is not readable without a key."""
    if "results" not in tables:
        return []
    res = results_table.c
    query = (
        select(cast(res.invocation_id, LargeBinary).label("invocation_id") if raw else res.invocation_id, res.body,
               events.c.payload)
        .join(events, and_(events.c.invocation_id == res.invocation_id, events.c.kind == "RESULT_COMMITTED",
                           events.c.key_id.is_(None)))
        .where(res.key_id.is_(None))
        .order_by(res.invocation_id)
    )
    chained: dict[str, set[str]] = defaultdict(set)
    bodies: dict[str, str] = {}
    async for batch in _stream(conn, query):
        for row in batch:
            invocation_id = bytes(row["invocation_id"]).decode("utf-8", "replace") if raw else row["invocation_id"]
            try:
                sha = json.loads(bytes(row["payload"])).get("stored_body_sha256")
            except (ValueError, AttributeError):
                continue  # a damaged payload: the chain's walk reports it
            if isinstance(sha, str):
                chained[invocation_id].add(sha)
                bodies.setdefault(invocation_id, hashlib.sha256(bytes(row["body"] or b"")).hexdigest())
    ids = sorted(i for i, shas in chained.items() if bodies[i] not in shas)
    if not ids:
        return []
    return [Break(Damage.MODIFIED, None, None, ids[0], None,
                  f"{len(ids)} stored result(s) ({_named(ids)}) hold a body whose SHA-256 is not the stored_body_sha256 "
                  "their chained RESULT_COMMITTED event holds: the result was replaced after it was recorded (what "
                  "`invocations result` or the side API would serve for it is not what the upstream answered)")]


async def _outcomes_without_evidence(conn: AsyncConnection, tables: set[str], raw: bool) -> list[str]:
    """Invocation records whose outcome their events cannot have given them. The record row is
    the events' projection, written with them, and an outcome comes from evidence only
    (``contract.Record.outcome``): ``committed``/``rejected`` from the remote's complete answer
    or a finding, ``partial_effect`` from a finding, ``unknown`` from a dispatch, and
    ``not_attempted`` only without one. Read from the events' kinds alone (no payload, no key):
    a row edited to take a record out of the reconciliation queue (``unknown`` made
    ``committed``) is found, while every chain verifies."""
    if "invocations" not in tables:
        return []
    inv = invocations_table.c

    def has(kind: str) -> Any:
        return exists().where(and_(events.c.invocation_id == inv.invocation_id, events.c.kind == kind))

    answered_or_found = or_(has("REMOTE_RESPONSE_COMPLETE"), has("RECONCILED"))
    impossible = or_(
        and_(inv.outcome.in_(("committed", "rejected")), not_(answered_or_found)),
        and_(inv.outcome == "partial_effect", not_(has("RECONCILED"))),
        and_(inv.outcome == "unknown", not_(has("DISPATCH_STARTED"))),
        and_(inv.outcome == "not_attempted", has("DISPATCH_STARTED")),
    )
    query = (select(cast(inv.invocation_id, LargeBinary) if raw else inv.invocation_id)
             .where(impossible, exists().where(events.c.invocation_id == inv.invocation_id))
             .order_by(inv.invocation_id))
    return [bytes(i).decode("utf-8", "replace") if raw else i for (i,) in (await conn.execute(query)).all()]


def _outcome_break(ids: list[str]) -> list[Break]:
    """The finding for the records of :func:`_outcomes_without_evidence` (none for none)."""
    if not ids:
        return []
    return [Break(Damage.MODIFIED, None, None, ids[0], None,
                  f"{len(ids)} invocation record(s) ({_named(ids)}) hold an outcome their events cannot have given "
                  "them (committed or rejected without the remote's complete answer or a finding, unknown without a "
                  "dispatch, not_attempted after one): the record row was edited. `invocations show` projects the "
                  "events, and says what is recorded; `invocations list` and the metrics read the edited row")]


def verify_database(url: str, extra_checkpoints: Iterable[Row] = ()) -> AuditResult:
    """Verify a live journal. Synchronous (call it outside an event loop); reads no key.

    Streams the events: memory stays small however long the journal, but for the damaged part
    (see the comment above :class:`_Walk`). The findings are :func:`verify`'s over every row.

    Beyond the chains, checks the chains cannot make: an invocation record with no event left
    (its events were removed: every record starts with one), events with no record, a stored
    result whose body is not the one its chained ``RESULT_COMMITTED`` names (where both are
    stored in the clear), and a record whose outcome its events cannot have given it."""
    return asyncio.run(_verify_live(url, list(extra_checkpoints)))


def verify_dump(path: Path, extra_checkpoints: Iterable[Row] = ()) -> AuditResult:
    export = read_export(path)
    result = verify(export.events, [*export.checkpoints, *extra_checkpoints])
    result.unended = not export.ended
    return result


def export_events(url: str, path: Path) -> tuple[int, int]:
    """Write every event (payload base64) and checkpoint as JSON lines; returns the counts.

    Streamed: written as read, in chain order, so memory stays small however long the journal.
    The file is created with mode 0600 (with encryption off, payloads are plaintext) under a
    temporary name and renamed into place when complete: a failed export leaves no partial file.
    """
    return asyncio.run(_export(url, Path(path)))


async def _export(url: str, path: Path) -> tuple[int, int]:
    count = 0
    async with _snapshot(url) as (conn, tables, raw):
        marks = await _read_marks(conn, tables)
        with _written(path) as out:
            header = {"type": EXPORT_FORMAT, "format": EXPORT_VERSION, "exported_at": canonical_time(datetime.now(UTC))}
            out.write(json.dumps(header) + "\n")
            async for batch in _stream(conn, _events_query(raw)):
                out.write("".join(json.dumps(_event_line(_decoded(dict(r), raw)), sort_keys=True) + "\n" for r in batch))
                count += len(batch)
            for mark in marks:
                line = {"type": "checkpoint", "writer": mark["writer"], "writer_seq": int(mark["writer_seq"]),
                        "hash": mark["hash"], "at": canonical_time(mark["at"])}
                out.write(json.dumps(line, sort_keys=True) + "\n")
            out.write(json.dumps({"type": _EXPORT_END, "events": count, "checkpoints": len(marks)}) + "\n")
    return count, len(marks)


@contextmanager
def _written(path: Path) -> Iterator[Any]:
    """A text file at ``path``, mode 0600, in place only once complete (a temporary file beside
    it, renamed); something that is not a regular file (``/dev/stdout``, a pipe) is written as is."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, "w", encoding="utf-8") as out:
            yield out
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yield out
        os.replace(partial, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(partial)
        raise


def _event_line(row: Row) -> dict[str, Any]:
    return {
        "type": "event",
        "invocation_id": row["invocation_id"],
        "seq": int(row["seq"]),
        "kind": row["kind"],
        "at": canonical_time(row["at"]),
        "writer": row["writer"],
        "writer_seq": int(row["writer_seq"]),
        "prev_hash": row["prev_hash"],
        "hash": row["hash"],
        "key_id": row["key_id"],
        "payload": base64.b64encode(bytes(row["payload"])).decode("ascii"),
    }


class Export(NamedTuple):
    """What an :func:`export_events` file holds. ``ended`` is False for a file an older affidavit
    wrote (format 1), which has no end line: one cut short at a line boundary looks whole."""

    events: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    ended: bool


def read_export(path: Path, events: bool = True) -> Export:
    """The events (only checked, not kept, unless ``events``: ``verify --checkpoints`` needs the
    checkpoints alone, so an export of millions of events costs no more memory than those) and
    checkpoints of an :func:`export_events` file; line order does not matter.

    Raises :class:`AuditInputError` for a file that is not an export, or one that does not hold
    what its end line counts: cut short (a copy interrupted, a full disk) or lines removed. The
    count guards against accidents, not forgers, who can edit it too: keep exports where the
    journal's administrators cannot write."""
    rows: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []
    seen = 0
    version: int | None = None
    end: dict[str, Any] | None = None
    for kind, item in _dump_lines(path, events):
        if kind == "event":
            seen += 1
            if events:
                rows.append(item)
        elif kind == "checkpoint":
            marks.append(item)
        elif kind == EXPORT_FORMAT:
            version = item.get("format")
        else:
            end = item
    if version is None:
        raise AuditInputError(f"{path}: not an audit export: it has no header line (an export written by `affidavit "
                              "audit export` begins with one). Nothing was verified")
    if version >= 2 and end is None:
        raise AuditInputError(
            f"{path}: the export is incomplete: it has no end line, so it was cut short (a copy interrupted, a disk "
            f"full) after {seen} event(s) and {len(marks)} checkpoint(s). Nothing was verified; use a complete copy "
            "or export again (`affidavit audit export`)")
    if end is not None and (end["events"], end["checkpoints"]) != (seen, len(marks)):
        raise AuditInputError(
            f"{path}: the export is incomplete or was edited: its end line counts {end['events']} event(s) and "
            f"{end['checkpoints']} checkpoint(s), the file holds {seen} and {len(marks)}. Nothing was verified; "
            "use a complete copy or export again (`affidavit audit export`)")
    return Export(rows, marks, ended=end is not None)


def read_dump(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Events and checkpoints from an :func:`export_events` file (see :func:`read_export`)."""
    export = read_export(path)
    return export.events, export.checkpoints


def read_checkpoints(path: Path) -> list[dict[str, Any]]:
    """Only the checkpoints of an :func:`export_events` file (for ``verify --checkpoints``)."""
    return read_export(path, events=False).checkpoints


def _dump_lines(path: Path, events: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(type, line)`` for each line of a dump, in file order; the events' payloads decoded if
    ``events``, else the events are only checked and yielded empty."""
    number = 0
    ended = False
    try:
        with Path(path).open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    kind = item.pop("type")
                    if kind == "event":
                        _check_types(item, _EVENT_FIELDS)
                        if events:
                            item["payload"] = base64.b64decode(item["payload"], validate=True)
                        yield kind, item if events else {}
                    elif kind == "checkpoint":
                        _check_types(item, _CHECKPOINT_FIELDS)
                        yield kind, item
                    elif kind == EXPORT_FORMAT:
                        if item.get("format") not in (1, EXPORT_VERSION):
                            raise ValueError(f"export format {item.get('format')!r}, which this version does not know "
                                             "(a newer affidavit wrote it: verify with that version)")
                        yield kind, item
                    elif kind == _EXPORT_END:
                        _check_types(item, _END_FIELDS)
                        if ended:
                            raise ValueError("a second end line")
                        ended = True
                        yield kind, item
                    else:
                        raise ValueError(f"unknown line type {kind!r}")
                except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
                    if not line.endswith("\n"):  # the last line, and unfinished: the file was cut in it
                        raise AuditInputError(
                            f"{path}:{number}: the export is incomplete: it ends in the middle of a line, so it was cut "
                            "short (a copy interrupted, a disk full). Nothing was verified; use a complete copy or "
                            "export again (`affidavit audit export`)") from None
                    raise AuditInputError(f"{path}:{number}: not a line of an audit export ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditInputError(f"{path}: cannot read the dump ({exc})") from None


_EVENT_FIELDS: dict[str, tuple[type, ...]] = {
    "invocation_id": (str,), "seq": (int,), "kind": (str,), "at": (str,), "writer": (str,), "writer_seq": (int,),
    "prev_hash": (str,), "hash": (str,), "key_id": (str, type(None)), "payload": (str,),
}
_CHECKPOINT_FIELDS: dict[str, tuple[type, ...]] = {"writer": (str,), "writer_seq": (int,), "hash": (str,)}
_END_FIELDS: dict[str, tuple[type, ...]] = {"events": (int,), "checkpoints": (int,)}


def _check_types(item: dict[str, Any], fields: dict[str, tuple[type, ...]]) -> None:
    for name, types in fields.items():
        if name not in item:
            raise KeyError(f"missing {name!r}")
        if not isinstance(item[name], types) or isinstance(item[name], bool):
            raise TypeError(f"{name!r} has the wrong type")
