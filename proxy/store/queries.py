"""Reads of the journal for the side API and the CLI (Core statements, no ORM)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from ..contract import Event, EventKind
from .schema import events, invocations, results


async def invocation(engine: AsyncEngine, invocation_id: str) -> dict[str, Any] | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(invocations).where(invocations.c.invocation_id == invocation_id))).mappings().first()
    return dict(row) if row else None


async def event_rows(engine: AsyncEngine, invocation_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(select(events).where(events.c.invocation_id == invocation_id).order_by(events.c.seq))
        ).mappings().all()
    return [dict(r) for r in rows]


def decode_events(rows: list[dict[str, Any]], decode: Any = None) -> list[Event]:
    out = []
    for row in rows:
        payload = bytes(row["payload"])
        data = decode(payload, row["key_id"]) if decode else json.loads(payload)
        out.append(Event(EventKind(row["kind"]), data, row["seq"]))
    return out


async def result(engine: AsyncEngine, invocation_id: str) -> dict[str, Any] | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(results).where(results.c.invocation_id == invocation_id))).mappings().first()
    return dict(row) if row else None


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
        return [dict(r) for r in (await conn.execute(query)).mappings().all()]


async def ping(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
