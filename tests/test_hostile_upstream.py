"""Self-tests of the hostile upstream: each misbehaviour must produce exactly the bytes and
the effect count the proxy tests will rely on. A bug here would make a proxy test pass
or fail for the wrong reason, so every behaviour is checked from a real client.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.certs import TestPKI
from tests.support.hostile import HostileUpstream, free_port

pytestmark = pytest.mark.timeout(20)

T = 3.0  # client timeout: generous for CI, still far below the file's budget


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(pki: TestPKI) -> Iterator[HostileUpstream]:
    with HostileUpstream(pki) as srv:
        yield srv


@pytest.fixture
def up(server: HostileUpstream) -> Iterator[HostileUpstream]:
    server.reset()
    yield server
    assert server.errors == []


# ------------------------------------------------------------------ client helpers


def connect(port: int, tls: ssl.SSLContext | None = None, host: str = "localhost") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=T)
    return tls.wrap_socket(sock, server_hostname=host) if tls else sock


def read_all(sock: socket.socket, timeout: float = T) -> tuple[bytes, bool]:
    """Everything until the peer closes; (data, closed). closed=False means it went quiet."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def exchange(port: int, raw: bytes, timeout: float = T) -> tuple[bytes, bool]:
    with connect(port) as sock:
        sock.sendall(raw)
        return read_all(sock, timeout)


def req(method: str, path: str, body: bytes = b"", *extra: str, close: bool = True) -> bytes:
    headers = [f"{method} {path} HTTP/1.1", "Host: upstream.test", f"Content-Length: {len(body)}", *extra]
    if close:
        headers.append("Connection: close")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def split(resp: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}, body


# ------------------------------------------------------------------ complete responses


def test_ok_echoes_request_and_applies_one_effect(up: HostileUpstream) -> None:
    body = b'{"amount": 100}'
    r = httpx.post(f"http://127.0.0.1:{up.http_port}/v1/charges?x=1", content=body, headers={"X-Trace": "AbC"}, timeout=T)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    echo = r.json()
    assert echo["method"] == "POST" and echo["path"] == "/v1/charges?x=1"
    assert ["X-Trace", "AbC"] in echo["headers"]  # case preserved
    assert echo["body_sha256"] == hashlib.sha256(body).hexdigest() and echo["body_length"] == len(body)
    assert echo["effects"] == 1 == up.effects
    (e,) = up.received
    assert (e.method, e.path, e.body, e.behaviour, e.tls) == ("POST", "/v1/charges?x=1", body, "ok", None)
    assert e.effect_applied and e.complete and e.conn_id == echo["conn_id"] and e.index == 0
    assert e.t_first_byte <= (e.t_end or 0)


def test_keep_alive_serves_two_requests_on_one_connection(up: HostileUpstream) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=T)
    for path in ("/a", "/h/status?code=202"):
        conn.request("POST", path, body=b"x")
        resp = conn.getresponse()
        resp.read()
    conn.close()
    a, b = up.received
    assert a.conn_id == b.conn_id and (a.index, b.index) == (0, 1)
    assert resp.status == 202 and up.effects == 2


def test_connection_close_is_respected(up: HostileUpstream) -> None:
    data, closed = exchange(up.http_port, req("GET", "/"))
    status, headers, body = split(data)
    assert closed and status == "HTTP/1.1 200 OK" and headers["connection"] == "close"
    assert len(body) == int(headers["content-length"])


def test_chunked_request_body_is_decoded(up: HostileUpstream) -> None:
    raw = b"POST /h/ok HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    raw += b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    data, _ = exchange(up.http_port, raw)
    assert json.loads(split(data)[2])["body_length"] == 11
    assert up.received[0].body == b"hello world"


@pytest.mark.parametrize(
    ("query", "code", "header", "value"),
    [
        ("code=202&job=j_1", 202, None, None),
        ("code=307&location=/elsewhere", 307, "location", "/elsewhere"),
        ("code=401", 401, None, None),
        ("code=403", 403, None, None),
        ("code=429&retry_after=7", 429, "retry-after", "7"),
        ("code=500", 500, None, None),
        ("code=503&retry_after=1", 503, "retry-after", "1"),
    ],
)
def test_status(up: HostileUpstream, query: str, code: int, header: str | None, value: str | None) -> None:
    r = httpx.get(up.url(f"/h/status?{query}"), timeout=T, follow_redirects=False)
    assert r.status_code == code and up.effects == 1
    if header:
        assert r.headers[header] == value
    if "job" in query:
        assert r.json() == {"job_id": "j_1", "status": "pending"}


