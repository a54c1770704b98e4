"""The public error envelope (contract section 10) and the HTTP status each code gets.

``code``, ``phase``, ``outcome`` and ``retry`` are closed enums; ``message`` is for humans and
says what happened, what the broker knows and what to do next. Library exception text never
appears here (it stays in the record's internal diagnostic field).
"""

from __future__ import annotations

import json
from typing import Any

from .contract import Code, Outcome, Phase, Retry

MEDIA_TYPE = "application/problem+json"

#: HTTP status for each broker-originated failure (docs/contract.md has the full table).
STATUS: dict[Code, int] = {
    Code.PROXY_AUTH_REQUIRED: 407,
    Code.INVALID_TARGET: 403,
    Code.FORBIDDEN_HEADER_OVERRIDE: 403,
    Code.UNSUPPORTED_ACTION: 405,
    Code.PAYLOAD_LIMIT: 413,
    Code.MALFORMED_REQUEST: 400,
    Code.REQUEST_TIMEOUT: 408,
    Code.APPROVAL_REQUIRED: 409,
    Code.APPROVAL_DENIED: 403,
    Code.APPROVAL_STALE: 409,
    Code.CREDENTIAL_MISSING: 502,
    Code.VAULT_LOCKED: 503,
    Code.CREDENTIAL_DECRYPT_FAILED: 502,
    Code.DNS_FAILED: 502,
    Code.CONNECT_REFUSED: 502,
    Code.CONNECT_FAILED: 502,
    Code.CONNECT_TIMEOUT: 504,
    Code.TLS_HANDSHAKE_FAILED: 502,
    Code.TLS_CERT_INVALID: 502,
    Code.TLS_CERT_UNTRUSTED: 502,
    Code.TLS_CERT_EXPIRED: 502,
    Code.TLS_HOSTNAME_MISMATCH: 502,
    Code.REMOTE_OUTCOME_UNKNOWN: 502,
    Code.REMOTE_RESULT_INCOMPLETE: 502,
    Code.RESULT_TOO_LARGE: 502,
    Code.CALLER_CANCELLED: 499,
    Code.IDEMPOTENCY_MISMATCH: 422,
    Code.IDEMPOTENCY_IN_PROGRESS: 409,
    Code.RETRY_BUDGET_EXHAUSTED: 429,
    Code.RECONCILE_REQUIRED: 409,
    Code.JOURNAL_UNAVAILABLE: 503,
    Code.RESULT_STORE_FAILED: 502,
    Code.RESULT_UNAVAILABLE: 409,
    Code.LEASE_LOST: 409,
    Code.BROKER_RESTARTED: 503,
}


def status_for(code: Code, *, timed_out: bool = False) -> int:
    if timed_out:
        return 504
    return STATUS.get(code, 502)


def envelope(
    invocation_id: str | None,
    code: Code,
    phase: Phase,
    outcome: Outcome,
    retry: Retry,
    message: str,
    evidence: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "invocation_id": invocation_id,
        "error": {
            "code": code.value,
            "phase": phase.value,
            "outcome": outcome.value,
            "retry": retry.value,
            "message": message,
        },
        "evidence": evidence or {},
    }


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), sort_keys=False).encode()
