"""The evidence contract, pure: transitions, projection, retry hints and decide().

No I/O here. Hypothesis drives the projection with random event sequences; the properties are
the contract's rules, so a change that breaks one fails with a minimal counter-example.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.contract import (
    ENDED,
    TRANSITIONS,
    CallerDisposition,
    Code,
    Event,
    EventKind,
    IllegalTransition,
    NextAction,
    Operation,
    Outcome,
    Phase,
    Record,
    Retry,
    Stage,
    apply,
    classify_status,
    contradicted_answer,
    decide,
    is_idempotent,
    project,
    retry_hint,
)

from proxy.decisions import RECONCILABLE

K = EventKind
POST = Operation(idempotent=False, fingerprint="sha256:a")
POST_WITH_CONTRACT = Operation(idempotent=False, remote_contract=True, fingerprint="sha256:a")
GET = Operation(idempotent=True, fingerprint="sha256:a")


def ev(kind: EventKind, **data) -> Event:
    return Event(kind, data)


def failed(phase: Phase, code: Code, **data) -> Event:
    return Event(K.FAILED, {"phase": phase.value, "code": code.value, **data})


PREFIX = [ev(K.ACTION_ACCEPTED), ev(K.PREFLIGHT_VALIDATED), ev(K.CREDENTIAL_AUTHORIZED)]
DISPATCH = [*PREFIX, ev(K.DISPATCH_STARTED, attempt=1, connection="new")]


def fold(events: list[Event]) -> Record:
    record = Record()
    for i, event in enumerate(events, 1):
        record = apply(record, Event(event.kind, event.data, i))
    return record


def complete(status: int, **data) -> list[Event]:
    return [
        *DISPATCH,
        ev(K.REQUEST_SENT),
        ev(K.REMOTE_RESPONSE_STARTED, status=status),
        ev(K.REMOTE_RESPONSE_COMPLETE, status=status, **data),
        ev(K.RESULT_COMMITTED),
    ]


# -- the happy path and the shape of a record ---------------------------------------------


def test_an_answer_that_came_before_the_request_was_taken_whole_leaves_the_request_incomplete():
    early = fold([*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=413, request_complete=False), ev(K.RESULT_COMMITTED)])
    assert early.response_complete and not early.request_complete and early.outcome is Outcome.REJECTED
    assert fold([*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=200), ev(K.RESULT_COMMITTED)]).request_complete



def test_a_delivered_result_is_committed_and_final():
    record = fold([*complete(200), ev(K.RESULT_DELIVERED)])
    assert record.stage is Stage.DELIVERED
    assert record.outcome is Outcome.COMMITTED
    assert record.phase is Phase.RESULT_DELIVERY
    assert record.caller_disposition is CallerDisposition.COMPLETED
    assert record.code is None
    assert record.dispatch_seq == 4
    assert record.request_complete and record.response_headers_received and record.response_complete
    assert retry_hint(record, POST) is Retry.NEVER
    assert decide(record, Retry.NEVER, POST, "sha256:a") is NextAction.RETURN_RECORDED_RESULT


def test_in_flight_record_has_no_retry_hint_and_says_wait():
    record = fold(DISPATCH)
    assert record.outcome is Outcome.UNKNOWN
    assert not record.ended
    assert retry_hint(record, POST) is None
    assert decide(record, None, POST, "sha256:a") is NextAction.WAIT


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, Outcome.COMMITTED), (201, Outcome.COMMITTED), (202, Outcome.COMMITTED), (204, Outcome.COMMITTED),
     (307, Outcome.COMMITTED), (400, Outcome.REJECTED), (401, Outcome.REJECTED), (403, Outcome.REJECTED),
     (404, Outcome.REJECTED), (409, Outcome.REJECTED), (422, Outcome.REJECTED), (429, Outcome.REJECTED),
     (500, Outcome.COMMITTED), (502, Outcome.COMMITTED), (503, Outcome.REJECTED), (504, Outcome.COMMITTED)],
)
def test_a_complete_final_status_decides_the_outcome(status, outcome):
    assert classify_status(status) is outcome
    assert fold(complete(status)).outcome is outcome


@pytest.mark.parametrize("status", [100, 101, 103, 199])
def test_informational_statuses_decide_nothing(status):
    with pytest.raises(IllegalTransition):
        classify_status(status)
    with pytest.raises(IllegalTransition):
        fold([*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=status)])


# -- the dispatch boundary ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "code"),
    [(Phase.CONNECTION_SETUP, Code.DNS_FAILED), (Phase.CONNECTION_SETUP, Code.CONNECT_REFUSED),
     (Phase.CONNECTION_SETUP, Code.TLS_CERT_EXPIRED), (Phase.CONNECTION_SETUP, Code.CONNECT_TIMEOUT)],
)
def test_connection_setup_failures_are_not_attempted(phase, code):
    record = fold([*PREFIX, ev(K.CONNECTION_ATTEMPT, attempt=1, stage="tcp_connect", code=code.value), failed(phase, code, answered=True)])
    assert record.outcome is Outcome.NOT_ATTEMPTED
    assert record.stage is Stage.ENDED_NOT_ATTEMPTED
    assert record.phase is phase
    assert record.attempts[0].code is code


def test_connection_setup_cannot_fail_after_dispatch_of_the_same_attempt():
    with pytest.raises(IllegalTransition):
        fold([*DISPATCH, failed(Phase.CONNECTION_SETUP, Code.CONNECT_REFUSED)])


@pytest.mark.parametrize("phase", [Phase.VALIDATION, Phase.CREDENTIAL_INJECTION, Phase.CONNECTION_SETUP])
def test_no_pre_dispatch_failure_can_follow_dispatch(phase):
    with pytest.raises(IllegalTransition):
        fold([*DISPATCH, failed(phase, Code.JOURNAL_UNAVAILABLE)])


@pytest.mark.parametrize("code", [Code.REMOTE_OUTCOME_UNKNOWN, Code.REMOTE_RESULT_INCOMPLETE])
def test_failure_after_dispatch_is_unknown(code):
    record = fold([*DISPATCH, ev(K.REQUEST_SENT), failed(Phase.REMOTE_EXECUTION, code, answered=True)])
    assert record.outcome is Outcome.UNKNOWN
    assert record.stage is Stage.ENDED_UNKNOWN
    assert record.code is code


def test_a_second_attempt_failing_before_its_dispatch_leaves_the_record_unknown():
    events = [
        *DISPATCH,
        failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN),
        ev(K.PREFLIGHT_VALIDATED, attempt=2),
        ev(K.CREDENTIAL_AUTHORIZED, attempt=2),
        ev(K.CONNECTION_ATTEMPT, attempt=2, stage="tcp_connect", code="CONNECT_REFUSED"),
        failed(Phase.CONNECTION_SETUP, Code.CONNECT_REFUSED, attempt=2),
    ]
    record = fold(events)
    assert record.outcome is Outcome.UNKNOWN
    assert record.stage is Stage.ENDED_UNKNOWN
    assert [a.number for a in record.attempts] == [1, 2]
    assert record.attempts[0].stage == "dispatched" and record.attempts[1].code is Code.CONNECT_REFUSED


def test_a_new_attempt_has_a_caller_of_its_own_whose_wait_is_recorded():
    first = [*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN, answered=True)]
    assert fold(first).caller_disposition is CallerDisposition.COMPLETED
    again = [*first, ev(K.PREFLIGHT_VALIDATED, attempt=2)]
    assert fold(again).caller_disposition is CallerDisposition.WAITING, "the re-send's caller is waiting"
    gave_up = [*again, ev(K.CREDENTIAL_AUTHORIZED, attempt=2), ev(K.DISPATCH_STARTED, attempt=2, connection="new"),
               ev(K.CALLER_CANCELLED, disposition="timed_out")]
    assert fold(gave_up).caller_disposition is CallerDisposition.TIMED_OUT


def test_a_new_attempt_after_a_failure_before_dispatch_can_still_end_not_attempted():
    events = [
        *PREFIX,
        failed(Phase.CONNECTION_SETUP, Code.DNS_FAILED),
        ev(K.PREFLIGHT_VALIDATED, attempt=2),
        ev(K.CREDENTIAL_AUTHORIZED, attempt=2),
        failed(Phase.CONNECTION_SETUP, Code.CONNECT_REFUSED, attempt=2),
    ]
    record = fold(events)
    assert record.outcome is Outcome.NOT_ATTEMPTED and record.stage is Stage.ENDED_NOT_ATTEMPTED
    assert record.code is Code.CONNECT_REFUSED


def test_a_result_cannot_precede_dispatch_and_delivery_cannot_precede_commit():
    with pytest.raises(IllegalTransition):
        fold([*PREFIX, ev(K.REMOTE_RESPONSE_COMPLETE, status=200)])
    with pytest.raises(IllegalTransition):
        fold([*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=200), ev(K.RESULT_DELIVERED)])
    with pytest.raises(IllegalTransition):
        fold([ev(K.ACTION_ACCEPTED), ev(K.ACTION_ACCEPTED)])


# -- callers that leave, late results, delivery ---------------------------------------------


def test_caller_timeout_then_late_result_is_committed_and_fetchable():
    events = [
        *DISPATCH,
        ev(K.REQUEST_SENT),
        ev(K.CALLER_CANCELLED, disposition="timed_out"),
        ev(K.REMOTE_RESPONSE_COMPLETE, status=201),
        ev(K.RESULT_COMMITTED),
        failed(Phase.RESULT_DELIVERY, Code.CALLER_CANCELLED),
    ]
    record = fold(events)
    assert record.outcome is Outcome.COMMITTED
    assert record.caller_disposition is CallerDisposition.TIMED_OUT
    assert record.phase is Phase.RESULT_DELIVERY
    assert retry_hint(record, POST) is Retry.FETCH_RESULT
    assert decide(record, Retry.FETCH_RESULT, POST, "sha256:a") is NextAction.FETCH_RESULT


def test_caller_gone_and_no_result_stays_unknown_with_the_disposition():
    events = [*DISPATCH, ev(K.CALLER_CANCELLED, disposition="disconnected"), failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN)]
    record = fold(events)
    assert record.outcome is Outcome.UNKNOWN
    assert record.caller_disposition is CallerDisposition.DISCONNECTED
    assert retry_hint(record, POST) is Retry.RECONCILE


def test_fetching_after_a_failed_delivery_delivers_but_keeps_the_disposition():
    events = [*complete(200), ev(K.CALLER_CANCELLED, disposition="disconnected"), failed(Phase.RESULT_DELIVERY, Code.CALLER_CANCELLED), ev(K.RESULT_DELIVERED, channel="side_api")]
    record = fold(events)
    assert record.stage is Stage.DELIVERED
    assert record.caller_disposition is CallerDisposition.DISCONNECTED
    assert retry_hint(record, POST) is Retry.NEVER


def test_a_denial_handed_to_its_waiting_caller_completes_the_wait_and_nothing_else():
    held = [ev(K.ACTION_ACCEPTED), ev(K.PREFLIGHT_VALIDATED), ev(K.APPROVAL_REQUESTED), ev(K.APPROVAL_DENIED, by="ops")]
    denied = fold(held)
    assert (denied.stage, denied.caller_disposition) == (Stage.ENDED_NOT_ATTEMPTED, CallerDisposition.WAITING)
    answered = fold([*held, ev(K.CALLER_ANSWERED)])
    assert answered.caller_disposition is CallerDisposition.COMPLETED
    assert (answered.stage, answered.outcome, answered.code, answered.phase) == (
        Stage.ENDED_NOT_ATTEMPTED, Outcome.NOT_ATTEMPTED, Code.APPROVAL_DENIED, Phase.CREDENTIAL_INJECTION)
    # A denied re-attempt of a dispatched invocation ends unknown; its caller was answered as well.
    again = [*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN, answered=True), ev(K.PREFLIGHT_VALIDATED),
             ev(K.APPROVAL_REQUESTED), ev(K.APPROVAL_DENIED, by="ops"), ev(K.CALLER_ANSWERED)]
    assert fold(again).stage is Stage.ENDED_UNKNOWN
    # A caller that had already left keeps its disposition; an open record cannot be "answered".
    left = [*DISPATCH, ev(K.CALLER_CANCELLED, disposition="disconnected"), failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN),
            ev(K.CALLER_ANSWERED)]
    assert fold(left).caller_disposition is CallerDisposition.DISCONNECTED
    for open_record in (PREFIX, DISPATCH, [*held[:3]]):
        with pytest.raises(IllegalTransition):
            fold([*open_record, ev(K.CALLER_ANSWERED)])


def test_result_store_failure_never_suggests_a_resend():
    events = [*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=201), failed(Phase.RESULT_DELIVERY, Code.RESULT_STORE_FAILED, answered=True)]
    record = fold(events)
    assert record.stage is Stage.STORE_FAILED
    assert record.outcome is Outcome.COMMITTED
    assert retry_hint(record, POST) is Retry.NEVER
    assert retry_hint(record, GET) is Retry.NEVER


# -- reconciliation ------------------------------------------------------------------------


def test_reconciliation_adds_a_fact_and_keeps_the_caller_disposition():
    events = [
        *DISPATCH,
        ev(K.CALLER_CANCELLED, disposition="timed_out"),
        failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN),
        ev(K.RECONCILED, outcome="committed", certainty="operator_attested"),
    ]
    record = fold(events)
    assert record.outcome is Outcome.COMMITTED
    assert record.certainty.value == "operator_attested"
    assert record.caller_disposition is CallerDisposition.TIMED_OUT
    assert record.dispatch_started
    assert retry_hint(record, POST) is Retry.NEVER


@pytest.mark.parametrize("outcome", ["not_attempted", "unknown"])
def test_reconciliation_cannot_claim_not_attempted_or_unknown(outcome):
    with pytest.raises(IllegalTransition):
        fold([*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN), ev(K.RECONCILED, outcome=outcome, certainty="operator_attested")])


@pytest.mark.parametrize(("status", "finding"), [(200, "rejected"), (500, "rejected"), (404, "committed"), (404, "partial_effect")])
def test_a_finding_against_the_remotes_complete_answer_is_named_as_such(status, finding):
    record = fold(complete(status))
    assert contradicted_answer(record, Outcome(finding)) is record.outcome is classify_status(status)
    # A finding that agrees with the answer (adding a reference, say) overturns nothing.
    assert contradicted_answer(record, record.outcome) is None
    # Without a complete answer there is nothing to overturn.
    unknown = fold([*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN)])
    assert contradicted_answer(unknown, Outcome(finding)) is None
    # A policy for new decisions: a history that holds such a finding (recorded before the rule,
    # or with override) still projects, and the finding is the outcome.
    recorded = fold([*complete(status), ev(K.RECONCILED, outcome=finding, certainty="operator_attested")])
    assert recorded.outcome is Outcome(finding) and recorded.status == status
    # After it, re-stating that finding overturns nothing; going back to the answer overturns it.
    assert contradicted_answer(recorded, Outcome(finding)) is None
    assert contradicted_answer(recorded, classify_status(status)) is Outcome(finding)


@pytest.mark.parametrize("found", ["committed", "rejected", "partial_effect"])
def test_the_remotes_answer_to_a_lookup_is_overturned_only_on_purpose(found):
    """No complete answer, but the remote answered a lookup: a finding against that is refused
    without override, one that restates it is not, and an operator's own finding binds nothing."""
    unknown = [*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN)]
    looked_up = fold([*unknown, ev(K.RECONCILED, outcome=found, certainty="remote_query")])
    # Restating it (to add a reference) is the operator's finding now; the lookup still stands behind it.
    restated = fold([*unknown, ev(K.RECONCILED, outcome=found, certainty="remote_query"),
                     ev(K.RECONCILED, outcome=found, certainty="operator_attested", reference="ch_1")])
    for record in (looked_up, restated):
        for finding in RECONCILABLE:
            overturned = contradicted_answer(record, finding)
            refines = found == "committed" and finding is Outcome.PARTIAL_EFFECT
            assert overturned is (None if finding.value == found or refines else Outcome(found)), finding
    attested = fold([*unknown, ev(K.RECONCILED, outcome=found, certainty="operator_attested")])
    assert all(contradicted_answer(attested, finding) is None for finding in RECONCILABLE)


