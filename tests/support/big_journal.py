"""A large, genuine journal, fast: real chain hashes computed here, rows bulk-inserted.

The broker's write path (``Journal``) commits a few events per transaction and would take many
minutes for the hundreds of thousands of events a memory measurement needs; the rows written
here are what it writes (each writer's chain from genesis, invocations of eight events
interleaved, a checkpoint every ``CHECKPOINT_EVERY_EVENTS``), and ``audit verify`` cannot tell
the difference. SQLite through the stdlib, PostgreSQL through asyncpg's COPY.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import make_url

from proxy.store.journal import GENESIS, chain_hash
from proxy.store.vault_schema import CHECKPOINT_EVERY_EVENTS

KINDS = ("ACTION_ACCEPTED", "PREFLIGHT_VALIDATED", "CREDENTIAL_AUTHORIZED", "DISPATCH_STARTED",
         "REQUEST_SENT", "REMOTE_RESPONSE_COMPLETE", "RESULT_COMMITTED", "RESULT_DELIVERED")
EVENT_COLUMNS = ("invocation_id", "seq", "kind", "at", "writer", "writer_seq", "prev_hash", "hash", "key_id", "payload")
START = datetime(2026, 3, 1, tzinfo=UTC)


def _positions(writer: str, count: int, concurrent: int = 16) -> Iterator[tuple[str, int]]:
    """(invocation_id, seq) of each of a writer's ``count`` events: ``concurrent`` invocations at
    a time, eight events each (the last ones cut short where the chain ends)."""
    slots: list[list[Any] | None] = [None] * concurrent  # slot -> [invocation_id, next seq]
    started = 0
    for ws in range(1, count + 1):
        slot = ws % concurrent
        current = slots[slot]
        if current is None or current[1] > len(KINDS):
            started += 1
            current = slots[slot] = [f"act_{writer}_{started:08d}", 1]
        yield current[0], current[1]
        current[1] += 1


def chain_rows(writer: str, count: int, concurrent: int = 16) -> Iterator[dict[str, Any]]:
    """``count`` events of one writer (see :func:`_positions`), hashed into its chain."""
    prev = GENESIS
    for ws, (invocation_id, seq) in enumerate(_positions(writer, count, concurrent), start=1):
        payload = json.dumps({"agent": "builder", "route": "payments.create", "seq": seq, "writer_seq": ws,
                              "note": "x" * 120}).encode()
        row = {"invocation_id": invocation_id, "seq": seq, "kind": KINDS[seq - 1], "at": START + timedelta(milliseconds=ws),
               "writer": writer, "writer_seq": ws, "prev_hash": prev, "key_id": None, "payload": payload}
        row["hash"] = prev = chain_hash(row)
        yield row


def build(url: str, writers: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Write each writer's chain (name -> events) and its checkpoints; returns the checkpoints."""
    marks: dict[str, list[dict[str, Any]]] = {}
    last: dict[str, int] = {}  # each invocation's last seq: its record's outcome follows from it
    for writer, count in writers.items():
        for invocation_id, seq in _positions(writer, count):
            last[invocation_id] = seq

    def rows() -> Iterator[dict[str, Any]]:
        for writer, count in writers.items():
            marks[writer] = []
            for row in chain_rows(writer, count):
                if row["writer_seq"] % CHECKPOINT_EVERY_EVENTS == 0 or row["writer_seq"] == count:
                    marks[writer].append(mark(row))
                yield row

    insert(url, rows(), lambda: [m for ms in marks.values() for m in ms], last)
    return marks


