"""The evidence contract: event kinds, the projection, retry hints and ``decide()``.

Rule 1: everything that decides what the broker *claims* about a remote effect lives in this
module. It does no I/O and knows nothing of mitmproxy, aiohttp, SQL or asyncio; adapters turn
what they observe into :class:`Event` values and ask this module what those events prove.

Three rules hold by construction rather than by care:

* ``outcome`` is derived from evidence (a complete result, a dispatch, a reconciliation), never
  taken from what a failure *says*. So once ``DISPATCH_STARTED`` is in the log, no later event can
  make the outcome ``not_attempted`` again.
* Events are validated against :data:`TRANSITIONS` before they are folded; an impossible move
  (a result before a dispatch, a delivery before a commit) raises :class:`IllegalTransition`.
* ``retry`` is computed from the record, the route's declared semantics and the clock; callers
  never infer it from message text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from datetime import UTC
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Any, Iterable, Mapping


class Phase(StrEnum):
    """Where the broker stopped (diagnosis, not retry policy)."""

    VALIDATION = "validation"
    CREDENTIAL_INJECTION = "credential_injection"
    CONNECTION_SETUP = "connection_setup"
    REMOTE_EXECUTION = "remote_execution"
    RESULT_DELIVERY = "result_delivery"


class Outcome(StrEnum):
    """What the broker knows about the remote effect."""

    NOT_ATTEMPTED = "not_attempted"
    REJECTED = "rejected"
    COMMITTED = "committed"
    UNKNOWN = "unknown"
    # Only ever reached by reconciliation: the remote proves part of the work was done.
    PARTIAL_EFFECT = "partial_effect"


class Retry(StrEnum):
    """What automation may do now."""

    NEVER = "never"
    AFTER_CORRECTION = "after_correction"
    BACKOFF = "backoff"
    SAME_IDEMPOTENCY_KEY = "same_idempotency_key"
    RECONCILE = "reconcile"
    FETCH_RESULT = "fetch_result"


class Code(StrEnum):
    """Stable machine codes. Extend deliberately: callers branch on these."""

    INVALID_TARGET = "INVALID_TARGET"
    UNSUPPORTED_ACTION = "UNSUPPORTED_ACTION"
    PAYLOAD_LIMIT = "PAYLOAD_LIMIT"
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
    FORBIDDEN_HEADER_OVERRIDE = "FORBIDDEN_HEADER_OVERRIDE"
    PROXY_AUTH_REQUIRED = "PROXY_AUTH_REQUIRED"
    APPROVAL_REQUIRED = "APPROVAL_REQUIRED"
    APPROVAL_DENIED = "APPROVAL_DENIED"
    APPROVAL_STALE = "APPROVAL_STALE"
    CREDENTIAL_MISSING = "CREDENTIAL_MISSING"
    VAULT_LOCKED = "VAULT_LOCKED"
    CREDENTIAL_DECRYPT_FAILED = "CREDENTIAL_DECRYPT_FAILED"
    DNS_FAILED = "DNS_FAILED"
    CONNECT_REFUSED = "CONNECT_REFUSED"
    CONNECT_TIMEOUT = "CONNECT_TIMEOUT"
    CONNECT_FAILED = "CONNECT_FAILED"
    TLS_HANDSHAKE_FAILED = "TLS_HANDSHAKE_FAILED"
    TLS_CERT_INVALID = "TLS_CERT_INVALID"
    TLS_CERT_UNTRUSTED = "TLS_CERT_UNTRUSTED"
    TLS_CERT_EXPIRED = "TLS_CERT_EXPIRED"
    TLS_HOSTNAME_MISMATCH = "TLS_HOSTNAME_MISMATCH"
    REMOTE_OUTCOME_UNKNOWN = "REMOTE_OUTCOME_UNKNOWN"
    REMOTE_RESULT_INCOMPLETE = "REMOTE_RESULT_INCOMPLETE"
    CALLER_CANCELLED = "CALLER_CANCELLED"
    IDEMPOTENCY_MISMATCH = "IDEMPOTENCY_MISMATCH"
    IDEMPOTENCY_IN_PROGRESS = "IDEMPOTENCY_IN_PROGRESS"
    RETRY_BUDGET_EXHAUSTED = "RETRY_BUDGET_EXHAUSTED"
    RECONCILE_REQUIRED = "RECONCILE_REQUIRED"
    JOURNAL_UNAVAILABLE = "JOURNAL_UNAVAILABLE"
    RESULT_STORE_FAILED = "RESULT_STORE_FAILED"
    RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
    RESULT_UNAVAILABLE = "RESULT_UNAVAILABLE"
    LEASE_LOST = "LEASE_LOST"
    BROKER_RESTARTED = "BROKER_RESTARTED"


class Certainty(StrEnum):
    """Why an outcome is what it is."""

    TRANSPORT_OBSERVED = "transport_observed"
    REMOTE_RESPONSE = "remote_response"
    REMOTE_QUERY = "remote_query"
    OPERATOR_ATTESTED = "operator_attested"


class CallerDisposition(StrEnum):
    """What the caller's wait did. Recorded once; reconciliation never rewrites it."""

    WAITING = "waiting"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"
    TIMED_OUT = "timed_out"


