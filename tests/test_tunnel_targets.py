"""Can an agent's request reach another target, path or method than the one the broker checked
against its routes and recorded (or carry a credential to a host it should not)?

CONNECT host vs the Host / :authority / absolute-form / SNI inside the tunnel, HTTP/2 framing
edge cases, ports, IPv6 literals, IDNA and odd host spellings. Each case checks the agent's
answer, the record at the side API, and what the hostile upstream received.
"""

from __future__ import annotations

import base64
import socket
import ssl
import struct
import threading
import time
from typing import Any, Iterator

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from tests.conftest import module_broker, standard_routes
from tests.support.broker import BrokerProcess, split_response
from tests.support.envelopes import check_envelope
from tests.support.h2agent import take_in
from tests.support.hostile import HostileUpstream

SECRET_ENV = "PAYMENTS_KEY"


def probe_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    plain = f"127.0.0.1:{up.http_port}"
    return [
        *standard_routes(up),
        {"name": "alt8443", "host": "alt.example.test", "port": 8443, "methods": ["GET", "POST"], "agents": ["builder"],
         "credential": "payments-key", "inject": {"header": "X-Api-Key", "value": "{secret}"}, "connect_to": good},
        {"name": "v6plain", "host": "[::1]", "port": 80, "scheme": "http", "methods": ["GET"], "agents": ["builder"],
         "connect_to": plain},
        {"name": "kv", "host": "kv.example.test", "port": 443, "methods": ["GET", "POST"], "agents": ["builder"],
         "credential": "payments-key", "inject": {"header": "X-Api-Key", "value": "{secret}"}, "connect_to": good},
        {"name": "idn", "host": "xn--bcher-kva.example.test", "port": 443, "methods": ["GET"], "agents": ["builder"],
         "connect_to": good},
        {"name": "kplain", "host": "kplain.example.test", "port": 80, "scheme": "http", "methods": ["GET"],
         "agents": ["builder"], "credential": "payments-key", "inject": {"header": "X-Api-Key", "value": "{secret}"},
         "connect_to": plain},
        {"name": "slowpost", "host": "slow.example.test", "port": 443, "methods": ["GET", "POST"], "agents": ["builder"],
         "connect_to": good},
    ]


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki, upstream_server) -> Iterator[BrokerProcess]:
    yield from module_broker(request, tmp_path_factory, pki, probe_routes(upstream_server), name="tunnel-targets", dialect="sqlite")


# -- helpers ---------------------------------------------------------------------------------


