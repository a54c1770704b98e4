"""proxy.client: parsing and decisions (pure, with fakes), then recovery against a real broker.

The real-broker tests count what the hostile upstream really applied: recovery must end with the
one effect the agent asked for, never a second one, and never a new idempotency key.
"""

from __future__ import annotations

import email.message
import json
import secrets
import time
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.client import (
    DEFAULT_BACKOFF,
    DEFAULT_POLL,
    AttemptsExhausted,
    CorrectionRequired,
    InvocationNotFound,
    NotAnEnvelope,
    ReconcileRequired,
    RecordedResult,
    ResultUnavailable,
    SideAPI,
    Step,
    after_failure,
    as_result,
    call_with_recovery,
    envelope_of,
    parse_envelope,
    parse_invocation,
)
from proxy.contract import CallerDisposition, Code, NextAction, Outcome, Phase, Retry
from proxy.envelope import MEDIA_TYPE, encode, envelope
from tests.support.hostile import HostileUpstream

ID = "act_01JABCDEFGHJKMNPQRSTVWXYZ0"


def broker_envelope(code: Code = Code.REMOTE_OUTCOME_UNKNOWN, retry: Retry = Retry.SAME_IDEMPOTENCY_KEY,
                    outcome: Outcome = Outcome.UNKNOWN, phase: Phase = Phase.REMOTE_EXECUTION,
                    invocation_id: str | None = ID, message: str = "The connection ended.", key: str | None = "k1",
                    status: int = 502) -> tuple[int, list[tuple[str, str]], bytes]:
    """An envelope exactly as the broker sends it: body and headers."""
    evidence: dict[str, Any] = {"dispatch_started": outcome is Outcome.UNKNOWN}
    if key:
        evidence["idempotency"] = {"key": key, "scope": "payments.create", "remote_contract": "configured"}
    body = encode(envelope(invocation_id, code, phase, outcome, retry, message, evidence))
    headers = [("Content-Type", MEDIA_TYPE)]
    if invocation_id:
        headers += [("Affidavit-Invocation-Id", invocation_id), ("Affidavit-Outcome", outcome.value), ("Affidavit-Code", code.value)]
    return status, headers, body


def record(next_action: NextAction, *, outcome: Outcome = Outcome.UNKNOWN, retry: Retry | None = Retry.SAME_IDEMPOTENCY_KEY,
           result_available: bool = False, retry_after: float | None = None, invocation_id: str = ID) -> dict[str, Any]:
    """A minimal ``GET /v1/invocations/{id}`` answer."""
    evidence: dict[str, Any] = {"dispatch_started": True}
    if retry_after is not None:
        evidence["retry_after"] = retry_after
    return {
        "invocation_id": invocation_id, "agent": "builder", "route": "pay", "method": "POST",
        "target": "https://pay.example.test/v1/charges", "fingerprint": "sha256:" + "0" * 64,
        "phase": "remote_execution", "outcome": outcome.value, "retry": retry.value if retry else None,
        "code": "REMOTE_OUTCOME_UNKNOWN", "caller_disposition": "completed", "stage": "ended_unknown",
        "next_action": next_action.value, "result_available": result_available,
        "idempotency": {"key": "k1", "scope": "payments.create", "remote_contract": "configured"},
        "evidence": evidence, "events": [],
    }


# -- parsing ------------------------------------------------------------------------------------


def test_an_envelope_parses_into_the_contract_enums():
    _, headers, body = broker_envelope()
    parsed = parse_envelope(body, headers + [("Retry-After", "2")])
    assert parsed.code is Code.REMOTE_OUTCOME_UNKNOWN and parsed.phase is Phase.REMOTE_EXECUTION
    assert parsed.outcome is Outcome.UNKNOWN and parsed.retry is Retry.SAME_IDEMPOTENCY_KEY
    assert parsed.invocation_id == ID and parsed.idempotency_key == "k1" and parsed.retry_after == 2.0
    assert parsed.evidence["dispatch_started"] is True


def test_the_idempotency_key_header_is_used_when_the_evidence_has_none():
    _, headers, body = broker_envelope(key=None)
    assert parse_envelope(body, headers + [("Affidavit-Idempotency-Key", "afk_1")]).idempotency_key == "afk_1"