class Dispatch(StrEnum):
    """How far the request got towards the remote."""

    NOT_STARTED = "not_started"
    STARTED_LOCALLY = "started_locally"
    BYTES_HANDED_TO_TRANSPORT = "bytes_handed_to_transport"
    REMOTE_ACKNOWLEDGED = "remote_acknowledged"


class EventKind(StrEnum):
    ACTION_ACCEPTED = "ACTION_ACCEPTED"
    PREFLIGHT_VALIDATED = "PREFLIGHT_VALIDATED"
    APPROVAL_REQUESTED = "APPROVAL_REQUESTED"
    APPROVAL_GRANTED = "APPROVAL_GRANTED"
    APPROVAL_DENIED = "APPROVAL_DENIED"
    CREDENTIAL_AUTHORIZED = "CREDENTIAL_AUTHORIZED"
    CONNECTION_ATTEMPT = "CONNECTION_ATTEMPT"
    DISPATCH_STARTED = "DISPATCH_STARTED"
    REQUEST_SENT = "REQUEST_SENT"
    REMOTE_RESPONSE_STARTED = "REMOTE_RESPONSE_STARTED"
    REMOTE_RESPONSE_COMPLETE = "REMOTE_RESPONSE_COMPLETE"
    RESULT_COMMITTED = "RESULT_COMMITTED"
    RESULT_DELIVERED = "RESULT_DELIVERED"
    CALLER_CANCELLED = "CALLER_CANCELLED"
    CALLER_ANSWERED = "CALLER_ANSWERED"
    RECONCILED = "RECONCILED"
    FAILED = "FAILED"


class NextAction(StrEnum):
    """The result of :func:`decide`: what an agent SDK should do next."""

    FETCH_RESULT = "fetch_result"
    RETRY_NEW_ATTEMPT = "retry_new_attempt"
    STOP_FOR_CORRECTION = "stop_for_correction"
    RETRY_SAME_KEY = "retry_same_key"
    RECONCILE = "reconcile"
    RETRY_WHEN_ALLOWED = "retry_when_allowed"
    RETURN_RECORDED_RESULT = "return_recorded_result"
    # Not in the seed's function: the record is still in flight, ask again later.
    WAIT = "wait"


class Stage(StrEnum):
    """The lifecycle position of one invocation; the keys of :data:`TRANSITIONS`."""

    NEW = "new"
    ACCEPTED = "accepted"
    VALIDATED = "validated"
    HELD = "held"
    APPROVED = "approved"
    AUTHORIZED = "authorized"
    DISPATCHED = "dispatched"
    SENT = "sent"
    RESPONDING = "responding"
    RESPONSE_COMPLETE = "response_complete"
    COMMITTED = "committed"
    DELIVERED = "delivered"
    DELIVERY_FAILED = "delivery_failed"
    STORE_FAILED = "store_failed"
    ENDED_NOT_ATTEMPTED = "ended_not_attempted"
    ENDED_UNKNOWN = "ended_unknown"


