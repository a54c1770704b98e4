"""People settle what the broker could not, and approve what it must not do alone: reconciliation
(by hand and by lookup) and approvals bound to the fingerprint, through the real CLI and side API."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import secrets
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any, Iterator

import httpx
import pytest
import typer

from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.h2agent import H2Agent
from tests.support.hostile import HostileUpstream

PAY = "https://ctl-pay.example.test"
HELD = "https://ctl-held.example.test"


def control_routes(up: HostileUpstream, approval_timeout: str = "20s") -> list[dict[str, Any]]:
    base = {"agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('good')}", "methods": ["POST", "GET"],
            "response_timeout": "1s", "result_horizon": "2s"}
    return [
        {"name": "ctl-pay", "host": "ctl-pay.example.test", **base,
         "lookup": {"path": "/h/status?code=200&for={key}"}},
        {"name": "ctl-held", "host": "ctl-held.example.test", **base, "approval": True,
         "approval_timeout": approval_timeout, "response_timeout": "5s", "result_horizon": "6s",
         "credential": "payments-key", "inject": {"header": "Authorization", "value": "Bearer {secret}"},
         "idempotency": {"header": "Idempotency-Key", "scope": "held", "retention": "1h"}},
    ]


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
           upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, control_routes(upstream_server), name="control")


def cli(broker: BrokerProcess, *args: str) -> str:
    done = broker.command(*args)
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
    return done.stdout.decode()


def sent(up: HostileUpstream) -> list:
    return [r for r in up.received if r.method]


# -- reconciliation ----------------------------------------------------------------------------


def test_reconciling_an_unknown_payment_keeps_the_timed_out_disposition(broker, upstream):
    with broker.client() as client:
        response = client.post(PAY + "/h/hang", content=b'{"amount":100}')
    body = check_envelope(response.content)
    assert (response.status_code, body["error"]["outcome"]) == (504, "unknown")
    invocation_id = body["invocation_id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    assert before["caller_disposition"] == "timed_out" and before["next_action"] == "reconcile"

    out = cli(broker, "reconcile", invocation_id, "--outcome", "committed", "--reference", "ch_123", "--note", "seen in the PSP dashboard")
    assert "outcome committed (operator_attested)" in out and "caller disposition timed_out" in out

    after = broker.invocation(invocation_id, broker.operator_token)
    assert after["outcome"] == "committed" and after["retry"] == "never"
    assert after["evidence"]["certainty"] == "operator_attested"
    assert after["caller_disposition"] == "timed_out", "a reconciliation never rewrites the caller's wait"
    assert after["evidence"]["dispatch_started"] is True and after["evidence"]["response_complete"] is False
    assert after["events"][:-1] == before["events"], "history is appended to, never rewritten"
    last = after["events"][-1]
    assert last["kind"] == "RECONCILED" and last["seq"] == before["events"][-1]["seq"] + 1
    assert last["data"]["reference"] == "ch_123" and last["data"]["certainty"] == "operator_attested"
    assert len(sent(upstream)) == 1


def test_a_repeat_of_a_reconciled_invocation_says_there_is_nothing_to_replay(broker, upstream):
    key = f"rec-{secrets.token_hex(4)}"
    with broker.client() as client:
        first = check_envelope(client.post(PAY + "/h/hang", content=b'{"amount":7}', headers={"Idempotency-Key": key}).content)
    invocation_id = first["invocation_id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    cli(broker, "reconcile", invocation_id, "--outcome", "committed", "--note", "seen at the PSP")
    before = len(sent(upstream))
    with broker.client() as client:
        again = client.post(PAY + "/h/hang", content=b'{"amount":7}', headers={"Idempotency-Key": key})
    body = check_envelope(again.content)
    assert again.status_code == 409
    assert (body["error"]["code"], body["error"]["outcome"], body["error"]["retry"]) == ("RESULT_UNAVAILABLE", "committed", "never")
    assert body["invocation_id"] == invocation_id and "reconciled as committed" in body["error"]["message"]
    assert again.headers["affidavit-code"] == "RESULT_UNAVAILABLE" and again.headers["affidavit-outcome"] == "committed"
    assert len(sent(upstream)) == before, "a reconciled invocation is never re-sent"
    with broker.api() as api:  # the side API says the same as the repeat, not "outcome unknown"
        fetched = api.get(f"/v1/invocations/{invocation_id}/result")
    body = check_envelope(fetched.content)
    assert fetched.status_code == 409 and fetched.headers["affidavit-code"] == "RESULT_UNAVAILABLE"
    assert (body["error"]["code"], body["error"]["outcome"]) == ("RESULT_UNAVAILABLE", "committed")
    assert "RECONCILED" in body["error"]["message"] and "do not re-send" in body["error"]["message"]


def test_a_reconciliation_cannot_claim_not_attempted_or_touch_an_undispatched_record(broker, upstream):
    with broker.client() as client:
        unknown = check_envelope(client.post(PAY + "/h/close_after_effect", content=b"{}").content)["invocation_id"]
        refused = check_envelope(client.get("https://nowhere.example.test/").content)["invocation_id"]
    broker.wait_for(unknown, lambda r: r["stage"] == "ended_unknown")
    with broker.operator() as api:
        bad = api.post(f"/v1/invocations/{unknown}/reconcile", json={"outcome": "not_attempted"})
        assert bad.status_code == 422
        early = api.post(f"/v1/invocations/{refused}/reconcile", json={"outcome": "committed"})
        assert early.status_code == 409, early.text
        assert "was never sent" in early.json()["detail"] and "nothing to reconcile" in early.json()["detail"], early.text
        assert "INVALID_TARGET" in early.json()["detail"]
        # Asked to look it up instead: the same refusal, not "the route declares no lookup" (it has
        # none: no route matched), which would send an operator off to configure one for nothing.
        looked = api.post(f"/v1/invocations/{refused}/reconcile", json={"lookup": True})
        assert looked.status_code == 409 and "was never sent" in looked.json()["detail"], looked.text
    with broker.api() as agent_api:
        assert agent_api.post(f"/v1/invocations/{unknown}/reconcile", json={"outcome": "committed"}).status_code == 403
    assert broker.invocation(unknown)["outcome"] == "unknown"


class _NotTheSideAPI(http.server.BaseHTTPRequestHandler):
    """Some other HTTP server, where api.listen points by mistake: JSON, but not the side API's."""

    status, content_type, body = 200, "application/json", b'{"hello": "world"}'

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = self.body
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