@pytest.mark.parametrize("body", [
    b"not json",
    b"[]",
    b'{"error": {"code": "X"}}',
    json.dumps({"invocation_id": None, "error": {"code": "SOMETHING_NEW", "phase": "validation", "outcome": "not_attempted",
                                                  "retry": "never", "message": "m"}}).encode(),
    json.dumps({"invocation_id": None, "error": {"code": "RECONCILE_REQUIRED", "phase": "validation", "outcome": "maybe",
                                                  "retry": "never", "message": "m"}}).encode(),
])
def test_what_is_not_an_envelope_of_known_values_is_refused(body):
    """An enum value this client does not know is refused, not guessed at."""
    with pytest.raises(NotAnEnvelope):
        parse_envelope(body)


@pytest.mark.parametrize("as_headers", [
    lambda pairs: pairs,
    dict,
    httpx.Headers,
    lambda pairs: _message(pairs),
], ids=["pairs", "dict", "httpx", "email.message"])
def test_envelope_of_accepts_any_library_headers(as_headers):
    _, headers, body = broker_envelope()
    assert envelope_of(as_headers(headers), body) is not None


def _message(pairs: list[tuple[str, str]]) -> email.message.Message:
    message = email.message.Message()  # what urllib.request and http.client give
    for k, v in pairs:
        message[k] = v
    return message


def test_the_remotes_own_problem_json_is_not_taken_for_a_broker_envelope():
    """A remote may answer problem+json in the envelope's shape; the broker then adds its
    Affidavit-Invocation-Id but no Affidavit-Code, so it is the remote's answer."""
    _, _, body = broker_envelope()
    proxied = [("Content-Type", MEDIA_TYPE), ("Affidavit-Invocation-Id", ID), ("Affidavit-Outcome", "rejected")]
    assert envelope_of(proxied, body) is None
    assert envelope_of([("Content-Type", "application/json"), ("Affidavit-Code", "REMOTE_OUTCOME_UNKNOWN")], body) is None
    assert envelope_of([("Content-Type", MEDIA_TYPE)], b'{"type": "about:blank", "status": 404}') is None


def test_an_envelope_without_a_record_is_recognised():
    _, headers, body = broker_envelope(Code.JOURNAL_UNAVAILABLE, Retry.BACKOFF, Outcome.NOT_ATTEMPTED, Phase.VALIDATION,
                                       invocation_id=None, status=503)
    found = envelope_of(headers + [("Retry-After", "1")], body)
    assert found is not None and found.invocation_id is None
    assert after_failure(found) == after_failure(found)  # frozen, comparable
    assert after_failure(found).step is Step.RETRY_SAME_KEY and after_failure(found).delay == 1.0


def test_an_invocation_record_parses():
    parsed = parse_invocation(json.dumps(record(NextAction.RETRY_WHEN_ALLOWED, retry_after=3)).encode())
    assert parsed.next_action is NextAction.RETRY_WHEN_ALLOWED and parsed.retry is Retry.SAME_IDEMPOTENCY_KEY
    assert parsed.caller_disposition is CallerDisposition.COMPLETED and parsed.remote_contract
    assert parsed.idempotency_key == "k1" and parsed.retry_after == 3.0 and parsed.code is Code.REMOTE_OUTCOME_UNKNOWN
    in_flight = parse_invocation(record(NextAction.WAIT, retry=None))
    assert in_flight.retry is None


def test_as_result_takes_the_usual_response_shapes():
    triple = as_result((201, [("A", "1")], b"x"))
    assert triple == RecordedResult(201, (("A", "1"),), b"x")
    response = httpx.Response(202, headers={"Affidavit-Invocation-Id": ID, "Affidavit-Replayed": "true"}, content=b"{}")
    result = as_result(response)
    assert (result.status, result.invocation_id, result.replayed, result.json()) == (202, ID, True, {})


# -- the decision -------------------------------------------------------------------------------

EXPECTED_STEPS = {
    NextAction.FETCH_RESULT: Step.FETCH_RESULT,
    NextAction.RETURN_RECORDED_RESULT: Step.FETCH_RESULT,
    NextAction.RETRY_NEW_ATTEMPT: Step.RETRY_SAME_KEY,
    NextAction.RETRY_SAME_KEY: Step.RETRY_SAME_KEY,
    NextAction.RETRY_WHEN_ALLOWED: Step.RETRY_NEW_KEY,
    NextAction.RECONCILE: Step.RECONCILE,
    NextAction.STOP_FOR_CORRECTION: Step.CORRECT,
    NextAction.WAIT: Step.WAIT,
}