S = Stage
_PRE_DISPATCH = frozenset({S.ACCEPTED, S.VALIDATED, S.HELD, S.APPROVED, S.AUTHORIZED})
_IN_EXCHANGE = frozenset({S.DISPATCHED, S.SENT, S.RESPONDING})
ENDED = frozenset(
    {S.DELIVERED, S.DELIVERY_FAILED, S.STORE_FAILED, S.ENDED_NOT_ATTEMPTED, S.ENDED_UNKNOWN}
)

#: Every legal move: event kind -> (stages it may follow, stage it leads to; None = unchanged).
#: ``FAILED`` is keyed by its phase because where a failure may happen depends on it.
#: A re-send after an unknown outcome starts again at PREFLIGHT_VALIDATED (a new attempt);
#: reconciliation adds a fact to an ended record and moves no stage.
TRANSITIONS: dict[EventKind | tuple[EventKind, Phase], tuple[frozenset[Stage], Stage | None]] = {
    EventKind.ACTION_ACCEPTED: (frozenset({S.NEW}), S.ACCEPTED),
    # A new attempt of an ended invocation (a keyed retry) starts again at preflight.
    EventKind.PREFLIGHT_VALIDATED: (frozenset({S.ACCEPTED, S.ENDED_UNKNOWN, S.ENDED_NOT_ATTEMPTED}), S.VALIDATED),
    EventKind.APPROVAL_REQUESTED: (frozenset({S.VALIDATED}), S.HELD),
    EventKind.APPROVAL_GRANTED: (frozenset({S.HELD}), S.APPROVED),
    # An operator's refusal ends the record: nothing was sent, no secret was touched.
    EventKind.APPROVAL_DENIED: (frozenset({S.HELD}), S.ENDED_NOT_ATTEMPTED),
    EventKind.CREDENTIAL_AUTHORIZED: (frozenset({S.VALIDATED, S.APPROVED}), S.AUTHORIZED),
    EventKind.CONNECTION_ATTEMPT: (frozenset({S.AUTHORIZED}), None),
    EventKind.DISPATCH_STARTED: (frozenset({S.AUTHORIZED}), S.DISPATCHED),
    EventKind.REQUEST_SENT: (frozenset({S.DISPATCHED}), S.SENT),
    EventKind.REMOTE_RESPONSE_STARTED: (frozenset({S.DISPATCHED, S.SENT}), S.RESPONDING),
    EventKind.REMOTE_RESPONSE_COMPLETE: (frozenset(_IN_EXCHANGE), S.RESPONSE_COMPLETE),
    EventKind.RESULT_COMMITTED: (frozenset({S.RESPONSE_COMPLETE}), S.COMMITTED),
    # A result fetched later through the side API is a delivery too (the caller has it now).
    EventKind.RESULT_DELIVERED: (frozenset({S.COMMITTED, S.DELIVERY_FAILED}), S.DELIVERED),
    # The caller's wait ended; the exchange may go on and still produce a fetchable result.
    # The broker then ends the record with FAILED (before dispatch, or delivery of a result).
    EventKind.CALLER_CANCELLED: (
        frozenset(_PRE_DISPATCH | _IN_EXCHANGE | {S.RESPONSE_COMPLETE, S.COMMITTED}),
        None,
    ),
    # The waiting caller was handed the answer to a record somebody else ended (an operator's
    # denial): its wait completed. Broker refusals say so on their own FAILED (``answered``).
    EventKind.CALLER_ANSWERED: (frozenset({S.ENDED_NOT_ATTEMPTED, S.ENDED_UNKNOWN}), None),
    EventKind.RECONCILED: (
        frozenset({S.ENDED_UNKNOWN, S.COMMITTED, S.DELIVERED, S.DELIVERY_FAILED, S.STORE_FAILED}),
        None,
    ),
    # Validation also happens at the dispatch write (journal unavailable, stale approval): the
    # credential may be prepared in memory by then, but nothing has left the broker.
    (EventKind.FAILED, Phase.VALIDATION): (frozenset(_PRE_DISPATCH), S.ENDED_NOT_ATTEMPTED),
    (EventKind.FAILED, Phase.CREDENTIAL_INJECTION): (
        frozenset({S.VALIDATED, S.HELD, S.APPROVED, S.AUTHORIZED}),
        S.ENDED_NOT_ATTEMPTED,
    ),
    (EventKind.FAILED, Phase.CONNECTION_SETUP): (frozenset({S.AUTHORIZED}), S.ENDED_NOT_ATTEMPTED),
    (EventKind.FAILED, Phase.REMOTE_EXECUTION): (frozenset(_IN_EXCHANGE), S.ENDED_UNKNOWN),
    (EventKind.FAILED, Phase.RESULT_DELIVERY): (
        frozenset({S.RESPONSE_COMPLETE, S.COMMITTED}),
        None,  # resolved in _advance: store failure vs delivery failure
    ),
}