@pytest.mark.parametrize("status", [200, 500])
def test_partial_effect_refines_a_committed_answer_without_override(status):
    assert contradicted_answer(fold(complete(status)), Outcome.PARTIAL_EFFECT) is None


def test_reconciliation_is_only_for_dispatched_records():
    with pytest.raises(IllegalTransition):
        fold([*PREFIX, failed(Phase.CONNECTION_SETUP, Code.DNS_FAILED), ev(K.RECONCILED, outcome="committed", certainty="operator_attested")])


# -- retry hints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "retry"),
    [(Code.INVALID_TARGET, Retry.AFTER_CORRECTION), (Code.PAYLOAD_LIMIT, Retry.AFTER_CORRECTION),
     (Code.FORBIDDEN_HEADER_OVERRIDE, Retry.AFTER_CORRECTION), (Code.UNSUPPORTED_ACTION, Retry.AFTER_CORRECTION),
     (Code.JOURNAL_UNAVAILABLE, Retry.BACKOFF)],
)
def test_validation_refusals(code, retry):
    record = fold([ev(K.ACTION_ACCEPTED), failed(Phase.VALIDATION, code, answered=True)])
    assert record.outcome is Outcome.NOT_ATTEMPTED
    assert record.caller_disposition is CallerDisposition.COMPLETED
    assert retry_hint(record, POST) is retry


