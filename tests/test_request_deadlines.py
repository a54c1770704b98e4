"""Deadlines for a request that arrives slowly (proxy/deadlines.py): a real broker, raw clients on
127.0.0.1 that send a head or a body slowly, over plain HTTP/1.1, inside a CONNECT tunnel with TLS
interception, and over HTTP/2.

These tests also pin the seam in mitmproxy the deadlines rely on (its HTTP/1 readers, the HTTP/2
connection's event handler, and the delivery of a ``Wakeup`` event through ``HttpLayer.
command_sources`` along ``context.layers``): a mitmproxy that changes any of it fails them.

Each refused request comes from a loopback address of its own (127.0.0.N), so that its log line is
not folded into another's by the per-address rate limit.
"""

from __future__ import annotations

import base64
import itertools
import select
import socket
import ssl
import time
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.broker import BrokerProcess, split_response
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream
from tests.support.journal import query

HEAD_DEADLINE = 0.5
BODY_DEADLINE = 0.8
#: The most a refused request may wait for its 408 (the deadline, plus a loaded machine's delay).
BOUND = 10.0
#: How much sooner than its deadline a 408 may come: uvloop's timers count whole milliseconds
#: from the loop's cached time. (Each wait is measured from before the client sent.)
EARLY = 0.01
PLAIN = "plain.example.test"
TLS_HOST = "api.payments.test"

_SOURCES = (f"127.0.0.{n}" for n in itertools.count(20))


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: Any,
           upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    """One broker with short deadlines for the module; once its tests are done, its log must show
    no crash (of mitmproxy's layers, or of the broker) and no expiry it could not deliver."""
    from tests.conftest import module_broker, standard_routes

    for process in module_broker(request, tmp_path_factory, pki, standard_routes(upstream_server), name="deadlines",
                                 dialect="sqlite", proxy={"request_head_timeout": f"{HEAD_DEADLINE}s",
                                                          "request_body_timeout": f"{BODY_DEADLINE}s"}):
        yield process
    logs = process.logs()  # stopped by now
    assert "Traceback" not in logs and "has crashed" not in logs and "cannot time out" not in logs, logs[-3000:]


# -- clients ---------------------------------------------------------------------------------------


def basic(broker: BrokerProcess) -> bytes:
    return b"Basic " + base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())


def plain(broker: BrokerProcess, source: str) -> socket.socket:
    """A raw agent connection to the proxy port from ``source``."""
    return socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=BOUND, source_address=(source, 0))


def tunnel(broker: BrokerProcess, source: str, host: str = TLS_HOST) -> ssl.SSLSocket:
    """A raw agent's CONNECT tunnel to ``host``:443 from ``source``, then TLS trusting the broker's CA."""
    return broker.tunnel(host, source=source, timeout=BOUND)


def connection(broker: BrokerProcess, how: str, source: str) -> tuple[socket.socket, bytes, bytes]:
    """(the socket, the request target, the proxy credentials header line) for ``how``: ``plain``
    (absolute-form through the proxy) or ``tunnel`` (origin-form inside CONNECT and TLS)."""
    if how == "plain":
        return plain(broker, source), f"http://{PLAIN}/h/ok".encode(), b"Proxy-Authorization: " + basic(broker) + b"\r\n"
    return tunnel(broker, source), b"/h/ok", b""


def host_of(how: str) -> bytes:
    return (PLAIN if how == "plain" else TLS_HOST).encode()


