"""What the side API and the CLI show for one invocation: the projection of its events.

Pure: rows and decoded events in, a JSON-ready dict out. The record is re-projected from the
events (the truth) rather than read from the ``invocations`` row (a cache of it), and the retry
hint is computed for *now*, so an idempotency retention that has run out is reflected at once.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .contract import Event, EventKind, NextAction, Operation, Record, Stage, decide, project, retry_hint

#: Event fields shown to operators only: library diagnostics are internal.
_INTERNAL = frozenset({"diagnostic"})
#: Stages of a request waiting for an operator's decision, or for its holder to send it once approved.
_HELD = frozenset({Stage.HELD, Stage.APPROVED})


def iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.isoformat()
    return str(value)


def retention_open(row: dict[str, Any], now: datetime) -> bool:
    expires = row.get("idempotency_expires_at")
    if expires is None:
        return True
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    return now < expires


def may_resend(row: dict[str, Any], now: datetime) -> bool:
    """A repeat with the same key could still be sent: retention open, retry budget not used up."""
    return retention_open(row, now) and row.get("generation", 0) < row.get("retry_budget", 0)


def budget_left(row: dict[str, Any]) -> bool:
    """A repeat with the row's key may still be attempted: it has a key, and its retry budget is not used up."""
    return row.get("idempotency_key") is None or row.get("generation", 0) < row.get("retry_budget", 0)


def operation_of(row: dict[str, Any]) -> Operation:
    return Operation(idempotent=bool(row["idempotent"]), remote_contract=bool(row["remote_contract"]), fingerprint=row["fingerprint"])


def owner_view(owner: str, heartbeat_at: datetime | None, now: datetime, stale_after: float) -> dict[str, Any]:
    """Who holds an in-flight record, and whether it still beats: a record whose holder stopped
    says ``waiting`` until some broker's recovery closes it (docs/operations.md, Replicas).
    ``stale``: its heartbeat is older than ``stale_after`` (null when it has written none: a
    broker still starting, or one under another name)."""
    silent = None if heartbeat_at is None else max((now - heartbeat_at).total_seconds(), 0.0)
    return {
        "broker": owner,
        "last_heartbeat": iso(heartbeat_at),
        "silent_s": None if silent is None else round(silent, 1),
        "stale": None if silent is None else silent > stale_after,
    }


def describe(
    row: dict[str, Any],
    events: list[Event],
    *,
    now: datetime | None = None,
    operator: bool = False,
    event_times: dict[int, Any] | None = None,
    owner: dict[str, Any] | None = None,
    holder_restarted: bool = False,
) -> dict[str, Any]:
    """The record as the side API and the CLI show it. ``owner`` (:func:`owner_view`), who holds a
    record still in flight, shown to operators only. ``holder_restarted``: that holder is an
    earlier incarnation of the broker asking, so it has stopped however fresh its heartbeat."""
    now = now or datetime.now(UTC)
    record: Record = project(events)
    operation = operation_of(row)
    retry = retry_hint(record, operation, retention_open=may_resend(row, now), budget_left=budget_left(row))
    next_action = decide(record, retry, operation, row["fingerprint"])
    holder_gone = holder_restarted or (owner is not None and owner["stale"] is True)
    if next_action is NextAction.WAIT and holder_gone and record.stage in _HELD and row.get("idempotency_key"):
        # Held for (or given) an approval by a broker that has stopped: nothing moves until the
        # agent repeats it with its key, which a running broker takes over (docs/control.md).
        next_action = NextAction.RETRY_SAME_KEY
    complete = next((e for e in reversed(events) if e.kind is EventKind.REMOTE_RESPONSE_COMPLETE), None)
    evidence: dict[str, Any] = {
        "dispatch": record.dispatch.value,
        "dispatch_started": record.dispatch_started,
        "dispatch_seq": record.dispatch_seq,
        "request_complete": record.request_complete,
        "response_headers_received": record.response_headers_received,
        "response_complete": record.response_complete,
        "status": record.status,
        "certainty": record.certainty.value if record.certainty else None,
        "attempts": [
            {
                "n": a.number,
                "connection": a.connection,
                "stage": a.stage,
                "code": a.code.value if a.code else None,
                "dispatch_seq": a.dispatch_seq,
            }
            for a in record.attempts
        ],
    }
    if complete is not None:
        for key in ("framing", "body_sha256", "body_bytes", "peer_certificate", "retry_after", "location", "job_ref", "http_version"):
            if key in complete.data:
                evidence[key] = complete.data[key]
    idempotency = None
    if row.get("idempotency_key") or row.get("remote_contract"):
        idempotency = {
            "key": row.get("idempotency_key"),
            "scope": row.get("idempotency_scope"),
            "expires_at": iso(row.get("idempotency_expires_at")),
            "fingerprint": row["fingerprint"],
            "remote_contract": "configured" if row.get("remote_contract") else "none",
        }
    view = {
        "invocation_id": row["invocation_id"],
        "agent": row["agent"],
        "route": row["route"],
        "method": row["method"],
        "target": row["target"],
        "fingerprint": row["fingerprint"],
        "created_at": iso(row["created_at"]),
        "phase": record.phase.value,
        "outcome": record.outcome.value,
        "retry": retry.value if retry else None,
        "code": record.code.value if record.code else None,
        "caller_disposition": record.caller_disposition.value,
        "stage": record.stage.value,
        "next_action": next_action.value,
        "credential": {
            "id": row.get("credential_id"),
            "version": row.get("credential_version"),
            "injection": row.get("injection"),
        },
        "idempotency": idempotency,
        "retry_budget": {"budget": row.get("retry_budget", 0), "used": row.get("generation", 0)},
        "replays": row.get("replays", 0),
        "evidence": evidence,
        "result_available": record.result_stored,
        "events": [
            {
                "seq": e.seq,
                "kind": e.kind.value,
                "at": iso((event_times or {}).get(e.seq)),
                "data": {k: v for k, v in e.data.items() if operator or k not in _INTERNAL},
            }
            for e in events
        ],
    }
    if owner is not None and operator and not record.ended:
        view["owner"] = owner
    return view
