"""Idempotency lookups, leases and counters: the state that decides a retry, all in SQL.

No retry decision depends on process memory: any broker sharing the database sees the same key
bindings, generations, leases and budgets.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from .schema import brokers, invocations

c = invocations.c


async def find_keyed(engine: AsyncEngine, agent: str, scope: str, key: str) -> dict[str, Any] | None:
    query = select(invocations).where(and_(c.agent == agent, c.idempotency_scope == scope, c.idempotency_key == key))
    async with engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return dict(row) if row else None


async def take_lease(
    engine: AsyncEngine, invocation_id: str, generation: int, owner: str, now: datetime, until: datetime
) -> bool:
    """Take the invocation for one more attempt: bump the generation, if nobody moved it since
    ``generation`` was read, no live lease is held, and the retry budget allows it.

    One statement, so the check and the bump are one atomic step on both dialects.
    """
    statement = (
        update(invocations)
        .where(
            and_(
                c.invocation_id == invocation_id,
                c.generation == generation,
                c.generation < c.retry_budget,
                or_(c.lease_expires_at.is_(None), c.lease_expires_at <= now),
            )
        )
        .values(generation=generation + 1, owner=owner, lease_expires_at=until, updated_at=now)
    )
    async with engine.begin() as conn:
        return (await conn.execute(statement)).rowcount == 1


async def count_replay(engine: AsyncEngine, invocation_id: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(update(invocations).where(c.invocation_id == invocation_id).values(replays=c.replays + 1))


async def owner_alive(engine: AsyncEngine, owner: str, stale_after: float) -> bool:
    """Whether the broker process ``owner`` has sent a heartbeat within ``stale_after`` seconds
    (judged by the database's clock on PostgreSQL, like the heartbeats themselves)."""
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            cutoff: Any = func.now() - timedelta(seconds=stale_after)
        else:
            cutoff = datetime.now(UTC) - timedelta(seconds=stale_after)
        row = (await conn.execute(select(brokers.c.owner).where(brokers.c.owner == owner, brokers.c.heartbeat_at > cutoff))).first()
    return row is not None
