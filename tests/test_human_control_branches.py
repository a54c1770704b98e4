"""Branches of human control the main module does not reach, on real brokers: a credential that
cannot be found, a reconciliation to ``partial_effect``, a lookup keyed by the remote's job id,
and an approval that went stale because the route's configuration changed across a restart."""

from __future__ import annotations

import json

import secrets
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import tomli_w

from proxy.crypto import generate_key
from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream

REC = "https://br-rec.example.test"
JOBS = "https://br-jobs.example.test"
HELD = "https://br-held.example.test"
CRED = "https://br-cred.example.test"

#: What the original attempt's record says about the exchange; reconciliation must not touch it.
DISPATCH_EVIDENCE = ("dispatch", "dispatch_started", "dispatch_seq", "request_complete", "response_headers_received",
                     "response_complete", "status", "attempts")


def sent(up: HostileUpstream) -> list:
    return [r for r in up.received if r.method]


def cli(broker: BrokerProcess, *args: str) -> str:
    done = broker.command(*args)
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
    return done.stdout.decode()


def rewrite(broker: BrokerProcess) -> None:
    broker.config_path.write_text(tomli_w.dumps(broker.config))


def kinds(record: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in record["events"]]


def failed_event(record: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in reversed(record["events"]) if e["kind"] == "FAILED")


# -- 1. CREDENTIAL_MISSING through the broker ----------------------------------------------------


def cred_route(up: HostileUpstream, credential: str) -> dict[str, Any]:
    return {"name": "br-cred", "host": "br-cred.example.test", "methods": ["GET", "POST"], "agents": ["builder"],
            "connect_to": f"127.0.0.1:{up.tls_port('good')}", "credential": credential,
            "inject": {"header": "Authorization", "value": "Bearer {secret}"}}


@pytest.mark.parametrize(("source", "dialect"), [("vault", "sqlite"), ("vault", "postgresql"), ("env", "sqlite"),
                                                 ("env", "postgresql")])
def test_a_credential_that_is_not_there_is_credential_missing_and_nothing_is_sent(make_broker, upstream, tmp_path,
                                                                                   source, dialect):
    name = f"absent-{source}-key"
    if source == "vault":
        key_file = tmp_path / "k1.key"
        key_file.write_text(generate_key())
        broker = make_broker(dialect, routes=[cred_route(upstream, name)], start=False,
                             crypto={"keys": [f"k1=file:{key_file}"]})
        broker.config["secrets"].append({"name": name, "from": f"vault:{name}"})
        expected_diagnostic = f"the vault has no secret '{name}'"
    else:
        variable = "ABSENT_UPSTREAM_KEY_" + secrets.token_hex(4).upper()
        broker = make_broker(dialect, routes=[cred_route(upstream, name)], start=False)
        broker.config["secrets"].append({"name": name, "from": f"env:{variable}"})
        expected_diagnostic = f"environment variable {variable} is not set"
    rewrite(broker)
    broker.start()  # a missing secret does not stop the broker: sources are read at the moment of use
    if source == "vault":
        # The vault is unlocked and holds something, just not this name.
        stored = broker.command("secrets", "set", "some-other-key", input=b"other-value-" + secrets.token_hex(4).encode())
        assert stored.returncode == 0, stored.stderr.decode()

    with broker.client() as client:
        refused = client.post(CRED + "/h/ok", content=b'{"n":1}')
    envelope = check_envelope(refused.content)
    assert refused.status_code == 502, "docs/troubleshooting.md: CREDENTIAL_MISSING is HTTP 502"
    assert (envelope["error"]["phase"], envelope["error"]["outcome"], envelope["error"]["code"], envelope["error"]["retry"]) == (
        "credential_injection", "not_attempted", "CREDENTIAL_MISSING", "after_correction")
    assert envelope["evidence"]["dispatch_started"] is False
    assert refused.headers["affidavit-code"] == "CREDENTIAL_MISSING" and refused.headers["affidavit-outcome"] == "not_attempted"
    assert refused.headers["x-should-retry"] == "false"
    invocation_id = envelope["invocation_id"]
    assert refused.headers["affidavit-invocation-id"] == invocation_id

    record = broker.invocation(invocation_id, broker.operator_token)
    assert (record["stage"], record["phase"], record["outcome"], record["code"]) == (
        "ended_not_attempted", "credential_injection", "not_attempted", "CREDENTIAL_MISSING")
    assert record["caller_disposition"] == "completed" and record["evidence"]["dispatch_started"] is False
    assert record["credential"] == {"id": name, "version": None, "injection": "header"}, "which secret, for the operator"
    assert kinds(record) == ["ACTION_ACCEPTED", "PREFLIGHT_VALIDATED", "FAILED"]
    assert expected_diagnostic in failed_event(record)["data"]["diagnostic"], "the operator is told which source"
    assert "diagnostic" not in failed_event(broker.invocation(invocation_id))["data"], "the agent is not"
    ended = [json.loads(line) for line in broker.logs().splitlines() if invocation_id in line and '"invocation ended"' in line]
    assert len(ended) == 1 and expected_diagnostic in ended[0]["diagnostic"], "the operator's log line says which source too"
    assert upstream.received == [], "not even a connection carried a request"
    assert upstream.effects == 0

    if source == "vault":
        # Control: the same route works once the secret exists, without a restart (read at every use).
        value = "vk_" + secrets.token_hex(10)
        stored = broker.command("secrets", "set", name, input=value.encode())
        assert stored.returncode == 0, stored.stderr.decode()
        with broker.client() as client:
            ok = client.post(CRED + "/h/ok", content=b'{"n":1}')
        assert ok.status_code == 200 and ok.headers["affidavit-outcome"] == "committed"
        assert [r.header("Authorization") for r in sent(upstream)] == [f"Bearer {value}"]
        after = broker.wait_for(ok.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
        assert after["credential"] == {"id": name, "version": "v1", "injection": "header"}
        assert broker.invocation(invocation_id, broker.operator_token)["events"] == record["events"], "the refusal stays"


# -- 2 and 3: reconciliation -------------------------------------------------------------------


def control_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    base = {"agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('good')}", "methods": ["POST", "GET"],
            "response_timeout": "1s", "result_horizon": "2s"}
    return [
        {"name": "br-rec", "host": "br-rec.example.test", **base},
        {"name": "br-jobs", "host": "br-jobs.example.test", **base,
         "lookup": {"path": "/h/status?code=200&for={job_ref}"}},
    ]


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
           upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, control_routes(upstream_server), name="branches")


