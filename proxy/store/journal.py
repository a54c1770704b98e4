"""The journal writer: group commit, one writer task per process, durable before it answers.

Every flow hands its rows to :meth:`Journal.submit` and awaits the returned future. One task
gathers everything submitted while the previous transaction was in flight into the next
transaction: one round trip and one fsync for many flows, while each flow still waits for *its
own* rows to be durable before it goes on (for ``DISPATCH_STARTED``: before any request byte).

The writer also extends this process's audit chain (``writer``, ``writer_seq``, ``prev_hash``,
``hash`` on every event). A batch that fails leaves the chain as it was before the batch; an
ambiguous failure (the commit may or may not have landed) starts a fresh chain under a new writer
name so that two rows can never claim the same place in one chain.
"""

from __future__ import annotations

import asyncio
import binascii
import hashlib
import json
import logging
import os
import sqlite3
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import orjson
from sqlalchemy import event, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from .. import metrics
from ..failpoints import failpoint
from ..crypto import KeyRing, payload_codec, payload_decoder, result_codec, result_decoder
from .leases import ReplayTally
from .queries import DAMAGED_ADVICE, causes, damaged
from .reading import READ_ONLY
from .sqlite_writer import SqliteWriter
from .schema import events
from .statements import PROJECTION_COLUMNS, CoreStatements, Fence, SqliteStatements, sqlite_pragmas, store_rows
from .vault_schema import chain_checkpoints, checkpoint_due, checkpoint_row

log = logging.getLogger("affidavit.journal")
T = TypeVar("T")
Statements = CoreStatements | SqliteStatements

GENESIS = "0" * 64


#: Seconds between the log lines of one outage's failed batches (the first is logged at once).
FAILURE_LOG_EVERY = 10.0
#: Work handed to :meth:`Journal.defer` runs at the latest this long after it was handed over.
DEFER_AT_MOST = 0.005

class JournalUnavailable(Exception):
    """The journal could not make the rows durable (database down, read-only, too slow).

    ``unwritten``: the rows are known not written (they never went to the database, or it
    answered their transaction with an error); otherwise they may have landed unconfirmed."""

    def __init__(self, message: str, *, unwritten: bool = False):
        super().__init__(message)
        self.unwritten = unwritten


class JournalDamaged(Exception):
    """A batch refused unsent because an earlier one found the journal's storage damaged."""


class LeaseLost(Exception):
    """A fenced write: the invocation's generation or lease moved on; nothing was written."""


class IdempotencyConflict(Exception):
    """An idempotency claim lost the race: another invocation already holds (agent, scope, key)."""


@dataclass(slots=True)
class EventRow:
    invocation_id: str
    seq: int
    kind: str
    at: datetime
    payload: bytes
    key_id: str | None = None


@dataclass(slots=True)
class Write:
    """Rows that become durable together, or not at all."""

    events: list[EventRow] = field(default_factory=list)
    insert_invocation: dict[str, Any] | None = None
    update_invocation: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    fence: Fence | None = None
    #: Insert ``insert_invocation`` only if its idempotency key is free (see Journal._claim).
    claim: bool = False
    #: Nobody waits for these rows: they may wait up to ``Journal.linger`` for company.
    lazy: bool = False
    #: An empty write that still reaches the database (to record a due chain checkpoint).
    checkpoint_only: bool = False
    #: In a batch of its own (rows the journal failed, sent again: if they fail again, nothing
    #: else fails with them).
    alone: bool = False
    #: An earlier write of the same invocation; if it failed, this one is not attempted, so a
    #: record never has a gap (later events without the earlier ones).
    after: asyncio.Future[None] | None = None
    future: asyncio.Future[None] | None = None


def canonical_event_bytes(row: dict[str, Any]) -> bytes:
    """The bytes an event's hash covers: every stored column but the hash itself, as a compact
    UTF-8 JSON array (invocation_id, seq, kind, at, writer, writer_seq, prev_hash, key_id,
    base64 of the payload). ``audit verify`` recomputes it from the stored row, without any key.
    """
    return _canonical(
        row["invocation_id"],
        int(row["seq"]),
        row["kind"],
        canonical_time(row["at"]),
        row["writer"],
        int(row["writer_seq"]),
        row["prev_hash"],
        row["key_id"],
        bytes(row["payload"]),
    )


def _canonical(
    invocation_id: str, seq: int, kind: str, at: str, writer: str, writer_seq: int, prev_hash: str,
    key_id: str | None, payload: bytes,
) -> bytes:  # fmt: skip
    fields = [invocation_id, seq, kind, at, writer, writer_seq, prev_hash, key_id,
              binascii.b2a_base64(payload, newline=False).decode("ascii")]  # fmt: skip
    return orjson.dumps(fields)