def test_redirect(up: HostileUpstream) -> None:
    r = httpx.post(up.url("/h/redirect?to=http://api.payments.test/next"), timeout=T)
    assert r.status_code == 307 and r.headers["location"] == "http://api.payments.test/next"
    assert up.effects == 1


def test_unknown_behaviour_is_404_without_effect(up: HostileUpstream) -> None:
    assert httpx.get(up.url("/h/no_such_thing"), timeout=T).status_code == 404
    assert up.effects == 0 and not up.received[0].effect_applied


def test_close_delimited_body_is_complete(up: HostileUpstream) -> None:
    data, closed = exchange(up.http_port, req("POST", "/h/close_delimited", b"abc", close=False))
    status, headers, body = split(data)
    assert closed and status == "HTTP/1.1 200 OK"
    assert "content-length" not in headers and "transfer-encoding" not in headers
    assert json.loads(body)["effects"] == 1 == up.effects
    assert httpx.get(up.url("/h/close_delimited"), timeout=T).json()["effects"] == 2


# ------------------------------------------------------------------ broken responses


def test_hang_applies_effect_and_never_answers(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("POST", "/h/hang", b"pay"))
        data, closed = read_all(sock, timeout=0.5)
        assert (data, closed) == (b"", False)
        assert up.effects == 1 and up.received[0].effect_applied


def test_close_after_effect_sends_nothing(up: HostileUpstream) -> None:
    assert exchange(up.http_port, req("POST", "/h/close_after_effect", b"pay")) == (b"", True)
    assert up.effects == 1
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=T)
    conn.request("POST", "/h/close_after_effect", body=b"pay")
    with pytest.raises(http.client.RemoteDisconnected):
        conn.getresponse()
    assert up.effects == 2


def test_close_after_effect_with_rst(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("POST", "/h/close_after_effect?rst=1", b"pay"))
        sock.settimeout(T)
        with pytest.raises(ConnectionResetError):
            sock.recv(100)
    assert up.effects == 1


def test_close_mid_headers(up: HostileUpstream) -> None:
    assert exchange(up.http_port, req("POST", "/h/close_mid_headers")) == (b"HTTP/1.1 200 OK\r\nContent-Type: appl", True)
    assert up.effects == 1


def test_short_body(up: HostileUpstream) -> None:
    data, closed = exchange(up.http_port, req("POST", "/h/short_body"))
    _, headers, body = split(data)
    assert closed and headers["content-length"] == "100" and len(body) == 40
    assert json.loads(body)["partial"] is True
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(up.url("/h/short_body"), timeout=T)
    assert up.effects == 2


def test_chunked_truncated(up: HostileUpstream) -> None:
    data, closed = exchange(up.http_port, req("POST", "/h/chunked_truncated"))
    _, headers, body = split(data)
    assert closed and headers["transfer-encoding"] == "chunked"
    assert body == b'd\r\n{"effects":1,\r\n9\r\n"items":[\r\n'  # no terminating 0-chunk
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=T)
    conn.request("POST", "/h/chunked_truncated")
    with pytest.raises(http.client.IncompleteRead):
        conn.getresponse().read()
    conn.close()
    assert up.effects == 2


def test_continue_close(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("POST", "/h/continue_close", b"0123456789", "Expect: 100-continue")[:-10])
        sock.settimeout(T)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert up.effects == 0  # nothing happens before the body arrives
        sock.sendall(b"0123456789")
        assert read_all(sock) == (b"", True)
    assert up.effects == 1 and up.received[0].body == b"0123456789"


def test_continue_final(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("PUT", "/h/continue_final", b"abc")[:-3])
        sock.settimeout(T)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"abc")
        status, _, body = split(read_all(sock)[0])
    assert status == "HTTP/1.1 201 Created" and json.loads(body)["body_length"] == 3
    assert up.effects == 1


def test_slow_answers_after_delay(up: HostileUpstream) -> None:
    t0 = time.monotonic()
    r = httpx.get(up.url("/h/slow?delay=0.3"), timeout=T)
    assert r.status_code == 200 and time.monotonic() - t0 >= 0.3 and up.effects == 1


def test_slow_applies_effect_even_if_client_left(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("POST", "/h/slow?delay=0.6", b"pay"))
        up.wait_for_requests(1)
    time.sleep(0.1)
    assert up.effects == 0  # still "working"
    deadline = time.monotonic() + T
    while up.effects == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    (e,) = up.received
    assert up.effects == 1 and e.effect_applied and e.client_gone