#: Phase reached by each event kind when it succeeds (FAILED carries its own).
_PHASE_OF: dict[EventKind, Phase] = {
    EventKind.ACTION_ACCEPTED: Phase.VALIDATION,
    EventKind.PREFLIGHT_VALIDATED: Phase.VALIDATION,
    EventKind.APPROVAL_REQUESTED: Phase.VALIDATION,
    EventKind.APPROVAL_GRANTED: Phase.VALIDATION,
    EventKind.APPROVAL_DENIED: Phase.CREDENTIAL_INJECTION,
    EventKind.CREDENTIAL_AUTHORIZED: Phase.CREDENTIAL_INJECTION,
    EventKind.CONNECTION_ATTEMPT: Phase.CONNECTION_SETUP,
    EventKind.DISPATCH_STARTED: Phase.REMOTE_EXECUTION,
    EventKind.REQUEST_SENT: Phase.REMOTE_EXECUTION,
    EventKind.REMOTE_RESPONSE_STARTED: Phase.REMOTE_EXECUTION,
    EventKind.REMOTE_RESPONSE_COMPLETE: Phase.REMOTE_EXECUTION,
    EventKind.RESULT_COMMITTED: Phase.RESULT_DELIVERY,
    EventKind.RESULT_DELIVERED: Phase.RESULT_DELIVERY,
}

#: Codes for failures before dispatch after which trying again later is safe and may succeed.
TRANSIENT_CODES = frozenset(
    {
        Code.DNS_FAILED,
        Code.CONNECT_REFUSED,
        Code.CONNECT_TIMEOUT,
        Code.CONNECT_FAILED,
        Code.TLS_HANDSHAKE_FAILED,
        Code.JOURNAL_UNAVAILABLE,
        Code.CALLER_CANCELLED,
        Code.REQUEST_TIMEOUT,
        Code.APPROVAL_REQUIRED,
        Code.IDEMPOTENCY_IN_PROGRESS,
        Code.LEASE_LOST,
        Code.BROKER_RESTARTED,
    }
)

#: RFC 9110 idempotent methods: the default a route may override.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
#: Complete refusals that may be retried after a delay, if the operation is safe to repeat.
_REFUSAL_STATUSES = frozenset({429, 503})


class IllegalTransition(ValueError):
    """An event that cannot follow the record's current stage (the log would lie)."""


class UnreadableRecord(Exception):
    """A stored record holds a value this version does not know: an event kind, a code, a phase...
    A newer broker wrote it (a format change comes with a schema revision, so a broker that knows
    it is older than the journal; docs/operations.md, Upgrading), or the record is damaged."""

    def __init__(self, what: str):
        super().__init__(f"the record holds {what}, which this version of the broker does not know (a newer "
                         "broker wrote it, or the record is damaged)")



@dataclass(frozen=True, slots=True)
class Event:
    """One appended fact. ``data`` holds kind-specific, non-secret fields."""

    kind: EventKind
    data: Mapping[str, Any] = field(default_factory=dict)
    seq: int | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