class _NotTheSideAPIAt404(_NotTheSideAPI):
    """A web server's own 404 page: it was printed whole, as "404 from the broker at ..."."""

    status, content_type = 404, "text/html"
    body = b"<html><head><title>404 Not Found</title></head><body>" + b"<p>nothing here</p>" * 200 + b"</body></html>"


@pytest.mark.parametrize("handler", [_NotTheSideAPI, _NotTheSideAPIAt404], ids=["200", "404"])
@pytest.mark.parametrize("args", [("approvals", "list"), ("approvals", "approve", "act_01M983Q3E5X3V5MXXTEZ5M3DQA"),
                                  ("reconcile", "act_01M983Q3E5X3V5MXXTEZ5M3DQA", "--outcome", "committed")],
                         ids=["list", "approve", "reconcile"])
def test_the_cli_says_when_api_listen_is_not_an_affidavit_side_api(broker, args, handler):
    """It printed a traceback (KeyError: 'items', 'stage', 'outcome'), or another server's whole
    error page as the broker's answer."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = broker.command(*args, env={"AFFIDAVIT_API__LISTEN": f"127.0.0.1:{server.server_address[1]}"})
    finally:
        server.shutdown()
        server.server_close()
    said = done.stderr.decode()
    assert done.returncode == 1 and f"answered {handler.status}, but not as an Affidavit side API does" in said, said
    assert "is api.listen in this configuration the broker's side API" in said and "Traceback" not in said, said
    assert "from the broker at" not in said and said.count("nothing here") < 10, said


def test_a_decision_the_broker_does_not_answer_in_time_says_it_may_still_be_made(monkeypatch, capsys):
    """`reconcile --lookup` gave up after 60 s with "is the broker running?", and the finding was
    recorded afterwards (the lookup waited on its route). Patched: the CLI's timeout only."""
    from proxy import cli_operator
    from proxy.client import SideAPI

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    try:
        port = silent.getsockname()[1]
        monkeypatch.setattr(cli_operator, "operator_api", lambda settings: SideAPI(f"http://127.0.0.1:{port}", "t", timeout=0.5))
        with pytest.raises(typer.Exit):
            cli_operator.call_api(None, "POST", "/v1/invocations/act_x/reconcile", {"lookup": True}, invocation_id="act_x")
    finally:
        silent.close()
    said = capsys.readouterr().err
    assert "no answer within 0.5 s. The broker may still make this change" in said, said
    assert "affidavit invocations show act_x" in said and "is the broker running" not in said, said


def test_the_cli_refuses_a_finding_that_is_none_before_it_asks_the_broker(broker, upstream):
    """A usage error (exit 2) that names the choices, not the API's 422 as a Python repr."""
    for args, says in ((["--outcome", "unknown"], "is not a finding"), (["--outcome", "not_attempted"], "is not a finding"),
                       ([], "--lookup")):
        done = broker.command("reconcile", "act_01M8TRTD8RSQZTD7JJN9HZ5237", *args)
        err = " ".join(re.sub("[\u2500-\u257f]", " ", done.stderr.decode()).split())  # rich's box, unwrapped
        assert done.returncode == 2 and says in err and "committed, rejected, partial_effect" in err, err
        assert "literal_error" not in err and "lookup=true" not in err, err
    # Bytes that are not UTF-8 (a Latin-1 terminal) are no text the journal can keep: a usage
    # error, not the broker's 500 (or 422) for a lone surrogate.
    for args in (["reconcile", "act_01M8TRTD8RSQZTD7JJN9HZ5237", "--outcome", "committed", "--note", b"caf\xe9"],
                 ["reconcile", "act_01M8TRTD8RSQZTD7JJN9HZ5237", "--outcome", "committed", "--reference", b"\xff"],
                 ["approvals", "deny", "act_01M8TRTD8RSQZTD7JJN9HZ5237", "--note", b"caf\xe9"],
                 ["approvals", "approve", b"act_\xff"], ["reconcile", b"act_\xff", "--outcome", "committed"],
                 ["invocations", "show", b"act_\xff"], ["invocations", "result", b"act_\xff"]):
        done = broker.command(*args)
        err = " ".join(re.sub("[\u2500-\u257f]", " ", done.stderr.decode()).split())
        assert done.returncode == 2 and "is not UTF-8 text" in err and "from the broker" not in err, (args, err)
        assert "Traceback" not in err and "journal could not be read" not in err, (args, err)
    # Both an outcome and --lookup: which one would decide? Neither is dropped silently.
    done = broker.command("reconcile", "act_01M8TRTD8RSQZTD7JJN9HZ5237", "--outcome", "committed", "--lookup")
    err = " ".join(re.sub("[\u2500-\u257f]", " ", done.stderr.decode()).split())
    assert done.returncode == 2 and "not both" in err, err
    with broker.operator() as api:
        both = api.post("/v1/invocations/act_01M8TRTD8RSQZTD7JJN9HZ5237/reconcile", json={"outcome": "rejected", "lookup": True})
    assert both.status_code == 422 and "not both" in both.json()["detail"], both.text
    for limit in ("0", "-5", "501"):
        done = broker.command("invocations", "list", "--limit", limit)
        assert done.returncode == 2 and "--limit" in done.stderr.decode(), done.stderr.decode()
    with broker.operator() as api:
        for before in ("", "garbage", "act_nope"):
            answer = api.get("/v1/invocations", params={"before": before})
            assert answer.status_code == 422, (before, answer.text)
    # A token the running broker does not know: say where it was read and that brokers read tokens at start.
    wrong = broker.command("approvals", "list", env={"AFFIDAVIT_TEST_OPERATOR": "not-the-one"})
    said = wrong.stderr.decode()
    assert wrong.returncode == 1 and "401" in said and "api.operator_token (env:AFFIDAVIT_TEST_OPERATOR)" in said, said
    assert "restart the broker" in said and "not-the-one" not in said, said
    # A 422 names the field and the rule, not the whole input back.
    long = broker.command("reconcile", "act_01M8TRTD8RSQZTD7JJN9HZ5237", "--outcome", "rejected", "--note", "n" * 2001)
    said = long.stderr.decode()
    assert long.returncode == 1 and f"422 from the broker at {broker.api_url}: note: String should have at most 2000 " \
        "characters" in said and "nnnn" not in said, said
    # An id is sent as one path segment, whatever it holds: not cut at a '?' into another id.
    for args in (["approvals", "approve", "act_x?y"], ["reconcile", "act_x?y", "--outcome", "rejected"]):
        done = broker.command(*args)
        assert done.returncode == 1 and "act_x?y" in done.stderr.decode(), (args, done.stderr.decode())
    # The operator sees every invocation: an unknown id is not "invisible to this token", it is not
    # in the journal of the broker that was asked (named: the wrong --config is a common cause).
    unknown = broker.command("approvals", "approve", "act_01M8TRTD8RSQZTD7JJN9HZ5237").stderr.decode()
    assert f"404 from the broker at {broker.api_url}: No invocation 'act_01M8TRTD8RSQZTD7JJN9HZ5237' is in the " \
        f"journal of the broker at {broker.api_url}" in unknown and "visible to this token" not in unknown, unknown


