"""End to end: a real broker process, real clients (curl, httpx, requests), a real TLS upstream.

Runs once per journal dialect (SQLite and PostgreSQL) through the module-scoped ``broker``.
"""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from tests.conftest import BrokerFactory, standard_routes
from tests.support.canaries import CANARIES
from tests.support.broker import BrokerProcess, big_answer_over_http1
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream, reencodings
from tests.support.journal import dispatched_ids, dump_journal, query

PAYMENTS = "https://api.payments.test"
EXPECTED_KINDS = [
    "ACTION_ACCEPTED",
    "PREFLIGHT_VALIDATED",
    "CREDENTIAL_AUTHORIZED",
    "DISPATCH_STARTED",
    "REMOTE_RESPONSE_COMPLETE",
    "RESULT_COMMITTED",
    "RESULT_DELIVERED",
]

#: Every body and header the broker returned in this module, grepped by the canary test.
SEEN: list[str] = []


def _seen(response: httpx.Response) -> httpx.Response:
    SEEN.append(response.text)
    SEEN.append(json.dumps(dict(response.headers)))
    return response


def split_curl(output: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of `curl -i` output (skipping the CONNECT response)."""
    text = output
    while True:
        head, _, rest = text.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if head.startswith(b"HTTP/1.1 200 Connection established") or status == 100:
            text = rest
            continue
        break
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    SEEN.append(output.decode("latin-1"))
    return status, headers, rest


def test_curl_https_call_is_injected_recorded_and_replayable(broker: BrokerProcess, upstream: HostileUpstream):
    done = broker.curl(f"{PAYMENTS}/h/status?code=201&job=job-42", "-X", "POST", "-H", "Content-Type: application/json", "-d", '{"amount":100}')
    assert done.returncode == 0, done.stderr
    status, headers, body = split_curl(done.stdout)
    assert status == 201
    assert headers["affidavit-outcome"] == "committed"
    invocation_id = headers["affidavit-invocation-id"]
    assert invocation_id.startswith("act_")
    assert json.loads(body) == {"job_id": "job-42", "status": "pending"}

    [seen] = upstream.received
    assert seen.header("Authorization") == f"Bearer {CANARIES['PAYMENTS_KEY']}"
    assert seen.header("Proxy-Authorization") is None
    assert seen.method == "POST" and seen.body == b'{"amount":100}'
    assert seen.sni == "api.payments.test"

    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    with broker.api() as api:
        mine = _seen(api.get(f"/v1/invocations/{invocation_id}")).json()
    assert mine["phase"] == "result_delivery"
    assert mine["outcome"] == "committed"
    assert mine["retry"] == "never"
    assert mine["next_action"] == "return_recorded_result"
    assert mine["route"] == "payments.create"
    assert mine["fingerprint"].startswith("sha256:") and len(mine["fingerprint"]) == 71
    assert mine["credential"] == {"id": "payments-key", "version": "env", "injection": "header"}
    assert [e["kind"] for e in mine["events"]] == EXPECTED_KINDS
    assert [e["seq"] for e in mine["events"]] == list(range(1, len(EXPECTED_KINDS) + 1))
    assert mine["evidence"]["dispatch_seq"] == 4
    assert mine["evidence"]["framing"] == "content-length"
    assert mine["evidence"]["peer_certificate"].startswith("sha256:")
    assert mine["caller_disposition"] == "completed"
    assert record["outcome"] == "committed"

    with broker.api() as api:
        replay = _seen(api.get(f"/v1/invocations/{invocation_id}/result"))
    assert replay.status_code == 201
    assert replay.content == body
    assert replay.headers["content-type"] == "application/json"
    assert replay.headers["affidavit-replayed"] == "true"
    assert len(upstream.received) == 1, "fetching a result must never re-execute it"


def test_basic_injection_and_plain_http(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        r = _seen(client.get("https://basic.example.test/h/status?code=200"))
        assert r.status_code == 200 and r.headers["affidavit-outcome"] == "committed"
        r = _seen(client.post("http://plain.example.test/h/status?code=202", content=b"x"))
        assert r.status_code == 202
    basic, plain = upstream.received
    expected = base64.b64encode(f"svc:{CANARIES['BASIC_KEY']}".encode()).decode()
    assert basic.header("Authorization") == f"Basic {expected}"
    assert plain.header("X-Api-Key") == CANARIES["PAYMENTS_KEY"]
    assert plain.tls is None


def test_an_echoed_credential_never_reaches_the_agent(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        r = _seen(client.get(f"{PAYMENTS}/h/ok"))
    assert r.status_code == 200
    echoed = dict((k.lower(), v) for k, v in r.json()["headers"])
    assert echoed["authorization"] == "[REDACTED]"
    assert CANARIES["PAYMENTS_KEY"] not in r.text
    assert upstream.received[0].header("Authorization") == f"Bearer {CANARIES['PAYMENTS_KEY']}"


def test_a_secret_holding_a_line_break_is_a_credential_failure_not_a_connection_failure(make_broker, upstream: HostileUpstream):
    """A secret whose value holds CR/LF could not be written into its header: the upstream client
    refused it, and the agent got 502 CONNECT_FAILED, phase connection_setup, "check the route's
    host, port or connect_to", with x-should-retry: true. It is the credential that cannot be
    used: CREDENTIAL_MISSING, phase credential_injection, nothing sent, the value never shown."""
    secret = "abcd1234-" + secrets.token_hex(4)
    broker = make_broker("sqlite", env={"PAYMENTS_KEY": secret + "\r\nX-Evil: 1"})
    upstream.reset()
    with broker.client() as client:
        answer = client.post(PAYMENTS + "/h/ok", content=b"{}")
    error = check_envelope(answer.content)["error"]
    assert (answer.status_code, error["code"], error["phase"], error["outcome"]) == (
        502, "CREDENTIAL_MISSING", "credential_injection", "not_attempted"), answer.text
    assert "holds a line break or another control character" in error["message"], error
    assert upstream.received == [], "nothing was sent"
    assert secret not in answer.text and secret not in broker.logs() and secret not in dump_journal(broker.database_url)


@pytest.mark.parametrize("coding", ["gzip", "zstd", "deflate", "raw-deflate"])
def test_an_echoed_credential_is_found_inside_a_compressed_body(broker: BrokerProcess, upstream: HostileUpstream, coding: str):
    """An upstream that echoes the request's headers gzipped (or br, zstd, deflate) would hand
    the injected secret to any client that decompresses: the broker looks through the coding."""
    from mitmproxy.net.encoding import decode

    secret = CANARIES["PAYMENTS_KEY"].encode()
    with broker.client() as client:
        with client.stream("GET", f"{PAYMENTS}/h/ok?encode={coding}") as r:
            raw = b"".join(r.iter_raw())
            status, headers = r.status_code, r.headers
    invocation_id = headers["affidavit-invocation-id"]
    assert status == 200 and upstream.received[-1].header("Authorization") == f"Bearer {CANARIES['PAYMENTS_KEY']}"
    assert headers["content-encoding"] == coding.removeprefix("raw-")

    def plain(body: bytes) -> bytes:
        for applied in reversed([c.strip() for c in headers["content-encoding"].split(",")]):
            body = decode(body, applied)
        return body

    delivered = plain(raw)
    assert secret not in delivered and b'"[REDACTED]"' in delivered, delivered[:300]
    assert int(headers["content-length"]) == len(raw)
    with broker.api() as api:
        with api.stream("GET", f"/v1/invocations/{invocation_id}/result") as fetched:
            stored = b"".join(fetched.iter_raw())
    assert secret not in plain(stored) and b'"[REDACTED]"' in plain(stored)
    record = broker.invocation(invocation_id)
    assert next(e for e in record["events"] if e["kind"] == "RESULT_COMMITTED")["data"]["redacted"] is True


def test_a_transfer_coding_is_undone_and_looked_inside(broker: BrokerProcess, upstream: HostileUpstream):
    """Transfer-Encoding: gzip, chunked is hop-by-hop: the broker drops the header, so it must
    undo the coding too (and look inside it for the secret)."""
    with broker.client() as client:
        r = _seen(client.get(f"{PAYMENTS}/h/ok?te=gzip"))
    assert r.status_code == 200 and "transfer-encoding" not in r.headers and "content-encoding" not in r.headers
    assert CANARIES["PAYMENTS_KEY"] not in r.text and dict((k.lower(), v) for k, v in r.json()["headers"])["authorization"] == "[REDACTED]"
    with broker.client("reviewer") as client:  # a route without a credential: undone too, nothing to redact
        plain = _seen(client.get("https://review.example.test/h/ok?te=gzip"))
    assert plain.status_code == 200 and plain.json()["path"] == "/h/ok?te=gzip"


def test_br_is_not_asked_for_on_a_credential_route_and_a_br_body_is_withheld(broker: BrokerProcess, upstream: HostileUpstream):
    """brotli 1.1 cannot decode with a memory bound, so the broker cannot look inside br."""
    with broker.client() as client:
        with client.stream("GET", f"{PAYMENTS}/h/ok?encode=br", headers={"Accept-Encoding": "br, gzip;q=0.8"}) as r:
            raw = b"".join(r.iter_raw())
    SEEN.append(raw.decode("latin-1") + json.dumps(dict(r.headers)))
    assert upstream.received[-1].header("Accept-Encoding") == "gzip;q=0.8", "br is not asked for"
    assert (r.status_code, raw) == (200, b"") and "br cannot be decoded" in r.headers["affidavit-withheld"]
    with broker.client("reviewer") as client:  # without a credential nothing is looked for, nothing withheld
        plain = _seen(client.get("https://review.example.test/h/ok?encode=br", headers={"Accept-Encoding": "br"}))
    assert upstream.received[-1].header("Accept-Encoding") == "br" and plain.json()["path"] == "/h/ok?encode=br"


def test_a_body_under_more_codings_than_the_broker_undoes_is_withheld(broker: BrokerProcess, upstream: HostileUpstream):
    """Each coding is decoded, and encoded again after a redaction, in turn: a body gzipped a
    thousand times over would hold the event loop for seconds. Past four, it is not looked into."""
    with broker.client() as client:
        four = client.get(f"{PAYMENTS}/h/ok?encode=gzip*4")
        with client.stream("GET", f"{PAYMENTS}/h/ok?encode=gzip*5") as r:
            raw = b"".join(r.iter_raw())
    assert four.status_code == 200 and b"[REDACTED]" in four.content, "four are looked through (httpx undoes them)"
    assert (r.status_code, r.headers["affidavit-outcome"], raw) == (200, "committed", b"")
    assert "5 codings stacked" in r.headers["affidavit-withheld"]


def test_a_compressed_body_too_big_to_look_inside_is_withheld(broker: BrokerProcess, upstream: HostileUpstream):
    """64 MiB of zeros and then the echo, gzipped to 64 KiB: more than max_response_body once
    decoded, so the broker cannot tell whether the secret is in it. It keeps the status and the
    outcome, and hands over (and stores) no body rather than a body it could not check."""
    with broker.client() as client:
        with client.stream("GET", f"{PAYMENTS}/h/ok?encode=bomb") as r:
            raw = b"".join(r.iter_raw())
    SEEN.append(raw.decode("latin-1") + json.dumps(dict(r.headers)))
    assert (r.status_code, r.headers["affidavit-outcome"], raw) == (200, "committed", b"")
    assert "once decoded" in r.headers["affidavit-withheld"] and "content-encoding" not in r.headers
    invocation_id = r.headers["affidavit-invocation-id"]
    with broker.api() as api:
        fetched = _seen(api.get(f"/v1/invocations/{invocation_id}/result"))
    assert fetched.status_code == 200 and fetched.content == b"" and "affidavit-withheld" in fetched.headers
    record = broker.invocation(invocation_id)
    committed = next(e for e in record["events"] if e["kind"] == "RESULT_COMMITTED")
    assert "once decoded" in committed["data"]["withheld"]
    line = next(line for line in broker.logs().splitlines() if "was withheld" in line and invocation_id in line)
    assert "gzip" in line


def test_affidavit_env_lines_work_for_requests(broker: BrokerProcess, upstream: HostileUpstream):
    done = broker.command("env", "--agent", "builder", "--token", broker.agents["builder"].token)
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    for line in done.stdout.decode().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip('"')
    assert env["SSL_CERT_FILE"] == str(broker.ca_path.absolute())
    script = "import requests; r = requests.get('https://api.payments.test/h/status?code=200', timeout=20); print(r.status_code, r.headers['Affidavit-Outcome'])"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode().split() == ["200", "committed"]
    assert upstream.received[0].header("Authorization") == f"Bearer {CANARIES['PAYMENTS_KEY']}"


def _raw(port: int, request: bytes, source: str | None = None) -> bytes:
    """One request on a raw socket (curl hides the body of a refused CONNECT), from ``source``
    (an address of 127.0.0.0/8) when given."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


@pytest.mark.parametrize("target", [b"/x", b"api.payments.test", b":443"])
def test_a_connect_without_host_and_port_opens_no_tunnel(broker: BrokerProcess, upstream: HostileUpstream, target: bytes):
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    answer = _raw(broker.proxy_port, b"CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n"
                  % (target, target, basic))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    error = check_envelope(body)["error"]
    assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted"), error
    # mitmproxy's parser refuses a target without a port itself; "/x" parses, and the broker refuses it
    assert target != b"/x" or "host:port" in error["message"], error
    assert upstream.received == []


@pytest.mark.parametrize("version,auth_name", [(b"HTTP/2.0", b"Proxy-Authorization"), (b"HTTP/2.0", b"proxy-authorization"),
                                               (b"HTTP/3.0", b"Proxy-Authorization"), (b"HTTP/1.9", b"Proxy-Authorization")])
@pytest.mark.parametrize("method", [b"GET", b"CONNECT"])
def test_a_request_line_with_another_version_on_an_http1_connection_is_refused_as_such(
        broker: BrokerProcess, upstream: HostileUpstream, version: bytes, auth_name: bytes, method: bytes):
    """mitmproxy reads ``GET ... HTTP/2.0`` on an HTTP/1 connection and calls it HTTP/2: it was
    refused for 'Proxy-Authorization' not being a valid HTTP/2 field name, and with the header in
    lower case forwarded (as HTTP/1.1), as were other versions; a CONNECT opened its tunnel.
    Each is refused for what it is, unrecorded."""
    upstream.reset()
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    target = b"plain.example.test:80" if method == b"CONNECT" else b"http://plain.example.test/h/ok"
    answer = _raw(broker.proxy_port, b"%s %s %s\r\nhost: plain.example.test\r\n%s: Basic %s\r\n\r\n"
                  % (method, target, version, auth_name, basic))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:300]
    error = check_envelope(body)["error"]
    assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted"), error
    assert f"The request line says {version.decode()}, but this connection speaks HTTP/1" in error["message"], error
    assert json.loads(body)["invocation_id"] is None
    assert upstream.received == []