@dataclass(frozen=True, slots=True)
class Operation:
    """What the route declares about the operation, for retry hints and :func:`decide`."""

    idempotent: bool
    remote_contract: bool = False
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at crossing the dispatch boundary (connection setup, then maybe dispatch)."""

    number: int
    connection: str | None = None  # "new" | "reused"
    stage: str | None = None  # last stage the attempt reached: dns, tcp, tls, dispatched
    code: Code | None = None
    dispatch_seq: int | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """The projection of an invocation's events: what the broker can prove, and nothing more."""

    stage: Stage = Stage.NEW
    phase: Phase = Phase.VALIDATION
    code: Code | None = None
    caller_disposition: CallerDisposition = CallerDisposition.WAITING
    dispatch: Dispatch = Dispatch.NOT_STARTED
    dispatch_seq: int | None = None
    dispatch_count: int = 0
    #: Attempts started (each begins at PREFLIGHT_VALIDATED), dispatched or not.
    attempt_count: int = 0
    request_complete: bool = False
    response_headers_received: bool = False
    response_complete: bool = False
    status: int | None = None
    retry_after: float | None = None
    result_stored: bool = False
    result_delivered: bool = False
    reconciled_outcome: Outcome | None = None
    #: The operator's grant for the current attempt (APPROVAL_GRANTED data); one attempt only.
    approval: Mapping[str, Any] | None = None
    certainty: Certainty | None = None
    #: A finding rests on the remote's answer to a lookup (certainty remote_query), now or before
    #: a later finding: changing the outcome after it needs override (see contradicted_answer).
    looked_up: bool = False
    attempts: tuple[Attempt, ...] = ()
    last_seq: int | None = None

    @property
    def outcome(self) -> Outcome:
        """Derived from evidence only: reconciliation, then a complete result, then dispatch."""
        if self.reconciled_outcome is not None:
            return self.reconciled_outcome
        if self.response_complete and self.status is not None:
            return classify_status(self.status)
        if self.dispatch_count > 0:
            return Outcome.UNKNOWN
        return Outcome.NOT_ATTEMPTED

    @property
    def ended(self) -> bool:
        return self.stage in ENDED

    @property
    def dispatch_started(self) -> bool:
        return self.dispatch_count > 0

    @property
    def result_fetchable(self) -> bool:
        return self.result_stored


def classify_status(status: int) -> Outcome:
    """A complete final response: any status proves the remote answered.

    4xx and 503 are authentic refusals that claim no success; everything else, 500 included, is
    ``committed`` (the remote application ran at least far enough to answer).
    """
    if status < 200:
        raise IllegalTransition(f"status {status} is informational and decides nothing")
    if 400 <= status < 500 or status == 503:
        return Outcome.REJECTED
    return Outcome.COMMITTED


def _transition_key(event: Event) -> EventKind | tuple[EventKind, Phase]:
    if event.kind is EventKind.FAILED:
        return (EventKind.FAILED, Phase(event.data["phase"]))
    return event.kind


def check(record: Record, event: Event) -> None:
    """Raise :class:`IllegalTransition` unless ``event`` may follow ``record``."""
    _checked_target(record, event)


def _checked_target(record: Record, event: Event) -> Stage | None:
    """The stage ``event`` moves ``record`` to (None: it stays), if the move is legal."""
    key = _transition_key(event)
    allowed, target = TRANSITIONS[key]
    if record.stage not in allowed:
        name = key if isinstance(key, EventKind) else f"{key[0]}({key[1]})"
        raise IllegalTransition(f"{name} cannot follow stage {record.stage}")
    if event.kind is EventKind.RECONCILED:
        outcome = Outcome(event.data["outcome"])
        if outcome in (Outcome.NOT_ATTEMPTED, Outcome.UNKNOWN):
            raise IllegalTransition(f"reconciliation cannot claim {outcome}")
    if event.kind is EventKind.REMOTE_RESPONSE_COMPLETE:
        classify_status(int(event.data["status"]))
    return target