@pytest.mark.parametrize(
    ("code", "retry"),
    [(Code.DNS_FAILED, Retry.BACKOFF), (Code.CONNECT_REFUSED, Retry.BACKOFF), (Code.CONNECT_TIMEOUT, Retry.BACKOFF),
     (Code.TLS_CERT_EXPIRED, Retry.AFTER_CORRECTION), (Code.TLS_CERT_UNTRUSTED, Retry.AFTER_CORRECTION),
     (Code.TLS_HOSTNAME_MISMATCH, Retry.AFTER_CORRECTION)],
)
def test_connection_setup_hints(code, retry):
    record = fold([*PREFIX, failed(Phase.CONNECTION_SETUP, code)])
    assert retry_hint(record, POST) is retry
    expected = NextAction.RETRY_NEW_ATTEMPT if retry is Retry.BACKOFF else NextAction.STOP_FOR_CORRECTION
    assert decide(record, retry, POST, "sha256:a") is expected


def test_unknown_hints_depend_on_declared_semantics_and_retention():
    record = fold([*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN)])
    assert retry_hint(record, GET) is Retry.BACKOFF
    assert retry_hint(record, POST) is Retry.RECONCILE
    assert retry_hint(record, POST_WITH_CONTRACT) is Retry.SAME_IDEMPOTENCY_KEY
    assert retry_hint(record, POST_WITH_CONTRACT, retention_open=False) is Retry.RECONCILE
    assert decide(record, Retry.BACKOFF, GET, "sha256:a") is NextAction.RETRY_NEW_ATTEMPT
    assert decide(record, Retry.RECONCILE, POST, "sha256:a") is NextAction.RECONCILE
    assert decide(record, Retry.SAME_IDEMPOTENCY_KEY, POST_WITH_CONTRACT, "sha256:a") is NextAction.RETRY_SAME_KEY
    changed = Operation(idempotent=False, remote_contract=True, fingerprint="sha256:b")
    assert decide(record, Retry.SAME_IDEMPOTENCY_KEY, changed, "sha256:a") is NextAction.RECONCILE