def read_to_close(sock: socket.socket, timeout: float = BOUND) -> tuple[bytes, bool]:
    """Everything the broker sends until it closes the connection (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except (ssl.SSLEOFError, ConnectionResetError):
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def read_response(sock: socket.socket, timeout: float = BOUND) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body, the connection left open."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(65536)
        assert chunk, f"the broker closed the connection: {data!r}"
        data += chunk
    status, headers, body = split_response(data)
    while len(body) < int(headers["content-length"]):
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(65536)
        assert chunk, "the broker closed the connection mid-body"
        body += chunk
    return status, headers, body


# -- what the broker says, records and counts --------------------------------------------------------


def timeouts_counted(broker: BrokerProcess) -> dict[str, float]:
    with broker.operator() as api:
        text = api.get("/metrics").text
    family = {f.name: f for f in text_string_to_metric_families(text)}.get("affidavit_request_timeouts")
    assert family is not None, "affidavit_request_timeouts is not exported"
    return {s.labels["part"]: s.value for s in family.samples if s.name == "affidavit_request_timeouts_total"}


def recorded(broker: BrokerProcess) -> tuple[tuple[str, ...], ...]:
    return tuple(query(broker.database_url, "SELECT count(*) FROM invocations")
                 + query(broker.database_url, "SELECT count(*) FROM events"))


def deadline_lines(broker: BrokerProcess, source: str) -> list[dict[str, Any]]:
    return [e for e in broker.log_entries() if e.get("code") == "REQUEST_TIMEOUT" and e.get("client") == source]


def assert_408(data: bytes, part: str) -> dict[str, Any]:
    """The answer to a request whose ``part`` did not arrive in time: 408, an envelope, and a close."""
    status, headers, body = split_response(data)
    assert status == 408, data[:300]
    assert headers["connection"] == "close", headers
    assert headers["content-type"] == "application/problem+json", headers
    assert (headers["affidavit-code"], headers["affidavit-outcome"], headers["x-should-retry"]) == (
        "REQUEST_TIMEOUT", "not_attempted", "true"), headers
    assert "affidavit-invocation-id" not in headers, "nothing was recorded, so no invocation is named"
    assert len(body) == int(headers["content-length"]), "the whole envelope, then the close"
    envelope = check_envelope(body)
    assert envelope["invocation_id"] is None
    error = envelope["error"]
    assert (error["code"], error["phase"], error["outcome"], error["retry"]) == (
        "REQUEST_TIMEOUT", "validation", "not_attempted", "backoff"), error
    assert envelope["evidence"] == {"dispatch_started": False, "request_complete": False, "timeout": f"request_{part}"}
    assert "Nothing was sent upstream and nothing was recorded" in error["message"], error
    assert "sending the request again is safe" in error["message"], error
    assert f"request_{part}_timeout" in error["message"], error
    return envelope


# -- a head that does not arrive ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "tunnel"])
def test_a_request_head_that_stops_arriving_gets_408_and_its_connection_closed(
        broker: BrokerProcess, upstream: HostileUpstream, how: str):
    source = next(_SOURCES)
    before, counted = recorded(broker), timeouts_counted(broker)
    sock, target, _ = connection(broker, how, source)
    with sock:
        sent = time.monotonic()
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: " + host_of(how) + b"\r\n")  # no blank line: not ended
        data, closed = read_to_close(sock)
        waited = time.monotonic() - sent
    assert closed, f"the connection stayed open: {data[:300]!r}"
    envelope = assert_408(data, "head")
    assert f"within {HEAD_DEADLINE:g} s of their first byte" in envelope["error"]["message"]
    assert HEAD_DEADLINE - EARLY <= waited < BOUND, waited

    assert upstream.received == [], "nothing reached the upstream"
    assert recorded(broker) == before, "nothing was recorded"
    after = timeouts_counted(broker)
    assert (after["head"] - counted["head"], after["body"] - counted["body"]) == (1, 0)
    [line] = deadline_lines(broker, source)
    assert line["level"] == "warning" and line["part"] == "head" and line["waited_s"] == HEAD_DEADLINE, line
    assert line["msg"].startswith(f"request head not received within {HEAD_DEADLINE:g} s from {source} ("), line
    assert ("in a CONNECT tunnel" in line["msg"]) == (how == "tunnel"), line
    assert "closed the connection" in line["msg"] and "raise [proxy] request_head_timeout" in line["msg"], line


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_its_deadline_not_kept_alive_by_its_bytes(
        broker: BrokerProcess, upstream: HostileUpstream):
    """The head clock is a deadline, not an inactivity timer: a client that sends a byte every
    tenth of a second (a slowloris) is answered once the deadline passes, while it is still sending."""
    source = next(_SOURCES)
    head = b"GET http://" + PLAIN.encode() + b"/h/ok HTTP/1.1\r\nHost: " + PLAIN.encode() + b"\r\nX-Pad: " + b"a" * 200
    with plain(broker, source) as sock:
        started, data, sent = time.monotonic(), b"", 0
        while sent < len(head) and time.monotonic() - started < BOUND:
            if select.select([sock], [], [], 0.1)[0]:  # the broker spoke (or closed)
                break
            sock.sendall(head[sent:sent + 1])
            sent += 1
        answered = time.monotonic() - started
        rest, closed = read_to_close(sock)
    data += rest
    assert sent < len(head), "the client was cut off before it could finish its head"
    assert closed
    assert_408(data, "head")
    assert HEAD_DEADLINE - EARLY <= answered < BOUND, answered
    assert upstream.received == []


# -- a body that does not arrive ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "tunnel"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_body_that_stops_arriving_gets_408_and_its_connection_closed(
        broker: BrokerProcess, upstream: HostileUpstream, how: str, framing: str):
    source = next(_SOURCES)
    before, counted = recorded(broker), timeouts_counted(broker)
    sock, target, auth = connection(broker, how, source)
    if framing == "content-length":
        head, body = b"Content-Length: 10\r\n", b"abc"
    else:
        head, body = b"Transfer-Encoding: chunked\r\n", b"3\r\nabc\r\n"
    with sock:
        sent = time.monotonic()
        sock.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: " + host_of(how) + b"\r\n" + auth + head + b"\r\n" + body)
        data, closed = read_to_close(sock)
        waited = time.monotonic() - sent
    assert closed, f"the connection stayed open: {data[:300]!r}"
    message = assert_408(data, "body")["error"]["message"]
    assert f"within {BODY_DEADLINE:g} s of the end of the headers" in message, message
    if framing == "content-length":
        assert "3 of the 10 bytes its content-length declares had arrived" in message, message
    assert BODY_DEADLINE - EARLY <= waited < BOUND, waited

    assert upstream.received == [], "nothing reached the upstream"
    assert recorded(broker) == before, "nothing was recorded"
    after = timeouts_counted(broker)
    assert (after["head"] - counted["head"], after["body"] - counted["body"]) == (0, 1)
    [line] = deadline_lines(broker, source)
    assert line["part"] == "body" and line["waited_s"] == BODY_DEADLINE, line
    assert line["msg"].startswith(f"request body not received within {BODY_DEADLINE:g} s from {source} (HTTP/1.1"), line
    assert "raise [proxy] request_body_timeout" in line["msg"], line


def test_a_body_awaited_after_100_continue_gets_408_as_its_final_answer(broker: BrokerProcess, upstream: HostileUpstream):
    """An interim 100 Continue is no answer: when the body it invited does not come, the 408 follows it."""
    source = next(_SOURCES)
    with plain(broker, source) as sock:
        sock.sendall(b"POST http://" + PLAIN.encode() + b"/h/ok HTTP/1.1\r\nHost: " + PLAIN.encode() + b"\r\n"
                     b"Proxy-Authorization: " + basic(broker) + b"\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        data, closed = read_to_close(sock)
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), data[:100]
    assert closed
    assert_408(data[len(b"HTTP/1.1 100 Continue\r\n\r\n"):], "body")
    assert upstream.received == []


def test_an_http2_stream_whose_body_stops_arriving_gets_408_and_is_reset_alone(
        broker: BrokerProcess, upstream: HostileUpstream):
    """Over HTTP/2 the deadline is the stream's: that stream is answered and reset (NO_ERROR: the
    agent need not send the rest), and the connection's other requests go on."""
    from h2.errors import ErrorCodes

    from tests.support.h2agent import H2Agent

    before, counted = recorded(broker), timeouts_counted(broker)
    with H2Agent(broker, TLS_HOST) as agent:
        started = time.monotonic()
        stalled = agent.request("POST", "/h/ok?stalled=1", body=b"abc", content_length=10, end_stream=False)
        beside = agent.request("POST", "/h/slow?delay=1.5", body=b"{}")  # on the same connection, answered later
        status, headers, body = agent.response(stalled, timeout=BOUND)
        waited = time.monotonic() - started
        assert status == 408 and headers["content-type"] == "application/problem+json", (status, body[:300])
        assert (headers["affidavit-code"], headers["x-should-retry"]) == ("REQUEST_TIMEOUT", "true"), headers
        envelope = check_envelope(body)
        assert (envelope["error"]["code"], envelope["error"]["outcome"], envelope["error"]["retry"],
                envelope["evidence"]["timeout"], envelope["invocation_id"]) == (
            "REQUEST_TIMEOUT", "not_attempted", "backoff", "request_body", None), envelope
        assert "3 of the 10 bytes its content-length declares had arrived" in envelope["error"]["message"]
        agent.read_until(lambda: "reset" in agent.streams[stalled], what=f"RST_STREAM on stream {stalled}")
        assert agent.streams[stalled]["reset"] == ErrorCodes.NO_ERROR
        assert BODY_DEADLINE - EARLY <= waited < BOUND, waited
        assert agent.response(beside, timeout=BOUND)[0] == 200, "the other request on the connection got its answer"
        assert agent.response(agent.request("GET", "/h/ok?after=1"))[0] == 200, "the connection goes on"
    assert sorted(r.path for r in upstream.received) == ["/h/ok?after=1", "/h/slow?delay=1.5"], "the stalled one was not sent"
    assert int(recorded(broker)[0][0]) == int(before[0][0]) + 2, "only the two answered requests were recorded"
    after = timeouts_counted(broker)
    assert (after["head"] - counted["head"], after["body"] - counted["body"]) == (0, 1)
    [line] = [e for e in deadline_lines(broker, "127.0.0.1") if "HTTP/2" in e["msg"]]
    assert "on its stream and reset it" in line["msg"], line