def canonical_time(at: datetime | str) -> str:
    """UTC with microseconds and a ``Z``, whatever the dialect hands back (SQLite drops the zone)."""
    if type(at) is datetime and at.tzinfo is UTC:
        # The broker's own event times (every event of every request): no conversion needed.
        return at.isoformat(timespec="microseconds")[:-6] + "Z"
    if isinstance(at, str):
        at = datetime.fromisoformat(at)
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    elif at.utcoffset():
        at = at.astimezone(UTC)
    # isoformat, not strftime: the same text ("...+00:00" -> "...Z") at a fraction of the cost,
    # and this runs for every event of every request.
    return at.isoformat(timespec="microseconds")[:-6] + "Z"


def chain_hash(row: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_event_bytes(row)).hexdigest()


def _sqlite_settings(engine: Engine, timeout: float) -> Engine:
    """WAL (readers beside the writer), FULL (each commit durable), and BEGIN IMMEDIATE."""

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        sqlite_pragmas(cursor, timeout)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # Take the write lock up front so concurrent broker processes queue, not deadlock; a
        # read (see reading()) takes none: WAL gives it a snapshot beside the writer.
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


async def on_engine(url: str, work: Callable[[AsyncEngine], Awaitable[T]], pool_size: int = 10, *,
                    unbounded_statements: bool = False) -> T:
    """``work(engine)`` on a short-lived engine (commands, tools), disposed whatever happens.
    ``unbounded_statements``: see :func:`make_engine`."""
    engine = make_engine(url, pool_size, unbounded_statements=unbounded_statements)
    try:
        return await work(engine)
    finally:
        await engine.dispose()


