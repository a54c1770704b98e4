"""The HTTP evidence contract against a hostile upstream: one test per fault, each injected.

Every test drives a real client through a real broker (both journal dialects) to the hostile
upstream and asserts three things: the record (phase, outcome, code, retry, evidence), what the
client got (envelope or response), and what the upstream actually received and applied.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.canaries import CANARIES
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.h2agent import H2Agent
from tests.support.hostile import HostileUpstream, free_port

H = "https://hostile.example.test"
PLAIN = "http://hostile-plain.example.test"


def hostile_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    fast = {"connect_timeout": "1s", "response_timeout": "1s", "result_horizon": "3s"}
    plain_route = {"port": 80, "scheme": "http", "connect_to": f"127.0.0.1:{up.http_port}"}
    every = ["GET", "HEAD", "POST", "PUT", "DELETE"]
    credential = {"credential": "payments-key", "inject": {"header": "Authorization", "value": "Bearer {secret}"}}
    return [
        {"name": "h.tls", "host": "hostile.example.test", "methods": every, "agents": ["builder"], "connect_to": good, **credential, **fast},
        {"name": "h.plain", "host": "hostile-plain.example.test", "methods": every, "agents": ["builder"], **plain_route, **fast},
        {"name": "h.slow", "host": "slow.example.test", "methods": every, "agents": ["builder"], "connect_to": good,
         "response_timeout": "10s", "result_horizon": "4s"},
        {"name": "h.other", "host": "other.example.test", "methods": every, "agents": ["builder"], "connect_to": good},
        {"name": "h.dns", "host": "nxdomain.invalid", "methods": every, "agents": ["builder"], **fast},
        {"name": "h.refused", "host": "refused.example.test", "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{free_port()}", **fast},
        {"name": "h.untrusted", "host": "untrusted.example.test", "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('untrusted')}", **fast},
        {"name": "h.expired", "host": "expired.example.test", "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('expired')}", **fast},
        {"name": "h.wronghost", "host": "wronghost.example.test", "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('wrong_host')}", **fast},
        {"name": "h.big", "host": "big.example.test", "methods": every, "agents": ["builder"], "connect_to": good, "max_body": "64MiB"},
        {"name": "h.stall", "host": "stall.example.test", "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_stall_port}", **fast},
    ]


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI, upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, hostile_routes(upstream_server), name="hostile")


def envelope_of(response: httpx.Response, status: int, code: str, phase: str, outcome: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = check_envelope(response.content)
    assert (body["error"]["code"], body["error"]["phase"], body["error"]["outcome"]) == (code, phase, outcome)
    assert response.headers["affidavit-invocation-id"] == body["invocation_id"]
    assert response.headers["affidavit-outcome"] == outcome
    assert CANARIES["PAYMENTS_KEY"] not in response.text
    return body


def record_of(broker: BrokerProcess, invocation_id: str, ended: bool = True) -> dict[str, Any]:
    if ended:
        return broker.wait_for(invocation_id, lambda r: r["retry"] is not None and r["stage"] not in ("committed", "dispatched"))
    return broker.invocation(invocation_id, broker.operator_token)


def kinds(record: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in record["events"]]


# -- connection setup: nothing crosses the boundary ----------------------------------------


@pytest.mark.parametrize(
    ("url", "code", "stage", "status", "retry"),
    [
        ("https://nxdomain.invalid/h/ok", "DNS_FAILED", "dns", 502, "backoff"),
        ("https://refused.example.test/h/ok", "CONNECT_REFUSED", "tcp_connect", 502, "backoff"),
        ("https://untrusted.example.test/h/ok", "TLS_CERT_UNTRUSTED", "tls_handshake", 502, "after_correction"),
        ("https://expired.example.test/h/ok", "TLS_CERT_EXPIRED", "tls_handshake", 502, "after_correction"),
        ("https://wronghost.example.test/h/ok", "TLS_HOSTNAME_MISMATCH", "tls_handshake", 502, "after_correction"),
        ("https://stall.example.test/h/ok", "CONNECT_TIMEOUT", "tls_handshake", 504, "backoff"),
    ],
)
def test_connection_setup_failures_are_not_attempted(broker, upstream, url, code, stage, status, retry):
    with broker.client() as client:
        started = time.monotonic()
        response = client.post(url, content=b'{"charge":1}')
        elapsed = time.monotonic() - started
    body = envelope_of(response, status, code, "connection_setup", "not_attempted")
    assert body["error"]["retry"] == retry
    assert response.headers["x-should-retry"] == ("true" if retry == "backoff" else "false")
    assert body["evidence"]["dispatch_started"] is False
    assert body["evidence"]["attempts"] == [{"n": 1, "stage": stage, "code": code}]
    record = record_of(broker, body["invocation_id"])
    assert "DISPATCH_STARTED" not in kinds(record)
    assert kinds(record)[-2:] == ["CONNECTION_ATTEMPT", "FAILED"]
    with broker.operator() as api:
        detail = api.get(f"/v1/invocations/{body['invocation_id']}").json()
    assert detail["events"][-2]["data"]["diagnostic"], "the library's text stays in the internal field"
    with broker.api() as api:
        agent_view = api.get(f"/v1/invocations/{body['invocation_id']}").json()
    assert "diagnostic" not in agent_view["events"][-2]["data"]
    assert upstream.effects == 0 and [r for r in upstream.received if r.method] == []
    if code.startswith("TLS_CERT") or code == "TLS_HOSTNAME_MISMATCH":
        assert upstream.tls_errors, "the upstream saw the broker refuse its certificate"
        # The setting an operator can change; routes have no ca_bundle (one is refused at start).
        assert "([upstream] ca_bundle)" in body["error"]["message"], body
    assert elapsed < 5


# -- after the boundary, no complete response: unknown --------------------------------------


@pytest.mark.parametrize(
    ("path", "code", "headers_received"),
    [
        ("/h/close_after_effect", "REMOTE_OUTCOME_UNKNOWN", False),
        ("/h/close_mid_headers", "REMOTE_OUTCOME_UNKNOWN", False),
        ("/h/short_body", "REMOTE_RESULT_INCOMPLETE", True),
        ("/h/chunked_truncated", "REMOTE_RESULT_INCOMPLETE", True),
        # Over TLS only close_notify proves a close-delimited body ended: a bare TCP FIN in its
        # place may be anyone's truncation.
        ("/h/close_delimited?cut=1", "REMOTE_RESULT_INCOMPLETE", True),
        ("/h/continue_close", "REMOTE_OUTCOME_UNKNOWN", False),
        # RFC 9110 15: a status is 100 to 599; neither an agent's client nor a replay could carry 999.
        ("/h/status?code=999", "REMOTE_OUTCOME_UNKNOWN", False),
        # A complete answer whose head is over the 64 KiB the broker reads: not a broken connection.
        ("/h/status?pad=70000", "RESULT_TOO_LARGE", False),
    ],
)
def test_broken_exchanges_after_dispatch_are_unknown(broker, upstream, path, code, headers_received):
    with broker.client() as client:
        response = client.post(H + path, content=b'{"charge":1}')
    body = envelope_of(response, 502, code, "remote_execution", "unknown")
    assert body["error"]["retry"] == "reconcile", "a POST without a declared contract must not be re-sent"
    assert response.headers["x-should-retry"] == "false", "SDK retry loops must not re-send it either"
    evidence = body["evidence"]
    assert evidence["dispatch_started"] is True and evidence["request_complete"] is True
    assert evidence["response_headers_received"] is headers_received
    assert evidence["response_complete"] is False
    record = record_of(broker, body["invocation_id"])
    assert record["outcome"] == "unknown" and record["code"] == code
    assert record["next_action"] == "reconcile"
    head_too_large = "head (its status line and header fields) is larger than the broker reads (65536 bytes)"
    assert (head_too_large in body["error"]["message"]) is (code == "RESULT_TOO_LARGE"), body["error"]["message"]
    assert "REMOTE_RESPONSE_COMPLETE" not in kinds(record) and "RESULT_COMMITTED" not in kinds(record)
    with broker.api() as api:
        fetched = api.get(f"/v1/invocations/{body['invocation_id']}/result")
    assert fetched.status_code == 409
    assert check_envelope(fetched.content)["error"]["outcome"] == "unknown"
    # The partial body is never served as the result, anywhere.
    for partial in (b'"partial"', b'"chunk"', b"appl"):
        assert partial not in response.content and partial not in fetched.content
    assert upstream.effects == 1
    assert len([r for r in upstream.received if r.method]) == 1, "no silent re-send"


def test_a_get_that_breaks_on_a_reused_connection_is_not_silently_resent(broker, upstream):
    with broker.client() as client:
        first = client.get(H + "/h/ok")
        assert first.status_code == 200
        response = client.get(H + "/h/close_after_effect")
    body = envelope_of(response, 502, "REMOTE_OUTCOME_UNKNOWN", "remote_execution", "unknown")
    assert body["error"]["retry"] == "backoff", "GET is idempotent by default: a new attempt is safe"
    assert body["evidence"]["attempts"][0]["connection"] == "reused"
    assert upstream.effects == 2
    assert [r.path for r in upstream.received if r.method] == ["/h/ok", "/h/close_after_effect"]


def test_a_body_a_naive_upstream_left_unread_never_reaches_another_agents_request(make_broker, upstream):
    """The upstream answers 200 before reading a request's body and keeps the connection, so the
    body is read as the start of whatever is sent next on it. One agent's body (a request its
    route forbids) must not become another agent's request, carrying that agent's credential:
    pooled connections are never shared across agents or routes."""
    shared = {"host": "shared.example.test", "port": 80, "scheme": "http", "connect_to": f"127.0.0.1:{upstream.http_port}"}
    broker = make_broker(routes=[
        {"name": "open", **shared, "methods": ["POST"], "path": "/h/early_ok", "agents": ["builder"]},
        {"name": "admin", **shared, "methods": ["GET"], "path": "/h/ok", "agents": ["reviewer"],
         "credential": "payments-key", "inject": {"header": "X-Api-Key", "value": "{secret}"}},
    ])
    smuggled = b"GET /h/ok?smuggled=1 HTTP/1.1\r\nHost: shared.example.test\r\nX-Pad: "
    with broker.client("builder") as builder:
        assert builder.post("http://shared.example.test/h/early_ok", content=smuggled).status_code == 200
    with broker.client("reviewer") as reviewer:
        answer = reviewer.get("http://shared.example.test/h/ok")
    assert answer.status_code == 200 and "smuggled" not in answer.text, answer.text
    assert json.loads(answer.text)["path"] == "/h/ok", "the reviewer got the answer to its own request"
    keyed = [r for r in upstream.received if r.header("X-Api-Key")]
    assert [(r.path, r.header("X-Api-Key")) for r in keyed] == [("/h/ok", CANARIES["PAYMENTS_KEY"])], keyed
    assert len({r.conn_id for r in upstream.received if r.method}) == 2, "the reviewer's request went on its own connection"


def test_a_connection_the_server_closed_while_idle_is_not_reused(broker, upstream):
    with broker.client() as client:
        assert client.get(H + "/h/idle_close?after=0.2").status_code == 200
        time.sleep(0.8)
        response = client.get(H + "/h/status?code=200")
    assert response.status_code == 200
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed"
    conns = {r.conn_id for r in upstream.received}
    assert len(conns) == 2, "the stale connection was not written to"


def test_no_answer_within_the_response_timeout_is_unknown_and_timed_out(broker, upstream):
    with broker.client() as client:
        started = time.monotonic()
        response = client.post(PLAIN + "/h/hang", content=b"{}")
        waited = time.monotonic() - started
    body = envelope_of(response, 504, "REMOTE_OUTCOME_UNKNOWN", "remote_execution", "unknown")
    assert body["evidence"]["timeout"] == "response"
    assert body["evidence"]["dispatch_started"] is True
    assert 0.9 < waited < 5
    record = broker.wait_for(body["invocation_id"], lambda r: r["stage"] == "ended_unknown", timeout=10)
    assert record["caller_disposition"] == "timed_out"
    assert record["outcome"] == "unknown" and record["retry"] == "reconcile"
    assert upstream.effects == 1


def test_a_slow_answer_records_each_step_once_and_a_quick_one_only_its_end(broker, upstream):
    """Slow: the request's last byte left, then the upstream's headers came, then its body; each
    step is on the record as it happens (once it has taken a moment), and only once. Quick: the
    complete answer implies both, so neither is written."""
    with broker.client() as client:
        slow = client.post(PLAIN + "/h/slow?delay=0.8", content=b"{}")
        quick = client.post(PLAIN + "/h/ok", content=b"{}")
    assert slow.status_code == quick.status_code == 200
    steps = ("DISPATCH_STARTED", "REQUEST_SENT", "REMOTE_RESPONSE_STARTED", "REMOTE_RESPONSE_COMPLETE", "RESULT_COMMITTED")
    record = record_of(broker, slow.headers["affidavit-invocation-id"])
    assert [k for k in kinds(record) if k in steps] == list(steps), kinds(record)
    assert record["outcome"] == "committed" and record["evidence"]["dispatch"] == "remote_acknowledged"
    record = record_of(broker, quick.headers["affidavit-invocation-id"])
    assert "REQUEST_SENT" not in kinds(record) and "REMOTE_RESPONSE_STARTED" not in kinds(record), kinds(record)


def test_a_late_result_after_the_response_timeout_becomes_fetchable(broker, upstream):
    with broker.client() as client:
        response = client.post(PLAIN + "/h/slow?delay=1.8", content=b"{}")
    body = envelope_of(response, 504, "REMOTE_OUTCOME_UNKNOWN", "remote_execution", "unknown")
    # Still in flight: no result yet, and nothing that reads as "send the POST again".
    with broker.api() as api:
        early = api.get(f"/v1/invocations/{body['invocation_id']}/result")
    assert early.status_code == 409 and early.headers["x-should-retry"] == "false", early.headers
    pending = check_envelope(early.content)
    assert (pending["error"]["outcome"], pending["error"]["retry"]) == ("unknown", "fetch_result"), pending
    assert "in flight" in pending["error"]["message"]
    record = broker.wait_for(body["invocation_id"], lambda r: r["stage"] == "delivery_failed", timeout=10)
    assert record["caller_disposition"] == "timed_out", "the caller's timed-out wait is never rewritten"
    assert record["outcome"] == "committed" and record["retry"] == "fetch_result"
    with broker.api() as api:
        fetched = api.get(f"/v1/invocations/{body['invocation_id']}/result")
    assert fetched.status_code == 200 and fetched.json()["path"] == "/h/slow?delay=1.8"
    assert upstream.effects == 1


# -- complete responses decide the outcome ----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "query", "outcome", "retry"),
    [
        ("POST", "code=500", "committed", "never"),
        ("POST", "code=200", "committed", "never"),
        ("GET", "code=401", "rejected", "after_correction"),
        ("POST", "code=403", "rejected", "after_correction"),
        ("GET", "code=429&retry_after=7", "rejected", "backoff"),
        ("GET", "code=503&retry_after=3", "rejected", "backoff"),
        ("POST", "code=429&retry_after=7", "rejected", "never"),
        ("POST", "code=503&retry_after=3", "rejected", "never"),
        ("GET", "code=429", "rejected", "never"),
        ("POST", "code=422", "rejected", "after_correction"),
    ],
)
def test_a_complete_final_response_is_the_result(broker, upstream, method, query, outcome, retry):
    with broker.client() as client:
        response = client.request(method, f"{H}/h/status?{query}", content=b"{}" if method == "POST" else None)
    status = int(query.split("&")[0].split("=")[1])
    assert response.status_code == status
    assert response.headers["affidavit-outcome"] == outcome
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert (record["outcome"], record["retry"], record["code"]) == (outcome, retry, None)
    assert record["evidence"]["response_complete"] is True and record["evidence"]["status"] == status
    assert record["evidence"]["certainty"] == "remote_response"
    if "retry_after" in query:
        assert record["evidence"]["retry_after"] == float(query.rsplit("=", 1)[1])
    if status == 500:
        assert record["next_action"] == "return_recorded_result"
    with broker.api() as api:
        replay = api.get(f"/v1/invocations/{record['invocation_id']}/result")
    assert replay.status_code == status and replay.content == response.content
    assert upstream.effects == 1


@pytest.mark.parametrize("query", ["code=503&retry_after=%C2%B2", "code=202&nest=100000"])
def test_evidence_the_broker_cannot_read_does_not_cost_the_result(broker, upstream, query):
    """A Retry-After of a digit that is not ASCII ('²', which str.isdigit() takes), a 202 whose JSON
    is nested past the parser's depth: the evidence is left out, the complete answer is the result."""
    with broker.client() as client:
        response = client.post(f"{H}/h/status?{query}", content=b"{}")
    status = int(query.split("&")[0].split("=")[1])
    assert response.status_code == status, response.text
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == ("rejected" if status == 503 else "committed") and record["evidence"]["response_complete"] is True
    assert "retry_after" not in record["evidence"] and "job_ref" not in record["evidence"]
    with broker.api() as api:
        assert api.get(f"/v1/invocations/{record['invocation_id']}/result").status_code == status