def test_a_finding_against_a_complete_response_is_refused_unless_it_says_override(broker, upstream):
    with broker.client() as client:
        answered = client.post(PAY + "/h/status?code=200", content=b'{"amount":5}')
    assert answered.status_code == 200
    invocation_id = answered.headers["affidavit-invocation-id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    with broker.operator() as api:
        refused = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected", "note": "refunded"})
    assert refused.status_code == 409
    assert "status 200) says committed, and a finding of rejected would overturn it." in refused.json()["detail"], refused.text
    assert "override=true" in refused.json()["detail"]
    assert broker.invocation(invocation_id, broker.operator_token)["events"] == before["events"], "nothing was appended"
    done = broker.command("reconcile", invocation_id, "--outcome", "rejected", "--note", "refunded")
    assert done.returncode != 0 and b"--override" in done.stdout + done.stderr
    out = cli(broker, "reconcile", invocation_id, "--outcome", "rejected", "--note", "refunded", "--override")
    assert "outcome rejected (operator_attested)" in out
    after = broker.invocation(invocation_id, broker.operator_token)
    assert after["outcome"] == "rejected" and after["evidence"]["response_complete"] is True
    assert after["events"][:-1] == before["events"]
    assert after["events"][-1]["kind"] == "RECONCILED" and after["events"][-1]["data"]["override"] is True
    with broker.operator() as api:
        # Re-stating the finding (to add a reference) overturns nothing; going back does.
        assert api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected", "reference": "re_1"}).status_code == 200
        back = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "committed"})
        assert back.status_code == 409, back.text
        assert ("an earlier finding set the outcome to rejected against the remote's complete answer (status 200), and a "
                "finding of committed would overturn that finding." in back.json()["detail"]), back.text
        assert broker.invocation(invocation_id, broker.operator_token)["outcome"] == "rejected"
        # A finding that goes back to what the answer said is no finding "against" the answer.
        assert api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "committed", "override": True}).status_code == 200
        again = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected"})
        assert again.status_code == 409, again.text
        assert ("the remote's complete answer (status 200) says committed (as an earlier finding does), and a finding "
                "of rejected would overturn it." in again.json()["detail"]), again.text


def test_reconcile_by_lookup_asks_the_remote_through_the_broker(broker, upstream):
    key = "pay_" + secrets.token_hex(6)
    with broker.client() as client:
        lost = client.post(PAY + "/h/close_after_effect", content=b"{}", headers={"Idempotency-Key": key})
    invocation_id = check_envelope(lost.content)["invocation_id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    out = cli(broker, "reconcile", invocation_id, "--lookup")
    assert "answered 200: committed" in out
    record = broker.invocation(invocation_id, broker.operator_token)
    assert record["outcome"] == "committed" and record["evidence"]["certainty"] == "remote_query"
    reference = record["events"][-1]["data"]["reference"]
    looked = broker.invocation(reference, broker.operator_token)
    assert looked["method"] == "GET" and looked["target"].endswith(f"for={key}")
    assert looked["agent"] == "builder" and looked["outcome"] == "committed"
    assert [r.method for r in sent(upstream)] == ["POST", "GET"]
    # The remote's own answer is held like a complete response: a mistyped id cannot undo it.
    with broker.operator() as api:
        flipped = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected"})
        assert flipped.status_code == 409, flipped.text
        assert ("the outcome is committed, on a record where the remote's answer to a lookup set it (certainty "
                "remote_query), and a finding of rejected would overturn it" in flipped.json()["detail"]), flipped.text
        assert broker.invocation(invocation_id, broker.operator_token)["events"] == record["events"], "nothing appended"
        restated = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "committed", "reference": "ch_1"})
        assert restated.status_code == 200, restated.text
        still = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected"})
        assert still.status_code == 409, "a restating finding does not lift the lookup's protection: " + still.text
        forced = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "rejected", "override": True})
        assert forced.status_code == 200 and forced.json()["outcome"] == "rejected", forced.text