@pytest.mark.parametrize("action", list(NextAction))
def test_every_next_action_has_one_step(action):
    what = after_failure(parse_invocation(record(action, result_available=True)))
    assert what.step is EXPECTED_STEPS[action]
    assert what.because is action and what.invocation_id == ID and what.idempotency_key == "k1"


def test_delays_come_from_the_record():
    assert after_failure(parse_invocation(record(NextAction.RETRY_WHEN_ALLOWED, retry_after=7))).delay == 7
    assert after_failure(parse_invocation(record(NextAction.RETRY_NEW_ATTEMPT))).delay == DEFAULT_BACKOFF
    assert after_failure(parse_invocation(record(NextAction.RETRY_SAME_KEY))).delay == 0
    assert after_failure(parse_invocation(record(NextAction.WAIT, retry=None))).delay == DEFAULT_POLL


def test_a_recorded_result_that_was_never_stored_means_reconcile_not_resend():
    what = after_failure(parse_invocation(record(NextAction.RETURN_RECORDED_RESULT, outcome=Outcome.COMMITTED,
                                                 retry=Retry.NEVER, result_available=False)))
    assert what.step is Step.RECONCILE


@pytest.mark.parametrize(("retry", "step"), [
    (Retry.FETCH_RESULT, Step.FETCH_RESULT),
    (Retry.NEVER, Step.FETCH_RESULT),
    (Retry.BACKOFF, Step.RETRY_SAME_KEY),
    (Retry.SAME_IDEMPOTENCY_KEY, Step.RETRY_SAME_KEY),
    (Retry.RECONCILE, Step.RECONCILE),
    (Retry.AFTER_CORRECTION, Step.CORRECT),
])
def test_every_envelope_retry_hint_has_one_step(retry, step):
    _, headers, body = broker_envelope(retry=retry)
    assert after_failure(parse_envelope(body, headers)).step is step
    assert {r for r in Retry} == {Retry.FETCH_RESULT, Retry.NEVER, Retry.BACKOFF, Retry.SAME_IDEMPOTENCY_KEY,
                                  Retry.RECONCILE, Retry.AFTER_CORRECTION}


def test_nothing_to_fetch_without_a_record():
    _, headers, body = broker_envelope(retry=Retry.FETCH_RESULT, invocation_id=None)
    assert after_failure(parse_envelope(body, headers)).step is Step.RECONCILE


@given(st.text(min_size=1, max_size=200))
def test_the_message_never_changes_the_decision(message):
    _, headers, body = broker_envelope(retry=Retry.RECONCILE, message=message)
    assert after_failure(parse_envelope(body, headers)).step is Step.RECONCILE


# -- call_with_recovery, with fakes -------------------------------------------------------------


class FakeAPI:
    """Answers invocation() from a script of records; result() from a fixed result or a 409."""

    def __init__(self, *records: dict[str, Any], result: RecordedResult | None = None):
        self.records = list(records)
        self.asked: list[str] = []
        self._result = result

    def invocation(self, invocation_id: str):
        self.asked.append(invocation_id)
        return parse_invocation(self.records.pop(0))

    def result(self, invocation_id: str) -> RecordedResult:
        if self._result is None:
            _, headers, body = broker_envelope(retry=Retry.RECONCILE)
            raise ResultUnavailable("no result", parse_envelope(body, headers))
        return self._result


class Sender:
    """Returns scripted responses and remembers the headers of every send."""

    def __init__(self, *responses: Any):
        self.responses = list(responses)
        self.sent: list[dict[str, str]] = []

    def __call__(self, headers: dict[str, str]) -> Any:
        self.sent.append(dict(headers))
        response = self.responses.pop(0)
        if isinstance(response, BaseException):
            raise response
        return response


OK = (201, [("Affidavit-Invocation-Id", ID), ("Affidavit-Outcome", "committed")], b'{"id": "ch_1"}')


def test_a_retry_allowed_by_the_record_goes_out_with_the_same_key():
    send, sleeps = Sender(broker_envelope(), OK), []
    result = call_with_recovery(send, FakeAPI(record(NextAction.RETRY_SAME_KEY)), "order-1", sleep=sleeps.append)
    assert result.status == 201 and result.source == "proxy"
    assert send.sent == [{"Idempotency-Key": "order-1"}] * 2