def test_idle_close_closes_a_pooled_connection(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(req("GET", "/h/idle_close?after=0.2", close=False))
        t0 = time.monotonic()
        data, closed = read_all(sock, timeout=T)
        assert closed and time.monotonic() - t0 >= 0.15
    status, headers, body = split(data)
    assert status == "HTTP/1.1 200 OK" and "connection" not in headers
    assert len(body) == int(headers["content-length"]) and up.effects == 1


def test_idle_close_serves_a_request_that_arrives_in_time(up: HostileUpstream) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=T)
    for _ in range(2):
        conn.request("GET", "/h/idle_close?after=1")
        conn.getresponse().read()
    conn.close()
    assert len({e.conn_id for e in up.received}) == 1 and up.effects == 2


# ------------------------------------------------------------------ idempotency


def test_idem_honour_replays_byte_identical(up: HostileUpstream) -> None:
    raw = req("POST", "/h/idem_honour", b"pay", "Idempotency-Key: k1")
    first, second = exchange(up.http_port, raw)[0], exchange(up.http_port, raw)[0]
    assert first == second and first.startswith(b"HTTP/1.1 200 OK")
    assert up.effects == 1 and up.effects_by_key == {"k1": 1}
    assert [e.effect_applied for e in up.received] == [True, False]
    exchange(up.http_port, req("POST", "/h/idem_honour", b"pay"))  # no key: like ok
    assert up.effects == 2


def test_idem_honour_custom_header(up: HostileUpstream) -> None:
    raw = req("POST", "/h/idem_honour?header=X-Request-Id", b"pay", "x-request-id: r1")
    exchange(up.http_port, raw), exchange(up.http_port, raw)
    assert up.effects_by_key == {"r1": 1}


def test_idem_ignore_applies_every_time(up: HostileUpstream) -> None:
    raw = req("POST", "/h/idem_ignore", b"pay", "Idempotency-Key: k1")
    assert split(exchange(up.http_port, raw)[0])[0] == split(exchange(up.http_port, raw)[0])[0] == "HTTP/1.1 200 OK"
    assert up.effects == 2 and up.effects_by_key == {"k1": 2}


def test_idem_strict_rejects_a_different_body(up: HostileUpstream) -> None:
    first = exchange(up.http_port, req("POST", "/h/idem_strict", b"a", "Idempotency-Key: k1"))[0]
    assert exchange(up.http_port, req("POST", "/h/idem_strict", b"a", "Idempotency-Key: k1"))[0] == first
    status, _, body = split(exchange(up.http_port, req("POST", "/h/idem_strict", b"b", "Idempotency-Key: k1"))[0])
    assert status == "HTTP/1.1 422 Unprocessable Entity" and "error" in json.loads(body)
    assert up.effects == 1 and up.effects_by_key == {"k1": 1}


# ------------------------------------------------------------------ first-byte hook


def test_on_first_byte_runs_before_the_request_is_read(up: HostileUpstream) -> None:
    calls: list[tuple[int, bytes]] = []

    def probe(conn_id: int, seen: bytes) -> float:
        calls.append((conn_id, seen))
        return time.monotonic()

    up.on_first_byte = probe
    with connect(up.http_port) as sock:
        sock.sendall(b"POST /h/ok HTTP/1.1\r\n")
        time.sleep(0.2)  # the head is incomplete: the hook must already have run
        assert calls == [(calls[0][0], b"POST /h/ok HTTP/1.1\r\n")]
        sock.sendall(b"Host: x\r\nContent-Length: 2\r\n\r\nhi")
        sock.settimeout(T)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        resp.read()
        sock.sendall(req("GET", "/second"))
        read_all(sock)
    a, b = up.received
    assert a.first_byte_probe < (a.t_end or 0) and a.conn_id == calls[0][0]
    assert b.first_byte_probe is not None and len(calls) == 2


def test_on_first_byte_error_is_recorded_not_fatal(up: HostileUpstream) -> None:
    def probe(conn_id: int, seen: bytes) -> None:
        raise LookupError("no journal row yet")

    up.on_first_byte = probe
    assert httpx.get(up.url("/"), timeout=T).status_code == 200
    assert isinstance(up.received[0].first_byte_error, LookupError)


