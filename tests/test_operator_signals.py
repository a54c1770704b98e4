"""End to end: what an operator sees of a running broker, from a real process.

``GET /metrics`` (Prometheus), the ``invocation ended`` JSON log lines, the ``affidavit
metrics`` table and the first-run experience of ``affidavit run --example``. Every number is
checked against traffic the test drove itself through a fresh broker, so a missing, doubled or
mislabelled count fails. Labels and log lines are also checked for what must never be in them:
URLs, invocation ids and secrets.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import socket
import sqlite3
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from proxy.contract import Code, Outcome, Phase
from tests.support.broker import AFFIDAVIT, BROKER_COMMAND, BrokerProcess, free_ports
from tests.support.canaries import CANARIES
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream
from tests.support.journal import _pg_args

DIALECTS = ["sqlite", "postgresql"]
PAYMENTS = "https://api.payments.test"
ENDED_STAGES = {"delivered", "delivery_failed", "store_failed", "ended_not_attempted", "ended_unknown"}
ROUTES = {"payments.create", "basic", "plain", "review"}  # tests.conftest.standard_routes
CHANNELS = {"replay", "side_api"}  # docs/api.md, GET /metrics
ALLOWED_LABELS: dict[str, set[str]] = {
    "route": ROUTES | {"(none)"},
    "phase": {p.value for p in Phase} | {""},
    "outcome": {o.value for o in Outcome} | {""},
    "code": {c.value for c in Code} | {""},
    "channel": CHANNELS,
    "agent": {"builder", "reviewer", "(unknown)"},
    "part": {"head", "body"},  # affidavit_request_timeouts
}
#: Every form a canary could leak in: as is, and basic-encoded the way the ``basic`` route sends it.
FORBIDDEN = [*CANARIES.values(), *(base64.b64encode(f"svc:{v}".encode()).decode() for v in CANARIES.values())]


# -- known traffic --------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Invocation ids of the traffic :func:`drive_known_traffic` sent, one of each kind."""

    ok: str  # GET, 200: payments.create / result_delivery / committed
    keyed: str  # POST with an Idempotency-Key, 201, committed; then repeated once (channel "replay")
    refused: str  # no route: (none) / validation / not_attempted / INVALID_TARGET
    lost: str  # POST, the upstream hangs up after the effect: remote_execution / unknown

    @property
    def ids(self) -> set[str]:
        return {self.ok, self.keyed, self.refused, self.lost}

    @property
    def dispatched(self) -> set[str]:
        return {self.ok, self.keyed, self.lost}


#: affidavit_invocations_total after :func:`drive_known_traffic`, exactly.
EXPECTED_INVOCATIONS = {
    ("payments.create", "result_delivery", "committed", ""): 2.0,
    ("(none)", "validation", "not_attempted", "INVALID_TARGET"): 1.0,
    ("payments.create", "remote_execution", "unknown", "REMOTE_OUTCOME_UNKNOWN"): 1.0,
}
EXPECTED_REPLAYS = {"replay": 1.0, "side_api": 1.0}


def ended(broker: BrokerProcess, invocation_id: str) -> dict[str, Any]:
    return broker.wait_for(invocation_id, lambda r: r["stage"] in ENDED_STAGES)


def drive_known_traffic(broker: BrokerProcess, upstream: HostileUpstream) -> Traffic:
    """One success, one keyed success and its replay, one refusal, one lost exchange, one result fetch."""
    with broker.client() as client:
        ok = client.get(f"{PAYMENTS}/h/ok")
        assert ok.status_code == 200 and ok.headers["affidavit-outcome"] == "committed", ok.text
        ok_id = ok.headers["affidavit-invocation-id"]

        key = "op-" + secrets.token_hex(8)
        keyed_request = {"content": b'{"amount":1}', "headers": {"Idempotency-Key": key, "Content-Type": "application/json"}}
        keyed = client.post(f"{PAYMENTS}/h/status?code=201", **keyed_request)
        assert keyed.status_code == 201 and keyed.headers["affidavit-outcome"] == "committed", keyed.text
        keyed_id = keyed.headers["affidavit-invocation-id"]
        ended(broker, keyed_id)
        again = client.post(f"{PAYMENTS}/h/status?code=201", **keyed_request)
        assert again.status_code == 201, again.text
        assert again.headers["affidavit-replayed"] == "true"
        assert again.headers["affidavit-invocation-id"] == keyed_id

        refused = client.get("https://unknown.example.test/x")
        assert refused.status_code == 403, refused.text
        refused_body = check_envelope(refused.content)
        assert refused_body["error"]["code"] == "INVALID_TARGET"

        lost = client.post(f"{PAYMENTS}/h/close_after_effect", content=b'{"charge":1}')
        assert lost.status_code == 502, lost.text
        lost_body = check_envelope(lost.content)
        assert (lost_body["error"]["phase"], lost_body["error"]["outcome"], lost_body["error"]["code"]) == (
            "remote_execution", "unknown", "REMOTE_OUTCOME_UNKNOWN")

    ended(broker, ok_id)
    with broker.api() as api:
        fetched = api.get(f"/v1/invocations/{ok_id}/result")
    assert fetched.status_code == 200 and fetched.headers["affidavit-replayed"] == "true"
    assert fetched.content == ok.content

    traffic = Traffic(ok_id, keyed_id, refused_body["invocation_id"], lost_body["invocation_id"])
    for invocation_id in traffic.ids:
        ended(broker, invocation_id)
    assert len([r for r in upstream.received if r.method]) == 3, "a replay or a result fetch reached the upstream"
    return traffic