def test_the_record_decides_not_the_envelope_and_waiting_ends_in_a_fetch():
    """A timed-out call's envelope says reconcile (provisionally); the record says wait, then fetch."""
    fetched = RecordedResult(200, (("Affidavit-Replayed", "true"),), b"late", source="side_api")
    api = FakeAPI(record(NextAction.WAIT, retry=None), record(NextAction.WAIT, retry=None),
                  record(NextAction.FETCH_RESULT, outcome=Outcome.COMMITTED, retry=Retry.FETCH_RESULT, result_available=True),
                  result=fetched)
    send, sleeps = Sender(broker_envelope(retry=Retry.RECONCILE, status=504)), []
    assert call_with_recovery(send, api, "k", sleep=sleeps.append) is fetched
    assert len(send.sent) == 1 and sleeps == [DEFAULT_POLL, DEFAULT_POLL]


def test_waiting_is_bounded():
    api = FakeAPI(*[record(NextAction.WAIT, retry=None)] * 10)
    with pytest.raises(AttemptsExhausted) as raised:
        call_with_recovery(Sender(broker_envelope()), api, "k", sleep=lambda s: None, max_wait=1.0)
    assert raised.value.invocation is not None and raised.value.invocation.next_action is NextAction.WAIT
    assert "call again later with the same key 'k'" in str(raised.value), "says what to do next"


def test_reconcile_and_correction_stop_without_another_send():
    send = Sender(broker_envelope(retry=Retry.RECONCILE))
    with pytest.raises(ReconcileRequired) as raised:
        call_with_recovery(send, FakeAPI(record(NextAction.RECONCILE, retry=Retry.RECONCILE)), "k")
    assert len(send.sent) == 1 and raised.value.invocation_id == ID
    send = Sender(broker_envelope(Code.INVALID_TARGET, Retry.AFTER_CORRECTION, Outcome.NOT_ATTEMPTED, Phase.VALIDATION, status=403))
    with pytest.raises(CorrectionRequired):
        call_with_recovery(send, FakeAPI(record(NextAction.STOP_FOR_CORRECTION, outcome=Outcome.NOT_ATTEMPTED,
                                                retry=Retry.AFTER_CORRECTION)), "k")
    assert len(send.sent) == 1


def test_a_mismatched_key_is_about_this_request_not_the_earlier_record():
    """IDEMPOTENCY_MISMATCH names the invocation that owns the key; its record (committed, say)
    must not be returned for a request with a different body."""
    send, api = Sender(broker_envelope(Code.IDEMPOTENCY_MISMATCH, Retry.AFTER_CORRECTION, Outcome.NOT_ATTEMPTED,
                                       Phase.VALIDATION, status=422)), FakeAPI()
    with pytest.raises(CorrectionRequired):
        call_with_recovery(send, api, "k")
    assert api.asked == []


def test_a_fetch_without_a_result_means_reconcile():
    send = Sender(broker_envelope(retry=Retry.FETCH_RESULT))
    with pytest.raises(ReconcileRequired):
        call_with_recovery(send, FakeAPI(record(NextAction.FETCH_RESULT, result_available=True)), "k")


def test_attempts_are_bounded_and_every_send_has_the_same_key():
    send = Sender(*[broker_envelope(retry=Retry.BACKOFF)] * 5)
    api = FakeAPI(*[record(NextAction.RETRY_NEW_ATTEMPT, retry=Retry.BACKOFF)] * 5)
    sleeps: list[float] = []
    with pytest.raises(AttemptsExhausted):
        call_with_recovery(send, api, "k", max_attempts=3, sleep=sleeps.append)
    assert send.sent == [{"Idempotency-Key": "k"}] * 3 and sleeps == [DEFAULT_BACKOFF] * 2


def test_a_lost_connection_to_the_broker_is_repeated_with_the_same_key():
    send = Sender(ConnectionResetError("broker went away"), OK)
    result = call_with_recovery(send, FakeAPI(), "k", sleep=lambda s: None)
    assert result.status == 201 and send.sent == [{"Idempotency-Key": "k"}] * 2
    with pytest.raises(ConnectionResetError):
        call_with_recovery(Sender(ConnectionResetError("x")), FakeAPI(), "k", max_attempts=1)


@pytest.mark.parametrize("key", ["", "   "])
def test_no_key_no_recovery(key):
    with pytest.raises(ValueError):
        call_with_recovery(Sender(OK), FakeAPI(), key)


