"""Safe retries: idempotency keys, replay, leases and fencing, across broker replicas.

Upstreams honour the key, ignore it, or are strict about it; every test counts the effects the
upstream really applied.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import subprocess
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream, free_port
from tests.support.journal import query

PAY = "https://pay.example.test"
NO_CONTRACT = "https://pay-nc.example.test"
OWN_HEADER = "https://pay-own.example.test"
SHORT = "https://pay-short.example.test"
PUT = "https://put.example.test"
TIGHT = "https://pay-tight.example.test"
PUT_TIGHT = "https://put-tight.example.test"


def retry_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    base = {"agents": ["builder"], "connect_to": good, "response_timeout": "3s", "result_horizon": "4s"}
    credential = {"credential": "payments-key", "inject": {"header": "Authorization", "value": "Bearer {secret}"}}
    return [
        {"name": "pay", "host": "pay.example.test", "methods": ["POST"], **base, **credential,
         "idempotency": {"header": "Idempotency-Key", "scope": "payments.create", "retention": "1h"}},
        {"name": "pay-nc", "host": "pay-nc.example.test", "methods": ["POST"], **base},
        {"name": "pay-own-header", "host": "pay-own.example.test", "methods": ["POST"], **base,
         "idempotency": {"header": "X-Idem", "scope": "own", "retention": "1h"}},
        {"name": "pay-short", "host": "pay-short.example.test", "methods": ["POST"], **base,
         "idempotency": {"header": "Idempotency-Key", "scope": "short", "retention": "1s"}},
        {"name": "put", "host": "put.example.test", "methods": ["PUT", "GET"], **base},
        {"name": "pay-tight", "host": "pay-tight.example.test", "methods": ["POST"], **base, "retry_budget": 1,
         "idempotency": {"header": "Idempotency-Key", "scope": "tight", "retention": "1h"}},
        {"name": "put-tight", "host": "put-tight.example.test", "methods": ["PUT"], **base, "retry_budget": 1},
        {"name": "bodiless", "host": "bodiless.example.test", "methods": ["HEAD", "DELETE"], **base},
        {"name": "refused-tight", "host": "refused-tight.example.test", "methods": ["POST"], **base,
         "connect_to": f"127.0.0.1:{free_port()}", "retry_budget": 1,
         "idempotency": {"header": "Idempotency-Key", "scope": "refused", "retention": "1h"}},
    ]


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI, upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, retry_routes(upstream_server), name="retries")


def key() -> str:
    return "k_" + secrets.token_hex(8)


def post(client: httpx.Client, url: str, idem: str | None, body: bytes = b'{"amount":100}') -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if idem is not None:
        headers["Idempotency-Key"] = idem
    return client.post(url, content=body, headers=headers)


def post_in_background(broker: BrokerProcess, url: str, idem: str) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """``post`` from a thread, started; its answer lands under ``"first"`` once the thread ends."""
    results: dict[str, httpx.Response] = {}

    def send() -> None:
        with broker.client() as client:
            results["first"] = post(client, url, idem)

    thread = threading.Thread(target=send)
    thread.start()
    return thread, results


def sent(up: HostileUpstream) -> list:
    return [r for r in up.received if r.method]


def test_a_committed_result_is_replayed_from_the_journal(broker, upstream):
    k = key()
    with broker.client() as client:
        first = post(client, PAY + "/h/idem_honour?code=201", k)
        again = post(client, PAY + "/h/idem_honour?code=201", k)
    assert first.status_code == again.status_code == 201
    assert "affidavit-replayed" not in first.headers
    assert again.headers["affidavit-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["affidavit-invocation-id"] == first.headers["affidavit-invocation-id"]
    assert len(sent(upstream)) == 1 and upstream.effects == 1
    # The replay count is written in batches, a moment after the replay.
    record = broker.wait_for(first.headers["affidavit-invocation-id"], lambda r: r["replays"] >= 1)
    assert record["replays"] == 1
    assert record["idempotency"]["key"] == k and record["idempotency"]["remote_contract"] == "configured"
    assert sent(upstream)[0].header("Idempotency-Key") == k


def _curl_http2(broker: BrokerProcess, method: str, url: str, k: str) -> tuple[str, dict[str, str]]:
    """An HTTP/2 agent (it refuses a 204 that carries Content-Length); its status and headers."""
    done = subprocess.run(["curl", "-sS", "-D", "-", "-o", "/dev/null", "--http2", "--proxy", broker.proxy_url(),
                           "--cacert", str(broker.ca_path), "--max-time", "20", "-H", f"Idempotency-Key: {k}",
                           *(["--head"] if method == "HEAD" else ["-X", method]), url],
                          capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    last = done.stdout.decode().strip().split("\r\n\r\n")[-1]  # after the CONNECT's answer
    status, *fields = [line.strip() for line in last.split("\r\n")]
    return status, {name.lower(): value.strip() for name, _, value in (f.partition(":") for f in fields)}


def test_a_replay_frames_a_bodiless_answer_as_the_live_one_was(broker, upstream):
    """A replayed HEAD keeps the length of the representation it describes; a replayed 204 has
    no Content-Length, which an HTTP/2 agent would refuse as a protocol error."""
    for method, url in (("HEAD", "https://bodiless.example.test/h/status?code=200"),
                        ("DELETE", "https://bodiless.example.test/h/status?code=204")):
        k = key()
        status, live = _curl_http2(broker, method, url, k)
        status_again, again = _curl_http2(broker, method, url, k)
        assert status == status_again, (status, status_again)
        assert "affidavit-replayed" not in live and again["affidavit-replayed"] == "true", again
        assert again["affidavit-invocation-id"] == live["affidavit-invocation-id"]
        if method == "HEAD":
            assert status == "HTTP/2 200" and int(live["content-length"]) > 0, live
            assert again["content-length"] == live["content-length"], (live, again)
        else:
            assert status == "HTTP/2 204" and "content-length" not in live and "content-length" not in again, again
    assert [r.method for r in sent(upstream)][-2:] == ["HEAD", "DELETE"], "the repeats were replays"


def test_the_same_key_with_a_different_body_is_refused_locally(broker, upstream):
    k = key()
    with broker.client() as client:
        first = post(client, PAY + "/h/idem_strict?code=201", k, b'{"amount":100}')
        changed = post(client, PAY + "/h/idem_strict?code=201", k, b'{"amount":999}')
    assert first.status_code == 201
    assert changed.status_code == 422
    body = check_envelope(changed.content)
    assert body["error"]["code"] == "IDEMPOTENCY_MISMATCH" and body["error"]["outcome"] == "not_attempted"
    assert body["invocation_id"] == first.headers["affidavit-invocation-id"]
    assert len(sent(upstream)) == 1 and upstream.effects == 1


def test_a_request_refused_before_its_key_is_bound_leaves_the_key_free(broker, upstream):
    k = key()
    with broker.client() as client:
        refused = client.post(PAY + "/h/idem_honour?code=201", content=b'{"amount":100}',
                              headers={"Idempotency-Key": k, "Authorization": "Bearer mine"})
        corrected = post(client, PAY + "/h/idem_honour?code=201", k)
    body = check_envelope(refused.content)
    assert body["error"]["code"] == "FORBIDDEN_HEADER_OVERRIDE" and body["error"]["retry"] == "after_correction"
    assert body["evidence"]["idempotency"]["key"] is None, "a validation refusal binds no key"
    assert corrected.status_code == 201 and "affidavit-replayed" not in corrected.headers
    assert corrected.headers["affidavit-invocation-id"] != body["invocation_id"]
    assert corrected.headers["affidavit-idempotency-key"] == k
    assert len(sent(upstream)) == 1 and sent(upstream)[0].header("Authorization") != "Bearer mine"


def test_a_repeat_while_in_flight_gets_409_and_sends_nothing(broker, upstream):
    k = key()
    thread, results = post_in_background(broker, PAY + "/h/slow?delay=1.5", k)
    upstream.wait_for_requests(1, timeout=5)
    with broker.client() as client:
        second = post(client, PAY + "/h/slow?delay=1.5", k)
    thread.join(10)
    assert second.status_code == 409
    error = check_envelope(second.content)["error"]
    assert (error["code"], error["outcome"], error["retry"]) == ("IDEMPOTENCY_IN_PROGRESS", "unknown", "same_idempotency_key")
    assert second.headers["affidavit-idempotency-key"] == k, "every answer about a keyed operation names its key"
    assert results["first"].status_code == 200
    assert len(sent(upstream)) == 1 and upstream.effects == 1


def test_a_repeat_while_the_first_is_not_yet_dispatched_is_told_the_effect_is_unknown(make_broker, upstream):
    """The first attempt has not crossed the dispatch boundary yet (it pauses before its
    credential), but it will: the repeat's answer may not say `not_attempted`, which would have
    the agent believe nothing will happen and try a new key (a second effect). It says `unknown`,
    repeat with this same key, and lets an SDK's own retry loop do just that, after a second."""
    broker = make_broker(routes=retry_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "before_credential=pause:2@1"})
    k = key()
    thread, results = post_in_background(broker, PAY + "/h/idem_honour?code=201", k)
    deadline = time.monotonic() + 10
    while not query(broker.database_url, f"SELECT 1 FROM invocations WHERE idempotency_key = '{k}'"):
        assert time.monotonic() < deadline, "the first request's key was never bound"
        time.sleep(0.05)
    with broker.client() as client:
        second = post(client, PAY + "/h/idem_honour?code=201", k)
    assert sent(upstream) == [], "the first attempt was still before its dispatch"
    thread.join(15)
    assert second.status_code == 409, second.text
    envelope = check_envelope(second.content)
    error = envelope["error"]
    assert (error["code"], error["phase"], error["outcome"], error["retry"]) == (
        "IDEMPOTENCY_IN_PROGRESS", "validation", "unknown", "same_idempotency_key")
    assert second.headers["affidavit-outcome"] == "unknown"
    assert (second.headers["x-should-retry"], second.headers["retry-after"]) == ("true", "1")
    assert envelope["invocation_id"] == results["first"].headers["affidavit-invocation-id"]
    assert results["first"].status_code == 201 and upstream.effects_by_key == {k: 1}
    with broker.client() as client:
        again = post(client, PAY + "/h/idem_honour?code=201", k)  # what the answer advised
    assert again.status_code == 201 and again.headers["affidavit-replayed"] == "true"
    assert upstream.effects_by_key == {k: 1}


