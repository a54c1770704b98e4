"""What people decide, appended to the record: approvals, denials, reconciliations.

Each decision is one more event on an existing invocation, with its own sequence number; nothing
earlier is rewritten (the caller's disposition and the dispatch evidence stay as they were). The
contract refuses what a decision may not claim: a reconciliation is never ``not_attempted`` or
``unknown``, and only a held request can be approved or denied.
"""

from __future__ import annotations

from typing import Any, Callable

from .contract import (TRANSITIONS, EventKind, IllegalTransition, Outcome, Record, Stage, classify_status,
                       contradicted_answer, project)
from .invocation_log import InvocationLog, identity_of
from .store import queries
from .store.journal import Journal, JournalUnavailable, LeaseLost

RECONCILABLE = (Outcome.COMMITTED, Outcome.REJECTED, Outcome.PARTIAL_EFFECT)


class DecisionRefused(Exception):
    """The decision does not fit the record, or the journal did not take it (``status`` is the
    HTTP status to answer with, ``title`` the problem's title)."""

    def __init__(self, status: int, message: str, title: str = "Refused"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.title = title


async def _append(
    journal: Journal, row: dict[str, Any], kind: EventKind, data: dict[str, Any],
    check: Callable[[Record], None] | None = None,
) -> Record:
    """Append one decision to the record as it is now; ``check`` may refuse it first."""
    _, events = await queries.events_of(journal.engine, row["invocation_id"], journal.decode_payload)
    record = project(events)
    if check is not None:
        check(record)
    entry = InvocationLog(journal, identity_of(row), row["owner"], record=record, persisted=True,
                          generation=row["generation"])
    entry.credential = (row["credential_id"], row["credential_version"], row["injection"])
    entry.lease_expires_at = row["lease_expires_at"]  # the holder's lease is the holder's: keep it
    try:
        entry.append(kind, **data)
    except IllegalTransition as exc:
        raise DecisionRefused(409, f"invocation {row['invocation_id']} (stage {entry.record.stage.value}) "
                                   f"cannot take {kind.value}: {exc}") from None
    try:
        await entry.commit()
    except LeaseLost:
        raise DecisionRefused(409, f"invocation {row['invocation_id']} changed while deciding; look again") from None
    except JournalUnavailable as exc:
        invocation_id = row["invocation_id"]
        if journal.damage is not None:  # no wait cures it (see Journal.damage)
            raise DecisionRefused(503, f"the journal could not record {kind.value} on invocation {invocation_id}: "
                                       f"{journal.damage}, and nothing is recorded in it until the broker restarts "
                                       "(see its log). Nothing was changed.", "Journal unavailable") from None
        if exc.unwritten:
            raise DecisionRefused(503, f"the journal could not record {kind.value} on invocation {invocation_id} "
                                       f"({exc}); nothing was changed. Try again once the database answers.",
                                  "Journal unavailable") from None
        raise DecisionRefused(503, f"the journal did not confirm {kind.value} on invocation {invocation_id} ({exc}): "
                                   "the database may have recorded it all the same. Look before deciding again "
                                   f"(affidavit invocations show {invocation_id}, or GET /v1/invocations/{{id}}).",
                              "Journal unavailable") from None
    return entry.record


async def decide_approval(journal: Journal, row: dict[str, Any], approve: bool, note: str | None, by: str) -> Record:
    """Approve or deny a held request. An approval is bound to the card's fingerprint."""
    _, events = await queries.events_of(journal.engine, row["invocation_id"], journal.decode_payload)
    record = project(events)
    if record.stage is not Stage.HELD:
        raise DecisionRefused(409, f"invocation {row['invocation_id']} is not waiting for approval (stage {record.stage.value})")
    card = next(e.data for e in reversed(events) if e.kind is EventKind.APPROVAL_REQUESTED)
    if approve:
        data = {
            "approves": card["approves"],
            "config_digest": card["config_digest"],
            "credential_version": card.get("credential_version"),
            "by": by,
            "note": note,
        }
        return await _append(journal, row, EventKind.APPROVAL_GRANTED, data)
    return await _append(journal, row, EventKind.APPROVAL_DENIED, {"by": by, "note": note})


def refuse_unreconcilable(row: dict[str, Any], record: Record) -> None:
    """Raise if no finding may follow ``record`` at all, whatever it says: it was never sent, or
    it is still in progress. (Checked before a lookup is even tried.)"""
    if record.stage is Stage.ENDED_NOT_ATTEMPTED:
        raise DecisionRefused(
            409,
            f"invocation {row['invocation_id']} was never sent: it stopped before the dispatch boundary "
            f"(outcome not_attempted, code {record.code.value if record.code else '-'}), so it had no remote "
            "effect and there is nothing to reconcile. Nothing was changed.",
        )
    if record.stage not in TRANSITIONS[EventKind.RECONCILED][0]:  # the other stages a finding may not follow
        raise DecisionRefused(
            409,
            f"invocation {row['invocation_id']} is still in progress (stage {record.stage.value}). Nothing was "
            "changed. Reconcile it once it has ended (GET /v1/invocations/{id}).",
        )


async def reconcile(
    journal: Journal,
    row: dict[str, Any],
    outcome: Outcome,
    certainty: str,
    reference: str | None,
    note: str | None,
    by: str,
    override: bool = False,
) -> Record:
    """Append what was found out about the effect; the original attempt stays as it was.

    ``override``: the finding may change the outcome of a record that holds the remote's complete
    answer (and says so); see :func:`contract.contradicted_answer`."""
    if outcome not in RECONCILABLE:
        raise DecisionRefused(422, f"a reconciliation says committed, rejected or partial_effect, not {outcome.value}")
    data = {"outcome": outcome.value, "certainty": certainty, "reference": reference, "note": note, "by": by}
    if override:
        data["override"] = True

    def against_the_answer(record: Record) -> None:
        refuse_unreconcilable(row, record)
        overturned = contradicted_answer(record, outcome)
        if overturned is not None and not override:
            if not record.response_complete or record.status is None:  # a lookup's answer set it, or stands behind it
                held = (f"the outcome is {overturned.value}, on a record where the remote's answer to a lookup set it "
                        f"(certainty remote_query), and a finding of {outcome.value} would overturn it")
            elif record.reconciled_outcome is None or overturned is classify_status(record.status):
                agreed = " (as an earlier finding does)" if record.reconciled_outcome is not None else ""
                held = (f"the remote's complete answer (status {record.status}) says {overturned.value}{agreed}, and a "
                        f"finding of {outcome.value} would overturn it")
            else:
                held = (f"an earlier finding set the outcome to {overturned.value} against the remote's complete answer "
                        f"(status {record.status}), and a finding of {outcome.value} would overturn that finding")
            raise DecisionRefused(
                409,
                f"invocation {row['invocation_id']}: {held}. Nothing was changed. If you "
                "are sure (the remote undid the operation, its status was wrong, or an earlier finding was), send "
                "override=true (affidavit reconcile --override).",
            )

    return await _append(journal, row, EventKind.RECONCILED, data, against_the_answer)
