"""Crash safety: kill the broker between durable steps, or take its journal away, and check that
it loses nothing and claims nothing false. Real broker processes, ``kill -9``, real databases."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import sqlite3
import signal
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import DIALECTS
from tests.support.broker import BrokerProcess, big_answer_over_http1
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream
from tests.support.journal import query
from tests.support.pg import ThrowawayCluster, fresh_database
from tests.support.relay import TcpRelay

CRASH = "https://crash.example.test"
SAFE = "https://crash-safe.example.test"


def crash_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    base = {"agents": ["builder"], "connect_to": f"127.0.0.1:{up.tls_port('good')}", "methods": ["POST", "GET"],
            "response_timeout": "5s", "result_horizon": "6s"}
    return [
        {"name": "crash", "host": "crash.example.test", **base},
        {"name": "crash-safe", "host": "crash-safe.example.test", **base,
         "idempotency": {"header": "Idempotency-Key", "scope": "crash", "retention": "1h"}},
    ]


def post(broker: BrokerProcess, url: str, key: str, timeout: float = 15) -> httpx.Response:
    with broker.client(timeout=timeout) as client:
        return client.post(url, content=b'{"amount":1}', headers={"Idempotency-Key": key, "Content-Type": "application/json"})


def restart_without_failpoints(broker: BrokerProcess) -> None:
    broker.kill()
    broker.env.pop("AFFIDAVIT_FAILPOINTS", None)
    broker.start()


def record_by_key_when(broker: BrokerProcess, key: str, timeout: float = 10.0) -> str:
    """The invocation bound to ``key``, once there is one."""
    deadline = time.monotonic() + timeout
    while not query(broker.database_url, f"SELECT 1 FROM invocations WHERE idempotency_key = '{key}'"):
        assert time.monotonic() < deadline, f"no record for key {key} within {timeout}s"
        time.sleep(0.05)
    return record_by_key(broker, key)


def record_by_key(broker: BrokerProcess, key: str) -> str:
    rows = query(broker.database_url, f"SELECT invocation_id FROM invocations WHERE idempotency_key = '{key}'")
    assert len(rows) == 1, rows
    return rows[0][0]


#: failpoint -> (outcome after recovery, retry, what a caller repeating the same key gets,
#:               effects applied by the upstream after the crash, and after the repeat)
CASES = {
    "before_credential": ("not_attempted", "backoff", 201, 0, 1),
    "during_tls": ("not_attempted", "backoff", 201, 0, 1),
    "after_dispatch_commit": ("unknown", "reconcile", 409, 0, 0),
    # "Handed to the transport" is not "received": a kill right after the last write may beat the
    # kernel to the wire, so the upstream applied the effect or not; either way the record says
    # unknown, which is exactly why it must.
    "after_request_sent": ("unknown", "reconcile", 409, None, None),
    "mid_response_headers": ("unknown", "reconcile", 409, 1, 1),
    "mid_response_body": ("unknown", "reconcile", 409, 1, 1),
    "after_response_complete": ("unknown", "reconcile", 409, 1, 1),
    "after_result_commit": ("committed", "fetch_result", 201, 1, 1),
    "during_delivery": ("committed", "fetch_result", 201, 1, 1),
}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
@pytest.mark.parametrize("failpoint", list(CASES))
def test_kill_at_every_boundary_then_recover(make_broker, upstream, dialect, failpoint):
    outcome, retry, repeat_status, effects, effects_after_repeat = CASES[failpoint]
    broker = make_broker(dialect, routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": f"{failpoint}=kill@1"})
    key = "crash_" + secrets.token_hex(6)
    url = CRASH + "/h/idem_honour?code=201"
    with pytest.raises(httpx.HTTPError):
        post(broker, url, key)
    assert broker.proc is not None and broker.proc.wait(10) == -9, "the failpoint killed the broker"
    restart_without_failpoints(broker)
    invocation_id = record_by_key(broker, key)
    record = broker.wait_for(invocation_id, lambda r: r["retry"] is not None and r["stage"] not in ("committed", "dispatched"))
    assert record["outcome"] == outcome, record
    assert record["retry"] == retry
    assert record["caller_disposition"] == "disconnected"
    kinds = [e["kind"] for e in record["events"]]
    if "DISPATCH_STARTED" in kinds:
        assert outcome != "not_attempted", "never not_attempted after DISPATCH_STARTED"
    last = record["events"][-1]
    assert last["kind"] == "FAILED" and "broker restart" in last["data"]["basis"]
    assert upstream.effects == effects if effects is not None else upstream.effects in (0, 1)
    effects_after_crash = upstream.effects
    # A caller that repeats the same logical operation gets the truth, never a second effect.
    repeat = post(broker, url, key)
    assert repeat.status_code == repeat_status, repeat.text
    if repeat_status == 409:
        assert check_envelope(repeat.content)["error"]["code"] == "RECONCILE_REQUIRED"
    elif outcome == "committed":
        assert repeat.headers["affidavit-replayed"] == "true"
    expected = effects_after_repeat if effects_after_repeat is not None else effects_after_crash
    assert upstream.effects == expected
    assert len([r for r in upstream.received if r.method]) <= 2


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_fault_of_the_broker_while_it_records_a_complete_answer_ends_the_record_unknown(make_broker, upstream, dialect):
    """An exception of the broker's own before a complete answer is on the record (a bug in
    reading its evidence, injected here) must not leave the record in flight for ever nor answer
    without the invocation's id: it ends unknown, reconcile, and the agent is told with the id."""
    broker = make_broker(dialect, routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "after_response_complete=raise@1"})
    response = post(broker, CRASH + "/h/status?code=201", "k_" + secrets.token_hex(6))
    assert response.status_code == 502, response.text
    body = check_envelope(response.content)
    assert (body["error"]["code"], body["error"]["outcome"], body["error"]["retry"]) == ("REMOTE_OUTCOME_UNKNOWN", "unknown", "reconcile")
    assert body["invocation_id"] == response.headers["affidavit-invocation-id"]
    assert "answered completely (status 201), but the broker failed recording" in body["error"]["message"], body
    record = broker.invocation(body["invocation_id"])
    assert (record["stage"], record["outcome"], record["next_action"]) == ("ended_unknown", "unknown", "reconcile"), record
    assert record["evidence"]["response_headers_received"] is True
    assert "the upstream's complete answer (status 201) could not be recorded" in broker.logs()
    assert upstream.effects == 1
    assert post(broker, CRASH + "/h/status?code=201", "k_" + secrets.token_hex(6)).status_code == 201, "the next one is served"


def _keyed_post_cut_by_a_crash(make_broker, upstream, dialect: str) -> tuple[BrokerProcess, str, str, dict[str, Any]]:
    """A keyed POST on a route with a remote contract, its broker killed mid-response and
    restarted: (broker, key, url, the record once recovery has closed it as unknown)."""
    broker = make_broker(dialect, routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "mid_response_headers=kill@1"})
    key = "crash_" + secrets.token_hex(6)
    url = SAFE + "/h/idem_honour?code=201"
    with pytest.raises(httpx.HTTPError):
        post(broker, url, key)
    restart_without_failpoints(broker)
    record = broker.wait_for(record_by_key(broker, key), lambda r: r["stage"] == "ended_unknown")
    return broker, key, url, record


def test_an_unknown_outcome_after_a_crash_is_resent_with_the_same_key_under_a_contract(make_broker, upstream):
    broker, key, url, record = _keyed_post_cut_by_a_crash(make_broker, upstream, "postgresql")
    assert record["retry"] == "same_idempotency_key"
    repeat = post(broker, url, key)
    assert repeat.status_code == 201 and repeat.headers["affidavit-outcome"] == "committed"
    assert upstream.effects == 1 and upstream.effects_by_key[key] == 1
    assert [r.header("Idempotency-Key") for r in upstream.received if r.method] == [key, key]


def test_an_unkeyed_request_killed_before_dispatch_leaves_no_false_record(make_broker, upstream):
    broker = make_broker("sqlite", routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "during_tls=kill@1"})
    with broker.client() as client:
        with pytest.raises(httpx.HTTPError):
            client.post(CRASH + "/h/ok", content=b"{}")
    restart_without_failpoints(broker)
    time.sleep(0.5)
    rows = query(broker.database_url, "SELECT outcome, code FROM invocations")
    # Pre-dispatch facts of an unkeyed request ride with its dispatch commit: a crash before it
    # leaves either no record or a not_attempted one, and the upstream saw nothing.
    assert all(row == ("not_attempted", "BROKER_RESTARTED") for row in rows), rows
    assert upstream.effects == 0


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_slow_exchange_records_that_its_request_left_so_a_crash_does_not_hide_it(make_broker, upstream, dialect):
    """A quick exchange keeps REQUEST_SENT and REMOTE_RESPONSE_STARTED in memory (its end implies
    both). A slow one records them once it has waited a moment: the record read while it waits,
    and the one recovered after the broker is killed, say the request left whole (and, once they
    came, that the upstream's headers did), not merely that its dispatch began."""
    broker = make_broker(dialect, routes=crash_routes(upstream))
    key = f"slow-{time.monotonic_ns()}"
    # hang: the effect at once, never an answer (a slow answer's late effect would land in a later test)
    thread = threading.Thread(target=lambda: _quietly(lambda: post(broker, SAFE + "/h/hang", key)))
    thread.start()
    upstream.wait_for_requests(1, timeout=10)
    invocation_id = record_by_key(broker, key)
    # Well inside the route's response timeout (5 s), whose end would record the progress too.
    record = broker.wait_for(invocation_id, lambda r: r["evidence"]["dispatch"] != "started_locally", timeout=2)
    assert record["evidence"]["dispatch"] == "bytes_handed_to_transport" and record["evidence"]["request_complete"] is True
    assert record["stage"] == "sent" and record["next_action"] == "wait", record
    broker.kill()
    thread.join(20)
    broker.start()
    closed = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown", timeout=15)
    assert (closed["evidence"]["dispatch"], closed["evidence"]["request_complete"]) == ("bytes_handed_to_transport", True)
    assert closed["outcome"] == "unknown", closed
    kinds = [k for (k,) in query(broker.database_url, f"SELECT kind FROM events WHERE invocation_id = '{invocation_id}' ORDER BY seq")]
    assert kinds.count("REQUEST_SENT") == 1 and kinds.index("DISPATCH_STARTED") < kinds.index("REQUEST_SENT"), kinds


@pytest.mark.parametrize(("dialect", "sig"), [("sqlite", signal.SIGTERM), ("postgresql", signal.SIGTERM),
                                             ("sqlite", signal.SIGHUP)], ids=["sqlite", "postgresql", "sqlite-SIGHUP"])