# -- what the clocks leave alone --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "tunnel"])
def test_a_keep_alive_connection_idle_between_requests_longer_than_the_head_deadline_is_kept(
        broker: BrokerProcess, upstream: HostileUpstream, how: str):
    """No clock runs while a connection waits for its next request (that wait is the idle close's)."""
    source = next(_SOURCES)
    counted = timeouts_counted(broker)
    sock, target, auth = connection(broker, how, source)
    request = b"GET " + target + b" HTTP/1.1\r\nHost: " + host_of(how) + b"\r\n" + auth + b"\r\n"
    with sock:
        sock.sendall(request)
        assert read_response(sock)[0] == 200
        time.sleep(HEAD_DEADLINE * 2 + BODY_DEADLINE)  # longer than either deadline
        sock.sendall(request)
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") != "close", headers
    assert len(upstream.received) == 2
    assert timeouts_counted(broker) == counted
    assert deadline_lines(broker, source) == []


@pytest.mark.parametrize("how", ["plain", "tunnel"])
def test_a_request_in_quick_pieces_within_its_deadlines_is_answered(
        broker: BrokerProcess, upstream: HostileUpstream, how: str):
    """A head, then a body, each in several reads that together take less than its deadline: each
    piece starts no clock of its own, and the request goes through."""
    source = next(_SOURCES)
    counted = timeouts_counted(broker)
    sock, target, auth = connection(broker, how, source)
    head = b"POST " + target + b" HTTP/1.1\r\nHost: " + host_of(how) + b"\r\n" + auth + b"Content-Length: 12\r\n\r\n"
    pieces = [head[:5], head[5:20], head[20:-3], head[-3:], b"hello", b" ", b"world!"]
    with sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.05)  # each a read of its own: ~0.15 s for the head, ~0.15 s for the body
        status, _, _ = read_response(sock)
        assert status == 200
        # The same connection goes on, and its next request starts a head clock of its own.
        sent = time.monotonic()
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: " + host_of(how) + b"\r\n")
        data, closed = read_to_close(sock)
    assert closed and HEAD_DEADLINE - EARLY <= time.monotonic() - sent < BOUND
    assert_408(data, "head")
    [first] = upstream.received
    assert first.body == b"hello world!"
    after = timeouts_counted(broker)
    assert (after["head"] - counted["head"], after["body"] - counted["body"]) == (1, 0)


