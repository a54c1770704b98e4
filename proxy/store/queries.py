"""Reads of the journal for the side API and the CLI (Core statements, no ORM)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import asyncio
import sqlite3

import asyncpg
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from ..contract import Event, EventKind
from ..crypto import PayloadDecoder, ResultDecoder
from .schema import events, invocations, results

#: What a read raises when the database does not answer (down, unreachable, pool exhausted).
UNREACHABLE = (DBAPIError, PoolTimeout, asyncpg.PostgresError, asyncpg.InterfaceError, sqlite3.Error, OSError,
               asyncio.TimeoutError)


def _row(row: Any) -> dict[str, Any]:
    """A row as a dict, its times in UTC with their offset (SQLite returns them without one)."""
    return {k: v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v for k, v in row.items()}


async def invocation(engine: AsyncEngine, invocation_id: str) -> dict[str, Any] | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(invocations).where(invocations.c.invocation_id == invocation_id))).mappings().first()
    return _row(row) if row else None


async def event_rows(engine: AsyncEngine, invocation_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(select(events).where(events.c.invocation_id == invocation_id).order_by(events.c.seq))
        ).mappings().all()
    return [_row(r) for r in rows]


def decode_events(rows: list[dict[str, Any]], decode: PayloadDecoder) -> list[Event]:
    """Events from stored rows; ``decode`` opens encrypted payloads (``Journal.decode_payload``)."""
    return [
        Event(EventKind(row["kind"]), decode(bytes(row["payload"]), row["key_id"], row["invocation_id"], row["seq"]), row["seq"])
        for row in rows
    ]


async def events_of(engine: AsyncEngine, invocation_id: str, decode: PayloadDecoder) -> tuple[list[dict[str, Any]], list[Event]]:
    """The stored rows of an invocation's events and the events they hold, in sequence order."""
    rows = await event_rows(engine, invocation_id)
    return rows, decode_events(rows, decode)


async def events_after(engine: AsyncEngine, invocation_id: str, seq: int, decode: PayloadDecoder) -> list[Event]:
    """Events appended after ``seq`` (by another process, e.g. an operator's decision)."""
    query = select(events).where(events.c.invocation_id == invocation_id, events.c.seq > seq).order_by(events.c.seq)
    async with engine.connect() as conn:
        rows = [_row(r) for r in (await conn.execute(query)).mappings().all()]
    return decode_events(rows, decode)


async def held(engine: AsyncEngine, limit: int = 200) -> list[dict[str, Any]]:
    """Invocations waiting for an operator's approval, oldest first."""
    query = select(invocations).where(invocations.c.stage == "held").order_by(invocations.c.created_at).limit(limit)
    async with engine.connect() as conn:
        return [_row(r) for r in (await conn.execute(query)).mappings().all()]


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
    async with engine.connect() as conn:
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
    async with engine.connect() as conn:
        row = (await conn.execute(select(results).where(results.c.invocation_id == invocation_id))).mappings().first()
    return _row(row) if row else None


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
    async with engine.connect() as conn:
        return [_row(r) for r in (await conn.execute(query)).mappings().all()]


async def ping(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