def test_a_request_cut_inside_its_head_is_still_recorded(up: HostileUpstream) -> None:
    with connect(up.http_port) as sock:
        sock.sendall(b"POST /h/ok HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.1)
    up.wait_for_requests(1)
    (e,) = up.received
    assert e.method == "" and not e.complete and e.raw_head.startswith(b"POST") and up.effects == 0


# ------------------------------------------------------------------ TLS


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "api.payments.test", "eu.example.test"])
def test_tls_good(up: HostileUpstream, pki: TestPKI, host: str) -> None:
    with connect(up.tls_port("good"), pki.client_context(), host) as sock:
        assert sock.selected_alpn_protocol() in (None, "http/1.1")
        sock.sendall(req("GET", "/h/ok"))
        status, _, _ = split(read_all(sock)[0])
    assert status == "HTTP/1.1 200 OK"
    (e,) = up.received
    assert e.tls == "good" and e.sni == (None if host == "127.0.0.1" else host)


@pytest.mark.parametrize(
    ("kind", "code", "message"),
    [
        ("untrusted", 20, "unable to get local issuer certificate"),
        ("expired", 10, "certificate has expired"),
        ("wrong_host", 62, "Hostname mismatch, certificate is not valid for 'localhost'."),
    ],
)
def test_tls_bad_certificates_fail_verification(up: HostileUpstream, pki: TestPKI, kind: str, code: int, message: str) -> None:
    with pytest.raises(ssl.SSLCertVerificationError) as err:
        connect(up.tls_port(kind), pki.client_context(), "localhost")
    assert (err.value.verify_code, err.value.verify_message) == (code, message)
    deadline = time.monotonic() + T
    while not up.tls_errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [k for _, k, _ in up.tls_errors] == [kind] and up.received == []


def test_single_label_wildcard_does_not_match(up: HostileUpstream, pki: TestPKI) -> None:
    """OpenSSL ignores ``*.test``: proxy tests must not rely on it (use *.example.test)."""
    with pytest.raises(ssl.SSLCertVerificationError) as err:
        connect(up.tls_port("good"), pki.client_context(), "anything.test")
    assert err.value.verify_code == 62


def test_tls_stall_never_finishes_the_handshake(up: HostileUpstream, pki: TestPKI) -> None:
    sock = socket.create_connection(("127.0.0.1", up.tls_stall_port), timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        pki.client_context().wrap_socket(sock, server_hostname="localhost")
    assert 0.25 < time.monotonic() - t0 < 2
    sock.close()


# ------------------------------------------------------------------ lifecycle


def test_free_port_refuses(up: HostileUpstream) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", free_port()), timeout=T).close()


def test_reset_clears_observations(up: HostileUpstream) -> None:
    httpx.post(up.url("/h/idem_honour"), headers={"Idempotency-Key": "k"}, timeout=T)
    up.on_first_byte = lambda c, b: None
    up.reset()
    assert (up.received, up.effects, up.effects_by_key, up.on_first_byte) == ([], 0, {}, None)
    httpx.post(up.url("/h/idem_honour"), headers={"Idempotency-Key": "k"}, timeout=T)
    assert up.effects == 1  # the stored response was forgotten too


def test_stop_releases_hanging_and_stalled_clients(pki: TestPKI) -> None:
    srv = HostileUpstream(pki).start()
    hanging = connect(srv.http_port)
    hanging.sendall(req("POST", "/h/hang"))
    stalled = socket.create_connection(("127.0.0.1", srv.tls_stall_port), timeout=T)
    srv.wait_for_requests(1)

    def server_threads() -> int:
        return sum(t.name == "hostile-upstream" for t in threading.enumerate())

    before, t0 = server_threads(), time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 3 and server_threads() == before - 1
    for sock in (hanging, stalled):
        assert read_all(sock)[1]
        sock.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.http_port), timeout=T)


@pytest.mark.parametrize("behaviour", ["close_after_effect", "close_mid_headers", "short_body", "chunked_truncated"])
def test_broken_responses_are_the_same_bytes_over_tls(up: HostileUpstream, pki: TestPKI, behaviour: str) -> None:
    plain = exchange(up.http_port, req("POST", f"/h/{behaviour}"))
    with connect(up.tls_port("good"), pki.client_context(), "api.payments.test") as sock:
        sock.sendall(req("POST", f"/h/{behaviour}"))
        over_tls = read_all(sock)
    # effects differ (1 then 2), so compare with the count masked
    assert over_tls[1] and over_tls[0].replace(b'"effects":2', b'"effects":1') == plain[0]
    assert up.effects == 2 and up.received[1].tls == "good"