# -- /metrics -------------------------------------------------------------------------------------


def scrape(broker: BrokerProcess) -> tuple[str, dict[str, Any]]:
    with broker.operator() as api:
        response = api.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return response.text, {family.name: family for family in text_string_to_metric_families(response.text)}


def samples(families: dict[str, Any], family: str, sample: str) -> dict[tuple[str, ...], float]:
    """``{label values (sorted by label name): value}`` of one sample name of one family."""
    if family not in families:
        return {}
    return {
        tuple(v for _, v in sorted(s.labels.items())): s.value for s in families[family].samples if s.name == sample
    }


def invocation_counts(families: dict[str, Any]) -> dict[tuple[str, str, str, str], float]:
    family = families.get("affidavit_invocations")
    return {
        (s.labels["route"], s.labels["phase"], s.labels["outcome"], s.labels["code"]): s.value
        for s in (family.samples if family is not None else [])
        if s.name == "affidavit_invocations_total"
    }


def replay_counts(families: dict[str, Any]) -> dict[str, float]:
    return {k[0]: v for k, v in samples(families, "affidavit_replays", "affidavit_replays_total").items()}


def single(families: dict[str, Any], family: str, sample: str) -> float:
    [value] = samples(families, family, sample).values()
    return value


def scrape_until(broker: BrokerProcess, done: Any, timeout: float = 10.0) -> tuple[str, dict[str, Any]]:
    """Scrape until ``done(families)`` (the counters of a delivery move just after the answer)."""
    deadline = time.monotonic() + timeout
    text, families = scrape(broker)
    while not done(families) and time.monotonic() < deadline:
        time.sleep(0.05)
        text, families = scrape(broker)
    return text, families


def assert_bounded_labels(text: str, families: dict[str, Any]) -> None:
    """Every label of every affidavit_* sample comes from a closed set; nothing secret or unbounded."""
    seen = 0
    for family in families.values():
        if not family.name.startswith("affidavit_"):
            continue
        for sample in family.samples:
            for name, value in sample.labels.items():
                seen += 1
                if name == "le":
                    assert value == "+Inf" or float(value) >= 0, sample
                    continue
                assert name in ALLOWED_LABELS, f"unexpected label {name!r} on {sample}"
                assert value in ALLOWED_LABELS[name], f"unbounded label value {name}={value!r} on {sample.name}"
                assert "/" not in value and "act_" not in value, sample
                assert not any(secret in value for secret in FORBIDDEN), f"a canary in a label of {sample.name}"
    assert seen > 0
    for secret in FORBIDDEN:
        assert secret not in text, "a canary in the /metrics text"
    for unbounded in ("act_", "unknown.example.test", "api.payments.test", "/h/"):
        assert unbounded not in text, f"{unbounded!r} (an id, a host or a path) in the /metrics text"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_metrics_count_known_traffic_with_bounded_labels(make_broker, upstream: HostileUpstream, dialect: str):
    broker = make_broker(dialect)
    with broker.api() as agent, httpx.Client(base_url=broker.api_url, timeout=10) as anonymous:
        assert anonymous.get("/metrics").status_code == 401
        assert agent.get("/metrics").status_code == 403, "metrics are for the operator"
    _, before = scrape(broker)
    assert invocation_counts(before) == {}
    assert single(before, "affidavit_in_flight", "affidavit_in_flight") == 0

    traffic = drive_known_traffic(broker, upstream)
    text, families = scrape_until(
        broker,
        lambda f: invocation_counts(f) == EXPECTED_INVOCATIONS
        and replay_counts(f) == EXPECTED_REPLAYS
        and single(f, "affidavit_in_flight", "affidavit_in_flight") == 0,
    )

    assert invocation_counts(families) == EXPECTED_INVOCATIONS
    assert replay_counts(families) == EXPECTED_REPLAYS
    assert single(families, "affidavit_in_flight", "affidavit_in_flight") == 0, "nothing is in flight at rest"
    assert single(families, "affidavit_journal_errors", "affidavit_journal_errors_total") == 0
    assert single(families, "affidavit_recovered", "affidavit_recovered_total") == 0

    histogram = families["affidavit_dispatch_record_seconds"]
    assert histogram.type == "histogram"
    count = single(families, "affidavit_dispatch_record_seconds", "affidavit_dispatch_record_seconds_count")
    assert count >= len(traffic.dispatched), "every DISPATCH_STARTED is timed"
    buckets = sorted(
        ((float(s.labels["le"]), s.value) for s in histogram.samples if s.name.endswith("_bucket")), key=lambda b: b[0]
    )
    assert buckets[-1] == (float("inf"), count)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets), "buckets are cumulative"
    assert single(families, "affidavit_dispatch_record_seconds", "affidavit_dispatch_record_seconds_sum") > 0

    assert_bounded_labels(text, families)
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")], \
        "only what docs/api.md lists: no *_created series"