def test_a_202_records_the_job_reference_and_is_not_done(broker, upstream):
    with broker.client() as client:
        response = client.post(f"{H}/h/status?code=202&job=job-7&location=/jobs/job-7", content=b"{}")
    assert response.status_code == 202 and response.headers["location"] == "/jobs/job-7"
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed" and record["retry"] == "never"
    assert record["evidence"]["location"] == "/jobs/job-7"
    assert record["evidence"]["job_ref"] == "job-7"


def test_a_job_id_no_text_encoding_can_store_is_kept_replaced_and_the_answer_recorded(broker, upstream):
    """JSON can escape a lone surrogate; no encoding of text can store one. The answer is still
    the result (not a 500 that leaves the record in flight for good), its job id with U+FFFD."""
    with broker.client() as client:
        response = client.post(f"{H}/h/status?code=202&surrogate=1", content=b"{}")
    assert response.status_code == 202 and response.headers["affidavit-outcome"] == "committed", response.text[:300]
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed" and record["evidence"]["job_ref"] == "job-\ufffd-7", record["evidence"]


def test_100_continue_then_a_final_response_is_decided_by_the_final_one(broker, upstream):
    with broker.client() as client:
        response = client.post(f"{H}/h/continue_final?code=201", content=b'{"x":1}')
    assert response.status_code == 201
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed" and record["evidence"]["status"] == 201