@pytest.mark.parametrize("channel", ["api", "cli"])
def test_an_unknown_outcome_reconciled_as_partial_effect_appends_and_rewrites_nothing(broker, upstream, channel):
    # The API case loses the answer after the effect (the caller got an envelope: completed); the
    # CLI case never answers (the caller's wait timed out). Both end unknown.
    behaviour, disposition = ("close_after_effect", "completed") if channel == "api" else ("hang", "timed_out")
    with broker.client() as client:
        response = client.post(REC + f"/h/{behaviour}", content=b'{"batch":"b-17","items":40}')
    lost = check_envelope(response.content)
    assert (response.status_code, lost["error"]["outcome"], lost["error"]["code"]) == (
        504 if channel == "cli" else 502, "unknown", "REMOTE_OUTCOME_UNKNOWN")
    invocation_id = lost["invocation_id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    assert before["caller_disposition"] == disposition and before["evidence"]["dispatch_started"] is True
    assert before["next_action"] == "reconcile" and before["retry"] == "reconcile"

    reference, note = "batch_b17_" + secrets.token_hex(3), "23 of 40 items are in the remote's ledger"
    with broker.api() as agent_api:  # an agent may not settle its own uncertainty
        refused = agent_api.post(f"/v1/invocations/{invocation_id}/reconcile",
                                 json={"outcome": "partial_effect", "reference": reference, "note": note})
    assert refused.status_code == 403 and "operator" in refused.json()["detail"]
    assert broker.invocation(invocation_id, broker.operator_token)["events"] == before["events"]

    if channel == "api":
        certainty = "remote_query"
        with broker.operator() as api:
            answer = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={
                "outcome": "partial_effect", "certainty": certainty, "reference": reference, "note": note})
        assert answer.status_code == 200, answer.text
        assert answer.json()["outcome"] == "partial_effect" and answer.json()["invocation_id"] == invocation_id
    else:
        certainty = "operator_attested"
        out = cli(broker, "reconcile", invocation_id, "--outcome", "partial_effect", "--reference", reference, "--note", note)
        assert f"{invocation_id}: outcome partial_effect (operator_attested), caller disposition timed_out, retry never" in out

    after = broker.invocation(invocation_id, broker.operator_token)
    assert (after["outcome"], after["retry"], after["next_action"]) == ("partial_effect", "never", "return_recorded_result")
    assert after["evidence"]["certainty"] == certainty
    assert after["stage"] == "ended_unknown" and after["code"] == before["code"] == "REMOTE_OUTCOME_UNKNOWN"
    assert after["caller_disposition"] == disposition, "a reconciliation never rewrites the caller's wait"
    assert {k: after["evidence"][k] for k in DISPATCH_EVIDENCE} == {k: before["evidence"][k] for k in DISPATCH_EVIDENCE}
    assert after["events"][:-1] == before["events"], "history is appended to, never rewritten"
    last = after["events"][-1]
    assert last["kind"] == "RECONCILED" and last["seq"] == before["events"][-1]["seq"] + 1
    assert {k: last["data"][k] for k in ("outcome", "certainty", "reference", "note", "by")} == {
        "outcome": "partial_effect", "certainty": certainty, "reference": reference, "note": note, "by": "operator"}
    assert broker.invocation(invocation_id)["outcome"] == "partial_effect", "the agent sees the finding too"
    with broker.api() as agent_api:
        result = agent_api.get(f"/v1/invocations/{invocation_id}/result")
    stored = check_envelope(result.content)
    assert result.status_code == 409 and stored["error"]["outcome"] == "partial_effect", "no result is invented"
    assert len(sent(upstream)) == 1 and upstream.effects == 1, "nothing was re-sent"


