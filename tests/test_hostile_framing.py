"""The response side against a hostile upstream: answers whose framing lies, interim responses,
odd heads, truncation, resets, junk after a response and what the next request on a pooled
connection reads, and routes that take a connection of their own for each request.

A raw scripted upstream (blocking sockets, one thread per connection) sends exactly the bytes a
test scripts, per request path ``/p/<script>``. Each test checks what the agent got (status,
envelope), the record at the side API, and the stored result: a response recorded committed must
be exactly what the upstream framed completely; anything else must be unknown with the right code,
and never a result belonging to another request.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.conftest import DIALECTS, module_broker
from tests.support.broker import BrokerProcess
from tests.support.certs import TestPKI
from tests.support.envelopes import check_envelope

pytestmark = pytest.mark.timeout(60)

TLS = "https://raw.example.test"
PLAIN = "http://raw-plain.example.test"
#: The same upstream through routes with reuse_connections = false.
FRESH_TLS = "https://raw-fresh.example.test"
FRESH_PLAIN = "http://raw-fresh-plain.example.test"


# ------------------------------------------------------------------------------- raw upstream


@dataclass
class Req:
    conn: int
    index: int
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def script(self) -> str:
        parts = self.path.split("?")[0].split("/")
        return parts[2] if len(parts) > 2 and parts[1] == "p" else "ok"


class Conn:
    def __init__(self, sock: socket.socket, raw: socket.socket, cid: int):
        self.sock, self.raw, self.id = sock, raw, cid
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        """Clean close: TLS close_notify (if TLS), then FIN."""
        if isinstance(self.sock, ssl.SSLSocket):
            try:
                self.sock.unwrap()
            except (OSError, ssl.SSLError):
                pass
        self.raw.close()

    def cut(self) -> None:
        """FIN with no TLS close_notify."""
        try:
            self.raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.raw.close()

    def rst(self) -> None:
        self.raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.raw.close()

    def fill(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (OSError, ssl.SSLError):
            return False
        self.buf += data
        return bool(data)

    def read_head(self) -> bytes | None:
        while b"\r\n\r\n" not in self.buf:
            if not self.fill():
                return None
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head

    def read_exact(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self.fill():
                return None
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


Script = Callable[["RawUpstream", Conn, Req], bool]  # returns: keep the connection


class RawUpstream:
    def __init__(self, pki: TestPKI):
        self.ctx = pki.server_context("good")
        self.scripts: dict[str, Script] = {}
        self.lock = threading.Lock()
        self.received: list[Req] = []
        self.effects = 0
        self.next_conn = 0
        self.open: set[socket.socket] = set()
        self.stopping = False
        self.receive_buffer: int | None = None  # SO_RCVBUF for the next connections (locks autotuning)
        self.listeners: list[socket.socket] = []
        self.plain_port = self._listen(tls=False)
        self.tls_port = self._listen(tls=True)

    def _listen(self, tls: bool) -> int:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        self.listeners.append(s)
        threading.Thread(target=self._accept, args=(s, tls), daemon=True).start()
        return s.getsockname()[1]

    def _accept(self, s: socket.socket, tls: bool) -> None:
        while not self.stopping:
            try:
                raw, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw, tls), daemon=True).start()

    def _serve(self, raw: socket.socket, tls: bool) -> None:
        with self.lock:
            self.next_conn += 1
            cid = self.next_conn
        sock: socket.socket = raw
        if self.receive_buffer is not None:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        try:
            if tls:
                raw.settimeout(5)
                sock = self.ctx.wrap_socket(raw, server_side=True)
            conn = Conn(sock, raw, cid)
            with self.lock:
                self.open.add(raw)
            index = 0
            while True:
                head = conn.read_head()
                if head is None:
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = [(n, v.strip()) for n, _, v in (ln.partition(":") for ln in lines[1:])]
                length = int(next((v for n, v in headers if n.lower() == "content-length"), "0"))
                req = Req(cid, index, method, path, headers, b"")
                with self.lock:
                    self.received.append(req)
                script = self.scripts.get(req.script, ok)
                if not getattr(script, "before_body", False):
                    body = conn.read_exact(length)
                    if body is None:
                        break
                    req.body = body
                if not script(self, conn, req):
                    break
                index += 1
        except (OSError, ssl.SSLError):
            pass
        finally:
            with self.lock:
                self.open.discard(raw)
            try:
                raw.close()
            except OSError:
                pass

    def effect(self) -> int:
        with self.lock:
            self.effects += 1
            return self.effects

    def reset(self) -> None:
        """A clean slate for the next test: its connections closed (the broker drops them from its
        pool when it sees the close), so no test's request lands on one an earlier test's script
        left in a state of its own (junk to come, a close to come)."""
        with self.lock:
            self.received.clear()
            self.effects = 0
            self.scripts.clear()
            self.receive_buffer = None
            closing, self.open = self.open, set()
        for raw in closing:
            try:
                raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if closing:
            time.sleep(0.1)  # for the broker to read the closes

    def stop(self) -> None:
        self.stopping = True
        for s in self.listeners:
            s.close()


def ok(up: RawUpstream, conn: Conn, req: Req) -> bool:
    n = up.effect()
    body = b'{"path":"%s","effects":%d,"conn":%d}' % (req.path.encode(), n, conn.id)
    conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return True


def wire(data: bytes, end: str = "close", delay: float = 0.0) -> Script:
    """Apply the effect, send ``data``, then end: ``close`` (clean, close_notify on TLS),
    ``cut`` (FIN, no close_notify), ``rst``, or ``keep``."""

    def script(up: RawUpstream, conn: Conn, req: Req) -> bool:
        up.effect()
        conn.send(data)
        if delay:
            time.sleep(delay)
        if end == "keep":
            return True
        getattr(conn, end)()
        return False

    return script


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def raw_server(pki: TestPKI) -> Iterator[RawUpstream]:
    server = RawUpstream(pki)
    yield server
    server.stop()


@pytest.fixture
def raw(raw_server: RawUpstream) -> Iterator[RawUpstream]:
    raw_server.reset()
    yield raw_server


def probe_routes(up: RawUpstream) -> list[dict[str, Any]]:
    every = ["GET", "HEAD", "POST", "PUT", "DELETE"]
    fast = {"connect_timeout": "2s", "response_timeout": "2s", "result_horizon": "4s"}
    return [
        {"name": "raw.tls", "host": "raw.example.test", "methods": every, "agents": ["builder", "reviewer"],
         "connect_to": f"127.0.0.1:{up.tls_port}", **fast},
        {"name": "raw.plain", "host": "raw-plain.example.test", "port": 80, "scheme": "http", "methods": every,
         "agents": ["builder", "reviewer"], "connect_to": f"127.0.0.1:{up.plain_port}", **fast},
        {"name": "raw.fresh", "host": "raw-fresh.example.test", "methods": every, "agents": ["builder"],
         "connect_to": f"127.0.0.1:{up.tls_port}", "reuse_connections": False, **fast},
        {"name": "raw.fresh.plain", "host": "raw-fresh-plain.example.test", "port": 80, "scheme": "http",
         "methods": every, "agents": ["builder"], "connect_to": f"127.0.0.1:{up.plain_port}",
         "reuse_connections": False, **fast},
    ]


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI,
           raw_server: RawUpstream) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, probe_routes(raw_server), name="probe")


# ------------------------------------------------------------------------------- helpers


def record_of(broker: BrokerProcess, iid: str) -> dict[str, Any]:
    return broker.wait_for(iid, lambda r: r["retry"] is not None and r["stage"] not in ("committed", "dispatched"))


def result_of(broker: BrokerProcess, iid: str) -> httpx.Response:
    with broker.operator() as api:
        return api.get(f"/v1/invocations/{iid}/result")


def kinds(record: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in record["events"]]


def expect_unknown(broker: BrokerProcess, response: httpx.Response, code: str, *, status: int = 502) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.headers, response.content[:300])
    assert response.headers["content-type"] == "application/problem+json"
    env = check_envelope(response.content)
    err = env["error"]
    assert (err["code"], err["phase"], err["outcome"]) == (code, "remote_execution", "unknown"), err
    record = record_of(broker, env["invocation_id"])
    assert record["outcome"] == "unknown" and record["code"] == code, record
    assert "RESULT_COMMITTED" not in kinds(record) and "REMOTE_RESPONSE_COMPLETE" not in kinds(record)
    fetched = result_of(broker, env["invocation_id"])
    assert fetched.status_code == 409, fetched.content
    return record


def expect_committed(broker: BrokerProcess, response: httpx.Response, status: int, body: bytes, framing: str,
                     outcome: str = "committed") -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response.content == body, response.content[:300]
    assert response.headers["affidavit-outcome"] == outcome
    iid = response.headers["affidavit-invocation-id"]
    record = record_of(broker, iid)
    assert record["outcome"] == outcome, record
    assert record["evidence"]["response_complete"] is True
    assert record["evidence"].get("framing", framing) == framing, record["evidence"]
    fetched = result_of(broker, iid)
    assert fetched.status_code == status and fetched.content == body, (fetched.status_code, fetched.content[:300])
    return record


BASES = [pytest.param(PLAIN, id="plain"), pytest.param(TLS, id="tls")]


# ------------------------------------------------------------------------------- framing lies

INCOMPLETE_CASES = {
    # Content-Length larger than the body, then a clean close.
    "cl_larger": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"partial\":true}",
    # chunked with no last chunk, then a clean close.
    "chunk_no_last": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"partial\":true}\r\n",
    # last chunk but no blank line after it (trailer section unterminated).
    "chunk_no_blank": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"partial\":true}\r\n0\r\n",
    "chunk_trailer_cut": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"partial\":true}\r\n0\r\nX-T: 1\r\n",
    # chunk size lies: shorter/longer than its data; a bad size; a size overflowing 64 bits.
    "chunk_size_short": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"partial\":true}\r\n0\r\n\r\n",
    "chunk_size_bad": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{\"partial\":true}\r\n0\r\n\r\n",
    "chunk_size_huge": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\nab\r\n0\r\n\r\n",
    "chunk_bare_lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\n{\"partial\":true}\n0\n\n",
}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", sorted(INCOMPLETE_CASES))
def test_incomplete_framing_is_result_incomplete(broker, raw, base, case):
    raw.scripts["x"] = wire(INCOMPLETE_CASES[case])
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"{}")
    expect_unknown(broker, response, "REMOTE_RESULT_INCOMPLETE")
    assert b"\"partial\":true" not in response.content
    assert raw.effects == 1 and len(raw.received) == 1


HEAD_BROKEN_CASES = {
    "two_cl_different": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nabcde",
    "cl_and_chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked_and_cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "obs_fold": b"HTTP/1.1 200 OK\r\nX-A: one\r\n two\r\nContent-Length: 2\r\n\r\nok",
    "nul_in_value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "bare_cr": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "status_2000": b"HTTP/1.1 2000 X\r\nContent-Length: 2\r\n\r\nok",
    "status_999": b"HTTP/1.1 999 X\r\nContent-Length: 2\r\n\r\nok",
    "http2_line": b"HTTP/2 200\r\nContent-Length: 2\r\n\r\nok",
    "not_http": b"ok\r\n\r\n",
    "101_unasked": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "100_then_close": b"HTTP/1.1 100 Continue\r\n\r\n",
    "103_then_close": b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
    "headers_cut": b"HTTP/1.1 200 OK\r\nContent-Le",
}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", sorted(HEAD_BROKEN_CASES))
def test_broken_heads_are_outcome_unknown(broker, raw, base, case):
    raw.scripts["x"] = wire(HEAD_BROKEN_CASES[case])
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"{}")
    record = expect_unknown(broker, response, "REMOTE_OUTCOME_UNKNOWN")
    assert record["retry"] == "reconcile"
    assert raw.effects == 1 and len(raw.received) == 1


def test_an_enormous_header_count_is_too_large_not_committed(broker, raw):
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(20000)) + b"Content-Length: 2\r\n\r\nok"
    raw.scripts["x"] = wire(head)
    with broker.client() as client:
        response = client.post(PLAIN + "/p/x", content=b"{}")
    expect_unknown(broker, response, "RESULT_TOO_LARGE")


def test_many_headers_under_the_limit_are_kept(broker, raw):
    names = [b"X-H%d" % i for i in range(3000)]
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(n + b": v\r\n" for n in names) + b"Content-Length: 2\r\n\r\nok"
    raw.scripts["x"] = wire(head)
    with broker.client() as client:
        response = client.post(PLAIN + "/p/x", content=b"{}")
    expect_committed(broker, response, 200, b"ok", "content-length")
    assert response.headers["x-h2999"] == "v"


# --- complete but odd framings: committed, exactly what was framed

COMPLETE_CASES = {
    # Content-Length smaller than what follows: the response is the first 2 bytes.
    "cl_smaller": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA-BYTES", 200, b"ok", "content-length"),
    "chunk_ext": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;a=b\r\nok\r\n0;x=\"y\"\r\n\r\n", 200, b"ok", "chunked"),
    "chunk_trailers": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\nContent-Length: 99\r\n\r\n",
                       200, b"ok", "chunked"),
    "interims": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                 b"HTTP/1.1 103 Early Hints\r\nLink: </b>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", 201, b"ok",
                 "content-length"),
    "204_with_body": (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello", 204, b"", "none"),
    "304_with_body": (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\nhello", 304, b"", "none"),
    "204_chunked_body": (b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 204, b"", "none"),
    "no_reason": (b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", "content-length"),
}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", sorted(COMPLETE_CASES))
def test_complete_odd_framings_are_recorded_as_framed(broker, raw, base, case):
    data, status, body, framing = COMPLETE_CASES[case]
    raw.scripts["x"] = wire(data, end="close")
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"{}")
    expect_committed(broker, response, status, body, framing)
    assert raw.effects == 1


# --- read-to-close bodies

@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/1.1"])
def test_a_read_to_close_body_over_plain_http_is_complete_at_a_clean_close(broker, raw, version):
    raw.scripts["x"] = wire(version + b" 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", end="close")
    with broker.client() as client:
        response = client.post(PLAIN + "/p/x", content=b"{}")
    expect_committed(broker, response, 200, b"all of it", "close")


@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/1.1"])
def test_a_read_to_close_body_over_plain_http_cut_by_a_reset_is_incomplete(broker, raw, version):
    raw.scripts["x"] = wire(version + b" 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", end="rst", delay=0.2)
    with broker.client() as client:
        response = client.post(PLAIN + "/p/x", content=b"{}")
    expect_unknown(broker, response, "REMOTE_RESULT_INCOMPLETE")


@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/1.1"])
def test_a_read_to_close_tls_body_with_close_notify_is_complete(broker, raw, version):
    raw.scripts["x"] = wire(version + b" 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", end="close")
    with broker.client() as client:
        response = client.post(TLS + "/p/x", content=b"{}")
    expect_committed(broker, response, 200, b"all of it", "close")


@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/1.1"])
@pytest.mark.parametrize("end", ["cut", "rst"])
def test_a_read_to_close_tls_body_without_close_notify_is_incomplete(broker, raw, version, end):
    raw.scripts["x"] = wire(version + b" 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", end=end, delay=0.2)
    with broker.client() as client:
        response = client.post(TLS + "/p/x", content=b"{}")
    expect_unknown(broker, response, "REMOTE_RESULT_INCOMPLETE")


@pytest.mark.parametrize("te", [b"gzip", b"chunked, identity", b"chunked,"])
def test_a_transfer_coding_not_ending_in_chunked_is_read_to_close_and_needs_close_notify(broker, raw, te):
    raw.scripts["x"] = wire(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + te + b"\r\n\r\n2\r\nok\r\n0\r\n\r\n", end="cut", delay=0.2)
    with broker.client() as client:
        response = client.post(TLS + "/p/x", content=b"{}")
    expect_unknown(broker, response, "REMOTE_RESULT_INCOMPLETE")


# --- HEAD

@pytest.mark.parametrize("base", BASES)
def test_a_head_answer_with_a_body_does_not_leak_into_the_next_request(broker, raw, base):
    def head_with_body(up: RawUpstream, conn: Conn, req: Req) -> bool:
        up.effect()
        conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + b"HTTP/1.1 299 Smuggled\r\nContent-Length: 2\r\n\r\nXX" + b"." * 6)
        return True

    raw.scripts["head"] = head_with_body
    with broker.client() as client:
        head = client.head(base + "/p/head")
        time.sleep(0.1)
        nxt = client.get(base + "/p/ok")
    assert head.status_code == 200 and head.content == b""
    expect_committed(broker, nxt, 200, nxt.content, "content-length")
    assert nxt.status_code == 200 and b'"path":"/p/ok"' in nxt.content


# ------------------------------------------------------------------------------- desync


def _junk_after(junk: bytes, delay: float = 0.0) -> Script:
    def script(up: RawUpstream, conn: Conn, req: Req) -> bool:
        n = up.effect()
        body = b'{"first":%d}' % n
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        if not delay:  # one write: the junk arrives with the answer, in its read
            conn.send(answer + junk)
            return True
        conn.send(answer)
        time.sleep(delay)
        conn.send(junk)
        return True

    return script


JUNK = b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{\"junk\":true}\n"


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_pipelined_junk_after_a_response_never_becomes_the_next_result(broker, raw, base, delay):
    """Junk in the answer's own read, or while the connection is idle, retires the connection. (Junk
    that arrives after the next request was written cannot be told from its answer in HTTP/1.1:
    see test_a_route_that_reuses_no_connection_is_not_desynchronised_by_its_upstream.)"""
    raw.scripts["junk"] = _junk_after(JUNK, delay)
    with broker.client() as client:
        first = client.post(base + "/p/junk", content=b"{}")
        if delay > 0.1:
            time.sleep(delay + 0.7)  # the junk arrives while the connection is idle
        second = client.post(base + "/p/ok", content=b"{}")
    expect_committed(broker, first, 200, first.content, "content-length")
    assert b"first" in first.content
    # The second result must be the upstream's answer to the second request, never the junk.
    if second.status_code == 200:
        assert b"junk" not in second.content, second.content
        assert b'"path":"/p/ok"' in second.content
        record = record_of(broker, second.headers["affidavit-invocation-id"])
        assert b"junk" not in result_of(broker, record["invocation_id"]).content
    else:
        expect_unknown(broker, second, "REMOTE_OUTCOME_UNKNOWN")


def _early_ok_unread(up: RawUpstream, conn: Conn, req: Req) -> bool:
    """A naive upstream: 200 right after the head, the body never read (it stays in the stream)."""
    conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{\"early\":1}\n")
    return True


_early_ok_unread.before_body = True  # type: ignore[attr-defined]


FRESH = [pytest.param(FRESH_PLAIN, id="plain"), pytest.param(FRESH_TLS, id="tls")]


@pytest.mark.parametrize("base", FRESH)
@pytest.mark.parametrize("trouble", ["unread_body", "late_junk"])
def test_a_route_that_reuses_no_connection_is_not_desynchronised_by_its_upstream(broker, raw, base, trouble):
    """Two ways an upstream that breaks HTTP/1.1's framing makes a kept connection carry another
    request's answer, which no reading of the bytes can tell: it answers 2xx without reading the
    body (the body is then the next request it serves), or it sends an answer nobody asked for
    just after the next request went out. On a route with reuse_connections = false each request
    has a connection of its own, asks for its close, and gets its own answer."""
    if trouble == "unread_body":
        raw.scripts["first"] = _early_ok_unread
        first_body = b"POST /p/ok?smuggled=1 HTTP/1.1\r\nHost: raw.example.test\r\nContent-Length: 0\r\nX-Pad: "
    else:
        raw.scripts["first"] = _junk_after(JUNK, 0.05)
        first_body = b"{}"
    with broker.client() as client:
        first = client.post(base + "/p/first", content=first_body)
        second = client.post(base + "/p/ok?second=1", content=b'{"second":true}')
    assert first.status_code == 200, first.content
    expect_committed(broker, second, 200, second.content, "content-length")
    assert b"second=1" in second.content and b"smuggled" not in second.content and b"junk" not in second.content
    assert b"smuggled" not in result_of(broker, second.headers["affidavit-invocation-id"]).content
    seen = [r for r in raw.received if r.path.startswith("/p/")]
    assert [r.path for r in seen] == ["/p/first", "/p/ok?second=1"], [r.path for r in seen]
    assert seen[0].conn != seen[1].conn and all(r.index == 0 for r in seen)
    assert all(("Connection", "close") in r.headers for r in seen), seen[0].headers


# ------------------------------------------------------------------------------- early answers, resets


def _answer_before_body(status: bytes, then: str) -> Script:
    def script(up: RawUpstream, conn: Conn, req: Req) -> bool:
        body = b'{"early":true}'
        conn.send(b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
        getattr(conn, then)()
        return False

    script.before_body = True  # type: ignore[attr-defined]
    return script


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("status", [b"413 Payload Too Large", b"200 OK"])
@pytest.mark.parametrize("then", ["close", "rst"])
def test_an_answer_before_the_body_was_read(broker, raw, base, status, then):
    raw.scripts["x"] = _answer_before_body(status, then)
    big = b"x" * (8 * 1024 * 1024)
    with broker.client() as client:
        response = client.post(base + "/p/x", content=big)
    code = int(status.split()[0])
    if response.status_code == code:
        record = expect_committed(broker, response, code, b'{"early":true}', "content-length",
                                  outcome="rejected" if code == 413 else "committed")
        assert record["evidence"].get("request_complete") is False, record["evidence"]
    else:
        expect_unknown(broker, response, "REMOTE_OUTCOME_UNKNOWN")


def _reset_mid_body(up: RawUpstream, conn: Conn, req: Req) -> bool:
    conn.read_exact(1000)
    conn.rst()
    return False


#: A body the kernel's buffers cannot take whole before the reset: the broker's send buffer grows to
#: 4 MiB here (net.ipv4.tcp_wmem) and the upstream's is locked small; within the 10 MiB max_body.
_MORE_THAN_THE_BUFFERS = 9 * 1024 * 1024


_reset_mid_body.before_body = True  # type: ignore[attr-defined]


@pytest.mark.parametrize("base", BASES)
def test_a_reset_mid_request_body_is_unknown(broker, raw, base):
    raw.scripts["x"] = _reset_mid_body
    raw.receive_buffer = 64 * 1024
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"x" * _MORE_THAN_THE_BUFFERS)
    record = expect_unknown(broker, response, "REMOTE_OUTCOME_UNKNOWN")
    assert record["evidence"]["request_complete"] is False


@pytest.mark.parametrize("base", BASES)
def test_a_complete_response_followed_by_a_reset_is_committed(broker, raw, base):
    raw.scripts["x"] = wire(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", end="rst", delay=0.2)
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"{}")
    expect_committed(broker, response, 201, b"ok", "content-length")


@pytest.mark.parametrize("base", BASES)
def test_a_response_and_an_immediate_reset(broker, raw, base):
    raw.scripts["x"] = wire(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", end="rst")
    with broker.client() as client:
        response = client.post(base + "/p/x", content=b"{}")
    if response.status_code == 201:
        expect_committed(broker, response, 201, b"ok", "content-length")
    else:
        expect_unknown(broker, response, "REMOTE_OUTCOME_UNKNOWN")


# ------------------------------------------------------------------------------- transfer codings


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def test_chunked_then_gzip_read_to_close_is_recorded_as_its_content(broker, raw):
    """RFC 9112 6.1: a response may apply chunked before another coding if it ends by closing. The
    wire body is gzip(chunked("ok")); its content is "ok", not the chunk framing."""
    raw.scripts["x"] = wire(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n" + _gzip(b"2\r\nok\r\n0\r\n\r\n"))
    with broker.client() as client:
        response = client.post(TLS + "/p/x", content=b"{}")
    expect_committed(broker, response, 200, b"ok", "close")


# ------------------------------------------------------------------------------- keep-alive after odd answers


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("first", [
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nsmuggled!",
    b"HTTP/1.1 204 No Content\r\nContent-Length: 40\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nsmuggled!",
    b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nsmuggled!",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nsmuggled!",
], ids=["interims", "cl_smaller", "204_body", "http10_chunked_ka", "chunked_junk"])
def test_the_next_request_on_a_kept_connection_gets_its_own_answer(broker, raw, base, first):
    raw.scripts["first"] = wire(first, end="keep")
    with broker.client() as client:
        one = client.post(base + "/p/first", content=b"{}")
        two = client.post(base + "/p/ok?second=1", content=b"{}")
    assert one.status_code in (200, 204), one.content
    assert two.status_code == 200 and b"second=1" in two.content and b"smuggled" not in two.content, two.content
    assert b"smuggled" not in result_of(broker, two.headers["affidavit-invocation-id"]).content