def test_side_api_arguments_are_checked():
    with pytest.raises(ValueError):
        SideAPI("127.0.0.1:8081", "t")
    with pytest.raises(ValueError):
        SideAPI("http://127.0.0.1:8081", "t", timeout=600)
    with pytest.raises(ValueError):
        SideAPI("http://127.0.0.1:8081", "")
    assert SideAPI.from_proxy_url("http://127.0.0.1:8081", "http://builder:s3cr%2Ft@127.0.0.1:8080")._token == "s3cr/t"
    with pytest.raises(ValueError):
        SideAPI.from_proxy_url("http://127.0.0.1:8081", "http://127.0.0.1:8080")


# -- against a real broker ----------------------------------------------------------------------

PAY = "https://pay.example.test"
NO_CONTRACT = "https://pay-nc.example.test"
SLOW = "https://slow.example.test"
DOWN = "https://down.example.test"


def client_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    base = {"agents": ["builder"], "connect_to": good, "response_timeout": "3s", "result_horizon": "4s"}
    return [
        {"name": "pay", "host": "pay.example.test", "methods": ["POST"], **base,
         "credential": "payments-key", "inject": {"header": "Authorization", "value": "Bearer {secret}"},
         "idempotency": {"header": "Idempotency-Key", "scope": "payments.create", "retention": "1h"}},
        {"name": "pay-nc", "host": "pay-nc.example.test", "methods": ["POST"], **base},
        {"name": "slow", "host": "slow.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good,
         "response_timeout": "1s", "result_horizon": "15s"},
        {"name": "down", "host": "down.example.test", "methods": ["POST"], "agents": ["builder"],
         "connect_to": f"127.0.0.1:{up.free_port()}"},
    ]


@pytest.fixture
def broker(make_broker, upstream: HostileUpstream):
    return make_broker(routes=client_routes(upstream))


@pytest.fixture
def api(broker) -> SideAPI:
    return SideAPI(broker.api_url, broker.agents["builder"].token, timeout=10)


@pytest.fixture
def proxied(broker) -> Iterator[httpx.Client]:
    with broker.client() as client:
        yield client


def sender(client: httpx.Client, url: str, body: bytes = b'{"amount": 100, "currency": "eur"}'):
    def send(headers: dict[str, str]) -> httpx.Response:
        return client.post(url, content=body, headers={"Content-Type": "application/json", **headers})
    return send


def sent(up: HostileUpstream) -> list:
    return [r for r in up.received if r.method]


def new_key() -> str:
    return "order-" + secrets.token_hex(6)


def test_a_payment_whose_response_was_lost_is_recovered_with_one_resend_and_one_effect(broker, api, proxied, upstream):
    key, sleeps = new_key(), []
    result = call_with_recovery(sender(proxied, PAY + "/h/idem_honour?code=201&lose=1"), api, key, sleep=sleeps.append)
    assert result.status == 201 and result.header("Affidavit-Outcome") == "committed" and not result.replayed
    attempts = sent(upstream)
    assert len(attempts) == 2, "the original and exactly one re-send"
    assert [a.header("Idempotency-Key") for a in attempts] == [key, key]
    assert upstream.effects_by_key == {key: 1} and upstream.effects == 1
    assert sleeps == [0.0]
    # RESULT_DELIVERED is written just after the hand-over; until then the record says "wait".
    record = parse_invocation(broker.wait_for(result.invocation_id, lambda r: r["stage"] == "delivered"))
    assert record.outcome is Outcome.COMMITTED and record.next_action is NextAction.RETURN_RECORDED_RESULT
    assert [a["n"] for a in record.evidence["attempts"]] == [1, 2]
    # The same call again is answered from the journal: no third request reaches the payment service.
    again = call_with_recovery(sender(proxied, PAY + "/h/idem_honour?code=201&lose=1"), api, key)
    assert again.replayed and again.body == result.body and len(sent(upstream)) == 2