def raw_connect(broker: BrokerProcess, authority: bytes, timeout: float = 10) -> tuple[socket.socket, bytes]:
    """CONNECT ``authority`` with builder's credentials; (socket, the proxy's answer head)."""
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    sock = socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=timeout)
    sock.sendall(b"CONNECT " + authority + b" HTTP/1.1\r\nHost: " + authority + b"\r\nProxy-Authorization: Basic " + basic + b"\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return sock, head


def tls_tunnel(broker: BrokerProcess, authority: bytes, sni: str | None, alpn: str = "http/1.1") -> ssl.SSLSocket:
    """CONNECT ``authority``, then TLS with ``sni`` (None: no SNI), trusting the broker's CA but
    not checking the name (the point is which name the broker uses upstream)."""
    sock, head = raw_connect(broker, authority)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.create_default_context(cafile=str(broker.ca_path))
    context.check_hostname = False
    context.set_alpn_protocols([alpn])
    return context.wrap_socket(sock, server_hostname=sni)


def http1_exchange(sock: socket.socket, request: bytes, timeout: float = 15) -> tuple[int, dict[str, str], bytes]:
    sock.settimeout(timeout)
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    status, headers, body = split_response(data)
    length = int(headers.get("content-length", "0"))
    deadline = time.monotonic() + timeout
    while len(body) < length and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def record_of(broker: BrokerProcess, headers: dict[str, str]) -> dict[str, Any]:
    return broker.invocation(headers["affidavit-invocation-id"], broker.operator_token)


def sni_of(r: Any) -> str | None:
    """The server name the upstream was sent, case folded: the broker keeps upstream connections
    per host, case-insensitively, so a request may ride a connection opened for an earlier one
    that spelled the host in upper case (see test_an_upper_case_connect_host_reaches_the_route_host)."""
    return r.sni.lower() if r.sni is not None else None


def latest(broker: BrokerProcess, **params: Any) -> list[dict[str, Any]]:
    with broker.operator() as api:
        return api.get("/v1/invocations", params={"limit": 20, **params}).json()["items"]


class H2Raw:
    """An HTTP/2 agent over an already open TLS socket: frames exactly as given."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
                                           normalize_outbound_headers=False, validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.flush()
        self.streams: dict[int, dict[str, Any]] = {}
        self.closed = False
        #: the error code of the GOAWAY the broker sent, if it sent one
        self.goaway: int | None = None

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send(self, headers: list[tuple[str, str]], body: bytes = b"", end_stream: bool = True, flush: bool = True) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, headers, end_stream=end_stream and not body)
        if body:
            self.conn.send_data(sid, body, end_stream=end_stream)
        self.streams[sid] = {"headers": None, "body": b"", "ended": None, "reset": None}
        if flush:
            self.flush()
        return sid

    def read_until(self, done, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; streams={self.streams}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except (ConnectionError, ssl.SSLError):
                data = b""
            if not data:
                self.closed = True
                return
            if (goaway := take_in(self.conn, self.streams, data)) is not None:
                self.goaway, self.closed = goaway, True
            self.flush()

    def response(self, sid: int, timeout: float = 15) -> tuple[int | None, dict[str, str], bytes]:
        self.read_until(lambda: self.streams[sid]["ended"] is not None or self.closed, timeout)
        state = self.streams[sid]
        headers = dict(state["headers"] or [])
        status = headers.pop(":status", None)
        return (int(status) if status else None), headers, state["body"]


def reset_and_carry_on(agent: H2Raw, sid: int) -> None:
    """RST_STREAM(CANCEL) on ``sid``, in one write with whatever is pending; the connection's next
    request is still answered."""
    agent.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    agent.flush()
    ok = agent.send(req_headers("GET", "/h/ok?after=1", "slow.example.test"))
    assert agent.response(ok)[0] == 200


def h2_tunnel(broker: BrokerProcess, host: str, port: int = 443, sni: str | None = None) -> H2Raw:
    sock = tls_tunnel(broker, f"{host}:{port}".encode(), sni if sni is not None else host, alpn="h2")
    assert sock.selected_alpn_protocol() == "h2"
    return H2Raw(sock)


def req_headers(method: str, path: str, authority: str, scheme: str = "https", extra: list[tuple[str, str]] | None = None):
    return [(":method", method), (":scheme", scheme), (":authority", authority), (":path", path), *(extra or [])]


# -- raw forwarding outside the broker -------------------------------------------------------


class RawListener:
    """A TCP listener on 127.0.0.1:``port`` that records every byte it receives."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.got = b""
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            conn.settimeout(2)
            try:
                while chunk := conn.recv(4096):
                    self.got += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(3)
        self.sock.close()


def _dns_query(name: bytes = b"exfil-secret-data.example") -> bytes:
    question = b"".join(bytes([len(p)]) + p for p in name.split(b".")) + b"\0" + struct.pack("!HH", 1, 1)
    message = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + question
    return struct.pack("!H", len(message)) + message


@pytest.mark.parametrize("port", [5353, 53])
def test_a_connect_to_a_dns_port_is_not_relayed_raw_outside_the_broker(broker: BrokerProcess, upstream: HostileUpstream, port: int):
    """mitmproxy's next_layer picks its DNS layer for a tunnel to port 53 or 5353 (before it looks
    at rawtcp), and that layer opens its own connection to the CONNECT target and relays the
    agent's DNS messages: no route checked, nothing recorded, to any host."""
    try:
        listener = RawListener(port)
    except OSError as exc:
        pytest.skip(f"cannot listen on {port}: {exc}")
    try:
        sock, head = raw_connect(broker, f"127.0.0.1:{port}".encode())
        with sock:
            # The tunnel opens (CONNECT is not routed; what is sent inside it is) ...
            assert head.startswith(b"HTTP/1.1 200"), head
            sock.sendall(_dns_query())
            sock.settimeout(3)
            # ... and the DNS message is read as the start of an HTTP request head, which never
            # ends: no answer comes back (and none from a DNS server through the broker).
            with pytest.raises(socket.timeout):
                sock.recv(4096)
        time.sleep(0.5)
    finally:
        listener.close()
    assert listener.connections == 0 and b"exfil-secret-data" not in listener.got, (
        f"the broker relayed the agent's bytes to 127.0.0.1:{port} itself: {listener.got!r}")


# -- the tunnel's host vs the request's ----------------------------------------------------------


def _secret(broker: BrokerProcess) -> str:
    return broker.env[SECRET_ENV]


@pytest.mark.parametrize("inner,path", [
    (b"GET /h/ok?case=hostB HTTP/1.1\r\nHost: review.example.test\r\n\r\n", "/h/ok?case=hostB"),
    (b"GET https://review.example.test/h/ok?case=absB HTTP/1.1\r\nHost: review.example.test\r\n\r\n", "/h/ok?case=absB"),
    (b"GET https://evil.test:8443/h/ok?case=absB2 HTTP/1.1\r\nHost: api.payments.test\r\n\r\n", "/h/ok?case=absB2"),
    (b"GET http://review.example.test/h/ok?case=absHttp HTTP/1.1\r\nHost: review.example.test\r\n\r\n",
     "/h/ok?case=absHttp"),
], ids=["host-header", "absolute-form", "absolute-other-port", "absolute-http"])
def test_http1_inside_a_tunnel_to_A_naming_B_reaches_only_A(broker: BrokerProcess, upstream: HostileUpstream, inner: bytes,
                                                            path: str):
    """Inside a tunnel to A the tunnel decides: a Host header or absolute-form target naming B is
    routed, recorded and sent as a request to A (A's route, A's credential, SNI and Host A)."""
    upstream.reset()
    with tls_tunnel(broker, b"api.payments.test:443", "api.payments.test") as sock:
        status, headers, body = http1_exchange(sock, inner)
    assert status == 200, (status, body[:300])
    record = record_of(broker, headers)
    assert (record["route"], record["target"]) == ("payments.create", "https://api.payments.test:443" + path), record
    [r] = upstream.received
    assert sni_of(r) == "api.payments.test" and r.path == path, (r.sni, r.path)
    assert [v for k, v in r.headers if k.lower() == "host"] == ["api.payments.test"], r.headers
    assert r.header("Authorization") == f"Bearer {_secret(broker)}"


@pytest.mark.parametrize("sni", [None, "review.example.test", "evil.test"], ids=["no-sni", "sni-B", "sni-evil"])
def test_sni_other_than_the_connect_host_changes_nothing_upstream(broker: BrokerProcess, upstream: HostileUpstream, sni):
    upstream.reset()
    with tls_tunnel(broker, b"api.payments.test:443", sni) as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: api.payments.test\r\n\r\n")
    assert status == 200, body[:300]
    record = record_of(broker, headers)
    assert record["route"] == "payments.create" and record["target"] == "https://api.payments.test:443/h/ok"
    [r] = upstream.received
    assert sni_of(r) == "api.payments.test" and r.header("Host") == "api.payments.test", (r.sni, r.headers)


@pytest.mark.parametrize("extra,authority", [
    ([], "review.example.test"),
    ([], "evil.test:8443"),
    ([("host", "evil.test")], "api.payments.test"),
    ([("host", "evil.test")], "review.example.test"),
], ids=["authority-B", "authority-other-port", "host-header-B", "both-differ"])
def test_http2_authority_or_host_naming_B_in_a_tunnel_to_A_reaches_only_A(broker: BrokerProcess, upstream: HostileUpstream, extra, authority):
    """In every case the request is routed and recorded as one to A, and sent to A only, with
    exactly one Host line (A)."""
    upstream.reset()
    agent = h2_tunnel(broker, "api.payments.test")
    try:
        sid = agent.send(req_headers("GET", "/h/ok?h2=1", authority, extra=extra))
        status, headers, body = agent.response(sid)
    finally:
        agent.sock.close()
    assert status == 200, (status, body[:300])
    record = record_of(broker, headers)
    assert (record["route"], record["target"]) == ("payments.create", "https://api.payments.test:443/h/ok?h2=1"), record
    [r] = upstream.received
    assert sni_of(r) == "api.payments.test" and r.path == "/h/ok?h2=1", (r.sni, r.path)
    assert [v for k, v in r.headers if k.lower() == "host"] == ["api.payments.test"], r.headers


# -- ports and host spellings --------------------------------------------------------------------


def test_connect_to_443_does_not_match_a_route_on_8443(broker: BrokerProcess, upstream: HostileUpstream):
    upstream.reset()
    with tls_tunnel(broker, b"alt.example.test:443", "alt.example.test") as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: alt.example.test:8443\r\n\r\n")
    assert status == 403 and check_envelope(body)["error"]["code"] == "INVALID_TARGET", body[:300]
    with tls_tunnel(broker, b"alt.example.test:8443", "alt.example.test") as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: alt.example.test\r\n\r\n")
    assert status == 200, body[:300]
    [r] = upstream.received
    assert r.header("Host") == "alt.example.test:8443" and r.sni == "alt.example.test" and r.header("X-Api-Key") == _secret(broker)
    assert record_of(broker, headers)["target"] == "https://alt.example.test:8443/h/ok"


def plain_proxy(broker: BrokerProcess, request_line_and_headers: bytes) -> tuple[int, dict[str, str], bytes]:
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    with socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=10) as sock:
        return http1_exchange(sock, request_line_and_headers + b"Proxy-Authorization: Basic " + basic + b"\r\n\r\n")