def test_an_unknown_end_whose_retry_budget_is_used_up_is_reconciled_whatever_the_method():
    """A repeat with the key would only be refused (RETRY_BUDGET_EXHAUSTED): even an idempotent
    operation is not sent back into it."""
    record = fold([*DISPATCH, failed(Phase.REMOTE_EXECUTION, Code.REMOTE_OUTCOME_UNKNOWN)])
    for operation in (GET, POST, POST_WITH_CONTRACT):
        assert retry_hint(record, operation, retention_open=False, budget_left=False) is Retry.RECONCILE
        assert decide(record, Retry.RECONCILE, operation, "sha256:a") is NextAction.RECONCILE
    assert retry_hint(record, GET, retention_open=False) is Retry.BACKOFF, "retention alone binds no idempotent repeat"
    done = fold([*complete(200), ev(K.RESULT_DELIVERED)])
    assert retry_hint(done, GET, budget_left=False) is Retry.NEVER, "a recorded result is the answer still"


def test_a_not_attempted_end_whose_retry_budget_is_used_up_stops_for_correction():
    """Nothing was sent, but a repeat with the key would only get the 429: no backoff into it."""
    record = fold([*PREFIX, failed(Phase.CONNECTION_SETUP, Code.CONNECT_REFUSED, stage="tcp_connect")])
    assert retry_hint(record, POST_WITH_CONTRACT) is Retry.BACKOFF
    for operation in (GET, POST, POST_WITH_CONTRACT):
        assert retry_hint(record, operation, budget_left=False) is Retry.AFTER_CORRECTION
    assert decide(record, Retry.AFTER_CORRECTION, POST, "sha256:a") is NextAction.STOP_FOR_CORRECTION


