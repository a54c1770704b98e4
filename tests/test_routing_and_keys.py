"""Route matching, file secrets and idempotency keys, through real broker processes.

Every test checks three things: what the agent was answered (response or envelope), what the
side API records, and what the hostile upstream actually received and applied.
Runs once per journal dialect through the module-scoped ``broker``; tests that need their own
configuration (failpoints, a custom key header) start one with ``make_broker``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import tomli_w

from proxy.fingerprint import fingerprint, normalized_target
from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream
from tests.support.journal import dispatched_ids, dump_journal, query

FILE_SECRET = "file-key"


def key_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    plain = f"127.0.0.1:{up.http_port}"

    def pin(name: str, host: str, port: int, target: str) -> dict[str, Any]:
        # A route nobody's request can match (reviewer only, a path no test uses) whose only job
        # is its connect_to: pins are per (host, port) across routes (docs/configuration.md), so a
        # request a wildcard route lets through reaches the hostile upstream instead of DNS, and a
        # request wrongly let through would show up in ``upstream.received``.
        return {"name": name, "host": host, "port": port, "path": "/__pin_only__", "agents": ["reviewer"], "connect_to": target}

    return [
        {"name": "wild", "host": "*.wild.test", "port": 80, "scheme": "http", "methods": ["GET"], "agents": ["builder"]},
        pin("pin-a", "a.wild.test", 80, plain),
        pin("pin-bc", "b.c.wild.test", 80, plain),
        pin("pin-bare", "wild.test", 80, plain),
        pin("pin-x", "xwild.test", 80, plain),
        {"name": "glob", "host": "glob.example.test", "path": "/v1/charges*", "methods": ["GET", "POST"],
         "agents": ["builder"], "connect_to": good},
        pin("pin-glob-8443", "glob.example.test", 8443, good),
        {"name": "suffix", "host": "suffix.example.test", "path": "/files/*.json", "methods": ["GET"],
         "agents": ["builder"], "connect_to": good},
        {"name": "filesecret", "host": "file.example.test", "methods": ["GET"], "agents": ["builder"],
         "credential": FILE_SECRET, "inject": {"header": "X-Api-Key", "value": "Token {secret}"}, "connect_to": good},
        {"name": "keys-a", "host": "keys-a.example.test", "methods": ["POST"], "agents": ["builder", "reviewer"], "connect_to": good},
        {"name": "keys-b", "host": "keys-b.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good},
        {"name": "shared-1", "host": "shared-1.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good,
         "idempotency": {"header": "Idempotency-Key", "scope": "shared", "retention": "1h"}},
        {"name": "shared-2", "host": "shared-2.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good,
         "idempotency": {"header": "Idempotency-Key", "scope": "shared", "retention": "1h"}},
        {"name": "durable", "host": "durable.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good,
         "idempotency": {"header": "Idempotency-Key", "scope": "durable-scope", "retention": "2h"}},
        {"name": "rej", "host": "rej.example.test", "methods": ["POST"], "agents": ["builder"], "connect_to": good},
        {"name": "rej-idem", "host": "rej-idem.example.test", "methods": ["POST"], "idempotent": True,
         "agents": ["builder"], "connect_to": good},
    ]


def secret_path(broker: BrokerProcess) -> Path:
    return broker.workdir / "secrets" / FILE_SECRET


def started(make_broker, dialect: str, up: HostileUpstream, **kwargs: Any) -> BrokerProcess:
    """A broker of its own (``make_broker``) with the routes and the ``file:`` secret of this module."""
    return with_file_secret(make_broker(dialect, routes=key_routes(up), start=False, **kwargs)).start()


def with_file_secret(broker: BrokerProcess) -> BrokerProcess:
    """Add the ``file:`` secret to a not-yet-started broker's configuration (absolute path)."""
    secret_path(broker).parent.mkdir(parents=True, exist_ok=True)
    broker.config["secrets"].append({"name": FILE_SECRET, "from": f"file:{secret_path(broker)}"})
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    return broker


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
           upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, key_routes(upstream_server), name="routing",
                             prepare=with_file_secret)


@pytest.fixture(scope="module")
def custom_header_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
                         upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    """One SQLite broker whose ``[proxy] idempotency_header`` is ``X-Operation-Key``."""
    yield from module_broker(request, tmp_path_factory, pki, key_routes(upstream_server), name="routing-custom-header",
                             dialect="sqlite", prepare=with_file_secret, proxy={"idempotency_header": "X-Operation-Key"})


def key() -> str:
    return "k_" + secrets.token_hex(8)


def sent(up: HostileUpstream) -> list:
    return [r for r in up.received if r.method]


def post(client: httpx.Client, url: str, headers: dict[str, str] | None = None, body: bytes = b'{"amount":100}') -> httpx.Response:
    return client.post(url, content=body, headers={"Content-Type": "application/json", **(headers or {})})