def test_lookup_404_means_no_effect(make_broker, upstream):
    routes = control_routes(upstream)
    routes[0]["lookup"] = {"path": "/h/status?code=404&for={key}"}
    broker = make_broker("sqlite", routes=routes)
    key = "pay_" + secrets.token_hex(6)
    with broker.client() as client:
        lost = client.post(PAY + "/h/close_after_effect", content=b"{}", headers={"Idempotency-Key": key})
    invocation_id = check_envelope(lost.content)["invocation_id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    out = cli(broker, "reconcile", invocation_id, "--lookup")
    assert "answered 404: rejected" in out
    assert broker.invocation(invocation_id)["outcome"] == "rejected"


def test_a_lookup_the_remote_never_answered_is_not_called_its_answer(make_broker, upstream):
    """The broker refused the lookup itself (its route does not allow GET): the 409 said "answered
    405, which proves nothing", as if the remote had answered."""
    routes = control_routes(upstream)
    routes[0]["methods"] = ["POST"]
    broker = make_broker("sqlite", routes=routes)
    with broker.client() as client:
        lost = client.post(PAY + "/h/close_after_effect", content=b"{}", headers={"Idempotency-Key": "pay_" + secrets.token_hex(6)})
    invocation_id = check_envelope(lost.content)["invocation_id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    with broker.operator() as api:
        looked = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"lookup": True})
    detail = looked.json()["detail"]
    assert looked.status_code == 409 and "got no answer from the remote: the broker answered it " in detail, looked.text
    assert "the remote was not asked (nothing was sent)" in detail and "proves nothing" not in detail, detail
    assert broker.invocation(invocation_id, broker.operator_token)["events"] == before["events"]
    assert [r.method for r in sent(upstream)] == ["POST"]


# -- approvals ---------------------------------------------------------------------------------


class Held:
    """A request that waits in a thread while the test plays the operator."""

    def __init__(self, broker: BrokerProcess, body: bytes, key: str | None = None, path: str = "/h/status?code=201", timeout: float = 30):
        self.result: httpx.Response | Exception | None = None
        headers = {"Idempotency-Key": key} if key else {}

        def run() -> None:
            try:
                with broker.client(timeout=timeout) as client:
                    self.result = client.post(HELD + path, content=body, headers=headers)
            except Exception as exc:  # the test inspects it
                self.result = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def response(self) -> httpx.Response:
        self.thread.join(40)
        assert isinstance(self.result, httpx.Response), self.result
        return self.result