def test_a_retry_after_beyond_a_day_is_no_usable_delay():
    """Contract section 5: backoff only with a usable delay. ``Retry-After: 0`` is one (now);
    31 years is not: the refusal is the answer."""
    for seconds, retry in ((0.0, Retry.BACKOFF), (86_400.0, Retry.BACKOFF), (86_401.0, Retry.NEVER), (999_999_999.0, Retry.NEVER)):
        record = fold([*complete(503, retry_after=seconds), ev(K.RESULT_DELIVERED)])
        assert retry_hint(record, GET) is retry, seconds
        assert retry_hint(record, POST) is Retry.NEVER


@pytest.mark.parametrize(
    ("status", "retry_after", "operation", "retry"),
    [(401, None, GET, Retry.AFTER_CORRECTION), (403, None, POST, Retry.AFTER_CORRECTION),
     (429, 3.0, GET, Retry.BACKOFF), (503, 3.0, GET, Retry.BACKOFF),
     (429, 3.0, POST, Retry.NEVER), (429, None, GET, Retry.NEVER), (503, None, POST, Retry.NEVER),
     (404, None, GET, Retry.AFTER_CORRECTION), (422, None, POST, Retry.AFTER_CORRECTION)],
)
def test_rejections(status, retry_after, operation, retry):
    record = fold([*complete(status, retry_after=retry_after), ev(K.RESULT_DELIVERED)])
    assert record.outcome is Outcome.REJECTED
    assert retry_hint(record, operation) is retry
    expected = NextAction.RETRY_WHEN_ALLOWED if retry is Retry.BACKOFF else NextAction.RETURN_RECORDED_RESULT
    assert decide(record, retry, operation, "sha256:a") is expected


