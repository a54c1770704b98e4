"""One invocation's log: contract events in, durable rows out.

The bridge between the pure contract and the journal. :meth:`InvocationLog.append` validates an
event against the contract and folds it into the in-memory :class:`~proxy.contract.Record`;
:meth:`submit` hands the new events and the resulting projection to the journal (write-behind);
:meth:`commit` waits until they are durable (write-through, used at the dispatch boundary and
before any answer that names the invocation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ulid import ULID

from . import metrics
from .contract import Event, EventKind, Operation, Record, Retry, apply, retry_hint
from .store.journal import EventRow, Fence, Journal, JournalUnavailable, LeaseLost, Write, brief, projection_row

log = logging.getLogger("affidavit.invocations")

def new_invocation_id() -> str:
    return f"act_{ULID()}"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Identity:
    """What the invocation is: fixed when it is accepted, stored once."""

    invocation_id: str
    agent: str
    route: str | None
    method: str
    target: str
    fingerprint: str
    idempotent: bool
    remote_contract: bool = False
    idempotency_key: str | None = None
    idempotency_scope: str | None = None
    idempotency_expires_at: datetime | None = None
    retry_budget: int = 0

    @property
    def operation(self) -> Operation:
        return Operation(idempotent=self.idempotent, remote_contract=self.remote_contract, fingerprint=self.fingerprint)

    def retention_open(self, now: datetime) -> bool:
        return self.idempotency_expires_at is None or now < self.idempotency_expires_at

    def may_resend(self, now: datetime, generation: int) -> bool:
        """Whether a repeat with the same key could still be sent: the remote contract's retention
        is open and the retry budget is not used up (else the repeat is RETRY_BUDGET_EXHAUSTED)."""
        return self.retention_open(now) and generation < self.retry_budget

    def budget_left(self, generation: int) -> bool:
        """Whether a repeat with this invocation's key may still be attempted (none without a key)."""
        return self.idempotency_key is None or generation < self.retry_budget


def identity_of(row: dict[str, Any]) -> Identity:
    """The stored identity of an invocation (as accepted; later config changes do not alter it)."""
    return Identity(
        invocation_id=row["invocation_id"],
        agent=row["agent"],
        route=row["route"],
        method=row["method"],
        target=row["target"],
        fingerprint=row["fingerprint"],
        idempotent=bool(row["idempotent"]),
        remote_contract=bool(row["remote_contract"]),
        idempotency_key=row["idempotency_key"],
        idempotency_scope=row["idempotency_scope"],
        idempotency_expires_at=aware(row["idempotency_expires_at"]) if row["idempotency_expires_at"] else None,
        retry_budget=row["retry_budget"],
    )