@pytest.mark.parametrize("target", [b"http://plain.example.test/h/ok", b"http://plain.example.test:80/h/ok",
                                    b"http://PLAIN.Example.TEST/h/ok", b"http://plain.example.test:080/h/ok"])
def test_absolute_form_default_port_spellings_reach_the_same_route(broker: BrokerProcess, upstream: HostileUpstream, target: bytes):
    upstream.reset()
    status, headers, body = plain_proxy(broker, b"GET " + target + b" HTTP/1.1\r\nHost: evil.test\r\n")
    assert status == 200, body[:300]
    [r] = upstream.received
    assert r.header("Host").lower() == "plain.example.test" and r.header("X-Api-Key") == _secret(broker), r.headers
    assert record_of(broker, headers)["target"] == "http://plain.example.test:80/h/ok"


@pytest.mark.parametrize("target", [b"http://user@plain.example.test/h/ok", b"http://user:pw@plain.example.test/h/ok",
                                    b"http://plain%2eexample.test/h/ok", b"http://evil.test\\@plain.example.test/h/ok",
                                    b"http://plain.example.test%00.evil.test/h/ok", b"http://plain.example.test:80@evil.test/h/ok"])
def test_absolute_form_userinfo_or_encoded_hosts_never_reach_another_host(broker: BrokerProcess, upstream: HostileUpstream, target: bytes):
    """Each spelling is refused as malformed before anything is routed: no record, nothing sent."""
    upstream.reset()
    status, headers, body = plain_proxy(broker, b"GET " + target + b" HTTP/1.1\r\nHost: plain.example.test\r\n")
    assert status == 400, (status, body[:300])
    envelope = check_envelope(body)
    assert envelope["error"]["code"] == "MALFORMED_REQUEST" and envelope["invocation_id"] is None, envelope
    assert "affidavit-invocation-id" not in headers, headers
    assert upstream.received == []