def test_a_committed_500_on_post_is_never_a_licence_to_resend():
    record = fold([*complete(500), ev(K.RESULT_DELIVERED)])
    assert record.outcome is Outcome.COMMITTED
    assert retry_hint(record, POST) is Retry.NEVER
    assert retry_hint(record, GET) is Retry.NEVER
    assert decide(record, Retry.NEVER, POST, "sha256:a") is NextAction.RETURN_RECORDED_RESULT


def test_method_semantics_are_overridable():
    assert is_idempotent("GET", None) and is_idempotent("put", None) and not is_idempotent("POST", None)
    assert not is_idempotent("PUT", False) and is_idempotent("POST", True)


def test_every_transition_names_real_stages():
    stages = set(Stage)
    for allowed, target in TRANSITIONS.values():
        assert allowed <= stages
        assert target is None or target in stages
    assert ENDED <= stages


# -- properties over random histories ---------------------------------------------------------

CODES = [c.value for c in Code]
STATUSES = [200, 201, 202, 204, 301, 307, 400, 401, 403, 404, 409, 422, 429, 500, 502, 503, 504]


_DATA: dict[EventKind, st.SearchStrategy[Event]] = {
    K.DISPATCH_STARTED: st.builds(lambda a, c: Event(K.DISPATCH_STARTED, {"attempt": a, "connection": c}), st.integers(1, 3), st.sampled_from(["new", "reused"])),
    K.CONNECTION_ATTEMPT: st.builds(lambda a, c: Event(K.CONNECTION_ATTEMPT, {"attempt": a, "stage": "tcp_connect", "code": c}), st.integers(1, 3), st.sampled_from(CODES)),
    K.REMOTE_RESPONSE_STARTED: st.builds(lambda s: Event(K.REMOTE_RESPONSE_STARTED, {"status": s}), st.sampled_from(STATUSES)),
    K.REMOTE_RESPONSE_COMPLETE: st.builds(lambda s, r: Event(K.REMOTE_RESPONSE_COMPLETE, {"status": s, "retry_after": r}), st.sampled_from(STATUSES), st.one_of(st.none(), st.floats(0, 60))),
    K.CALLER_CANCELLED: st.builds(lambda d: Event(K.CALLER_CANCELLED, {"disposition": d}), st.sampled_from(["cancelled", "disconnected", "timed_out"])),
    K.RECONCILED: st.builds(lambda o, c: Event(K.RECONCILED, {"outcome": o, "certainty": c}),
                            st.sampled_from(["committed", "rejected", "partial_effect", "unknown", "not_attempted"]),
                            st.sampled_from(["operator_attested", "remote_query"])),
}