def test_an_early_answer_is_the_result_and_says_the_request_was_not_taken_whole(broker, upstream):
    """An upstream that refuses after the head and stops reading: its 413 is the result, but the
    record must not claim the request reached it whole (40 MB: more than loopback buffers hold)."""
    with broker.client() as client:
        response = client.post("https://big.example.test/h/early_answer", content=b"x" * (40 * 1024 * 1024))
    assert response.status_code == 413 and response.headers["affidavit-outcome"] == "rejected"
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "rejected" and record["evidence"]["response_complete"] is True
    assert record["evidence"]["request_complete"] is False
    with broker.client() as client:  # the connection with the rest of the body queued is not reused
        assert client.get("https://big.example.test/h/ok").status_code == 200


def test_a_connection_whose_answer_came_before_the_body_was_read_is_not_reused(broker, upstream):
    """The upstream refuses from the head alone and keeps the connection open, the small body
    unread in its socket (the kernel took it all: the broker's write completed). Reusing that
    connection would put the next request behind those bytes, and lose it in the reset that ends
    such a connection: an unknown outcome for a request that never reached the application."""
    with broker.client() as client:
        refused = client.post(H + "/h/early_answer?hold=3", content=b"x" * 10_000)
        nxt = client.post(H + "/h/ok", content=b'{"charge":1}')
    assert refused.status_code == 413 and refused.headers["affidavit-outcome"] == "rejected"
    assert nxt.status_code == 200 and nxt.headers["affidavit-outcome"] == "committed", nxt.text[:500]
    record = record_of(broker, nxt.headers["affidavit-invocation-id"])
    assert record["evidence"]["attempts"][0]["connection"] == "new", record["evidence"]["attempts"]
    assert upstream.effects == 1
    with broker.client() as client:  # a 2xx answer took the body: that connection is reused
        first = client.post(H + "/h/ok", content=b"x" * 10_000)
        second = client.post(H + "/h/ok", content=b"{}")
    record = record_of(broker, second.headers["affidavit-invocation-id"])
    assert (first.status_code, second.status_code) == (200, 200)
    assert record["evidence"]["attempts"][0]["connection"] == "reused", record["evidence"]["attempts"]


