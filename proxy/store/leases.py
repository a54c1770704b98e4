"""Idempotency lookups, leases and counters: the state that decides a retry, all in SQL.

No retry decision depends on process memory: any broker sharing the database sees the same key
bindings, generations, leases and budgets.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from .schema import brokers, invocations
from .reading import reading

c = invocations.c
log = logging.getLogger("affidavit.journal")


async def find_keyed(engine: AsyncEngine, agent: str, scope: str, key: str) -> dict[str, Any] | None:
    query = select(invocations).where(and_(c.agent == agent, c.idempotency_scope == scope, c.idempotency_key == key))
    async with reading(engine) as conn:
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


async def renew_lease(
    engine: AsyncEngine, invocation_id: str, generation: int, owner: str, now: datetime, until: datetime
) -> bool:
    """Extend ``owner``'s own lease that lapsed before it dispatched (an approval that took longer
    than the lease, say), if nobody took the invocation since. A lapsed lease another broker took
    has a new generation, and is not renewed."""
    return await _own_lease(engine, invocation_id, generation, owner, lease_expires_at=until, updated_at=now)


async def release_lease(engine: AsyncEngine, invocation_id: str, generation: int, owner: str) -> bool:
    """Give up ``owner``'s lease of ``generation`` (an attempt that ended without dispatching and
    could not write so): a repeat may take the invocation at once. Nothing if it moved on."""
    return await _own_lease(engine, invocation_id, generation, owner, lease_expires_at=None)


async def _own_lease(engine: AsyncEngine, invocation_id: str, generation: int, owner: str, **values: Any) -> bool:
    """Set ``values`` on the invocation if ``owner`` still holds its lease of ``generation``
    (same generation, same owner, still leased), in one statement."""
    statement = (
        update(invocations)
        .where(and_(c.invocation_id == invocation_id, c.generation == generation, c.owner == owner,
                    c.lease_expires_at.is_not(None)))
        .values(**values)
    )
    async with engine.begin() as conn:
        return (await conn.execute(statement)).rowcount == 1


class ReplayTally:
    """``invocations.replays``, counted in memory and added in batches: one transaction per
    ``interval`` for all the replays served meanwhile, not one per replay (at one request at a
    time, an UPDATE per replay cost more than the replay itself). The count is a statistic, not
    evidence: it lags by up to ``interval``, and counts not yet written when the process is
    killed are lost."""

    def __init__(self, engine: AsyncEngine, interval: float = 0.5):
        self.engine = engine
        self.interval = interval
        self._pending: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()

    def add(self, invocation_id: str) -> None:
        self._pending[invocation_id] += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="affidavit replay counts")

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._hurry.wait(), seconds)
        except TimeoutError:
            pass

    async def _drain(self) -> None:
        failures = 0
        while self._pending:
            await self._pause(self.interval)  # gather what is served meanwhile
            batch, self._pending = self._pending, Counter()
            try:
                await add_replays(self.engine, batch)
                failures = 0
            except Exception as exc:  # the database is away: keep the counts, try again shortly
                self._pending.update(batch)
                failures += 1
                if failures >= 30 or self._hurry.is_set():
                    log.warning("dropped %d replay counts: %s", sum(self._pending.values()), exc)
                    self._pending.clear()
                    return
                await self._pause(1.0)

    async def flush(self) -> None:
        """Write what is pending now (at a stop); one try if the database is away."""
        self._hurry.set()
        if self._task is not None:
            await self._task
        if self._pending:
            await self._drain()


async def add_replays(engine: AsyncEngine, counts: Counter[str]) -> None:
    statement = update(invocations).where(c.invocation_id == bindparam("iid")).values(replays=c.replays + bindparam("n"))
    async with engine.begin() as conn:
        await conn.execute(statement, [{"iid": iid, "n": n} for iid, n in counts.items()])


async def owner_alive(engine: AsyncEngine, owner: str, stale_after: float) -> bool:
    """Whether the broker process ``owner`` has sent a heartbeat within ``stale_after`` seconds
    (judged by the database's clock on PostgreSQL, like the heartbeats themselves)."""
    async with reading(engine) as conn:
        if conn.dialect.name == "postgresql":
            cutoff: Any = func.now() - timedelta(seconds=stale_after)
        else:
            cutoff = datetime.now(UTC) - timedelta(seconds=stale_after)
        row = (await conn.execute(select(brokers.c.owner).where(brokers.c.owner == owner, brokers.c.heartbeat_at > cutoff))).first()
    return row is not None