def _event_strategy() -> st.SearchStrategy[Event]:
    """Any event at all, legal or not, with random data."""
    plain = [k for k in EventKind if k not in _DATA and k is not K.FAILED]
    return st.one_of(
        st.sampled_from(plain).map(lambda k: Event(k, {})),
        *_DATA.values(),
        st.builds(lambda p, c, a: Event(K.FAILED, {"phase": p, "code": c, "answered": a}), st.sampled_from([p.value for p in Phase]), st.sampled_from(CODES), st.booleans()),
    )


def _legal_history(candidates: list[Event]) -> list[Record]:
    """Fold candidates, skipping the ones the contract refuses; returns every record reached."""
    record = Record()
    records = [record]
    seq = 0
    for event in candidates:
        try:
            record = apply(record, Event(event.kind, event.data, seq + 1))
        except IllegalTransition:
            continue
        seq += 1
        records.append(record)
    return records


def _event_of(key) -> st.SearchStrategy[Event]:
    """Random data for one key of TRANSITIONS (FAILED keys carry their phase)."""
    if isinstance(key, tuple):
        _, phase = key
        return st.builds(lambda c, a: Event(K.FAILED, {"phase": phase.value, "code": c, "answered": a}), st.sampled_from(CODES), st.booleans())
    return _DATA.get(key, st.just(Event(key, {})))


@st.composite
def legal_histories(draw, max_steps: int = 30) -> list[Record]:
    """Random walks through the transition table: at each step, one of the legal next moves.

    Choosing among moves the table allows from the current stage reaches deep states (late
    results, re-sends, reconciliation) that filtering random sequences would almost never hit.
    """
    record = Record()
    records = [record]
    for step in range(max_steps):
        keys = [key for key, (allowed, _) in TRANSITIONS.items() if record.stage in allowed]
        if not keys:
            break
        # Moves that end a record are drawn less often, so walks get deep before they stop.
        keys = [k for k in keys for _ in range(1 if isinstance(k, tuple) else 6)]
        event = draw(st.sampled_from(keys).flatmap(_event_of))
        try:
            record = apply(record, Event(event.kind, event.data, step + 1))
        except IllegalTransition:
            continue
        records.append(record)
    return records


operations = st.builds(Operation, idempotent=st.booleans(), remote_contract=st.booleans(), fingerprint=st.just("sha256:a"))