def refused(broker: BrokerProcess, response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """A validation refusal: the envelope, its headers, and the record agree that nothing was sent."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = check_envelope(response.content)
    assert (body["error"]["phase"], body["error"]["outcome"], body["error"]["code"]) == ("validation", "not_attempted", code)
    assert body["evidence"]["dispatch_started"] is False
    assert response.headers["affidavit-outcome"] == "not_attempted"
    assert body["invocation_id"] == response.headers["affidavit-invocation-id"]
    record = broker.invocation(body["invocation_id"])
    assert (record["outcome"], record["code"], record["route"]) == ("not_attempted", code, None)
    assert "DISPATCH_STARTED" not in [e["kind"] for e in record["events"]]
    return body


# -- 1. route matching -------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["a.wild.test", "b.c.wild.test", "A.Wild.TEST"])
def test_a_wildcard_route_matches_subdomains_at_any_depth(broker, upstream, host):
    with broker.client() as client:
        r = client.get(f"http://{host}/h/ok")
    assert r.status_code == 200, r.text
    assert r.headers["affidavit-outcome"] == "committed"
    record = broker.invocation(r.headers["affidavit-invocation-id"])
    assert record["route"] == "wild" and record["outcome"] == "committed"
    assert record["target"] == f"http://{host.lower()}:80/h/ok"
    [seen] = sent(upstream)
    assert seen.tls is None and seen.path == "/h/ok"
    assert seen.header("Host").lower() == host.lower()
    assert upstream.effects == 1


@pytest.mark.parametrize("host", ["wild.test", "xwild.test", "wild.test.evil.test"])
def test_a_wildcard_route_does_not_match_the_bare_suffix_or_a_lookalike(broker, upstream, host):
    with broker.client() as client:
        r = client.get(f"http://{host}/h/ok")
    refused(broker, r, 403, "INVALID_TARGET")
    assert sent(upstream) == []


def test_a_host_with_a_trailing_dot_is_refused_saying_so(broker, upstream):
    """The refusal shows the normalized target, without the dot, which a route does name: the
    message says what was written."""
    with broker.client() as client:
        r = client.get("http://a.wild.test./h/ok")
    body = refused(broker, r, 403, "INVALID_TARGET")
    assert "The host was written 'a.wild.test.', with a trailing dot" in body["error"]["message"], body
    assert sent(upstream) == []


def test_a_path_glob_matches_across_slashes_and_ignores_the_query(broker, upstream):
    with broker.client() as client:
        deep = client.get("https://glob.example.test/v1/charges/ch_1/refunds")
        query_ = client.get("https://glob.example.test/v1/charges?next=/v2/x")
    assert deep.status_code == 200 and query_.status_code == 200
    assert [r.path for r in sent(upstream)] == ["/v1/charges/ch_1/refunds", "/v1/charges?next=/v2/x"]
    assert broker.invocation(deep.headers["affidavit-invocation-id"])["route"] == "glob"


@pytest.mark.parametrize("url", [
    "https://glob.example.test/v2/charges",
    "https://glob.example.test/V1/charges",  # the glob is case-sensitive (fnmatchcase)
    "https://glob.example.test/h/ok?p=/v1/charges",  # the query is not part of the matched path
])
def test_a_path_outside_the_glob_is_an_invalid_target(broker, upstream, url):
    with broker.client() as client:
        for method in ("GET", "POST"):
            refused(broker, client.request(method, url, content=b"{}" if method == "POST" else None), 403, "INVALID_TARGET")
    assert sent(upstream) == []


@pytest.mark.parametrize("path", [
    "/files/secret.txt;.json",  # servlet containers drop a segment's ';' parameters
    "/files/admin/delete;x.json",
    "/files/secret.txt%3b.json",
    "/files/secret.txt%00.json",  # C servers stop at a NUL
    "/files/secret.txt%2500.json",  # decoded twice
])
def test_a_path_that_matches_the_glob_only_as_written_is_an_invalid_target(broker, upstream, path):
    """A glob with a fixed ending must also match the path as a lenient upstream reads it."""
    with broker.client() as client:
        message = refused(broker, client.get(f"https://suffix.example.test{path}"), 403, "INVALID_TARGET")["error"]["message"]
    assert "as an upstream may read it" in message, message
    assert "/files/secret.txt'" in message or "/files/admin/delete'" in message, message
    assert sent(upstream) == []


@pytest.mark.parametrize(("glob", "path"), [
    ("/api/v4/projects/acme%2Fwidgets/*", "/api/v4/projects/acme%2Fwidgets/issues"),  # GitLab's project ids
    ("/calendar/v3/calendars/team%40acme.com/events", "/calendar/v3/calendars/team%40acme.com/events"),
    ("/files/my%20report.pdf", "/files/my%20report.pdf"),
    ("/api/items;v=2/list", "/api/items;v=2/list"),
    ("/files/*/meta", "/files/a%3Fb/meta"),  # '?' and '#' are fine in an object's key
    ("/files/*.json", "/files/a;v=1/b%20c.json"),
])
def test_a_glob_is_read_as_leniently_as_the_path(glob, path):
    """Encodings and ';' parameters the operator wrote into the glob are read the same way as the
    path's, so a route for an encoded path still matches it."""
    from proxy.config import Route
    from proxy.routing import match_route

    route = Route(name="r", host="api.test", path=glob, methods=["GET"], agents=["a"])
    assert match_route([route], "a", "https", "api.test", 443, "GET", path) is route


def test_a_path_whose_lenient_reading_the_glob_allows_too_is_served(broker, upstream):
    with broker.client() as client:
        assert client.get("https://suffix.example.test/files/a;v=1/b%20c.json").status_code == 200
    assert [r.path for r in sent(upstream)] == ["/files/a;v=1/b%20c.json"], "sent as written"


@pytest.mark.parametrize("path", [
    "/files/caf%C3%A9.json",  # non-ASCII, encoded: read the slow way, and no dot in it
    "/files/%E2%82%AC/price.json",
    "/files/main...feature.json",  # dots inside a name are no segment of their own
    "/files/.well-known.json",
    "/files/%e9t%e9.json",  # Latin-1 bytes, not UTF-8: nothing a decoder reads as a dot
    "/files/%ud800.json",  # half a UTF-16 pair in IIS's escape: no character, and no crash
    "/files/%f0%8d%a0%80.json",  # an overlong surrogate
])
def test_a_path_that_only_resembles_a_dot_segment_is_served_as_written(broker, upstream, path):
    with broker.client() as client:
        assert client.get(f"https://suffix.example.test{path}").status_code == 200
    assert [r.path for r in sent(upstream)] == [path]


@pytest.mark.parametrize(("segment", "hides"), [
    ("..", True), (".", True), ("%2E%2e", True), ("..%20", True), ("..%09", True), ("...", True), (". .", True),
    ("%u002e%u002E", True), ("%U002e%U002E", True), ("%25u002e%25u002e", True), ("%c0%ae%c0%ae", True), ("%e0%80%ae.", True),
    ("%f0%80%80%ae", True), ("..%c0%afadmin", True), ("%ef%bc%8e%ef%bc%8e", True), ("%e2%80%a5", True),
    ("%ef%bc%8e%ef%bc%8e%ef%bc%8fadmin", True), ("..%ef%bc%bcadmin", True), ("..;x", True), ("%2e%2e%00x", True),
    ("..%3f", True), ("..%3Fx=1", True), ("..%23top", True), ("%2e%23", True), ("x%23..", False), ("a%3f..", False), ("..a%3f", False),
    ("ok", False), ("a.b", False), ("..a", False), ("x..", False), ("main...feature", False), ("caf%C3%A9", False),
    ("%e9t%e9", False), ("%ff%fe", False), ("%c3%28", False), ("%u0041", False), ("%uzzzz", False),
    ("%ud800", False), ("%uDFFF%u002e", False), ("%25ud800", False), ("%f0%8d%a0%80", False), ("%ed%a0%80", False),
])
def test_the_readings_of_a_segment_that_hide_a_dot_segment(segment, hides):
    """Each reading some server applies (decoding twice, IIS's %u, overlong UTF-8, Unicode
    compatibility forms, Windows' trailing dots and spaces, ';' and NUL) is checked; a name with
    dots among other characters is no dot-segment in any of them."""
    from proxy.routing import hides_a_dot_segment

    assert hides_a_dot_segment(segment) is hides


def test_another_port_is_an_invalid_target(broker, upstream):
    with broker.client() as client:
        r = client.get("https://glob.example.test:8443/v1/charges")
    body = refused(broker, r, 403, "INVALID_TARGET")
    assert broker.invocation(body["invocation_id"])["target"] == "https://glob.example.test:8443/v1/charges"
    assert sent(upstream) == []


# -- 2. a file: secret ---------------------------------------------------------------------------


def test_a_file_secret_is_read_at_use_injected_and_never_shown(broker, upstream):
    path = secret_path(broker)
    values = ["fk_canary_" + secrets.token_hex(12), "fk_canary_" + secrets.token_hex(12)]
    answers, versions = [], []
    for value in values:  # the second value replaces the first without a restart
        path.write_text(f"  {value}\n")  # surrounding whitespace is trimmed (docs/configuration.md)
        versions.append(f"file-{path.stat().st_mtime_ns}")
        with broker.client() as client:
            r = client.get("https://file.example.test/h/ok")
        assert r.status_code == 200, r.text
        answers.append(r)
        time.sleep(0.02)  # a distinct modification time for the second version
    assert [s.header("X-Api-Key") for s in sent(upstream)] == [f"Token {v}" for v in values]
    texts = []
    for value, version, r in zip(values, versions, answers):
        invocation_id = r.headers["affidavit-invocation-id"]
        assert value not in r.text and "[REDACTED]" in r.text  # the upstream echoed it; the agent never sees it
        record = broker.wait_for(invocation_id, lambda rec: rec["stage"] == "delivered")
        assert record["credential"] == {"id": FILE_SECRET, "version": version, "injection": "header"}
        with broker.api() as api:
            texts += [api.get(f"/v1/invocations/{invocation_id}").text, api.get(f"/v1/invocations/{invocation_id}/result").text]
        with broker.operator() as api:
            texts.append(api.get(f"/v1/invocations/{invocation_id}").text)
            texts.append(api.get("/v1/invocations", params={"route": "filesecret"}).text)
    assert versions[0] != versions[1]
    haystack = "\n".join(texts) + dump_journal(broker.database_url) + broker.logs()
    assert FILE_SECRET in haystack
    for value in values:
        assert value not in haystack


def test_a_file_secret_that_is_not_text_is_refused_before_anything_is_sent(broker, upstream):
    """A key file holding binary (a DER key where a token was meant): CREDENTIAL_MISSING naming the
    file, not a 500 that cannot vouch for anything."""
    path = secret_path(broker)
    path.write_bytes(b"\x30\x82\x01\xff\xfe-not-utf-8")
    try:
        with broker.client() as client:
            r = client.get("https://file.example.test/h/ok")
    finally:
        path.write_text("fk_restored_" + secrets.token_hex(8))
    body = check_envelope(r.content)
    assert (r.status_code, body["error"]["code"], body["error"]["phase"], body["error"]["outcome"]) == (
        502, "CREDENTIAL_MISSING", "credential_injection", "not_attempted"), body
    assert sent(upstream) == []
    record = broker.wait_for(body["invocation_id"], lambda rec: rec["retry"] is not None)
    assert "is not UTF-8 text" in (record["events"][-1]["data"].get("diagnostic") or ""), record["events"][-1]


# -- 4. keys are scoped by (agent, scope, key) ----------------------------------------------------


def test_a_key_too_long_to_keep_or_empty_is_refused_never_cut(broker, upstream):
    """Cut to the 255 characters kept, two different keys would name one operation: the second
    payment would be answered with the first one's result as if it were its own."""
    url = "https://keys-a.example.test/h/idem_ignore?code=201"
    with broker.client() as client:
        kept = post(client, url, {"Idempotency-Key": "k" * 255})
        refused = [post(client, url, {"Idempotency-Key": "k" * 255 + tail}) for tail in ("1", "2")]
        empty = post(client, url, {"Idempotency-Key": ""})  # a template whose key came out empty
    assert kept.status_code == 201 and "affidavit-replayed" not in kept.headers
    for answer, said in [*((r, "256 characters long") for r in refused), (empty, "header is empty")]:
        body = check_envelope(answer.content)
        assert (answer.status_code, body["error"]["code"], body["error"]["outcome"]) == (
            400, "MALFORMED_REQUEST", "not_attempted"), body
        assert said in body["error"]["message"], body["error"]["message"]
        assert "affidavit-replayed" not in answer.headers
    assert len(sent(upstream)) == 1, "only the key that fits was sent"


def test_two_agents_with_one_key_on_one_route_get_two_invocations(broker, upstream):
    """Two invocations for the broker; upstream, the key goes as sent by each (docs/retries.md: at
    the upstream, agents that share a credential share its keys)."""
    k = key()
    url = "https://keys-a.example.test/h/idem_ignore?code=201"
    answers = {}
    for agent in ("builder", "reviewer"):
        with broker.client(agent) as client:
            first = post(client, url, {"Idempotency-Key": k})
            again = post(client, url, {"Idempotency-Key": k})
        assert first.status_code == again.status_code == 201
        assert "affidavit-replayed" not in first.headers and again.headers["affidavit-replayed"] == "true"
        assert again.headers["affidavit-invocation-id"] == first.headers["affidavit-invocation-id"]
        answers[agent] = first
    ids = {agent: r.headers["affidavit-invocation-id"] for agent, r in answers.items()}
    assert ids["builder"] != ids["reviewer"]
    assert upstream.effects_by_key[k] == 2 and len(sent(upstream)) == 2
    assert [r.header("Idempotency-Key") for r in sent(upstream)] == [k, k], "forwarded as sent, not per agent"
    for agent, invocation_id in ids.items():
        record = broker.invocation(invocation_id, broker.agents[agent].token)
        assert record["agent"] == agent and record["outcome"] == "committed"
        assert (record["idempotency"]["key"], record["idempotency"]["scope"]) == (k, "keys-a")
    # Each agent's view is its own: the other's invocation does not exist for it.
    with broker.api(broker.agents["reviewer"].token) as api:
        assert api.get(f"/v1/invocations/{ids['builder']}").status_code == 404


def test_one_key_on_two_routes_with_different_scopes_gets_two_invocations(broker, upstream):
    k = key()
    with broker.client() as client:
        a = post(client, "https://keys-a.example.test/h/idem_ignore?code=201", {"Idempotency-Key": k})
        b = post(client, "https://keys-b.example.test/h/idem_ignore?code=201", {"Idempotency-Key": k})
        a2 = post(client, "https://keys-a.example.test/h/idem_ignore?code=201", {"Idempotency-Key": k})
        b2 = post(client, "https://keys-b.example.test/h/idem_ignore?code=201", {"Idempotency-Key": k})
    assert [r.status_code for r in (a, b, a2, b2)] == [201] * 4
    assert "affidavit-replayed" not in a.headers and "affidavit-replayed" not in b.headers
    assert a2.headers["affidavit-replayed"] == b2.headers["affidavit-replayed"] == "true"
    assert a.headers["affidavit-invocation-id"] != b.headers["affidavit-invocation-id"]
    assert a2.headers["affidavit-invocation-id"] == a.headers["affidavit-invocation-id"]
    assert b2.headers["affidavit-invocation-id"] == b.headers["affidavit-invocation-id"]
    assert upstream.effects_by_key[k] == 2 and len(sent(upstream)) == 2
    scopes = [broker.invocation(r.headers["affidavit-invocation-id"])["idempotency"]["scope"] for r in (a, b)]
    assert scopes == ["keys-a", "keys-b"]


def test_routes_that_share_a_scope_share_keys(broker, upstream):
    k = key()
    with broker.client() as client:
        first = post(client, "https://shared-1.example.test/h/idem_honour?code=201", {"Idempotency-Key": k})
        other = post(client, "https://shared-2.example.test/h/idem_honour?code=201", {"Idempotency-Key": k})
    assert first.status_code == 201
    body = check_envelope(other.content)
    assert other.status_code == 422 and body["error"]["code"] == "IDEMPOTENCY_MISMATCH"
    assert body["error"]["outcome"] == "not_attempted"
    assert body["invocation_id"] == first.headers["affidavit-invocation-id"]
    assert len(sent(upstream)) == 1 and upstream.effects_by_key[k] == 1
    assert broker.invocation(body["invocation_id"])["idempotency"]["scope"] == "shared"


# -- 6. rejected results ------------------------------------------------------------------------


@pytest.mark.parametrize("code", [422, 400])
def test_a_complete_client_error_is_rejected_and_replayed(broker, upstream, code):
    k = key()
    url = f"https://rej.example.test/h/status?code={code}"
    with broker.client() as client:
        first = post(client, url, {"Idempotency-Key": k})
        again = post(client, url, {"Idempotency-Key": k})
    assert first.status_code == again.status_code == code
    assert first.headers["affidavit-outcome"] == again.headers["affidavit-outcome"] == "rejected"
    assert "affidavit-replayed" not in first.headers and again.headers["affidavit-replayed"] == "true"
    assert again.content == first.content and json.loads(first.content) == {"status": code, "effects": 1}
    assert again.headers["affidavit-invocation-id"] == first.headers["affidavit-invocation-id"]
    assert upstream.effects == 1 and len(sent(upstream)) == 1
    # The replay count and the delivery fact are both written a moment later, each on its own
    # schedule (docs/api.md): wait for both before reading the hint, which is null until delivery.
    record = broker.wait_for(first.headers["affidavit-invocation-id"],
                             lambda r: r["replays"] >= 1 and r["stage"] == "delivered")
    assert (record["outcome"], record["retry"], record["next_action"]) == ("rejected", "after_correction", "return_recorded_result")
    assert record["evidence"]["status"] == code and record["result_available"] is True


def test_a_429_on_a_non_idempotent_post_is_replayed_even_after_retry_after(broker, upstream):
    k = key()
    url = "https://rej.example.test/h/status?code=429&retry_after=1"
    with broker.client() as client:
        first = post(client, url, {"Idempotency-Key": k})
        record = broker.wait_for(first.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
        assert (record["outcome"], record["retry"], record["next_action"]) == ("rejected", "never", "return_recorded_result")
        time.sleep(1.3)
        late = post(client, url, {"Idempotency-Key": k})
    assert first.status_code == late.status_code == 429
    assert late.headers["affidavit-replayed"] == "true" and late.headers["retry-after"] == "1"
    assert upstream.effects == 1 and len(sent(upstream)) == 1


def test_a_429_with_retry_after_on_an_idempotent_route_is_the_keys_answer_and_a_new_key_tries_again(broker, upstream):
    k = key()
    url = "https://rej-idem.example.test/h/status?code=429&retry_after=1"
    with broker.client() as client:
        first = post(client, url, {"Idempotency-Key": k})
        invocation_id = first.headers["affidavit-invocation-id"]
        record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
        assert (record["outcome"], record["retry"], record["next_action"]) == ("rejected", "backoff", "retry_when_allowed")
        assert record["evidence"]["retry_after"] == 1
        early = post(client, url, {"Idempotency-Key": k})
        time.sleep(1.3)
        later = post(client, url, {"Idempotency-Key": k})
        assert first.status_code == early.status_code == later.status_code == 429
        for repeat in (early, later):
            assert repeat.headers["affidavit-replayed"] == "true" and repeat.content == first.content
            assert repeat.headers["affidavit-invocation-id"] == invocation_id
        assert upstream.effects == 1 and len(sent(upstream)) == 1, "the key's repeats never reach the upstream"
        fresh = post(client, url, {"Idempotency-Key": key()})
    assert fresh.status_code == 429 and "affidavit-replayed" not in fresh.headers
    assert fresh.headers["affidavit-invocation-id"] != invocation_id
    assert upstream.effects == 2 and len(sent(upstream)) == 2
    record = broker.wait_for(invocation_id, lambda r: r["replays"] >= 2)
    assert [e["kind"] for e in record["events"]].count("DISPATCH_STARTED") == 1
    assert record["retry_budget"]["used"] == 0, "a replay takes no lease and spends no budget"


# -- 3. a custom idempotency header ---------------------------------------------------------------


def test_a_custom_idempotency_header_is_the_only_key(custom_header_broker, upstream):
    broker = custom_header_broker
    k, plain = key(), key()
    url = "https://keys-a.example.test/h/idem_ignore?code=201&header=X-Operation-Key"
    with broker.client() as client:
        first = post(client, url, {"X-Operation-Key": k})
        again = post(client, url, {"X-Operation-Key": k})
    assert first.status_code == again.status_code == 201
    assert again.headers["affidavit-replayed"] == "true" and again.content == first.content
    assert upstream.effects_by_key[k] == 1
    record = broker.invocation(first.headers["affidavit-invocation-id"])
    assert (record["idempotency"]["key"], record["idempotency"]["scope"]) == (k, "keys-a")
    assert sent(upstream)[0].header("X-Operation-Key") == k  # no contract: forwarded as sent

    upstream.reset()
    url = "https://keys-a.example.test/h/idem_ignore?code=201"
    with broker.client() as client:
        one = post(client, url, {"Idempotency-Key": plain})
        two = post(client, url, {"Idempotency-Key": plain})
    assert one.status_code == two.status_code == 201
    assert "affidavit-replayed" not in two.headers
    assert one.headers["affidavit-invocation-id"] != two.headers["affidavit-invocation-id"]
    assert upstream.effects_by_key[plain] == 2, "Idempotency-Key is just a header now"
    for r in (one, two):
        assert broker.invocation(r.headers["affidavit-invocation-id"])["idempotency"] is None
    assert query(broker.database_url, f"SELECT count(*) FROM invocations WHERE idempotency_key = '{plain}'") == [("0",)]


def test_a_custom_idempotency_header_feeds_a_declared_contract(custom_header_broker, upstream):
    broker = custom_header_broker
    k, theirs = key(), key()
    url = "https://shared-1.example.test/h/idem_honour?code=201"
    with broker.client() as client:
        keyed = post(client, url, {"X-Operation-Key": k})
        first = post(client, url, {"Idempotency-Key": theirs})
        second = post(client, url, {"Idempotency-Key": theirs})
        unkeyed = post(client, url, {})
    assert keyed.status_code == first.status_code == second.status_code == unkeyed.status_code == 201
    assert keyed.headers["affidavit-idempotency-key"] == k
    seen = sent(upstream)
    assert seen[0].header("Idempotency-Key") == k and seen[0].header("X-Operation-Key") is None
    # The contract's own header (here the default name, not [proxy] idempotency_header) is the
    # agent's key too: the repeat is the same operation, replayed, never a second effect under a
    # key the broker made up. Only a request with no key at all gets one of the broker's.
    assert first.headers["affidavit-idempotency-key"] == theirs
    assert second.headers["affidavit-replayed"] == "true"
    assert first.headers["affidavit-invocation-id"] == second.headers["affidavit-invocation-id"]
    generated = unkeyed.headers["affidavit-idempotency-key"]
    assert generated.startswith("afk_")
    assert [s.header("Idempotency-Key") for s in seen[1:]] == [theirs, generated]
    assert upstream.effects == 3 and upstream.effects_by_key[theirs] == 1


# -- 5. the key is durable before dispatch ---------------------------------------------------------


def _timestamp(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_key_fingerprint_scope_and_expiry_are_durable_before_dispatch(make_broker, upstream, dialect):
    broker = started(make_broker, dialect, upstream, env={"AFFIDAVIT_FAILPOINTS": "after_dispatch_commit=pause:1.5"})
    url_path = "/h/idem_honour?code=201"
    body = b'{"amount":7}'
    expected_fp = fingerprint("POST", normalized_target("https", "durable.example.test", 443, url_path), body,
                              [("Content-Type", "application/json")])
    for agent_key in (key(), None):  # the agent's own key, then one the broker generates
        answers: dict[str, httpx.Response] = {}

        def send() -> None:
            with broker.client(timeout=15) as client:
                answers["r"] = post(client, "https://durable.example.test" + url_path, {"Idempotency-Key": agent_key} if agent_key else {}, body)

        upstream.reset()
        thread = threading.Thread(target=send)
        thread.start()
        where = f"idempotency_key = '{agent_key}'" if agent_key else "idempotency_key LIKE 'afk_%'"
        sql = ("SELECT invocation_id, idempotency_key, idempotency_scope, fingerprint, idempotency_expires_at, created_at "
               f"FROM invocations WHERE {where}")
        deadline, rows = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            rows = [r for r in query(broker.database_url, sql) if r[0] in dispatched_ids(broker.database_url)]
            if rows:
                break
            time.sleep(0.05)
        upstream_saw = len(upstream.received)
        thread.join(20)
        assert rows, "DISPATCH_STARTED was never durable"
        assert upstream_saw == 0, "the journal was read too late: the request had already left"
        [(invocation_id, stored_key, scope, stored_fp, expires, created)] = rows
        assert stored_key == (agent_key or answers["r"].headers["affidavit-idempotency-key"])
        assert scope == "durable-scope"
        assert stored_fp == expected_fp
        assert abs((_timestamp(expires) - _timestamp(created)) - timedelta(hours=2)) < timedelta(seconds=5)
        r = answers["r"]
        assert r.status_code == 201 and r.headers["affidavit-invocation-id"] == invocation_id
        assert [s.header("Idempotency-Key") for s in sent(upstream)] == [stored_key]
        record = broker.invocation(invocation_id)
        assert record["fingerprint"] == expected_fp
        assert record["idempotency"]["expires_at"] is not None


def test_a_refusal_names_an_ipv6_target_in_brackets():
    """``http://::1:8080/x`` cannot be read back; the message names the target as a URL."""
    from proxy.routing import Refusal, match_route

    refused = match_route([], "builder", "http", "::1", 8080, "GET", "/x?q=1")
    assert isinstance(refused, Refusal) and "http://[::1]:8080/x." in refused.message, refused


@pytest.mark.parametrize("path", [
    "/h/%%32%65%%32%65/admin",  # '%' then '2' and 'e' escaped: '%2e' after one decoding, '.' after two
    "/h/%2%65%2%65/admin",
    "/h/%%32%45%2%45/admin",
    "/h/x%%32%66..%%32%66..%%32%66admin",  # an escaped escape of '/' around plain dots
    "/h/%%63%30%%61%65%%63%30%%61%65/admin",  # overlong UTF-8 dots, their escapes escaped
])
def test_a_dot_segment_behind_escaped_escapes_is_malformed(path):
    """An upstream that decodes twice reads '%%32%65' as '.', just as it reads '%252e': the path
    must be taken apart whatever its escapes look like before decoding, not only when they
    already spell an encoded dot, slash or percent sign."""
    from proxy.broker import AgentRequest, malformed_request

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method="GET", path=path, headers=[], body=b"")
    assert malformed_request(req, "Idempotency-Key") is not None


@pytest.mark.parametrize("path", [
    # '%2e' after the three decodings the broker reads through, '.' after a fourth: the same
    # depth as '%2525...', spelled without '%2525'.
    "/h/%%32%35%%32%35%33%32%%32%35%36%35%%32%35%%32%35%33%32%%32%35%36%35/admin",
    "/h/%%32%35%%32%35%33%32%%32%35%36%35/x",
])
def test_a_path_still_encoded_after_every_decoding_the_broker_reads_is_malformed(path):
    from proxy.broker import AgentRequest, malformed_request

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method="GET", path=path, headers=[], body=b"")
    why = malformed_request(req, "Idempotency-Key")
    assert why is not None and "three times or more" in why


@pytest.mark.parametrize("path", ["/files/100%25", "/a%252Fb/c", "/files/my%20report.pdf", "/x/%%", "/x/50%"])
def test_a_path_whose_decodings_settle_is_not_refused_for_its_depth(path):
    from proxy.broker import AgentRequest, malformed_request

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method="GET", path=path, headers=[], body=b"")
    assert malformed_request(req, "Idempotency-Key") is None