def apply(record: Record, event: Event) -> Record:
    """Fold one event into the record, after checking that the move is legal."""
    target = _checked_target(record, event)
    changes: dict[str, Any] = {"last_seq": event.seq if event.seq is not None else record.last_seq}
    kind = event.kind

    if kind is EventKind.FAILED:
        phase = Phase(event.data["phase"])
        code = Code(event.data["code"])
        changes.update(phase=phase, code=code)
        if phase is Phase.RESULT_DELIVERY:
            target = S.DELIVERY_FAILED if record.stage is S.COMMITTED else S.STORE_FAILED
        if phase is Phase.CONNECTION_SETUP:
            changes["attempts"] = _update_attempt(
                record.attempts, event, stage=event.get("stage"), code=code
            )
        if event.get("answered"):
            changes.update(_dispose(record, CallerDisposition.COMPLETED))
    elif kind is EventKind.CALLER_CANCELLED:
        disposition = CallerDisposition(event.data.get("disposition", CallerDisposition.CANCELLED))
        changes.update(_dispose(record, disposition))
        if record.stage not in _PRE_DISPATCH:
            changes["code"] = Code.CALLER_CANCELLED
    elif kind is EventKind.APPROVAL_DENIED:
        changes.update(phase=Phase.CREDENTIAL_INJECTION, code=Code.APPROVAL_DENIED)
    elif kind is EventKind.CALLER_ANSWERED:
        changes.update(_dispose(record, CallerDisposition.COMPLETED))
    elif kind is EventKind.RECONCILED:
        changes.update(
            reconciled_outcome=Outcome(event.data["outcome"]),
            certainty=Certainty(event.data["certainty"]),
            looked_up=record.looked_up or event.data["certainty"] == Certainty.REMOTE_QUERY.value,
        )
    else:
        changes["phase"] = _PHASE_OF[kind]
        if kind is EventKind.PREFLIGHT_VALIDATED:
            changes["attempt_count"] = record.attempt_count + 1
            changes["approval"] = None  # an approval covers one attempt, never the next
            if record.stage in ENDED:  # a new attempt begins, with a caller of its own
                changes["code"] = None  # the old code and the old caller's end stay in their events
                changes["caller_disposition"] = CallerDisposition.WAITING
        elif kind is EventKind.APPROVAL_GRANTED:
            changes["approval"] = dict(event.data)
        elif kind is EventKind.CONNECTION_ATTEMPT:
            changes["attempts"] = _update_attempt(
                record.attempts, event, stage=event.get("stage"), code=_code_or_none(event)
            )
        elif kind is EventKind.DISPATCH_STARTED:
            changes.update(
                dispatch=Dispatch.STARTED_LOCALLY,
                dispatch_seq=event.seq,
                dispatch_count=record.dispatch_count + 1,
                request_complete=False,
                response_headers_received=False,
                response_complete=False,
                status=None,
                certainty=Certainty.TRANSPORT_OBSERVED,
                attempts=_update_attempt(
                    record.attempts,
                    event,
                    stage="dispatched",
                    connection=event.get("connection"),
                    dispatch_seq=event.seq,
                ),
            )
        elif kind is EventKind.REQUEST_SENT:
            changes.update(dispatch=Dispatch.BYTES_HANDED_TO_TRANSPORT, request_complete=True)
        elif kind is EventKind.REMOTE_RESPONSE_STARTED:
            changes.update(
                dispatch=Dispatch.REMOTE_ACKNOWLEDGED,
                response_headers_received=True,
                status=event.get("status"),
            )
        elif kind is EventKind.REMOTE_RESPONSE_COMPLETE:
            changes.update(
                dispatch=Dispatch.REMOTE_ACKNOWLEDGED,
                response_headers_received=True,
                response_complete=True,
                # A complete answer usually means the request was taken whole; an upstream that
                # answered early (and stopped reading) says otherwise, recorded as false.
                request_complete=event.get("request_complete", True),
                status=int(event.data["status"]),
                retry_after=event.get("retry_after"),
                certainty=Certainty.REMOTE_RESPONSE,
            )
        elif kind is EventKind.RESULT_COMMITTED:
            changes["result_stored"] = True
        elif kind is EventKind.RESULT_DELIVERED:
            changes["result_delivered"] = True
            if record.stage is S.COMMITTED:
                changes.update(_dispose(record, CallerDisposition.COMPLETED))
                changes["code"] = None
    if target is S.ENDED_NOT_ATTEMPTED and record.dispatch_count > 0:
        # A later attempt failed before its own dispatch; an earlier one crossed the boundary.
        target = S.ENDED_UNKNOWN
    if target is not None:
        changes["stage"] = target
    return _replaced(record, changes)