def test_a_post_without_a_contract_whose_response_was_lost_needs_reconciliation(api, proxied, upstream):
    key = new_key()
    with pytest.raises(ReconcileRequired) as raised:
        call_with_recovery(sender(proxied, NO_CONTRACT + "/h/close_after_effect"), api, key, sleep=pytest.fail)
    stopped = raised.value
    assert len(sent(upstream)) == 1 and upstream.effects == 1, "no second send"
    assert stopped.envelope is not None and stopped.envelope.code is Code.REMOTE_OUTCOME_UNKNOWN
    assert stopped.envelope.retry is Retry.RECONCILE and stopped.envelope.outcome is Outcome.UNKNOWN
    assert stopped.invocation is not None and stopped.invocation.next_action is NextAction.RECONCILE
    assert stopped.invocation.evidence["dispatch_started"] is True
    with pytest.raises(ResultUnavailable) as no_result:
        api.result(stopped.invocation_id)
    assert no_result.value.envelope.outcome is Outcome.UNKNOWN and no_result.value.envelope.invocation_id == stopped.invocation_id
    # A later attempt with the same key is refused by the broker too, and sends nothing.
    with pytest.raises(ReconcileRequired) as again:
        call_with_recovery(sender(proxied, NO_CONTRACT + "/h/close_after_effect"), api, key)
    assert again.value.envelope.code is Code.RECONCILE_REQUIRED and len(sent(upstream)) == 1


def test_a_result_is_fetched_after_the_caller_gave_up(api, proxied, upstream):
    """The broker stops the caller's wait at response_timeout (1 s) but keeps reading; the upstream
    answers at 2.5 s. The record says wait, then fetch_result; the result comes from the side API."""
    key, slept = new_key(), []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    send = sender(proxied, SLOW + "/h/slow?delay=2.5")
    first: list[httpx.Response] = []
    result = call_with_recovery(lambda h: first.append(send(h)) or first[-1], api, key, sleep=sleep, max_wait=20)
    assert first[0].status_code == 504 and first[0].headers["content-type"] == MEDIA_TYPE
    assert result.source == "side_api" and result.replayed and result.status == 200
    assert result.json()["effects"] == 1 and result.invocation_id == first[0].headers["affidavit-invocation-id"]
    assert slept and all(s == DEFAULT_POLL for s in slept)
    assert len(sent(upstream)) == 1 and upstream.effects == 1
    record = api.invocation(result.invocation_id)
    assert record.caller_disposition is CallerDisposition.TIMED_OUT, "a later fetch never rewrites the caller's wait"
    assert record.outcome is Outcome.COMMITTED and record.result_available
    assert api.result(result.invocation_id).body == result.body


def test_nothing_sent_is_retried_under_the_same_invocation_until_attempts_run_out(api, proxied, upstream):
    key, sleeps = new_key(), []
    with pytest.raises(AttemptsExhausted) as raised:
        call_with_recovery(sender(proxied, DOWN + "/h/ok"), api, key, max_attempts=3, sleep=sleeps.append)
    stopped = raised.value
    assert stopped.envelope.code is Code.CONNECT_REFUSED and stopped.envelope.outcome is Outcome.NOT_ATTEMPTED
    assert stopped.invocation.next_action is NextAction.RETRY_NEW_ATTEMPT
    assert sleeps == [DEFAULT_BACKOFF, DEFAULT_BACKOFF]
    record = api.invocation(stopped.invocation_id)
    assert record.outcome is Outcome.NOT_ATTEMPTED and record.raw["retry_budget"]["used"] == 2
    kinds = [e["kind"] for e in record.raw["events"]]
    assert kinds.count("PREFLIGHT_VALIDATED") == 3 and kinds.count("FAILED") == 3 and "DISPATCH_STARTED" not in kinds
    assert upstream.received == []


def test_the_side_api_ignores_proxy_settings_and_hides_what_is_not_the_agents(broker, api, proxied, monkeypatch):
    # An agent configured by `affidavit env` has these set; urllib (or httpx with trust_env) would
    # send side API calls to the proxy, which refuses them as INVALID_TARGET.
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, broker.proxy_url())
    response = proxied.post(NO_CONTRACT + "/h/ok", content=b"{}")
    invocation_id = response.headers["affidavit-invocation-id"]
    assert api.invocation(invocation_id).outcome is Outcome.COMMITTED
    other = SideAPI(broker.api_url, broker.agents["reviewer"].token)
    with pytest.raises(InvocationNotFound):
        other.invocation(invocation_id)
    with pytest.raises(InvocationNotFound):
        other.result(invocation_id)
    with pytest.raises(InvocationNotFound):
        api.invocation("act_00000000000000000000000000")
    fetched = api.result(invocation_id)
    assert fetched.status == 200 and fetched.replayed and fetched.source == "side_api"