def test_a_clean_stop_writes_what_it_knows_of_the_requests_it_cuts(make_broker, upstream, dialect, sig):
    """SIGTERM with a request waiting on the upstream: the request is cut, and its record says
    so in the journal (REMOTE_OUTCOME_UNKNOWN), not left 'in flight' for a recovery to guess at.
    SIGHUP (the terminal closed) stops as cleanly; it killed the broker at once."""
    broker = make_broker(dialect, routes=crash_routes(upstream))
    key = f"stop-{time.monotonic_ns()}"
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["r"] = post(broker, SAFE + "/h/hang", key)
        except httpx.HTTPError as exc:
            result["r"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    upstream.wait_for_requests(1, timeout=10)
    assert broker.stop(sig=sig) == 0
    thread.join(20)
    invocation_id = record_by_key(broker, key)
    rows = query(broker.database_url, f"SELECT stage, outcome, code FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert rows == [("ended_unknown", "unknown", "REMOTE_OUTCOME_UNKNOWN")], rows
    kinds = [k for (k,) in query(broker.database_url, f"SELECT kind FROM events WHERE invocation_id = '{invocation_id}' ORDER BY seq")]
    assert kinds[-1] == "FAILED" and "DISPATCH_STARTED" in kinds, kinds
    assert "BROKER_RESTARTED" not in kinds and "CALLER_CANCELLED" not in kinds, kinds
    assert "affidavit: stopped" in broker.logs() and "still being handled" not in broker.logs()


def test_a_stop_lets_the_exchanges_already_sent_end_and_sends_nothing_new(make_broker, upstream):
    """[proxy] drain: a stop no longer cuts an exchange about to end (a rolling restart made every
    unkeyed POST in flight a reconciliation, found by a probe). The one already sent ends as it
    would and its answer is delivered; the port stops listening; a request on a connection that
    was open already is not sent (not_attempted, retry is safe); then the broker stops."""
    broker = make_broker("postgresql", routes=crash_routes(upstream), proxy={"drain": "8s"})
    answers: dict[str, Any] = {}
    with broker.client() as idle, broker.client() as busy:
        assert idle.post(CRASH + "/h/ok", content=b"{}").status_code == 200  # its connection stays open
        slow = threading.Thread(target=lambda: answers.update(slow=busy.post(CRASH + "/h/slow?delay=2", content=b"{}")))
        slow.start()
        upstream.wait_for_requests(2, timeout=10)
        assert broker.proc is not None
        stopped_at = time.monotonic()
        broker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while "received SIGTERM" not in broker.logs() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        with pytest.raises(OSError):  # nothing listens any more: new connections go elsewhere
            socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=2).close()
        ready = httpx.get(broker.api_url + "/readyz", timeout=10)
        late = idle.post(CRASH + "/h/ok", content=b"{}")
        slow.join(20)
        code = broker.proc.wait(20)
    took = time.monotonic() - stopped_at
    assert code == 0, broker.logs()[-3000:]
    answer = answers["slow"]
    assert answer.status_code == 200 and "affidavit-code" not in answer.headers, (answer.status_code, answer.text[:300])
    assert (ready.status_code, ready.json()) == (503, {"status": "unavailable", "broker": "stopping"})
    assert answer.headers["connection"] == "close", "the agent's next request goes to a broker that runs"
    late_body = check_envelope(late.content)
    error = late_body["error"]
    assert (late.status_code, error["code"], error["outcome"], error["retry"]) == (
        503, "BROKER_RESTARTED", "not_attempted", "backoff"), late_body
    assert error["message"].startswith("The broker is stopping") and late_body["invocation_id"] is None
    assert late.headers["connection"] == "close" and late.headers["retry-after"] == "1"
    assert upstream.effects == 2, "the slow one was sent; the late one was not"
    assert 1.3 < took < 8, took
    rows = query(broker.database_url, "SELECT stage, outcome FROM invocations WHERE invocation_id = "
                                      f"'{answer.headers['affidavit-invocation-id']}'")
    assert rows == [("delivered", "committed")], rows
    assert "still in flight after the drain" not in broker.logs()


def test_a_stop_drains_an_exchange_whose_caller_already_timed_out(make_broker, upstream):
    """The caller's wait ended (response_timeout) and the exchange goes on in the background:
    the drain waits for it too, so its late result is stored for the caller to fetch."""
    routes = [{**route, "response_timeout": "1s"} for route in crash_routes(upstream)]
    broker = make_broker("postgresql", routes=routes, proxy={"drain": "8s"})
    with broker.client() as client:
        timed_out = client.post(CRASH + "/h/slow?delay=2.5", content=b"{}")
    assert timed_out.status_code == 504, timed_out.text
    invocation_id = timed_out.headers["affidavit-invocation-id"]
    assert broker.stop(timeout=30) == 0
    rows = query(broker.database_url, f"SELECT outcome, retry FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert rows == [("committed", "fetch_result")], rows
    assert "still in flight after the drain" not in broker.logs()


def _hanging_with_drain(make_broker, upstream, drain: str) -> tuple[BrokerProcess, dict[str, Any], threading.Thread]:
    """A broker with ``[proxy] drain``, and a keyed request it has sent to an upstream that never
    answers (its answer lands in the dict once the thread ends)."""
    broker = make_broker("postgresql", routes=crash_routes(upstream), proxy={"drain": drain})
    answers: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: answers.update(r=post(broker, SAFE + "/h/hang", f"hang-{time.monotonic_ns()}")))
    slow.start()
    upstream.wait_for_requests(1, timeout=10)
    return broker, answers, slow


def test_a_second_signal_during_the_drain_stops_at_once(make_broker, upstream):
    broker, answers, slow = _hanging_with_drain(make_broker, upstream, "20s")
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGTERM)
    time.sleep(0.6)
    began = time.monotonic()
    assert broker.stop() == 0
    assert time.monotonic() - began < 8, "the second signal did not wait for the 20 s drain"
    slow.join(20)
    assert check_envelope(answers["r"].content)["error"]["code"] == "REMOTE_OUTCOME_UNKNOWN"
    assert "received SIGTERM again: stopping now" in broker.logs()


def test_a_drain_that_runs_out_cuts_what_is_left(make_broker, upstream):
    broker, answers, slow = _hanging_with_drain(make_broker, upstream, "1s")
    began = time.monotonic()
    assert broker.stop() == 0
    took = time.monotonic() - began
    slow.join(20)
    error = check_envelope(answers["r"].content)["error"]
    assert (error["code"], error["outcome"]) == ("REMOTE_OUTCOME_UNKNOWN", "unknown"), error
    assert error["message"].startswith("The broker is stopping (a restart or a scale-down) and cut this exchange"), error
    assert 0.9 < took < 8, took
    assert "1 request(s) still in flight after the drain (1 s); cutting them" in broker.logs()