def _rejected_on_one_connection(broker: BrokerProcess, source: str, token: str, attempts: int) -> tuple[list[bytes], bool]:
    """``attempts`` requests with a wrong token pipelined on one connection from ``source``: the
    answers read, and whether the broker closed the connection."""
    auth = base64.b64encode(f"builder:{token}".encode())
    request = (b"GET http://plain.example.test/h/ok HTTP/1.1\r\nHost: plain.example.test\r\n"
               b"Proxy-Authorization: Basic " + auth + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(request * attempts)
        data, closed = b"", False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            data += chunk
    return [head for head in re.findall(rb"HTTP/1\.1 \d{3}[^\r]*", data)], closed


@pytest.mark.parametrize("dialect", ["sqlite"])
def test_a_guessing_client_is_refused_per_connection_counted_every_time_and_logged_once(
        make_broker, upstream: HostileUpstream, dialect: str):
    """Wrong proxy credentials: the 407 closes the connection (a guess costs a new one), every
    rejection is counted, and a burst from one address is one log line, not one per guess."""
    broker = make_broker(dialect)
    answers, closed = _rejected_on_one_connection(broker, "127.0.0.3", "guess-0", attempts=5)
    assert answers == [b"HTTP/1.1 407 Proxy Authentication Required"] and closed, (answers, closed)
    for n in range(1, 30):
        answers, closed = _rejected_on_one_connection(broker, "127.0.0.3", f"guess-{n}", attempts=1)
        assert answers == [b"HTTP/1.1 407 Proxy Authentication Required"] and closed
    _rejected_on_one_connection(broker, "127.0.0.4", "guess-other", attempts=1)
    with broker.client() as client:  # the right token still works, on a connection kept alive
        assert client.get("http://plain.example.test/h/ok").status_code == 200
        assert client.get("http://plain.example.test/h/ok").status_code == 200
    assert [r.path for r in upstream.received if r.method] == ["/h/ok", "/h/ok"], "no refused guess was forwarded"

    _, families = scrape(broker)
    assert samples(families, "affidavit_proxy_auth_rejected", "affidavit_proxy_auth_rejected_total") == {("builder",): 31.0}
    lines = [e for e in broker.log_entries() if e["msg"].startswith("proxy credentials rejected")]
    assert [(e["msg"], e["agent"], e["code"]) for e in lines] == [
        ("proxy credentials rejected for agent 'builder' from 127.0.0.3", "builder", "PROXY_AUTH_REQUIRED"),
        ("proxy credentials rejected for agent 'builder' from 127.0.0.4", "builder", "PROXY_AUTH_REQUIRED"),
    ], lines
    assert "guess-" not in broker.logs(), "a token is never logged"


def test_rejections_within_the_window_are_counted_into_the_next_line(caplog):
    from proxy.addon import RejectionLog

    now = [100.0]
    rejections = RejectionLog(window=60, pairs=2, clock=lambda: now[0])
    caplog.set_level("WARNING", logger="affidavit.addon")
    for _ in range(4):
        rejections.rejected("builder", "10.0.0.1")
    now[0] += 59.9
    rejections.rejected("builder", "10.0.0.1")
    rejections.rejected(None, "10.0.0.1")  # another pair: logged at once
    now[0] += 0.2
    rejections.rejected("builder", "10.0.0.1")  # 60.1 s after the first line: logged, with the 4 before
    assert [(r.getMessage(), r.not_logged) for r in caplog.records] == [
        ("proxy credentials rejected for agent 'builder' from 10.0.0.1", 0),
        ("proxy credentials rejected for an agent name this broker does not know from 10.0.0.1", 0),
        ("proxy credentials rejected for agent 'builder' from 10.0.0.1 (4 more from there in the 60 s before, "
         "not logged one by one)", 4),
    ]
    # A third address with two pairs remembered: one is forgotten, the new one is logged.
    rejections.rejected("builder", "10.0.0.2")
    assert caplog.records[-1].getMessage().endswith("from 10.0.0.2") and len(rejections._seen) <= 2


# -- structured logs ------------------------------------------------------------------------------


def json_lines(broker: BrokerProcess) -> list[dict[str, Any]]:
    entries = []
    for line in broker.logs().splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def ended_lines(broker: BrokerProcess) -> list[dict[str, Any]]:
    return [e for e in json_lines(broker) if e.get("msg") == "invocation ended"]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_one_invocation_ended_line_per_invocation_matching_its_record(make_broker, upstream: HostileUpstream, dialect: str):
    broker = make_broker(dialect)
    started = time.monotonic()
    traffic = drive_known_traffic(broker, upstream)
    elapsed_ms = (time.monotonic() - started) * 1000

    deadline = time.monotonic() + 10
    lines = ended_lines(broker)
    while len(lines) < len(traffic.ids) and time.monotonic() < deadline:
        time.sleep(0.05)
        lines = ended_lines(broker)
    ids = [line["invocation_id"] for line in lines]
    assert sorted(ids) == sorted(traffic.ids), "one line per ended invocation; replays and fetches end nothing"

    for line in lines:
        assert line["level"] == "info" and line["logger"] == "affidavit.invocations"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", line["ts"]), line["ts"]
        record = broker.invocation(line["invocation_id"], broker.operator_token)
        for key in ("route", "phase", "outcome", "code", "agent", "method", "caller_disposition"):
            assert line[key] == record[key], (key, line, record)
        assert line["status"] == record["evidence"]["status"]
        dispatches = [e for e in record["events"] if e["kind"] == "DISPATCH_STARTED"]
        assert line["attempts"] == len(dispatches)
        assert isinstance(line["total_ms"], (int, float)) and 0 <= line["total_ms"] <= elapsed_ms
        if line["invocation_id"] in traffic.dispatched:
            assert isinstance(line["remote_ms"], (int, float)) and 0 <= line["remote_ms"] <= line["total_ms"]
        else:
            assert line.get("remote_ms") is None, "nothing was dispatched"

    by_id = {line["invocation_id"]: line for line in lines}
    assert (by_id[traffic.ok]["phase"], by_id[traffic.ok]["outcome"], by_id[traffic.ok]["code"]) == ("result_delivery", "committed", None)
    assert by_id[traffic.ok]["status"] == 200 and by_id[traffic.keyed]["status"] == 201
    assert (by_id[traffic.refused]["route"], by_id[traffic.refused]["code"]) == (None, "INVALID_TARGET")
    assert (by_id[traffic.lost]["outcome"], by_id[traffic.lost]["code"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN")

    logs = broker.logs()
    assert any(CANARIES["PAYMENTS_KEY"] in (r.header("Authorization") or "") for r in upstream.received)
    for name, secret in zip([*CANARIES, *CANARIES], FORBIDDEN):
        assert secret not in logs, f"{name} leaked into the log"


def test_warning_level_drops_info_lines_and_the_broker_still_works(make_broker, upstream: HostileUpstream):
    broker = make_broker("sqlite", log={"level": "warning"})
    assert broker.config["log"] == {"level": "warning"}
    with broker.client() as client:
        ok = client.get(f"{PAYMENTS}/h/ok")
        refused = client.get("https://unknown.example.test/x")
    assert ok.status_code == 200 and ok.headers["affidavit-outcome"] == "committed"
    assert refused.status_code == 403
    for response in (ok, refused):
        ended(broker, response.headers["affidavit-invocation-id"])  # ended, so its line would be written
    _, families = scrape_until(broker, lambda f: sum(invocation_counts(f).values()) == 2)
    assert sum(invocation_counts(families).values()) == 2, "metrics do not depend on the log level"

    assert "invocation ended" not in broker.logs()
    assert [e for e in json_lines(broker) if e["level"] in ("debug", "info")] == []
    assert "proxy listening on" in broker.logs(), "the start-up banner is not a log line"


# -- affidavit metrics ----------------------------------------------------------------------------

OUTCOME_COLUMNS = ["not_attempted", "rejected", "committed", "unknown", "partial_effect"]
PHASE_ROWS = [p.value for p in Phase]


def metrics_table(broker: BrokerProcess, *args: str) -> tuple[dict[str, list[int]], str]:
    """``{row: [not_attempted, rejected, committed, unknown, partial_effect, total]}`` and the summary line."""
    done = broker.command("metrics", *args)
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    header = next(line for line in out.splitlines() if re.search(r"[│┃|]\s*phase\s*[│┃|]", line))
    assert [c.strip() for c in re.split(r"[│┃|]", header)[2:-1]] == [*OUTCOME_COLUMNS, "total"], out
    rows: dict[str, list[int]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        if len(cells) == 9 and cells[1] in (*PHASE_ROWS, "total"):
            rows[cells[1]] = [0 if c == "." else int(c) for c in cells[2:-1]]
    assert sorted(rows) == sorted([*PHASE_ROWS, "total"]), out
    summary = " ".join(line for line in out.splitlines() if line.startswith(("remote_execution/unknown:", "connection_setup/")))
    assert re.search(r"^remote_execution/unknown: \d+ \(.*never re-send blindly\)$", out, re.M), "one whole line at 80 columns"
    return rows, summary


def expected_table(cells: dict[tuple[str, str], int]) -> dict[str, list[int]]:
    table = {}
    for phase in PHASE_ROWS:
        values = [cells.get((phase, outcome), 0) for outcome in OUTCOME_COLUMNS]
        table[phase] = [*values, sum(values)]
    totals = [sum(cells.get((p, o), 0) for p in PHASE_ROWS) for o in OUTCOME_COLUMNS]
    table["total"] = [*totals, sum(totals)]
    return table


def execute(url: str, sql: str) -> None:
    """Write to the journal from outside the broker (stdlib sqlite3, or psql)."""
    if url.startswith("sqlite"):
        with sqlite3.connect(make_url(url).database or "", timeout=10) as conn:
            conn.execute(sql)
        return
    done = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", *_pg_args(url), "-c", sql], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def backdate(url: str, hours: int, invocation_id: str | None = None) -> None:
    """Move invocations ``hours`` into the past (the window is whole UTC hours: no test can wait one)."""
    where = f" WHERE invocation_id = '{invocation_id}'" if invocation_id else ""
    if url.startswith("sqlite"):
        execute(url, f"UPDATE invocations SET created_at = strftime('%Y-%m-%d %H:%M:%f000', created_at, '-{hours} hours'){where}")
    else:
        execute(url, f"UPDATE invocations SET created_at = created_at - interval '{hours} hours'{where}")



@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_request_still_in_flight_is_neither_counted_nor_queued_for_reconciliation(make_broker, upstream: HostileUpstream, dialect: str):
    """Dispatched and not yet answered, a record says remote_execution/unknown: the views and
    `affidavit metrics` used to count it so, and unknown_outcomes (the reconciliation queue)
    listed it, though its answer was on its way. They count an invocation once it has ended, as
    affidavit_invocations_total does."""
    import concurrent.futures

    broker = make_broker(dialect)
    gate = f"in-flight-{dialect}-{secrets.token_hex(4)}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Held at the upstream until the looks below are done (a fixed delay ran out on a loaded
        # machine while `affidavit metrics` started, and the request was counted as ended).
        slow = pool.submit(lambda: broker.client().post(f"{PAYMENTS}/h/ok?gate={gate}", content=b"{}"))
        deadline = time.monotonic() + 10
        while not _sql(broker, "SELECT invocation_id FROM invocations WHERE stage IN ('dispatched', 'sent')"):
            assert time.monotonic() < deadline, "the slow request was never dispatched"
            time.sleep(0.05)
        assert _sql(broker, "SELECT count(*) FROM unknown_outcomes") == [("0",)]
        assert _sql(broker, "SELECT count(*) FROM invocation_outcomes") == [("0",)]
        rows, summary = metrics_table(broker, "--since", "1h")
        assert rows == expected_table({}) and summary.startswith("remote_execution/unknown: 0 "), summary
        upstream.open_gate(gate)
        assert slow.result(timeout=20).status_code == 200
    deadline = time.monotonic() + 10
    while _sql(broker, "SELECT stage FROM invocations") != [("delivered",)]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rows, _ = metrics_table(broker, "--since", "1h")
    assert rows == expected_table({("result_delivery", "committed"): 1})
    assert _sql(broker, "SELECT sum(invocations) FROM invocation_outcomes") == [("1",)]


def _sql(broker: BrokerProcess, sql: str) -> list[tuple[str, ...]]:
    from tests.support.journal import query

    return query(broker.database_url, sql)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_affidavit_metrics_table_counts_and_since_window(make_broker, upstream: HostileUpstream, dialect: str):
    broker = make_broker(dialect, env={"COLUMNS": "80"})  # a narrow terminal (or a pipe) cuts no name
    rows, summary = metrics_table(broker, "--since", "1h")
    assert rows == expected_table({}), "a fresh journal counts nothing"

    traffic = drive_known_traffic(broker, upstream)
    everything = {
        ("result_delivery", "committed"): 2,
        ("validation", "not_attempted"): 1,
        ("remote_execution", "unknown"): 1,
    }
    rows, summary = metrics_table(broker, "--since", "1h")
    assert rows == expected_table(everything)
    assert summary.startswith("remote_execution/unknown: 1 ") and "connection_setup/not_attempted: 0 " in summary
    rows, _ = metrics_table(broker)  # the default window, 24h
    assert rows == expected_table(everything)
    rows, _ = metrics_table(broker, "--since", "1h", "--route", "payments.create")
    assert rows == expected_table({k: v for k, v in everything.items() if k[0] != "validation"})

    # The lost exchange three hours ago: outside the last hour, inside the last day.
    backdate(broker.database_url, 3, traffic.lost)
    recent = {k: v for k, v in everything.items() if k != ("remote_execution", "unknown")}
    rows, summary = metrics_table(broker, "--since", "1h")
    assert rows == expected_table(recent)
    assert summary.startswith("remote_execution/unknown: 0 ")
    rows, summary = metrics_table(broker, "--since", "24h")
    assert rows == expected_table(everything)
    assert summary.startswith("remote_execution/unknown: 1 ")

    # Everything three hours ago: the last hour is empty (zeros, "." in the cells).
    backdate(broker.database_url, 3)
    rows, summary = metrics_table(broker, "--since", "1h")
    assert rows == expected_table({})
    assert summary.startswith("remote_execution/unknown: 0 ")
    rows, _ = metrics_table(broker, "--since", "7d")
    assert rows == expected_table(everything)

    bad = broker.command("metrics", "--since", "yesterday")
    assert bad.returncode == 2 and b"--since" in bad.stderr


# -- affidavit run --example ----------------------------------------------------------------------


def port_free(port: int) -> bool:
    """Whether the broker could listen on 127.0.0.1:``port`` (it sets SO_REUSEADDR, so do we)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_") and "PROXY" not in k.upper()}
    env.update(extra)
    return env


def wait_for_text(path: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float, also: Path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if needle in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(
        f"no {needle!r} within {timeout}s (exit {proc.poll()}):\n{path.read_text(errors='replace')}\n{also.read_text(errors='replace')[-3000:]}"
    )


@pytest.fixture
def example_dir(tmp_path: Path) -> Iterator[Path]:
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    yield workdir


def test_run_example_with_a_configuration_elsewhere_keeps_its_files_beside_it(example_dir: Path, tmp_path: Path):
    """``run --example -c DIR/affidavit.toml`` from another directory: the tokens, the CA and the
    journal go beside the file, and the file names them absolutely, so the broker starts (and
    starts again) from any directory; nothing lands in the working directory."""
    home = tmp_path / "etc-affidavit"
    config = home / "affidavit.toml"
    proxy_listen, api_listen = (f"127.0.0.1:{port}" for port in free_ports(2))
    env = clean_env(AFFIDAVIT_PROXY__LISTEN=proxy_listen, AFFIDAVIT_API__LISTEN=api_listen)
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen([AFFIDAVIT, "run", "--example", "-c", str(config)], cwd=example_dir, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        printed = wait_for_text(out, "export AFFIDAVIT_API_URL=", proc, 60, err)
        assert f"affidavit: wrote an example configuration to {config} (tokens in {home / '.affidavit'}/)" in printed.splitlines()
        assert list(example_dir.iterdir()) == [], "nothing in the working directory"
        assert {p.name for p in home.iterdir()} >= {"affidavit.toml", ".affidavit", "affidavit.db"}
        ca = home / ".affidavit" / "mitmproxy-ca-cert.pem"
        assert f"affidavit: CA certificate {ca}" in printed.splitlines()
        token = (home / ".affidavit" / "builder.token").read_text().strip()
        # From yet another directory, the same configuration gives the same lines.
        again = subprocess.run([AFFIDAVIT, "env", "-c", str(config)], cwd=tmp_path, env=env, capture_output=True, timeout=60)
        assert again.returncode == 0, again.stderr.decode()
        proxy_url = f"http://builder:{token}@{proxy_listen}"
        with httpx.Client(proxy=proxy_url, verify=ssl.create_default_context(cafile=str(ca)), trust_env=False, timeout=20) as client:
            refused = client.get("https://unknown.example.test/x")
        assert refused.status_code == 403 and check_envelope(refused.content)["error"]["code"] == "INVALID_TARGET"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, err.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _serve_until_banner(args: list[str], cwd: Path, env: dict[str, str], needle: str, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    out, err = logs / "run.out", logs / "run.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen([AFFIDAVIT, "run", *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        return proc, wait_for_text(out, needle, proc, 60, err)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        raise


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def test_run_example_keeps_a_token_file_already_there_and_says_so(example_dir: Path, tmp_path: Path):
    """A ``.affidavit/builder.token`` left from an earlier try is kept (never overwritten), and the
    line that reports the example says so: the token the agent needs is the old one."""
    (example_dir / ".affidavit").mkdir()
    old = secrets.token_urlsafe(24)
    (example_dir / ".affidavit" / "builder.token").write_text(old + "\n")
    proxy_listen, api_listen = (f"127.0.0.1:{port}" for port in free_ports(2))
    env = clean_env(AFFIDAVIT_PROXY__LISTEN=proxy_listen, AFFIDAVIT_API__LISTEN=api_listen)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    proc, printed = _serve_until_banner(["--example"], example_dir, env, "export AFFIDAVIT_API_URL=", tmp_path / "first")
    try:
        assert ("affidavit: wrote an example configuration to affidavit.toml "
                "(tokens in .affidavit/; builder.token was there already and kept)") in printed.splitlines()
        assert (example_dir / ".affidavit" / "builder.token").read_text() == old + "\n"
        ca = example_dir / ".affidavit" / "mitmproxy-ca-cert.pem"
        with httpx.Client(proxy=f"http://builder:{old}@{proxy_listen}", verify=ssl.create_default_context(cafile=str(ca)),
                          trust_env=False, timeout=20) as client:
            refused = client.get("https://unknown.example.test/x")
        assert refused.status_code == 403 and check_envelope(refused.content)["error"]["code"] == "INVALID_TARGET"
    finally:
        _stop(proc)
    # Run again: the configuration exists now, and --example says it left it alone.
    proc, printed = _serve_until_banner(["--example"], example_dir, env, "export AFFIDAVIT_API_URL=", tmp_path / "second")
    try:
        assert "affidavit: affidavit.toml exists; --example left it as it is and runs it" in printed.splitlines()
    finally:
        _stop(proc)
    for run in ("first", "second"):
        assert old not in (tmp_path / run / "run.out").read_text() + (tmp_path / run / "run.err").read_text()


def test_a_broker_without_agents_says_it_refuses_every_request(tmp_path: Path):
    """No ``[[agents]]``: the banner does not print exports for a made-up agent 'AGENT' with the
    token 'TOKEN'; it says that every request is refused, as one is."""
    proxy_listen, api_listen = (f"127.0.0.1:{port}" for port in free_ports(2))
    config = tmp_path / "affidavit.toml"
    config.write_text(f"""[proxy]
listen = "{proxy_listen}"
confdir = "{tmp_path / 'conf'}"

[api]
listen = "{api_listen}"

[database]
url = "sqlite+aiosqlite:///{tmp_path / 'journal.db'}"
""")
    proc, printed = _serve_until_banner(["-c", str(config)], tmp_path, clean_env(), "affidavit: CA certificate", tmp_path)
    try:
        wait_for_text(tmp_path / "run.out", "[[agents]]", proc, 10, tmp_path / "run.err")
        printed = (tmp_path / "run.out").read_text()
        assert "AGENT" not in printed and "export " not in printed
        assert ("affidavit: no [[agents]] are configured, so the proxy refuses every request (407); add one "
                "(docs/configuration.md), then `affidavit env --agent NAME` prints its settings") in printed.splitlines()
        with httpx.Client(proxy=f"http://AGENT:TOKEN@{proxy_listen}", trust_env=False, timeout=20) as client:
            refused = client.get("http://upstream.example.test/x")
        assert refused.status_code == 407, refused.text
    finally:
        _stop(proc)
    # `affidavit env` says the same, rather than print exports for 'AGENT' with the token 'TOKEN'.
    done = subprocess.run([AFFIDAVIT, "env", "-c", str(config)], env=clean_env(), capture_output=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, b""), done
    assert b"affidavit: no [[agents]] are configured, so the proxy refuses every request" in done.stderr, done.stderr


@pytest.mark.parametrize("ports", ["default", "chosen"])
def test_run_example_in_an_empty_directory(example_dir: Path, ports: str):
    if ports == "default":
        taken = [p for p in (8080, 8081) if not port_free(p)]
        if taken:
            pytest.skip(f"the example's fixed ports {taken} on 127.0.0.1 are in use by another process")
        proxy_listen, api_listen = "127.0.0.1:8080", "127.0.0.1:8081"
        env = clean_env()
    else:  # "Every value can be overridden with AFFIDAVIT_* variables" (the example's header)
        proxy_listen, api_listen = (f"127.0.0.1:{port}" for port in free_ports(2))
        env = clean_env(AFFIDAVIT_PROXY__LISTEN=proxy_listen, AFFIDAVIT_API__LISTEN=api_listen)
    assert list(example_dir.iterdir()) == []
    out, err = example_dir.parent / f"run-{ports}.out", example_dir.parent / f"run-{ports}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen([AFFIDAVIT, "run", "--example"], cwd=example_dir, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        printed = wait_for_text(out, "export AFFIDAVIT_API_URL=", proc, 60, err)
        # The command re-executed itself (same pid) as the one the test brokers start with.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        assert cmdline == [*BROKER_COMMAND, "run", "--example"], cmdline
        lines = printed.splitlines()
        assert "affidavit: wrote an example configuration to affidavit.toml (tokens in .affidavit/)" in lines
        assert f"affidavit: proxy listening on {proxy_listen}, side API on http://{api_listen}" in lines
        [ca_line] = [line for line in lines if line.startswith("affidavit: CA certificate ")]
        ca = Path(ca_line.removeprefix("affidavit: CA certificate "))
        assert ca == (example_dir / ".affidavit" / "mitmproxy-ca-cert.pem").resolve()
        assert ca.is_file() and ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
        exports = [line.strip() for line in lines if line.startswith("  export ")]
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        token_ref = "$(cat .affidavit/builder.token)"
        assert values["HTTPS_PROXY"] == f'"http://builder:{token_ref}@{proxy_listen}"'
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
            assert values[name] == f'"{ca}"', name
        assert values["AFFIDAVIT_API_URL"] == f'"http://{api_listen}"'
        token = (example_dir / ".affidavit" / "builder.token").read_text().strip()
        assert token not in printed, "the banner names the token's source, never the token"
        assert (example_dir / ".affidavit" / "builder.token").stat().st_mode & 0o077 == 0

        # `affidavit env` in the same directory prints the same lines; `affidavit ca` the same path.
        again = subprocess.run([AFFIDAVIT, "env"], cwd=example_dir, env=env, capture_output=True, timeout=60)
        assert again.returncode == 0, again.stderr.decode()
        assert again.stdout.decode().splitlines() == exports
        path = subprocess.run([AFFIDAVIT, "ca"], cwd=example_dir, env=env, capture_output=True, timeout=60)
        assert path.returncode == 0 and path.stdout.decode().strip() == str(ca)

        # The printed proxy URL and CA work: a target no route allows is refused, as a recorded envelope.
        proxy_url = values["HTTPS_PROXY"].strip('"').replace(token_ref, token)
        with httpx.Client(proxy=proxy_url, verify=ssl.create_default_context(cafile=str(ca)), trust_env=False, timeout=20) as client:
            refused = client.get("https://unknown.example.test/x")
        assert refused.status_code == 403, refused.text
        assert check_envelope(refused.content)["error"]["code"] == "INVALID_TARGET"

        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the broker did not stop within 20s of SIGTERM:\n{err.read_text(errors='replace')[-3000:]}")
        assert code == 0, err.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    for secret in (token, (example_dir / ".affidavit" / "operator.token").read_text().strip()):
        assert secret not in out.read_text() and secret not in err.read_text()