def wait_for_card(broker: BrokerProcess, predicate=lambda card: True, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with broker.operator() as api:
            items = [c for c in api.get("/v1/approvals").json()["items"] if predicate(c)]
        if items:
            return items[-1]
        time.sleep(0.1)
    raise AssertionError("no approval card appeared")


def test_an_approval_given_after_a_restart_waits_for_the_agents_repeat(make_broker, upstream):
    """Nobody waits for the card once its broker restarted; the approval is recorded and kept
    (recovery sweeps leave it alone), and the agent's repeat with the same key, even right after
    the restart, is sent under it: once, without a second card."""
    broker, key, card = held_then_restarted(make_broker, upstream, b'{"deploy":"v48"}', sweep_every="0.2s")
    out = cli(broker, "approvals", "approve", card["invocation_id"])
    assert "approved" in out, out
    time.sleep(1.5)  # several recovery sweeps of this incarnation, which knows its predecessor is dead
    kinds = [e["kind"] for e in broker.invocation(card["invocation_id"])["events"]]
    assert kinds[-1] == "APPROVAL_GRANTED", kinds
    with broker.client(timeout=10) as client:
        response = client.post(HELD + "/h/status?code=201", content=b'{"deploy":"v48"}', headers={"Idempotency-Key": key})
    assert response.status_code == 201, response.text
    assert response.headers["affidavit-invocation-id"] == card["invocation_id"]
    assert len(sent(upstream)) == 1 and json.loads(sent(upstream)[0].body) == {"deploy": "v48"}
    kinds = [e["kind"] for e in broker.invocation(card["invocation_id"])["events"]]
    assert kinds.count("APPROVAL_REQUESTED") == 1 and kinds.count("DISPATCH_STARTED") == 1, kinds
    assert "FAILED" not in kinds, kinds


def test_an_approved_request_goes_through_and_the_card_says_exactly_what(broker, upstream):
    body = b'{"deploy":"v42"}'
    held = Held(broker, body)
    card = wait_for_card(broker)
    assert (card["agent"], card["route"], card["method"]) == ("builder", "ctl-held", "POST")
    assert card["target"].startswith("https://ctl-held.example.test:443/h/status")
    assert card["body_bytes"] == len(body) and len(card["body_sha256"]) == 64
    assert card["credential_id"] == "payments-key" and card["credential_version"] == "env"
    assert card["approves"].startswith("sha256:") and card["retry_of_uncertain_action"] is None
    listed = [json.loads(line) for line in cli(broker, "approvals", "list", "--json").splitlines()]
    assert [c["invocation_id"] for c in listed] == [card["invocation_id"]]
    assert card["invocation_id"] in cli(broker, "approvals", "list")
    for width in ("80", "200"):  # a pipe or a small terminal: every field whole, on a line or two
        done = broker.command("approvals", "list", env={"COLUMNS": width})
        text = done.stdout.decode()
        assert done.returncode == 0 and "…" not in text, text
        assert all(len(line.rstrip()) <= int(width) or card["target"] in line for line in text.splitlines()), text
        for whole in (card["invocation_id"], "builder", "ctl-held", card["approves"][:19], f"sha256:{card['body_sha256'][:12]}"):
            assert whole in text, (width, whole, text)
    assert sent(upstream) == [], "nothing is sent (and no secret touched) while held"
    cli(broker, "approvals", "approve", card["invocation_id"], "--note", "change ticket 7")
    response = held.response()
    assert response.status_code == 201 and response.headers["affidavit-outcome"] == "committed"
    kinds = [e["kind"] for e in broker.invocation(card["invocation_id"])["events"]]
    assert kinds[:6] == ["ACTION_ACCEPTED", "PREFLIGHT_VALIDATED", "APPROVAL_REQUESTED", "APPROVAL_GRANTED",
                         "CREDENTIAL_AUTHORIZED", "DISPATCH_STARTED"]
    assert len(sent(upstream)) == 1


def test_approvals_are_listed_oldest_first_page_by_page_and_the_cli_follows_every_page(broker, upstream, monkeypatch):
    """`GET /v1/approvals` answered at most 200 cards and never said there were more: with cards
    of a stopped broker piling up (oldest first), a new one fell off the list unseen."""
    tag = secrets.token_hex(4)
    bodies = [f'{{"deploy":"page-{tag}-{n}"}}'.encode() for n in range(3)]
    shas = [hashlib.sha256(body).hexdigest() for body in bodies]
    held = []
    for body, sha in zip(bodies, shas):  # one after another, so their ids (and ages) are in this order
        held.append(Held(broker, body))
        wait_for_card(broker, lambda c, sha=sha: c["body_sha256"] == sha)
    ours = lambda items: [c for c in items if c["body_sha256"] in shas]  # noqa: E731 (other tests' cards may be held too)
    pages, after = [], None
    with broker.operator() as api:
        for _ in range(50):
            page = api.get("/v1/approvals", params={"limit": 2, **({"after": after} if after else {})}).json()
            assert len(page["items"]) <= 2
            pages.append(page["items"])
            after = page["next"]
            if after is None:
                break
        assert api.get("/v1/approvals", params={"after": "not-an-id"}).status_code == 422
        assert api.get("/v1/approvals", params={"limit": 0}).status_code == 422
    listed = [c["invocation_id"] for page in pages for c in page]
    assert listed == sorted(listed) and len(set(listed)) == len(listed), "oldest first, each card once"
    mine = [c["invocation_id"] for page in pages for c in ours(page)]
    assert len(mine) == 3 and len(pages) >= 2, pages

    from typer.testing import CliRunner

    from proxy import cli_operator
    from proxy.cli import app

    monkeypatch.setattr(cli_operator, "APPROVALS_PAGE", 1)  # one card per call: the CLI must follow `next`
    monkeypatch.chdir(broker.workdir)
    done = CliRunner().invoke(app, ["approvals", "list", "--json", "--config", str(broker.config_path)], env=broker.env)
    assert done.exit_code == 0, done.output
    assert [c["invocation_id"] for c in ours(json.loads(line) for line in done.output.splitlines())] == mine
    for invocation_id in mine:
        cli(broker, "approvals", "deny", invocation_id)
    assert all(h.response().status_code == 403 for h in held)


def test_a_denied_request_is_not_attempted_and_sends_nothing(broker, upstream):
    held = Held(broker, b'{"deploy":"v43"}')
    card = wait_for_card(broker)
    cli(broker, "approvals", "deny", card["invocation_id"], "--note", "not today")
    response = held.response()
    envelope = check_envelope(response.content)
    assert response.status_code == 403
    assert (envelope["error"]["code"], envelope["error"]["phase"], envelope["error"]["outcome"]) == (
        "APPROVAL_DENIED", "credential_injection", "not_attempted")
    generated = envelope["evidence"]["idempotency"]["key"]
    assert generated.startswith("afk_") and response.headers["affidavit-idempotency-key"] == generated, (
        "the key the broker made is named, so the agent can repeat under it")
    assert sent(upstream) == []
    # The agent was handed the denial: its wait completed (not "waiting" for ever).
    record = broker.wait_for(card["invocation_id"], lambda r: r["caller_disposition"] != "waiting", timeout=5)
    assert (record["caller_disposition"], record["stage"], record["code"]) == ("completed", "ended_not_attempted", "APPROVAL_DENIED")
    assert [e["kind"] for e in record["events"]] == [
        "ACTION_ACCEPTED", "PREFLIGHT_VALIDATED", "APPROVAL_REQUESTED", "APPROVAL_DENIED", "CALLER_ANSWERED"]
    time.sleep(0.3)  # the lines are written a loop turn or two after the end
    ended = [line for line in broker.logs().splitlines() if card["invocation_id"] in line and '"invocation ended"' in line]
    assert len(ended) == 1, "one end, logged and counted once (by whoever appended it, not again by the holder)"


def test_an_http2_agent_that_resets_its_held_request_cancels_it_and_an_approval_sends_nothing(broker, upstream):
    """RST_STREAM cancels one request and keeps the connection (mitmproxy tells the stream only
    after the request hook returns): the held request must end as when an agent hangs up."""
    body = b'{"deploy":"v46","stream":"reset"}'
    with H2Agent(broker, "ctl-held.example.test") as agent:
        stream = agent.request("POST", "/h/status?code=201", body)
        card = wait_for_card(broker, lambda c: c["body_bytes"] == len(body))
        agent.reset(stream)
        record = broker.wait_for(card["invocation_id"], lambda r: r["stage"] != "held", timeout=5)
        assert (record["outcome"], record["code"], record["phase"]) == ("not_attempted", "CALLER_CANCELLED", "validation")
        assert record["caller_disposition"] == "cancelled" and record["evidence"]["dispatch_started"] is False
        with broker.operator() as api:
            pending = [c["invocation_id"] for c in api.get("/v1/approvals").json()["items"]]
            assert card["invocation_id"] not in pending, "the card is gone"
            approve = api.post(f"/v1/approvals/{card['invocation_id']}", json={"decision": "approve", "note": "too late"})
        assert approve.status_code == 409, approve.text
        time.sleep(1.0)  # a holder that missed the reset would dispatch on its next look
        assert sent(upstream) == [], "nothing reached the upstream"
        after = broker.invocation(card["invocation_id"], broker.operator_token)
        assert [e["kind"] for e in after["events"]] == [
            "ACTION_ACCEPTED", "PREFLIGHT_VALIDATED", "APPROVAL_REQUESTED", "CALLER_CANCELLED", "FAILED"]
        # The connection carries on: another stream is held, and decided, as usual.
        again = agent.request("POST", "/h/status?code=201", body + b" ")
        second = wait_for_card(broker, lambda c: c["body_bytes"] == len(body) + 1)
        cli(broker, "approvals", "deny", second["invocation_id"])
        status, _, _ = agent.response(again)
        assert status == 403 and sent(upstream) == []


def test_no_decision_in_time_is_not_attempted_with_the_reason(make_broker, upstream):
    broker = make_broker("sqlite", routes=control_routes(upstream, approval_timeout="1s"))
    started = time.monotonic()
    response = Held(broker, b"{}").response()
    envelope = check_envelope(response.content)
    assert response.status_code == 409 and envelope["error"]["code"] == "APPROVAL_REQUIRED"
    assert envelope["error"]["outcome"] == "not_attempted" and "approval" in envelope["error"]["message"]
    assert response.headers["affidavit-idempotency-key"] == envelope["evidence"]["idempotency"]["key"]
    assert 0.9 < time.monotonic() - started < 10
    assert sent(upstream) == []


def test_a_changed_body_under_an_approved_key_is_stale_and_sends_nothing(broker, upstream):
    key = "deploy_" + secrets.token_hex(6)
    held = Held(broker, b'{"deploy":"v44"}', key=key)
    card = wait_for_card(broker)
    with broker.client() as client:
        changed = client.post(HELD + "/h/status?code=201", content=b'{"deploy":"v99"}', headers={"Idempotency-Key": key})
    stale = check_envelope(changed.content)
    assert (stale["error"]["code"], stale["error"]["outcome"]) == ("APPROVAL_STALE", "not_attempted")
    cli(broker, "approvals", "approve", card["invocation_id"])
    assert held.response().status_code == 201
    assert len(sent(upstream)) == 1 and sent(upstream)[0].body == b'{"deploy":"v44"}'


def test_an_approval_is_stale_if_the_credential_rotates_before_dispatch(make_broker, upstream, tmp_path):
    secret_file = tmp_path / "payments.key"
    secret_file.write_text("first-secret-value")
    broker = make_broker("sqlite", routes=control_routes(upstream), start=False,
                         env={"AFFIDAVIT_FAILPOINTS": "after_approval=pause:8@1"})
    broker.config["secrets"][0]["from"] = f"file:{secret_file}"
    broker.config_path.write_text(__import__("tomli_w").dumps(broker.config))
    broker.start()
    held = Held(broker, b'{"deploy":"v45"}')
    card = wait_for_card(broker)
    cli(broker, "approvals", "approve", card["invocation_id"])
    # The broker pauses 8 s between the approval and reading the credential: wide enough for a
    # loaded machine (1.5 s was not: the CLI's own exit took longer, and the old secret was read).
    secret_file.write_text("rotated-secret-value")
    response = held.response()
    envelope = check_envelope(response.content)
    assert (envelope["error"]["code"], envelope["error"]["phase"], envelope["error"]["outcome"]) == (
        "APPROVAL_STALE", "validation", "not_attempted")
    assert sent(upstream) == [], "the old approval authorises nothing new"


def test_a_retry_after_an_unknown_outcome_asks_again_and_says_so(broker, upstream):
    key = "deploy_" + secrets.token_hex(6)
    first = Held(broker, b'{"deploy":"v46"}', key=key, path="/h/idem_honour?code=201&lose=1")
    card = wait_for_card(broker, lambda c: not c.get("retry_of_uncertain_action"))
    cli(broker, "approvals", "approve", card["invocation_id"])
    lost = check_envelope(first.response().content)
    assert lost["error"]["outcome"] == "unknown" and lost["error"]["retry"] == "same_idempotency_key"
    again = Held(broker, b'{"deploy":"v46"}', key=key, path="/h/idem_honour?code=201&lose=1")
    retry_card = wait_for_card(broker, lambda c: c.get("retry_of_uncertain_action") is True)
    assert retry_card["invocation_id"] == card["invocation_id"]
    cli(broker, "approvals", "approve", retry_card["invocation_id"])
    assert again.response().status_code == 201
    assert upstream.effects_by_key[key] == 1 and len(sent(upstream)) == 2


def test_a_denied_repeat_of_an_unknown_outcome_says_unknown_not_never_sent(broker, upstream):
    """The repeat sent nothing, but the first attempt was sent: an answer saying `not_attempted`
    would tell the agent a new operation (a new key) is safe, and that can be a second effect."""
    key = "deploy_" + secrets.token_hex(6)
    again, card = _uncertain_then_held_again(broker, key)
    cli(broker, "approvals", "deny", card["invocation_id"])
    response = again.response()
    denied = check_envelope(response.content)
    assert (response.status_code, denied["error"]["code"]) == (403, "APPROVAL_DENIED")
    assert denied["error"]["outcome"] == "unknown" and response.headers["affidavit-outcome"] == "unknown", denied
    assert "earlier attempt" in denied["error"]["message"] and denied["evidence"]["dispatch_started"] is True, denied
    assert broker.invocation(card["invocation_id"])["outcome"] == "unknown"
    assert upstream.effects_by_key[key] == 1


def test_a_stop_ends_a_held_request_no_key_of_the_agents_names_and_withdraws_its_card(make_broker, upstream):
    """Without an Idempotency-Key of its own (the broker made one), no repeat can take the hold
    over: telling the agent to repeat with "the same key" was false, and the card stayed held for
    good (recovery leaves held cards alone). It ends, not attempted, and its card goes."""
    broker = make_broker("sqlite", routes=control_routes(upstream))
    held = Held(broker, b'{"deploy":"v50"}', timeout=15)
    card = wait_for_card(broker)
    broker.stop()
    answer = held.response()
    told = check_envelope(answer.content)
    assert (answer.status_code, told["error"]["code"], told["error"]["outcome"]) == (409, "APPROVAL_REQUIRED", "not_attempted")
    assert "cannot be taken over by a repeat, so it ends here" in told["error"]["message"], told
    broker.start()
    assert broker.invocation(card["invocation_id"])["stage"] == "ended_not_attempted"
    assert wait_for_card_list(broker) == []
    assert sent(upstream) == []


def test_a_stop_while_a_resend_of_an_unknown_outcome_is_held_says_unknown_and_the_same_key(make_broker, upstream):
    """The held repeat sent nothing, but its first attempt was sent: the stop's answer must not
    say `not_attempted`/`backoff`, which would let an agent take a new key (a second effect)."""
    broker = make_broker("sqlite", routes=control_routes(upstream))
    key = "deploy_" + secrets.token_hex(6)
    again, card = _uncertain_then_held_again(broker, key)
    broker.stop()
    answer = again.response()
    told = check_envelope(answer.content)
    assert (answer.status_code, told["error"]["code"], told["error"]["outcome"], told["error"]["retry"]) == (
        409, "APPROVAL_REQUIRED", "unknown", "same_idempotency_key"), told
    assert "earlier attempt of this invocation was sent" in told["error"]["message"], told
    assert answer.headers["affidavit-outcome"] == "unknown", answer.headers
    broker.start()
    assert broker.invocation(card["invocation_id"])["stage"] == "held"
    assert upstream.effects_by_key[key] == 1


def _uncertain_then_held_again(broker: BrokerProcess, key: str) -> tuple[Held, dict[str, Any]]:
    """A keyed, approved request whose answer was lost (unknown), and its repeat held again for
    approval (a re-send card): the repeat, and its card."""
    path = "/h/idem_honour?code=201&lose=1"
    first = Held(broker, b'{"deploy":"v47"}', key=key, path=path)
    cli(broker, "approvals", "approve", wait_for_card(broker)["invocation_id"])
    lost = check_envelope(first.response().content)
    assert (lost["error"]["outcome"], lost["error"]["retry"]) == ("unknown", "same_idempotency_key"), lost
    again = Held(broker, b'{"deploy":"v47"}', key=key, path=path)
    return again, wait_for_card(broker, lambda c: c.get("retry_of_uncertain_action") is True)


def test_a_resend_approved_after_its_lease_lapsed_is_sent_once_not_wedged(make_broker, upstream):
    """The operator takes longer than [proxy] retry_lease to approve a re-send. Nobody else took
    the invocation meanwhile, so the broker renews its own lease and sends: it does not answer
    LEASE_LOST and leave the record 'approved' with nobody to send it."""
    broker = make_broker("sqlite", routes=control_routes(upstream), proxy={"retry_lease": "1s"})
    key = "deploy_" + secrets.token_hex(6)
    again, card = _uncertain_then_held_again(broker, key)
    time.sleep(1.5)  # the re-send's lease lapses while the card waits
    cli(broker, "approvals", "approve", card["invocation_id"])
    response = again.response()
    assert response.status_code == 201, broker.logs()[-6000:]
    assert upstream.effects_by_key[key] == 1 and len(sent(upstream)) == 2
    record = broker.wait_for(card["invocation_id"], lambda r: r["stage"] == "delivered")
    assert (record["outcome"], record["retry_budget"]["used"]) == ("committed", 1), record


def test_a_resend_approved_after_the_retention_closed_is_not_sent(make_broker, upstream):
    """The remote contract's retention window closes while a re-send waits for approval: the
    re-send no longer has the key's protection, so it is refused at the dispatch boundary, and
    the record says reconcile."""
    routes = control_routes(upstream)
    routes[1]["idempotency"] = {**routes[1]["idempotency"], "retention": "6s"}
    broker = make_broker("sqlite", routes=routes)
    key = "deploy_" + secrets.token_hex(6)
    again, card = _uncertain_then_held_again(broker, key)
    expires = datetime.fromisoformat(broker.invocation(card["invocation_id"])["idempotency"]["expires_at"])
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.3)
    cli(broker, "approvals", "approve", card["invocation_id"])
    response = again.response()
    body = check_envelope(response.content)
    assert (response.status_code, body["error"]["code"], body["error"]["outcome"], body["error"]["retry"]) == (
        409, "RECONCILE_REQUIRED", "unknown", "reconcile"), body
    assert len(sent(upstream)) == 1, "the re-send was not sent"
    record = broker.wait_for(card["invocation_id"], lambda r: r["retry"] is not None)
    assert (record["outcome"], record["retry"], record["next_action"]) == ("unknown", "reconcile", "reconcile"), record