@pytest.mark.parametrize(("behaviour", "effects"), [("idem_honour", 1), ("idem_ignore", 2), ("idem_strict", 1)])
def test_an_unknown_outcome_under_a_remote_contract_is_resent_with_the_same_key(broker, upstream, behaviour, effects):
    k = key()
    url = f"{PAY}/h/{behaviour}?code=201&lose=1"
    with broker.client() as client:
        lost = post(client, url, k)
        body = check_envelope(lost.content)
        assert (lost.status_code, body["error"]["outcome"], body["error"]["retry"]) == (502, "unknown", "same_idempotency_key")
        assert broker.invocation(body["invocation_id"])["next_action"] == "retry_same_key"
        retried = post(client, url, k)
        replayed = post(client, url, k)
    assert retried.status_code == 201 and retried.headers["affidavit-outcome"] == "committed"
    assert retried.headers["affidavit-invocation-id"] == body["invocation_id"]
    assert replayed.headers["affidavit-replayed"] == "true" and replayed.content == retried.content
    attempts = sent(upstream)
    assert len(attempts) == 2, "one original, one re-send, and the replay never reached the upstream"
    assert {a.header("Idempotency-Key") for a in attempts} == {k}
    assert upstream.effects_by_key[k] == effects
    record = broker.invocation(body["invocation_id"])
    assert record["outcome"] == "committed" and record["retry_budget"]["used"] == 1
    assert [a["n"] for a in record["evidence"]["attempts"]] == [1, 2]
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("DISPATCH_STARTED") == 2 and kinds.count("FAILED") == 1