def test_a_request_not_yet_dispatched_at_a_clean_stop_is_never_sent(make_broker, upstream):
    """SIGTERM while a request is still before its dispatch: nothing new goes upstream once the
    broker is stopping, and the record says not_attempted."""
    broker = make_broker(routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "before_credential=pause:2@1"})
    key = f"stopping-{time.monotonic_ns()}"
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: _quietly(lambda: answers.append(post(broker, SAFE + "/h/ok", key))))
    thread.start()
    time.sleep(0.7)  # the key is bound; the broker pauses before the credential
    assert broker.stop() == 0
    thread.join(20)
    assert upstream.received == [], "nothing is sent once the broker is stopping"
    # The agent is told the broker stopped, not that the upstream was unreachable (check its host).
    [answer] = answers
    message = check_envelope(answer.content)["error"]["message"]
    assert message.startswith("The broker is stopping") and "connect_to" not in message, message
    invocation_id = record_by_key(broker, key)
    rows = query(broker.database_url, f"SELECT outcome, code FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert rows == [("not_attempted", "CONNECT_FAILED")], rows


def test_a_request_that_reaches_its_dispatch_after_the_stop_began_is_not_dispatched(make_broker, upstream):
    """SIGTERM while a request has its upstream connection and is about to dispatch: its
    DISPATCH_STARTED used to be committed after the signal, and the stop then cut the exchange
    before a byte went out, so the record ended unknown (reconcile) with nothing sent (found by a
    probe). A dispatch once the broker is stopping is refused instead: not_attempted."""
    broker = make_broker(routes=crash_routes(upstream), env={"AFFIDAVIT_FAILPOINTS": "during_tls=pause:2@1"})
    key = f"stopping-at-dispatch-{time.monotonic_ns()}"
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: _quietly(lambda: answers.append(post(broker, SAFE + "/h/ok", key))))
    thread.start()
    time.sleep(0.7)  # connected upstream; paused at the start of the dispatch
    assert broker.stop() == 0
    thread.join(20)
    assert upstream.received == [], "nothing is sent once the broker is stopping"
    invocation_id = record_by_key(broker, key)
    rows = query(broker.database_url, f"SELECT outcome, code FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert rows == [("not_attempted", "CONNECT_FAILED")], rows
    kinds = [k for (k,) in query(broker.database_url, f"SELECT kind FROM events WHERE invocation_id = '{invocation_id}' ORDER BY seq")]
    assert "DISPATCH_STARTED" not in kinds, kinds
    if answers:  # the agent's connection may be cut by the stop first
        message = check_envelope(answers[0].content)["error"]["message"]
        assert message.startswith("The broker is stopping"), message


def test_a_response_the_stop_cuts_mid_body_is_said_to_be_cut_by_the_stop(make_broker, upstream):
    """SIGTERM while a response's body is arriving: the stop cuts it, and the agent was told 'The
    response ended before its framing was complete' (REMOTE_RESULT_INCOMPLETE), which blames the
    upstream (found by two probes). The record ends as the stop's cuts do: REMOTE_OUTCOME_UNKNOWN."""
    broker = make_broker(routes=crash_routes(upstream))
    key = f"stopping-mid-body-{time.monotonic_ns()}"
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: _quietly(lambda: answers.append(post(broker, SAFE + "/h/stall_mid_body", key))))
    thread.start()
    upstream.wait_for_requests(1, timeout=10)
    time.sleep(0.5)  # the head and the first bytes are in
    assert broker.stop() == 0
    thread.join(20)
    invocation_id = record_by_key(broker, key)
    rows = query(broker.database_url, f"SELECT outcome, code FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert rows == [("unknown", "REMOTE_OUTCOME_UNKNOWN")], rows
    if answers:  # the agent's connection may be cut by the stop first
        error = check_envelope(answers[0].content)["error"]
        assert (error["code"], error["outcome"]) == ("REMOTE_OUTCOME_UNKNOWN", "unknown"), error
        assert error["message"].startswith("The broker is stopping"), error


def test_a_broker_out_of_file_descriptors_says_so_and_blames_no_upstream(make_broker, upstream):
    """With every descriptor of the broker's process in use (idle connections piled up, say), the
    connection to the upstream cannot be opened: nothing is sent, and the agent is told why,
    rather than to have an operator check the route's host and port."""
    import resource

    broker = make_broker(routes=crash_routes(upstream))
    pid = broker.proc.pid
    tunnel = broker.tunnel("crash.example.test")  # the agent's connection, opened while descriptors remain
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # The limit caps descriptor *numbers*: set it to the lowest free one, so that a hole left by a
    # closed descriptor cannot be handed out (a count of open descriptors can sit above a hole), and
    # again while the broker still closes some (the readiness probe's connection, say).
    seen: set[int] = set()
    for _ in range(50):
        in_use = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        if in_use == seen:
            break
        seen = in_use
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(set(range(len(in_use) + 1)) - in_use), hard))
        time.sleep(0.2)
    else:
        pytest.fail(f"the broker's descriptors never settled: {sorted(seen)}")
    try:
        tunnel.sendall(b"POST /h/ok HTTP/1.1\r\nHost: crash.example.test\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < 100:
            chunk = tunnel.recv(65536)
            assert chunk, answer
            answer += chunk
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        tunnel.close()
    body = check_envelope(answer.split(b"\r\n\r\n", 1)[1])
    assert (body["error"]["code"], body["error"]["outcome"]) == ("CONNECT_FAILED", "not_attempted"), body
    message = body["error"]["message"]
    assert "no file descriptor left" in message and "connect_to" not in message, message
    assert upstream.received == []
    with broker.client() as client:  # descriptors back: served as usual
        assert client.post(CRASH + "/h/ok", content=b"{}").status_code == 200


def _quietly(call: Any) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass


# -- the journal itself fails ------------------------------------------------------------------


@pytest.fixture
def relayed_pg(pg_admin_url: str):
    """A fresh PostgreSQL database reached through a TCP relay the test can cut."""
    url, drop = fresh_database(pg_admin_url)
    server = make_url(url)
    with TcpRelay(server.host or "127.0.0.1", server.port or 5432) as relay:
        yield server.set(host="127.0.0.1", port=relay.listen_port).render_as_string(hide_password=False), relay
    drop()


def _start_on(make_broker, upstream, url: str, **kwargs: Any) -> BrokerProcess:
    return make_broker(routes=crash_routes(upstream), db_url=url, **kwargs)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_resend_cut_by_a_crash_is_closed_as_unknown_and_can_be_sent_again(make_broker, upstream, dialect):
    """A same-key re-send (generation 1) whose broker dies mid-exchange: its writes are fenced by
    generation and owner, and recovery's close used to be fenced by the recovering broker's own
    name, so it was refused at every sweep; the record said in flight for good and every repeat got
    IDEMPOTENCY_IN_PROGRESS. Recovery closes it as the stopped owner's, and the key works again."""
    broker, key, url, first = _keyed_post_cut_by_a_crash(make_broker, upstream, dialect)
    invocation_id = first["invocation_id"]

    broker.kill()
    broker.env["AFFIDAVIT_FAILPOINTS"] = "mid_response_headers=kill@1"
    broker.start()
    with pytest.raises(httpx.HTTPError):
        post(broker, url, key)  # the re-send, cut the same way
    [(generation,)] = query(broker.database_url, f"SELECT generation FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert int(generation) == 1
    restart_without_failpoints(broker)
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown" and r["evidence"]["dispatch_seq"] and
                             len(r["evidence"]["attempts"]) == 2, timeout=15)
    assert (record["outcome"], record["code"], record["retry"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN", "same_idempotency_key")
    assert "could not close" not in broker.logs()

    repeat = post(broker, url, key)
    assert repeat.status_code == 201 and repeat.headers["affidavit-outcome"] == "committed", repeat.text
    assert upstream.effects_by_key[key] == 1, "the service honoured the key: one effect for three sends"


def test_an_unreachable_journal_fails_closed_and_the_broker_serves_again_when_it_returns(relayed_pg, make_broker, upstream):
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    with broker.client() as client:
        first = client.post(CRASH + "/h/ok", content=b"{}")
        assert first.status_code == 200
        first_id = first.headers["affidavit-invocation-id"]
        with broker.api() as api:  # opens the side API's read connections before the cut
            assert api.get(f"/v1/invocations/{first_id}/result").status_code == 200
        bound = f"bound-{time.monotonic_ns()}"
        assert post(broker, SAFE + "/h/ok", bound).status_code == 200
        relay.cut()
        refused = client.post(CRASH + "/h/ok", content=b"{}")
        body = check_envelope(refused.content)
        assert refused.status_code == 503
        assert (body["error"]["code"], body["error"]["phase"], body["error"]["outcome"], body["error"]["retry"]) == (
            "JOURNAL_UNAVAILABLE", "validation", "not_attempted", "backoff")
        # A keyed request needs a read before anything else (is the key bound?): the same answer,
        # for a new key and for a repeat of a bound one, never "unknown".
        for key in (f"new-{time.monotonic_ns()}", bound):
            keyed = post(broker, SAFE + "/h/ok", key)
            body = check_envelope(keyed.content)
            assert (keyed.status_code, body["error"]["code"], body["error"]["outcome"], body["error"]["retry"]) == (
                503, "JOURNAL_UNAVAILABLE", "not_attempted", "backoff"), keyed.text
            # Not "No invocation was recorded": the key may name one, which may have had its effect.
            assert "cannot say whether the key names an earlier operation" in body["error"]["message"], body
            assert "retry after a delay with the same key, never a new one" in body["error"]["message"], body
        assert httpx.get(broker.api_url + "/readyz", timeout=10).status_code == 503
        assert httpx.get(broker.api_url + "/healthz", timeout=10).status_code == 200
        with broker.api() as api:  # the side API says the journal is away, not a bare 500
            for path in (f"/v1/invocations/{first_id}", f"/v1/invocations/{first_id}/result"):
                away = api.get(path)
                assert away.status_code == 503 and away.headers["retry-after"] == "1", (path, away.text)
                assert "journal (database) did not answer" in away.json()["detail"]
        relay.restore()
        deadline = time.monotonic() + 15
        while httpx.get(broker.api_url + "/readyz", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.3)
        # Ready means ready: the first request after the database returns is served (the
        # journal writer replaces the connection the outage closed, rather than failing on it).
        again = client.post(CRASH + "/h/ok", content=b"{}")
        with broker.api() as api:  # the side API's reads reconnect too
            assert api.get(f"/v1/invocations/{first_id}/result").status_code == 200
    assert again.status_code == 200, again.text
    assert upstream.effects == 3, "nothing was forwarded while the journal was down"
    logs = broker.logs()
    # The outage is the broker's to report, once; not a library's traceback per reconnect try.
    assert "Traceback" not in logs and "connection floor" not in logs, logs
    assert "Requests waiting on them were refused" in logs and "journal writes work again" in logs
    assert "journal write failed" not in broker.logs().split("could not be checked against the journal")[-1]


def test_a_request_refused_with_no_record_is_not_logged_as_a_record_in_flight(relayed_pg, make_broker, upstream):
    """The agent was told no invocation was recorded (its first write was the one refused); a
    long outage's warning about it may not say "its record ... says the request is in flight",
    which sends an operator looking for a record the journal most likely never got."""
    url, relay = relayed_pg
    broker = make_broker(routes=crash_routes(upstream), db_url=url, **{"upstream": {"result_horizon": "1s"}})
    with broker.client() as client:
        assert client.post(CRASH + "/h/ok", content=b"{}").status_code == 200
        relay.cut()
        refused = client.post(CRASH + "/h/ok", content=b"{}")
    assert refused.status_code == 503 and check_envelope(refused.content)["invocation_id"] is None, refused.text
    deadline = time.monotonic() + 20
    while "still does not answer" not in broker.logs():
        assert time.monotonic() < deadline, broker.logs()[-3000:]
        time.sleep(0.3)
    relay.restore()
    [line] = [line for line in broker.logs().splitlines() if "still does not answer" in line]
    assert "cannot tell whether its refused first write landed" in line and "nothing was sent" in line, line
    assert "its record is still not closed" not in broker.logs()
    assert upstream.effects == 1


def test_an_outage_under_load_is_a_few_log_lines_not_one_per_failed_batch(relayed_pg, make_broker, upstream):
    """Every request refused in an outage is a failed batch; a busy broker fails dozens a second.
    The first is logged whole, the rest are counted into one line per 10 s, and the recovery line
    says how many there were. So are keyed requests whose key cannot be looked up, and side-API
    calls that cannot read the journal."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    with broker.client() as client, broker.api() as api:
        ok = client.post(CRASH + "/h/ok", content=b"{}")
        assert ok.status_code == 200
        offset = len(broker.logs())
        relay.cut()
        refused = [client.post(CRASH + "/h/ok", content=b"{}").status_code for _ in range(12)]
        assert refused == [503] * 12
        keyed = [post(broker, SAFE + "/h/ok", f"outage-{i}").status_code for i in range(6)]
        assert keyed == [503] * 6
        reads = [api.get(f"/v1/invocations/{ok.headers['affidavit-invocation-id']}").status_code for _ in range(6)]
        assert reads == [503] * 6
        relay.restore()
        deadline = time.monotonic() + 10
        while client.post(CRASH + "/h/ok", content=b"{}").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
    logs = broker.logs()[offset:]
    failed = [line for line in logs.splitlines() if "journal write failed" in line]
    assert len(failed) == 1, failed
    for kind in ("could not be checked against the journal", "side API: the journal did not answer"):
        assert len([line for line in logs.splitlines() if kind in line]) == 1, (kind, logs[-3000:])
    [back] = [line for line in logs.splitlines() if "journal writes work again" in line]
    assert int(back.split("(")[1].split()[0]) >= 12, back


def test_a_progress_write_lost_in_an_outage_does_not_cost_the_result_once_the_journal_is_back(relayed_pg, make_broker, upstream):
    """A slow exchange records its progress lazily, while it waits. If that write fails (the
    journal is away for a moment), the result's commit sends it again first, in order, rather
    than being refused after it: the answer is stored and delivered whole, not RESULT_STORE_FAILED."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    offset = len(broker.logs())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with broker.client() as client:
            answer = pool.submit(client.post, CRASH + "/h/slow?delay=3", content=b"{}")
            upstream.wait_for_requests(1, timeout=10)
            relay.cut()  # before the progress write, 0.25 s after the request left
            deadline = time.monotonic() + 5
            while "journal write failed" not in broker.logs()[offset:] and time.monotonic() < deadline:
                time.sleep(0.05)
            # The cut reset the connection before the write went out: known unwritten.
            assert "journal write failed; 1 write(s) not recorded" in broker.logs()[offset:], broker.logs()[offset:][-2000:]
            relay.restore()
            deadline = time.monotonic() + 10
            while httpx.get(broker.api_url + "/readyz", timeout=10).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            response = answer.result(timeout=20)
    assert response.status_code == 200 and "affidavit-code" not in response.headers, (response.status_code, response.text[:500])
    invocation_id = response.headers["affidavit-invocation-id"]
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered", timeout=10)
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("REQUEST_SENT") == 1 and kinds.index("REQUEST_SENT") < kinds.index("REMOTE_RESPONSE_COMPLETE"), kinds
    assert record["outcome"] == "committed" and upstream.effects == 1


def test_a_result_whose_commit_waits_behind_a_lost_progress_write_is_stored_once_the_journal_is_back(relayed_pg, make_broker, upstream):
    """As above, but the journal is still away when the answer arrives: the result's commit sends
    the lost progress write again first, which fails, so the result's own write was never made.
    The repair once the journal is back wrote RESULT_COMMITTED without the result (the record said
    fetch_result; the fetch said no result): the result stays with its events and is stored."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    offset = len(broker.logs())
    with broker.client() as client:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.post, CRASH + "/h/slow?delay=2", content=b"{}")
            upstream.wait_for_requests(1, timeout=10)
            relay.cut()  # before the progress write, 0.25 s after the request left
            response = answer.result(timeout=20)  # the answer arrives while the journal is away
    assert response.status_code == 200 and response.headers["affidavit-code"] == "RESULT_STORE_FAILED", response.headers
    invocation_id = response.headers["affidavit-invocation-id"]
    relay.restore()
    deadline = time.monotonic() + 20
    while "after the journal recovered" not in broker.logs()[offset:] and time.monotonic() < deadline:
        time.sleep(0.1)
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered", timeout=10)
    assert record["outcome"] == "committed", record
    with broker.operator() as api:
        stored = api.get(f"/v1/invocations/{invocation_id}/result")
    assert stored.status_code == 200, stored.text[:500]
    assert stored.content == response.content and stored.headers["affidavit-replayed"] == "true"
    assert upstream.effects == 1


def test_a_heartbeat_that_fails_and_comes_back_is_logged_both_times(relayed_pg, make_broker, upstream):
    """The operator who saw "heartbeat failed" at 3 a.m. also learns, at the same level, when the
    journal took heartbeats again."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url, recovery={"heartbeat": "0.3s"}, log={"level": "warning"})

    def logged(text: str) -> None:
        deadline = time.monotonic() + 15
        while text not in broker.logs() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert text in broker.logs(), broker.logs()[-3000:]

    relay.cut()
    logged("heartbeat failed")
    assert "heartbeat written again" not in broker.logs()
    relay.restore()
    logged("heartbeat written again")
    logs = broker.logs()
    assert logs.count("heartbeat failed") == 1 and logs.count("heartbeat written again") == 1, "once each, not per beat"


def test_after_an_outage_the_broker_saw_only_through_readyz_the_first_request_is_served(relayed_pg, make_broker, upstream):
    """No request came while the database was away, so the journal writer's connection died
    unnoticed: once /readyz says ready, the next request must not fail on that dead connection."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    with broker.client() as client:
        assert client.post(CRASH + "/h/ok", content=b"{}").status_code == 200
        time.sleep(1.0)  # its lazy facts (the delivery) are written: the writer is idle now
        relay.cut()

        def ready() -> int:
            return httpx.get(broker.api_url + "/readyz", timeout=10).status_code

        deadline = time.monotonic() + 15
        while ready() != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        relay.restore()
        while ready() != 200 and time.monotonic() < deadline + 15:
            time.sleep(0.2)
        seen = len(broker.logs())
        first = client.post(CRASH + "/h/ok", content=b"{}")
    assert first.status_code == 200, first.text
    assert "journal write failed" not in broker.logs()[seen:]
    assert upstream.effects == 2


def record_by_key_when_back(broker: BrokerProcess, relay: TcpRelay, key: str) -> str:
    relay.restore()
    return record_by_key(broker, key)


def _refused_at_the_dispatch_write(make_broker, upstream, url: str, fault: Any) -> tuple[BrokerProcess, httpx.Response, dict]:
    """A keyed request whose DISPATCH_STARTED write meets ``fault`` (the key is bound durably
    first; the broker pauses just before that write): the 503 it gets, and its envelope."""
    broker = _start_on(make_broker, upstream, url, env={"AFFIDAVIT_FAILPOINTS": "during_tls=pause:1.5@1"})
    key = f"jd-{time.monotonic_ns()}"
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", post(broker, SAFE + "/h/ok", key)))
    thread.start()
    time.sleep(0.7)  # PREFLIGHT_VALIDATED is durable (keyed); the broker pauses before DISPATCH_STARTED
    fault()
    thread.join(20)
    body = check_envelope(result["r"].content)
    assert (result["r"].status_code, body["error"]["code"], body["error"]["outcome"]) == (503, "JOURNAL_UNAVAILABLE", "not_attempted")
    return broker, result["r"], body


def test_a_dispatch_write_that_lands_unacknowledged_is_answered_and_closed_as_what_it_is(relayed_pg, make_broker, upstream):
    """DISPATCH_STARTED reaches the database, its acknowledgement never returns: the broker sent
    nothing, but the record cannot prove that. The envelope says both ends this can have, and the
    record ends unknown (never rewritten as not dispatched), its caller answered, its basis saying
    what the broker knows."""
    url, relay = relayed_pg
    broker, response, body = _refused_at_the_dispatch_write(make_broker, upstream, url, relay.deafen)
    assert "or as unknown if its DISPATCH_STARTED reached the database unconfirmed" in body["error"]["message"], body
    relay.restore()
    record = broker.wait_for(body["invocation_id"], lambda r: r["retry"] is not None, timeout=20)
    # The route declares an idempotency contract: a same-key re-send is what unknown allows here.
    assert (record["outcome"], record["code"], record["retry"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN", "same_idempotency_key"), record
    assert record["caller_disposition"] == "completed", "the caller was answered (the 503)"
    failed = record["events"][-1]
    assert failed["kind"] == "FAILED" and "did not confirm it, so this broker sent nothing" in failed["data"]["basis"], failed
    assert [r for r in upstream.received if r.method] == [], "nothing was sent"


def test_a_key_binding_that_lands_unacknowledged_is_closed_and_the_key_works_again(relayed_pg, make_broker, upstream):
    """The first write of a keyed request binds its key; it reaches the database, its
    acknowledgement never returns. The agent is told nothing was sent, and what follows if the
    binding landed; the record is closed as not attempted once the journal answers. Before, it
    stayed in flight, and every repeat with the key got IDEMPOTENCY_IN_PROGRESS for as long as
    the broker ran."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url, env={"AFFIDAVIT_FAILPOINTS": "before_claim=pause:2@2"})
    warm = post(broker, SAFE + "/h/ok", f"warm-{time.monotonic_ns()}")  # the journal is connected
    assert warm.status_code == 200
    # Its last writes (the delivery record goes behind) are in: none stalls ahead of the binding.
    broker.wait_for(warm.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
    key = f"bind-{time.monotonic_ns()}"
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", post(broker, SAFE + "/h/ok", key)))
    thread.start()
    deadline = time.monotonic() + 10
    while broker.logs().count("failpoint before_claim: pause") < 2:  # looked up; paused before binding its key
        assert time.monotonic() < deadline, "the request never reached the binding of its key"
        time.sleep(0.05)
    relay.deafen()
    thread.join(20)
    body = check_envelope(result["r"].content)
    error = body["error"]
    assert (result["r"].status_code, error["code"], error["outcome"], body["invocation_id"]) == (
        503, "JOURNAL_UNAVAILABLE", "not_attempted", None), body
    invocation_id = record_by_key_when_back(broker, relay, key)
    assert (f"No invocation was recorded, unless its write reached the database unconfirmed: then invocation "
            f"{invocation_id} is closed as not attempted once the database answers") in error["message"], error
    record = broker.wait_for(invocation_id, lambda r: r["retry"] is not None, timeout=20)
    assert (record["outcome"], record["code"]) == ("not_attempted", "JOURNAL_UNAVAILABLE"), record
    again = post(broker, SAFE + "/h/ok", key)
    assert again.status_code == 200, again.text
    assert upstream.effects == 2, "the warm-up, and this key's operation once: by the repeat"


def test_a_reconciliation_the_database_took_unacknowledged_is_answered_as_maybe_recorded(relayed_pg, make_broker, upstream):
    """An operator's finding reaches the database, its acknowledgement never returns: the side API
    answered a bare 500 (with a traceback in the log, which said "not recorded") while the finding
    was in the record. It answers 503: not confirmed, may be recorded, look before deciding again."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    with broker.client() as client:
        done = client.post(CRASH + "/h/ok", content=b"{}")
    invocation_id = done.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    marker = f"ack-lost-{secrets.token_hex(4)}"
    seen = len(broker.logs())
    relay.deafen_after(b'"RECONCILED"')  # the write's batch document names the event's kind (its note is encoded)
    with broker.operator() as api:
        answer = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"outcome": "committed", "note": marker},
                          timeout=30)
    relay.restore()
    problem = answer.json()
    assert (answer.status_code, problem["title"], answer.headers.get("retry-after")) == (
        503, "Journal unavailable", "1"), answer.text
    assert "did not confirm RECONCILED" in problem["detail"] and "may have recorded it" in problem["detail"], problem
    assert f"affidavit invocations show {invocation_id}" in problem["detail"], problem
    record = broker.wait_for(invocation_id, lambda r: any(e["kind"] == "RECONCILED" for e in r["events"]), timeout=15)
    assert [e["data"]["note"] for e in record["events"] if e["kind"] == "RECONCILED"] == [marker], record
    logs = broker.logs()[seen:]
    assert "Traceback" not in logs and "not confirmed (the database may have recorded them)" in logs, logs[-3000:]


def test_a_write_that_never_reached_the_database_is_answered_as_unrecorded(relayed_pg, make_broker, upstream):
    """Nothing listens where the database was: the broker knows its writes went nowhere, so the
    answer says plainly that no invocation was recorded (no "unless it landed")."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    relay.cut()
    for _ in range(2):  # the first may meet the pooled connection the cut reset, on its way
        with broker.client() as client:
            response = client.post(CRASH + "/h/ok", content=b"{}")
    body = check_envelope(response.content)
    assert (response.status_code, body["error"]["code"], body["invocation_id"]) == (503, "JOURNAL_UNAVAILABLE", None), body
    assert "No invocation was recorded. Retry after a delay" in body["error"]["message"], body
    assert upstream.effects == 0


def test_a_keyed_record_refused_at_the_dispatch_write_is_closed_when_the_journal_returns(relayed_pg, make_broker, upstream):
    url, relay = relayed_pg
    broker, response, body = _refused_at_the_dispatch_write(make_broker, upstream, url, relay.cut)
    key = response.request.headers["Idempotency-Key"]
    assert body["invocation_id"] == record_by_key_when_back(broker, relay, key), "the bound key's record is named"
    assert response.headers["affidavit-invocation-id"] == body["invocation_id"]
    record = broker.wait_for(body["invocation_id"], lambda r: r["retry"] is not None, timeout=20)
    assert (record["outcome"], record["code"], record["retry"]) == ("not_attempted", "JOURNAL_UNAVAILABLE", "backoff"), record
    assert record["caller_disposition"] != "waiting", record
    assert upstream.effects == 0, "nothing is forwarded without a durable DISPATCH_STARTED"


@pytest.mark.parametrize("ended_by", ["the horizon, nobody waiting", "a reset, the caller answered"])
def test_an_end_the_journal_refused_is_recorded_once_it_is_back(relayed_pg, make_broker, upstream, ended_by):
    """The write that ends a dispatched exchange fails in a short outage: after result_horizon with
    no answer (nobody waits; it used to be tried once and logged), or after the upstream reset (the
    caller got its 502; it used to be dropped in silence). While this broker beats no other closes
    its records, so without a retry the record said in flight, and a keyed repeat
    IDEMPOTENCY_IN_PROGRESS, until a restart. It is written once the journal is back."""
    url, relay = relayed_pg
    horizon = ended_by.startswith("the horizon")
    timeouts = {"response_timeout": "1s", "result_horizon": "3s"} if horizon else {}
    routes = [{**route, **timeouts} for route in crash_routes(upstream)]
    broker = make_broker(routes=routes, db_url=url, env={} if horizon else {"AFFIDAVIT_FAILPOINTS": "after_request_sent=pause:2@1"})
    key = f"end-{time.monotonic_ns()}"
    answer: dict[str, httpx.Response] = {}
    target = SAFE + ("/h/hang" if horizon else "/h/close_after_effect?rst=1")
    thread = threading.Thread(target=lambda: answer.setdefault("r", post(broker, target, key)))
    thread.start()
    invocation_id = record_by_key_when(broker, key)
    broker.wait_for(invocation_id, lambda r: r["stage"] in ("dispatched", "sent"), timeout=5)
    time.sleep(1.5 if horizon else 0.5)  # the end is written at the 3 s horizon, or after the 2 s pause
    relay.cut()
    thread.join(20)
    time.sleep(2.5)  # past the end's write, which fails
    relay.restore()
    if horizon:
        assert answer["r"].status_code == 504 and answer["r"].headers["affidavit-outcome"] == "unknown", answer["r"].text
    else:
        assert answer["r"].status_code == 502 and answer["r"].headers["affidavit-outcome"] == "unknown", answer["r"].text
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown", timeout=20)
    assert (record["outcome"], record["code"], record["retry"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN", "same_idempotency_key"), record
    assert "could not record the end" not in broker.logs()
    assert [e["kind"] for e in record["events"]].count("FAILED") == 1, record["events"]


def test_a_caller_that_left_during_a_failed_dispatch_write_still_gets_its_record_closed(relayed_pg, make_broker, upstream):
    """The agent hangs up while DISPATCH_STARTED's commit is in flight, and the journal then fails
    that commit (it landed, unacknowledged). Nobody is waiting for an answer, but the record must
    still end, as what the broker knows (unknown: it sent nothing, the record cannot prove it), and
    the key must not stay "in progress" for as long as the broker runs."""
    url, relay = relayed_pg
    # A horizon beyond the journal's 5 s timeout: the failed commit, not the horizon, ends the exchange.
    routes = [{**route, "result_horizon": "30s"} for route in crash_routes(upstream)]
    broker = make_broker(routes=routes, db_url=url, env={"AFFIDAVIT_FAILPOINTS": "during_tls=pause:1.5@1"})
    key = f"gone-{time.monotonic_ns()}"
    outcome: dict[str, Any] = {}

    def leave_during_the_commit() -> None:
        try:
            post(broker, SAFE + "/h/ok", key, timeout=3.0)  # gives up while the commit hangs (1.5-6.5 s)
        except httpx.TimeoutException as exc:
            outcome["left"] = exc

    thread = threading.Thread(target=leave_during_the_commit)
    thread.start()
    time.sleep(0.7)  # PREFLIGHT_VALIDATED is durable (keyed); the broker pauses before DISPATCH_STARTED
    relay.deafen()
    thread.join(20)
    assert "left" in outcome, "the caller gave up before the journal did"
    time.sleep(5.0)  # the journal's timeout runs out on the DISPATCH_STARTED commit
    invocation_id = record_by_key_when_back(broker, relay, key)
    record = broker.wait_for(invocation_id, lambda r: r["retry"] is not None, timeout=20)
    assert (record["outcome"], record["code"], record["retry"]) == ("unknown", "REMOTE_OUTCOME_UNKNOWN", "same_idempotency_key"), record
    assert record["caller_disposition"] == "disconnected", record
    assert "did not confirm it, so this broker sent nothing" in record["events"][-1]["data"]["basis"], record["events"][-1]
    assert "IllegalTransition" not in broker.logs() and "never retrieved" not in broker.logs(), broker.logs()[-3000:]
    again = post(broker, SAFE + "/h/ok", key)
    assert again.status_code == 200 and again.headers["affidavit-invocation-id"] == invocation_id, again.text
    assert len([r for r in upstream.received if r.method]) == 1, "sent once: by the same-key re-send, never before"


def _vaulted_broker(make_broker, upstream, url: str, tmp_path, failpoints: str, **sections: Any) -> BrokerProcess:
    """A broker on ``url`` whose keyed route injects a vault secret, paused at ``failpoints``."""
    from proxy.crypto import generate_key

    key_file = tmp_path / "k1.key"
    key_file.write_text(generate_key())
    route = {**crash_routes(upstream)[1], "credential": "vaulted", "inject": {"header": "Authorization", "value": "Bearer {secret}"}}
    broker = make_broker(routes=[route], db_url=url, start=False, crypto={"keys": [f"k1=file:{key_file}"]},
                         env={"AFFIDAVIT_FAILPOINTS": failpoints}, **sections)
    broker.config["secrets"].append({"name": "vaulted", "from": "vault:vaulted"})
    broker.config_path.write_text(__import__("tomli_w").dumps(broker.config))
    assert broker.command("db", "upgrade").returncode == 0
    assert broker.command("secrets", "set", "vaulted", input=b"vaulted-secret-value").returncode == 0
    return broker.start()


def _vault_read_in_an_outage(broker: BrokerProcess, relay: TcpRelay, url: str, key: str) -> tuple[httpx.Response, dict]:
    """Send ``url`` with ``key``; cut the database while the broker pauses before reading the vault."""
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", post(broker, url, key)))
    thread.start()
    time.sleep(0.7)  # the broker pauses before it reads the vault
    relay.cut()
    thread.join(20)
    body = check_envelope(result["r"].content)
    assert (result["r"].status_code, body["error"]["code"]) == (503, "JOURNAL_UNAVAILABLE"), body
    assert result["r"].headers["affidavit-invocation-id"] == body["invocation_id"]
    return result["r"], body


def test_a_vault_read_that_fails_before_dispatch_says_not_attempted_and_closes_the_record(relayed_pg, make_broker, upstream, tmp_path):
    """The database goes away between the key's binding and the vault read of the secret: nothing
    was sent, so the agent is told so (not a 500 that cannot vouch for anything), and the record,
    bound to its key, is closed once the database is back rather than left "in progress"."""
    url, relay = relayed_pg
    broker = _vaulted_broker(make_broker, upstream, url, tmp_path, "before_credential=pause:1.5@1")
    key = f"vault-{time.monotonic_ns()}"
    response, body = _vault_read_in_an_outage(broker, relay, SAFE + "/h/ok", key)
    assert body["error"]["outcome"] == "not_attempted", body
    invocation_id = record_by_key_when_back(broker, relay, key)
    assert invocation_id == body["invocation_id"]
    record = broker.wait_for(invocation_id, lambda r: r["retry"] is not None, timeout=20)
    assert (record["outcome"], record["code"], record["retry"]) == ("not_attempted", "JOURNAL_UNAVAILABLE", "backoff"), record
    assert [r for r in upstream.received if r.method] == [], "nothing was sent"
    again = post(broker, SAFE + "/h/ok", key)
    assert again.status_code == 200, again.text
    assert upstream.received[-1].header("Authorization") == "Bearer vaulted-secret-value"


def test_a_resend_whose_vault_read_fails_says_so_and_keeps_the_earlier_unknown(relayed_pg, make_broker, upstream, tmp_path):
    """The same outage, on the re-send of an invocation whose first attempt ended unknown: this
    attempt sent nothing, and the answer says so (the invocation as a whole stays unknown, as its
    first attempt left it), not a 500; once the database is back, the failed re-send's lease is
    given up and the key's next repeat re-sends."""
    url, relay = relayed_pg
    broker = _vaulted_broker(make_broker, upstream, url, tmp_path, "after_lease=pause:1.5@1")
    key = f"vault-{time.monotonic_ns()}"
    lost = post(broker, SAFE + "/h/idem_honour?code=201&lose=1", key)
    assert check_envelope(lost.content)["error"]["retry"] == "same_idempotency_key", lost.text
    response, body = _vault_read_in_an_outage(broker, relay, SAFE + "/h/idem_honour?code=201&lose=1", key)
    assert body["invocation_id"] == lost.headers["affidavit-invocation-id"]
    relay.restore()
    assert len([r for r in upstream.received if r.method]) == 1, "the re-send was not sent"
    # Once the database answers, the failed re-send's lease is given up: no waiting out its 30 s.
    deadline = time.monotonic() + 10
    while (again := post(broker, SAFE + "/h/idem_honour?code=201&lose=1", key)).status_code == 409 \
            and time.monotonic() < deadline:
        assert check_envelope(again.content)["error"]["code"] == "IDEMPOTENCY_IN_PROGRESS", again.text
        time.sleep(0.5)
    assert again.status_code == 201, again.text
    assert upstream.effects_by_key[key] == 1


def test_a_held_request_outlasts_a_moment_of_database_outage(relayed_pg, make_broker, upstream):
    """A request waits for an operator's approval and polls the database for the decision; the
    database goes away for a moment. The card stays held (the poll looks again), and the approval
    given once the database is back sends the request, once."""
    url, relay = relayed_pg
    route = {**crash_routes(upstream)[1], "approval": True, "approval_timeout": "30s"}
    broker = make_broker(routes=[route], db_url=url)
    key = f"held-{time.monotonic_ns()}"
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", post(broker, SAFE + "/h/ok", key, timeout=40)))
    thread.start()
    deadline = time.monotonic() + 10
    cards: list = []
    while not cards and time.monotonic() < deadline:
        with broker.operator() as api:
            cards = api.get("/v1/approvals").json()["items"]
        time.sleep(0.1)
    assert cards, "the request was held"
    relay.cut()
    time.sleep(1.5)  # several polls fail
    relay.restore()
    approved = broker.command("approvals", "approve", cards[0]["invocation_id"])
    assert approved.returncode == 0, approved.stderr
    thread.join(30)
    assert result["r"].status_code == 200, result["r"].text
    assert len([r for r in upstream.received if r.method]) == 1


def test_a_delivery_recorded_while_the_database_is_away_is_written_once_it_is_back(relayed_pg, make_broker, upstream):
    """The result is durable and the agent is reading it when the database goes away: the fact
    that it was delivered cannot be written then, and no later write of the invocation would carry
    it. It is sent again until it lands, so the record says delivered, not 'wait' until a
    restart's recovery decides the caller left."""
    url, relay = relayed_pg
    broker = make_broker(db_url=url)
    size = 8 * 1024 * 1024  # more than socket buffers hold: delivery ends when the agent has read it
    # Cut once the head is in: the result is durable (its head left after that commit), the
    # delivery is not yet.
    invocation_id, read = big_answer_over_http1(broker, size, read_all=True, after_head=relay.cut)
    assert read == size
    time.sleep(1.5)  # the delivery's write fails in the outage
    relay.restore()
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered", timeout=20)
    assert record["caller_disposition"] == "completed", record


def test_a_read_only_database_fails_closed(make_broker, upstream, pg_admin_url):
    url, drop = fresh_database(pg_admin_url)
    try:
        broker = _start_on(make_broker, upstream, url)
        database = url.rsplit("/", 1)[1]
        terminate = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        query(pg_admin_url, f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        query(pg_admin_url, terminate)
        with broker.client() as client:
            refused = client.post(CRASH + "/h/ok", content=b"{}")
            assert refused.status_code == 503
            assert check_envelope(refused.content)["error"]["code"] == "JOURNAL_UNAVAILABLE"
            # Reads still work, so only the failed writes say it: the last batch, then the next
            # heartbeat. Until then a load balancer would keep sending requests to be refused.
            assert _ready_within(broker, 10, want=503) == {"status": "unavailable", "journal": "unwritable"}
            query(pg_admin_url, f"ALTER DATABASE {database} SET default_transaction_read_only = off")
            query(pg_admin_url, terminate)
            # The heartbeat, not traffic (a balancer sends none to an unready broker), proves it back.
            assert _ready_within(broker, 15, want=200)["status"] == "ready"
            again = client.post(CRASH + "/h/ok", content=b"{}")
        assert again.status_code == 200, again.text
        assert upstream.effects == 1
        broker.stop()
    finally:
        drop()


def _ready_within(broker, seconds: float, want: int) -> dict:
    """``/readyz``'s answer once its status is ``want`` (fails after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while (answer := httpx.get(broker.api_url + "/readyz", timeout=10)).status_code != want:
        assert time.monotonic() < deadline, f"/readyz still {answer.status_code} {answer.text} after {seconds} s"
        time.sleep(0.2)
    return answer.json()


def _alter(url: str, statement: str) -> None:
    """DDL on a broker's database, from outside the broker."""
    if url.startswith("sqlite"):
        with sqlite3.connect(make_url(url).database or "", timeout=10) as conn:
            conn.execute(statement)
    else:
        query(url, statement)


def _damage_the_invocations_table(broker: BrokerProcess) -> None:
    """Overwrite the first page of a stopped SQLite broker's ``invocations`` table (a bad disk, a
    bad copy): SQLite answers "database disk image is malformed" when it is read or written."""
    path = make_url(broker.database_url).database
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        [root] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'invocations'").fetchone()
    with open(path, "r+b") as journal:  # the invocations table's first page, overwritten
        journal.seek((root - 1) * page_size)
        journal.write(b"\xa5" * page_size)


def test_a_damaged_sqlite_journal_is_named_as_such_by_the_side_api(make_broker, upstream):
    """A journal file whose pages were damaged (a bad disk, a bad copy): the side API said "a bug,
    or a schema this version does not expect", and logged a traceback. It names the damage, and
    the log says what to do."""
    broker = make_broker("sqlite", routes=crash_routes(upstream))
    first = post(broker, SAFE + "/h/ok", f"damage-{time.monotonic_ns()}")
    assert first.status_code == 200
    invocation_id = first.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    broker.stop()
    _damage_the_invocations_table(broker)
    broker.start()
    seen = len(broker.logs())
    with broker.operator() as api:
        answer = api.get(f"/v1/invocations/{invocation_id}")
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/problem+json", answer.text
    assert "The journal's storage is damaged" in answer.json()["detail"], answer.text
    logs = broker.logs()[seen:]
    assert "the journal's storage is damaged" in logs and "restore the journal from a backup" in logs and "Traceback" not in logs, logs


DAMAGED_LINE = "nothing more is recorded in it until the broker restarts"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_journal_whose_storage_is_damaged_is_not_ready_and_takes_no_more_writes(make_broker, upstream, dialect):
    """A write that finds the journal's storage damaged: /readyz said "ready" (the heartbeat, on
    another table, still worked) while every request was refused, and the broker went on writing
    into the damaged file. Now it stops writing until a restart, says so once, and is not ready.
    SQLite: a page of the file overwritten; PostgreSQL: the server's own data-corruption error
    (XX001), raised by a trigger on the table the damage is in."""
    broker = make_broker(dialect, routes=crash_routes(upstream))

    def send() -> httpx.Response:
        with broker.client(timeout=15) as client:
            return client.post(CRASH + "/h/ok", content=b"{}")

    first = send()
    assert first.status_code == 200
    key = f"kept-{time.monotonic_ns()}"
    kept = post(broker, SAFE + "/h/ok", key)
    assert kept.status_code == 200  # a result a repeat would replay
    for answered in (first, kept):  # their delivery records land after the answers: not into the damage
        broker.wait_for(answered.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
    if dialect == "sqlite":
        broker.stop()
        _damage_the_invocations_table(broker)
        broker.start()
    else:
        query(broker.database_url, "CREATE FUNCTION damaged() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
              "RAISE EXCEPTION 'invalid page in block 7 of relation base/1/2' USING ERRCODE = 'XX001'; END $$")
        query(broker.database_url, "CREATE TRIGGER damaged BEFORE INSERT OR UPDATE ON invocations "
              "FOR EACH ROW EXECUTE FUNCTION damaged()")
    assert _ready_within(broker, 10, 200)["status"] == "ready"
    seen = len(broker.logs())
    refused = send()
    body = check_envelope(refused.content)
    assert refused.status_code == 503, refused.text
    assert (body["error"]["code"], body["error"]["outcome"]) == ("JOURNAL_UNAVAILABLE", "not_attempted"), body
    assert _ready_within(broker, 1, 503) == {"status": "unavailable", "journal": "damaged"}
    if dialect == "postgresql":  # repaired under the broker: it still writes nothing until it restarts
        query(broker.database_url, "DROP TRIGGER damaged ON invocations")
        count = query(broker.database_url, "SELECT count(*) FROM events")
    again = send()
    assert again.status_code == 503 and check_envelope(again.content)["error"]["code"] == "JOURNAL_UNAVAILABLE", again.text
    # Refused before the journal is touched at all: no key lookup, lease or replay read of it.
    repeat = post(broker, SAFE + "/h/ok", key)
    told = check_envelope(repeat.content)["error"]
    assert (repeat.status_code, told["code"]) == (503, "JOURNAL_UNAVAILABLE") and "journal is damaged" in told["message"], told
    assert upstream.effects == 2, "nothing was forwarded after the damage was found"
    logs = broker.logs()[seen:]
    assert logs.count(DAMAGED_LINE) == 1 and "restore the journal from a backup" in logs, logs
    assert "the journal's storage is damaged" in logs and "Traceback" not in logs, logs
    if dialect == "postgresql":
        assert query(broker.database_url, "SELECT count(*) FROM events") == count, "nothing was written after the damage"
        broker.stop()
        broker.start()
        assert _ready_within(broker, 10, 200)["status"] == "ready"
        assert send().status_code == 200
        assert upstream.effects == 3


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_read_the_database_answers_with_an_error_is_not_reported_as_an_outage(make_broker, upstream, dialect):
    """A keyed repeat reads its record before it may send anything. When that read fails because
    the database answered with an error (a column renamed under the broker: a damaged schema, not
    an outage), the agent gets the broker's internal-error 500 saying nothing was sent, not 503
    JOURNAL_UNAVAILABLE ("retry after a delay" would not help); the side API a 500 problem."""
    broker = make_broker(dialect, routes=crash_routes(upstream))
    key = f"schema-{time.monotonic_ns()}"
    first = post(broker, SAFE + "/h/ok", key)
    assert first.status_code == 200
    invocation_id = first.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    _alter(broker.database_url, "ALTER TABLE events RENAME COLUMN payload TO payload_moved")
    try:
        again = post(broker, SAFE + "/h/ok", key)
        body = check_envelope(again.content)
        assert (again.status_code, body["invocation_id"], body["error"]["code"], body["error"]["outcome"],
                body["error"]["retry"]) == (500, None, "REMOTE_OUTCOME_UNKNOWN", "unknown", "reconcile"), again.text
        assert "so it sent nothing" in body["error"]["message"] and "affidavit-code" not in again.headers
        with broker.operator() as api:
            answer = api.get(f"/v1/invocations/{invocation_id}")
        assert answer.status_code == 500 and answer.headers["content-type"] == "application/problem+json", answer.text
        assert "not an outage" in answer.json()["detail"]
    finally:
        _alter(broker.database_url, "ALTER TABLE events RENAME COLUMN payload_moved TO payload")
    replayed = post(broker, SAFE + "/h/ok", key)
    assert replayed.status_code == 200 and replayed.headers["affidavit-invocation-id"] == invocation_id
    assert upstream.effects == 1, "nothing was sent again"
    assert "answered 500, nothing sent" in broker.logs()


def test_a_complete_answer_still_being_recorded_when_the_response_timeout_ends_is_not_called_missing(make_broker, upstream):
    """The response timeout ran out after the upstream's complete answer was in hand but before
    its first event was appended (a large body's redaction runs in a thread there; a failpoint
    pause stands in for it): the caller got 504 "No complete response arrived within the response
    timeout", and the lookup built on it "no complete answer came back". The timeout is the
    upstream's: a complete answer whose record is on its way is waited for, then delivered."""
    routes = crash_routes(upstream)
    routes[0].update(response_timeout="1s")
    broker = make_broker("sqlite", routes=routes, env={"AFFIDAVIT_FAILPOINTS": "after_response_complete=pause:1.5@1"})
    with broker.client(timeout=15) as client:
        answer = client.post(CRASH + "/h/status?code=201", content=b"{}")
    assert answer.status_code == 201 and "affidavit-code" not in answer.headers, answer.text
    record = broker.wait_for(answer.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
    assert record["outcome"] == "committed" and "CALLER_CANCELLED" not in [e["kind"] for e in record["events"]]
    assert upstream.effects == 1


@pytest.mark.parametrize("outage", [0.0, 3.5])
def test_a_result_that_cannot_be_stored_is_delivered_flagged_and_recorded_later(relayed_pg, make_broker, upstream, outage):
    """``outage`` 3.5 s: the journal stays away longer than [upstream] result_horizon (2 s here);
    the broker keeps the answer and records it when the journal returns, rather than leave the
    record in flight for as long as it runs."""
    url, relay = relayed_pg
    broker = make_broker(routes=crash_routes(upstream), db_url=url, env={"AFFIDAVIT_FAILPOINTS": "after_dispatch_commit=pause:1@1"},
                         **{"upstream": {"result_horizon": "2s"}})
    result: dict[str, httpx.Response] = {}

    def call() -> None:
        with broker.client() as client:
            result["r"] = client.post(CRASH + "/h/status?code=201", content=b"{}")

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # DISPATCH_STARTED is durable; the broker is paused before the first byte
    relay.cut()
    thread.join(15)
    response = result["r"]
    assert response.status_code == 201, "the complete, authentic result reaches the caller"
    assert response.headers["affidavit-code"] == "RESULT_STORE_FAILED"
    assert response.headers["affidavit-outcome"] == "committed"
    invocation_id = response.headers["affidavit-invocation-id"]
    assert upstream.effects == 1
    time.sleep(outage)
    relay.restore()
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered", timeout=20)
    assert record["outcome"] == "committed"
    assert record["events"][-1]["data"].get("recorded_after_delivery") is True
    assert len([r for r in upstream.received if r.method]) == 1, "never a re-send"
    assert "operator attention" in broker.logs()


def test_a_result_that_landed_unacknowledged_and_the_writes_after_it_are_all_recorded_in_order(relayed_pg, make_broker, upstream):
    """The result's commit reaches the database but its acknowledgement does not, and the caller
    hangs up meanwhile: when the journal answers again the broker sends every write it was not
    told was durable, in order (the one that had landed counts as done), so the record has every
    event, without a gap that `audit verify` would call a deletion."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url, env={"AFFIDAVIT_FAILPOINTS": "after_response_complete=pause:1@1"})
    key = f"ra-{time.monotonic_ns()}"
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            with broker.client(timeout=1.8) as client:
                client.post(CRASH + "/h/status?code=201", content=b"{}", headers={"Idempotency-Key": key})
        except httpx.HTTPError as exc:  # the caller gives up while the result's commit hangs
            outcome["gave_up"] = type(exc).__name__

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.6)  # the upstream has answered; the broker pauses before recording the result
    relay.deafen()  # the result's commit will land, its acknowledgement will not
    thread.join(20)
    assert outcome.get("gave_up"), outcome
    time.sleep(6)  # the journal's timeout fails the result's write, and everything after it
    relay.restore()
    invocation_id = record_by_key(broker, key)
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivery_failed", timeout=30)
    seqs = [e["seq"] for e in record["events"]]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("RESULT_COMMITTED") == 1 and kinds.count("CALLER_CANCELLED") == 1, kinds
    assert (record["outcome"], record["caller_disposition"]) == ("committed", "disconnected"), record
    with broker.api() as api:
        assert api.get(f"/v1/invocations/{invocation_id}/result").status_code == 201
    verified = broker.command("audit", "verify")
    assert verified.returncode == 0 and b"intact" in verified.stdout + verified.stderr, verified.stdout + verified.stderr
    assert upstream.effects == 1


def _load(broker: BrokerProcess, seconds: float, threads: int, tag: str) -> list[tuple[int, httpx.Response | None]]:
    """Requests from `threads` clients for `seconds`, each with a unique marker the upstream logs."""
    answers: list[tuple[int, httpx.Response | None]] = []
    lock = threading.Lock()
    counter = iter(range(1_000_000))
    deadline = time.monotonic() + seconds

    def worker() -> None:
        with broker.client(timeout=10) as client:
            for i in iter(lambda: next(counter) if time.monotonic() < deadline else None, None):
                try:
                    r = client.post(f"{CRASH}/h/status?code=200&n={tag}{i}", content=b"{}")
                except httpx.HTTPError:
                    r = None
                with lock:
                    answers.append((i, r))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(worker)
    return answers


def _no_request_without_its_record(broker: BrokerProcess, upstream: HostileUpstream, answers: list) -> None:
    received = {r.query["n"] for r in upstream.received if r.method and "n" in r.query}
    dispatched = {
        row[0].rsplit("n=", 1)[1]
        for row in query(broker.database_url,
                         "SELECT i.target FROM invocations i JOIN events e ON e.invocation_id = i.invocation_id "
                         "WHERE e.kind = 'DISPATCH_STARTED'")
    }
    assert received, "the load reached the upstream"
    assert received <= dispatched, f"requests the upstream received without a record: {sorted(received - dispatched)[:5]}"
    recorded = {row[0] for row in query(broker.database_url, "SELECT invocation_id FROM invocations")}
    told = {r.headers["affidavit-invocation-id"] for _, r in answers if r is not None and "affidavit-invocation-id" in r.headers}
    assert told <= recorded, "an invocation id given to a caller has no record"


def test_cutting_the_database_during_load_loses_nothing(relayed_pg, make_broker, upstream):
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    cutter = threading.Timer(1.0, relay.cut)
    restorer = threading.Timer(2.5, relay.restore)
    cutter.start()
    restorer.start()
    answers = _load(broker, 4.0, 8, "cut")
    cutter.join()
    restorer.join()
    statuses = [r.status_code for _, r in answers if r is not None]
    assert 503 in statuses and 200 in statuses, "the load saw the outage and the recovery"
    _no_request_without_its_record(broker, upstream, answers)


def test_restarting_postgresql_during_load_loses_nothing(make_broker, upstream, tmp_path):
    with ThrowawayCluster() as cluster:
        url = cluster.create_database("affidavit")
        broker = _start_on(make_broker, upstream, url)
        restarter = threading.Timer(1.0, lambda: (cluster.stop("immediate"), time.sleep(1.0), cluster.start()))
        restarter.start()
        answers = _load(broker, 4.0, 8, "restart")
        restarter.join()
        # On a busy machine the cluster may come back after that load ended: go on asking, for a
        # bounded time, until the broker has answered a request that began after the restart.
        for round_ in range(30):
            codes = [r.status_code if r is not None else None for _, r in answers]
            if 200 in codes[max(n for n, code in enumerate(codes) if code != 200 or n == 0):]:
                break
            answers += _load(broker, 1.0, 2, f"again{round_}-")
        statuses = [r.status_code if r is not None else None for _, r in answers]
        failed = [n for n, status in enumerate(statuses) if status != 200]
        assert failed, "the restart hit requests in flight (503 JOURNAL_UNAVAILABLE or a cut connection)"
        assert all(status in (503, None) for status in (statuses[n] for n in failed)), set(statuses)
        assert 200 in statuses[failed[-1]:], "the broker served again once PostgreSQL was back, without a restart"
        _no_request_without_its_record(broker, upstream, answers)
        broker.stop()


# -- several brokers on one journal: recover only the dead ---------------------------------------

FAST_RECOVERY = {"heartbeat": "0.3s", "stale_after": "1.5s", "sweep_every": "0.3s"}


def _post_in_background(broker: BrokerProcess, url: str) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(lambda: broker.client(timeout=15).post(url, content=b"{}"))
    pool.shutdown(wait=False)
    return future


def _record_for(broker: BrokerProcess, marker: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = query(broker.database_url, f"SELECT invocation_id FROM invocations WHERE target LIKE '%n={marker}'")
        if rows:
            return rows[0][0]
        time.sleep(0.05)
    raise AssertionError(f"no record for {marker} within {timeout}s")


def test_a_live_brokers_in_flight_work_is_left_alone_and_a_dead_ones_is_closed(make_broker, upstream):
    a = make_broker("postgresql", routes=crash_routes(upstream), recovery={**FAST_RECOVERY, "instance": "broker-a"})
    b = make_broker(routes=crash_routes(upstream), like=a, recovery={**FAST_RECOVERY, "instance": "broker-b"})
    time.sleep(2.0)  # b has been healthy for longer than stale_after: it now judges other brokers

    # A slow exchange on a live broker: b sweeps every 0.3 s for 3.5 s while it is in flight.
    live = _post_in_background(a, CRASH + "/h/slow?delay=3.5&n=live")
    live_id = _record_for(a, "live")
    assert live.result(timeout=15).status_code == 200
    record = a.wait_for(live_id, lambda r: r["stage"] == "delivered")
    assert record["outcome"] == "committed"
    assert [e for e in record["events"] if e["kind"] == "FAILED"] == [], "a live broker's work was recovered"
    assert "left in flight" not in b.logs()

    # The same exchange on a broker that dies: b closes it once a's heartbeat is stale.
    dead = _post_in_background(a, CRASH + "/h/slow?delay=3.5&n=dead")
    dead_id = _record_for(a, "dead")
    a.wait_for(dead_id, lambda r: r["stage"] in ("dispatched", "sent"), timeout=5)  # sent: 0.25 s on
    a.kill()
    with pytest.raises(httpx.HTTPError):
        dead.result(timeout=15)
    closed = b.wait_for(dead_id, lambda r: r["stage"] == "ended_unknown", timeout=10)
    assert closed["outcome"] == "unknown" and closed["code"] == "REMOTE_OUTCOME_UNKNOWN"
    basis = closed["events"][-1]["data"]["basis"]
    assert basis.startswith("broker broker-a/") and "silent for recovery.stale_after" in basis, basis  # not "restart"
    assert f"invocation {dead_id} was left in flight" in b.logs()
    [ended] = [line for line in b.log_entries()
               if line.get("msg") == "invocation ended" and line.get("invocation_id") == dead_id]
    assert ended["recovered_from"].startswith("broker-a/") and ended["total_ms"] is None, ended
    deadline = time.monotonic() + 10
    while upstream.effects < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.effects == 2, "the upstream applied the dead broker's request: unknown was the truth"
    last_writer = query(b.database_url, f"SELECT writer FROM events WHERE invocation_id = '{dead_id}' ORDER BY seq DESC LIMIT 1")
    assert last_writer[0][0].startswith("broker-b/"), last_writer


@pytest.mark.parametrize("dialect", DIALECTS)
def test_an_operator_sees_whether_the_broker_holding_a_record_still_beats(make_broker, upstream, dialect):
    """A record in flight says ``waiting`` until a broker closes it; when its broker is gone and
    none runs, nothing will. The operator's view names the holder and how long it has been silent,
    and `invocations show` says what that means; an agent's view does not name brokers."""
    broker = make_broker(dialect, routes=crash_routes(upstream), recovery=FAST_RECOVERY)
    slow = _post_in_background(broker, CRASH + "/h/slow?delay=3.5&n=held-by")
    invocation_id = _record_for(broker, "held-by")
    broker.wait_for(invocation_id, lambda r: r["stage"] in ("dispatched", "sent"), timeout=5)
    assert "owner" not in broker.invocation(invocation_id), "an agent's view names no broker"
    holder = broker.invocation(invocation_id, broker.operator_token)["owner"]
    [(owner,)] = query(broker.database_url, f"SELECT owner FROM invocations WHERE invocation_id = '{invocation_id}'")
    assert holder["broker"] == owner and holder["stale"] is False and 0 <= holder["silent_s"] < 1.5, holder

    broker.kill()
    with pytest.raises(httpx.HTTPError):
        slow.result(timeout=15)
    time.sleep(2.0)  # past stale_after (1.5 s), and no broker runs to close the record
    shown = broker.command("invocations", "show", invocation_id)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["stage"] in ("dispatched", "sent") and view["caller_disposition"] == "waiting", view
    assert view["owner"]["broker"] == owner and view["owner"]["stale"] is True and view["owner"]["silent_s"] >= 1.5, view
    hint = shown.stderr.decode()
    assert f"the broker that holds this record, {owner}, last beat" in hint and "If no broker runs, start one" in hint, hint

    later = make_broker(routes=crash_routes(upstream), like=broker, recovery=FAST_RECOVERY)
    later.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown", timeout=15)
    assert "owner" not in later.invocation(invocation_id, later.operator_token), "an ended record has no holder"
    done = later.command("invocations", "show", invocation_id)
    assert done.returncode == 0 and "owner" not in json.loads(done.stdout) and done.stderr == b"", done.stderr


@contextlib.contextmanager
def _b_behind_a_relay(make_broker, upstream, pg_admin_url) -> Iterator[tuple[BrokerProcess, BrokerProcess, TcpRelay]]:
    """Brokers a (straight to a fresh PostgreSQL database) and b (through a relay the test cuts),
    with fast recovery; a has been healthy long enough to judge b once b goes silent."""
    from tests.support.pg import fresh_database

    url, drop = fresh_database(pg_admin_url)
    server = make_url(url)
    try:
        with TcpRelay(server.host or "127.0.0.1", server.port or 5432) as relay:
            relayed = server.set(host="127.0.0.1", port=relay.listen_port).render_as_string(hide_password=False)
            routes = [{**route, "result_horizon": "30s"} for route in crash_routes(upstream)]  # b waits for its answer
            a = make_broker(routes=routes, db_url=url, recovery={**FAST_RECOVERY, "instance": "broker-a"})
            b = make_broker(routes=routes, like=a, db_url=relayed, recovery={**FAST_RECOVERY, "instance": "broker-b"})
            time.sleep(2.0)
            try:
                yield a, b, relay
            finally:
                a.stop()
                b.stop()
    finally:
        drop()


def _closed_by_a_while_b_is_cut_off(a: BrokerProcess, relay: TcpRelay, marker: str) -> str:
    """Cut b off once its slow exchange's progress (REQUEST_SENT, 0.25 s on) is durable, so that
    no write of it fails in the cut; then wait for a to close the record."""
    invocation_id = _record_for(a, marker)
    a.wait_for(invocation_id, lambda r: r["stage"] == "sent", timeout=5)
    relay.cut()
    closed = a.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown", timeout=10)
    assert closed["retry"] == "same_idempotency_key", closed  # what the record says before b's finding
    return invocation_id


def _reconciled_from_what_b_saw(a: BrokerProcess, b: BrokerProcess, invocation_id: str, upstream, *, handed: bool) -> None:
    """``handed``: whether b's caller got the answer (flagged), which the finding's note says."""
    record = a.wait_for(invocation_id, lambda r: r.get("retry") == "never", timeout=20)
    assert record["outcome"] == "committed", record
    finding = record["events"][-1]
    assert finding["kind"] == "RECONCILED" and finding["data"]["certainty"] == "remote_response", finding
    assert finding["data"]["by"].startswith("broker broker-b/") and "status 200" in finding["data"]["note"], finding
    caller = ("the answer was handed to the caller flagged RESULT_STORE_FAILED" if handed else
              "the caller was no longer waiting (timed_out), so nobody received the answer")
    assert caller in finding["data"]["note"], finding
    assert "this broker appended what it saw instead: reconciled as committed" in b.logs()
    assert len([r for r in upstream.received if r.method]) == 1, "the completed operation was not re-sent"


def test_a_broker_cut_off_while_another_closes_its_record_appends_the_answer_it_saw(make_broker, upstream, pg_admin_url):
    """Broker b is cut off from the database mid-exchange for longer than stale_after, so broker
    a closes b's record as unknown; then the upstream answers b. b cannot write the exchange any
    more, but it appends what it saw (a finding from the remote's response), so the record does
    not invite a re-send of an operation that completed."""
    with _b_behind_a_relay(make_broker, upstream, pg_admin_url) as (a, b, relay):
        key = f"cut-{time.monotonic_ns()}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, b, SAFE + "/h/slow?delay=4&n=cut", key)
            invocation_id = _closed_by_a_while_b_is_cut_off(a, relay, "cut")
            answer = pending.result(timeout=20)
        assert answer.status_code == 200 and answer.headers["affidavit-code"] == "RESULT_STORE_FAILED", answer.text
        relay.restore()
        _reconciled_from_what_b_saw(a, b, invocation_id, upstream, handed=True)
        again = post(a, SAFE + "/h/slow?delay=4&n=cut", key)
        assert (again.status_code, check_envelope(again.content)["error"]["code"]) == (409, "RESULT_UNAVAILABLE"), again.text


def test_a_caller_timed_out_after_another_broker_closed_the_record_gets_the_504_that_names_it(make_broker, upstream, pg_admin_url):
    """The same takeover, but b's caller reaches the response timeout (5 s) after the database is
    back: its CALLER_CANCELLED can no longer be written (a's events hold those numbers). The caller
    still gets the 504 naming its invocation, not a 500 that names nothing."""
    with _b_behind_a_relay(make_broker, upstream, pg_admin_url) as (a, b, relay):
        key = f"late-{time.monotonic_ns()}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, b, SAFE + "/h/slow?delay=7&n=late", key)
            invocation_id = _closed_by_a_while_b_is_cut_off(a, relay, "late")
            relay.restore()
            answer = pending.result(timeout=20)
        body = check_envelope(answer.content)
        assert (answer.status_code, body["invocation_id"], body["error"]["code"], body["error"]["outcome"]) == (
            504, invocation_id, "REMOTE_OUTCOME_UNKNOWN", "unknown"), body
        assert "Traceback" not in b.logs(), b.logs()[-3000:]
        _reconciled_from_what_b_saw(a, b, invocation_id, upstream, handed=False)


def test_a_second_live_broker_under_the_same_instance_name_does_not_take_the_first_ones_work(make_broker, upstream):
    """recovery.instance set to the same name on two running brokers (a copied configuration): the
    second would take the first for an earlier incarnation of itself, dead since it holds the
    port, and close its live records at once. The moving heartbeat shows it is alive: its work is
    left alone, and the second broker says what is wrong."""
    a = make_broker("postgresql", routes=crash_routes(upstream), recovery={**FAST_RECOVERY, "instance": "copied-name"})
    live = _post_in_background(a, CRASH + "/h/slow?delay=3&n=twin")
    live_id = _record_for(a, "twin")
    a.wait_for(live_id, lambda r: r["stage"] == "sent", timeout=5)
    b = make_broker(routes=crash_routes(upstream), like=a, recovery={**FAST_RECOVERY, "instance": "copied-name"})
    assert live.result(timeout=15).status_code == 200
    record = a.wait_for(live_id, lambda r: r["stage"] == "delivered")
    assert record["outcome"] == "committed"
    assert [e for e in record["events"] if e["kind"] == "FAILED"] == [], "the live broker's work was taken over"
    deadline = time.monotonic() + 10  # b judges after its second look at the heartbeats
    while "another running broker uses recovery.instance 'copied-name'" not in b.logs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "another running broker uses recovery.instance 'copied-name'" in b.logs()
    assert "left in flight" not in b.logs()
    # And an earlier incarnation that did stop is still recovered at once (no stale_after wait).
    dead = _post_in_background(b, CRASH + "/h/slow?delay=3&n=gone")
    dead_id = _record_for(b, "gone")
    b.wait_for(dead_id, lambda r: r["stage"] == "sent", timeout=5)
    b.kill()
    with pytest.raises(httpx.HTTPError):
        dead.result(timeout=15)
    b.start()
    closed = b.wait_for(dead_id, lambda r: r["stage"] == "ended_unknown", timeout=5)
    assert closed["code"] == "REMOTE_OUTCOME_UNKNOWN"


def test_a_second_live_broker_under_the_same_instance_name_leaves_the_first_ones_held_request_alone(make_broker, upstream):
    """The same misconfiguration with a request held for approval: a repeat of its key through the
    second broker must not take the hold over as if its holder were a dead earlier incarnation."""
    routes = [{**crash_routes(upstream)[1], "approval": True, "approval_timeout": "20s"}]
    a = make_broker("postgresql", routes=routes, recovery={**FAST_RECOVERY, "instance": "copied-name"})
    key = f"twin-held-{time.monotonic_ns()}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, a, SAFE + "/h/ok", key, 30)
        invocation_id = record_by_key_when(a, key)
        b = make_broker(routes=routes, like=a, recovery={**FAST_RECOVERY, "instance": "copied-name"})
        deadline = time.monotonic() + 10
        while "another running broker uses recovery.instance" not in b.logs() and time.monotonic() < deadline:
            time.sleep(0.1)
        repeat = post(b, SAFE + "/h/ok", key)
        body = check_envelope(repeat.content)
        assert (repeat.status_code, body["error"]["code"], body["invocation_id"]) == (409, "APPROVAL_REQUIRED", invocation_id), body
        assert "waiting for an operator's approval" in body["error"]["message"], body
        assert a.command("approvals", "approve", invocation_id).returncode == 0
        assert held.result(timeout=30).status_code == 200
    assert len([r for r in upstream.received if r.method]) == 1


def test_a_broker_with_no_heartbeat_yet_keeps_its_fresh_records(make_broker, upstream):
    """A broker that has not written a heartbeat (its first one failed, or it is starting) is not
    taken for dead while its records are fresh: a sibling closed them at once, and the caller of
    a request the upstream answered got RESULT_STORE_FAILED while the record said unknown."""
    patient = {**FAST_RECOVERY, "stale_after": "3s"}  # ample next to the 0.6 s exchange, on a loaded machine
    b = make_broker("postgresql", routes=crash_routes(upstream), recovery={**patient, "instance": "broker-b"})
    a = make_broker(routes=crash_routes(upstream), like=b, recovery={**patient, "instance": "broker-a"},
                    env={"AFFIDAVIT_FAILPOINTS": "heartbeat=raise"})
    time.sleep(3.5)  # b has been healthy for longer than stale_after: it now judges other brokers
    assert query(b.database_url, "SELECT count(*) FROM brokers WHERE instance = 'broker-a'") == [('0',)]
    assert query(b.database_url, "SELECT count(*) FROM brokers WHERE instance = 'broker-b'") == [('1',)]

    # b sweeps every 0.3 s while the exchange is in flight, well within stale_after (3 s).
    fresh = _post_in_background(a, CRASH + "/h/slow?delay=0.6&n=fresh")
    fresh_id = _record_for(a, "fresh")
    answer = fresh.result(timeout=15)
    assert answer.status_code == 200 and "affidavit-code" not in answer.headers, answer.headers
    record = a.wait_for(fresh_id, lambda r: r["stage"] == "delivered")
    assert record["outcome"] == "committed"
    assert [e for e in record["events"] if e["kind"] == "FAILED"] == [], record["events"]
    assert "left in flight" not in b.logs()


def test_a_first_attempt_fenced_after_a_takeover_says_not_attempted(make_broker, upstream):
    """A broker that stalls before dispatch, silent, is taken over; when it goes on, its
    DISPATCH_STARTED is fenced. Nothing was ever dispatched, so its answer says not_attempted,
    as the record does, not unknown (its own refused write is no evidence)."""
    b = make_broker("postgresql", routes=crash_routes(upstream), recovery={**FAST_RECOVERY, "instance": "broker-b"})
    a = make_broker(routes=crash_routes(upstream), like=b, recovery={**FAST_RECOVERY, "instance": "broker-a"},
                    env={"AFFIDAVIT_FAILPOINTS": "heartbeat=raise;before_credential=pause:4@1"})
    time.sleep(2.0)  # b has been healthy for longer than stale_after: it now judges other brokers
    with a.client(timeout=15) as client:
        lost = client.post(CRASH + "/h/status?code=201&n=stalled", content=b"{}", headers={"Idempotency-Key": "k_" + secrets.token_hex(6)})
    assert lost.status_code == 409, lost.text
    error = check_envelope(lost.content)["error"]
    assert (error["code"], error["outcome"]) == ("LEASE_LOST", "not_attempted"), error
    assert lost.headers["affidavit-outcome"] == "not_attempted"
    record = b.invocation(lost.headers["affidavit-invocation-id"])
    assert (record["outcome"], record["code"]) == ("not_attempted", "BROKER_RESTARTED"), record
    assert not [r for r in upstream.received if "n=stalled" in r.path], "nothing was sent"


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


BEHAVIOURS = ["/h/status?code=200", "/h/status?code=500", "/h/short_body", "/h/close_after_effect",
              "/h/status?code=429&retry_after=1", "/h/chunked_truncated", "/h/ok"]


def test_soak_mixed_hostile_traffic(make_broker, upstream, report):
    total = int(os.environ.get("AFFIDAVIT_SOAK_REQUESTS", "10000"))
    broker = make_broker("postgresql", routes=crash_routes(upstream))
    assert broker.proc is not None
    answers: list[int] = []
    lock = threading.Lock()
    counter = iter(range(total))
    rss: dict[str, int] = {"start": _rss_kb(broker.proc.pid)}
    began = time.monotonic()

    def worker() -> None:
        with broker.client(timeout=10) as client:
            for i in iter(lambda: next(counter, None), None):
                if i == total // 5:
                    rss["warm"] = _rss_kb(broker.proc.pid)
                try:
                    code = client.post(CRASH + BEHAVIOURS[i % len(BEHAVIOURS)], content=b"{}").status_code
                except httpx.HTTPError:
                    code = 0
                with lock:
                    answers.append(code)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for _ in range(32):
            pool.submit(worker)
    time.sleep(1.0)
    rss["end"] = _rss_kb(broker.proc.pid)
    report(f"soak: {total} requests at concurrency 32 in {time.monotonic() - began:.0f} s; broker RSS at start "
           f"{rss['start']} kB, after {total // 5} requests {rss['warm']} kB, at the end {rss['end']} kB "
           "(AFFIDAVIT_SOAK_REQUESTS sets the count)")
    assert len(answers) == total and 0 not in answers
    in_flight = query(broker.database_url, "SELECT count(*) FROM invocations WHERE stage NOT IN "
                      "('delivered', 'delivery_failed', 'store_failed', 'ended_not_attempted', 'ended_unknown')")
    assert in_flight == [("0",)], "every invocation ended"
    dispatched = int(query(broker.database_url, "SELECT count(*) FROM events WHERE kind = 'DISPATCH_STARTED'")[0][0])
    assert dispatched == len([r for r in upstream.received if r.method]) == total
    assert upstream.effects == total
    by_outcome = dict(query(broker.database_url, "SELECT outcome, count(*) FROM invocations GROUP BY outcome"))
    per_behaviour = total // len(BEHAVIOURS)
    assert int(by_outcome["unknown"]) >= 3 * per_behaviour  # short body, close after effect, truncated chunks
    assert rss["end"] < rss["warm"] * 1.3 + 20_000, rss


def test_a_resend_refused_at_its_dispatch_write_keeps_the_earlier_dispatch_in_its_answer(relayed_pg, make_broker, upstream):
    """A same-key re-send of an invocation whose first attempt was dispatched (outcome unknown)
    meets a journal that refuses its DISPATCH_STARTED. This attempt sent nothing, but the
    invocation was sent before: its answer says unknown, as its record does, never not_attempted
    (which tells an agent the operation never left, and that a new one is safe)."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url, env={"AFFIDAVIT_FAILPOINTS": "during_tls=pause:1.5@2"})
    key = f"rs-{time.monotonic_ns()}"
    first = post(broker, SAFE + "/h/close_after_effect", key)
    lost = check_envelope(first.content)
    assert (lost["error"]["outcome"], lost["error"]["retry"]) == ("unknown", "same_idempotency_key"), lost
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", post(broker, SAFE + "/h/close_after_effect", key)))
    thread.start()
    time.sleep(0.7)  # the re-send holds its lease; the broker pauses before its DISPATCH_STARTED write
    relay.cut()
    thread.join(20)
    second = result["r"]
    body = check_envelope(second.content)
    assert (second.status_code, body["error"]["code"], body["invocation_id"]) == (503, "JOURNAL_UNAVAILABLE", lost["invocation_id"])
    assert (body["error"]["outcome"], second.headers["affidavit-outcome"]) == ("unknown", "unknown"), body
    assert body["evidence"]["dispatch_started"] is True, "of the invocation, as its outcome"
    assert "closed as not attempted" not in body["error"]["message"], body
    assert upstream.effects == 1, "the re-send sent nothing"
    relay.restore()
    record = broker.wait_for(lost["invocation_id"], lambda r: r["retry"] is not None, timeout=20)
    assert record["outcome"] == "unknown", record


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_resend_refused_before_dispatch_keeps_the_earlier_dispatch_in_its_answer(make_broker, upstream, dialect):
    """The same for a re-send refused before dispatch (here its credential has gone): the record
    stays unknown, and so does the answer, which says the earlier dispatch in its evidence too."""
    routes = crash_routes(upstream)
    routes[1] = {**routes[1], "credential": "payments-key", "inject": {"header": "X-Api-Key"}}
    broker = make_broker(dialect, routes=routes)
    key = f"rc-{time.monotonic_ns()}"
    lost = check_envelope(post(broker, SAFE + "/h/close_after_effect", key).content)
    assert lost["error"]["outcome"] == "unknown", lost
    broker.stop()
    broker.env.pop("PAYMENTS_KEY")
    broker.start()
    second = post(broker, SAFE + "/h/close_after_effect", key)
    body = check_envelope(second.content)
    assert (body["error"]["code"], body["invocation_id"]) == ("CREDENTIAL_MISSING", lost["invocation_id"]), body
    assert (body["error"]["outcome"], second.headers["affidavit-outcome"]) == ("unknown", "unknown"), body
    assert body["evidence"]["dispatch_started"] is True
    record = broker.invocation(lost["invocation_id"])
    assert (record["outcome"], record["code"]) == ("unknown", "CREDENTIAL_MISSING"), record
    assert upstream.effects == 1


def test_a_resend_that_cannot_connect_does_not_say_nothing_was_sent(make_broker, upstream):
    """A same-key re-send whose new connection fails (refused here) sent nothing itself, but the
    invocation's first attempt was sent: outcome unknown, and the message must not tell a reader
    (an agent reads it) that nothing was sent and that retrying is safe."""
    with TcpRelay("127.0.0.1", upstream.tls_port("good")) as relay:
        routes = crash_routes(upstream)
        routes[1] = {**routes[1], "connect_to": f"127.0.0.1:{relay.listen_port}"}
        broker = make_broker("sqlite", routes=routes)
        key = f"rr-{time.monotonic_ns()}"
        lost = check_envelope(post(broker, SAFE + "/h/close_after_effect", key).content)
        assert lost["error"]["outcome"] == "unknown", lost
        relay.stop()
        second = post(broker, SAFE + "/h/close_after_effect", key)
    body = check_envelope(second.content)
    assert (body["error"]["code"], body["error"]["outcome"]) == ("CONNECT_REFUSED", "unknown"), body
    assert "Nothing was sent" not in body["error"]["message"] and "is safe" not in body["error"]["message"], body
    assert "earlier attempt" in body["error"]["message"], body
    assert upstream.effects == 1


def test_a_stopping_broker_waits_also_for_requests_that_began_after_it_first_looked(caplog):
    """Broker.close looked once at the requests being handled; one accepted just before the proxy
    stopped listening began after that look, and the stop then logged it as 'still being handled
    after 5 s' a fraction of a second after the signal (found by a probe), without waiting for it."""
    import asyncio
    import logging
    import types

    from proxy.broker import Broker

    async def scenario() -> tuple[bool, float]:
        handling: set[asyncio.Task[None]] = set()
        late_done = asyncio.Event()

        async def late() -> None:
            await asyncio.sleep(0.3)
            late_done.set()

        async def first() -> None:
            await asyncio.sleep(0.1)
            task = asyncio.create_task(late())
            handling.add(task)
            task.add_done_callback(handling.discard)

        task = asyncio.create_task(first())
        handling.add(task)
        task.add_done_callback(handling.discard)
        broker = types.SimpleNamespace(_closing=False, _behind=set(), _handling=handling, _background=set())
        started = time.monotonic()
        await Broker.close(broker)  # type: ignore[arg-type]
        return late_done.is_set(), time.monotonic() - started

    with caplog.at_level(logging.WARNING, logger="affidavit"):
        waited_for_late, took = asyncio.run(scenario())
    assert waited_for_late and took < 2, took
    assert "still being handled" not in caplog.text


def test_a_stalled_journal_refuses_within_its_timeout(relayed_pg, make_broker, upstream):
    """A database that takes connections and never answers (a hung host, a commit waiting for a
    synchronous standby that is gone): each agent gets JOURNAL_UNAVAILABLE within the journal's
    timeout (5 s, docs/operations.md), whatever the request had to read or write first: a keyed
    request looks its key up and binds it before its DISPATCH_STARTED (a small pool: its lookups
    wait for a connection, then for a new one, then for the query), and requests queue behind a
    batch that is already stalled. Before, they waited 11-37 s. Nothing is sent."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url, database={"pool_size": 1})
    assert post(broker, SAFE + "/h/ok", f"warm-{time.monotonic_ns()}").status_code == 200
    relay.blackhole()
    try:
        def timed(i: int) -> tuple[float, httpx.Response]:
            began = time.monotonic()
            if i % 2:
                response = post(broker, SAFE + "/h/ok", f"stall-{i}-{time.monotonic_ns()}", timeout=60)
            else:
                with broker.client(timeout=60) as client:
                    response = client.post(CRASH + "/h/ok", content=b"{}")
            return time.monotonic() - began, response

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(timed, range(12)))
        began = time.monotonic()
        ready = httpx.get(broker.api_url + "/readyz", timeout=30)
        readyz_took = time.monotonic() - began
        began = time.monotonic()
        code = broker.stop(timeout=60)
        stop_took = time.monotonic() - began
    finally:
        relay.restore()
    print(f"readyz {readyz_took:.1f} stop {stop_took:.1f}")
    assert (ready.status_code, ready.json()) == (503, {"status": "unavailable", "journal": "unreachable"})
    assert readyz_took < 4.5, f"/readyz took {readyz_took:.1f} s (docs/api.md: 3 s)"
    assert code == 0 and stop_took < 12, f"a stop with a stalled journal took {stop_took:.1f} s (docs/operations.md: ~10 s)"
    for took, response in answers:
        body = check_envelope(response.content)
        assert (response.status_code, body["error"]["code"]) == (503, "JOURNAL_UNAVAILABLE"), body
        print(f"{took:.1f}")
    # 5 s, plus what 12 agents' TLS handshakes through the broker take on a loaded 2-core CI
    # machine (7.04 s seen once there); the unbounded waits this guards against took 10-37 s.
    assert max(took for took, _ in answers) < 8.5, [(round(t, 1), r.request.headers.get("idempotency-key", "")[:5]) for t, r in answers]
    assert upstream.effects == 1, "only the first request, before the stall, was sent"


def test_a_lookup_whose_answer_cannot_be_recorded_makes_no_finding(relayed_pg, make_broker, upstream):
    """`reconcile --lookup`: the remote answers the lookup completely, but the journal is gone
    before the broker can record that answer (RESULT_STORE_FAILED). No finding may rest on an
    answer the journal does not hold: the operator gets a 409 saying so, the record stays as it
    was, and the lookup's own record is completed once the journal is back."""
    from tests.test_human_control import PAY, control_routes

    url, relay = relayed_pg
    routes = control_routes(upstream)
    routes[0].update(response_timeout="5s", result_horizon="6s")  # not timed out during the pause
    broker = make_broker(routes=routes, db_url=url, env={"AFFIDAVIT_FAILPOINTS": "after_response_complete=pause:1.5@1"})
    key = "pay_" + secrets.token_hex(6)
    with broker.client() as client:
        lost = client.post(PAY + "/h/close_after_effect", content=b"{}", headers={"Idempotency-Key": key})
    invocation_id = check_envelope(lost.content)["invocation_id"]
    before = broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    answer: dict[str, httpx.Response] = {}

    def reconcile() -> None:
        with broker.operator() as api:
            answer["r"] = api.post(f"/v1/invocations/{invocation_id}/reconcile", json={"lookup": True}, timeout=30)

    thread = threading.Thread(target=reconcile)
    thread.start()
    deadline = time.monotonic() + 10
    while "GET" not in [r.method for r in upstream.received]:  # the lookup reached the remote
        assert time.monotonic() < deadline, "the lookup was never sent"
        time.sleep(0.05)
    time.sleep(0.2)  # its answer is complete; the broker pauses 1.5 s before recording it
    relay.cut()
    thread.join(20)
    looked = answer["r"]
    detail = looked.json()["detail"]
    assert looked.status_code == 409, looked.text
    assert "but the broker could not record it (RESULT_STORE_FAILED), so no finding rests on it" in detail, detail
    assert "The record is unchanged" in detail
    lookup_id = re.search(r"The lookup \(invocation (act_\w+)\)", detail).group(1)
    relay.restore()
    after = broker.wait_for(invocation_id, lambda r: True)
    assert after["events"] == before["events"] and after["outcome"] == "unknown", after["events"][-1]
    recorded = broker.wait_for(lookup_id, lambda r: r["stage"] == "delivered", timeout=20)
    assert recorded["outcome"] == "committed" and recorded["method"] == "GET"
    assert [r.method for r in upstream.received if r.method] == ["POST", "GET"], "the lookup was sent once, the payment never again"


def test_a_write_held_up_in_the_network_cannot_land_after_it_was_found_missing(relayed_pg, make_broker, upstream):
    """A request's first write (no key: its dispatch write) is held up in the network past the
    journal's timeout: the agent is told nothing was sent, and the broker looks, once the journal
    answers, whether the write landed after all. It found nothing, took that for proof, and
    stopped looking; the write then landed, and its record said "dispatched, caller waiting" for
    as long as the broker ran (recovery takes only a stopped broker's records), with nothing in
    the log. Now the database session the write was sent on is ended before that look, so the
    look is final: the write cannot land after it."""
    url, relay = relayed_pg
    broker = _start_on(make_broker, upstream, url)
    with broker.client(timeout=20) as client:
        warm = client.post(CRASH + "/h/ok", content=b"{}")  # the writer's connection is open
        assert warm.status_code == 200
        broker.wait_for(warm.headers["affidavit-invocation-id"], lambda r: r["stage"] == "delivered")
        relay.hold_after(b'"DISPATCH_STARTED"', 9.0)
        refused = client.post(CRASH + "/h/ok", content=b"{}")
    body = check_envelope(refused.content)
    assert (refused.status_code, body["error"]["code"], body["error"]["outcome"]) == (503, "JOURNAL_UNAVAILABLE", "not_attempted"), body
    invocation_id = re.search(r"then invocation (act_\w+) is closed", body["error"]["message"]).group(1)
    deadline = time.monotonic() + 9.0 + 4.0  # the held write reaches the database, or its ended session
    while time.monotonic() < deadline:
        assert query(url, f"SELECT stage FROM invocations WHERE invocation_id = '{invocation_id}'") == [], \
            "the held write landed after the broker had found it missing"
        time.sleep(0.5)
    assert upstream.effects == 1, "nothing was sent for the refused request"
    with broker.client(timeout=20) as client:
        assert client.post(CRASH + "/h/ok", content=b"{}").status_code == 200, "the journal works on"


def test_a_repeat_while_a_stopped_brokers_lease_runs_is_told_so_and_takes_the_attempt_after_it(make_broker, upstream):
    """A broker took the lease for a same-key re-send of an unknown outcome and died before that
    attempt's first event: no event shows the lease, and a repeat meanwhile was told the
    invocation "is still in progress" while the record said to retry with the same key. The
    409 now says the invocation ended, who holds the lease, until when, and what then."""
    broker = make_broker("postgresql", routes=crash_routes(upstream), proxy={"retry_lease": "60s"},
                         env={"AFFIDAVIT_FAILPOINTS": "mid_response_headers=kill@1"})
    key = "lease_" + secrets.token_hex(6)
    url = SAFE + "/h/idem_honour?code=201"
    with pytest.raises(httpx.HTTPError):
        post(broker, url, key)
    restart_without_failpoints(broker)
    invocation_id = record_by_key(broker, key)
    broker.wait_for(invocation_id, lambda r: r["stage"] == "ended_unknown")
    broker.kill()
    broker.env["AFFIDAVIT_FAILPOINTS"] = "after_lease=kill@1"
    broker.start()
    with pytest.raises(httpx.HTTPError):
        post(broker, url, key)  # the lease is taken; the broker dies before the attempt's first event
    [(owner,)] = query(broker.database_url, f"SELECT owner FROM invocations WHERE invocation_id = '{invocation_id}'")
    restart_without_failpoints(broker)
    told = post(broker, url, key)
    error = check_envelope(told.content)["error"]
    assert (told.status_code, error["code"]) == (409, "IDEMPOTENCY_IN_PROGRESS"), told.text
    assert f"ended unknown, and a broker process ({owner}) holds a lease on it until " in error["message"], error
    assert "the lease runs out then and a repeat with this key may take the attempt over" in error["message"], error
    # The lease runs out (60 s, so that no restart on a loaded machine outlasts it before the 409).
    query(broker.database_url, f"UPDATE invocations SET lease_expires_at = now() WHERE invocation_id = '{invocation_id}'")
    deadline = time.monotonic() + 15
    while (repeat := post(broker, url, key)).status_code == 409:
        assert time.monotonic() < deadline, repeat.text
        time.sleep(0.5)
    assert repeat.status_code == 201 and repeat.headers["affidavit-outcome"] == "committed", repeat.text
    assert [r.header("Idempotency-Key") for r in upstream.received if r.method] == [key, key], "sent twice in all, never more"


def test_a_result_that_landed_unconfirmed_while_another_broker_closed_the_record_is_logged_as_such(make_broker, upstream, pg_admin_url):
    """b's result commit lands but is never acknowledged, and the database goes deaf to b: b hands
    the answer over flagged RESULT_STORE_FAILED, a takes b for stopped and closes the record after
    the stored result. When b can write again, the delivery it saw no longer fits the record: the
    log said only "conflicting write: duplicate key value violates unique constraint". It now says
    another broker closed the record, and what became of the answer here."""
    with _b_behind_a_relay(make_broker, upstream, pg_admin_url) as (a, b, relay):
        relay.deafen_after(b'"RESULT_COMMITTED"')
        answer = post(b, SAFE + "/h/slow?delay=0.5&n=landed", f"landed-{time.monotonic_ns()}", timeout=30)
        assert answer.status_code == 200 and answer.headers["affidavit-code"] == "RESULT_STORE_FAILED", answer.text
        invocation_id = answer.headers["affidavit-invocation-id"]
        closed = a.wait_for(invocation_id, lambda r: r["stage"] == "delivery_failed", timeout=20)
        assert (closed["outcome"], closed["retry"]) == ("committed", "fetch_result"), closed
        relay.restore()
        deadline = time.monotonic() + 30
        while "but not what became of its delivery" not in b.logs():
            assert time.monotonic() < deadline, b.logs()[-3000:]
            time.sleep(0.2)
        assert (f"recorded the result of {invocation_id} after the journal recovered, but not what became of its "
                "delivery (handed to the caller): another broker closed the record meanwhile") in b.logs(), b.logs()[-3000:]
        assert "duplicate key" not in b.logs() and "Traceback" not in b.logs()
        assert len([r for r in upstream.received if r.method]) == 1, "never re-sent"