def held_then_restarted(make_broker, upstream, body: bytes, **recovery: str) -> tuple[BrokerProcess, str, dict[str, Any]]:
    """A PostgreSQL broker holds a keyed request for approval, is killed and started again."""
    broker = make_broker("postgresql", routes=control_routes(upstream), recovery=recovery)
    key = "deploy_" + secrets.token_hex(6)
    Held(broker, body, key=key, timeout=5)
    card = wait_for_card(broker)
    broker.kill()
    broker.start()
    return broker, key, card


@pytest.mark.parametrize("how", ["SIGTERM", "supervisor killed"])
def test_a_stop_leaves_a_held_request_held_and_does_not_log_it_ended(make_broker, upstream, how):
    """The broker stops while a request waits for approval: on SIGTERM, or (`--workers 2`) because
    its supervisor was killed with SIGKILL and the orphaned workers stop by themselves. Cutting the
    agent's connection on the way is the broker stopping, not the agent leaving: the request stays
    held (as across a crash), and no "invocation ended" line claims an end the journal does not
    have. The agent is told so at once: it got an empty reply, after the stop's 5 s wait."""
    from tests.test_workers import wait_gone, worker_pids

    workers = how == "supervisor killed"
    broker = make_broker("sqlite", routes=control_routes(upstream), **({"proxy": {"workers": 2}} if workers else {}))
    pids = worker_pids(broker) if workers else []
    key = "deploy_" + secrets.token_hex(6)
    held = Held(broker, b'{"deploy":"v49"}', key=key, timeout=15)
    card = wait_for_card(broker)
    stopping = time.monotonic()
    if workers:
        assert broker.proc is not None
        broker.proc.kill()  # the supervisor only: its workers notice within a second and stop
        broker.proc.wait(5)
        broker.proc = None
        assert wait_gone(pids, timeout=15) == [], "the orphaned workers did not stop"
        assert "the supervisor (pid" in broker.logs(), "the workers' own log lines reach the test's log"
    else:
        broker.stop()
    answer = held.response()
    told = check_envelope(answer.content)
    assert answer.status_code == 409 and told["invocation_id"] == card["invocation_id"], answer.text
    assert (told["error"]["code"], told["error"]["outcome"], told["error"]["retry"]) == (
        "APPROVAL_REQUIRED", "not_attempted", "backoff"), told
    assert told["error"]["message"].startswith("The broker is stopping") and "stays held" in told["error"]["message"]
    assert answer.headers["affidavit-idempotency-key"] == key
    assert time.monotonic() - stopping < 10 + (15 if workers else 0), "the stop waited for the held request"
    assert "still being handled" not in broker.logs()
    ended = [e for e in broker.log_entries()
             if e.get("msg") == "invocation ended" and e.get("invocation_id") == card["invocation_id"]]
    assert ended == [], ended
    broker.start()
    record = broker.invocation(card["invocation_id"])  # the agent's own view
    assert (record["stage"], record["caller_disposition"]) == ("held", "waiting"), record
    if not workers:  # the restarted broker knows its earlier incarnation is gone (a worker, only its own)
        # Nothing moves until the agent repeats it with its key: not "wait", which an agent's
        # client would follow until it gave up.
        assert record["next_action"] == "retry_same_key", record
    assert [c["invocation_id"] for c in wait_for_card_list(broker)] == [card["invocation_id"]]
    assert sent(upstream) == []