def test_lookup_by_the_job_reference_the_remote_returned(broker, upstream):
    job = "job_" + secrets.token_hex(6)
    with broker.client() as client:
        accepted = client.post(JOBS + f"/h/status?code=202&job={job}&location=/jobs/{job}", content=b'{"export":"all"}')
    assert accepted.status_code == 202 and accepted.json() == {"job_id": job, "status": "pending"}
    invocation_id = accepted.headers["affidavit-invocation-id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    assert before["evidence"]["job_ref"] == job and before["evidence"]["location"] == f"/jobs/{job}"
    assert before["outcome"] == "committed" and before["evidence"]["certainty"] == "remote_response"

    out = cli(broker, "reconcile", invocation_id, "--lookup", "--note", "export finished")
    assert "answered 200: committed" in out

    after = broker.invocation(invocation_id, broker.operator_token)
    assert after["outcome"] == "committed" and after["evidence"]["certainty"] == "remote_query"
    assert after["events"][:-1] == before["events"]
    last = after["events"][-1]
    assert last["kind"] == "RECONCILED" and last["seq"] == before["events"][-1]["seq"] + 1
    assert last["data"]["note"] == "export finished" and last["data"]["certainty"] == "remote_query"
    lookup_id = last["data"]["reference"]
    assert lookup_id != invocation_id and f"lookup {lookup_id} answered 200" in out
    looked = broker.invocation(lookup_id, broker.operator_token)
    assert (looked["method"], looked["route"], looked["agent"], looked["outcome"]) == ("GET", "br-jobs", "builder", "committed")
    assert looked["target"] == f"https://br-jobs.example.test:443/h/status?code=200&for={job}"
    assert "RESULT_COMMITTED" in kinds(looked), "the lookup is its own recorded invocation"
    got = sent(upstream)
    assert [r.method for r in got] == ["POST", "GET"] and got[1].query["for"] == job
    assert upstream.effects == 2  # the hostile status behaviour counts every request it answers


@pytest.mark.parametrize(("base", "says"), [
    (REC, ["declares no lookup", "give the outcome yourself", "configuration.md#lookup"]),  # the route has none
    (JOBS, ["{job_ref}"]),  # it has one, but the record has no job reference to fill it with
])
def test_a_lookup_that_cannot_be_made_changes_nothing_and_says_why(broker, upstream, base, says):
    with broker.client() as client:
        response = client.post(base + "/h/close_after_effect", content=b'{"export":"some"}')
    invocation_id = check_envelope(response.content)["invocation_id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    with broker.operator() as api:
        answer = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"lookup": True})
    assert answer.status_code == 422 and all(s in answer.json()["detail"] for s in says), answer.text
    done = broker.command("reconcile", invocation_id, "--lookup")
    assert done.returncode != 0 and b"422" in done.stderr
    assert broker.invocation(invocation_id, broker.operator_token)["events"] == before["events"]
    assert [r.method for r in sent(upstream)] == ["POST"], "no lookup was sent"


# -- 4. APPROVAL_STALE: the route changed while the approval was pending ------------------------


def held_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    return [{"name": "br-held", "host": "br-held.example.test", "agents": ["builder"], "methods": ["POST"],
             "connect_to": f"127.0.0.1:{up.tls_port('good')}", "approval": True, "approval_timeout": "20s",
             "response_timeout": "5s", "result_horizon": "6s", "credential": "payments-key",
             "inject": {"header": "Authorization", "value": "Bearer {secret}"},
             "idempotency": {"header": "Idempotency-Key", "scope": "br-held", "retention": "1h"}}]