def make_engine(url: str, pool_size: int = 10, timeout: float = 5.0, *, unbounded_statements: bool = False) -> AsyncEngine:
    """An async engine with the settings durability and fail-fast behaviour depend on. ``timeout``
    bounds connecting, waiting (SQLite: for the lock) and each PostgreSQL statement, which
    ``unbounded_statements`` leaves unbounded (a command that scans a whole table on purpose)."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": timeout})
        _sqlite_settings(engine.sync_engine, timeout)
        return engine
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_timeout=timeout,
        connect_args={"timeout": timeout, "command_timeout": None if unbounded_statements else timeout},
    )


class Journal:
    """Group-commit writer for one broker process (one audit chain per writer name)."""

    def __init__(
        self,
        engine: AsyncEngine,
        writer: str,
        *,
        ring: KeyRing | None = None,
        timeout: float = 5.0,
        max_batch: int = 512,
        linger: float = 0.05,
        defer_at_most: float = DEFER_AT_MOST,
    ):
        self.engine = engine
        self.linger = linger
        #: Work nobody waits for (:meth:`defer`), and the timer that runs it if no batch goes out.
        self._deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._deferred_timer: asyncio.TimerHandle | None = None
        self.defer_at_most = defer_at_most
        #: Replays served (a statistic, written in batches beside the journal).
        self.replays = ReplayTally(engine)
        #: How payloads and results are stored (encrypted when the key ring has keys) and read back.
        self.ring = ring or KeyRing.empty()
        self.encode_payload = payload_codec(self.ring)
        self.decode_payload = payload_decoder(self.ring)
        self.encode_result = result_codec(self.ring)
        self.decode_result = result_decoder(self.ring)
        self._checkpoint_seq = 0
        self._checkpoint_at = 0.0
        self.writer_base = writer
        self.timeout = timeout
        self.max_batch = max_batch
        # A deque and one wake-up future: waiting for work costs no task per wait.
        self._queue: deque[Write] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        #: When the oldest queued lazy write has waited its linger, and the timer that wakes
        #: the writer then (a lazy write alone does not wake it: a write somebody waits for
        #: usually comes first and takes it along).
        self._lazy_deadline: float | None = None
        self._lazy_timer: asyncio.TimerHandle | None = None
        self._in_flight: list[Write] = []  # the batch being written
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._conn: AsyncConnection | None = None
        #: PostgreSQL: the server session of the writer's connection (pid, backend_start and the
        #: application_name it was tagged with), and those of connections dropped with a write on
        #: them the database did not confirm: until :meth:`settle` ends them, such a write can
        #: still land (held up in the network).
        self._session: tuple[int, Any, str] | None = None
        self._unsettled: list[tuple[int, Any, str]] = []
        self._settling = asyncio.Lock()
        self._session_unknown_logged = False
        # SQLite: batches go to a writer process of their own (proxy.store.sqlite_writer); the
        # rare isolated retry after a collision runs in one worker thread with its own sqlite3
        # connection (opened there when first needed).
        self._sqlite_path: str | None = None
        self._sqlite_writer: SqliteWriter | None = None
        self._sqlite: SqliteStatements | None = None
        self._sqlite_thread: ThreadPoolExecutor | None = None
        if engine.dialect.name == "sqlite":
            self._sqlite_path = engine.url.database or ":memory:"
            self._sqlite_writer = SqliteWriter(self._sqlite_path, timeout)
            self._sqlite_thread = ThreadPoolExecutor(1, thread_name_prefix="affidavit-journal")
        self._driver: Any = None  # the asyncpg connection under ``_conn`` (PostgreSQL fast path)
        self._generation = 0
        self.writer = writer
        self._writer_seq = 0
        self._prev_hash = GENESIS
        self.batches = 0
        self.errors = 0
        self.healthy = True
        #: During an outage the first failed batch is logged whole, then one line per
        #: FAILURE_LOG_EVERY seconds with the count since (a busy broker fails dozens a second).
        self._failure_logged_at = -FAILURE_LOG_EVERY
        #: Whether the batch being written has gone to the database (before: a failure, a refused
        #: connection say, is known to have written nothing).
        self._on_the_wire = False
        self._failures_unlogged = 0
        #: Why :meth:`start` could not make the journal writable (the broker refuses to start).
        self.start_problem: str | None = None
        #: Set once a batch fails because the journal's storage is damaged (SQLite's "database
        #: disk image is malformed", PostgreSQL's XX001/XX002): from then on nothing is written
        #: to it, every write is refused unsent, until the broker restarts (no retry cures
        #: damage, and writing on could spread it or leave records half-readable).
        self.damage: str | None = None

    async def start(self) -> None:
        """Start the writer. A writer name that already has rows continues its chain."""
        try:
            async with self.engine.connect() as conn:
                last = (
                    await conn.execute(
                        select(events.c.writer_seq, events.c.hash)
                        .where(events.c.writer == self.writer)
                        .order_by(events.c.writer_seq.desc())
                        .limit(1)
                    )
                ).first()
        except Exception as exc:  # the database may be down at start; the writer retries per batch
            log.warning("journal: could not read the chain head at start: %s", brief(exc))
            self._rotate_chain()
        else:
            if last is not None:
                self._writer_seq, self._prev_hash = int(last[0]), last[1]
                self._checkpoint_seq = self._writer_seq
        self._checkpoint_at = time.monotonic()
        if self._sqlite_writer is not None:
            try:
                await self._sqlite_writer.start()
            except Exception as exc:  # every batch tries again, and fails closed if it must
                self.start_problem = f"the SQLite journal's writer process could not start: {brief(exc)}"
                log.error("journal: %s", self.start_problem)
        self._closing = False
        self._task = asyncio.create_task(self._run(), name="affidavit journal writer")

    async def close(self) -> None:
        try:
            await self.replays.flush()
        except Exception as exc:  # a statistic; never block a stop on it
            log.info("replay counts not written at close: %s", exc)
        if self._task is not None:
            # From here on new writes are refused; everything accepted before is written (or
            # fails as a batch fails) by the flushes, and whatever is still unanswered after the
            # writer stopped is refused, so no caller waits for ever.
            self._run_deferred()  # a delivery record among them is a write still to be made
            self._closing = True
            await self.flush()
            if self._writer_seq > self._checkpoint_seq:
                self._checkpoint_at = 0.0  # one last checkpoint for the chain's final head
                await self.flush(force=True)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
            if self._lazy_timer is not None:
                self._lazy_timer.cancel()
                self._lazy_timer = self._lazy_deadline = None
            cut, queued = self._in_flight, [*self._queue]  # the batch cut may have landed; the queue did not
            self._in_flight = []
            self._queue.clear()
            for stranded, unwritten in ((cut, False), (queued, True)):
                for w in stranded:
                    if w.future is not None and not w.future.done():
                        w.future.set_exception(JournalUnavailable("the journal closed before this write was made "
                                                                  "durable", unwritten=unwritten))
        await self._drop_connection()
        if self._sqlite_writer is not None:
            await self._sqlite_writer.close()
        if self._sqlite_thread is not None:
            await asyncio.get_running_loop().run_in_executor(self._sqlite_thread, self._close_sqlite)
        # What the last writes' landing deferred (an end's log line and count) runs before the
        # loop may stop; a write it would submit is refused now, as any after close.
        await asyncio.sleep(0)
        self._run_deferred()

    @property
    def write_problem(self) -> str | None:
        """Why the journal cannot write at all right now, when it knows (SQLite: its file was
        deleted or replaced under it, for good; or its writer process could not start, or three
        in a row died on their batches, and it waits to try again); None otherwise. (Damaged
        storage, which stops every write too, is :attr:`damage`.)"""
        if self._sqlite_writer is None:
            return None
        return self._sqlite_writer.replaced or self._sqlite_writer.problem

    def _close_sqlite(self) -> None:
        statements, self._sqlite = self._sqlite, None
        if statements is not None:
            statements.close()

    @property
    def closing(self) -> bool:
        """The broker's stop closes the journal: writes are refused from now on."""
        return self._closing

    def submit(self, write: Write) -> asyncio.Future[None]:
        """Queue rows for the next transaction; the future resolves once they are durable."""
        return self._enqueue(write, refuse="the journal is closing" if self._closing else None)

    def _enqueue(self, write: Write, refuse: str | None = None) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        write.future = loop.create_future()
        if self._task is None:
            refuse = "the journal writer is not running"
        if refuse is not None:
            write.future.set_exception(JournalUnavailable(refuse, unwritten=True))
            return write.future
        self._queue.append(write)
        if write.lazy:
            if self._lazy_deadline is None:
                self._lazy_deadline = loop.time() + self.linger
                self._lazy_timer = loop.call_at(self._lazy_deadline, self._wake)
        else:
            self._wake()
        return write.future

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the turn after the writer next sends a batch, or within
        ``defer_at_most`` seconds if none goes out: work nobody waits for (a delivery record, the
        end-of-invocation log line), done while the loop would otherwise sit idle until the
        database answers. Before, such work ran in the turns after a response was written, and
        at concurrency 1 those turns were usually spent on the agent's next request, which
        waited for them."""
        self._deferred.append((fn, args))
        if self._deferred_timer is None:
            self._deferred_timer = asyncio.get_running_loop().call_later(self.defer_at_most, self._run_deferred)

    def _run_deferred(self) -> None:
        if self._deferred_timer is not None:
            self._deferred_timer.cancel()
            self._deferred_timer = None
        while self._deferred:  # what a deferred call defers in turn runs now too
            work, self._deferred = self._deferred, []
            for fn, args in work:
                try:
                    fn(*args)
                except Exception:  # one failure never keeps the others from running
                    log.exception("deferred work failed: %r", fn)

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def commit(self, write: Write) -> None:
        await self.submit(write)

    async def flush(self, *, force: bool = False) -> None:
        """Wait until everything submitted so far has been attempted (``force``: even an empty
        batch goes to the database, so a due checkpoint is written)."""
        if self._task is None:
            return
        marker = self._enqueue(Write(checkpoint_only=force))
        try:
            await marker
        except JournalUnavailable:
            pass

    async def _next(self, timeout: float | None) -> Write | None:
        """The next queued write, waiting up to ``timeout`` (None: for ever) for one."""
        if not self._queue:
            loop = asyncio.get_running_loop()
            self._wakeup = wakeup = loop.create_future()
            timer = loop.call_later(timeout, lambda: wakeup.done() or wakeup.set_result(None)) if timeout else None
            try:
                await wakeup
            finally:
                self._wakeup = None
                if timer is not None:
                    timer.cancel()
        return self._queue.popleft() if self._queue else None

    async def _run(self) -> None:
        while True:
            first = await self._next(None)
            if first is None:
                continue
            batch = [first]
            while len(batch) < self.max_batch and not first.alone:
                if not self._queue:
                    if not all(w.lazy for w in batch):
                        break
                    # Only facts nobody waits for: let them ride with the next commit that
                    # somebody does wait for, or go on their own once the oldest has lingered.
                    left = (self._lazy_deadline or 0.0) - asyncio.get_running_loop().time()
                    more = await self._next(left) if left > 0 else None
                    if more is None:
                        break
                    if more.alone:
                        self._queue.appendleft(more)
                        break
                    batch.append(more)
                    continue
                if self._queue[0].alone:
                    break
                batch.append(self._queue.popleft())
            self._lazy_taken()
            self._in_flight = batch
            await failpoint("journal_before_commit")
            if self._deferred:  # runs once this batch is on its way: the loop waits for the database then
                asyncio.get_running_loop().call_soon(self._run_deferred)
            await self._write_batch(batch)
            self._in_flight = []

    def _lazy_taken(self) -> None:
        """The batch just formed holds every lazy write queued so far (or the queue is full):
        the linger starts again with the next one."""
        if self._lazy_timer is not None and not any(w.lazy for w in self._queue):
            self._lazy_timer.cancel()
            self._lazy_timer = self._lazy_deadline = None

    async def _connection(self) -> AsyncConnection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = await asyncio.wait_for(self.engine.connect(), self.timeout)
            if self.engine.dialect.name == "postgresql":
                await self._name_session(self._conn)
        return self._conn

    async def _name_session(self, conn: AsyncConnection) -> None:
        """Learn (and tag) the writer connection's server session, for :meth:`settle`. The tag
        makes sure a session that a pooler has handed to someone else is never the one ended."""
        tag = f"affidavit-journal-{os.urandom(6).hex()}"
        try:
            async with asyncio.timeout(self.timeout):
                driver = (await conn.get_raw_connection()).driver_connection
                row = await driver.fetchrow(_SESSION_NAMED, tag)  # autocommit: no transaction left open
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            row, why = None, brief(exc)
        else:
            why = "the server does not show its own session"
        if row is None or row["backend_start"] is None:
            self._session = None
            if not self._session_unknown_logged:
                self._session_unknown_logged = True
                log.warning("journal: could not learn the database session of the writer's connection (%s); a write "
                            "the database does not confirm is then looked for without first ending the session it "
                            "was sent on, so one held up in the network could still land after the look", why)
            return
        self._session = (row["pid"], row["backend_start"], tag)

    async def settle(self) -> None:
        """Make sure no write the database did not confirm can land any more. On PostgreSQL such
        a write may still be on its way (held up in the network) when the broker reads that it is
        not there, and commit afterwards, unseen: the server sessions of the connections it was
        sent on are ended here (a write that had landed stays; one still on its way finds its
        session gone). Call before reading whether such a write landed. Raises what the
        database raises, or :class:`JournalUnavailable` if a session outlives its ending."""
        async with self._settling:  # one at a time: each session is ended, and struck off, once
            while self._unsettled:
                session = self._unsettled[0]
                await self._end_session(*session)
                self._unsettled.remove(session)

    async def _end_session(self, pid: int, started: Any, tag: str) -> None:
        named = {"pid": pid, "started": started, "tag": tag}
        async with self.engine.connect() as conn:
            # Each look in its own transaction: within one, PostgreSQL shows the activity view as
            # it was at the first look, and the ended session would seem to live on.
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            try:
                await conn.execute(text(_END_SESSION), named)
            except Exception as exc:
                from .queries import causes  # imported here: queries imports this module

                if not any(getattr(error, "sqlstate", None) == "42501" for error in causes(exc)):
                    raise
                # Not allowed (a role that may not end its own sessions): read as before.
                log.warning("journal: could not end the database session of a write it did not confirm (%s); a "
                            "record found missing now may still appear, and stay in flight until recovery closes "
                            "it", brief(exc))
                return
            for _ in range(100):  # ending a session is asynchronous: wait (bounded) until it is gone
                if (await conn.execute(text(_SESSION_ALIVE), named)).first() is None:
                    return
                await asyncio.sleep(0.05)
        raise JournalUnavailable(f"the database session {pid} of an unconfirmed write did not end")

    async def _drop_connection(self) -> None:
        self._driver = None
        self._session = None
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await asyncio.wait_for(conn.invalidate(), 1.0)
            except Exception:  # the connection is already gone; nothing to release
                pass

    def _rotate_chain(self) -> None:
        """After an ambiguous failure, continue on a new chain; the old one simply ends."""
        self._generation += 1
        self.writer = f"{self.writer_base}.{self._generation}"
        self._writer_seq = 0
        self._prev_hash = GENESIS
        self._checkpoint_seq = 0

    async def _write_batch(self, batch: list[Write]) -> None:
        for w in batch:
            if w.after is not None and w.after.done() and (w.after.cancelled() or w.after.exception()):
                if w.future is not None and not w.future.done():
                    w.future.set_exception(JournalUnavailable("an earlier write of this invocation failed",
                                                              unwritten=not _earlier_may_have_landed(w)))
        live = [w for w in batch if w.future is not None and not w.future.done()]
        if not any(w.events or w.insert_invocation or w.update_invocation or w.result or w.fence or w.checkpoint_only for w in live):
            for w in live:
                w.future.set_result(None)  # type: ignore[union-attr]
            return
        self._on_the_wire = False
        try:
            try:
                async with asyncio.timeout(self.timeout):  # no extra task per batch, unlike wait_for
                    refused = await self._write(live)
            except (IntegrityError, sqlite3.IntegrityError, asyncpg.UniqueViolationError):
                # A write collided with another writer's rows (a race on one invocation). Redo
                # the batch with each write in its own savepoint so only the colliding one fails.
                async with asyncio.timeout(self.timeout):
                    refused = await self._transaction(live, isolate=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure to make the rows durable: the callers are told
            self.errors += 1
            metrics.JOURNAL_ERRORS.inc()
            was_healthy, self.healthy = self.healthy, False
            self._rotate_chain()
            if self.damage is None and damaged(exc):
                self.damage = f"the journal's storage is damaged ({brief(exc)})"
                log.error(
                    "journal: %s: nothing more is recorded in it until the broker restarts, and every request is refused "
                    "(JOURNAL_UNAVAILABLE, nothing sent). Operators: stop the broker, %s", self.damage, DAMAGED_ADVICE,
                )
            # The callers first: dropping a connection to a database that does not answer takes
            # its own bounded wait.
            error = JournalUnavailable(brief(exc), unwritten=not self._on_the_wire or _rolled_back(exc))
            for w in live:
                if not w.future.done():  # type: ignore[union-attr]
                    w.future.set_exception(error)  # type: ignore[union-attr]
            behind = self._refuse_queued() if isinstance(exc, TimeoutError) else 0
            now = time.monotonic()
            if was_healthy or now - self._failure_logged_at >= FAILURE_LOG_EVERY:
                since = (f" ({self._failures_unlogged} more failed batch(es) since the last such line)"
                         if self._failures_unlogged else "")
                queued = f", and {behind} queued behind it were refused unsent" if behind else ""
                fate = "not recorded" if error.unwritten else "not confirmed (the database may have recorded them)"
                log.warning(
                    "journal write failed; %d write(s) %s%s: %s. Requests waiting on them were refused "
                    "(JOURNAL_UNAVAILABLE, nothing sent) or, for a result, delivered flagged RESULT_STORE_FAILED and "
                    "written later; the next write tries a new connection. Operators: check the database.%s",
                    len(live), fate, queued, brief(exc), since,
                )
                self._failure_logged_at, self._failures_unlogged = now, 0
            else:
                self._failures_unlogged += 1
            if not error.unwritten and self._session is not None:
                self._unsettled.append(self._session)  # until settle(), it may still land
            await self._drop_connection()
            return
        if not self.healthy:
            log.warning("journal writes work again (%d failed batch(es) so far); requests are served", self.errors)
            self._failures_unlogged = 0  # the next outage's first failure is logged whole anyway
        self.healthy = True
        self.batches += 1
        for w in live:
            if w.future.done():  # type: ignore[union-attr]
                continue
            if id(w) in refused:
                w.future.set_exception(refused[id(w)])  # type: ignore[union-attr]
            else:
                w.future.set_result(None)  # type: ignore[union-attr]

    def _refuse_queued(self) -> int:
        """After a batch the database did not answer within the timeout: the writes queued behind
        it have waited about as long, and a new batch would wait as long again, so they are
        refused now, unsent (a stalled database answers every caller within the timeout, not
        once per batch ahead of it). Lazy writes, which nobody waits for, stay for the next.
        Returns how many were refused."""
        why = (f"the journal did not answer within {self.timeout:g} s, and this write, queued behind one it did not "
               "answer, was not sent to it")
        kept: deque[Write] = deque()
        refused = 0
        for w in self._queue:
            if w.lazy:
                kept.append(w)
            elif w.future is not None and not w.future.done():
                w.future.set_exception(JournalUnavailable(why, unwritten=not _earlier_may_have_landed(w)))
                refused += 1
        self._queue = kept
        return refused

    async def _write(self, batch: list[Write]) -> dict[int, Exception]:
        if self.damage is not None:  # refused unsent (see ``damage``)
            raise JournalDamaged(f"{self.damage}, so nothing more is recorded in it until the broker restarts")
        if self._sqlite_writer is not None:
            self._on_the_wire = True  # the writer process may have begun it whatever it says
            return await self._call_batch(self._sqlite_writer.write, batch)
        if sum(len(w.result["body"]) for w in batch if w.result) < _INLINE_LIMIT:
            return await self._call_batch(self._write_pg, batch)
        return await self._transaction(batch, isolate=False)

    async def _write_pg(self, document: bytes) -> list[dict[str, Any]]:
        """PostgreSQL: one ``affidavit_write`` call (one round trip, autocommit); refused checks
        come back as SQLSTATE AF001 with nothing written."""
        driver = self._driver
        if driver is not None and driver.is_closed():
            # The database closed it while the writer was idle (a restart, a cut): nothing was
            # sent on it, so take a new connection instead of failing this batch.
            await self._drop_connection()
            driver = None
        if driver is None:
            conn = await self._connection()
            driver = self._driver = (await conn.get_raw_connection()).driver_connection
        self._on_the_wire = True
        try:
            await driver.execute(_BATCH_CALL, document.decode())
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", None) != "AF001":
                raise
            return list(json.loads(exc.detail or "[]"))
        return []

    async def _call_batch(
        self, execute: Callable[[bytes], Awaitable[list[dict[str, Any]]]], batch: list[Write]
    ) -> dict[int, Exception]:
        """The whole batch as one document (``affidavit_write`` on PostgreSQL, the writer process
        on SQLite). Refused fences or claims come back with nothing written; those writes are
        dropped, the rest re-chained, and the document sent again.
        """
        refused: dict[int, Exception] = {}
        live = list(batch)
        while True:
            chain = [self._writer_seq, self._prev_hash]
            payload, mark = self._payload(live, chain)
            answer = await execute(payload)
            if answer:
                for item in answer:
                    w = live[item["write"]]
                    refused[id(w)] = (
                        IdempotencyConflict(w.insert_invocation["invocation_id"])  # type: ignore[index]
                        if item["why"] == "claim"
                        else LeaseLost(w.fence.invocation_id if w.fence else "")
                    )
                live = [w for w in live if id(w) not in refused]
                continue
            self._writer_seq, self._prev_hash = chain
            self._checkpointed(mark)
            return refused

    def _payload(self, writes: list[Write], chain: list[Any]) -> tuple[bytes, dict[str, Any] | None]:
        """The batch as one JSON document for ``affidavit_write`` (bytes as ``\\x`` hex)."""
        checks: list[dict[str, Any]] = []
        for i, w in enumerate(writes):
            check: dict[str, Any] = {}
            if w.fence is not None:
                f = w.fence
                check["fence"] = {"invocation_id": f.invocation_id, "generation": f.generation, "owner": f.owner,
                                  "now": f.now, "check_expiry": f.check_expiry}
            if w.claim and w.insert_invocation:
                check["claim"] = w.insert_invocation
            if check:
                check["write"] = i
                checks.append(check)
        event_rows = self._chain_rows(writes, chain)
        inserts, updates = _projections(writes)
        mark = self._checkpoint(chain)
        document = {
            "checks": checks,
            "inserts": inserts,
            "events": event_rows,
            "updates": [_keyed(row) for row in updates.values()],
            "results": [w.result for w in writes if w.result],
            "checkpoints": [mark] if mark else [],
        }
        # Empty parts are left out: the function skips the statements of absent parts (0009).
        document = {part: rows for part, rows in document.items() if rows}
        return orjson.dumps(document, default=_json_value), mark

    def _checkpoint(self, chain: list[Any]) -> dict[str, Any] | None:
        """A chain checkpoint row if one is due after this batch (same transaction as its events)."""
        seq, head = chain
        if not checkpoint_due(seq, self._checkpoint_seq, time.monotonic() - self._checkpoint_at):
            return None
        return checkpoint_row(self.writer, seq, head, datetime.now(UTC))

    def _checkpointed(self, mark: dict[str, Any] | None) -> None:
        if mark is not None:
            self._checkpoint_seq, self._checkpoint_at = mark["writer_seq"], time.monotonic()

    def _chain_rows(self, writes: list[Write], chain: list[Any]) -> list[dict[str, Any]]:
        """Event rows extending the audit chain held in ``chain`` (writer_seq, prev_hash)."""
        writer_seq, prev_hash = chain
        writer = self.writer
        rows: list[dict[str, Any]] = []
        for w in writes:
            for e in w.events:
                writer_seq += 1
                digest = hashlib.sha256(_canonical(
                    e.invocation_id, e.seq, e.kind, canonical_time(e.at), writer, writer_seq, prev_hash, e.key_id, e.payload
                )).hexdigest()  # fmt: skip
                rows.append({
                    "invocation_id": e.invocation_id,
                    "seq": e.seq,
                    "kind": e.kind,
                    "at": e.at,
                    "writer": writer,
                    "writer_seq": writer_seq,
                    "prev_hash": prev_hash,
                    "key_id": e.key_id,
                    "payload": e.payload,
                    "hash": digest,
                })  # fmt: skip
                prev_hash = digest
        chain[:] = [writer_seq, prev_hash]
        return rows

    async def _transaction(self, batch: list[Write], *, isolate: bool) -> dict[int, Exception]:
        """Plain statements: isolated retries, and PostgreSQL's batches with large results.

        SQLite runs the whole transaction in one worker thread with its own connection (one thread
        hop per batch, not one per statement); PostgreSQL runs it through the async connection.
        """
        if self._sqlite_thread is not None:
            loop = asyncio.get_running_loop()
            self._on_the_wire = True
            return await loop.run_in_executor(self._sqlite_thread, self._sqlite_transaction, batch, isolate)
        conn = await self._connection()
        self._on_the_wire = True
        return await conn.run_sync(lambda sync: self._statements(CoreStatements(sync), batch, isolate))

    def _sqlite_transaction(self, batch: list[Write], isolate: bool) -> dict[int, Exception]:
        if self._sqlite is None:
            assert self._sqlite_path is not None
            self._sqlite = SqliteStatements.connect(self._sqlite_path, self.timeout)
        try:
            return self._statements(self._sqlite, batch, isolate)
        except sqlite3.Error:
            self._close_sqlite()  # the next batch starts on a fresh connection
            raise

    def _statements(self, statements: Statements, batch: list[Write], isolate: bool) -> dict[int, Exception]:
        """One transaction for the batch (synchronous). Returns the writes refused, with why.

        Fenced writes and idempotency claims are checked row by row first; everything else goes
        in a few multi-row statements. With ``isolate``, each write gets its own savepoint.
        The chain state is adopted only once the transaction has committed.
        """
        chain = [self._writer_seq, self._prev_hash]
        generation = self._generation  # a timed-out batch that commits late must not move the chain
        refused: dict[int, Exception] = {}
        with statements.transaction():
            kept: list[Write] = []
            for w in batch:
                if w.fence is not None and not statements.holds(w.fence):
                    refused[id(w)] = LeaseLost(w.fence.invocation_id)
                elif w.claim and not statements.claim(w.insert_invocation):  # type: ignore[arg-type]
                    refused[id(w)] = IdempotencyConflict(w.insert_invocation["invocation_id"])  # type: ignore[index]
                else:
                    kept.append(w)
            if isolate:
                for w in kept:
                    saved = list(chain)
                    try:
                        with statements.savepoint():
                            self._insert(statements, [w], chain)
                    except statements.integrity_errors as exc:
                        chain[:] = saved
                        refused[id(w)] = LeaseLost(f"conflicting write: {brief(exc)}")
            else:
                self._insert(statements, kept, chain)
            mark = self._checkpoint(chain)
            if mark is not None:
                statements.insert(chain_checkpoints, [mark])
        if generation == self._generation:
            self._writer_seq, self._prev_hash = chain
            self._checkpointed(mark)
        return refused

    def _insert(self, statements: Statements, writes: list[Write], chain: list[Any]) -> None:
        """The rows of ``writes`` as plain statements."""
        event_rows = self._chain_rows(writes, chain)
        inserts, updates = _projections(writes)
        store_rows(statements, inserts, event_rows, list(updates.values()), [w.result for w in writes if w.result])


def _projections(writes: list[Write]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The invocation rows a batch inserts, and the projection updates it still has to make.

    An invocation inserted by this batch and updated later in it (its lazy first facts riding
    with its DISPATCH_STARTED) is inserted once with its latest projection; of several updates
    of one invocation only the last counts. A claimed insert is made by the claim check, so
    updates of it stay updates.
    """
    inserts: dict[str, dict[str, Any]] = {}
    updates: dict[str, dict[str, Any]] = {}
    for w in writes:
        if w.insert_invocation and not w.claim:
            inserts[w.insert_invocation["invocation_id"]] = dict(w.insert_invocation)
        if w.update_invocation:
            key = w.update_invocation["b_invocation_id"]
            if key in inserts:
                inserts[key].update((k, v) for k, v in w.update_invocation.items() if k != "b_invocation_id")
            else:
                updates[key] = w.update_invocation
    return list(inserts.values()), updates