def test_an_ipv6_literal_route_matches_its_host(broker: BrokerProcess, upstream: HostileUpstream):
    """Route host "[::1]" (the only way configuration takes an IPv6 literal): a request to
    http://[::1]/ should match it."""
    upstream.reset()
    status, headers, body = plain_proxy(broker, b"GET http://[::1]/h/ok HTTP/1.1\r\nHost: [::1]\r\n")
    assert status == 200, (status, body[:400])
    [r] = upstream.received
    assert r.header("Host") == "[::1]"


def test_an_upper_case_connect_host_reaches_the_route_host(broker: BrokerProcess, upstream: HostileUpstream):
    upstream.reset()
    with tls_tunnel(broker, b"API.PAYMENTS.TEST:443", "API.PAYMENTS.TEST") as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: API.PAYMENTS.TEST\r\n\r\n")
    assert status == 200, body[:300]
    [r] = upstream.received
    assert r.header("Host").lower() == "api.payments.test" and sni_of(r) == "api.payments.test"


def test_a_trailing_dot_host_is_refused(broker: BrokerProcess, upstream: HostileUpstream):
    upstream.reset()
    with tls_tunnel(broker, b"api.payments.test.:443", "api.payments.test") as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: api.payments.test.\r\n\r\n")
    assert status == 403 and check_envelope(body)["error"]["code"] == "INVALID_TARGET"
    assert upstream.received == []


def test_a_kelvin_sign_host_reaches_the_upstream_as_the_route_host(broker: BrokerProcess, upstream: HostileUpstream):
    """'\u212av.example.test' lower-cases (Python) to the route's 'kv.example.test', and IDNA maps it to
    the same name for DNS and SNI: the Host header the upstream reads must be that name too, not the
    agent's Unicode spelling (a virtual-host server would not know it)."""
    upstream.reset()
    sock, head = raw_connect(broker, "\u212av.example.test:443".encode())
    sock.close()
    # mitmproxy refuses a CONNECT authority that is not ASCII (it IDNA-decodes the bytes).
    assert head.startswith(b"HTTP/1.1 400") and b"MALFORMED_REQUEST" in head, head[:200]
    assert upstream.received == []


def test_an_idn_route_written_as_its_a_label_matches_the_a_label_host(broker: BrokerProcess, upstream: HostileUpstream):
    """Configuration takes ASCII host names only, so an IDN route is written as its A-label; an agent
    that CONNECTs to that same A-label must match it, and the upstream see the A-label in Host."""
    upstream.reset()
    with tls_tunnel(broker, b"xn--bcher-kva.example.test:443", "xn--bcher-kva.example.test") as sock:
        status, headers, body = http1_exchange(sock, b"GET /h/ok HTTP/1.1\r\nHost: xn--bcher-kva.example.test\r\n\r\n")
    assert status == 200, (status, body[:400])
    [r] = upstream.received
    assert r.header("Host") == "xn--bcher-kva.example.test"