class Held:
    """A request that waits in a thread while the test plays the operator."""

    def __init__(self, broker: BrokerProcess, body: bytes, key: str, timeout: float = 30):
        self.result: httpx.Response | Exception | None = None

        def run() -> None:
            try:
                with broker.client(timeout=timeout) as client:
                    self.result = client.post(HELD + "/h/status?code=201", content=body, headers={"Idempotency-Key": key})
            except Exception as exc:  # the test inspects it
                self.result = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def response(self) -> httpx.Response:
        self.thread.join(40)
        assert isinstance(self.result, httpx.Response), self.result
        return self.result


def wait_for_card(broker: BrokerProcess, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with broker.operator() as api:
            items = api.get("/v1/approvals").json()["items"]
        if items:
            return items[-1]
        time.sleep(0.1)
    raise AssertionError("no approval card appeared")


@pytest.mark.parametrize(("change", "dialect"), [
    ("injection_template", "sqlite"),
    ("injection_template", "postgresql"),
    ("credential", "sqlite"),
    ("unchanged", "sqlite"),  # the control: the same restart without a change goes through
])
def test_an_approval_given_under_an_old_route_configuration_is_stale(make_broker, upstream, change, dialect):
    broker = make_broker(dialect, routes=held_routes(upstream), recovery={"heartbeat": "0.5s", "stale_after": "2s"})
    key = "deploy_" + secrets.token_hex(6)
    body = b'{"deploy":"v51"}'
    first = Held(broker, body, key, timeout=5)
    card = wait_for_card(broker)
    invocation_id = card["invocation_id"]
    assert card["credential_id"] == "payments-key" and card["config_digest"].startswith("sha256:")

    broker.kill()  # the held request is durable; its caller's connection is gone with the process
    first.thread.join(10)
    route = broker.config["routes"][0]
    if change == "injection_template":
        route["inject"]["value"] = "Token {secret}"  # same header, same credential: only the route's digest differs
    elif change == "credential":
        broker.env["PAYMENTS_KEY_2"] = "sk_second_" + secrets.token_hex(8)
        broker.config["secrets"].append({"name": "payments-key-2", "from": "env:PAYMENTS_KEY_2"})
        route["credential"] = "payments-key-2"
    rewrite(broker)
    broker.start()

    relisted = wait_for_card(broker)
    assert relisted["invocation_id"] == invocation_id and relisted["approves"] == card["approves"]
    assert relisted["config_digest"] == card["config_digest"], "the card keeps the configuration it was made under"
    time.sleep(2.5)  # the killed incarnation's heartbeat is stale: the agent's repeat takes the wait over
    resumed = Held(broker, body, key)
    broker.wait_for(invocation_id, lambda r: r["retry_budget"]["used"] >= 1, timeout=15)  # taken over, still held
    assert broker.invocation(invocation_id, broker.operator_token)["stage"] == "held"
    cli(broker, "approvals", "approve", invocation_id, "--note", "approved after the restart")
    response = resumed.response()
    record = broker.wait_for(invocation_id, lambda r: r["stage"] not in ("held", "approved", "authorized"))

    if change == "unchanged":
        assert response.status_code == 201 and response.headers["affidavit-invocation-id"] == invocation_id
        assert [r.body for r in sent(upstream)] == [body]
        assert sent(upstream)[0].header("Authorization") == f"Bearer {broker.env['PAYMENTS_KEY']}"
        return

    envelope = check_envelope(response.content)
    assert response.status_code == 409
    assert (envelope["error"]["code"], envelope["error"]["phase"], envelope["error"]["outcome"], envelope["error"]["retry"]) == (
        "APPROVAL_STALE", "validation", "not_attempted", "after_correction")
    assert envelope["invocation_id"] == invocation_id and envelope["evidence"]["dispatch_started"] is False
    assert (record["stage"], record["outcome"], record["code"]) == ("ended_not_attempted", "not_attempted", "APPROVAL_STALE")
    events = kinds(record)
    assert "APPROVAL_GRANTED" in events and "DISPATCH_STARTED" not in events
    assert events[-1] == "FAILED"
    why = failed_event(record)["data"]["diagnostic"]
    if change == "injection_template":
        assert why == "the route's configuration changed since the approval"
    else:
        assert why == "the request or its credential version differs from the one approved"
    assert sent(upstream) == [] and upstream.effects == 0, "the old approval authorised nothing new"