_RECORD_FIELDS = tuple(f.name for f in fields(Record))
_RECORD_FIELD_SET = frozenset(_RECORD_FIELDS)
# What _replaced relies on: every field is a plain init field, and __init__ does nothing else.
assert all(f.init for f in fields(Record)) and not hasattr(Record, "__post_init__")
_new_record = object.__new__
_set = object.__setattr__


def _replaced(record: Record, changes: dict[str, Any]) -> Record:
    """``dataclasses.replace(record, **changes)`` for the one frozen class folded on every event
    of every request, at about two thirds of its cost (no per-field checks, no ``__init__``
    call). Every field is set, so the copy is whole."""
    assert changes.keys() <= _RECORD_FIELD_SET, f"not fields of Record: {changes.keys() - _RECORD_FIELD_SET}"
    new = _new_record(Record)
    for name in _RECORD_FIELDS:
        _set(new, name, changes[name] if name in changes else getattr(record, name))
    return new


def _dispose(record: Record, disposition: CallerDisposition) -> dict[str, Any]:
    """The first end of the caller's wait is the one recorded; later facts never rewrite it."""
    if record.caller_disposition is CallerDisposition.WAITING:
        return {"caller_disposition": disposition}
    return {}


def _code_or_none(event: Event) -> Code | None:
    code = event.get("code")
    return Code(code) if code else None


def _update_attempt(attempts: tuple[Attempt, ...], event: Event, **fields: Any) -> tuple[Attempt, ...]:
    number = int(event.get("attempt", 1))
    fields = {k: v for k, v in fields.items() if v is not None}
    for i, attempt in enumerate(attempts):
        if attempt.number == number:
            return attempts[:i] + (replace(attempt, **fields),) + attempts[i + 1 :]
    return attempts + (Attempt(number=number, **fields),)


def contradicted_answer(record: Record, finding: Outcome) -> Outcome | None:
    """The outcome a reconciliation finding ``finding`` would overturn on a record that holds the
    remote's complete answer (None: no complete answer, or nothing is overturned).

    That answer is the strongest evidence there is, so changing the outcome it gave, or the one a
    deliberate earlier finding put over it, must say so (``override``). ``partial_effect`` after
    ``committed`` refines it (the remote ran, and did part) and overturns nothing. A policy for new
    decisions, not a transition rule: history recorded before it still projects.

    The remote's answer to a lookup (a finding of certainty ``remote_query``) is held the same
    way, on a record without a complete answer of its own: once one is there, a later finding
    that changes the outcome (another lookup's included, and one after a restating finding) says
    so too."""
    if (not record.response_complete or record.status is None) and not record.looked_up:
        return None
    current = record.outcome
    if finding is current or (current is Outcome.COMMITTED and finding is Outcome.PARTIAL_EFFECT):
        return None
    return current


def project(events: Iterable[Event]) -> Record:
    """Fold a whole event log (in sequence order) into a record. A stored value this version does
    not know is :class:`UnreadableRecord`."""
    record = Record()
    for event in events:
        try:
            record = apply(record, event)
        except IllegalTransition:
            raise
        except (ValueError, KeyError) as exc:  # an enum's value or a field this version does not know
            raise UnreadableRecord(f"event {event.seq} ({event.kind.value}) with {exc}") from exc
    return record