def mark(row: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint a writer records with ``row`` as its chain head."""
    return {"writer": row["writer"], "writer_seq": row["writer_seq"], "hash": row["hash"], "at": row["at"]}


def insert(url: str, rows: Iterable[dict[str, Any]], marks: Callable[[], list[dict[str, Any]]] = list,
           last: dict[str, int] | None = None, batch: int = 20_000) -> None:
    """Store ``rows`` as they come, each invocation's record row with its first event (as the
    broker writes them, in one transaction: ``audit verify`` reports events without a record),
    then the checkpoints ``marks()`` returns (after the rows). ``last``: each invocation's last
    seq, for the outcome its record holds (default: all eight events)."""
    sink = _sqlite_sink(url) if url.startswith("sqlite") else _pg_sink(url)
    next(sink)
    pending: list[dict[str, Any]] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= batch:
            sink.send((pending, _records(pending, last or {}), []))
            pending = []
    sink.send((pending, _records(pending, last or {}), marks()))
    sink.close()


INVOCATION_COLUMNS = ("invocation_id", "created_at", "updated_at", "agent", "route", "method", "target", "fingerprint",
                      "idempotent", "remote_contract", "stage", "phase", "outcome", "caller_disposition",
                      "dispatch_started", "last_seq", "owner", "generation", "attempts_used", "retry_budget", "replays")


def _outcome(last_seq: int) -> str:
    """The outcome of an invocation whose events are the first ``last_seq`` of :data:`KINDS` (what
    ``audit verify`` checks a record's outcome against)."""
    if last_seq >= KINDS.index("REMOTE_RESPONSE_COMPLETE") + 1:
        return "committed"
    return "unknown" if last_seq >= KINDS.index("DISPATCH_STARTED") + 1 else "not_attempted"


def _records(rows: list[dict[str, Any]], last: dict[str, int]) -> list[dict[str, Any]]:
    """The record row of each invocation whose first event is among ``rows`` (``audit verify``
    reads only that the row is there, and that its outcome fits the events' kinds)."""
    return [{"invocation_id": r["invocation_id"], "created_at": r["at"], "updated_at": r["at"], "agent": "builder",
             "route": "payments.create", "method": "POST", "target": "https://api.payments.test:443/v1/charges",
             "fingerprint": "sha256:" + "0" * 64, "idempotent": False, "remote_contract": False, "stage": "delivered",
             "phase": "result_delivery", "outcome": _outcome(last.get(r["invocation_id"], len(KINDS))),
             "caller_disposition": "completed", "dispatch_started": True, "last_seq": len(KINDS), "owner": r["writer"],
             "generation": 0, "attempts_used": 1, "retry_budget": 3, "replays": 0}
            for r in rows if r["seq"] == 1]


def _sqlite_sink(url: str):
    conn = sqlite3.connect(make_url(url).database)
    try:
        columns = ", ".join(EVENT_COLUMNS)
        while True:
            rows, records, marks = yield
            # Times as SQLAlchemy stores them on SQLite (no zone; read back as UTC).
            conn.executemany(f"INSERT INTO events ({columns}) VALUES ({', '.join('?' * len(EVENT_COLUMNS))})",
                             [tuple(_sqlite_time(r[c]) if c == "at" else r[c] for c in EVENT_COLUMNS) for r in rows])
            conn.executemany(
                f"INSERT INTO invocations ({', '.join(INVOCATION_COLUMNS)}) VALUES ({', '.join('?' * len(INVOCATION_COLUMNS))})",
                [tuple(_sqlite_time(r[c]) if c.endswith("_at") else r[c] for c in INVOCATION_COLUMNS) for r in records])
            conn.executemany("INSERT INTO chain_checkpoints (writer, writer_seq, hash, at) VALUES (?, ?, ?, ?)",
                             [(m["writer"], m["writer_seq"], m["hash"], _sqlite_time(m["at"])) for m in marks])
            conn.commit()
    except GeneratorExit:
        conn.commit()
    finally:
        conn.close()


def _sqlite_time(at: datetime) -> str:
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")


def _pg_sink(url: str):
    import asyncpg

    parsed = make_url(url)
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(host=parsed.host, port=parsed.port or 5432, user=parsed.username,
                                                   password=parsed.password, database=parsed.database))
    try:
        while True:
            rows, records, marks = yield
            loop.run_until_complete(conn.copy_records_to_table(
                "events", columns=list(EVENT_COLUMNS), records=[tuple(r[c] for c in EVENT_COLUMNS) for r in rows]))
            if records:
                loop.run_until_complete(conn.copy_records_to_table(
                    "invocations", columns=list(INVOCATION_COLUMNS),
                    records=[tuple(r[c] for c in INVOCATION_COLUMNS) for r in records]))
            if marks:
                loop.run_until_complete(conn.copy_records_to_table(
                    "chain_checkpoints", columns=["writer", "writer_seq", "hash", "at"],
                    records=[(m["writer"], m["writer_seq"], m["hash"], m["at"]) for m in marks]))
    except GeneratorExit:
        pass
    finally:
        loop.run_until_complete(conn.close())
        loop.close()