def test_a_key_sent_in_the_routes_own_contract_header_is_the_agents_key_and_a_retry_stays_one_effect(broker, upstream):
    """An SDK of an API whose contract header is not Idempotency-Key (PayPal-Request-Id, say)
    sends its key there. That key names the operation: the lost answer's same-key repeat is the
    same invocation, re-sent with the agent's key, and the upstream applies it once."""
    k = key()
    url = f"{OWN_HEADER}/h/idem_honour?code=201&lose=1&header=X-Idem"
    with broker.client() as client:
        lost = client.post(url, content=b'{"amount":100}', headers={"X-Idem": k})
        body = check_envelope(lost.content)
        assert (lost.status_code, body["error"]["outcome"], body["error"]["retry"]) == (502, "unknown", "same_idempotency_key")
        assert lost.headers["affidavit-idempotency-key"] == k
        retried = client.post(url, content=b'{"amount":100}', headers={"X-Idem": k})
        both = client.post(url, content=b'{"amount":100}', headers={"X-Idem": k, "Idempotency-Key": k})
        differ = client.post(url, content=b'{"amount":100}', headers={"X-Idem": k, "Idempotency-Key": key()})
    assert retried.status_code == 201 and retried.headers["affidavit-invocation-id"] == body["invocation_id"]
    assert both.headers["affidavit-replayed"] == "true" and both.headers["affidavit-invocation-id"] == body["invocation_id"]
    refused = check_envelope(differ.content)
    assert (differ.status_code, refused["error"]["code"]) == (400, "MALFORMED_REQUEST"), differ.text
    assert "different idempotency keys" in refused["error"]["message"]
    attempts = sent(upstream)
    assert len(attempts) == 2, "the original and its re-send; the replay and the refusal sent nothing"
    assert [a.header("X-Idem") for a in attempts] == [k, k] and all(a.header("Idempotency-Key") is None for a in attempts)
    assert upstream.effects_by_key == {k: 1}
    assert broker.invocation(body["invocation_id"])["idempotency"]["key"] == k