@pytest.mark.parametrize("headers,refused", [
    ([("X-Idem", "k1")], False),
    ([("Idempotency-Key", "k1"), ("X-Idem", "k1")], False),
    ([("Idempotency-Key", "k1"), ("X-Idem", " k1 ")], False),
    ([("Idempotency-Key", "k1"), ("X-Idem", "k2")], True),
    ([("X-Idem", "k1"), ("x-idem", "k2")], True),
    ([("X-Idem", "")], True),
    ([("X-Idem", "caf\u00e9")], True),
    ([("X-Idem", "k" * 256)], True),
])
def test_a_key_in_the_routes_contract_header_is_checked_as_the_agents_key(headers, refused):
    """On a route whose contract names its own header, the agent's key may come in it: it is
    held to the same rules, and two different keys (one in each header, say) are refused."""
    from proxy.broker import AgentRequest, malformed_request

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method="POST", path="/x", headers=headers, body=b"")
    why = malformed_request(req, "Idempotency-Key", "X-Idem")
    assert (why is not None) is refused, why
    if refused and len({v.strip() for _, v in headers}) > 1:
        assert "different idempotency keys" in why, why
    assert malformed_request(req, "Idempotency-Key") is None, "without the route's contract, X-Idem is just a header"


@pytest.mark.parametrize("connection,refused", [
    ("close", False), ("keep-alive, X-Trace", False), ("Idempotency-Key", True), ("close, idempotency-key", True),
    ("X-Idem", True),
])
def test_a_connection_header_naming_the_key_header_is_malformed(connection, refused):
    """A field the Connection header names is an option of the agent's hop, dropped before the key
    was read: the agent's key vanished and each repeat went upstream as a new operation (with a
    key the broker made up, on a route with a contract)."""
    from proxy.broker import AgentRequest, malformed_request

    headers = [("Connection", connection), ("Idempotency-Key", "k1")]
    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method="POST", path="/x", headers=headers, body=b"")
    why = malformed_request(req, "Idempotency-Key", "X-Idem")
    assert (why is not None and "names " in why and "Connection" in why) if refused else why is None, why