@settings(max_examples=300, deadline=None)
@given(legal_histories(), operations, st.booleans())
def test_properties_of_every_legal_history(records, operation, retention_open):
    dispatched = False
    first_disposition = None
    attempt = 0
    for record in records:
        if record.attempt_count != attempt:  # a new attempt has a caller of its own
            attempt, first_disposition = record.attempt_count, None
        dispatched = dispatched or record.dispatch_started
        # Never back to not_attempted once DISPATCH_STARTED is in the log.
        if dispatched:
            assert record.outcome is not Outcome.NOT_ATTEMPTED
            assert record.stage is not Stage.ENDED_NOT_ATTEMPTED
        # Known outcomes come only from a complete result or a reconciliation.
        if record.outcome in (Outcome.COMMITTED, Outcome.REJECTED, Outcome.PARTIAL_EFFECT):
            assert record.response_complete or record.reconciled_outcome is not None
        # The caller's disposition is written once per attempt and never rewritten.
        if record.caller_disposition is not CallerDisposition.WAITING:
            first_disposition = first_disposition or record.caller_disposition
            assert record.caller_disposition is first_disposition
        retry = retry_hint(record, operation, retention_open=retention_open)
        if retry is Retry.FETCH_RESULT:
            assert record.result_stored
        action = decide(record, retry, operation, "sha256:a")
        # No path re-sends a non-idempotent operation without a declared contract.
        if record.outcome is Outcome.UNKNOWN and not operation.idempotent and not operation.remote_contract:
            assert action not in (NextAction.RETRY_NEW_ATTEMPT, NextAction.RETRY_SAME_KEY, NextAction.RETRY_WHEN_ALLOWED)
        if action is NextAction.RETRY_SAME_KEY:
            assert operation.remote_contract and retention_open
        # A committed effect is never retried.
        if record.outcome is Outcome.COMMITTED:
            assert action in (NextAction.RETURN_RECORDED_RESULT, NextAction.FETCH_RESULT, NextAction.WAIT)
        if not record.ended and retry is None:
            assert action is NextAction.WAIT


@settings(max_examples=200, deadline=None)
@given(st.lists(_event_strategy(), max_size=40))
def test_projection_is_a_pure_fold(candidates):
    records = _legal_history(candidates)
    final = records[-1]
    # Replaying the same accepted events gives the same record (no hidden state).
    accepted = []
    record = Record()
    for event in candidates:
        try:
            record = apply(record, Event(event.kind, event.data, len(accepted) + 1))
        except IllegalTransition:
            continue
        accepted.append(Event(event.kind, event.data, len(accepted) + 1))
    assert project(accepted) == final


def test_the_walk_generator_reaches_every_stage():
    seen: set[Stage] = set()

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(legal_histories())
    def collect(records):
        seen.update(r.stage for r in records)

    collect()
    assert seen == set(Stage)


def test_a_timed_out_callers_provisional_end_never_claims_what_is_not_durable():
    """The answer the broker gives a caller whose wait ended: while the complete response's record
    is still on its way it is unknown (to be fetched), never committed; and it is worked out for
    every stage the exchange can be in, without an illegal move."""
    from types import SimpleNamespace

    from proxy.broker import _RECORDING, _provisional_end

    def end(events, in_hand=False):
        record = fold(events)
        return _provisional_end(SimpleNamespace(record=record, retry_for=lambda r: retry_hint(r, POST)),
                                in_hand or record.stage in _RECORDING)

    assert end(DISPATCH) == (Outcome.UNKNOWN, Retry.RECONCILE)
    responding = [*DISPATCH, ev(K.REQUEST_SENT), ev(K.REMOTE_RESPONSE_STARTED, status=200)]
    assert end(responding) == (Outcome.UNKNOWN, Retry.RECONCILE)
    # The complete answer in hand, its first event not appended yet (a large body's redaction): fetched.
    assert end(responding, in_hand=True) == (Outcome.UNKNOWN, Retry.FETCH_RESULT)
    recorded = [*DISPATCH, ev(K.REMOTE_RESPONSE_COMPLETE, status=201)]
    assert end(recorded) == (Outcome.UNKNOWN, Retry.FETCH_RESULT)
    assert end([*recorded, ev(K.RESULT_COMMITTED)]) == (Outcome.UNKNOWN, Retry.FETCH_RESULT)