def test_without_a_declared_contract_an_unknown_post_needs_reconciliation(broker, upstream):
    k = key()
    with broker.client() as client:
        lost = post(client, NO_CONTRACT + "/h/close_after_effect", k)
        again = post(client, NO_CONTRACT + "/h/close_after_effect", k)
    assert check_envelope(lost.content)["error"]["retry"] == "reconcile"
    assert lost.headers["affidavit-idempotency-key"] == k, "the first answer names the bound key, as the repeat's does"
    assert again.status_code == 409 and again.headers["affidavit-idempotency-key"] == k
    refused = check_envelope(again.content)
    assert refused["error"]["code"] == "RECONCILE_REQUIRED" and refused["error"]["outcome"] == "unknown"
    assert refused["evidence"]["dispatch_started"] is True
    assert len(sent(upstream)) == 1 and upstream.effects == 1
    # The agent's own key goes upstream as sent; the broker adds no idempotency header itself.
    assert sent(upstream)[0].header("Idempotency-Key") == k


def test_a_route_without_a_contract_never_gets_a_broker_made_key(broker, upstream):
    with broker.client() as client:
        response = post(client, NO_CONTRACT + "/h/ok", None)
    assert response.status_code == 200 and "affidavit-idempotency-key" not in response.headers
    assert sent(upstream)[0].header("Idempotency-Key") is None