@pytest.mark.parametrize("method,path,host,said", [
    ("A" * 16, "/x", "api.test", None),
    ("A" * 17, "/x", "api.test", "17 characters long"),
    ("G\x00T", "/x", "api.test", "method"),
    ("G\udcffT", "/x", "api.test", "method"),
    ("GET", "/x\x00", "api.test", "target"),
    ("GET", "/\udcff", "api.test", "target"),
    ("GET", "/x\x7f", "api.test", None),  # recorded, then refused as malformed
    ("GET", "/caf\u00e9", "api.test", None),  # text: recorded, then refused as malformed
    ("GET", "/x", "api\x00.test", "host"),
])
def test_what_no_record_can_hold_is_named(method, path, host, said):
    from proxy.broker import AgentRequest, unrecordable

    why = unrecordable(AgentRequest(agent="a", scheme="https", host=host, port=443, method=method, path=path, headers=[], body=b""))
    assert (why is None) if said is None else (why is not None and said in why and "nothing was recorded" in why), why
    if why is not None:
        why.encode("utf-8")  # the message itself can be sent and logged


@pytest.mark.parametrize("method,refused", [
    ("GET", False), ("PATCH", False), ("M-SEARCH", False), ("X_CUSTOM.v1", False),
    ("PO\u017fT", True), ("GE\u00df", True), ("GE T", True), ("", True), ("GET\x00", True), ("PO(ST)", True),
])
def test_a_method_that_is_not_an_http_token_is_malformed(method, refused):
    """mitmproxy upper-cases a method in Unicode ('PO\u017fT' becomes 'POST'): only a token is a
    method a route can be checked against."""
    from proxy.broker import AgentRequest, malformed_request

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method=method, path="/x", headers=[], body=b"")
    why = malformed_request(req, "Idempotency-Key")
    assert (why is not None and "not an HTTP token" in why) if refused else why is None