def test_a_kelvin_sign_host_header_in_origin_form_reaches_the_upstream_as_the_route_host(broker: BrokerProcess, upstream: HostileUpstream):
    """Origin-form through the plain proxy: mitmproxy takes the host from the Host header as text
    (no IDNA decoding), and '\u212aplain.example.test' lower-cases to the route's host."""
    upstream.reset()
    status, headers, body = plain_proxy(broker, "GET /h/ok HTTP/1.1\r\nHost: \u212aplain.example.test\r\n".encode())
    assert status == 200, (status, body[:300])
    record = record_of(broker, headers)
    assert (record["route"], record["target"]) == ("kplain", "http://kplain.example.test:80/h/ok"), record
    [r] = upstream.received
    assert r.tls is None and r.path == "/h/ok", (r.tls, r.path)
    assert [v for k, v in r.headers if k.lower() == "host"] == ["kplain.example.test"], r.headers
    assert r.header("X-Api-Key") == _secret(broker)


# -- HTTP/2 specifics -----------------------------------------------------------------------------


@pytest.mark.parametrize("method,path,status,code,sent", [
    ("GET", "h/ok", 400, "MALFORMED_REQUEST", None),
    ("OPTIONS", "*", 400, "MALFORMED_REQUEST", None),
    ("GET", "", 400, "MALFORMED_REQUEST", None),
    ("GET", "?a=1", 400, "MALFORMED_REQUEST", None),
    ("GET", "http://evil.test/h/ok", 400, "MALFORMED_REQUEST", None),
    ("GET", "//evil.test/h/ok", 200, None, "//evil.test/h/ok"),
], ids=["no-slash", "asterisk", "empty", "query-only", "absolute", "double-slash"])
def test_http2_odd_paths_never_reach_another_path_than_recorded(broker: BrokerProcess, upstream: HostileUpstream, method, path,
                                                                 status, code, sent):
    """A :path that is not origin-form (RFC 9113 8.3.1) is malformed: refused (recorded, not
    sent). An empty one went upstream as "/" and "?a=1" as it was, with the route's credential,
    matched as if it were "/". One that is sent is sent exactly as recorded."""
    upstream.reset()
    agent = h2_tunnel(broker, "api.payments.test")
    try:
        sid = agent.send(req_headers(method, path, "api.payments.test"))
        got, headers, body = agent.response(sid)
    finally:
        agent.sock.close()
    assert got == status, (got, body[:300])
    record = record_of(broker, headers)
    if code is None:
        [r] = upstream.received
        assert (r.method, r.path, r.header("Host"), sni_of(r)) == (method, sent, "api.payments.test", "api.payments.test"), r
        assert (record["target"], record["outcome"]) == ("https://api.payments.test:443" + sent, "committed"), record
    else:
        assert check_envelope(body)["error"]["code"] == code, body[:300]
        assert upstream.received == []
        # recorded as the agent spelled it (an empty path as "/"), refused and not attempted
        assert (record["target"], record["code"], record["outcome"]) == (
            "https://api.payments.test:443" + (path or "/"), code, "not_attempted"), record