def test_a_declared_contract_gets_a_generated_key_the_agent_can_retry_with(broker, upstream):
    with broker.client() as client:
        lost = post(client, PAY + "/h/idem_honour?code=201&lose=1", None)
        body = check_envelope(lost.content)
        generated = lost.headers["affidavit-idempotency-key"]
        assert body["evidence"]["idempotency"]["key"] == generated and generated.startswith("afk_")
        retried = post(client, PAY + "/h/idem_honour?code=201&lose=1", generated)
    assert retried.status_code == 201
    assert retried.headers["affidavit-invocation-id"] == body["invocation_id"]
    assert [a.header("Idempotency-Key") for a in sent(upstream)] == [generated, generated]
    assert upstream.effects == 1


def test_an_idempotent_operation_is_attempted_again(broker, upstream):
    k = key()
    url = PUT + "/h/idem_ignore?code=200&lose=1"
    with broker.client() as client:
        lost = client.put(url, content=b"{}", headers={"Idempotency-Key": k})
        assert check_envelope(lost.content)["error"]["retry"] == "backoff"
        again = client.put(url, content=b"{}", headers={"Idempotency-Key": k})
    assert again.status_code == 200 and again.headers["affidavit-outcome"] == "committed"
    assert upstream.effects == 2 and len(sent(upstream)) == 2
    assert [a.header("Idempotency-Key") for a in sent(upstream)] == [k, k]


def test_an_idempotent_operation_that_used_its_retry_budget_says_reconcile(broker, upstream):
    """Idempotent, so an unknown end may be repeated, but only as often as the budget allows: the
    attempt that used the last of it says reconcile (no x-should-retry), as the record does, and
    not backoff, which would send the caller into the 429 a further repeat gets. Without a key
    there is no budget to use up: a new invocation every time."""
    k = key()
    url = PUT_TIGHT + "/h/idem_ignore?code=200&lose=all"
    with broker.client() as client:
        first = client.put(url, content=b"{}", headers={"Idempotency-Key": k})
        second = client.put(url, content=b"{}", headers={"Idempotency-Key": k})  # the one re-attempt the budget allows
        third = client.put(url, content=b"{}", headers={"Idempotency-Key": k})
        unkeyed = client.put(url, content=b"{}")
    assert (check_envelope(first.content)["error"]["retry"], first.headers["x-should-retry"]) == ("backoff", "true")
    used = check_envelope(second.content)["error"]
    assert (used["outcome"], used["retry"], second.headers["x-should-retry"]) == ("unknown", "reconcile", "false"), used
    assert third.status_code == 429 and check_envelope(third.content)["error"]["code"] == "RETRY_BUDGET_EXHAUSTED"
    record = broker.invocation(check_envelope(first.content)["invocation_id"])
    assert (record["retry"], record["next_action"]) == ("reconcile", "reconcile"), record
    assert record["retry_budget"] == {"budget": 1, "used": 1}
    free = check_envelope(unkeyed.content)["error"]
    assert (free["outcome"], free["retry"], unkeyed.headers["x-should-retry"]) == ("unknown", "backoff", "true"), free
    free_record = broker.invocation(check_envelope(unkeyed.content)["invocation_id"])
    assert (free_record["retry"], free_record["next_action"]) == ("backoff", "retry_new_attempt")
    assert len(sent(upstream)) == 3