def test_a_folded_header_line_is_refused_as_such(broker: BrokerProcess, upstream: HostileUpstream):
    """obs-fold (a header continued on a line that begins with a space): mitmproxy joins the lines
    with the line break, which the broker refuses; the message says it was a fold."""
    upstream.reset()
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    answer = _raw(broker.proxy_port, b"GET http://plain.example.test/h/ok HTTP/1.1\r\nHost: plain.example.test\r\n"
                  b"X-Note: one\r\n two\r\nProxy-Authorization: Basic %s\r\n\r\n" % basic)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    error = check_envelope(body)["error"]
    assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted"), error
    assert ("The request header 'X-Note' holds a control character (here a continuation line: HTTP/1's obsolete "
            "line folding)") in error["message"], error
    assert upstream.received == []


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_proxy_token_gets_407_and_nothing_is_sent(broker: BrokerProcess, upstream: HostileUpstream, token):
    auth = b"" if token is None else b"Proxy-Authorization: Basic " + base64.b64encode(f"builder:{token}".encode()) + b"\r\n"
    def rejected() -> list[str]:
        return [line for line in broker.logs().splitlines() if "proxy credentials rejected for agent 'builder'" in line]

    before = len(rejected())
    source = f"127.0.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}"  # a pair no other test logged
    requests_ = [
        b"CONNECT api.payments.test:443 HTTP/1.1\r\nHost: api.payments.test:443\r\n" + auth + b"\r\n",
        b"GET http://plain.example.test/h/ok HTTP/1.1\r\nHost: plain.example.test\r\n" + auth + b"\r\n",
    ]
    for request in requests_:
        answer = _raw(broker.proxy_port, request, source)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 407"), head
        assert b"proxy-authenticate: basic" in head.lower()
        # Wrong credentials end the connection; missing ones keep it for the client's retry.
        assert (b"\r\nconnection: close" in head.lower()) == (token is not None), head
        envelope = check_envelope(body)
        SEEN.append(json.dumps(envelope))
        assert envelope["error"]["code"] == "PROXY_AUTH_REQUIRED"
        assert envelope["error"]["outcome"] == "not_attempted"
        assert envelope["invocation_id"] is None
        # No credentials: how to give them. Wrong ones: that they were refused, for which agent.
        expected = "is required" if token is None else "proxy credentials were not accepted"
        assert expected in envelope["error"]["message"], envelope["error"]["message"]
    assert upstream.received == []
    # The second rejection from the same address within a minute is counted, not logged again.
    assert [line for line in rejected()[before:] if f"from {source}" in line] == rejected()[before:]
    assert len(rejected()) - before == (0 if token is None else 1), rejected()
    assert not any("wrong-token" in line for line in broker.logs().splitlines()), "the token is never logged"


@pytest.mark.parametrize("header", [
    b"Basic " + base64.b64encode(b"tok-in-the-name-slot-7f3a9c:"),  # http://TOKEN@host: a token where the name goes
    "Bearer \u00e9t\u00e9".encode("utf-8"),  # not Basic, not ASCII
    b"Basic !!!not-base64!!!",
])
def test_malformed_or_misplaced_proxy_credentials_get_a_407_that_repeats_nothing(broker: BrokerProcess, upstream: HostileUpstream, header):
    answer = _raw(broker.proxy_port, b"GET http://plain.example.test/h/ok HTTP/1.1\r\nHost: plain.example.test\r\nProxy-Authorization: " + header + b"\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 407"), head
    envelope = check_envelope(body)
    assert envelope["error"]["code"] == "PROXY_AUTH_REQUIRED"
    assert b"tok-in-the-name-slot" not in answer
    assert "tok-in-the-name-slot" not in broker.logs(), "an unknown agent name may be a token: never logged"
    assert "Traceback" not in broker.logs()
    assert upstream.received == []


def _refused(response: httpx.Response, status: int, code: str, phase: str = "validation") -> dict[str, Any]:
    _seen(response)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = check_envelope(response.content)
    assert body["error"]["code"] == code
    assert body["error"]["phase"] == phase
    assert body["error"]["outcome"] == "not_attempted"
    assert body["error"]["retry"] == "after_correction"
    assert body["invocation_id"] == response.headers["affidavit-invocation-id"]
    assert body["evidence"]["dispatch_started"] is False
    return body