def wait_for_card_list(broker: BrokerProcess) -> list[dict[str, Any]]:
    with broker.operator() as api:
        return api.get("/v1/approvals").json()["items"]


def test_a_card_whose_broker_stopped_says_no_caller_waits_on_it(make_broker, upstream):
    """A held request outlives its broker (the agent repeats it to be held again), so its card
    stays listed; an operator must see that approving it sends nothing until that repeat."""
    broker = make_broker("postgresql", routes=control_routes(upstream), recovery={"heartbeat": "0.3s", "stale_after": "1s"})
    Held(broker, b'{"deploy":"v49"}', key="deploy_" + secrets.token_hex(6), timeout=5)
    card = wait_for_card(broker)
    assert card["owner"]["stale"] is False and card["owner"]["broker"], card
    assert "waiting" in cli(broker, "approvals", "list")
    broker.kill()
    broker.start()
    time.sleep(1.5)  # past stale_after: the old incarnation beats no more
    [listed] = wait_for_card_list(broker)
    assert listed["invocation_id"] == card["invocation_id"] and listed["owner"]["broker"] == card["owner"]["broker"]
    assert listed["owner"]["stale"] is True and listed["owner"]["silent_s"] >= 1.0, listed["owner"]
    listing = cli(broker, "approvals", "list")
    assert "gone (approval waits for a repeat)" in " ".join(listing.split()), listing
    approved = cli(broker, "approvals", "approve", card["invocation_id"])
    assert "nothing is sent until the agent repeats the request with the same Idempotency-Key" in approved, approved
    record = broker.invocation(card["invocation_id"])
    assert (record["stage"], record["next_action"]) == ("approved", "retry_same_key"), record
    shown = json.loads(cli(broker, "invocations", "show", card["invocation_id"]))
    assert (shown["stage"], shown["next_action"], shown["owner"]["stale"]) == ("approved", "retry_same_key", True), shown


def test_a_held_request_survives_a_restart(make_broker, upstream):
    broker, key, card = held_then_restarted(make_broker, upstream, b'{"deploy":"v47"}', heartbeat="0.5s", stale_after="2s")
    assert wait_for_card(broker)["invocation_id"] == card["invocation_id"], "the restart did not forget it"
    time.sleep(2.5)  # the old incarnation's heartbeat is stale: the agent's retry may take the wait over
    resumed = Held(broker, b'{"deploy":"v47"}', key=key)
    time.sleep(0.5)
    cli(broker, "approvals", "approve", card["invocation_id"])
    response = resumed.response()
    assert response.status_code == 201 and response.headers["affidavit-invocation-id"] == card["invocation_id"]
    assert len(sent(upstream)) == 1
    assert json.loads(sent(upstream)[0].body) == {"deploy": "v47"}