def test_a_request_never_sent_that_used_its_retry_budget_stops_backing_off(broker, upstream):
    """Nothing was ever sent (the upstream refuses connections), so waiting may cure it, but only
    while the key has attempts left: the attempt that used the last of them says after_correction
    (no x-should-retry), as the record does, not backoff into the 429 a further repeat gets."""
    k = key()
    url = "https://refused-tight.example.test/h/ok"
    with broker.client() as client:
        first = post(client, url, k)
        second = post(client, url, k)  # the one re-attempt the budget allows
        third = post(client, url, k)
    refused = check_envelope(first.content)["error"]
    assert (refused["code"], refused["retry"], first.headers["x-should-retry"]) == ("CONNECT_REFUSED", "backoff", "true")
    used = check_envelope(second.content)["error"]
    assert (used["code"], used["outcome"], used["retry"], second.headers["x-should-retry"]) == (
        "CONNECT_REFUSED", "not_attempted", "after_correction", "false"), used
    assert "Retrying later is safe" not in used["message"] and "used the last of its Idempotency-Key's retry budget" in used["message"]
    assert "Retrying later is safe" in refused["message"]
    exhausted = check_envelope(third.content)["error"]
    assert third.status_code == 429 and exhausted["code"] == "RETRY_BUDGET_EXHAUSTED"
    # Nothing to reconcile (an operator's reconcile refuses a record never sent): a new key is safe.
    assert "send the operation again with a new key" in exhausted["message"] and "reconcile" not in exhausted["message"]
    record = broker.invocation(check_envelope(first.content)["invocation_id"])
    assert (record["retry"], record["next_action"], record["retry_budget"]) == (
        "after_correction", "stop_for_correction", {"budget": 1, "used": 1}), record
    assert sent(upstream) == []


def test_after_the_retention_window_resends_stop(broker, upstream):
    k = key()
    url = SHORT + "/h/idem_honour?lose=1"
    with broker.client() as client:
        lost = post(client, url, k)
        assert check_envelope(lost.content)["error"]["retry"] == "same_idempotency_key"
        time.sleep(1.3)
        late = post(client, url, k)
    assert late.status_code == 409
    assert check_envelope(late.content)["error"]["code"] == "RECONCILE_REQUIRED"
    record = broker.invocation(check_envelope(lost.content)["invocation_id"])
    assert record["retry"] == "reconcile" and record["next_action"] == "reconcile"
    assert len(sent(upstream)) == 1


def test_the_retry_budget_is_durable_across_a_restart(broker, upstream):
    k = key()
    url = TIGHT + "/h/idem_ignore?lose=all"
    with broker.client() as client:
        first = post(client, url, k)
        second = post(client, url, k)  # the one re-send the budget allows
        third = post(client, url, k)
    assert check_envelope(first.content)["error"]["retry"] == "same_idempotency_key"
    # The re-send that used the budget up: another repeat could only be refused, so it says so.
    assert (check_envelope(second.content)["error"]["outcome"], check_envelope(second.content)["error"]["retry"]) == ("unknown", "reconcile")
    exhausted = check_envelope(third.content)
    assert third.status_code == 429 and exhausted["error"]["code"] == "RETRY_BUDGET_EXHAUSTED"
    assert exhausted["evidence"]["dispatch_started"] is True and len(exhausted["evidence"]["attempts"]) == 2
    assert "Its effect is unknown: reconcile it" in exhausted["error"]["message"], exhausted
    broker.stop()
    broker.start()
    with broker.client() as client:
        after = post(client, url, k)
    assert after.status_code == 429 and check_envelope(after.content)["error"]["code"] == "RETRY_BUDGET_EXHAUSTED"
    assert len(sent(upstream)) == 2
    invocation_id = check_envelope(first.content)["invocation_id"]
    assert query(broker.database_url, f"SELECT generation, retry_budget FROM invocations WHERE invocation_id = '{invocation_id}'") == [("1", "1")]
    record = broker.invocation(invocation_id)
    assert (record["retry"], record["next_action"]) == ("reconcile", "reconcile"), "not retry_same_key: that repeat gets a 429"
    assert record["retry_budget"] == {"budget": 1, "used": 1}


# -- several brokers, one PostgreSQL -----------------------------------------------------------


def _unknown_invocation(broker: BrokerProcess, k: str, url: str) -> str:
    with broker.client() as client:
        lost = post(client, url, k)
    body = check_envelope(lost.content)
    assert body["error"]["outcome"] == "unknown"
    return body["invocation_id"]