def _keyed(update_row: dict[str, Any]) -> dict[str, Any]:
    """A projection update as ``affidavit_write`` takes it (keyed by ``invocation_id``)."""
    row = dict(update_row)
    row["invocation_id"] = row.pop("b_invocation_id")
    return row


#: PostgreSQL: the writer connection's server session, named by its pid, when it began (pids are
#: reused) and a tag of its own in application_name (a pooler hands a session to its next client).
#: Ending one (:meth:`Journal.settle`) happens only where all three still match.
_SESSION_NAMED = ("SELECT pid, backend_start, set_config('application_name', $1, false) FROM pg_stat_activity "
                  "WHERE pid = pg_backend_pid()")
_END_SESSION = ("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid = :pid AND backend_start = :started AND application_name = :tag")
_SESSION_ALIVE = ("SELECT 1 FROM pg_stat_activity "
                  "WHERE pid = :pid AND backend_start = :started AND application_name = :tag")

#: Results larger than this (in total per batch) go through plain statements, not inline JSON.
_INLINE_LIMIT = 256 * 1024
_BATCH_CALL = "SELECT affidavit_write($1::jsonb)"


def _json_value(value: Any) -> Any:
    """For orjson: bytes become PostgreSQL's hex bytea input (datetimes it encodes itself)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\x" + bytes(value).hex()
    raise TypeError(f"cannot put {type(value).__name__} into a journal batch")


def projection_row(invocation_id: str, values: dict[str, Any]) -> dict[str, Any]:
    """Parameters for the projection update: every projection column, always (executemany)."""
    row = {name: values[name] for name in PROJECTION_COLUMNS}
    row["b_invocation_id"] = invocation_id
    return row


#: SQLSTATE classes of an error that may end a session whose transaction had committed: a lost
#: connection (08), an operator's or the server's intervention (57: a shutdown, a terminated
#: backend), a system error (58), an internal one (XX).
_MAY_HAVE_COMMITTED = frozenset({"08", "57", "58", "XX"})


def _earlier_may_have_landed(w: Write) -> bool:
    """Whether the earlier write of ``w``'s invocation that it waits on failed in a way that may
    have landed (``w`` itself was never sent): then the invocation may have a record after all."""
    earlier = w.after
    if earlier is None or not earlier.done() or earlier.cancelled():
        return False
    failure = earlier.exception()
    return isinstance(failure, JournalUnavailable) and not failure.unwritten


def _rolled_back(exc: BaseException) -> bool:
    """Whether PostgreSQL answered the batch with an error that rolled its transaction back (a
    read-only database, a full disk, a check that failed), so nothing of it was written."""
    return any(isinstance(error, asyncpg.PostgresError)
               and str(getattr(error, "sqlstate", "") or "")[:2] not in _MAY_HAVE_COMMITTED for error in causes(exc))


def brief(exc: BaseException) -> str:
    """One line for operators; driver exception names stay in logs, never in envelopes."""
    if isinstance(exc, asyncio.TimeoutError):
        return "the database did not answer in time"
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
