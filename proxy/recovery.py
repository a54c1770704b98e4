"""Crash recovery: close the records a dead broker left in flight, by appending what is known.

Each broker process is an *owner* ``<instance>/<incarnation>``; the instance is the host and the
proxy's listen address, so a restarted broker knows its earlier incarnations are dead (it holds
their port now) and recovers their work at once. Work of other instances is recovered only once
their heartbeat has been silent for ``stale_after`` while this broker's own journal connection
was healthy all that time (a database outage silences every heartbeat at once; it proves nothing);
an owner that never wrote a heartbeat, only once its record is that old too. A broker beats before
it serves and on through its start-up, so its siblings know it is alive before it writes a record.

Recovery appends; it never rewrites. What it appends follows the contract:

* stopped before ``DISPATCH_STARTED``: ``FAILED(<phase>, BROKER_RESTARTED)``: not attempted;
* stopped after it without an authentic end: ``FAILED(remote_execution, REMOTE_OUTCOME_UNKNOWN)``;
* a complete response whose result was not stored: ``FAILED(result_delivery, RESULT_STORE_FAILED)``;
* a committed result never handed over: ``FAILED(result_delivery, BROKER_RESTARTED)``, so the
  record says ``retry=fetch_result``.

The caller's wait ended with the broker: ``CALLER_CANCELLED(disconnected)`` first, if the
record still shows it waiting. Held approvals are left alone: they survive restarts, and so does
an approval nobody has acted on yet (stage ``approved``: nothing was sent, no secret touched);
the agent's repeat with the same key is sent under it.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, true
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from . import metrics
from .failpoints import failpoint
from .contract import CallerDisposition, Code, EventKind, Phase, Record, Stage, UnreadableRecord, project
from .crypto import DecryptError
from .invocation_log import InvocationLog, identity_of, utcnow
from .store import queries
from .store.journal import Fence, Journal, brief
from .store.reading import reading
from .store.schema import brokers, invocations

log = logging.getLogger("affidavit.recovery")

#: Stages a live broker may leave a record in; HELD (awaiting approval) and APPROVED (a grant
#: not yet acted on) are deliberately absent: both wait for the agent's repeat, across restarts.
IN_FLIGHT = (
    Stage.ACCEPTED,
    Stage.VALIDATED,
    Stage.AUTHORIZED,
    Stage.DISPATCHED,
    Stage.SENT,
    Stage.RESPONDING,
    Stage.RESPONSE_COMPLETE,
    Stage.COMMITTED,
)


def closing_events(
    record: Record, *, cause: str = "broker restart", code: Code = Code.BROKER_RESTARTED, answered: bool = False,
    after_dispatch: str | None = None,
) -> list[tuple[EventKind, dict[str, Any]]]:
    """What recovery appends to a record its owner left in flight (pure; see module docstring).

    ``cause``/``code`` say why it was left (a restart, or a journal write that failed at the
    dispatch boundary); ``answered``: the caller did get an envelope; ``after_dispatch``: the
    basis to record if ``DISPATCH_STARTED`` is durable (default: the cause, after dispatch).
    """
    events: list[tuple[EventKind, dict[str, Any]]] = []
    if record.caller_disposition is CallerDisposition.WAITING and not answered:
        events.append((EventKind.CALLER_CANCELLED, {"disposition": "disconnected", "basis": cause}))
    if record.stage is Stage.COMMITTED:
        events.append((EventKind.FAILED, {"phase": Phase.RESULT_DELIVERY, "code": code,
                                          "basis": f"{cause} before delivery"}))
    elif record.stage is Stage.RESPONSE_COMPLETE:
        events.append((EventKind.FAILED, {"phase": Phase.RESULT_DELIVERY, "code": Code.RESULT_STORE_FAILED,
                                          "basis": f"{cause} before the result was stored",
                                          "operator_attention": True}))
    elif record.stage in (Stage.DISPATCHED, Stage.SENT, Stage.RESPONDING):
        events.append((EventKind.FAILED, {"phase": Phase.REMOTE_EXECUTION, "code": Code.REMOTE_OUTCOME_UNKNOWN,
                                          "answered": answered or None, "basis": after_dispatch or f"{cause} after dispatch"}))
    else:
        phase = record.phase
        if any(a.stage for a in record.attempts) and record.stage is Stage.AUTHORIZED:
            phase = Phase.CONNECTION_SETUP
        events.append((EventKind.FAILED, {"phase": phase, "code": code, "answered": answered or None,
                                          "basis": f"{cause} before dispatch"}))
    return events


def _like_escaped(text: str) -> str:
    """``text`` matched literally by LIKE (``_`` and ``%`` are wildcards there)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class Recovery:
    """Heartbeat of this broker, and the sweep that closes abandoned records."""

    def __init__(
        self,
        journal: Journal,
        owner: str,
        instance: str,
        *,
        heartbeat: float = 2.0,
        stale_after: float = 30.0,
        sweep_every: float = 10.0,
    ):
        self.journal = journal
        self.engine: AsyncEngine = journal.engine
        self.owner = owner
        self.instance = instance
        self.heartbeat = heartbeat
        self.stale_after = stale_after
        self.sweep_every = sweep_every
        self.started_at = utcnow()
        self._healthy_since: datetime | None = None
        self._silent = False  # a heartbeat failure was logged and none has succeeded since
        #: In-flight records this broker cannot read (a newer broker wrote them): left to one that can.
        self._unreadable: set[str] = set()
        self._sweeping = False
        self._task: asyncio.Task[None] | None = None
        self.recovered = 0
        #: This instance's other owners' heartbeats at the previous sweep, and the loop time of the
        #: first look: an "earlier incarnation" whose heartbeat moves is a live twin (another
        #: broker configured with the same recovery.instance), and its records are not taken.
        self._beats: dict[str, Any] | None = None
        self._first_look: float | None = None
        #: Why the latest heartbeat failed (None once one succeeds).
        self.last_failure: BaseException | None = None
        self.twins: set[str] = set()

    async def start_beating(self) -> None:
        """Write the first heartbeat now (before the broker listens: a sibling then knows it is
        alive) and keep beating; sweeps wait for :meth:`start`."""
        await self.beat()
        self._keep_beating()

    async def start(self) -> None:
        """Sweep too, from now on (once this broker holds its port: see the module's docstring)."""
        self._sweeping = True
        self._keep_beating()

    def _keep_beating(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="affidavit recovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        next_sweep = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await self.beat()
            if self._sweeping and loop.time() >= next_sweep and self._healthy_since is not None:
                try:
                    await self.sweep()
                except Exception as exc:  # the next round tries again
                    log.warning("recovery sweep failed: %s", exc)
                next_sweep = loop.time() + (self.sweep_every if self._twins_judged() else self._twin_wait)
            await asyncio.sleep(self.heartbeat)

    @property
    def heartbeat_failing(self) -> bool:
        """Whether the last heartbeat (a write of its own, every ``heartbeat`` seconds) failed."""
        return self._silent

    async def beat(self) -> None:
        now = utcnow()
        try:
            await failpoint("heartbeat")
            # Bounded: a database that hangs must not stall a start (or the loop) for ever.
            async with asyncio.timeout(max(self.heartbeat, 5.0)), self.engine.begin() as conn:
                # PostgreSQL stamps heartbeats with its own clock, so brokers on hosts whose clocks
                # disagree still judge each other fairly (SQLite is one host anyway).
                stamp = func.now() if conn.dialect.name == "postgresql" else now
                row = {"owner": self.owner, "instance": self.instance, "started_at": self.started_at, "heartbeat_at": stamp}
                dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
                await conn.execute(
                    dialect_insert(brokers).values(row).on_conflict_do_update(
                        index_elements=["owner"], set_={"heartbeat_at": stamp}
                    )
                )
        except Exception as exc:
            self.last_failure = exc
            if not self._silent:
                log.warning("heartbeat failed (journal unreachable?): %s; other brokers may take this one's "
                            "in-flight records over after recovery.stale_after", brief(exc) or type(exc).__name__)
                self._silent = True
            self._healthy_since = None
            return
        self.last_failure = None
        if self._healthy_since is None:
            self._healthy_since = now
            if self._silent:  # at the failure's level, so whoever saw it sees this too
                log.warning("heartbeat written again: the journal answers; this broker judges other brokers' "
                            "records again after recovery.stale_after (%.0f s) of healthy heartbeats", self.stale_after)
                self._silent = False

    @property
    def _twin_wait(self) -> float:
        """Long enough for any live broker to have beaten at least once."""
        return 1.5 * self.heartbeat

    def _twins_judged(self) -> bool:
        loop = asyncio.get_running_loop()
        return self._first_look is not None and loop.time() - self._first_look >= self._twin_wait

    def earlier_incarnation_dead(self, owner: str) -> bool:
        """Whether ``owner``, named as an earlier incarnation of this broker, is dead: it is, since
        this broker holds its port, unless its heartbeat was seen moving (a live twin). Seeing
        that takes about two heartbeats from the start; until then a restarted broker takes its
        predecessor's held requests over at once, as it must, and a twin's would be too."""
        return owner not in self.twins

    async def _look_for_twins(self) -> None:
        """Note this instance's other owners whose heartbeat moved since the last look: they are
        alive, however their name says they are an earlier incarnation of this broker."""
        async with reading(self.engine) as conn:
            rows = (await conn.execute(select(brokers.c.owner, brokers.c.heartbeat_at).where(
                brokers.c.instance == self.instance, brokers.c.owner != self.owner))).all()
        beats = {owner: at for owner, at in rows}
        if self._beats is None:
            self._first_look = asyncio.get_running_loop().time()
        else:
            for owner in sorted(o for o, at in beats.items() if self._beats.get(o) != at and o not in self.twins):
                self.twins.add(owner)
                log.error("another running broker uses recovery.instance %r (owner %s is heartbeating), so it is "
                          "not an earlier incarnation of this one and its in-flight records are left to it. Give "
                          "every broker its own recovery.instance (the default, host:port, is unique per listening "
                          "port): two brokers under one name would close each other's live records.",
                          self.instance, owner)
        self._beats = beats

    async def sweep(self) -> int:
        """Close every record abandoned by a dead owner; returns how many were closed."""
        now = utcnow()
        c = invocations.c
        await self._look_for_twins()
        # This instance's earlier incarnations are dead (this broker holds their port), unless
        # their heartbeat moves: judged once a heartbeat interval has passed since the first look.
        own_earlier = and_(c.owner.like(f"{_like_escaped(self.instance)}/%", escape="\\"), c.owner != self.owner,
                           c.owner.not_in(self.twins) if self.twins else true())
        conditions = [own_earlier] if self._twins_judged() else []
        if self._healthy_since is not None and now - self._healthy_since >= timedelta(seconds=self.stale_after):
            horizon = timedelta(seconds=self.stale_after)
            cutoff = func.now() - horizon if self.engine.dialect.name == "postgresql" else now - horizon
            alive = select(brokers.c.owner).where(brokers.c.heartbeat_at > cutoff)
            # Dead: no recent heartbeat. An owner with no heartbeat row at all may be one that is
            # starting (its first beat slow, or failing), not one that stopped: its records are
            # taken only once they too are stale_after old. (Judged by its own clock, which wrote
            # updated_at; an owner that has beaten is judged by the database's clock alone.)
            beaten = select(brokers.c.owner)
            conditions.append(and_(c.owner != self.owner, c.owner.not_in(alive),
                                   or_(c.owner.in_(beaten), c.updated_at < cutoff)))
        if not conditions:
            return 0
        query = (
            select(invocations)
            .where(and_(c.stage.in_([s.value for s in IN_FLIGHT]), or_(*conditions),
                        c.invocation_id.not_in(self._unreadable) if self._unreadable else true()))
            .order_by(c.created_at)
            .limit(500)
        )
        async with reading(self.engine) as conn:
            rows = [dict(r) for r in (await conn.execute(query)).mappings().all()]
        closed = 0
        for row in rows:
            if await self._close(row):
                closed += 1
        if closed:
            log.warning("recovered %d invocation(s) left in flight by stopped brokers", closed)
        self.recovered += closed
        metrics.RECOVERED.inc(closed)
        return closed

    async def _close(self, row: dict[str, Any]) -> bool:
        try:
            _, events = await queries.events_of(self.engine, row["invocation_id"], self.journal.decode_payload)
            record = project(events)
        except UnreadableRecord as exc:  # left to a broker that can read it; said once, not at every sweep
            self._unreadable.add(row["invocation_id"])
            log.warning("invocation %s was left in flight by %s, but this broker cannot close it: %s. A broker of the "
                        "version that wrote it will; upgrade this one (docs/operations.md, Upgrading)",
                        row["invocation_id"], row["owner"], exc)
            return False
        except DecryptError as exc:  # one such record must not hold up the sweep of every other
            self._unreadable.add(row["invocation_id"])
            log.warning("invocation %s was left in flight by %s, but this broker cannot read it to close it: %s. Put "
                        "the key it was stored under back in [crypto] keys and restart the broker: its recovery then "
                        "closes it (docs/vault.md, key rotation)", row["invocation_id"], row["owner"], exc)
            return False
        if record.ended or record.stage not in IN_FLIGHT:
            return False
        entry = InvocationLog(
            self.journal, identity_of(row), self.owner, record=record, persisted=True, generation=row["generation"],
            taken_from=row["owner"],
        )
        entry.credential = (row["credential_id"], row["credential_version"], row["injection"])
        # Its own earlier incarnation restarted; another broker's only fell silent (stopped, or
        # cut off from the database for longer than stale_after: it may still be running).
        own = row["owner"].startswith(f"{self.instance}/")
        cause = "broker restart" if own else (f"broker {row['owner']} silent for recovery.stale_after "
                                              f"({self.stale_after:g} s; stopped, or cut off from the journal)")
        for kind, data in closing_events(record, cause=cause):
            entry.append(kind, **data)
        # A re-send's writes are fenced by its generation and owner: this broker's close holds only
        # while the stopped owner still holds the record (no one else took it over meanwhile).
        fence = Fence(entry.invocation_id, entry.generation, row["owner"], utcnow(), False) if entry.generation else None
        try:
            await entry.commit(fence=fence)
        except Exception as exc:  # another broker closed it first, or the journal is down
            log.info("could not close %s: %s", row["invocation_id"], exc)
            return False
        log.warning(
            "invocation %s was left in flight by %s; recorded %s (%s)",
            row["invocation_id"], row["owner"], entry.record.outcome.value, entry.record.code.value if entry.record.code else "-",
        )
        return True