def test_twenty_concurrent_retries_over_three_brokers_send_exactly_one(make_broker, upstream):
    routes = retry_routes(upstream)
    a = make_broker("postgresql", routes=routes)
    b = make_broker(routes=routes, like=a)
    c = make_broker(routes=routes, like=a)
    k = key()
    gate = "g_" + k
    url = PAY + f"/h/idem_honour?code=201&lose=1&gate={gate}"  # the re-send waits at the gate
    invocation_id = _unknown_invocation(a, k, url)
    clients = [broker.client() for broker in (a, b, c)]
    barrier = threading.Barrier(20)

    def retry(n: int) -> httpx.Response:
        barrier.wait(10)
        return post(clients[n % 3], url, k)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(retry, n) for n in range(20)]
        deadline = time.monotonic() + 15
        while len(sent(upstream)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let every retry reach its broker while the re-send is held
        upstream.open_gate(gate)
        answers = [f.result(30) for f in futures]
    for client in clients:
        client.close()
    assert all(r.headers["affidavit-invocation-id"] == invocation_id for r in answers)
    fresh = [r for r in answers if r.status_code == 201 and "affidavit-replayed" not in r.headers]
    assert len(fresh) == 1, sorted(r.status_code for r in answers)
    for r in answers:
        if r is not fresh[0]:
            in_progress = r.status_code == 409 and check_envelope(r.content)["error"]["code"] == "IDEMPOTENCY_IN_PROGRESS"
            replayed = r.status_code == 201 and r.headers.get("affidavit-replayed") == "true"
            assert in_progress or replayed, (r.status_code, r.text)
    assert [r.status_code for r in answers].count(409) >= 10, "the retries overlapped the held re-send"
    assert len(sent(upstream)) == 2, "exactly one re-send reached the upstream"
    assert upstream.effects_by_key[k] == 1
    # Afterwards any replica replays it.
    for broker in (a, b, c):
        with broker.client() as client:
            replay = post(client, url, k)
        assert replay.status_code == 201 and replay.headers["affidavit-replayed"] == "true"
    assert len(sent(upstream)) == 2


def test_a_stale_lease_holder_is_fenced_before_it_dispatches(make_broker, upstream):
    routes = retry_routes(upstream)
    stale = make_broker("postgresql", routes=routes, env={"AFFIDAVIT_FAILPOINTS": "after_lease=pause:3@1"}, proxy={"retry_lease": "1s"})
    fresh = make_broker(routes=routes, like=stale, proxy={"retry_lease": "1s"})
    k = key()
    url = PAY + "/h/idem_honour?code=201&lose=1"
    invocation_id = _unknown_invocation(fresh, k, url)
    outcome: dict[str, httpx.Response] = {}

    def through_stale() -> None:
        with stale.client() as client:
            outcome["stale"] = post(client, url, k)

    thread = threading.Thread(target=through_stale)
    thread.start()
    time.sleep(1.6)  # the stale broker holds the lease, paused; the lease runs out
    with fresh.client() as client:
        won = post(client, url, k)
    thread.join(15)
    assert won.status_code == 201
    lost = outcome["stale"]
    assert lost.status_code == 409
    assert check_envelope(lost.content)["error"]["code"] == "LEASE_LOST"
    # what the record said when this attempt began (an earlier attempt was dispatched)
    assert lost.headers["Affidavit-Outcome"] == check_envelope(lost.content)["error"]["outcome"] == "unknown"
    assert len(sent(upstream)) == 2, "the stale broker sent nothing"
    record = fresh.invocation(invocation_id)
    assert record["outcome"] == "committed"
    assert [e["kind"] for e in record["events"]].count("DISPATCH_STARTED") == 2
    assert record["retry_budget"]["used"] == 2


@pytest.mark.parametrize(("dispatches", "refused_dispatch", "outcome"), [
    (0, False, "not_attempted"),  # fenced before any dispatch (a first attempt's hold, say)
    (1, True, "not_attempted"),  # the one dispatch counted is the refused write itself
    (1, False, "unknown"),  # an earlier attempt was dispatched; this one was fenced at its hold
    (2, True, "unknown"),
])
def test_lease_lost_says_what_earlier_attempts_prove(dispatches, refused_dispatch, outcome):
    """Both places a fence refuses: at dispatch (the record in memory holds the refused
    DISPATCH_STARTED) and at a re-send's hold for approval (it does not)."""
    from types import SimpleNamespace

    from proxy.broker import Broker
    from proxy.contract import Record

    entry = SimpleNamespace(invocation_id="act_" + "0" * 26, record=Record(dispatch_count=dispatches))
    reply = Broker._lease_lost(None, entry, refused_dispatch=refused_dispatch)  # type: ignore[arg-type]
    assert dict(reply.headers)["Affidavit-Outcome"] == outcome
    body = check_envelope(reply.body)
    assert body["error"]["outcome"] == outcome
    assert body["evidence"]["dispatch_started"] is (outcome == "unknown"), "the evidence agrees with the outcome"


def test_a_lease_that_ran_out_with_nobody_taking_it_is_renewed_by_its_holder(make_broker, upstream):
    """A stall past the lease with no competitor: nobody took the invocation (its generation is
    still this attempt's), so the holder renews its lease at the dispatch write and sends, once.
    A competitor that took it meanwhile fences it instead (the test above)."""
    routes = retry_routes(upstream)
    slow = make_broker("postgresql", routes=routes, env={"AFFIDAVIT_FAILPOINTS": "after_lease=pause:1.5@1"}, proxy={"retry_lease": "0.5s"})
    k = key()
    url = PAY + "/h/idem_honour?code=201&lose=1"
    invocation_id = _unknown_invocation(slow, k, url)
    with slow.client() as client:
        late = post(client, url, k)
    assert late.status_code == 201, late.text
    assert len(sent(upstream)) == 2 and upstream.effects_by_key[k] == 1
    record = slow.invocation(invocation_id)
    assert (record["outcome"], record["retry_budget"]["used"]) == ("committed", 1), record
    assert "lease was running out before dispatch and nobody had taken it; renewed" in slow.logs()


def test_a_broker_killed_after_taking_a_lease_leaves_budget_and_generation_intact(make_broker, upstream):
    routes = retry_routes(upstream)
    doomed = make_broker("postgresql", routes=routes, env={"AFFIDAVIT_FAILPOINTS": "after_lease=kill"}, proxy={"retry_lease": "1s"})
    k = key()
    url = PAY + "/h/idem_honour?code=201&lose=1"
    invocation_id = _unknown_invocation(doomed, k, url)
    with doomed.client() as client:
        with pytest.raises(httpx.HTTPError):
            post(client, url, k)
    doomed.kill()
    columns = "generation, retry_budget, outcome, stage"
    row = query(doomed.database_url, f"SELECT {columns} FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert row[0][0] == "1" and row[0][2:] == ("unknown", "ended_unknown"), row
    # The killed broker comes back: its start-up recovery resets neither the generation nor the budget.
    doomed.env.pop("AFFIDAVIT_FAILPOINTS")
    doomed.start()
    assert query(doomed.database_url, f"SELECT {columns} FROM invocations WHERE invocation_id = '{invocation_id}'") == row
    assert doomed.invocation(invocation_id)["retry_budget"]["used"] == 1
    survivor = make_broker(routes=routes, like=doomed, proxy={"retry_lease": "1s"})
    time.sleep(1.1)  # the dead broker's lease runs out
    with survivor.client() as client:
        retried = post(client, url, k)
    assert retried.status_code == 201
    assert query(doomed.database_url, f"SELECT generation FROM invocations WHERE invocation_id = '{invocation_id}'") == [("2",)]
    assert survivor.invocation(invocation_id)["retry_budget"]["used"] == 2
    assert len(sent(upstream)) == 2 and upstream.effects_by_key[k] == 1