def retry_hint(
    record: Record, operation: Operation, *, retention_open: bool = True, budget_left: bool = True
) -> Retry | None:
    """What automation may do now. ``None`` while the record is still in flight.

    ``retention_open`` is whether a same-key re-send could still go out: the remote idempotency
    contract's retention window is still open (the caller computes it from the stored expiry and
    the clock) and, where the caller knows it, the retry budget is not used up. ``budget_left``
    is whether a repeat with the same key may still be attempted at all (false once a keyed
    invocation used its retry budget): an idempotent operation is then reconciled too, since its
    repeat would only be refused (RETRY_BUDGET_EXHAUSTED).
    """
    if record.stage is S.DELIVERY_FAILED:
        return Retry.FETCH_RESULT
    if not record.ended:
        return None
    outcome = record.outcome
    if outcome is Outcome.NOT_ATTEMPTED:
        # Nothing was sent. A transient cause may be waited out, but not past the retry budget:
        # a repeat with the key would only be refused (RETRY_BUDGET_EXHAUSTED), so from then on
        # a new attempt is a new operation, with a new key, which is someone's decision.
        if record.code in TRANSIENT_CODES and budget_left:
            return Retry.BACKOFF
        return Retry.AFTER_CORRECTION
    if outcome is Outcome.UNKNOWN:
        if operation.idempotent:
            return Retry.BACKOFF if budget_left else Retry.RECONCILE
        if operation.remote_contract and retention_open:
            return Retry.SAME_IDEMPOTENCY_KEY
        return Retry.RECONCILE
    if outcome is Outcome.REJECTED:
        if record.reconciled_outcome is not None:
            return Retry.NEVER
        if record.status in (401, 403):
            return Retry.AFTER_CORRECTION
        if record.status in _REFUSAL_STATUSES:
            if operation.idempotent and record.retry_after is not None and record.retry_after <= USABLE_RETRY_AFTER:
                return Retry.BACKOFF
            return Retry.NEVER
        return Retry.AFTER_CORRECTION
    # committed or partial_effect: the effect happened; the record is the answer, never a re-send.
    return Retry.NEVER


def decide(
    record: Record,
    retry: Retry | None,
    operation: Operation,
    recorded_fingerprint: str | None,
) -> NextAction:
    """The seed's decision function, over a projected record and its retry hint."""
    if retry is None:
        return NextAction.WAIT
    if retry is Retry.FETCH_RESULT:
        return NextAction.FETCH_RESULT
    outcome = record.outcome
    if outcome is Outcome.NOT_ATTEMPTED:
        if retry is Retry.BACKOFF:
            return NextAction.RETRY_NEW_ATTEMPT
        return NextAction.STOP_FOR_CORRECTION
    if outcome is Outcome.UNKNOWN:
        if operation.idempotent and retry is not Retry.RECONCILE:  # reconcile: its retry budget is used up
            return NextAction.RETRY_NEW_ATTEMPT
        if (
            retry is Retry.SAME_IDEMPOTENCY_KEY
            and operation.fingerprint is not None
            and operation.fingerprint == recorded_fingerprint
        ):
            return NextAction.RETRY_SAME_KEY
        return NextAction.RECONCILE
    if outcome is Outcome.REJECTED and retry is Retry.BACKOFF:
        return NextAction.RETRY_WHEN_ALLOWED
    return NextAction.RETURN_RECORDED_RESULT


def is_idempotent(method: str, declared: bool | None) -> bool:
    """A method name is evidence, not a guarantee: a route's declaration wins."""
    if declared is not None:
        return declared
    return method.upper() in IDEMPOTENT_METHODS


#: The longest ``Retry-After`` (seconds) that is a usable delay (contract section 5): beyond a day, a
#: refusal is not "try again later" but "not now": the hint is never, and a later attempt is a new
#: operation the caller decides on.
USABLE_RETRY_AFTER = 86_400.0


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds from ``now`` (default: the clock): delta-seconds or an
    HTTP date (GMT); None when absent or unreadable. Shared by the broker and proxy.client."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit() is also true of '²', which float() refuses
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)