def test_refusals_are_recorded_envelopes_and_send_nothing(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        no_route = _refused(client.get("https://unknown.example.test/x"), 403, "INVALID_TARGET")
        not_mine = _refused(client.get("https://review.example.test/h/ok"), 403, "INVALID_TARGET")
        override = _refused(client.get(f"{PAYMENTS}/h/ok", headers={"Authorization": "Bearer mine"}), 403, "FORBIDDEN_HEADER_OVERRIDE")
        method = _refused(client.request("PATCH", f"{PAYMENTS}/h/ok"), 405, "UNSUPPORTED_ACTION")
        too_big = _refused(client.post(f"{PAYMENTS}/h/ok", content=b"x" * (64 * 1024 + 1)), 413, "PAYLOAD_LIMIT")
        # The side API called through the proxy: no route could ever be right, so the answer says
        # to call it directly rather than to ask an operator for one.
        side_api = _refused(client.get(broker.api_url + "/v1/invocations"), 403, "INVALID_TARGET")
    assert upstream.received == []
    assert "this broker's own side API" in side_api["error"]["message"] and "NO_PROXY" in side_api["error"]["message"]
    assert "side API" not in no_route["error"]["message"]
    for body in (no_route, not_mine, override, method, too_big):
        record = broker.invocation(body["invocation_id"])
        assert record["outcome"] == "not_attempted"
        assert record["code"] == body["error"]["code"]
        assert [e["kind"] for e in record["events"]][-1] == "FAILED"
        assert "DISPATCH_STARTED" not in [e["kind"] for e in record["events"]]
    assert "review.example.test" not in no_route["error"]["message"]
    # A method the route does not allow is on that route's record (and counted under it).
    assert broker.invocation(method["invocation_id"])["route"] == "payments.create"
    assert broker.invocation(no_route["invocation_id"])["route"] is None
    assert broker.invocation(not_mine["invocation_id"])["route"] is None, "a route the agent may not use stays unnamed"
    with broker.operator() as api:
        exposition = _seen(api.get("/metrics")).text
    counted = [line for line in exposition.splitlines() if line.startswith("affidavit_invocations_total{")
               and 'code="UNSUPPORTED_ACTION"' in line]
    assert counted and all('route="payments.create"' in line for line in counted), exposition


def test_invocations_show_and_result_read_the_journal_and_say_which_is_missing(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        ok = _seen(client.get(f"{PAYMENTS}/h/ok"))
        refused = _refused(client.get("https://unknown.example.test/x"), 403, "INVALID_TARGET")["invocation_id"]
    done = broker.command("invocations", "show", ok.headers["affidavit-invocation-id"])
    assert done.returncode == 0 and json.loads(done.stdout)["agent"] == "builder", done.stderr
    done = broker.command("invocations", "result", ok.headers["affidavit-invocation-id"])
    assert done.returncode == 0 and done.stdout == ok.content, done.stderr
    done = broker.command("invocations", "result", "--headers", ok.headers["affidavit-invocation-id"])
    assert done.returncode == 0 and done.stdout.startswith(b"HTTP 200") and done.stdout.endswith(ok.content)
    done = broker.command("invocations", "result", refused)
    err = done.stderr.decode()
    assert done.returncode == 1 and "has no stored result (outcome not_attempted, code INVALID_TARGET)" in err, err
    assert "it was never sent, so there is no response" in err and "no complete response was recorded" not in err, err
    for command in ("show", "result"):
        done = broker.command("invocations", command, "act_01M8TRTD8RSQZTD7JJN9HZ5237")
        assert done.returncode == 1 and b"no invocation 'act_01M8TRTD8RSQZTD7JJN9HZ5237' in the journal" in done.stderr, done


def test_invocations_list_reads_at_any_width_and_refuses_a_filter_typo(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        ids = [_refused(client.request("PATCH", f"{PAYMENTS}/h/ok"), 405, "UNSUPPORTED_ACTION")["invocation_id"] for _ in range(2)]
    listed = broker.command("invocations", "list", "--code", "UNSUPPORTED_ACTION", "--json")
    rows = {row["invocation_id"]: row for row in map(json.loads, listed.stdout.decode().splitlines())}
    assert set(ids) <= set(rows), listed
    assert rows[ids[0]]["route"] == "payments.create" and rows[ids[0]]["created_at"].endswith("+00:00")
    assert "T" in rows[ids[0]]["created_at"], "ISO 8601, as the side API writes times"
    for width in ("80", "200"):
        shown = broker.command("invocations", "list", "--code", "UNSUPPORTED_ACTION", env={"COLUMNS": width})
        text = shown.stdout.decode()
        assert shown.returncode == 0 and "…" not in text, text
        for invocation_id in ids:
            line = next(line for line in text.splitlines() if invocation_id in line)
            assert len(line.rstrip()) <= int(width), line
            around = text[text.index(invocation_id):][:int(width) * 3]
            assert "payments.create" in around and "UNSUPPORTED_ACTION" in around and "after_correction" in around, text
        if width == "200":
            continue  # the table
        # Broken between facts only: a label keeps its value, and every continuation is indented.
        rows_shown = text.splitlines()[1:]
        assert all(line.startswith(("act_", "    ")) for line in rows_shown if line.strip()), text
        assert not any(line.rstrip().endswith((" route", " retry", " status")) for line in rows_shown), text
    # A window reaching back past year 1 (where dates end) lists everything; it is no traceback.
    endless = broker.command("invocations", "list", "--code", "UNSUPPORTED_ACTION", "--since", "99999999999d", "--json")
    assert endless.returncode == 0 and set(ids) <= {json.loads(line)["invocation_id"] for line in endless.stdout.decode().splitlines()}, endless
    counted = broker.command("metrics", "--since", "99999999999d")
    assert counted.returncode == 0 and b"Traceback" not in counted.stderr, counted
    typo = broker.command("invocations", "list", "--outcome", "unknwon")
    assert typo.returncode == 2 and b"'unknwon' is not one of" in typo.stderr, typo
    # A route is free text (a removed route keeps its records): looked up, but a name the
    # configuration lacks is said, so a typo does not read as "nothing happened".
    for command in (("invocations", "list"), ("metrics",)):
        routed = broker.command(*command, "--route", "payments.craete")
        assert routed.returncode == 0 and b"the configuration has no route 'payments.craete'" in routed.stderr, routed
        assert b"payments.create" in routed.stderr, routed
        known = broker.command(*command, "--route", "payments.create")
        assert known.returncode == 0 and b"no route" not in known.stderr, known


def test_side_api_isolates_agents_and_hides_unknown_ids(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        r = _seen(client.get(f"{PAYMENTS}/h/ok"))
    invocation_id = r.headers["affidavit-invocation-id"]
    with broker.api(broker.agents["reviewer"].token) as api:
        other = _seen(api.get(f"/v1/invocations/{invocation_id}"))
        assert other.status_code == 404
        assert _seen(api.get(f"/v1/invocations/{invocation_id}/result")).status_code == 404
    with broker.api() as api:
        assert _seen(api.get("/v1/invocations/act_00000000000000000000000000")).status_code == 404
        assert _seen(api.get("/v1/invocations")).status_code == 403
        odd = _seen(api.get("/v1/invocations/act_%E2%82%AC%00x"))  # escaped once for the reader, not twice
        assert odd.status_code == 404 and odd.json()["detail"] == "No invocation 'act_\\u20ac\\x00x' is visible to this token."
    with broker.api("not-a-token") as api:
        assert _seen(api.get(f"/v1/invocations/{invocation_id}")).status_code == 401
    with broker.operator() as api:
        assert _seen(api.get(f"/v1/invocations/{invocation_id}")).json()["agent"] == "builder"
        listing = _seen(api.get("/v1/invocations", params={"route": "payments.create"})).json()
        assert invocation_id in [item["invocation_id"] for item in listing["items"]]
        assert all(item["created_at"].endswith("+00:00") for item in listing["items"]), "UTC, with its offset, on both dialects"
        for bogus in ({"outcome": "bogus"}, {"phase": "nowhere"}, {"code": "NOT_A_CODE"}):
            assert _seen(api.get("/v1/invocations", params=bogus)).status_code == 422, bogus
        assert _seen(api.get("/openapi.json")).status_code == 200


def test_another_agents_result_takes_as_long_to_refuse_as_an_id_that_does_not_exist(broker: BrokerProcess,
                                                                                    upstream: HostileUpstream):
    """docs/api.md: both get the same answer, so ids cannot be probed, and that includes its time.
    The result's fast path found the row and refused at once, while an unknown id went on to a
    second read: a 404 three times as fast said the id was real. Medians of interleaved requests
    (a loaded machine moves single ones by milliseconds)."""
    with broker.client() as client:
        real = _seen(client.get(f"{PAYMENTS}/h/ok")).headers["affidavit-invocation-id"]
    missing = "act_01M00000000000000000000000"
    ratios = []
    with broker.api(broker.agents["reviewer"].token) as api:
        # Up to three series: a burst of other load can skew one; a real difference (the fast
        # path's was 3x) shows in every one. Each pair alternates which id goes first.
        for _ in range(3):
            times: dict[str, list[float]] = {real: [], missing: []}
            for n in range(60):
                for invocation_id in (real, missing) if n % 2 == 0 else (missing, real):
                    started = time.perf_counter()
                    answer = api.get(f"/v1/invocations/{invocation_id}/result")
                    times[invocation_id].append(time.perf_counter() - started)
                    assert answer.status_code == 404, answer.text
                    assert answer.json()["detail"] == f"No invocation {invocation_id!r} is visible to this token."
            ratios.append(statistics.median(times[real]) / statistics.median(times[missing]))
            if 0.75 < ratios[-1] < 1.35:
                return
    pytest.fail(f"another agent's id answered in {', '.join(f'{r:.2f}' for r in ratios)}x the time of an unknown one")


def test_side_api_unknown_paths_and_methods_get_problem_documents(broker: BrokerProcess, upstream: HostileUpstream):
    """No redirect to another endpoint (``%2F`` decodes to a trailing slash), no bare
    ``{"detail": ...}``: the API's own errors are problem documents, token or not."""
    for api_of in (broker.operator, lambda: broker.api("not-a-token")):
        with api_of() as api:
            for path in ("/v1/invocations/", "/v1/invocations/%2F", "/v1/invocations/act_x/result/", "/v1/nope",
                         "/v1/invocations/act_x%2Fresult", "/v1/invocations%2fact_x",
                         "/docs", "/redoc"):  # no browsable pages (served without a token, scripts from a CDN)
                answer = _seen(api.get(path))
                assert answer.status_code == 404, (path, answer.status_code, answer.headers.get("location"))
                assert answer.headers["content-type"] == "application/problem+json", path
                assert "no such endpoint" in answer.json()["detail"], answer.text
            answer = _seen(api.delete("/v1/invocations"))
            assert answer.status_code == 405 and answer.headers["allow"] == "GET"
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["detail"] == "DELETE /v1/invocations: this endpoint takes only GET. See docs/api.md."
            answer = _seen(api.post("/healthz"))  # two routes on one path: both methods are named
            assert answer.status_code == 405 and answer.headers["allow"] == "GET, HEAD", answer.headers
            assert answer.json()["detail"] == "POST /healthz: this endpoint takes only GET, HEAD. See docs/api.md."


def test_an_unknown_id_is_answered_without_echoing_it_whole(broker: BrokerProcess):
    """A 20 KB id, or one with a line break, is named in the 404 cut and escaped, not repeated."""
    with broker.operator() as api:
        for invocation_id, shown in (("act_" + "x" * 20000, "act_" + "x" * 96 + "..."), ("act_a%0Ab", "act_a\\nb")):
            answer = _seen(api.get(f"/v1/invocations/{invocation_id}"))
            assert answer.status_code == 404 and answer.headers["content-type"] == "application/problem+json"
            detail = answer.json()["detail"]
            assert len(detail) < 300 and f"No invocation '{shown}' is visible" in detail, detail


def test_the_health_endpoints_answer_head_as_get_without_a_body(broker: BrokerProcess):
    """Load balancers and uptime checks often probe with HEAD: the same status and headers as
    GET, and no body (curl would complain of bytes after a HEAD answer)."""
    for path in ("/healthz", "/readyz"):
        got = httpx.get(broker.api_url + path, timeout=10)
        probe = subprocess.run(["curl", "-sS", "--max-time", "10", "-I", broker.api_url + path],
                               capture_output=True, text=True, timeout=20)
        assert probe.returncode == 0, probe.stderr
        status_line, *fields = probe.stdout.strip().splitlines()
        assert status_line.split()[1] == str(got.status_code) == "200", probe.stdout
        headers = dict(line.lower().split(": ", 1) for line in fields)
        assert headers["content-type"] == got.headers["content-type"], probe.stdout
        raw = _api_raw(broker, [b"HEAD " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
        head, _, after = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and after == b"", raw


def _no_traceback_since(broker: BrokerProcess, offset: int) -> None:
    logged = broker.logs()[offset:]
    assert "Traceback" not in logged, logged[-3000:]


def test_a_since_hours_past_the_calendar_lists_everything(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        invocation_id = _seen(client.get(f"{PAYMENTS}/h/ok")).headers["affidavit-invocation-id"]
    offset = len(broker.logs())
    with broker.operator() as api:
        for hours in ("1e8", "1e300", "inf"):  # further back than year 1, where datetime ends
            listing = _seen(api.get("/v1/invocations", params={"since_hours": hours, "limit": 500}))
            assert listing.status_code == 200, (hours, listing.text)
            assert invocation_id in [item["invocation_id"] for item in listing.json()["items"]], hours
    _no_traceback_since(broker, offset)


def test_an_id_or_a_filter_holding_a_nul_is_unknown_or_malformed_never_a_500(broker: BrokerProcess, upstream: HostileUpstream):
    """PostgreSQL refuses a NUL in a text parameter; no id, route or agent name can hold one."""
    offset = len(broker.logs())
    with broker.api() as api:
        for path in ("/v1/invocations/act_x%00y", "/v1/invocations/act_x%00y/result"):
            answer = _seen(api.get(path))
            assert answer.status_code == 404, (path, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
    with broker.operator() as api:
        assert _seen(api.post("/v1/invocations/%00/reconcile", json={"outcome": "committed"})).status_code == 404
        assert _seen(api.post("/v1/approvals/%00", json={"decision": "deny"})).status_code == 404
        for name in ("route", "agent", "before"):
            answer = _seen(api.get("/v1/invocations", params={name: "a\x00b"}))
            assert answer.status_code == 422, (name, answer.text)
            assert answer.json()["detail"][0]["loc"] == ["query", name]
    _no_traceback_since(broker, offset)


def test_a_nan_or_infinity_in_a_body_gets_a_422(broker: BrokerProcess, upstream: HostileUpstream):
    """Python's JSON reader takes NaN and Infinity, which JSON has not: echoing one in the 422 must not fail it."""
    offset = len(broker.logs())
    headers = {"Content-Type": "application/json"}
    with broker.operator() as api:
        for path, body in (("/v1/invocations/act_nope/reconcile", b'{"outcome": "committed", "note": NaN}'),
                           ("/v1/approvals/act_nope", b'{"decision": Infinity}'),
                           ("/v1/approvals/act_nope", b'{"decision": "deny", "note": -Infinity}')):
            answer = _seen(api.post(path, content=body, headers=headers))
            assert answer.status_code == 422, (path, answer.text)
            [problem] = answer.json()["detail"]
            assert problem["loc"][0] == "body" and isinstance(problem["input"], str), problem
        # Not sent as JSON, and not UTF-8 either: FastAPI hands the raw bytes to the 422.
        for content_type in (None, "application/x-www-form-urlencoded"):
            for path in ("/v1/invocations/act_nope/reconcile", "/v1/approvals/act_nope"):
                answer = _seen(api.post(path, content=b"\xc3\x28", headers={"Content-Type": content_type} if content_type else {}))
                assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][0] == "body", (path, answer.text)
    _no_traceback_since(broker, offset)


def test_a_lone_surrogate_in_a_body_gets_a_422_naming_it(broker: BrokerProcess, upstream: HostileUpstream):
    """JSON's "\\ud800" reads as half a character: in a note it could not be stored, and echoed
    in a 422 it could not be encoded; either was a 500 with a traceback in the log."""
    offset = len(broker.logs())
    headers = {"Content-Type": "application/json"}
    with broker.client() as client:
        invocation_id = _seen(client.get("http://plain.example.test/h/ok")).headers["affidavit-invocation-id"]
    with broker.operator() as api:
        for path, body, field in (
            (f"/v1/invocations/{invocation_id}/reconcile", b'{"outcome": "committed", "note": "x\\ud800"}', "note"),
            (f"/v1/invocations/{invocation_id}/reconcile", b'{"outcome": "committed", "reference": "\\udfff"}', "reference"),
            ("/v1/approvals/act_nope", b'{"decision": "deny", "note": "\\ud800"}', "note"),
            ("/v1/approvals/act_nope", b'{"decision": "\\ud800"}', "decision"),
            (f"/v1/invocations/{invocation_id}/reconcile", b'{"outcome": "\\ud800"}', "outcome"),
            (f"/v1/invocations/{invocation_id}/reconcile", b'{"\\ud800": 1}', None),  # a key: the body is not text
        ):
            answer = _seen(api.post(path, content=body, headers=headers))
            assert answer.status_code == 422, (body, answer.status_code, answer.text)
            [problem] = answer.json()["detail"]
            assert problem["loc"] == ["body", field] if field else ["body"], problem
        assert "\\ud800" in answer.text  # echoed as the escape it was
        paired = _seen(api.post(f"/v1/invocations/{invocation_id}/reconcile", headers=headers,
                                content=b'{"outcome": "committed", "note": "ok \\ud83d\\ude00"}'))
        assert paired.status_code in (200, 409), paired.text  # a whole character is text: past validation
    _no_traceback_since(broker, offset)


def test_a_key_or_parameter_given_twice_is_a_422_not_one_of_them_chosen(broker: BrokerProcess, upstream: HostileUpstream):
    """{"decision": "approve", "decision": "deny"} was a denial to the broker and reads as an
    approval to whoever stops at the first; ?outcome=unknown&outcome=committed listed only the
    committed ones. Each is refused, naming what was repeated; nothing is changed."""
    headers = {"Content-Type": "application/json"}
    with broker.operator() as api:
        for path, body, key in (
            ("/v1/approvals/act_nope", b'{"decision": "approve", "decision": "deny"}', "decision"),
            ("/v1/invocations/act_nope/reconcile", b'{"outcome": "committed", "note": "a", "note": "b"}', "note"),
        ):
            answer = _seen(api.post(path, content=body, headers=headers))
            assert answer.status_code == 422, answer.text
            assert [(p["loc"], p["msg"]) for p in answer.json()["detail"]] == [(["body", key], "given more than once; give it once")]
        listing = _seen(api.get("/v1/invocations?outcome=unknown&outcome=committed&limit=5&limit=6"))
        assert listing.status_code == 422, listing.text
        assert [p["loc"] for p in listing.json()["detail"]] == [["query", "limit"], ["query", "outcome"]]
        assert _seen(api.get("/v1/invocations?outcome=unknown&limit=5")).status_code == 200
        deep = _seen(api.post("/v1/approvals/act_nope", content=b"[" * 5000 + b"]" * 5000, headers=headers))
        assert deep.status_code == 400, deep.text  # FastAPI's own answer for a body it cannot read, as before
    with broker.api("not-a-token") as api:  # a caller without a token learns nothing about its body
        assert _seen(api.post("/v1/approvals/act_nope", content=b'{"decision": "approve", "decision": "deny"}',
                              headers=headers)).status_code == 401


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_the_broker_serves_on_uvloop_by_default_and_on_asyncio_when_told(make_broker, upstream: HostileUpstream,
                                                                        event_loop: str):
    sections = {} if event_loop == "uvloop" else {"proxy": {"event_loop": "asyncio"}}
    broker = make_broker("postgresql", **sections)
    loaded = Path(f"/proc/{broker.proc.pid}/maps").read_text()
    assert ("uvloop" in loaded) == (event_loop == "uvloop"), "the loop the configuration asks for is the one running"
    assert f'event loop: {event_loop} ({"Loop" if event_loop == "uvloop" else "_UnixSelectorEventLoop"})' in broker.logs()
    with broker.client() as client:
        tls = _seen(client.post(f"{PAYMENTS}/h/status?code=201", json={"amount": 1}))
        plain = _seen(client.post("http://plain.example.test/h/status?code=202", content=b"x"))
    assert (tls.status_code, plain.status_code) == (201, 202)
    assert [seen.header("Authorization") or seen.header("X-Api-Key") for seen in upstream.received] == [
        f"Bearer {CANARIES['PAYMENTS_KEY']}", CANARIES["PAYMENTS_KEY"]]
    for answer in (tls, plain):
        invocation_id = answer.headers["affidavit-invocation-id"]
        broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
        with broker.api() as api:
            replay = _seen(api.get(f"/v1/invocations/{invocation_id}/result"))
        assert (replay.status_code, replay.content) == (answer.status_code, answer.content)
    assert len(upstream.received) == 2


def test_a_malformed_call_without_the_right_token_is_refused_for_the_token_not_the_body(
    broker: BrokerProcess, upstream: HostileUpstream
):
    """FastAPI parses the body before it resolves the token: the refusal must still be the token's."""
    headers = {"Content-Type": "application/json"}
    bodies = (("/v1/invocations/act_nope/reconcile", b'{"outcome": ', 422),
              ("/v1/approvals/act_nope", b"not json", 422),
              ("/v1/approvals/act_nope", b'{"decision": "\xff"}', 400))  # not UTF-8: FastAPI cannot parse it
    callers = (("no token", httpx.Client(base_url=broker.api_url, timeout=10), 401),
               ("a wrong token", broker.api("not-a-token"), 401),
               ("an agent's token", broker.api(), 403),
               ("the operator's token", broker.operator(), None))  # None: the body's own answer
    for who, api, status in callers:
        with api:
            for path, body, malformed in bodies:
                answer = _seen(api.post(path, content=body, headers=headers))
                assert answer.status_code == (status or malformed), (who, path, answer.text)
                if status is not None:
                    assert answer.headers["content-type"] == "application/problem+json", (who, path)
                    assert "detail" in answer.json() and "loc" not in answer.text, (who, answer.text)
            if status == 401:  # a malformed query parameter, too
                answer = _seen(api.get("/v1/invocations", params={"limit": "many"}))
                assert answer.status_code == 401 and "WWW-Authenticate" in answer.headers, (who, answer.text)


def test_a_call_with_two_authorization_headers_is_refused_whichever_comes_first(broker: BrokerProcess, upstream: HostileUpstream):
    """Which of two tokens counts would be the broker's guess (an agent's and the operator's, say):
    the call is refused, with nothing read or changed, and one token alone still works."""
    agent = broker.agents["builder"].token
    pairs = ((agent, broker.operator_token), (broker.operator_token, agent), (agent, "not-a-token"))
    with httpx.Client(base_url=broker.api_url, timeout=10) as anyone:
        for first, second in pairs:
            headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
            for method, path in (("GET", "/v1/invocations"), ("POST", "/v1/approvals/act_nope")):
                answer = _seen(anyone.request(method, path, headers=headers, json={"decision": "deny"}))
                assert answer.status_code == 400, (first == agent, method, path, answer.text)
                assert answer.headers["content-type"] == "application/problem+json"
                assert "2 Authorization headers" in answer.json()["detail"]
                assert agent not in answer.text and broker.operator_token not in answer.text
        for token in (agent, broker.operator_token):
            answer = _seen(anyone.get("/v1/invocations/act_nope", headers={"Authorization": f"Bearer {token}"}))
            assert answer.status_code == 404, answer.text  # past the token check


def test_without_an_operator_token_an_operator_call_says_none_is_configured(make_broker, upstream: HostileUpstream):
    broker = make_broker(start=False)
    del broker.config["api"]["operator_token"]
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    broker.start()
    with broker.api() as api:
        for path in ("/metrics", "/v1/invocations", "/v1/approvals"):
            answer = _seen(api.get(path))
            assert answer.status_code == 403, (path, answer.text)
            assert "this broker has none configured ([api] operator_token)" in answer.json()["detail"], answer.text


def test_an_oversized_api_body_is_refused_before_it_is_read(broker: BrokerProcess, upstream: HostileUpstream):
    """The largest valid body is a few KiB; FastAPI would read any body whole into memory, before it
    looks at the token."""
    big = b'{"note": "' + b"x" * (1024 * 1024) + b'"}'

    def chunks():  # no Content-Length: the broker must count what arrives
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    with httpx.Client(base_url=broker.api_url, timeout=10) as anyone:
        for path in ("/v1/invocations/act_nope/reconcile", "/v1/approvals/act_nope"):
            for content in (big, chunks()):
                answer = _seen(anyone.post(path, content=content, headers={"Content-Type": "application/json"}))
                assert answer.status_code == 413, answer.text[:300]
                assert answer.headers["content-type"] == "application/problem+json"
                assert answer.json()["status"] == 413 and "65536" in answer.json()["detail"]
    with broker.operator() as api:  # a body of a valid size still gets its answer
        note = "é" * 2000  # the longest note, each character escaped: 12 KiB
        answer = _seen(api.post("/v1/approvals/act_nope", content=json.dumps({"decision": "deny", "note": note}),
                                headers={"Content-Type": "application/json"}))
        assert answer.status_code == 404, answer.text


def test_an_api_client_still_sending_an_oversized_body_reads_the_413_instead_of_a_reset(broker: BrokerProcess,
                                                                                    upstream: HostileUpstream):
    """A client that sends its whole body (declared or chunked) before it reads (httpx, requests, curl without Expect)
    must find the 413 when it reads: the broker keeps reading and dropping what follows for a while,
    rather than closing on unread bytes, which makes the kernel answer with a reset."""
    size = 24 * 1024 * 1024  # more than loopback's socket buffers hold
    block = b"x" * (1024 * 1024)
    declared = (f"Content-Length: {size}".encode(), block, b"")
    chunked = (b"Transfer-Encoding: chunked", b"%x\r\n%s\r\n" % (len(block), block), b"0\r\n\r\n")
    for path, (framing, each, end) in itertools.product(
        ("/v1/invocations/act_nope/reconcile", "/v1/approvals/act_nope"), (declared, chunked)
    ):
        with socket.create_connection(("127.0.0.1", int(broker.api_url.rsplit(":", 1)[1])), timeout=10) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                         + framing + b"\r\n\r\n")
            for _ in range(size // len(block)):
                sock.sendall(each)  # a reset here, or below, is the failure
            sock.sendall(end)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:300]
        assert json.loads(body)["status"] == 413 and "65536" in json.loads(body)["detail"], body[:300]
    with broker.operator() as api:  # the API serves on
        assert _seen(api.get("/v1/approvals")).status_code == 200


def _api_raw(broker: BrokerProcess, parts: list[bytes]) -> bytes:
    """Send ``parts`` to the side API on one connection (stopping if it closes); all it answers."""
    with socket.create_connection(("127.0.0.1", int(broker.api_url.rsplit(":", 1)[1])), timeout=10) as sock:
        try:
            for part in parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-way: what it said is still there to read
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_an_oversized_api_request_head_is_refused_and_the_connection_closed(broker: BrokerProcess, upstream: HostileUpstream):
    """uvicorn's httptools protocol holds a head whole, however long: one 200 MB header took
    360 MB of the broker's memory (the proxy's too). Over 64 KiB is a 431 and a close."""
    offset = len(broker.logs())
    endless = [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "] + [b"a" * 65536] * 64  # 4 MiB, never ending
    answer = _api_raw(broker, endless)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:300]
    SEEN.append(body.decode())
    assert json.loads(body)["status"] == 431 and "65536" in json.loads(body)["detail"]
    long_url = _api_raw(broker, [b"GET /healthz?" + b"q" * (256 * 1024)])
    assert long_url.startswith(b"HTTP/1.1 431"), long_url[:300]
    # A whole head just over the bound, sent at once (parsed in one read), with or without a token.
    for auth in (b"", b"Authorization: Bearer " + broker.operator_token.encode() + b"\r\n"):
        for extra in (b"X-Big: " + b"a" * 66000 + b"\r\n", b"".join(b"X-%d: v\r\n" % i for i in range(9000))):
            whole = _api_raw(broker, [b"GET /v1/invocations HTTP/1.1\r\nHost: x\r\n" + auth + extra + b"\r\n"])
            assert whole.startswith(b"HTTP/1.1 431"), whole[:300]
    # Below the bound, and a body in the same read as the head, are answered as before.
    fine = _api_raw(broker, [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60000 + b"\r\nConnection: close\r\n\r\n"])
    assert fine.startswith(b"HTTP/1.1 200"), fine[:300]
    note = json.dumps({"decision": "deny", "note": "n" * 2000}).encode() + b" " * 60000
    posted = _api_raw(broker, [b"POST /v1/approvals/act_nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               b"Content-Type: application/json\r\nAuthorization: Bearer " + broker.operator_token.encode()
                               + b"\r\nContent-Length: %d\r\n\r\n" % len(note) + note])
    assert posted.startswith(b"HTTP/1.1 404"), posted[:300]
    _no_traceback_since(broker, offset)


def test_an_api_request_that_does_not_arrive_in_time_gets_a_408_and_a_close(make_broker, upstream: HostileUpstream):
    """A client that trickles a head, stops half-way through it, or declares a body and sends
    part of it, held a side-API connection open for good (uvicorn has no such clock): now each
    request must arrive whole within [api] request_timeout of its first byte."""
    broker = make_broker(api={"request_timeout": "1s"})
    port = int(broker.api_url.rsplit(":", 1)[1])
    token = b"Authorization: Bearer " + broker.operator_token.encode() + b"\r\n"
    cases = {
        "trickled head": [b"GET /healthz HTTP/1.1\r\n"] + [b"X-A: b\r\n"] * 20,
        "half a head": [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"],
        "half a body": [b"POST /v1/approvals/act_nope HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + token
                        + b"Content-Length: 100\r\n\r\n{"],
        "after a served request": [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\n"],
    }
    for name, parts in cases.items():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            for part in parts:
                sock.sendall(part)
                time.sleep(0.2 if len(parts) > 1 else 0)
                if sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT) if _readable(sock) else b"":
                    break  # answered: stop trickling
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            took = time.monotonic() - started
        last = answer[answer.rfind(b"HTTP/1.1 "):]
        head, _, body = last.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), (name, answer[:400])
        assert json.loads(body)["status"] == 408 and "request_timeout" in json.loads(body)["detail"], body
        assert 0.9 < took < 4, (name, took)
        if name == "after a served request":
            assert answer.startswith(b"HTTP/1.1 200"), "the first request was served as usual"
    assert "did not arrive whole within 1s of its first byte" in broker.logs()
    _no_traceback_since(broker, 0)
    with broker.operator() as api:  # served on, and a request that arrives at once is untouched by the clock
        assert _seen(api.get("/v1/approvals")).status_code == 200


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


@pytest.mark.parametrize("request_bytes", [
    "GET /v1/caf\u00e9 HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    b"get /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/approvals/act_nope HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/approvals/act_nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/0.9\r\nHost: x\r\n\r\n",
], ids=["raw-utf8-path", "lowercase-method", "negative-length", "length-and-chunked", "http-2.0-line", "http-0.9-line"])
def test_a_request_that_is_not_http_gets_a_problem_document(broker: BrokerProcess, upstream: HostileUpstream, request_bytes):
    answer = _api_raw(broker, [request_bytes])
    head, _, body = answer.partition(b"\r\n\r\n")
    status = b"505" if b" HTTP/2.0" in request_bytes or b" HTTP/0.9" in request_bytes else b"400"
    assert head.startswith(b"HTTP/1.1 " + status) and b"content-type: application/problem+json" in head.lower(), answer[:300]
    assert b"connection: close" in head.lower()
    detail = json.loads(body)["detail"]
    assert ("speaks HTTP/1.1" if status == b"505" else "not valid HTTP/1.1") in detail, body


def test_the_schema_declares_every_answer_the_side_api_gives(broker: BrokerProcess, upstream: HostileUpstream):
    """What schemathesis checks: each answer's status, and its media type, are in /openapi.json."""
    with broker.client() as client:
        created = _seen(client.post(f"{PAYMENTS}/h/status?code=201", content=b"{}")).headers["affidavit-invocation-id"]
    json_body = {"Content-Type": "application/json"}
    with broker.operator() as api:
        schema = api.get("/openapi.json").json()
        answers = [
            ("/metrics", "get", api.get("/metrics")),
            ("/v1/invocations/{invocation_id}/result", "get", api.get(f"/v1/invocations/{created}/result")),
            ("/v1/invocations/{invocation_id}/reconcile", "post",  # neither an outcome nor a lookup
             api.post(f"/v1/invocations/{created}/reconcile", json={})),
            ("/v1/invocations/{invocation_id}/reconcile", "post",  # not UTF-8
             api.post(f"/v1/invocations/{created}/reconcile", content=b'{"note": "\xff"}', headers=json_body)),
            ("/v1/approvals/{invocation_id}", "post", api.post(f"/v1/approvals/{created}", content=b"\xff", headers=json_body)),
        ]
    assert [a[2].status_code for a in answers] == [200, 201, 422, 400, 400], [a[2].text for a in answers]
    for path, method, answer in answers:
        _seen(answer)
        declared = schema["paths"][path][method]["responses"]
        status = str(answer.status_code) if str(answer.status_code) in declared else "default"
        assert status in declared, f"{method.upper()} {path} answered {answer.status_code}, not in {sorted(declared)}"
        types = declared[status].get("content")
        media_type = answer.headers["content-type"].split(";")[0]
        assert types is None or media_type in types, f"{method.upper()} {path} {answer.status_code}: {media_type} not in {sorted(types)}"


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_dispatch_started_is_durable_before_the_first_request_byte(make_broker, upstream: HostileUpstream, dialect):
    broker = make_broker(dialect)
    probes: list[set[str]] = []
    upstream.on_first_byte = lambda _conn, _data: probes.append(dispatched_ids(broker.database_url)) or True
    ids = []
    with broker.client() as client:
        for _ in range(3):  # the first on a new connection, the next ones on a reused one
            r = _seen(client.post(f"{PAYMENTS}/h/status?code=200", content=b"{}"))
            ids.append(r.headers["affidavit-invocation-id"])
    assert len(probes) == 3
    for invocation_id, visible in zip(ids, probes):
        assert invocation_id in visible, "the upstream saw a request byte before DISPATCH_STARTED was durable"
    connections = [broker.invocation(i)["evidence"]["attempts"][0]["connection"] for i in ids]
    assert connections == ["new", "reused", "reused"]


def test_a_complete_answer_whose_record_is_slow_is_delivered_not_timed_out(make_broker, upstream: HostileUpstream, pg_admin_url):
    """The response timeout is the upstream's: once the complete answer is in hand and only its
    record is slow to commit (here: another session holds a lock the result's row needs), the
    caller waits for that commit (bounded by the journal's timeout) and gets the answer, not a
    504 that calls it missing (nor a crash, as when its provisional end was worked out)."""
    import threading

    routes = standard_routes(upstream)
    routes[0] = {**routes[0], "response_timeout": "1s"}
    broker = make_broker("postgresql", routes=routes)
    with broker.client() as client:
        assert client.get(f"{PAYMENTS}/h/ok").status_code == 200  # warm: connections, statements
        def lock_results() -> None:
            subprocess.run(["psql", "-X", "-q", "-d", broker.database_url.replace("+asyncpg", ""), "-c",
                            "BEGIN; LOCK TABLE results IN EXCLUSIVE MODE; SELECT pg_sleep(2.5); COMMIT;"],
                           capture_output=True, timeout=30)

        locker = threading.Thread(target=lock_results)
        locker.start()
        time.sleep(0.5)  # the lock is taken
        started = time.monotonic()
        r = client.post(f"{PAYMENTS}/h/status?code=201", content=b'{"amount": 3}')
        waited = time.monotonic() - started
        locker.join()
    assert r.status_code == 201 and r.headers["affidavit-outcome"] == "committed", r.text
    assert "affidavit-code" not in r.headers, "stored, so not flagged"
    assert 1.2 < waited < 5, waited
    record = broker.wait_for(r.headers["affidavit-invocation-id"], lambda rec: rec["stage"] == "delivered")
    assert record["caller_disposition"] == "completed" and record["outcome"] == "committed"
    assert [e["seq"] for e in record["events"]] == list(range(1, len(record["events"]) + 1)), "no gap in the record"
    assert "Traceback" not in broker.logs()


#: A credential with characters a JSON document, a query string or an HTML page spells otherwise.
SPECIAL_KEY = 'sk_p@ss/w+rd"q<y>&\\z ' + CANARIES["PAYMENTS_KEY"][-8:]


def _spelled(secret: str) -> list[str]:
    """The secret as sent and as the echoes below encode it (an echo must match none)."""
    import urllib.parse

    return [secret, json.dumps(secret)[1:-1], urllib.parse.quote_plus(secret), urllib.parse.quote(secret, safe="")]


@pytest.mark.parametrize("path", ["/h/ok", "/h/mirror?into=query"])
def test_an_echo_the_upstream_encoded_is_redacted_everywhere(make_broker, upstream: HostileUpstream, path: str):
    """An honest upstream echoes the credential it received JSON-escaped (its JSON document of the
    request's headers) or percent-encoded (a query string, a form body): neither the agent, nor
    the record, nor the stored result, nor the journal holds any spelling of it."""
    broker = make_broker(env={"PAYMENTS_KEY": SPECIAL_KEY})
    with broker.client() as client:
        r = client.post(f"{PAYMENTS}{path}", content=b"{}")
    assert upstream.received[-1].header("Authorization") == f"Bearer {SPECIAL_KEY}", "the upstream got the real one"
    assert r.status_code in (200, 201) and r.headers["affidavit-outcome"] == "committed", r.text
    seen = [r.text, json.dumps(list(r.headers.items()))]
    assert "[REDACTED]" in seen[0] + seen[1]
    invocation_id = r.headers["affidavit-invocation-id"]
    time.sleep(0.3)
    with broker.api() as api:
        record = api.get(f"/v1/invocations/{invocation_id}")
        result = api.get(f"/v1/invocations/{invocation_id}/result")
    seen += [record.text, result.text, json.dumps(list(result.headers.items())), dump_journal(broker.database_url), broker.logs()]
    SEEN.extend(seen[:5])
    for text in seen:
        for spelling in _spelled(SPECIAL_KEY):
            assert spelling not in text, (spelling, text[:400])
    committed = next(e for e in record.json()["events"] if e["kind"] == "RESULT_COMMITTED")
    assert committed["data"]["redacted"] is True


@pytest.mark.parametrize("into", ["location", "name", "reason", "job", "coding", "transfer"])
def test_an_echo_outside_the_body_and_header_values_is_redacted_too(broker: BrokerProcess, upstream: HostileUpstream, into: str):
    """An upstream may put the credential it received in a ``Location``, a job id, the reason
    phrase, a header's name, or the name of a coding (which withholds the body, and the reason it
    was withheld must not quote it, in any case): neither the agent, nor the record, nor the side
    API, nor the log sees it."""
    offset = len(broker.logs())
    secret = CANARIES["PAYMENTS_KEY"]
    proxy = f"http://builder:{broker.agents['builder'].token}@127.0.0.1:{broker.proxy_port}"
    done = subprocess.run(["curl", "-sS", "-i", "--proxy", proxy, "--cacert", str(broker.ca_path), "--max-time", "20",
                           "-X", "POST", "-d", "{}", f"{PAYMENTS}/h/mirror?into={into}"], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    SEEN.append(done.stdout.decode("latin-1"))
    status, headers, _ = split_curl(done.stdout)
    assert upstream.received[-1].header("Authorization") == f"Bearer {secret}"
    assert secret.encode() not in done.stdout, done.stdout[:400]
    assert status == {"location": 201, "job": 202}.get(into, 200)
    invocation_id = headers["affidavit-invocation-id"]
    time.sleep(0.3)
    with broker.api() as api:
        record = api.get(f"/v1/invocations/{invocation_id}").text
        result = api.get(f"/v1/invocations/{invocation_id}/result")
    SEEN.extend([record, result.text, json.dumps(dict(result.headers))])
    assert secret not in record and secret not in result.text and secret not in json.dumps(dict(result.headers))
    assert secret not in dump_journal(broker.database_url)
    evidence = json.loads(record)["evidence"]
    if into == "location":
        assert headers["location"] == "/things/[REDACTED]" and evidence["location"] == "/things/[REDACTED]"
    elif into == "job":
        assert evidence["job_ref"] == "job-[REDACTED]"
    elif into == "name":
        assert headers["x-kept"] == "yes" and result.headers["x-kept"] == "yes"
    committed = next(e for e in json.loads(record)["events"] if e["kind"] == "RESULT_COMMITTED")
    for text in (done.stdout.decode("latin-1"), record, result.text, json.dumps(dict(result.headers)),
                 broker.logs()[offset:], dump_journal(broker.database_url)):
        assert secret.lower() not in text.lower(), "not even lower-cased, or quoted as a coding's name"
    if into in ("coding", "transfer"):  # a coding it cannot undo: the body is withheld, and why, without the name
        assert committed["data"]["withheld"] == \
            f"{'Content' if into == 'coding' else 'Transfer'}-Encoding (unknown): a coding the broker does not know", committed
        assert headers["affidavit-withheld"] == committed["data"]["withheld"]
        return
    # The reason phrase is not part of the stored result; everything else was stored redacted.
    assert committed["data"].get("redacted") is (True if into != "reason" else None), committed


def _reencoded(secret: str) -> list[str]:
    """What must not survive of a re-encoded echo: each form :func:`reencodings` makes, also
    JSON-escaped, and the middle of each base64 form (4 characters off each end: those may
    depend on the bytes either side of the secret, which are not its own)."""
    forms = list(reencodings(secret).values())
    for before in (b"", b"x", b"xy"):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            forms.append(encode(before + secret.encode()).decode()[4:-4])
    return sorted({f for form in forms for f in (form, json.dumps(form)[1:-1])})


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_an_echo_the_upstream_reencoded_is_redacted_everywhere(make_broker, upstream: HostileUpstream, dialect: str):
    """A careless upstream re-encodes the credential it received (base64 in a debug field, a hex
    dump, an upper-cased header, a URL percent-encoded twice), in headers, a ``Location`` and a
    body, gzipped or not, on a Bearer and a Basic route: neither the agent, nor the record, nor
    the stored result, nor the journal, nor the log holds any of those forms."""
    broker = make_broker(dialect, env={"PAYMENTS_KEY": SPECIAL_KEY})
    offset = len(broker.logs())
    token = base64.b64encode(f"svc:{CANARIES['BASIC_KEY']}".encode()).decode()
    seen: list[str] = []
    for url, coding in [(f"{PAYMENTS}/h/reencode", None), (f"{PAYMENTS}/h/reencode?encode=gzip", "gzip"),
                        ("https://basic.example.test/h/reencode?encode=gzip", "gzip")]:
        with broker.client() as client:
            with client.stream("GET", url) as r:
                raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["affidavit-outcome"] == "committed", raw[:400]
        assert r.headers.get("content-encoding") == coding
        body = gzip.decompress(raw) if coding else raw
        debug = json.loads(body)["debug"]
        assert len(debug) == len(reencodings("any")) * (2 if "basic" in url else 1) and all("[REDACTED]" in v for v in debug.values()), debug
        for name in ("x-debug-authorization", "x-token-hex", "x-token"):
            assert "[REDACTED]" in r.headers[name], (name, r.headers[name])
        assert r.headers["location"] == "/next?token=[REDACTED]"
        invocation_id = r.headers["affidavit-invocation-id"]
        record = broker.wait_for(invocation_id, lambda rec: rec["stage"] == "delivered")
        assert record["evidence"]["location"] == "/next?token=[REDACTED]"
        assert next(e for e in record["events"] if e["kind"] == "RESULT_COMMITTED")["data"]["redacted"] is True
        with broker.api() as api:
            result = api.get(f"/v1/invocations/{invocation_id}/result")  # httpx undoes the gzip
        assert result.status_code == 200 and json.loads(result.content)["debug"] == debug, "stored as delivered"
        seen += [raw.decode("latin-1"), body.decode("latin-1"), json.dumps(list(r.headers.items())), json.dumps(record),
                 result.content.decode("latin-1"), json.dumps(list(result.headers.items()))]
    received = [e.header("Authorization") for e in upstream.received[-3:]]
    assert received == [f"Bearer {SPECIAL_KEY}"] * 2 + [f"Basic {token}"], "the upstream got the real ones"
    journal = dump_journal(broker.database_url)
    assert "[REDACTED]" in journal, "the uncompressed answer is in the journal, redacted"
    seen += [journal, broker.logs()[offset:]]
    for secret in (SPECIAL_KEY, token, CANARIES["BASIC_KEY"]):
        for form in _reencoded(secret):
            for text in seen:
                assert form not in text, (secret, form, text[:300])


def test_a_websocket_handshake_is_refused_before_anything_is_sent(broker: BrokerProcess, upstream: HostileUpstream):
    """A WebSocket cannot be one recorded exchange. A real client (``websockets``, through the
    broker's CONNECT tunnel) gets the envelope; the upstream sees nothing, not even the plain GET
    the handshake would become once its hop-by-hop ``Upgrade`` is dropped."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    upstream.reset()
    context = ssl.create_default_context(cafile=str(broker.ca_path))
    with pytest.raises(InvalidStatus) as refused:
        connect("wss://api.payments.test/h/ok", proxy=broker.proxy_url(), ssl=context, open_timeout=20)
    response = refused.value.response
    SEEN.append(bytes(response.body).decode(errors="replace"))
    assert response.status_code == 405, response
    assert response.headers["Content-Type"] == "application/problem+json"
    body = check_envelope(bytes(response.body))
    assert body["error"]["code"] == "UNSUPPORTED_ACTION" and body["error"]["outcome"] == "not_attempted"
    assert "WebSocket" in body["error"]["message"] and "Nothing was sent" in body["error"]["message"]
    assert upstream.received == []
    record = broker.invocation(body["invocation_id"])
    assert record["route"] == "payments.create" and record["code"] == "UNSUPPORTED_ACTION"
    assert "DISPATCH_STARTED" not in [e["kind"] for e in record["events"]]

    # An h2c upgrade offer (curl --http2 on http://) is no WebSocket: it goes on as HTTP/1.1.
    auth = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    answer = _raw(broker.proxy_port, b"GET http://plain.example.test/h/ok HTTP/1.1\r\nHost: plain.example.test\r\n"
                  b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                  b"Proxy-Authorization: Basic " + auth + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    [forwarded] = upstream.received
    assert forwarded.header("Upgrade") is None and forwarded.header("HTTP2-Settings") is None


def _override_refused(broker: BrokerProcess, refused: httpx.Response, *said: str) -> dict[str, Any]:
    """The record of a request refused for an override header, after checking the answer."""
    SEEN.append(refused.text)
    assert refused.status_code == 405, refused.text
    body = check_envelope(refused.content)
    assert (body["error"]["code"], body["error"]["phase"], body["error"]["outcome"]) == \
        ("UNSUPPORTED_ACTION", "validation", "not_attempted")
    message = body["error"]["message"]
    assert all(s in message for s in (*said, "Nothing was sent")), message
    record = broker.invocation(body["invocation_id"])
    assert "DISPATCH_STARTED" not in [e["kind"] for e in record["events"]]
    return record


@pytest.mark.parametrize("header", ["X-HTTP-Method-Override", "X-HTTP-Method", "x-method-override"])
def test_a_method_override_header_naming_another_method_is_refused_before_anything_is_sent(
    broker: BrokerProcess, upstream: HostileUpstream, header: str
):
    """A GET that asks the service to DELETE: many services honour the header, and the broker
    would have routed, recorded and judged its retries as a GET (safe to repeat). Refused, nothing
    sent. The header naming the request's own method (any case) asks for nothing new."""
    upstream.reset()
    with broker.client() as client:
        refused = client.get(f"{PAYMENTS}/h/ok", headers={header: "DELETE"})
        same = client.post(f"{PAYMENTS}/h/ok", headers={header: "post"}, content=b"{}")
    record = _override_refused(broker, refused, header, "'DELETE'")
    assert (record["method"], record["code"]) == ("GET", "UNSUPPORTED_ACTION")

    assert same.status_code == 200 and same.headers["affidavit-outcome"] == "committed", same.text
    [forwarded] = upstream.received
    assert forwarded.method == "POST" and forwarded.header(header) == "post"


@pytest.mark.parametrize("header", ["X-Original-URL", "X-Rewrite-URL", "x-override-url"])
def test_a_path_override_header_naming_another_path_is_refused_before_anything_is_sent(
    broker: BrokerProcess, upstream: HostileUpstream, header: str
):
    """IIS URL Rewrite (and frameworks behind it) serve the path X-Original-URL names: a request
    the route allows for /h/ok could have the service act on /admin. Refused, nothing sent; the
    header naming the request's own path asks for nothing new."""
    upstream.reset()
    with broker.client() as client:
        refused = client.get(f"{PAYMENTS}/h/ok", headers={header: "/admin/delete-all"})
        same = client.get(f"{PAYMENTS}/h/ok?x=1", headers={header: "/h/ok?x=1"})
    _override_refused(broker, refused, header, "'/admin/delete-all'")
    assert same.status_code == 200, same.text
    [forwarded] = upstream.received
    assert forwarded.header(header) == "/h/ok?x=1"


@pytest.mark.parametrize("where", ["query", "form", "json", "multipart"])
def test_a_method_override_field_in_a_post_naming_another_method_is_refused_before_anything_is_sent(
    broker: BrokerProcess, upstream: HostileUpstream, where: str
):
    """Rails, Laravel, Symfony and Express's method-override perform a POST carrying
    ``_method=DELETE`` as a DELETE: the route was checked, and the record made, for a POST. A field
    naming POST, or a body that only mentions the name, asks for nothing new."""
    def post(client: httpx.Client, method: str) -> httpx.Response:
        if where == "query":
            return client.post(f"{PAYMENTS}/h/ok?a=1&%5Fmethod={method}", content=b"{}")
        if where == "form":
            return client.post(f"{PAYMENTS}/h/ok", data={"amount": "5", "_method": method})
        if where == "json":
            return client.post(f"{PAYMENTS}/h/ok", json={"_method": method, "amount": 5})
        return client.post(f"{PAYMENTS}/h/ok", files={"_method": (None, method), "doc": ("a.txt", b"x")})

    upstream.reset()
    with broker.client() as client:
        refused = post(client, "DELETE")
        same = post(client, "post")
        mention = client.post(f"{PAYMENTS}/h/ok", data={"payment_method": "pm_1", "note": "_method=DELETE"})
    record = _override_refused(broker, refused, "_method field", "'DELETE'")
    assert (record["method"], record["code"]) == ("POST", "UNSUPPORTED_ACTION")
    assert same.status_code == 200 and same.headers["affidavit-outcome"] == "committed", same.text
    assert mention.status_code == 200, mention.text
    assert [r.method for r in upstream.received] == ["POST", "POST"]


def test_fields_a_connection_header_names_do_not_cross_the_broker(broker: BrokerProcess, upstream: HostileUpstream):
    """RFC 9110 7.6.1: a proxy removes the fields ``Connection`` names, both ways. A field the
    agent marks as its hop's only is not sent (nor fingerprinted); one the upstream marks so is
    neither delivered nor stored with the result."""
    upstream.reset()
    with broker.client() as client:
        r = _seen(client.get(f"{PAYMENTS}/h/status?code=200&hop=X-Upstream-Hop",
                             headers={"Connection": "keep-alive, X-Agent-Hop", "X-Agent-Hop": "mine", "X-Kept": "yes"}))
    assert r.status_code == 200, r.text
    assert "x-upstream-hop" not in r.headers, r.headers
    [forwarded] = upstream.received
    assert forwarded.header("X-Agent-Hop") is None and forwarded.header("X-Kept") == "yes"
    with broker.api() as api:
        replayed = _seen(api.get(f"/v1/invocations/{r.headers['affidavit-invocation-id']}/result"))
    assert replayed.status_code == 200 and "x-upstream-hop" not in replayed.headers, replayed.headers


@pytest.mark.parametrize("field", [("x-note", "mine "), ("x-note", "\tmine"), ("X-Note", "mine"), ("x note", "mine"),
                                   ("connection", "keep-alive"), ("te", "gzip"), ("upgrade", "websocket")])
def test_an_http2_request_with_fields_http2_forbids_is_refused_alone(broker: BrokerProcess, upstream: HostileUpstream, field):
    """RFC 9113 8.1.1: a malformed request is an error of its stream, not of the connection. The
    h2 library would end the whole connection (GOAWAY), and with it the answer of every other
    request in flight on it: the broker refuses that one request, with an envelope."""
    from tests.support.h2agent import H2Agent

    upstream.reset()
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        slow = agent.request("GET", "/h/slow?delay=0.5")
        bad = agent.request("GET", "/h/ok?bad=1", headers=[field])
        status, headers, body = agent.response(bad)
        assert status == 400 and headers["content-type"] == "application/problem+json", (status, body[:300])
        envelope = check_envelope(body)
        SEEN.append(json.dumps(envelope))
        assert (envelope["error"]["code"], envelope["error"]["outcome"], envelope["invocation_id"]) == (
            "MALFORMED_REQUEST", "not_attempted", None)
        # A name that is no token at all mitmproxy refuses itself, as HTTP it cannot parse; the rest are the broker's.
        assert ("RFC 9113" in envelope["error"]["message"] and "other requests" in envelope["error"]["message"]
                or field[0] == "x note" and "not valid HTTP" in envelope["error"]["message"]), envelope
        assert agent.response(slow)[0] == 200, "the request in flight on the same connection got its answer"
        again = agent.request("GET", "/h/ok")
        assert agent.response(again)[0] == 200, "the connection goes on"
    assert sorted(r.path for r in upstream.received) == ["/h/ok", "/h/slow?delay=0.5"], "the malformed one was not sent"


@pytest.mark.parametrize(("fields", "body"), [
    ([(":path", "/admin")], b""),
    ([(":protocol", "websocket")], b""),
    ([(":status", "200")], b""),
    ([(":protocol", "websocket")], b"x" * 16000),  # headers and the whole body in one read
    ([(":x-note", "v" * 20000)], b""),  # a long value, which the envelope does not quote
])
def test_an_http2_request_with_malformed_pseudo_headers_is_refused_alone(
        broker: BrokerProcess, upstream: HostileUpstream, fields, body):
    """A pseudo-header twice, or one a request may not have: mitmproxy would end the connection
    (GOAWAY), and with it the answer of a request already dispatched on it."""
    from tests.support.h2agent import H2Agent

    upstream.reset()
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        slow = agent.request("POST", "/h/slow?delay=0.5", body=b"{}")
        time.sleep(0.2)  # dispatched before the malformed one arrives
        refused = agent.request("POST" if body else "GET", "/h/ok", body=body, headers=fields)
        status, headers, answer = agent.response(refused)
        assert status == 400 and headers["content-type"] == "application/problem+json", (status, answer[:300])
        assert [name for name, _ in agent.streams[refused]["headers"]].count("content-length") == 1, "one, or curl resets"
        error = check_envelope(answer)["error"]
        assert "vvvv" not in error["message"], "the envelope does not quote the request"
        assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted") and "pseudo-header" in error["message"]
        assert agent.response(slow)[0] == 200, "the request dispatched on the same connection got its answer"
        assert agent.response(agent.request("GET", "/h/ok"))[0] == 200, "the connection goes on"
    assert sorted(r.path for r in upstream.received) == ["/h/ok", "/h/slow?delay=0.5"]


def test_an_http2_request_with_malformed_pseudo_headers_reset_by_its_agent_at_once_is_let_go(
        broker: BrokerProcess, upstream: HostileUpstream):
    """The agent resets the malformed stream in the same write: by the time the broker refuses it
    the stream is closed, and there is nothing to answer; the connection's other requests go on."""
    from h2.errors import ErrorCodes

    from tests.support.h2agent import H2Agent

    upstream.reset()
    offset = len(broker.logs())
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        refused = agent.request("POST", "/h/ok", body=b"{}", headers=[(":path", "/admin")], end_stream=False, flush=False)
        agent.conn.reset_stream(refused, ErrorCodes.CANCEL)
        assert agent.response(agent.request("GET", "/h/ok"))[0] == 200, "the connection goes on"
    assert [r.path for r in upstream.received] == ["/h/ok"]
    assert "Traceback" not in broker.logs()[offset:]


@pytest.mark.parametrize("lengths", [["abc"], [""], ["-1"], ["+5"], ["1_0"], ["5", "7"]],
                         ids=["letters", "empty", "negative", "plus", "underscore", "two-values"])
def test_an_http2_content_length_that_is_not_a_length_is_refused_alone(
        broker: BrokerProcess, upstream: HostileUpstream, lengths: list[str]):
    """RFC 9110 8.6: digits, one value. The h2 library ends the whole connection over one it
    cannot read as a number, and reads some that are not lengths at all as numbers (Python's
    int takes "+5" and "1_0"): that stream is refused, the others on the connection go on."""
    from tests.support.h2agent import H2Agent

    upstream.reset()
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        slow = agent.request("POST", "/h/slow?delay=0.5", body=b"{}")
        time.sleep(0.2)  # dispatched before the bad one arrives
        bad = agent.request("POST", "/h/ok?bad=1", headers=[("content-length", v) for v in lengths], end_stream=True)
        status, headers, answer = agent.response(bad)
        assert status == 400 and headers["content-type"] == "application/problem+json", (status, answer[:300])
        error = check_envelope(answer)["error"]
        assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted"), error
        assert "content-length header is not one length in bytes" in error["message"], error
        assert agent.response(slow)[0] == 200, "the request dispatched on the same connection got its answer"
        assert agent.response(agent.request("GET", "/h/ok"))[0] == 200, "the connection goes on"
    assert sorted(r.path for r in upstream.received) == ["/h/ok", "/h/slow?delay=0.5"], "the bad one was not sent"


@pytest.mark.parametrize(("declared", "frames"), [
    (4, [(b"x" * 10, True)]),
    (4, [(b"x" * 10, False)]),  # and goes on sending
    (10, [(b"x" * 6, False), (b"x" * 6, True)]),  # the broker has read part of the body when the rest overruns it
    (10, [(b"x" * 4, True)]),
    (10, [(b"x" * 4, False), (b"", True)]),  # ended later, by an empty DATA frame
    (10, [(b"", True)]),  # ended with its headers, which h2 lets pass
], ids=["longer", "longer-still-sending", "longer-in-a-later-frame", "shorter", "shorter-ended-later", "shorter-no-data"])
def test_an_http2_body_that_does_not_match_its_content_length_is_refused_alone(
        broker: BrokerProcess, upstream: HostileUpstream, declared: int, frames: list[tuple[bytes, bool]]):
    """RFC 9113 8.1.1: a body longer or shorter than its content-length makes the request
    malformed, an error of its stream. The h2 library would end the whole connection (GOAWAY), and
    with it the answer of a request already dispatched on it: the broker refuses that one stream,
    before anything of it was recorded (the body is read whole before the ``request`` hook)."""
    from h2.errors import ErrorCodes

    from tests.support.h2agent import H2Agent

    recorded = "SELECT DISTINCT invocation_id FROM events"
    before, offset = set(query(broker.database_url, recorded)), len(broker.logs())
    upstream.reset()
    with H2Agent(broker, "api.payments.test") as agent:
        slow = agent.request("POST", "/h/slow?delay=0.5", body=b"{}")
        time.sleep(0.2)  # dispatched before the bad one arrives
        (first, end), *later = frames
        bad = agent.request("POST", "/h/ok?bad=1", body=first, content_length=declared, end_stream=end, flush=not later)
        for data, end in later:
            time.sleep(0.2)  # in a read of its own
            agent.send(bad, data, end_stream=end, flush=False)
        beside = agent.request("GET", "/h/ok?beside=1")  # in one write with the bad frame: the broker reads them together
        status, headers, answer = agent.response(bad)
        assert status == 400 and headers["content-type"] == "application/problem+json", (status, answer[:300])
        envelope = check_envelope(answer)
        SEEN.append(json.dumps(envelope))
        error = envelope["error"]
        assert (error["code"], error["outcome"], envelope["invocation_id"]) == ("MALFORMED_REQUEST", "not_attempted", None)
        assert f"the {declared} bytes its content-length header declares" in error["message"], error
        assert "Nothing was sent upstream and nothing was recorded" in error["message"], error
        if not frames[-1][1]:  # the agent is still sending: its stream is reset, which asks it to stop
            agent.read_until(lambda: "reset" in agent.streams[bad], what=f"RST_STREAM on stream {bad}")
            assert agent.streams[bad]["reset"] == ErrorCodes.NO_ERROR
        status, headers, _ = agent.response(slow)
        assert status == 200, "the request dispatched on the same connection got its answer"
        done = [headers["affidavit-invocation-id"]]
        status, headers, _ = agent.response(beside)
        assert status == 200, "the request read with the bad frame got its answer"
        done.append(headers["affidavit-invocation-id"])
        status, headers, _ = agent.response(agent.request("GET", "/h/ok"))
        assert status == 200, "the connection goes on"
        done.append(headers["affidavit-invocation-id"])
    assert sorted(r.path for r in upstream.received) == ["/h/ok", "/h/ok?beside=1", "/h/slow?delay=0.5"], "the bad one was not sent"
    assert set(query(broker.database_url, recorded)) - before == {(i,) for i in done}, "nothing of the refused one was recorded"
    assert dispatched_ids(broker.database_url) >= set(done)
    assert "Traceback" not in broker.logs()[offset:]


@pytest.mark.parametrize("path", ["/h/ok HTTP/1.1", "/h/o\tk", "/h/..\x0b/admin", "/h/ok\x7f", "/h/\u00e9t\u00e9",
                                  "/h/ok#/../admin"])
def test_an_http2_path_that_is_no_request_target_is_refused_before_it_is_sent(
        broker: BrokerProcess, upstream: HostileUpstream, path: str):
    """HTTP/2 carries ``:path`` as it is, any byte but a line break: written into the HTTP/1.1
    request line upstream, a space would end the target early, a control byte or one that is not
    ASCII would be read differently by each parser, and ``#`` cut the path short."""
    from tests.support.h2agent import H2Agent

    upstream.reset()
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        status, headers, body = agent.response(agent.request("GET", path))
        assert status == 400 and headers["content-type"] == "application/problem+json", (status, body[:300])
        envelope = check_envelope(body)
        SEEN.append(json.dumps(envelope))
        error = envelope["error"]
        assert (error["code"], error["outcome"], error["retry"]) == ("MALFORMED_REQUEST", "not_attempted", "after_correction")
        assert "Percent-encode it" in error["message"] and "Nothing was sent" in error["message"], error
        assert agent.response(agent.request("GET", "/h/ok?a|b"))[0] == 200, "visible ASCII RFC 3986 leaves out goes on"
    assert [r.path for r in upstream.received] == ["/h/ok?a|b"], "the malformed one was not sent"


@pytest.mark.parametrize("value", ["a\x0bb", "a\x7fb", "a\x1bb"])
def test_an_http2_header_with_a_control_character_is_refused_before_it_is_sent(
        broker: BrokerProcess, upstream: HostileUpstream, value: str):
    """HTTP/2 carries any byte but CR, LF and NUL in a field value; written upstream over HTTP/1.1,
    another control character is read differently by each parser (RFC 9113 8.2.1 calls it malformed)."""
    from tests.support.h2agent import H2Agent

    upstream.reset()
    with H2Agent(broker, "api.payments.test", strict=False) as agent:
        status, headers, body = agent.response(agent.request("GET", "/h/ok", headers=[("x-note", value)]))
    assert status == 400, (status, body[:300])
    error = check_envelope(body)["error"]
    assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted") and "control character" in error["message"]
    assert upstream.received == []


def test_a_request_body_under_a_transfer_coding_other_than_chunked_is_refused(broker: BrokerProcess, upstream: HostileUpstream):
    """mitmproxy undoes ``chunked`` but not ``gzip, chunked``: the body would go upstream still
    compressed, described as a plain one, and be fingerprinted and limited as compressed bytes."""
    coded = gzip.compress(b"hello")
    request = (b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n"
               + b"%x\r\n" % len(coded) + coded + b"\r\n0\r\n\r\n")
    upstream.reset()
    head, _, body = _through_tunnel(broker, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    error = check_envelope(body)["error"]
    assert (error["code"], error["outcome"]) == ("MALFORMED_REQUEST", "not_attempted") and "gzip, chunked" in error["message"]
    assert upstream.received == []


@pytest.mark.parametrize("version", ["--http2", "--http1.1"])
@pytest.mark.parametrize("sent", ["&header=Content-Length:5", ""])
def test_a_204_is_delivered_without_a_content_length(broker: BrokerProcess, upstream: HostileUpstream, version, sent):
    """RFC 9110 8.6: no Content-Length on a 204, neither the upstream's (an HTTP/2 client refuses
    the answer as a protocol error) nor one of the broker's own."""
    done = subprocess.run(["curl", "-sS", "-i", version, "--proxy",
                           f"http://builder:{broker.agents['builder'].token}@127.0.0.1:{broker.proxy_port}",
                           "--cacert", str(broker.ca_path), "--max-time", "20", "-X", "DELETE",
                           f"{PAYMENTS}/h/status?code=204{sent}"], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    line = b"HTTP/2 204" if version == "--http2" else b"HTTP/1.1 204"
    assert done.stdout.count(line) == 1, done.stdout[:400]
    status, headers, body = split_curl(done.stdout.replace(b"HTTP/2 204", b"HTTP/1.1 204"))
    assert status == 204 and "content-length" not in headers and body == b"", done.stdout[:400]
    invocation_id = headers["affidavit-invocation-id"]
    time.sleep(0.3)
    kinds = [e["kind"] for e in broker.invocation(invocation_id)["events"]]
    assert kinds[-1] == "RESULT_DELIVERED", kinds


def test_no_canary_secret_anywhere(broker: BrokerProcess, upstream: HostileUpstream):
    """Runs last in the module: everything the broker wrote or said is free of the secrets."""
    with broker.client() as client:
        _seen(client.get(f"{PAYMENTS}/h/ok"))
        _seen(client.get("https://basic.example.test/h/ok"))
        _seen(client.post(f"{PAYMENTS}/h/short_body", content=b"{}"))
    assert any(CANARIES["PAYMENTS_KEY"] in (r.header("Authorization") or "") for r in upstream.received)
    time.sleep(0.3)
    with broker.operator() as api:
        listing = api.get("/v1/invocations", params={"limit": 500}).json()
        SEEN.append(json.dumps(listing))
        for item in listing["items"]:
            SEEN.append(api.get(f"/v1/invocations/{item['invocation_id']}").text)
            SEEN.append(api.get(f"/v1/invocations/{item['invocation_id']}/result").text)
    haystacks = {"database": dump_journal(broker.database_url), "logs": broker.logs(), "answers": "\n".join(SEEN)}
    assert len(haystacks["database"]) > 1000 and len(haystacks["answers"]) > 1000
    for name, value in CANARIES.items():
        encoded = base64.b64encode(f"svc:{value}".encode()).decode()
        for where, text in haystacks.items():
            assert value not in text, f"{name} leaked into {where}"
            assert encoded not in text, f"{name} (basic-encoded) leaked into {where}"


def _through_tunnel(broker: BrokerProcess, request: bytes) -> bytes:
    """``request`` inside a CONNECT tunnel to api.payments.test:443, TLS to the broker's CA; the
    answer up to the connection's close (both refusals close it)."""
    with broker.tunnel("api.payments.test") as tls:
        tls.sendall(request)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    return data


def _h2_request(
    broker: BrokerProcess, method: str, path: str, headers: list[tuple[str, str]] = [], body: bytes = b"",
    trailers: list[tuple[str, str]] | None = None,
) -> tuple[int, list[tuple[str, str]], bytes]:
    """One HTTP/2 request in a tunnel to api.payments.test:443, from a raw h2 client: the fields
    go out as given (curl and httpx send neither request trailers nor split cookie fields).
    Returns the status, the response fields and the body."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    with broker.tunnel("api.payments.test", alpn="h2") as tls:
        conn.initiate_connection()
        request = [(":method", method), (":scheme", "https"), (":authority", "api.payments.test"), (":path", path), *headers]
        conn.send_headers(1, request, end_stream=not body and trailers is None)
        if body:
            conn.send_data(1, body, end_stream=trailers is None)
        if trailers is not None:
            conn.send_headers(1, trailers, end_stream=True)
        tls.sendall(conn.data_to_send())
        status, fields, data = 0, [], b""
        while True:
            chunk = tls.recv(65536)
            assert chunk, "the broker closed the connection without ending the stream"
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    fields = [(k, v) for k, v in event.headers if not k.startswith(":")]
                    status = int(dict(event.headers)[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream reset: {event.error_code!r}")
                elif isinstance(event, h2.events.StreamEnded):
                    return status, fields, data
            tls.sendall(conn.data_to_send())


@pytest.mark.parametrize(
    ("path", "request_bytes", "status", "code"),
    [
        ("plain", b"THIS IS NOT HTTP\r\n\r\n", 400, "MALFORMED_REQUEST"),
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nContent-Length: twelve\r\n\r\n", 400, "MALFORMED_REQUEST"),
        # A chunked body whose framing breaks: mitmproxy only closes the connection, the broker answers first.
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400, "MALFORMED_REQUEST"),
        # Chunk lines ended by a bare LF (h11 would wait for a CRLF that never comes), data not
        # followed by CRLF (h11 would drop the two bytes unread), a chunk-size line without end.
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n", 400, "MALFORMED_REQUEST"),
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", 400, "MALFORMED_REQUEST"),
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 5000, 400, "MALFORMED_REQUEST"),
        # A trailer section that never ends (h11 would hold it whole, before any credential is looked at).
        ("plain", b"POST http://plain.example.test/h/ok HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: " + b"a" * 300000, 400, "MALFORMED_REQUEST"),
        # Past the largest max_body (10 MiB by default) plus 1 MiB: refused on its Content-Length,
        # before a byte of the body is read.
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nContent-Length: 12582912\r\n\r\n", 413, "PAYLOAD_LIMIT"),
        # The same for a chunk whose size line says it (no body deadline to wait out first).
        ("tunnel", b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\nc00000\r\n", 413, "PAYLOAD_LIMIT"),
        ("plain", b"POST http://plain.example.test/h/ok HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nab", 413, "PAYLOAD_LIMIT"),
        # A head past 64 KiB that has not ended (mitmproxy would hold it whole, however long).
        ("plain", b"GET http://plain.example.test/h/ok HTTP/1.1\r\nX-Big: " + b"a" * (66 * 1024), 431, "MALFORMED_REQUEST"),
        ("tunnel", b"GET /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nX-Big: " + b"a" * (66 * 1024), 431, "MALFORMED_REQUEST"),
        # The same heads, ended: sent whole, each arrives in a read or two and must not be served.
        ("plain", b"GET http://plain.example.test/h/ok HTTP/1.1\r\nX-Big: " + b"a" * (66 * 1024) + b"\r\n\r\n", 431, "MALFORMED_REQUEST"),
        ("tunnel", b"GET /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nX-Big: " + b"a" * (66 * 1024) + b"\r\n\r\n", 431, "MALFORMED_REQUEST"),
        ("plain", b"GET http://plain.example.test/h/ok?" + b"q" * (100 * 1024) + b" HTTP/1.1\r\n\r\n", 431, "MALFORMED_REQUEST"),
    ],
)
def test_requests_the_proxy_core_refuses_get_envelopes(broker: BrokerProcess, upstream: HostileUpstream, path, request_bytes, status, code):
    """mitmproxy answers these itself before any hook runs; the broker replaces its HTML page
    with an envelope (a behaviour of mitmproxy pinned here: its HTTP/1 layer's error page)."""
    if path == "plain":
        answer = _raw(broker.proxy_port, request_bytes)
    else:
        answer = _through_tunnel(broker, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), answer[:300]
    assert b"content-type: application/problem+json" in head.lower()
    envelope = check_envelope(body)
    SEEN.append(json.dumps(envelope))
    assert envelope["invocation_id"] is None
    assert (envelope["error"]["code"], envelope["error"]["outcome"], envelope["error"]["retry"]) == (code, "not_attempted", "after_correction")
    assert b"mitmproxy" not in body.lower() and b"twelve" not in body and b"NOT HTTP" not in body
    assert upstream.received == []


OVERSIZED_SNIPPET = """
import json, sys, requests
url, size = sys.argv[1], int(sys.argv[2])
answers = []
for _ in range(3):
    try:
        r = requests.post(url, data=b"x" * size, timeout=30)  # sends the whole body, then reads
        answers.append([r.status_code, r.json()["error"]["code"]])
    except requests.RequestException as exc:
        answers.append(["raised", type(exc).__name__, str(exc)[:300]])
print(json.dumps(answers))
"""


@pytest.mark.parametrize("size_mib", [12, 40])
@pytest.mark.parametrize("url", ["https://api.payments.test/h/ok", "http://plain.example.test/h/ok"])
def test_a_client_that_sends_its_whole_oversized_body_before_reading_gets_the_refusal(
    broker: BrokerProcess, upstream: HostileUpstream, url: str, size_mib: int,
):
    """requests (urllib3) writes the whole body before it reads. The proxy core refuses a body
    over its limit at once (413) and used to close with the rest unread: the kernel answered the
    agent's next bytes with a reset, which discarded the refusal, and requests raised a
    ConnectionError or SSLError (14 of 15 times over TLS in a probe). The broker now stops
    sending and reads on, dropping the bytes, until the agent closes."""
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    env.update(HTTPS_PROXY=broker.proxy_url(), HTTP_PROXY=broker.proxy_url(), REQUESTS_CA_BUNDLE=str(broker.ca_path))
    upstream.reset()
    run = subprocess.run([sys.executable, "-c", OVERSIZED_SNIPPET, url, str(size_mib << 20)], env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert json.loads(run.stdout) == [[413, "PAYLOAD_LIMIT"]] * 3
    assert upstream.received == []


def test_a_chunked_body_over_the_limit_sent_whole_by_curl_gets_the_refusal(broker: BrokerProcess, upstream: HostileUpstream, tmp_path: Path):
    """curl with a chunked upload reads nothing until it has sent the last chunk ("Empty reply
    from server" before the linger)."""
    body = tmp_path / "big"
    body.write_bytes(b"y" * (12 << 20))
    upstream.reset()
    done = broker.curl("http://plain.example.test/h/ok", "-X", "POST", "-H", "Transfer-Encoding: chunked", "--data-binary", f"@{body}")
    assert done.returncode == 0, done.stderr.decode()
    status, _, answer = split_curl(done.stdout)
    assert (status, json.loads(answer)["error"]["code"]) == (413, "PAYLOAD_LIMIT")
    assert upstream.received == []


def test_a_well_framed_chunked_body_is_read_however_it_arrives(broker: BrokerProcess, upstream: HostileUpstream):
    """The stricter reading of chunked framing takes nothing well-framed: chunk extensions, several
    chunks, and every CRLF split across reads, one byte at a time."""
    request = (b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               b"5;name=value\r\nhello\r\n1\r\n \r\nA  \r\n0123456789\r\n0\r\n\r\n")
    upstream.reset()
    with broker.tunnel("api.payments.test") as tls:
        for i in range(len(request)):
            tls.sendall(request[i:i + 1])
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:400]
    [forwarded] = upstream.received
    assert forwarded.body == b"hello 0123456789"


@pytest.mark.parametrize(
    "head",
    [
        b"GET /h/../admin HTTP/1.1",  # /h/* would match; the upstream would serve /admin
        b"GET /h/%2e%2E/admin HTTP/1.1",
        b"GET /h/..%2fadmin HTTP/1.1",
        b"GET /h/.%5C..%5cadmin HTTP/1.1",
        b"GET /h/./ok HTTP/1.1",
        b"GET /h/..;/admin HTTP/1.1",  # servlet containers read a segment's name up to ';'
        b"GET /h/.%3Bx/ok HTTP/1.1",
        b"GET /h/%252e%252E/admin HTTP/1.1",  # an upstream that decodes twice
        b"GET /h/%2525252e%2525252e/admin HTTP/1.1",  # or more
        b"GET /h/..%00/admin HTTP/1.1",  # one that stops reading at a NUL
        b"GET /h/..%3f/admin HTTP/1.1",  # one that decodes, then splits off the query
        b"GET /h/..%20/admin HTTP/1.1",  # Windows drops trailing spaces and dots from a name
        b"GET /h/.../admin HTTP/1.1",
        b"GET /h/%u002e%u002e/admin HTTP/1.1",  # IIS's own escape
        b"GET /h/%c0%ae%c0%ae/admin HTTP/1.1",  # overlong UTF-8, read by lenient decoders
        b"GET /h/..%c0%afadmin HTTP/1.1",  # an overlong slash
        b"GET /h/%ef%bc%8e%ef%bc%8e/admin HTTP/1.1",  # fullwidth dots, which NFKC makes '.'
        b"GET /h/ok#x HTTP/1.1",  # a fragment is never sent: an upstream may read the path up to it
        b"GET /h/ok HTTP/1.1\r\nX-Note: a\rb",
        b"GET /h/ok HTTP/1.1\r\nX-Note: a\x00b",
        b"POST /h/ok HTTP/1.1\r\nIdempotency-Key: z\xff\xfe",
        b"POST /h/ok HTTP/1.1\r\nIdempotency-Key: \xd0\xba\xd0\xbb\xd1\x8e\xd1\x87-1",
        b"POST /h/ok HTTP/1.1\r\nIdempotency-Key: one\r\nIdempotency-Key: two",
        b"PO\xc5\xbfT /h/ok HTTP/1.1",  # 'PO\u017fT' upper-cases to 'POST'; no token, no method
        b"GE\xc3\x9f /h/ok HTTP/1.1",
    ],
)
def test_requests_that_would_reach_another_path_or_split_are_malformed_before_any_secret(
    broker: BrokerProcess, upstream: HostileUpstream, head: bytes
):
    """Dot-segments (raw or percent-encoded, behind an encoded slash or backslash) would let an
    upstream that resolves them serve a path the route's glob never saw, with the route's
    credential; a line break or NUL would split the request; a key that is not one visible-ASCII
    value names no operation the agent can repeat. Each is the agent's to correct."""
    request = head + b"\r\nHost: api.payments.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    answer = _through_tunnel(broker, request)
    head_of_answer, _, body = answer.partition(b"\r\n\r\n")
    assert head_of_answer.startswith(b"HTTP/1.1 400"), answer[:400]
    envelope = check_envelope(body)
    SEEN.append(json.dumps(envelope))
    error = envelope["error"]
    assert (error["code"], error["phase"], error["outcome"], error["retry"]) == (
        "MALFORMED_REQUEST", "validation", "not_attempted", "after_correction"), error
    assert "Nothing was sent" in error["message"]
    kinds = [e["kind"] for e in broker.invocation(envelope["invocation_id"])["events"]]
    assert "CREDENTIAL_AUTHORIZED" not in kinds and "DISPATCH_STARTED" not in kinds, kinds
    assert upstream.received == []


def test_a_second_value_of_the_injected_header_is_an_override(make_broker: BrokerFactory, upstream: HostileUpstream):
    """The placeholder is the one value the agent may send; a second line of the header is not
    silently dropped while the secret goes out."""
    routes = standard_routes(upstream)
    routes[0]["inject"]["placeholder"] = "Bearer placeholder"
    broker = make_broker("sqlite", routes=routes)
    request = (b"GET /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nAuthorization: Bearer placeholder\r\n"
               b"Authorization: Bearer mine\r\nConnection: close\r\n\r\n")
    head, _, body = _through_tunnel(broker, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), head
    assert check_envelope(body)["error"]["code"] == "FORBIDDEN_HEADER_OVERRIDE"
    assert upstream.received == []
    with broker.client() as client:  # the placeholder alone still goes through, with the secret
        assert _seen(client.get(f"{PAYMENTS}/h/ok", headers={"Authorization": "Bearer placeholder"})).status_code == 200


def test_a_request_head_just_under_the_bound_is_served_however_it_arrives(broker: BrokerProcess, upstream: HostileUpstream):
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    head = (b"GET http://plain.example.test/h/ok HTTP/1.1\r\nProxy-Authorization: Basic " + basic
            + b"\r\nX-Big: " + b"a" * 60000 + b"\r\nConnection: close\r\n\r\n")
    for parts in ([head], [head[:40000], head[40000:]], [head[i:i + 8192] for i in range(0, len(head), 8192)]):
        with socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=10) as sock:
            for part in parts:
                sock.sendall(part)
                time.sleep(0.02)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), (len(parts), answer[:300])


BIG = 8 * 1024 * 1024  # more than the kernel's socket buffers and an HTTP/2 window hold


def test_a_large_answer_the_agent_never_reads_is_not_recorded_as_delivered(broker: BrokerProcess, upstream: HostileUpstream):
    """RESULT_DELIVERED only once every byte has left the broker (contract section 6): an agent
    that takes the head and a little of the body, then resets, had a failed delivery, and the
    record says fetch the result."""
    invocation_id, read = big_answer_over_http1(broker, BIG, read_all=False)
    assert read < BIG
    record = broker.wait_for(invocation_id, lambda r: r["stage"] in ("delivered", "delivery_failed"))
    kinds = [e["kind"] for e in record["events"]]
    assert "RESULT_DELIVERED" not in kinds, kinds
    assert (record["stage"], record["phase"], record["retry"], record["caller_disposition"]) == (
        "delivery_failed", "result_delivery", "fetch_result", "disconnected"), record
    with broker.api() as api:  # and it is all there to fetch
        assert len(_seen(api.get(f"/v1/invocations/{invocation_id}/result")).content) == BIG


def test_a_large_answer_read_slowly_is_delivered_once_it_has_all_left(broker: BrokerProcess, upstream: HostileUpstream):
    invocation_id, read = big_answer_over_http1(broker, BIG, read_all=True)
    assert read == BIG
    record = broker.wait_for(invocation_id, lambda r: r["stage"] in ("delivered", "delivery_failed"))
    assert record["stage"] == "delivered" and record["caller_disposition"] == "completed", record


def test_an_http2_answer_its_window_never_admits_is_not_recorded_as_delivered(broker: BrokerProcess, upstream: HostileUpstream):
    """An HTTP/2 agent that never opens its flow-control window gets the head and 64 KiB; the
    rest waits in the broker. Closing then is a failed delivery, not a delivered result."""
    import h2.config
    import h2.connection
    import h2.events

    tls = broker.tunnel("api.payments.test", alpn="h2")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", "api.payments.test"),
                          (":path", f"/h/big?bytes={BIG}")], end_stream=True)
    tls.sendall(conn.data_to_send())
    invocation_id, received = None, 0
    deadline = time.monotonic() + 10
    while received < 65535 and time.monotonic() < deadline:
        for event in conn.receive_data(tls.recv(65536)):
            if isinstance(event, h2.events.ResponseReceived):
                invocation_id = dict(event.headers)["affidavit-invocation-id"]
            elif isinstance(event, h2.events.DataReceived):
                received += len(event.data)  # never acknowledged: the window stays shut
        tls.sendall(conn.data_to_send())
    assert invocation_id is not None and 0 < received < BIG, received
    time.sleep(1.0)
    tls.close()
    record = broker.wait_for(invocation_id, lambda r: r["stage"] in ("delivered", "delivery_failed"))
    kinds = [e["kind"] for e in record["events"]]
    assert "RESULT_DELIVERED" not in kinds and record["retry"] == "fetch_result", (kinds, record["retry"])


def test_an_endless_request_head_is_refused_on_the_proxy_port(broker: BrokerProcess, upstream: HostileUpstream):
    """Anyone who reaches the proxy port, before any credential is asked for, could make the
    broker hold a request head of any size: 32 MiB of one header line took 33 MB of its memory.
    Now it reads at most 64 KiB and a read more, then refuses and closes."""
    def rss_kib() -> int:
        return int(Path(f"/proc/{broker.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])

    before = rss_kib()
    with socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=10) as sock:
        sent = 0
        try:
            sock.sendall(b"GET http://plain.example.test/h/ok HTTP/1.1\r\nX-Big: ")
            while sent < 32 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass  # the broker closed: the refusal
        else:
            raise AssertionError("the broker read 32 MiB of a request head without refusing it")
    assert sent < 16 * 1024 * 1024, sent
    assert rss_kib() - before < 8 * 1024, (before, rss_kib())
    with broker.client() as client:  # and it serves on
        assert _seen(client.get(f"{PAYMENTS}/h/ok")).status_code == 200


def test_the_memory_of_large_bodies_is_given_back_refused_ones_included(make_broker, upstream: HostileUpstream):
    """mitmproxy reads a request's body before the 407 goes out, and a finished flow's objects
    (its body with them) wait in reference cycles for a collection the broker's object-count
    thresholds rarely start: forty 8 MiB uploads with no credentials left ~300 MiB behind. A
    collection once bodies worth 64 MiB have passed bounds it."""
    broker = make_broker()

    def rss_mib() -> float:
        return int(Path(f"/proc/{broker.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    body = os.urandom(8 * 1024 * 1024)
    with broker.client() as client:
        assert _seen(client.get(f"{PAYMENTS}/h/ok")).status_code == 200
    before = rss_mib()
    with httpx.Client(proxy=f"http://127.0.0.1:{broker.proxy_port}", timeout=30) as anonymous:
        for _ in range(40):
            assert anonymous.post("http://plain.example.test/h/ok", content=body).status_code == 407
    time.sleep(0.5)
    grown = rss_mib() - before
    assert grown < 160, f"{grown:.0f} MiB more after 320 MiB of refused uploads"


CHUNKED = b"POST /h/ok HTTP/1.1\r\nHost: api.payments.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"


@pytest.mark.parametrize("version", ["http/1.1 tunnel", "http/1.1 plain", "h2"])
def test_request_trailers_are_refused_over_either_http_version(broker: BrokerProcess, upstream: HostileUpstream, version):
    """Trailer fields after a request body: the broker forwards none, so it refuses the request
    whole rather than send it without them. Over HTTP/1 mitmproxy's connection handler used to
    crash on them (NotImplementedError) and leave the agent waiting; over HTTP/2 they were dropped."""
    with broker.operator() as api:
        recorded = len(api.get("/v1/invocations", params={"limit": 500}).json()["items"])
    if version == "h2":
        status, fields, body = _h2_request(broker, "POST", "/h/ok", body=b"abc", trailers=[("x-checksum", "abc")])
        assert ("content-type", "application/problem+json") in fields
    else:
        if version == "http/1.1 tunnel":
            answer = _through_tunnel(broker, CHUNKED + b"X-Checksum: abc\r\n\r\n")
        else:
            auth = b"Proxy-Authorization: " + broker.agents["builder"].basic.encode() + b"\r\n"
            request = CHUNKED.replace(b"POST /h/ok", b"POST http://plain.example.test/h/ok").replace(
                b"Host: api.payments.test\r\n", b"Host: plain.example.test\r\n" + auth)
            answer = _raw(broker.proxy_port, request + b"X-Checksum: abc\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), answer[:300]
        assert b"content-type: application/problem+json" in head.lower() and b"connection: close" in head.lower()
        status = 400
    # No answer at all (the old HTTP/1 behaviour, for 30-40 s) fails above: the sockets time out after 10 s.
    envelope = check_envelope(body)
    SEEN.append(json.dumps(envelope))
    assert status == 400 and envelope["invocation_id"] is None
    assert (envelope["error"]["code"], envelope["error"]["outcome"], envelope["error"]["retry"]) == ("MALFORMED_REQUEST", "not_attempted", "after_correction")
    assert "trailer" in envelope["error"]["message"] and "abc" not in envelope["error"]["message"]
    assert upstream.received == []
    assert "mitmproxy has crashed" not in broker.logs() and "Traceback" not in broker.logs()
    with broker.operator() as api:
        assert len(api.get("/v1/invocations", params={"limit": 500}).json()["items"]) == recorded, "nothing is recorded"

    # The same request without trailers is forwarded, body and all.
    if version == "h2":
        status, _, body = _h2_request(broker, "POST", "/h/ok", body=b"abc")
    else:
        status = int(_through_tunnel(broker, CHUNKED.replace(b"chunked\r\n", b"chunked\r\nConnection: close\r\n") + b"\r\n").split(b" ", 2)[1])
    assert status == 200
    [seen] = upstream.received
    assert seen.body == b"abc" and seen.header("X-Checksum") is None


def test_http2_cookie_fields_reach_an_http1_upstream_as_one_cookie_line(broker: BrokerProcess, upstream: HostileUpstream):
    """An HTTP/2 agent may split Cookie into one field per cookie; over HTTP/1.1 they must be one
    line joined with "; " (RFC 9113 8.2.3), or an upstream that reads one Cookie line loses
    cookies. Other repeated fields keep their order and number."""
    status, _, _ = _h2_request(broker, "GET", "/h/ok", headers=[
        ("cookie", "session=abc"), ("x-tag", "one"), ("cookie", "csrf=xyz"), ("x-tag", "two"), ("cookie", "theme=dark"),
    ])
    assert status == 200
    [seen] = upstream.received
    assert [(k.lower(), v) for k, v in seen.headers if k.lower() in ("cookie", "x-tag")] == [
        ("cookie", "session=abc; csrf=xyz; theme=dark"), ("x-tag", "one"), ("x-tag", "two"),
    ]


def test_debug_logging_logs_no_header_an_agent_sends(make_broker, upstream: HostileUpstream):
    """At level debug, libraries' debug output (hpack decodes every HTTP/2 header) would log the
    agent's own tokens and cookies: only the broker's loggers follow the level."""
    broker = make_broker(log={"level": "debug"})
    agent_secret = "agent_cookie_" + "5f0e3c1b9a7d"
    for version in ("--http2", "--http1.1"):
        done = broker.curl(f"{PAYMENTS}/h/ok", version, "-H", f"Cookie: session={agent_secret}",
                           "-H", f"X-Agent-Token: {agent_secret}")
        assert done.returncode == 0, done.stderr
    logs = broker.logs()
    assert '"level":"debug"' in logs or "invocation ended" in logs
    assert agent_secret not in logs and CANARIES["PAYMENTS_KEY"] not in logs


@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_an_oversized_body_gets_the_payload_limit_envelope_over_either_http_version(broker: BrokerProcess, upstream: HostileUpstream, version, tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * (12 * 1024 * 1024))
    done = broker.curl("https://api.payments.test/h/ok", version, "--data-binary", f"@{big}")
    assert done.returncode == 0, done.stderr
    status, headers, body = split_curl(done.stdout)
    assert status == 413 and headers["content-type"] == "application/problem+json", done.stdout[:500]
    envelope = check_envelope(body)
    SEEN.append(json.dumps(envelope))
    assert envelope["error"]["code"] == "PAYLOAD_LIMIT" and envelope["invocation_id"] is None
    assert upstream.received == []


def test_a_client_that_takes_the_side_api_for_the_proxy_is_told_so(broker: BrokerProcess, upstream: HostileUpstream):
    """HTTPS_PROXY pointed at api.listen by mistake: uvicorn answered a CONNECT with a bare
    "Invalid HTTP request received" and an absolute-form request with "no such endpoint"."""
    offset = len(broker.logs())
    answer = _api_raw(broker, [b"CONNECT api.payments.test:443 HTTP/1.1\r\nHost: api.payments.test:443\r\n\r\n"])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/problem+json" in head, answer[:300]
    assert "not its proxy" in json.loads(body)["detail"] and "proxy.listen" in json.loads(body)["detail"], body
    with httpx.Client(proxy=broker.api_url, timeout=10) as mistaken:
        answer = _seen(mistaken.get("http://api.payments.test/v1/charges"))
        assert answer.status_code == 404 and "not its proxy" in answer.json()["detail"], answer.text
        assert "http://api.payments.test/v1/charges" in answer.json()["detail"]
        # A GitLab-style id with an encoded '/' is told the same, not "an encoded '/' is part of no path".
        answer = _seen(mistaken.get("http://api.payments.test/api/v4/projects/group%2Fproject"))
        assert answer.status_code == 404 and "not its proxy" in answer.json()["detail"], answer.text
        with pytest.raises(httpx.ProxyError, match="400"):
            mistaken.get("https://api.payments.test/v1/charges")
    with httpx.Client(base_url=broker.api_url, timeout=10) as anyone:  # a path that is none, asked directly
        assert "not its proxy" not in _seen(anyone.get("/v1/charges")).json()["detail"]
    logged = broker.logs()[offset:]
    assert "Unsupported upgrade" not in logged and "Invalid HTTP request" not in logged, logged[-2000:]


def test_upstream_keepalive_is_how_long_an_idle_connection_is_reused(make_broker, upstream: HostileUpstream):
    """[upstream] keepalive reaches the broker's client: within it the next request rides the same
    connection, past it a new one is opened."""
    broker = make_broker(start=False)
    broker.config.setdefault("upstream", {})["keepalive"] = "400ms"
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    broker.start()
    upstream.reset()
    with broker.client() as client:
        for pause in (0.0, 0.05, 1.0):
            time.sleep(pause)
            assert client.get(f"{PAYMENTS}/h/ok").status_code == 200
    first, second, third = upstream.received
    assert first.conn_id == second.conn_id != third.conn_id