@pytest.mark.parametrize("fields,status", [
    ([(":method", "CONNECT"), (":authority", "evil.test:443")], 400),
    ([(":method", "CONNECT"), (":scheme", "https"), (":authority", "evil.test:443"), (":path", "/h/ok")], 400),
    ([(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "https"), (":authority", "api.payments.test"),
      (":path", "/h/ok")], 400),
    ([(":method", "GET"), (":scheme", "HTTPS"), (":authority", "api.payments.test"), (":path", "/h/ok")], 400),
    ([(":method", "GET"), (":scheme", "http"), (":authority", "api.payments.test"), (":path", "/h/ok")], 200),
    ([(":method", "GET"), (":scheme", "ftp"), (":authority", "api.payments.test"), (":path", "/h/ok")], 400),
    ([(":method", "GET"), (":scheme", "https"), (":path", "/h/ok")], 200),
], ids=["connect", "connect-with-path", "extended-connect", "upper-scheme", "http-scheme", "ftp-scheme", "no-authority"])
def test_http2_connect_and_odd_schemes(broker: BrokerProcess, upstream: HostileUpstream, fields, status):
    """CONNECT (plain or extended) and a :scheme other than "https"/"http" are refused as
    malformed (nothing recorded, nothing sent), and the connection goes on; ":scheme http" or no
    :authority is sent as https to the tunnel's host, as recorded."""
    upstream.reset()
    agent = h2_tunnel(broker, "api.payments.test")
    try:
        sid = agent.send(fields)
        got, headers, body = agent.response(sid)
        ok = agent.send(req_headers("GET", "/h/ok?after=1", "api.payments.test"))
        after = agent.response(ok)[0]
    finally:
        agent.sock.close()
    assert got == status, (got, body[:300])
    assert after == 200
    if status == 400:
        envelope = check_envelope(body)
        assert envelope["error"]["code"] == "MALFORMED_REQUEST" and envelope["invocation_id"] is None, envelope
        assert "affidavit-invocation-id" not in headers, headers
        assert [r.path for r in upstream.received] == ["/h/ok?after=1"]
    else:
        record = record_of(broker, headers)
        assert (record["method"], record["target"]) == ("GET", "https://api.payments.test:443/h/ok"), record
        assert [r.path for r in upstream.received] == ["/h/ok", "/h/ok?after=1"]
    for r in upstream.received:
        assert (r.method, r.header("Host"), sni_of(r)) == ("GET", "api.payments.test", "api.payments.test"), (r.method, r.headers, r.sni)
        assert r.tls is not None  # the TLS listener: sent as https


def test_http2_many_small_headers(broker: BrokerProcess, upstream: HostileUpstream):
    """3000 small header fields (HEADERS plus CONTINUATION frames): the connection is ended at
    once (GOAWAY PROTOCOL_ERROR, then EOF), the stream gets no response, nothing is recorded or
    sent."""
    upstream.reset()
    agent = h2_tunnel(broker, "api.payments.test")
    try:
        extra = [(f"x-h{i}", "v") for i in range(3000)]
        t0 = time.monotonic()
        sid = agent.send(req_headers("GET", "/h/ok?many=1", "api.payments.test", extra=extra))
        status, headers, body = agent.response(sid, timeout=30)
        took = time.monotonic() - t0
        agent.sock.settimeout(10)
        rest = agent.sock.recv(4096)
    finally:
        agent.sock.close()
    assert took < 10, took
    assert (status, body, agent.streams[sid]["ended"]) == (None, b"", None), agent.streams
    assert agent.closed and agent.goaway == h2.errors.ErrorCodes.PROTOCOL_ERROR, agent.goaway
    assert rest == b"", rest  # the connection is closed
    time.sleep(0.5)
    assert upstream.received == []
    assert not [i for i in latest(broker) if i["target"].endswith("many=1")]


def test_http2_data_after_end_stream_is_not_sent(broker: BrokerProcess, upstream: HostileUpstream):
    """A DATA frame on a stream the agent already ended, in the same write (one TLS record, so
    read at once): the broker resets the stream (RST_STREAM STREAM_CLOSED) without an answer; the
    request is neither recorded nor sent, and the connection goes on."""
    from hyperframe.frame import DataFrame

    upstream.reset()
    agent = h2_tunnel(broker, "slow.example.test")
    try:
        sid = agent.send(req_headers("POST", "/h/slow?delay=0.3", "slow.example.test", extra=[("content-length", "2")]),
                         body=b"{}", end_stream=True, flush=False)
        frame = DataFrame(sid, data=b"EXTRA-BYTES")
        frame.flags.add("END_STREAM")
        agent.sock.sendall(agent.conn.data_to_send() + frame.serialize())
        status, headers, body = agent.response(sid)
        assert (status, body) == (None, b""), (status, body[:300])
        assert (agent.streams[sid]["ended"], agent.streams[sid]["reset"]) == ("StreamReset", h2.errors.ErrorCodes.STREAM_CLOSED)
        assert not agent.closed and agent.goaway is None
        ok = agent.send(req_headers("GET", "/h/ok?after=1", "slow.example.test"))
        assert agent.response(ok)[0] == 200
    finally:
        agent.sock.close()
    time.sleep(1.0)
    assert [(r.method, r.path) for r in upstream.received] == [("GET", "/h/ok?after=1")]
    assert not [i for i in latest(broker, route="slowpost") if i["target"].endswith("delay=0.3")]