@pytest.mark.parametrize("method,path,body,refused", [
    ("POST", "/x?_method=DELETE", b"", True),
    ("POST", "/x?a=1&%5Fmethod=put", b"", True),
    ("POST", "/x?_method=post", b"", False),
    ("GET", "/x?_method=DELETE", b"", False),  # frameworks override a POST only
    ("POST", "/x", b"a=1&_method=PATCH", True),
    ("POST", "/x", b"%5Fmethod=patch", True),
    ("POST", "/x", b'{"_method": "DELETE", "x": 1}', True),
    ("POST", "/x", b'{"\\u005fmethod": "DELETE"}', True),
    ("POST", "/x", b'--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\nPUT\r\n--b--\r\n', True),
    ("POST", "/x", b'--b\r\nContent-Disposition: form-data; name="_method_x"\r\n\r\nPUT\r\n--b--\r\n', False),
    ("POST", "/x", b'{"note": "_method=DELETE", "nested": {"_method": "DELETE"}}', False),
    ("POST", "/x", b"payment_method=pm_1&amount=5", False),
    ("POST", "/x", b'[1, "_method"]', False),
    ("POST", "/x", b"_method=", False),
])
def test_a_method_override_field_is_read_where_frameworks_read_it(method, path, body, refused):
    from proxy.broker import AgentRequest, _override

    req = AgentRequest(agent="a", scheme="https", host="api.test", port=443, method=method, path=path, headers=[], body=body)
    why = _override(req, "r")
    assert (why is not None and "_method field" in why) if refused else why is None, why


@pytest.mark.parametrize("pattern,host,matched", [
    ("*.254", "169.254.169.254", False),  # the cloud metadata address is no name under '254'
    ("*.0.0.1", "127.0.0.1", False),
    ("*.1", "[::1]", False),
    ("*.example.test", "api.example.test", True),
    ("*.254", "printer.254", True),
])
def test_a_wildcard_route_matches_names_not_ip_literals(pattern, host, matched):
    """'*.suffix' stands for the names under a domain: an address that happens to end the same way
    (a probe's '*.254' took 169.254.169.254, with the route's credential) is no such name."""
    from proxy.config import Route

    route = Route(name="r", host=pattern, agents=["a"])
    assert route.matches_target("https", host, 443) is matched