def aware(value: datetime) -> datetime:
    """SQLite hands timestamps back without a zone; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class InvocationLog:
    def __init__(
        self,
        journal: Journal,
        identity: Identity,
        owner: str,
        *,
        record: Record | None = None,
        persisted: bool = False,
        generation: int = 0,
        taken_from: str | None = None,
    ):
        self.journal = journal
        #: The owner whose record this process only closes (recovery), else None: it did not time
        #: the invocation, so its end-of-invocation line has no duration and names that owner.
        self.taken_from = taken_from
        self.identity = identity
        self.owner = owner
        self.record = record or Record()
        self.generation = generation
        #: Set while this process holds a lease for a re-send (see proxy.store.leases).
        self.lease_expires_at: datetime | None = None
        self.credential: tuple[str | None, str | None, str | None] = (None, None, None)
        self.attempts_used = self.record.dispatch_count
        self._buffer: list[EventRow] = []
        self._persisted = persisted
        #: Some of this record is known to be durable (a commit of it succeeded).
        self.durable = persisted
        self._last: asyncio.Future[None] | None = None
        #: Writes not known to be durable yet, oldest first (pruned as they succeed): what
        #: :meth:`resubmit` sends again after the journal failed them.
        self._unconfirmed: list[Write] = []
        #: Held while failed writes are sent again: two commits of this invocation at once (the
        #: background finisher and the delivery repair) must not both resend the same writes.
        self._resending: asyncio.Lock | None = None
        #: A result whose commit failed before its write was made (an earlier write had to be sent
        #: again first, and the journal still failed): it stays with the buffered events (its
        #: RESULT_COMMITTED among them) and goes in the next write made of them.
        self._result: dict[str, Any] | None = None
        self._created_at = utcnow()
        #: The last failure's internal diagnostic (library or secret-source text, never a value),
        #: for the operator's end-of-invocation log line.
        self._diagnostic: str | None = None
        self._started = time.monotonic()
        self._dispatched_at: float | None = None
        #: The end this log appended (the record then, and when), until the write that holds it
        #: is durable: only then is it logged and counted (:meth:`_end_landed`).
        self._end: tuple[Record, float] | None = None
        self._end_write: Write | None = None

    @property
    def invocation_id(self) -> str:
        return self.identity.invocation_id

    def append(self, kind: EventKind, **data: Any) -> Event:
        """Record a fact. Raises :class:`~proxy.contract.IllegalTransition` for impossible moves."""
        data = {k: v for k, v in data.items() if v is not None}
        if "diagnostic" in data:
            self._diagnostic = data["diagnostic"]
        seq = (self.record.last_seq or 0) + 1
        event = Event(kind, data, seq)
        was_ended = self.record.ended
        record = apply(self.record, event)
        # Encoded before the record moves on: data that cannot be stored leaves the record as it was.
        payload, key_id = self.journal.encode_payload(self.invocation_id, seq, data)
        self.record = record
        if kind is EventKind.DISPATCH_STARTED:
            self.attempts_used = self.record.dispatch_count
            self._dispatched_at = time.monotonic()
        if self.record.ended and not was_ended:
            self._end = (self.record, time.monotonic())
        self._buffer.append(EventRow(self.invocation_id, seq, kind.value, utcnow(), payload, key_id))
        return event

    def adopt(self, events: list[Event]) -> None:
        """Fold events another process appended (an operator's decision) into this log. An end
        among them was logged and counted where it was appended, so not again here."""
        for event in events:
            self.record = apply(self.record, event)

    def _end_landed(self, write: Write) -> None:
        """``write`` is durable: if it holds this log's end, log and count that end now.

        One structured line (and one count) per ended attempt the journal holds: an end whose
        write never lands (the journal refused it, or another broker closed the record first) is
        not reported here, since the record says otherwise or nothing. The line is written once
        the journal writer has sent its next batch (:meth:`Journal.defer`), while the database
        works, not while the caller waits for the same commit."""
        if write is not self._end_write or self._end is None:
            return
        (record, now), self._end, self._end_write = self._end, None, None
        self.journal.defer(self._emit_end, record, now)

    def _emit_end(self, record: Record, now: float) -> None:
        identity = self.identity
        metrics.invocation_ended(identity.route, record.phase.value, record.outcome.value, record.code.value if record.code else None)
        log.info(
            "invocation ended",
            extra={
                "invocation_id": identity.invocation_id,
                "agent": identity.agent,
                "route": identity.route,
                "method": identity.method,
                "phase": record.phase.value,
                "outcome": record.outcome.value,
                "code": record.code.value if record.code else None,
                "caller_disposition": record.caller_disposition.value,
                "status": record.status,
                "attempts": record.dispatch_count,
                "total_ms": None if self.taken_from else round((now - self._started) * 1000, 2),
                "remote_ms": round((now - self._dispatched_at) * 1000, 2) if self._dispatched_at else None,
                "diagnostic": self._diagnostic,
                **({"recovered_from": self.taken_from} if self.taken_from else {}),
            },
        )

    def retry_for(self, record: Record, now: datetime | None = None) -> Retry | None:
        """The retry hint for ``record`` (this log's, or a provisional end of it): a same-key
        re-send counts only while the retention is open and the retry budget is not used up."""
        identity = self.identity
        return retry_hint(record, identity.operation, retention_open=identity.may_resend(now or utcnow(), self.generation),
                          budget_left=identity.budget_left(self.generation))

    def projection(self, now: datetime | None = None) -> dict[str, Any]:
        now = now or utcnow()
        record = self.record
        retry = self.retry_for(record, now)
        return {
            "updated_at": now,
            "stage": record.stage.value,
            "phase": record.phase.value,
            "outcome": record.outcome.value,
            "retry": retry.value if retry else None,
            "code": record.code.value if record.code else None,
            "caller_disposition": record.caller_disposition.value,
            "dispatch_started": record.dispatch_started,
            "dispatch_seq": record.dispatch_seq,
            "status": record.status,
            "last_seq": record.last_seq or 0,
            "attempts_used": self.attempts_used,
            "credential_id": self.credential[0],
            "credential_version": self.credential[1],
            "injection": self.credential[2],
            "owner": self.owner,
            "lease_expires_at": None if record.ended else self.lease_expires_at,
        }

    def _insert_row(self, projection: dict[str, Any]) -> dict[str, Any]:
        i = self.identity
        return {
            "invocation_id": i.invocation_id,
            "created_at": self._created_at,
            "agent": i.agent,
            "route": i.route,
            "method": i.method,
            "target": i.target,
            "fingerprint": i.fingerprint,
            "idempotent": i.idempotent,
            "idempotency_key": i.idempotency_key,
            "idempotency_scope": i.idempotency_scope,
            "idempotency_expires_at": i.idempotency_expires_at,
            "remote_contract": i.remote_contract,
            "generation": self.generation,
            "retry_budget": i.retry_budget,
            "replays": 0,
            **projection,
        }

    def fence(self, *, check_expiry: bool = False) -> Fence | None:
        """Writes of a re-send are fenced by its generation; the first attempt needs none."""
        if self.generation == 0:
            return None
        return Fence(self.invocation_id, self.generation, self.owner, utcnow(), check_expiry)

    def submit(
        self,
        *,
        result: dict[str, Any] | None = None,
        fence: Fence | None = None,
        claim: bool = False,
        lazy: bool = False,
    ) -> asyncio.Future[None]:
        """Hand buffered events (and the new projection) to the journal without waiting.

        ``claim``: the first write of a keyed invocation, refused with IdempotencyConflict if
        another invocation holds the same (agent, scope, key).
        """
        write = self._next_write(result, fence, claim, lazy)
        self._last = self.journal.submit(write)
        if lazy:  # nobody awaits it: its landing is what makes the record durable
            self._last.add_done_callback(self._landed)
        if write is self._end_write:
            self._last.add_done_callback(lambda future: None if _went_wrong(future) else self._end_landed(write))
        return self._last

    async def commit(
        self, *, result: dict[str, Any] | None = None, fence: Fence | None = None, claim: bool = False
    ) -> None:
        """Make everything appended so far durable; raises JournalUnavailable or LeaseLost.

        A write nobody waited for that failed (a lazy one, during an outage) would have every
        later write of this invocation refused after it: it is sent again first, in order."""
        if any(_failed(w) for w in self._unconfirmed):  # those after it, still queued, fail with it
            if result is not None:
                self._result = result  # should the resend fail: see _next_write
            try:
                await self.resubmit()
            except LeaseLost:  # another broker closed the record meanwhile: these can never be made
                raise JournalUnavailable("an earlier write of this invocation failed, and another broker has "
                                         "closed the record since") from None
            if result is not None:
                # Still stashed, or taken meanwhile by a write nobody waits for (the caller left
                # during the resend), which then carries it with its RESULT_COMMITTED: never twice.
                result, self._result = self._result, None
        await self.submit(result=result, fence=fence, claim=claim)
        self.durable = True

    def _next_write(self, result: dict[str, Any] | None, fence: Fence | None, claim: bool, lazy: bool) -> Write:
        """The buffered events and the new projection, as one write after the previous one."""
        projection = self.projection()
        if result is None:
            result = self._result
        self._result = None
        write = Write(events=self._buffer, result=result, fence=fence or self.fence(), after=self._last, lazy=lazy)
        self._unconfirmed = [w for w in self._unconfirmed if not _durable(w)]
        self._unconfirmed.append(write)
        self._buffer = []
        if self._end is not None and self._end_write is None:
            self._end_write = write  # the end's event is among these rows
        if self._persisted:
            write.update_invocation = projection_row(self.invocation_id, projection)
        else:
            write.insert_invocation = self._insert_row(projection)
            write.claim = claim
            self._persisted = True
        return write

    async def resubmit(self) -> None:
        """Send every write the journal failed again, oldest first, each whole, and wait for each.

        A write whose rows are there already counts as done: its commit had landed, unconfirmed
        (the journal refuses it as a conflicting write, :class:`LeaseLost`, and the stored events
        at its sequence numbers are its own). Every later write failed with it, unsent, and goes
        after it, so the record keeps each event, in order. Each goes in a batch of its own.
        Raises :class:`JournalUnavailable` when the journal still fails (call it again then), and
        :class:`LeaseLost` when other events hold those sequence numbers (another broker closed
        the record meanwhile: these writes can never be made).
        """
        if self._resending is None:
            self._resending = asyncio.Lock()
        async with self._resending:  # another commit's resend may have made some of them since
            await self._resend()

    async def _resend(self) -> None:
        for write in [w for w in self._unconfirmed if not _durable(w)]:
            if write.future is not None and not write.future.done():
                # Still in flight (another commit's, sent after its resend): it ends first, and
                # one that lands is not sent twice.
                await asyncio.wait([write.future])
                if _durable(write):
                    self._confirmed(write)
                    continue
            again = Write(
                events=write.events,
                insert_invocation=write.insert_invocation,
                update_invocation=write.update_invocation,
                result=write.result,
                fence=write.fence,
                claim=write.claim,
                alone=True,
            )
            self._last = self.journal.submit(again)
            try:
                await self._last
            except LeaseLost:
                if not await self._stored(write):
                    raise
                self._last = _done()  # it had landed: the next write goes after it, not after its refusal
            self._confirmed(write)

    async def settle_landed(self) -> None:
        """Confirm, oldest first, the failed writes the database holds after all (their commits
        landed unconfirmed), and stop at the first it does not: it writes nothing. For a record
        another path has found ended; an end of this log's among them is reported now.
        Raises :class:`JournalUnavailable` when the read fails."""
        for write in [w for w in self._unconfirmed if _failed(w)]:
            if not await self._stored(write):
                return
            self._confirmed(write)

    def _confirmed(self, write: Write) -> None:
        """``write`` is durable now. Its committer may have woken first and pruned it already
        (:meth:`_next_write` drops the durable ones), so it may be gone."""
        if write in self._unconfirmed:
            self._unconfirmed.remove(write)
        self._end_landed(write)

    async def _stored(self, write: Write) -> bool:
        """Whether the database holds ``write``'s events as they are (its commit had landed).
        A read that fails is :class:`JournalUnavailable`, as :meth:`resubmit` promises its callers
        (the delivery repair tries again on it; any other error would end the repair for good)."""
        from .store import queries  # imported here: queries imports the journal module this one uses

        try:
            stored = await queries.event_rows(self.journal.engine, self.invocation_id)
        except queries.DATABASE_ERRORS as exc:
            raise JournalUnavailable(f"could not read back whether an earlier write had landed: {brief(exc)}") from exc
        rows = {r["seq"]: r for r in stored}
        return all(
            e.seq in rows and rows[e.seq]["kind"] == e.kind and bytes(rows[e.seq]["payload"]) == e.payload
            for e in write.events
        )

    def _landed(self, future: asyncio.Future[None]) -> None:
        if not _went_wrong(future):
            self.durable = True

    def submit_quietly(self) -> None:
        """Write-behind for facts nobody waits on; a failed one is sent again by the next commit.

        The rows ride with the next commit anyone waits for (usually this invocation's own
        DISPATCH_STARTED), or go alone after the journal's linger. A crash inside that window
        loses them; that is only ever the record of a request that was not yet sent.
        """
        future = self.submit(lazy=True)
        future.add_done_callback(_consume)

    @property
    def broken(self) -> bool:
        return _went_wrong(self._last)


def _went_wrong(future: asyncio.Future[None] | None) -> bool:
    return future is not None and future.done() and (future.cancelled() or future.exception() is not None)


def _durable(write: Write) -> bool:
    future = write.future
    return future is not None and future.done() and not _went_wrong(future)


def _failed(write: Write) -> bool:
    return _went_wrong(write.future)


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def _consume(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


__all__ = ["Identity", "InvocationLog", "JournalUnavailable", "new_invocation_id", "utcnow"]