@pytest.mark.parametrize("with_body", [False, True])
def test_http2_rst_stream_in_the_same_write_as_a_whole_request_sends_nothing(broker: BrokerProcess, upstream: HostileUpstream, with_body):
    """HEADERS (+DATA) with END_STREAM, then RST_STREAM(CANCEL), in one write: the agent abandoned
    the request before the broker could dispatch it. It must not be sent (not_attempted,
    CALLER_CANCELLED); if it is sent, the record must say so (unknown or the result, never
    not_attempted)."""
    upstream.reset()
    agent = h2_tunnel(broker, "slow.example.test")
    try:
        body = b'{"charge":1}' if with_body else b""
        sid = agent.send(req_headers("POST", f"/h/ok?rst={int(with_body)}", "slow.example.test",
                                     extra=[("content-length", str(len(body)))]), body=body, flush=False)
        reset_and_carry_on(agent, sid)
    finally:
        agent.sock.close()
    time.sleep(1.0)
    items = [i for i in latest(broker, route="slowpost") if i["method"] == "POST"]
    rec = broker.invocation(items[0]["invocation_id"], broker.operator_token) if items else None
    sent = [r for r in upstream.received if r.method == "POST"]
    if rec is None or not rec["target"].endswith(f"rst={int(with_body)}"):
        assert not sent, "sent, and not recorded"
        return  # refused before the broker saw it: nothing recorded, nothing sent
    _cancelled(rec, sent)


def _cancelled(rec: dict[str, Any], sent: list[Any]) -> None:
    """The record of a request its agent reset: never delivered. Read with the request's end (the
    usual case), the reset stops it before dispatch: nothing sent, not_attempted. On a loaded
    machine the reset can arrive in a later read, after dispatch began: then the request went out,
    and the record says the caller cancelled and the outcome is not not_attempted."""
    kinds = [e["kind"] for e in rec["events"]]
    assert "RESULT_DELIVERED" not in kinds, ("an answer the agent never got is not delivered", kinds)
    assert rec["caller_disposition"] == "cancelled", rec
    if "DISPATCH_STARTED" in kinds:
        assert kinds.index("CALLER_CANCELLED") > kinds.index("DISPATCH_STARTED") and rec["outcome"] != "not_attempted", kinds
    else:
        assert not sent, "a request its agent reset before dispatch was sent"
        assert (rec["outcome"], rec["code"]) == ("not_attempted", "CALLER_CANCELLED"), rec


def test_http2_rst_stream_before_the_request_ends_sends_and_records_nothing(broker: BrokerProcess, upstream: HostileUpstream):
    upstream.reset()
    agent = h2_tunnel(broker, "slow.example.test")
    try:
        sid = agent.send(req_headers("POST", "/h/ok?rst=early", "slow.example.test", extra=[("content-length", "5")]),
                         end_stream=False, flush=False)
        reset_and_carry_on(agent, sid)
    finally:
        agent.sock.close()
    time.sleep(0.5)
    assert [r.path for r in upstream.received] == ["/h/ok?after=1"]
    assert not [i for i in latest(broker, route="slowpost") if i["target"].endswith("rst=early")]