def test_close_delimited_body_is_complete_but_marked_as_weaker_framing(broker, upstream):
    with broker.client() as client:
        response = client.get(f"{H}/h/close_delimited")
    assert response.status_code == 200
    record = record_of(broker, response.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed" and record["evidence"]["framing"] == "close"


def test_a_redirect_to_another_origin_is_a_new_invocation_without_the_credential(broker, upstream):
    target = "https://other.example.test/h/status?code=200"
    done = broker.curl(f"{H}/h/redirect?to={target}", "-L", "-X", "GET")
    assert done.returncode == 0, done.stderr
    ids = [line.split(b":", 1)[1].strip().decode() for line in done.stdout.split(b"\r\n") if line.lower().startswith(b"affidavit-invocation-id")]
    assert len(ids) == 2 and ids[0] != ids[1]
    first, second = (record_of(broker, i) for i in ids)
    assert first["route"] == "h.tls" and first["outcome"] == "committed" and first["evidence"]["status"] == 307
    assert first["evidence"]["location"] == target
    assert second["route"] == "h.other" and second["outcome"] == "committed"
    assert second["credential"]["id"] is None
    hop1, hop2 = [r for r in upstream.received if r.method]
    assert hop1.header("Authorization") == f"Bearer {CANARIES['PAYMENTS_KEY']}"
    assert hop2.header("Authorization") is None and hop2.sni == "other.example.test"


def test_a_redirect_to_an_origin_without_a_route_is_refused_before_anything_is_sent(broker, upstream):
    done = broker.curl(f"{H}/h/redirect?to=https://elsewhere.example.test/steal", "-L")
    assert done.returncode == 0, done.stderr
    assert b"INVALID_TARGET" in done.stdout
    assert len([r for r in upstream.received if r.method]) == 1


# -- the caller leaves -------------------------------------------------------------------------


def _latest(broker: BrokerProcess, route: str) -> dict[str, Any]:
    with broker.operator() as api:
        return api.get("/v1/invocations", params={"route": route, "limit": 1}).json()["items"][0]


def test_a_caller_that_gives_up_still_gets_a_late_result_fetched(broker, upstream):
    done = broker.curl("https://slow.example.test/h/slow?delay=1.5", "-X", "POST", "-d", "{}", timeout=0.5)
    assert done.returncode == 28, "curl gave up (timeout)"
    invocation_id = _latest(broker, "h.slow")["invocation_id"]
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivery_failed", timeout=10)
    assert record["caller_disposition"] == "disconnected"
    assert record["outcome"] == "committed"
    assert record["retry"] == "fetch_result" and record["next_action"] == "fetch_result"
    assert record["phase"] == "result_delivery" and record["code"] == "CALLER_CANCELLED"
    assert "CALLER_CANCELLED" in kinds(record)
    with broker.api() as api:
        fetched = api.get(f"/v1/invocations/{invocation_id}/result")
    assert fetched.status_code == 200 and fetched.json()["path"] == "/h/slow?delay=1.5"
    assert upstream.effects == 1
    # Fetching it was the delivery: the hint moves on, the caller's disposition does not.
    fetched_record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered" and r["replays"] >= 1)
    assert fetched_record["retry"] == "never" and fetched_record["caller_disposition"] == "disconnected"
    assert fetched_record["replays"] == 1 and fetched_record["events"][-1]["data"]["channel"] == "side_api"


def test_a_caller_that_gives_up_on_a_silent_upstream_leaves_an_unknown_record(broker, upstream):
    done = broker.curl("https://slow.example.test/h/hang", "-X", "POST", "-d", "{}", timeout=0.5)
    assert done.returncode == 28
    invocation_id = _latest(broker, "h.slow")["invocation_id"]
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown", timeout=10)
    assert record["caller_disposition"] == "disconnected"
    assert record["outcome"] == "unknown" and record["retry"] == "reconcile"
    assert upstream.effects == 1


def _http2_exchange_left(broker: BrokerProcess, upstream: HostileUpstream, leave: str) -> tuple[dict[str, Any], float, str]:
    """An HTTP/2 agent sends a slow request and a shorter one on one connection, then abandons the
    slow one (``reset``: RST_STREAM on its stream; ``close``: its whole connection) while the
    upstream still works on it. Returns the slow one's record once the caller's wait is recorded,
    the seconds that took, and the other stream's invocation id (empty if closed with it)."""
    with H2Agent(broker, "slow.example.test") as agent:
        slow = agent.request("POST", "/h/slow?delay=2.5", b'{"charge":1}')
        other = agent.request("GET", "/h/slow?delay=1.2")
        upstream.wait_for_requests(2)
        time.sleep(0.3)
        if leave == "reset":
            agent.reset(slow)
        else:
            agent.close()
        left_at = time.monotonic()
        with broker.operator() as api:
            items = api.get("/v1/invocations", params={"route": "h.slow", "limit": 2}).json()["items"]
        slow_id = next(i["invocation_id"] for i in items if i["method"] == "POST")
        record = broker.wait_for(slow_id, lambda r: r["caller_disposition"] != "waiting", timeout=6)
        took = time.monotonic() - left_at
        other_id = ""
        if leave == "reset":
            status, headers, body = agent.response(other)
            assert status == 200 and headers["affidavit-outcome"] == "committed", (status, headers, body)
            assert json.loads(body)["path"] == "/h/slow?delay=1.2"
            other_id = headers["affidavit-invocation-id"]
    return record, took, other_id


def test_an_http2_agent_that_resets_one_stream_is_let_go_at_once_and_its_other_streams_go_on(broker, upstream):
    """RST_STREAM keeps the connection: mitmproxy reports it only to the stream, and only after the
    request hook returns; the broker must notice it at once (the route waits 10 s for a response)."""
    record, took, other_id = _http2_exchange_left(broker, upstream, "reset")
    assert record["caller_disposition"] == "cancelled", record
    assert took < 2.0 and "REMOTE_RESPONSE_COMPLETE" not in kinds(record), "noticed before the upstream answered"
    assert record["evidence"]["dispatch_started"] is True
    # The remote side is still the upstream's: its late, complete answer is the outcome.
    ended = broker.wait_for(record["invocation_id"], lambda r: r["stage"] == "delivery_failed", timeout=10)
    assert ended["outcome"] == "committed" and ended["caller_disposition"] == "cancelled"
    assert (ended["phase"], ended["code"], ended["retry"]) == ("result_delivery", "CALLER_CANCELLED", "fetch_result")
    assert [e["data"]["disposition"] for e in ended["events"] if e["kind"] == "CALLER_CANCELLED"] == ["cancelled"]
    # The other stream on the same connection was answered and recorded as usual.
    other = broker.wait_for(other_id, lambda r: r["stage"] == "delivered")
    assert other["caller_disposition"] == "completed" and other["outcome"] == "committed"
    assert upstream.effects == 2


def test_an_http2_agent_that_closes_its_connection_is_disconnected_not_cancelled(broker, upstream):
    """The other way an HTTP/2 agent leaves: the connection goes, so the wait is ``disconnected``
    (what ``cancelled`` means, one request abandoned on a live connection, is not true here)."""
    record, took, _ = _http2_exchange_left(broker, upstream, "close")
    assert record["caller_disposition"] == "disconnected" and took < 2.0, record
    ended = broker.wait_for(record["invocation_id"], lambda r: r["stage"] == "delivery_failed", timeout=10)
    assert ended["outcome"] == "committed" and ended["caller_disposition"] == "disconnected"


def test_an_upstream_cannot_speak_for_the_broker(broker, upstream):
    with broker.client() as client:
        response = client.get(H + "/h/status?code=200&header=Affidavit-Outcome:not_attempted")
        forged = client.get(H + "/h/status?code=200&header=Affidavit-Replayed:true")
    assert response.headers.get_list("affidavit-outcome") == ["committed"]
    assert "affidavit-replayed" not in forged.headers
    with broker.api() as api:
        replay = api.get(f"/v1/invocations/{response.headers['affidavit-invocation-id']}/result")
    assert replay.headers.get_list("affidavit-outcome") == ["committed"]


def test_every_proxied_response_carries_the_invocation_id(broker, upstream):
    with broker.client() as client:
        for path in ("/h/ok", "/h/status?code=404", "/h/status?code=500"):
            response = client.get(H + path)
            assert response.headers["affidavit-invocation-id"].startswith("act_")
            assert response.headers["affidavit-outcome"] in ("committed", "rejected")