@pytest.mark.parametrize("blank", [b"\r\n", b"\n", b"\r\n\r\n"], ids=["crlf", "lf", "two"])
def test_a_whole_request_after_blank_lines_in_one_read_is_answered_at_once(
        broker: BrokerProcess, upstream: HostileUpstream, blank: bytes):
    """RFC 9112 2.2: blank lines before a request line are ignored. mitmproxy skips one per read
    and then waits for more bytes; a request that came whole with them would wait for its head
    deadline and be refused as slow, though it had arrived."""
    source = next(_SOURCES)
    with plain(broker, source) as sock:
        sock.sendall(blank + b"GET http://" + PLAIN.encode() + b"/h/ok HTTP/1.1\r\nHost: " + PLAIN.encode() + b"\r\n"
                     b"Proxy-Authorization: " + basic(broker) + b"\r\n\r\n")
        status, _, _ = read_response(sock, timeout=HEAD_DEADLINE)
    assert status == 200
    assert [r.path for r in upstream.received] == ["/h/ok"]
    assert deadline_lines(broker, source) == []


def test_a_flood_of_slow_requests_from_one_address_is_counted_every_time_and_logged_once(
        broker: BrokerProcess, upstream: HostileUpstream):
    source = next(_SOURCES)
    counted = timeouts_counted(broker)
    socks = [plain(broker, source) for _ in range(4)]
    try:
        for sock in socks:
            sock.sendall(b"GET http://" + PLAIN.encode() + b"/h/ok HTTP/1.1\r\n")
        answers = [read_to_close(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    for data, closed in answers:
        assert closed
        assert_408(data, "head")
    after = timeouts_counted(broker)
    assert after["head"] - counted["head"] == 4, "every expiry is counted"
    [line] = deadline_lines(broker, source)  # the rest fold into the next line after the window
    assert line["not_logged"] == 0
    assert upstream.received == []