def test_http1_request_then_close_in_one_write_is_not_recorded_as_delivered(broker: BrokerProcess, upstream: HostileUpstream):
    """An HTTP/1 agent that sends a whole request and closes its connection at once never reads an
    answer: the record must not say it was delivered (and, left before dispatch, nothing is sent)."""
    upstream.reset()
    basic = base64.b64encode(f"builder:{broker.agents['builder'].token}".encode())
    sock = socket.create_connection(("127.0.0.1", broker.proxy_port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.sendall(b"POST http://plain.example.test/h/ok?closed=1 HTTP/1.1\r\nHost: plain.example.test\r\n"
                 b"Content-Length: 2\r\nProxy-Authorization: Basic " + basic + b"\r\n\r\n{}")
    sock.close()
    # Which of three outcomes depends on when the broker reads the close (the request and the
    # close can come in one read or two, and the request hook may or may not have begun):
    #   - the flow ended before the broker took the request: no record, nothing sent;
    #   - it took the request with the agent already gone: recorded not_attempted,
    #     CALLER_CANCELLED, nothing sent;
    #   - the agent left after dispatch began: sent once, recorded as dispatched.
    # None of them records a delivery.
    deadline = time.monotonic() + 5
    items = []
    while not items and time.monotonic() < deadline:
        time.sleep(0.25)
        items = [i for i in latest(broker, route="plain") if i["target"].endswith("closed=1")]
    assert len(items) <= 1, items
    if not items:
        time.sleep(0.5)
        assert [r for r in upstream.received if r.path.endswith("closed=1")] == []
        return
    rec = broker.wait_for(items[0]["invocation_id"], lambda r: "FAILED" in [e["kind"] for e in r["events"]])
    kinds = [e["kind"] for e in rec["events"]]
    assert "RESULT_DELIVERED" not in kinds, kinds
    assert (rec["code"], rec["caller_disposition"]) == ("CALLER_CANCELLED", "disconnected"), rec
    assert rec["target"] == "http://plain.example.test:80/h/ok?closed=1", rec["target"]
    if rec["evidence"]["dispatch_started"]:
        assert "DISPATCH_STARTED" in kinds and rec["outcome"] != "not_attempted", rec
        [sent] = upstream.wait_for_requests(1, timeout=10)
        assert (sent.method, sent.path, sent.body) == ("POST", "/h/ok?closed=1", b"{}"), (sent.method, sent.path)
    else:
        assert "DISPATCH_STARTED" not in kinds and rec["outcome"] == "not_attempted", rec
        time.sleep(0.5)
        assert upstream.received == []


def test_http2_body_end_and_rst_stream_in_one_write_after_the_headers_sends_nothing(broker: BrokerProcess, upstream: HostileUpstream):
    """HEADERS first (the broker has screened them), then the last DATA frame (END_STREAM) and
    RST_STREAM(CANCEL) in one write: the agent cancelled before the broker began on the request.
    Nothing may be sent; the record says not_attempted, CALLER_CANCELLED, and no delivery."""
    upstream.reset()
    agent = h2_tunnel(broker, "slow.example.test")
    try:
        sid = agent.send(req_headers("POST", "/h/ok?rst=split", "slow.example.test", extra=[("content-length", "2")]),
                         end_stream=False)
        time.sleep(0.3)
        agent.conn.send_data(sid, b"{}", end_stream=True)
        reset_and_carry_on(agent, sid)
    finally:
        agent.sock.close()
    time.sleep(1.0)
    [item] = [i for i in latest(broker, route="slowpost") if i["target"].endswith("rst=split")]
    rec = broker.invocation(item["invocation_id"], broker.operator_token)
    _cancelled(rec, [r for r in upstream.received if r.path.endswith("rst=split")])


# -- what no record can hold ------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_method_or_target_no_record_can_hold_is_refused_unrecorded_and_spoils_no_other_write(make_broker, upstream, dialect):
    """On PostgreSQL a 17-character method (the column holds 16) or a NUL in a method or target
    failed the journal's write of its refusal, and with it the writes of other requests batched
    alongside: those got 503 JOURNAL_UNAVAILABLE, or their answers RESULT_STORE_FAILED. Bytes that
    are not UTF-8 failed the broker's own encoding of the record: a 500 "unknown, reconcile" for a
    request never sent. Each is now refused before anything is recorded, and the others go on."""
    from concurrent.futures import ThreadPoolExecutor

    broker = make_broker(dialect, routes=probe_routes(upstream))
    bad_lines = [b"A" * 17 + b" http://plain.example.test/h/ok HTTP/1.1\r\n", b"G\x00T http://plain.example.test/h/ok HTTP/1.1\r\n",
                 b"G\xffT http://plain.example.test/h/ok HTTP/1.1\r\n"]
    bad_streams = [("GET", b"/h/ok\x00b"), ("GET", b"/h/\xff"), (b"G\xffT", "/h/ok")]

    def normal(_: int) -> tuple[int, str | None]:
        with broker.client() as client:
            answer = client.get("http://plain.example.test/h/ok")
        return answer.status_code, answer.headers.get("affidavit-code")

    def refused(status: int, body: bytes) -> None:
        assert status == 400, (status, body[:300])
        envelope = check_envelope(body)
        assert (envelope["invocation_id"], envelope["error"]["code"], envelope["error"]["outcome"]) == (
            None, "MALFORMED_REQUEST", "not_attempted"), envelope
        assert "nothing was recorded" in envelope["error"]["message"], envelope

    upstream.reset()
    with ThreadPoolExecutor(8) as pool:
        for line, (method, path) in zip(bad_lines, bad_streams):
            others = [pool.submit(normal, n) for n in range(8)]
            status, _, body = plain_proxy(broker, line + b"Host: plain.example.test\r\n")
            refused(status, body)
            agent = h2_tunnel(broker, "api.payments.test")
            try:
                got, _, body = agent.response(agent.send([(":method", method), (":scheme", "https"),
                                                          (":authority", "api.payments.test"), (":path", path)]))
            finally:
                agent.sock.close()
            refused(got, body)
            assert [f.result(timeout=30) for f in others] == [(200, None)] * 8
    assert len(upstream.received) == 24 and {r.path for r in upstream.received} == {"/h/ok"}
    assert len(latest(broker, limit=100)) == 24, "the refused requests left no record"
    assert "Traceback" not in broker.logs() and "journal write failed" not in broker.logs()
    assert broker.logs().count("refused a request of agent builder it cannot record: 400 MALFORMED_REQUEST") == 6
