"""Evidence binds the real bytes and the real peer; the documented SQL runs; the views bucket by hour.

Every number is computed here, independently of the broker: body hashes from the bytes the client
received (or the upstream sent), certificate fingerprints from the certificate the hostile upstream
serves, bucket hours from the raw ``created_at`` of each row. The SQL in ``docs/metrics.md`` is run
exactly as written, through ``psql`` and the stdlib ``sqlite3``, as an operator would paste it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sqlite3
import ssl
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import DIALECTS, standard_routes
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream, free_port
from tests.support.journal import _pg_args

PAYMENTS = "https://api.payments.test"
DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ENDED_STAGES = {"delivered", "delivery_failed", "store_failed", "ended_not_attempted", "ended_unknown"}


# -- helpers --------------------------------------------------------------------------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ended(broker: BrokerProcess, invocation_id: str) -> dict[str, Any]:
    return broker.wait_for(invocation_id, lambda r: r["stage"] in ENDED_STAGES)


def event(record: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [e["data"] for e in record["events"] if e["kind"] == kind]
    return found


def served_certificate_der(port: int, pki: TestPKI) -> bytes:
    """The DER of the certificate the upstream actually presents on ``port`` (a real handshake)."""
    context = pki.client_context()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="api.payments.test") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der
    return der


def pki_leaf_der(pki: TestPKI, kind: str) -> bytes:
    """The leaf certificate of ``kind`` straight from the PKI's files (the first PEM of the chain)."""
    pem = Path(pki.cert(kind)).read_text()
    first = pem[: pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    return ssl.PEM_cert_to_DER_cert(first)


def psql(url: str, sql: str, env: dict[str, str] | None = None) -> list[tuple[str, ...]]:
    """Run ``sql`` exactly as pasted into ``psql``; fail with psql's own error text."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    password = make_url(url).password
    if password:
        environment["PGPASSWORD"] = password
    environment.update(env or {})
    done = subprocess.run(
        ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-At", "-F", "\t", *_pg_args(url), "-f", "-"],
        input=sql, capture_output=True, text=True, timeout=30, env=environment,
    )
    assert done.returncode == 0, f"psql failed on:\n{sql}\n{done.stderr}"
    return [tuple(line.split("\t")) for line in done.stdout.splitlines() if line]


def sqlite_rows(url: str, sql: str) -> list[tuple[str, ...]]:
    path = make_url(url).database or ""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10) as conn:
        try:
            rows = conn.execute(sql).fetchall()
        except sqlite3.Error as exc:
            raise AssertionError(f"sqlite3 failed on:\n{sql}\n{exc!r}") from None
    return [tuple("" if v is None else str(v) for v in row) for row in rows]


def run_sql(url: str, sql: str) -> list[tuple[str, ...]]:
    return sqlite_rows(url, sql) if url.startswith("sqlite") else psql(url, sql)


def execute(url: str, sql: str) -> None:
    """Write to the journal from outside the broker."""
    if url.startswith("sqlite"):
        with sqlite3.connect(make_url(url).database or "", timeout=10) as conn:
            conn.execute(sql)
        return
    psql(url, sql)


def backdate(url: str, hours: int, invocation_id: str) -> None:
    """Move one invocation ``hours`` into the past (as tests/test_operator_signals.py does)."""
    where = f" WHERE invocation_id = '{invocation_id}'"
    if url.startswith("sqlite"):
        execute(url, f"UPDATE invocations SET created_at = strftime('%Y-%m-%d %H:%M:%f000', created_at, '-{hours} hours'){where}")
    else:
        execute(url, f"UPDATE invocations SET created_at = created_at - interval '{hours} hours'{where}")


def created_at(url: str, invocation_id: str) -> datetime:
    """The row's ``created_at`` as an aware UTC datetime, read raw (not through the views)."""
    if url.startswith("sqlite"):
        sql = f"SELECT created_at FROM invocations WHERE invocation_id = '{invocation_id}'"
    else:
        sql = (f"SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US') "
               f"FROM invocations WHERE invocation_id = '{invocation_id}'")
    [(value,)] = run_sql(url, sql)
    parsed = datetime.fromisoformat(value)
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def hour_of(moment: datetime) -> str:
    """The bucket an operator expects: the UTC wall-clock hour, in the views' text form."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:00:00")


# -- 1. evidence binds the real bytes and the real peer --------------------------------------------


def test_body_hash_is_of_the_exact_bytes_the_client_received(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        get = client.get(f"{PAYMENTS}/h/status?code=200")
        post = client.post(f"{PAYMENTS}/h/status?code=201", content=b'{"amount":7}', headers={"Content-Type": "application/json"})
    for response, status in ((get, 200), (post, 201)):
        assert response.status_code == status and response.headers["affidavit-outcome"] == "committed", response.text
        assert response.headers.get("content-encoding") is None  # .content is the bytes on the wire
        record = ended(broker, response.headers["affidavit-invocation-id"])
        evidence = record["evidence"]
        assert evidence["body_sha256"] == sha256_hex(response.content)
        assert evidence["body_bytes"] == len(response.content)
        assert evidence["status"] == status
        committed = event(record, "RESULT_COMMITTED")
        assert committed["stored_body_sha256"] == sha256_hex(response.content), "nothing to redact: stored == received"
        with broker.api() as api:
            replay = api.get(f"/v1/invocations/{record['invocation_id']}/result")
        assert replay.status_code == status and replay.content == response.content
    assert get.content != post.content, "two different bodies, two different hashes"
    assert len(upstream.received) == 2


def test_a_body_that_held_the_secret_has_no_hash_or_length_in_the_record_only_its_stored_hash(
        broker: BrokerProcess, upstream: HostileUpstream):
    """/h/ok echoes the injected credential: the client gets a redacted body. The hash of what the
    upstream sent (rebuilt here from what it received) would let the agent test guesses of the
    secret offline, its length tell the secret's: neither is anywhere in the record, whose stored
    hash is of what the client got."""
    with broker.client() as client:
        response = client.get(f"{PAYMENTS}/h/ok")
    assert response.status_code == 200, response.text
    [seen] = upstream.received
    echoed = json.loads(response.content)
    assert "[REDACTED]" in response.text
    original = json.dumps({**echoed, "headers": [[n, v] for n, v in seen.headers]}, separators=(",", ":")).encode()
    assert original != response.content

    record = ended(broker, response.headers["affidavit-invocation-id"])
    evidence = record["evidence"]
    assert "body_sha256" not in evidence and "body_bytes" not in evidence, evidence
    assert sha256_hex(original) not in json.dumps(record), "no hash of the body that held the secret, anywhere"
    assert event(record, "RESULT_COMMITTED")["stored_body_sha256"] == sha256_hex(response.content)
    assert evidence["status"] == 200 and evidence["response_complete"] is True


def test_peer_certificate_is_the_certificate_the_upstream_serves(broker: BrokerProcess, upstream: HostileUpstream, pki: TestPKI):
    port = upstream.tls_port("good")
    der = served_certificate_der(port, pki)
    assert der == pki_leaf_der(pki, "good")
    expected = "sha256:" + sha256_hex(der)
    assert der != pki_leaf_der(pki, "untrusted")

    ids = []
    with broker.client() as client:
        for _ in range(3):  # a new connection, then reused ones: the fingerprint must survive pooling
            r = client.post(f"{PAYMENTS}/h/status?code=200", content=b"{}")
            assert r.status_code == 200, r.text
            ids.append(r.headers["affidavit-invocation-id"])
        r = client.get("https://basic.example.test/h/status?code=200")  # another host, same port
        assert r.status_code == 200, r.text
        ids.append(r.headers["affidavit-invocation-id"])
        r = client.get(f"{PAYMENTS}/h/close_delimited")  # a body ended by close
        assert r.status_code == 200, r.text
        ids.append(r.headers["affidavit-invocation-id"])
    records = [ended(broker, i) for i in ids]
    assert "reused" in [rec["evidence"]["attempts"][0]["connection"] for rec in records[:3]]
    for rec in records:
        assert rec["evidence"]["peer_certificate"] == expected, rec["evidence"]
        assert event(rec, "REMOTE_RESPONSE_COMPLETE")["peer_certificate"] == expected
    assert records[-1]["evidence"]["framing"] == "close"


def test_plain_http_has_no_peer_certificate(broker: BrokerProcess, upstream: HostileUpstream):
    with broker.client() as client:
        r = client.post("http://plain.example.test/h/status?code=202", content=b"x")
    assert r.status_code == 202, r.text
    record = ended(broker, r.headers["affidavit-invocation-id"])
    assert record["outcome"] == "committed"
    assert record["evidence"]["body_sha256"] == sha256_hex(r.content)
    assert record["evidence"].get("peer_certificate") is None
    assert event(record, "REMOTE_RESPONSE_COMPLETE").get("peer_certificate") is None
    assert upstream.received[0].tls is None


# -- 2. the SQL in docs/metrics.md runs and counts right -------------------------------------------


def doc_sql_blocks() -> list[tuple[str, str, set[str]]]:
    """``(title, sql, dialects)`` for every ```sql block; the title is the prose line above it."""
    text = DOC.read_text()
    blocks = []
    for match in re.finditer(r"```sql\n(.*?)```", text, re.S):
        before = [line for line in text[: match.start()].splitlines() if line.strip()]
        title = before[-1] if before else ""
        if "PostgreSQL" in title:
            dialects = {"postgresql"}
        elif "SQLite" in title:
            dialects = {"sqlite"}
        else:
            dialects = {"sqlite", "postgresql"}
        blocks.append((title, match.group(1), dialects))
    return blocks


def docs_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    """The standard routes plus two that fail in connection setup (untrusted certificate, refused)."""
    fast = {"connect_timeout": "1s", "response_timeout": "2s"}
    return [
        *standard_routes(up),
        {"name": "untrusted", "host": "untrusted.example.test", "port": 443, "methods": ["GET"], "agents": ["builder"],
         "connect_to": f"127.0.0.1:{up.tls_port('untrusted')}", **fast},
        {"name": "refused", "host": "refused.example.test", "port": 443, "methods": ["GET"], "agents": ["builder"],
         "connect_to": f"127.0.0.1:{free_port()}", **fast},
    ]


def drive_docs_traffic(broker: BrokerProcess) -> dict[str, Any]:
    """3 committed, 1 refused (no route), 1 unknown, 2 untrusted certificates, 1 refused connection."""
    ids: dict[str, Any] = {"ok": []}
    with broker.client() as client:
        for _ in range(3):
            r = client.get(f"{PAYMENTS}/h/status?code=200")
            assert r.status_code == 200 and r.headers["affidavit-outcome"] == "committed", r.text
            ids["ok"].append(r.headers["affidavit-invocation-id"])
        r = client.get("https://unknown.example.test/x")
        assert r.status_code == 403 and check_envelope(r.content)["error"]["code"] == "INVALID_TARGET", r.text
        ids["refused"] = r.headers["affidavit-invocation-id"]
        r = client.post(f"{PAYMENTS}/h/close_after_effect", content=b'{"charge":1}')
        assert r.status_code == 502 and check_envelope(r.content)["error"]["outcome"] == "unknown", r.text
        ids["lost"] = r.headers["affidavit-invocation-id"]
        ids["untrusted"] = []
        for _ in range(2):
            r = client.get("https://untrusted.example.test/h/ok")
            assert check_envelope(r.content)["error"]["code"] == "TLS_CERT_UNTRUSTED", r.text
            ids["untrusted"].append(r.headers["affidavit-invocation-id"])
        r = client.get("https://refused.example.test/h/ok")
        assert check_envelope(r.content)["error"]["code"] == "CONNECT_REFUSED", r.text
        ids["connect_refused"] = r.headers["affidavit-invocation-id"]
    for value in ids.values():
        for invocation_id in value if isinstance(value, list) else [value]:
            ended(broker, invocation_id)
    return ids


ALL_PHASES = {
    ("connection_setup", "not_attempted"): 3,
    ("remote_execution", "unknown"): 1,
    ("result_delivery", "committed"): 3,
    ("validation", "not_attempted"): 1,
}


def check_block(title: str, sql: str, rows: list[tuple[str, ...]], broker: BrokerProcess, ids: dict[str, Any], lost_shifted: bool) -> None:
    """The numbers each documented query must give for :func:`drive_docs_traffic` (``lost_shifted``:
    the unknown one was moved 30 hours back)."""
    lost = broker.invocation(ids["lost"], broker.operator_token)
    lost_hour = hour_of(created_at(broker.database_url, ids["lost"]))
    if "24 hours" in sql:  # phase x outcome, last 24 hours
        expected = {k: v for k, v in ALL_PHASES.items() if not (lost_shifted and k == ("remote_execution", "unknown"))}
        assert [(p, o, int(n)) for p, o, n in rows] == [(p, o, n) for (p, o), n in sorted(expected.items())], (title, rows)
    elif "outcome = 'unknown'" in sql:  # unknown outcomes per hour
        assert rows == [(lost_hour, "payments.create", "REMOTE_OUTCOME_UNKNOWN", "1")], (title, rows)
    elif "phase = 'connection_setup'" in sql:
        assert rows == [("untrusted", "TLS_CERT_UNTRUSTED", "2"), ("refused", "CONNECT_REFUSED", "1")], (title, rows)
    elif "FROM unknown_outcomes" in sql:
        assert len(rows) == 1, (title, rows)
        [(invocation_id, created, route, method, target, code, retry)] = rows
        assert (invocation_id, route, method, target, code, retry) == (
            ids["lost"], "payments.create", "POST", lost["target"], "REMOTE_OUTCOME_UNKNOWN", lost["retry"])
        assert created
    elif "date_trunc('day'" in sql:
        totals: Counter[str] = Counter()
        for _day, outcome, n in rows:
            totals[outcome] += int(n)
        assert totals == Counter({"committed": 3, "not_attempted": 4, "unknown": 1}), (title, rows)
    else:
        raise AssertionError(f"docs/metrics.md has a query this test does not check yet: {title}\n{sql}")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_metrics_doc_sql_runs_and_counts_known_traffic(make_broker, upstream: HostileUpstream, dialect: str):
    blocks = doc_sql_blocks()
    assert len(blocks) >= 6, "docs/metrics.md lost its queries"
    mine = [(title, sql) for title, sql, dialects in blocks if dialect in dialects]
    assert mine, f"no documented query for {dialect}"
    broker = make_broker(dialect, routes=docs_routes(upstream))
    ids = drive_docs_traffic(broker)

    for title, sql in mine:
        check_block(title, sql, run_sql(broker.database_url, sql), broker, ids, lost_shifted=False)

    # The lost exchange 30 hours ago: out of every "last 24 hours", still in the queue and the totals.
    backdate(broker.database_url, 30, ids["lost"])
    for title, sql in mine:
        check_block(title, sql, run_sql(broker.database_url, sql), broker, ids, lost_shifted=True)

    # A success 23h5xm ago is inside "the last 24 hours", though its hour bucket starts before the
    # 24h mark: every documented 24h query (like `affidavit metrics --since 24h`) still counts it.
    edge = inside_oldest_hour_of_the_last_day()
    stamp = edge.strftime("%Y-%m-%d %H:%M:%S.%f")
    value = f"'{stamp}'" if dialect == "sqlite" else f"'{stamp}+00'::timestamptz"
    execute(broker.database_url, f"UPDATE invocations SET created_at = {value} WHERE invocation_id = '{ids['ok'][0]}'")
    for title, sql in mine:
        check_block(title, sql, run_sql(broker.database_url, sql), broker, ids, lost_shifted=True)
    metrics = broker.command("metrics", "--since", "24h")
    assert metrics.returncode == 0, metrics.stderr.decode()
    assert re.search(r"result_delivery\s*[│┃|]\s*\.?\s*[│┃|]\s*\.?\s*[│┃|]\s*3\s*[│┃|]", metrics.stdout.decode()), metrics.stdout.decode()


def inside_oldest_hour_of_the_last_day() -> datetime:
    """A moment less than 24 hours ago whose UTC hour began more than 24 hours ago (with a margin
    of at least 30 s either side, waiting a bounded minute when the clock is too close to the hour)."""
    bound = datetime.now(UTC) - timedelta(hours=24)
    hour_end = bound.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    if hour_end - bound < timedelta(seconds=90):
        time.sleep((hour_end - bound).total_seconds() + 1)
        bound = datetime.now(UTC) - timedelta(hours=24)
        hour_end = bound.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return bound + min((hour_end - bound) / 2, timedelta(minutes=5))


# -- 3. time buckets of the outcome views -----------------------------------------------------------


VIEW = "SELECT bucket, route, phase, outcome, code, invocations FROM invocation_outcomes ORDER BY bucket, route, phase, outcome"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_outcome_view_buckets_rows_by_their_utc_hour(make_broker, upstream: HostileUpstream, dialect: str):
    broker = make_broker(dialect)
    url = broker.database_url
    committed, refused = [], []
    with broker.client() as client:
        for _ in range(5):
            r = client.get(f"{PAYMENTS}/h/status?code=200")
            assert r.status_code == 200, r.text
            committed.append(r.headers["affidavit-invocation-id"])
        for _ in range(2):
            r = client.get("https://unknown.example.test/x")
            assert r.status_code == 403, r.text
            refused.append(r.headers["affidavit-invocation-id"])
    for invocation_id in committed + refused:
        ended(broker, invocation_id)

    shifted = committed[:2] + refused[:1]
    before = {i: created_at(url, i) for i in committed + refused}
    for invocation_id in shifted:
        backdate(url, 2, invocation_id)
    after = {i: created_at(url, i) for i in committed + refused}
    for invocation_id, moment in before.items():
        delta = timedelta(hours=2) if invocation_id in shifted else timedelta(0)
        # SQLite's strftime('%f') keeps milliseconds only: the backdate may drop the microseconds.
        assert abs(after[invocation_id] - (moment - delta)) < timedelta(milliseconds=1), "the backdate moved the wrong rows"

    kind = {i: ("payments.create", "result_delivery", "committed", "") for i in committed}
    kind.update({i: ("", "validation", "not_attempted", "INVALID_TARGET") for i in refused})
    expected = Counter((hour_of(after[i]), *kind[i]) for i in after)
    rows = run_sql(url, VIEW)
    assert Counter({row[:5]: int(row[5]) for row in rows}) == expected
    old = {hour_of(after[i]) for i in shifted}
    new = {hour_of(after[i]) for i in after if i not in shifted}
    if len(new) == 1:  # the traffic did not straddle an hour (it takes well under a second)
        assert sorted(int(r[5]) for r in rows if r[3] == "committed") == [2, 3]
        assert sorted(int(r[5]) for r in rows if r[3] == "not_attempted") == [1, 1]
    assert old.isdisjoint(new), "two hours apart must be two buckets"
    buckets = {r[0] for r in rows}
    assert buckets == old | new and len(buckets) >= 2

    # Either side of an hour boundary, to the microsecond; PostgreSQL read in a half-hour-offset
    # session time zone, so a bucket in local time instead of UTC shows.
    day = (datetime.now(UTC) - timedelta(days=3)).strftime("%Y-%m-%d")
    edges = {committed[2]: f"{day} 10:59:59.999999", committed[3]: f"{day} 11:00:00.000000", committed[4]: f"{day} 11:59:59.999999"}
    for invocation_id, stamp in edges.items():
        value = f"'{stamp}'" if dialect == "sqlite" else f"'{stamp}+00'::timestamptz"
        execute(url, f"UPDATE invocations SET created_at = {value} WHERE invocation_id = '{invocation_id}'")
    where = f"WHERE bucket LIKE '{day}%'" if dialect == "sqlite" else f"WHERE bucket::date = '{day}'"
    sql = f"SELECT bucket, invocations FROM invocation_outcomes {where} ORDER BY bucket"
    rows = sqlite_rows(url, sql) if dialect == "sqlite" else psql(url, sql, env={"PGTZ": "Asia/Kolkata"})
    assert rows == [(f"{day} 10:00:00", "1"), (f"{day} 11:00:00", "2")]
