"""The mitmproxy adapter: agent identity, flows in, replies out.

mitmproxy owns the agent's side of the connection (CONNECT, TLS interception, HTTP parsing).
Every request is answered by the broker through ``flow.response``, so mitmproxy never opens an
upstream connection of its own (``connection_strategy=lazy`` keeps it from connecting at
CONNECT time). A hook that raises would make mitmproxy forward the request unrecorded ("fail
open"), so every hook here catches everything and answers with an envelope instead.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gc
import hmac
import logging
import re
import time
import weakref
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable
from mitmproxy import http
from mitmproxy.connection import Client, ConnectionState

from . import metrics
from .broker import AgentRequest, Broker, Reply, internal_error, shown, unrecordable, unrecorded_refusal
from .contract import CallerDisposition, Code, Retry
from .failpoints import failpoint_now
from .logs import LogThrottle
from .upstream import HOP_BY_HOP, connection_options

if TYPE_CHECKING:
    from .deadlines import RequestClocks

log = logging.getLogger("affidavit.addon")

REALM = 'Basic realm="affidavit"'


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _reply_to_response(reply: Reply) -> http.Response:
    now = time.time()
    if not reply.framed and not any(k.lower() == "content-length" for k, _ in reply.headers):
        reply.headers.append(("Content-Length", str(len(reply.body))))
    return http.Response(
        http_version=b"HTTP/1.1",
        status_code=reply.status,
        reason=(reply.reason or _reason(reply.status)).encode("latin-1", "replace"),
        headers=http.Headers([(k.encode("latin-1", "replace"), v.encode("latin-1", "replace")) for k, v in reply.headers]),
        content=reply.body,
        trailers=None,
        timestamp_start=now,
        timestamp_end=now,
    )


def agent_fields(request: http.Request) -> list[tuple[str, str]]:
    """The request's header fields, in order, as the broker will send them over HTTP/1.1.

    An HTTP/2 or HTTP/3 client may split Cookie into one field per cookie (RFC 9113 8.2.3,
    RFC 9114 4.2.1); before the request goes on over HTTP/1.1 they must be joined with "; " into
    one field (RFC 6265 5.4: one Cookie header), which takes the place of the first. Every other
    field keeps its order and repeats. The broker (its checks, the fingerprint, the upstream) sees
    only the joined form, so a request is the same request whichever way the agent split its cookies.

    Fields the agent's ``Connection`` header names are options of the agent's hop (RFC 9110
    7.6.1): they are left out here, so that neither the checks nor the fingerprint see a field that
    is not sent. The fixed hop-by-hop fields stay visible (``Upgrade`` tells a WebSocket
    handshake); the upstream client never sends them.
    """
    fields = [(k, v) for k, v in request.headers.items(multi=True)]
    hop_only = connection_options(fields) - HOP_BY_HOP
    if hop_only:
        fields = [(k, v) for k, v in fields if k.lower() not in hop_only]
    cookies = [v for k, v in fields if k.lower() == "cookie"]
    if len(cookies) < 2 or not (request.is_http2 or request.is_http3):
        return fields
    joined: list[tuple[str, str]] = []
    for name, value in fields:
        if name.lower() != "cookie":
            joined.append((name, value))
        elif cookies:
            joined.append((name, "; ".join(cookies)))
            cookies = []
    return joined


def canonical_host(host: str) -> str:
    """The request's host as routes name it and as it goes upstream (DNS, SNI, ``Host``): an IPv6
    literal in brackets (mitmproxy hands it over bare; a route writes ``[::1]``), and a name that
    is not ASCII as its IDNA A-label, the name DNS and TLS are given anyway. mitmproxy decodes an
    A-label it reads (``xn--bcher-kva``) to Unicode, and takes a ``Host`` header's text as it is:
    ``\u212aplain.example.test`` matched ``kplain.example.test`` (Python lower-cases the Kelvin
    sign to ``k``) while its own bytes went upstream in ``Host``."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    if not host.isascii():
        try:
            return host.encode("idna").decode("ascii").lower()
        except UnicodeError:
            return host  # no name DNS knows: no route names it either
    return host


def _refusal(status: int, code: Code, message: str, extra_headers: list[tuple[str, str]] | None = None, *,
             retry: Retry = Retry.AFTER_CORRECTION, evidence: dict[str, Any] | None = None) -> http.Response:
    """An unrecorded refusal of the adapter's own (``invocation_id`` null): validation, not attempted."""
    return _reply_to_response(unrecorded_refusal(status, code, message, extra_headers, retry=retry, evidence=evidence))


def auth_required() -> http.Response:
    return _refusal(
        407,
        Code.PROXY_AUTH_REQUIRED,
        "Proxy authentication is required: use http://AGENT:TOKEN@host:port as the proxy URL. "
        "Nothing was sent and nothing was recorded.",
        [("Proxy-Authenticate", REALM)],
    )


def credentials_rejected(close: bool) -> http.Response:
    """``close``: end the connection after this answer (HTTP/1), so that a guess costs a new
    connection; a client that sent no credentials yet keeps its connection for the retry."""
    return _refusal(
        407,
        Code.PROXY_AUTH_REQUIRED,
        "The proxy credentials were not accepted: the agent name or its token in the proxy URL "
        "(http://AGENT:TOKEN@host:port) is wrong, or the token was rotated. "
        "Nothing was sent and nothing was recorded.",
        [("Proxy-Authenticate", REALM), *([("Connection", "close")] if close else [])],
    )


class RejectionLog(LogThrottle):
    """Wrong proxy credentials, logged for the operator without letting a guessing client flood
    the log: the first rejection of a (who, address) pair is logged at once; further ones within
    ``window`` seconds are counted, and the next rejection after the window is logged with that
    count. ``affidavit_proxy_auth_rejected`` counts every one."""

    def __init__(self, window: float = 60.0, pairs: int = 1024, clock: Callable[[], float] = time.monotonic):
        super().__init__(window, pairs, clock)

    def rejected(self, known: str | None, address: str) -> None:
        metrics.PROXY_AUTH_REJECTED.labels(known or "(unknown)").inc()
        skipped = self.admit((known, address))
        if skipped is None:
            return
        who = f"agent {known!r}" if known else "an agent name this broker does not know"
        more = self.note(skipped, "from there")
        log.warning("proxy credentials rejected for %s from %s%s", who, address, more,
                    extra={"agent": known, "code": Code.PROXY_AUTH_REQUIRED.value, "not_logged": skipped})


#: Fields HTTP/2 forbids in a request (RFC 9113 8.2.2): each only means something on one
#: HTTP/1.1 hop. ``te`` is allowed with the value ``trailers`` alone.
_CONNECTION_SPECIFIC = frozenset({b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"})
#: An HTTP/2 field name: a token (RFC 9110 5.1) in lower case (RFC 9113 8.2.1).
_HTTP2_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")


def http2_malformed(request: http.Request) -> str | None:
    """Why an HTTP/2 request's header fields break HTTP/2's rules (RFC 9113 8.2), or None. Such a
    request is malformed and must not be forwarded (8.1.1); it is refused alone, with an
    envelope, while the connection's other requests go on. (Line breaks and NUL bytes, which
    would split the request sent upstream, are the broker's check, on either HTTP version.)"""
    for name, value in request.headers.fields:
        if not _HTTP2_FIELD_NAME.fullmatch(name):
            return (f"The request header {shown(name.decode('latin-1'))!r} is not a valid HTTP/2 field name "
                    "(lower-case letters, digits and !#$%&'*+-.^_`|~ only; RFC 9113 8.2.1).")
        if name in _CONNECTION_SPECIFIC or (name == b"te" and value.strip().lower() != b"trailers"):
            return (f"The request carries the connection-specific header {name.decode()!r}, which HTTP/2 forbids "
                    "(RFC 9113 8.2.2).")
        if value[:1] in (b" ", b"\t") or value[-1:] in (b" ", b"\t"):
            return (f"The value of the request header {name.decode()!r} begins or ends with whitespace, which "
                    "HTTP/2 forbids (RFC 9113 8.2.1).")
    return None


def http2_refused(why: str) -> http.Response:
    log.info("refused a malformed HTTP/2 request on its stream alone: 400 %s", Code.MALFORMED_REQUEST.value)
    return _refusal(
        400, Code.MALFORMED_REQUEST,
        f"{why} Nothing was sent upstream and nothing was recorded; the connection's other requests go on. "
        "Fix the client's request.",
    )


def wrong_http1_version(flow: http.HTTPFlow) -> http.Response | None:
    """The refusal of a request line (a CONNECT's too) on an HTTP/1 connection that names another
    version than HTTP/1.0 or HTTP/1.1, else None. mitmproxy reads ``HTTP/2.0`` (or ``HTTP/3.0``,
    ``HTTP/1.9``) there as HTTP/1 but calls it that version, so neither version's rules would be
    the ones it was checked by (HTTP/2 is spoken only where TLS negotiated it, ALPN ``h2``)."""
    version = flow.request.http_version
    if version in ("HTTP/1.1", "HTTP/1.0") or flow.client_conn.alpn == b"h2" or flow.request.is_http3:
        return None
    log.info("refused a request line saying %s on an HTTP/1 connection: 400 %s", shown(version, 20),
             Code.MALFORMED_REQUEST.value)
    return _refusal(
        400, Code.MALFORMED_REQUEST,
        f"The request line says {shown(version, 20)}, but this connection speaks HTTP/1 (HTTP/1.1 or HTTP/1.0; HTTP/2 "
        "is spoken only inside TLS, negotiated as h2). Nothing was sent upstream and nothing was recorded. Send the "
        "request as HTTP/1.1.",
    )


def trailers_refused() -> http.Response:
    """A request with trailer fields: the broker forwards none (its upstream client sends no
    trailers and the fingerprint covers none), and sending the request without them would send
    something other than what the agent asked for. Refused whole, over either HTTP version."""
    log.info("refused a request with trailer fields: 400 %s", Code.MALFORMED_REQUEST.value)
    return _refusal(
        400,
        Code.MALFORMED_REQUEST,
        "The request carries trailer fields (after its chunked body, or in a last HTTP/2 HEADERS frame). "
        "The broker does not forward request trailers, and sending the request without them would change it. "
        "Nothing was sent upstream and nothing was recorded. Send these fields as headers instead.",
    )


#: The most an agent's HTTP/1 request head (request line and headers, a CONNECT's too) may take.
#: mitmproxy holds a head whole however long it is ("FIXME: protect against header size DoS" in
#: its ``Http1Server.read_headers``); over HTTP/2, hpack's header list limit (64 KiB) applies.
MAX_REQUEST_HEAD = 64 * 1024


#: The longest chunk-size line (the size in hex and any chunk extensions, RFC 9112 7.1.1) an
#: agent's chunked request body may have.
MAX_CHUNK_LINE = 4096

#: How long a connection whose request body was refused before it was read whole (over the limit,
#: or broken framing) keeps being read, and what arrives dropped, after the refusal went out:
#: until the agent closes, or this many seconds.
LINGER = 10.0


def connection_handler(client: Client) -> Any:
    """mitmproxy's handler of the agent's connection ``client``; None once it is gone (or with no
    master, or one without a proxyserver)."""
    try:
        from mitmproxy import ctx

        return ctx.master.addons.get("proxyserver").connections.get(client.id)
    except Exception:
        return None


def install_core_refusals(body_limit: int, clocks: "RequestClocks | None" = None) -> None:
    """Make the refusals mitmproxy sends itself, before any hook runs, envelopes like every
    other: HTTP it cannot parse (400) and a body over its ``body_size_limit`` (413).

    mitmproxy turns both into a ``ResponseProtocolError`` that each HTTP version renders as an
    HTML page: HTTP/1 through ``_http1.make_error_response`` (a module function looked up at call
    time, replaced here), HTTP/2 inside ``Http2Server._handle_event`` (wrapped here: the error
    becomes the ordinary response events, which mitmproxy sends as it sends any response). Other
    statuses keep mitmproxy's page; the broker never lets mitmproxy connect upstream, so they do
    not arise. Neither refusal is recorded: the agent is not yet authenticated and nothing was read
    that could be sent. mitmproxy's own text (which may quote the client's bytes) stays out of the
    envelope. Pinned by tests/test_broker_e2e.py::test_requests_the_proxy_core_refuses_get_envelopes.

    An HTTP/1 request body mitmproxy cannot read gets no answer of its own: a broken chunk only
    closes the connection (and some broken chunks h11 lets pass or waits on: see the reader
    below), and trailers after a chunked body raise ``NotImplementedError`` ("HTTP trailers are
    not implemented yet"), which crashes the connection's handler and leaves the agent waiting
    with the connection open. ``Http1Server.read_body`` is wrapped here so that both end in
    an envelope (400) and a close, the way mitmproxy ends a request head it cannot parse. Pinned by
    tests/test_broker_e2e.py::test_request_trailers_are_refused_over_either_http_version.

    An HTTP/1 request head longer than :data:`MAX_REQUEST_HEAD`, whole or still growing, is refused
    (431) and its connection closed: ``Http1Server.read_headers`` is wrapped here, since mitmproxy
    would otherwise hold it whole, from anyone who can reach the port, before any credential is
    looked at. Pinned by tests/test_broker_e2e.py::test_an_endless_request_head_is_refused_on_the_proxy_port.
    The wrapper also reads on past blank lines before a request line, which mitmproxy skips one per
    read and then waits for more bytes with the request in hand. Pinned by
    tests/test_request_deadlines.py::test_a_whole_request_after_blank_lines_in_one_read_is_answered_at_once.

    The same HTTP/1 readers and the HTTP/2 connection's event handler run ``clocks``, the
    deadlines of a request that arrives slowly (proxy/deadlines.py): after each read they start
    or stop the clock of the part of the request still awaited, and an expiry reaches them as a
    ``Wakeup`` event, which they hand to ``clocks``. Pinned by tests/test_request_deadlines.py.
    """
    from h11 import EndOfMessage, ProtocolError
    from h11._readers import ChunkedReader
    from mitmproxy.net.http.http1 import assemble_response
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import (
        RequestProtocolError,
        ResponseData,
        ResponseEndOfMessage,
        ResponseHeaders,
        ResponseProtocolError,
    )
    from mitmproxy.proxy.layers.http import _http1, _http2
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.tls import ClientTLSLayer
    from OpenSSL import SSL

    from .deadlines import expired  # deadlines builds on this module: imported once both are loaded

    try:  # mitmproxy 12: a protocol error's code is an ErrorCode that knows its HTTP status
        from mitmproxy.proxy.layers.http import ErrorCode

        unreadable_request: Any = ErrorCode.REQUEST_VALIDATION_FAILED
    except ImportError:  # mitmproxy 11: the code is the HTTP status itself
        unreadable_request = 400

    def status_of(code: Any) -> int | None:
        to_status = getattr(code, "http_status_code", None)
        return to_status() if to_status is not None else code

    def refusal(status: int) -> http.Response | None:
        if status == 413:
            response = _refusal(
                413,
                Code.PAYLOAD_LIMIT,
                f"The request body is larger than any route accepts (the broker reads at most {body_limit} bytes); "
                "it was refused before it was read. Nothing was sent upstream and nothing was recorded. "
                "Send a smaller body.",
            )
        elif status == 431:
            response = _refusal(
                431,
                Code.MALFORMED_REQUEST,
                f"The request line and headers are larger than the broker reads ({MAX_REQUEST_HEAD} bytes); the "
                "request was refused before it was read whole. Nothing was sent upstream and nothing was recorded. "
                "Send smaller headers.",
            )
        elif status == 400:
            response = _refusal(
                400,
                Code.MALFORMED_REQUEST,
                "The request is not valid HTTP (its request line, headers or framing could not be parsed), so the "
                "broker could not read it. Nothing was sent upstream and nothing was recorded. Fix the client's request.",
            )
        else:
            return None
        log.info("the proxy core refused a request: %d %s", status, response.headers["Affidavit-Code"])
        return response

    def refuse_and_linger(server: _http1.Http1Server, response: http.Response) -> Any:
        """Send ``response`` and close, lingering: stop sending (a FIN after the answer) but keep
        reading, and dropping, whatever the agent still sends, until it closes or :data:`LINGER`
        seconds pass. A close with the agent's bytes unread makes the kernel answer them with a
        reset, which discards the refusal at the agent's end before a client that reads only after
        sending its whole body (urllib3, curl with a chunked body) has read it: the agent saw a
        broken connection instead of the envelope. Nothing the agent sends afterwards is parsed,
        so no request after a refusal on this connection can reach the broker."""
        response.headers["Connection"] = "close"
        yield commands.SendData(server.conn, assemble_response(response))
        handler = connection_handler(server.conn)
        if handler is None or server.conn not in handler.transports:
            yield commands.CloseConnection(server.conn)
            server.state = server.done
            return
        # Below mitmproxy's layers (the answer is written by now): a half-close sent through
        # them would reach a CONNECT tunnel's own stream as the tunnel's end, which closes the
        # connection whole. Over TLS a close_notify goes first: a bare FIN is a truncation to the
        # agent's TLS library (OpenSSL answers it with a decode_error alert).
        if goodbye := close_notify(server):
            handler.transports[server.conn].writer.write(goodbye)
        handler.close_connection(server.conn, half_close=True)
        server.state = functools.partial(lingering, server)
        asyncio.get_running_loop().call_later(LINGER, close_lingering, weakref.ref(server.conn))

    def lingering(server: _http1.Http1Server, event: Any) -> Any:
        if isinstance(event, events.ConnectionClosed):
            yield commands.CloseConnection(server.conn)
            server.state = server.done
            return
        server.buf = type(server.buf)()  # dropped, unparsed
        yield from ()

    def close_notify(server: _http1.Http1Server) -> bytes:
        """The bytes of a TLS close_notify on the agent's connection, when the broker terminates
        TLS on it; else nothing."""
        for layer in server.context.layers:
            if isinstance(layer, ClientTLSLayer) and layer.conn is server.conn and getattr(layer, "tls", None) is not None:
                try:
                    layer.tls.shutdown()
                    return layer.tls.bio_read(65536)
                except SSL.Error:
                    return b""
        return b""

    def close_lingering(conn: "weakref.ref[Client]") -> None:
        client = conn()
        if client is None or client.state is ConnectionState.CLOSED:
            return
        handler = connection_handler(client)
        if handler is not None and client in handler.transports:
            handler.close_connection(client)

    def unanswered(server: _http1.Http1Server) -> bool:
        """No final answer went out yet: none, or only an interim one (the ``100 Continue`` mitmproxy
        sends an agent that asked for it, which mitmproxy's own error path takes for an answer
        and then closes without one)."""
        return server.response is None or server.response.status_code < 200

    make_error_response = getattr(_http1.make_error_response, "__wrapped__", _http1.make_error_response)

    def http1_error_response(status_code: int, message: str = "") -> bytes:
        response = refusal(status_code)
        if response is None:
            return make_error_response(status_code, message)
        response.headers["Connection"] = "close"  # mitmproxy closes the connection after it
        return assemble_response(response)

    class Unreadable(Exception):
        """The agent's request body cannot be read as sent; ``args[0]`` is the refusal."""

    class AgentBodyReader:
        """h11's body reader, except that a framing error or a trailer section ends the body
        with :class:`Unreadable`, which mitmproxy's own ``read_body`` does not catch.

        h11 (0.14, the line mitmproxy 11 allows) is lenient with chunked framing in two ways
        that matter here: it drops the two bytes after a chunk's data unread (``helloXX`` passes
        for ``hello\\r\\n``: a body the upstream may frame differently), and it waits for a
        chunk-size line to end in CRLF however long the line grows (a bare LF, ``5\\nhello``,
        leaves the agent waiting for an answer that never comes). Both are framing errors here.
        It also holds a trailer section whole, however long, before it ends; trailers are
        refused as soon as their first byte arrives."""

        def __init__(self, reader: Any):
            self.reader = reader
            self.chunked = isinstance(reader, ChunkedReader)

        def __call__(self, buf: Any) -> Any:
            if self.chunked and (refused := self.misframed(buf)) is not None:
                raise Unreadable(refused)
            try:
                event = self.reader(buf)
            except ProtocolError:
                raise Unreadable(refusal(400)) from None
            if event is None and self.chunked and (refused := self.misframed(buf)) is not None:
                raise Unreadable(refused)
            if isinstance(event, EndOfMessage) and event.headers:
                raise Unreadable(trailers_refused())
            if self.chunked and isinstance(left := getattr(self.reader, "_bytes_in_chunk", 0), int) and left > body_limit:
                # A chunk no route could take (its size line says so): refused now, as a declared
                # Content-Length over the limit is, not after its bytes or the body deadline.
                raise Unreadable(refusal(413))
            return event

        def misframed(self, buf: Any) -> http.Response | None:
            """The refusal of what is buffered, when it cannot begin the rest of a well-framed
            chunked body without trailers (h11 would hold a trailer section however long, and the
            broker refuses trailers anyway); None while it still can."""
            reader, data = self.reader, buf._data  # h11's ReceiveBuffer: its bytes, unconsumed
            if reader._reading_trailer:  # after the last chunk: only the CRLF that ends the body
                if data[:2] == b"\r\n"[:len(data[:2])]:
                    return None
                return refusal(400) if data[:1] in (b"\r", b"\n") else trailers_refused()
            discard = reader._bytes_to_discard  # 0.14: how many bytes of a chunk's CRLF are due
            if isinstance(discard, int) and discard:
                return None if data[:discard] == b"\r\n"[2 - discard:][:len(data)] else refusal(400)
            if discard or reader._bytes_in_chunk:
                return None  # chunk data (or, in a newer h11, a CRLF it checks itself)
            line_end = data.find(b"\n", 0, MAX_CHUNK_LINE)
            if line_end < 0:
                return None if len(data) < MAX_CHUNK_LINE else refusal(400)
            return None if line_end > 0 and data[line_end - 1] == 0x0D else refusal(400)

        def read_eof(self) -> Any:  # the agent hung up mid-body: mitmproxy's handling is right
            return self.reader.read_eof()

    read_body = getattr(_http1.Http1Server.read_body, "__wrapped__", _http1.Http1Server.read_body)

    def http1_read_body(self: _http1.Http1Server, event: Any) -> Any:
        if isinstance(event, events.Wakeup):  # a deadline (mitmproxy asks for no wakeup here)
            if clocks is not None:
                yield from clocks.http1_expired(self, event)
            return
        if not isinstance(self.body_reader, AgentBodyReader):  # a new reader for each request
            self.body_reader = AgentBodyReader(self.body_reader)
        try:
            yield from read_body(self, event)
        except Unreadable as unreadable:
            response: http.Response = unreadable.args[0]
            if unanswered(self) and self.conn.state & ConnectionState.CAN_WRITE:
                yield from refuse_and_linger(self, response)
            else:
                yield commands.CloseConnection(self.conn)
                self.state = self.done
            yield ReceiveHttp(RequestProtocolError(self.stream_id, "the request body could not be read as sent", unreadable_request))
        if clocks is not None:
            clocks.http1_read(self, event)

    read_headers = getattr(_http1.Http1Server.read_headers, "__wrapped__", _http1.Http1Server.read_headers)

    def http1_read_headers(self: _http1.Http1Server, event: Any) -> Any:
        if isinstance(event, events.Wakeup):  # a deadline (mitmproxy asks for no wakeup here)
            if clocks is not None:
                yield from clocks.http1_expired(self, event)
            return
        # Judged before mitmproxy parses the bytes (its layer has added them to the buffer): a
        # head that arrives whole in one read is parsed, and its request handled, in the same
        # step, so a check afterwards only sees heads that have not ended yet.
        too_large = False
        if isinstance(event, events.DataReceived) and len(self.buf) > MAX_REQUEST_HEAD:
            pending = bytes(self.buf)
            ends = [i for i in (pending.find(b"\n\r\n"), pending.find(b"\n\n")) if i >= 0]
            too_large = (min(ends) if ends else len(pending)) > MAX_REQUEST_HEAD and bool(self.conn.state & ConnectionState.CAN_WRITE)
        if too_large:
            # No lingering here: a head this long is not a client's ordinary request, and reading
            # on would take whatever it still sends.
            response = refusal(431)
            assert response is not None
            response.headers["Connection"] = "close"
            yield commands.SendData(self.conn, assemble_response(response))
            yield commands.CloseConnection(self.conn)
            self.state = self.done
        else:
            before = len(self.buf)
            yield from read_headers(self, event)
            # mitmproxy takes one blank line before a request line per read (RFC 9112 2.2 has a
            # server ignore them) and then waits for more bytes, even with the whole request in
            # hand, which would wait for the head deadline: read on.
            while self.state == self.read_headers and self.buf and before - len(self.buf) in (1, 2):
                before = len(self.buf)
                yield from read_headers(self, events.DataReceived(self.conn, b""))
        if clocks is not None:
            clocks.http1_read(self, event)

    send = getattr(_http1.Http1Server.send, "__wrapped__", _http1.Http1Server.send)

    def http1_send(self: _http1.Http1Server, event: Any) -> Any:
        # mitmproxy's own refusal of a request it will not read (a declared body over its
        # body_size_limit, say) is sent the same lingering way; other events as mitmproxy sends them.
        if (isinstance(event, ResponseProtocolError) and unanswered(self) and self.conn.state & ConnectionState.CAN_WRITE
                and (response := refusal(status_of(event.code))) is not None):
            return (yield from refuse_and_linger(self, response))
        return (yield from send(self, event))

    handle_event = getattr(_http2.Http2Server._handle_event, "__wrapped__", _http2.Http2Server._handle_event)

    def http2_handle_event(self: _http2.Http2Server, event: Any) -> Any:
        if isinstance(event, events.Wakeup) and clocks is not None and expired(event) is not None:
            return (yield from clocks.http2_expired(self, event))  # a stream's body deadline
        response = None
        if isinstance(event, ResponseProtocolError) and self.is_open_for_us(event.stream_id):
            stream = self.h2_conn.streams.get(event.stream_id)
            if stream is not None and not stream.state_machine.headers_sent:  # else mitmproxy resets the stream
                response = refusal(status_of(event.code))
        if response is None:
            return (yield from handle_event(self, event))
        for answer in (
            ResponseHeaders(event.stream_id, response, end_stream=False),
            ResponseData(event.stream_id, response.content or b""),
            ResponseEndOfMessage(event.stream_id),
        ):
            yield from handle_event(self, answer)

    http1_error_response.__wrapped__ = make_error_response  # type: ignore[attr-defined]
    http1_read_body.__wrapped__ = read_body  # type: ignore[attr-defined]
    http1_read_headers.__wrapped__ = read_headers  # type: ignore[attr-defined]
    http1_send.__wrapped__ = send  # type: ignore[attr-defined]
    http2_handle_event.__wrapped__ = handle_event  # type: ignore[attr-defined]
    _http1.make_error_response = http1_error_response
    _http1.Http1Server.read_body = http1_read_body  # type: ignore[method-assign]
    _http1.Http1Server.read_headers = http1_read_headers  # type: ignore[method-assign]
    _http1.Http1Server.send = http1_send  # type: ignore[method-assign]
    _http2.Http2Server._handle_event = http2_handle_event  # type: ignore[method-assign]


def install_caller_watch(addon: "BrokerAddon", clocks: "RequestClocks | None" = None) -> None:
    """Tell ``addon`` at once when an agent abandons a request whose ``request`` hook still runs.

    mitmproxy has no hook for this. While a blocking hook runs, it parks every later event for
    that request's stream, unread, and only looks at them when the hook returns (``HttpStream.
    check_killed``, which then sets ``flow.error`` and fires ``error``). A closed connection shows
    meanwhile on the connection's state (which a timer used to poll), but an HTTP/2 agent cancels
    one request with RST_STREAM and keeps its connection: nothing outside the stream changes, and
    a held request would be dispatched on approval after its agent had cancelled it. Every way an
    agent abandons a request (an HTTP/2 stream reset, an HTTP/2 connection closed or GOAWAY, an
    HTTP/1 connection closed) reaches the request's ``HttpStream`` as a ``RequestProtocolError``
    event the moment it happens; ``HttpStream.handle_event`` (inherited from ``Layer``) is wrapped
    here to pass that on before mitmproxy parks it, and otherwise changes nothing mitmproxy does.
    Pinned by the HTTP/2 reset and close tests in tests/test_hostile_contract.py and
    tests/test_human_control.py (and the HTTP/1 ones there), so an upgrade that moves it fails.
    """
    import h2.errors
    import h2.events
    import h2.exceptions
    from hyperframe.frame import DataFrame, HeadersFrame
    from mitmproxy.proxy.commands import SendData
    from mitmproxy.proxy.layers.http import HttpStream, RequestProtocolError
    from mitmproxy.net.http.status_codes import CLIENT_CLOSED_REQUEST
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._http2 import Http2Server, parse_h2_request_headers

    handle_event = getattr(HttpStream.handle_event, "__wrapped__", HttpStream.handle_event)

    def stream_handle_event(self: HttpStream, event: Any) -> Any:
        flow = getattr(self, "flow", None)  # set with the request's headers
        if flow is not None:
            # Which stream of its connection answers this flow: a handover (below) looks for
            # what of its response still waits in the HTTP/2 connection's buffers.
            flow.metadata.setdefault(_STREAM_ID, self.stream_id)
            if isinstance(event, RequestProtocolError):
                addon.caller_left(flow)
        return (yield from handle_event(self, event))

    server_init = getattr(Http2Server.__init__, "__wrapped__", Http2Server.__init__)

    def http2_server_init(self: Any, context: Any) -> None:
        server_init(self, context)
        _HTTP2_SERVERS[context.client.id] = self
        # The h2 library ends the whole connection (GOAWAY) over one request whose header fields
        # break HTTP/2's rules, and with it the answers of every other request in flight on it.
        # The broker checks those rules itself, per request (http2_malformed), and refuses only
        # that one. HTTP/1's checks (mitmproxy's validate_inbound_headers) stay as they are.
        self.h2_conf.validate_inbound_headers = False
        # A request body that does not match its content-length (more bytes than it declares, or
        # END_STREAM short of it) makes h2 end the whole connection too, and lose the events of
        # every frame read with it. It is an error of that stream (RFC 9113 8.1.1): its DATA
        # frames go through the check below, which refuses that stream alone and tells mitmproxy
        # it was reset, as h2 itself does with a stream whose WINDOW_UPDATE overflows. The body is
        # read whole before the ``request`` hook, where the broker records and dispatches (it sets
        # no ``stream_large_bodies``), so a mismatch is always found before anything was recorded.
        # h2's frame table is not public: pinned by tests/test_broker_e2e.py::
        # test_an_http2_body_that_does_not_match_its_content_length_is_refused_alone.
        dispatch = self.h2_conn._frame_dispatch_table
        dispatch[DataFrame] = functools.partial(receive_data_frame, self.h2_conn, dispatch[DataFrame])
        # So does a content-length h2 cannot read as a number (h2 raises while it opens the stream).
        dispatch[HeadersFrame] = functools.partial(receive_headers_frame, self.h2_conn, dispatch[HeadersFrame])

    handle_h2_event = getattr(Http2Server.handle_h2_event, "__wrapped__", Http2Server.handle_h2_event)

    def http2_handle_h2_event(self: Any, event: Any) -> Any:
        # A request's END_STREAM and the agent's RST_STREAM read together: h2 has closed the stream
        # by the time mitmproxy sees StreamEnded, so mitmproxy forgets the stream there and then
        # ignores the StreamReset, and the request goes on as if its agent still waited (it is
        # dispatched, and its answer, dropped on the closed stream, recorded as delivered). The
        # reset is passed on to the request as mitmproxy passes on any other.
        if isinstance(event, h2.events.StreamEnded) and event.stream_id in self.streams and self.is_closed(event.stream_id):
            ended_then_reset(self).add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset) and event.stream_id in ended_then_reset(self):
            ended_then_reset(self).discard(event.stream_id)
            if event.stream_id not in self.streams:
                stop = yield from handle_h2_event(self, event)
                yield ReceiveHttp(self.ReceiveProtocolError(
                    event.stream_id, "stream reset by client",
                    code=CLIENT_CLOSED_REQUEST if event.error_code == h2.errors.ErrorCodes.CANCEL else self.ReceiveProtocolError.code))
                return stop
        # Pseudo-header fields mitmproxy cannot parse (one missing, one twice, one unknown) would
        # end the whole connection too: that one stream gets its envelope, ended (and reset if
        # the agent was still sending), and the connection's other requests go on. So does a
        # request ended with its headers that declares a body, which h2 does not check (it
        # checks a body against its content-length only as DATA frames come: see above).
        if isinstance(event, h2.events.RequestReceived):
            why = None
            try:
                parse_h2_request_headers(event.headers)
            except ValueError:  # its text quotes the fields: not for the envelope
                why = ("The request's HTTP/2 pseudo-header fields are malformed: one is missing or repeated, or is not "
                       "one a request may have (:method, :scheme, :authority, :path).")
            lengths = [v for k, v in event.headers if k == b"content-length"]
            if why is None and lengths and (not all(v.isdigit() for v in lengths) or len(set(lengths)) > 1):
                why = _CONTENT_LENGTH_NOT_A_LENGTH  # int() took it ("-1", "+5", "1_0"), or values that disagree
            declared = int(lengths[0], 10) if lengths and why is None else 0
            if why is None and event.stream_ended and declared:
                why = body_length_mismatch(declared, 0)
            if why is not None:
                refuse_stream(self.h2_conn, event.stream_id, why)
                yield SendData(self.conn, self.h2_conn.data_to_send())
                return False
        stop = yield from handle_h2_event(self, event)
        if clocks is not None:
            clocks.http2_event(self, event)  # a stream's body deadline starts with its headers, stops at its end
        return stop

    def ended_then_reset(server: Any) -> set[int]:
        """The streams of ``server`` whose request ended in the read that also reset them."""
        pending = server.__dict__.get("_affidavit_ended_then_reset")
        if pending is None:
            pending = server.__dict__["_affidavit_ended_then_reset"] = set()
        return pending

    def body_length_mismatch(declared: int, read: int) -> str:
        if read > declared:
            return f"The request's body is longer than the {declared} bytes its content-length header declares."
        return f"The request's body ended after {read} of the {declared} bytes its content-length header declares."

    def receive_data_frame(conn: Any, receive: Callable[[Any], Any], frame: Any) -> Any:
        try:
            return receive(frame)
        except h2.exceptions.InvalidBodyLengthError as e:  # raised before h2 took the frame's END_STREAM, if any
            refuse_stream(conn, frame.stream_id, body_length_mismatch(e.expected_length, e.actual_length))
            conn.acknowledge_received_data(frame.flow_controlled_length, frame.stream_id)  # the connection's window
            return [], [stream_reset(frame.stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)]

    def receive_headers_frame(conn: Any, receive: Callable[[Any], Any], frame: Any) -> Any:
        try:
            return receive(frame)
        except h2.exceptions.ProtocolError as e:  # raised once h2 opened the stream and took its END_STREAM, if any
            if "content-length" not in str(e).lower() or frame.stream_id not in conn.streams:
                raise
            refuse_stream(conn, frame.stream_id, _CONTENT_LENGTH_NOT_A_LENGTH)
            return [], []  # mitmproxy never heard of this stream

    def stream_reset(stream_id: int, error_code: int) -> Any:
        """The event h2 gives for a stream it reset itself."""
        try:  # h2 4.2 on (mitmproxy 12): its events are made with their fields
            return h2.events.StreamReset(stream_id=stream_id, error_code=error_code, remote_reset=False)
        except TypeError:  # h2 4.1 (mitmproxy 11): they are set after
            event = h2.events.StreamReset()
            event.stream_id, event.error_code, event.remote_reset = stream_id, error_code, False
            return event

    def refuse_stream(conn: Any, stream_id: int, why: str) -> None:
        stream = conn.streams.get(stream_id)
        if stream is None or stream.closed:  # already ended: reset by the agent, or refused for its body
            return
        response = http2_refused(why)
        fields = [(b":status", b"%d" % response.status_code), *((k.lower(), v) for k, v in response.headers.fields)]
        try:
            conn.send_headers(stream_id, fields)
            conn.send_data(stream_id, response.content or b"", end_stream=True)
        except h2.exceptions.H2Error:  # the agent's window or frame size does not admit it (or an answer has begun)
            conn.reset_stream(stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return
        if not stream.closed:  # the agent is still sending: it need not
            conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)

    stream_handle_event.__wrapped__ = handle_event  # type: ignore[attr-defined]
    http2_server_init.__wrapped__ = server_init  # type: ignore[attr-defined]
    http2_handle_h2_event.__wrapped__ = handle_h2_event  # type: ignore[attr-defined]
    HttpStream.handle_event = stream_handle_event  # type: ignore[method-assign]
    Http2Server.__init__ = http2_server_init  # type: ignore[method-assign]
    Http2Server.handle_h2_event = http2_handle_h2_event  # type: ignore[method-assign]


_CONTENT_LENGTH_NOT_A_LENGTH = ("The request's content-length header is not one length in bytes (RFC 9110 8.6: "
                                "digits only, and one value if it is repeated).")
_STREAM_ID = "affidavit.stream_id"
_GONE = "affidavit.gone_before_handled"  # how the agent left a flow before its request hook began
_LEFT = "affidavit.stream_reset"  # the agent reset this flow's HTTP/2 stream (its connection goes on)
#: The HTTP/2 connection of each agent connection that speaks it (gone with the connection).
_HTTP2_SERVERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


class Handover:
    """Whether a response written to an agent's connection has left the broker whole.

    mitmproxy hands a response to the connection's transport at once, but a large one (or one an
    HTTP/2 agent's flow-control window does not admit) waits in the transport's buffer or in the
    HTTP/2 connection's per-stream buffers until the agent reads. ``RESULT_DELIVERED`` is recorded
    only when every byte has been handed to the agent's socket (what a proxy can know: the kernel
    does not say what the agent read); a connection that ends first is a failed delivery. Found
    through mitmproxy's proxyserver addon, which keeps each agent connection's handler."""

    def __init__(self, connections: Any):
        self._connections = connections  # mitmproxy's Proxyserver.connections: client id -> handler
        self._unsure = False

    def watch(self, flow: http.HTTPFlow) -> Callable[[], bool | None]:
        """A check to call now and later: None while bytes of ``flow``'s response wait in the
        broker, True once all have left, False if the connection ended before they did."""
        client = flow.client_conn
        handler = self._connections.get(client.id)
        if handler is None and client.timestamp_end is None:
            # Open, yet unknown to mitmproxy's proxyserver: its bookkeeping is not what this
            # expects (another mitmproxy version). Written counts as delivered then, as before.
            if not self._unsure:
                self._unsure = True
                log.warning("cannot see whether responses leave the broker whole (mitmproxy's proxyserver does not "
                            "list this connection); a written response is recorded as delivered")
            return lambda: True
        io = handler.transports.get(client) if handler is not None else None
        writer = getattr(io, "writer", None)
        transport = getattr(writer, "transport", None)
        reader = getattr(io, "reader", None)
        http2 = _HTTP2_SERVERS.get(client.id)
        stream_id = flow.metadata.get(_STREAM_ID)

        def check() -> bool | None:
            if transport is None or flow.metadata.get(_LEFT):
                return False  # gone before the response was written, or the agent reset its stream
            if reader is not None and reader.exception() is not None:
                return False  # the connection broke (a reset) before every byte had left
            # Not yet handed to the connection (mitmproxy ends a flow's life right after: 12 a step
            # after the hook returns, 11 in it), or frames the HTTP/2 window does not admit yet.
            held = http2 is not None and stream_id is not None and http2.h2_conn.stream_buffers.get(stream_id)
            if flow.live or held:
                return False if transport.is_closing() else None
            if transport.get_write_buffer_size() > 0:
                return None  # still in the transport's buffer (also while it closes after the answer)
            return True  # every byte is with the agent's socket

        return check


def _how_left(flow: http.HTTPFlow) -> CallerDisposition:
    """An agent whose connection still reads abandoned this one request (an HTTP/2 stream reset):
    ``cancelled``; one whose connection is going or gone: ``disconnected``. mitmproxy marks the
    connection before it tells the streams (an EOF clears CAN_READ first; on GOAWAY or a protocol
    error it closes the connection, then fails each stream)."""
    if flow.client_conn.state & ConnectionState.CAN_READ:
        return CallerDisposition.CANCELLED
    return CallerDisposition.DISCONNECTED


class AgentAuth:
    """Agents authenticate with ``Proxy-Authorization: Basic agent:token``.

    mitmproxy's ``proxyauth`` addon knows one user; the broker needs an identity per agent. For
    HTTPS the header comes with CONNECT only, so the identity is kept per client connection.
    """

    def __init__(self, tokens: dict[str, str]):
        self._tokens = {name: token.encode() for name, token in tokens.items()}
        self._by_client: dict[str, str] = {}
        self.rejections = RejectionLog()

    @staticmethod
    def _basic(header: str | None) -> tuple[str, str, str] | None:
        """(agent, ":", token) of ``Basic base64(agent:token)``; None when it is not that."""
        if not header or not header.lower().startswith("basic "):
            return None
        try:
            return base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except ValueError:  # not base64 (binascii.Error), not ASCII, not UTF-8
            return None

    def authenticate(self, header: str | None) -> str | None:
        basic = self._basic(header)
        if basic is None:
            return None
        agent, sep, token = basic
        expected = self._tokens.get(agent)
        # Compare against something even for unknown agents, so timing reveals nothing.
        if not sep or not hmac.compare_digest(token.encode(), expected or b"\0" * 32) or expected is None:
            return None
        return agent

    def refusal(self, flow: http.HTTPFlow) -> http.Response:
        """The 407 for a request :meth:`authenticate` refused: "authenticate" when it brought no
        credentials; "not accepted", logged for the operator, when it brought wrong ones. The log
        names the agent only if it is one of ours: a name it does not know may be a token typed
        in the wrong place, and is neither logged nor echoed."""
        header = flow.request.headers.get("Proxy-Authorization")
        if not header:
            return auth_required()
        basic = self._basic(header)
        known = basic[0] if basic is not None and basic[0] in self._tokens else None
        peer = flow.client_conn.peername
        self.rejections.rejected(known, str(peer[0]) if peer else "?")
        return credentials_rejected(close=flow.request.http_version.startswith("HTTP/1"))

    def agent_of(self, flow: http.HTTPFlow) -> str | None:
        agent = self._by_client.get(flow.client_conn.id)
        if agent is not None:
            return agent
        return self.authenticate(flow.request.headers.get("Proxy-Authorization"))

    def connect(self, flow: http.HTTPFlow) -> None:
        """CONNECT: the only place an HTTPS agent presents its credentials."""
        agent = self.authenticate(flow.request.headers.get("Proxy-Authorization"))
        if agent is None:
            flow.response = self.refusal(flow)
        else:
            self._by_client[flow.client_conn.id] = agent

    def forget(self, client: Client) -> None:
        self._by_client.pop(client.id, None)


class BrokerAddon:
    """The one addon: identity, each request to the broker, and whether the reply reached the
    caller. One addon rather than several, because mitmproxy walks every addon for every hook."""

    def __init__(self, broker: Broker, auth: AgentAuth, on_running: Callable[[], None] | None = None):
        self.broker = broker
        self.auth = auth
        self._on_running = on_running
        self._live: dict[str, AgentRequest] = {}
        self._unsent: dict[str, Reply] = {}
        #: Set once mitmproxy's proxyserver is known (:meth:`running`); without it, a response
        #: counts as delivered once written, as mitmproxy's own hooks see it.
        self.handover: Handover | None = None
        self.garbage = BodyGarbage()

    def running(self) -> None:
        from mitmproxy import ctx

        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is not None and isinstance(getattr(proxyserver, "connections", None), dict):
            self.handover = Handover(proxyserver.connections)
        else:
            log.warning("mitmproxy's proxyserver keeps no connections here: deliveries are recorded once written")
        if self._on_running is not None:
            self._on_running()

    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            if not flow.request.host or not 0 < flow.request.port < 65536:
                # "CONNECT /x" or "CONNECT host": no authority to tunnel to, so nothing to route.
                log.info("refused a CONNECT without host:port: 400 %s", Code.MALFORMED_REQUEST.value)
                flow.response = _refusal(
                    400, Code.MALFORMED_REQUEST,
                    "CONNECT needs the target as host:port (CONNECT api.example.com:443). No tunnel was opened; "
                    "nothing was sent and nothing was recorded.")
                return
            if (wrong := wrong_http1_version(flow)) is not None:
                flow.response = wrong
                return
            self.auth.connect(flow)
        except Exception:  # never fail open
            log.exception("proxy authentication failed unexpectedly")
            flow.response = auth_required()

    def next_layer(self, nextlayer: Any) -> None:
        """Inside a tunnel only HTTP (over TLS or not) is spoken, and answered by the broker.
        mitmproxy's own choice relays some tunnels raw: one to port 53 or 5353 goes to its DNS
        layer, which connects to the CONNECT target itself and forwards the agent's messages, with
        no route checked and nothing recorded. Any layer that is not TLS or HTTP becomes HTTP
        (bytes that are not HTTP then get the MALFORMED_REQUEST envelope)."""
        try:
            from mitmproxy.proxy import layers
            from mitmproxy.proxy.layers.http import HTTPMode

            chosen = nextlayer.layer
            if chosen is not None and not isinstance(chosen, (layers.HttpLayer, layers.ServerTLSLayer,
                                                              layers.ClientTLSLayer, layers.modes.HttpProxy)):
                log.info("a tunnel was about to be relayed as %s; it is handled as HTTP", type(chosen).__name__)
                nextlayer.layer = layers.HttpLayer(nextlayer.context, HTTPMode.transparent)
        except Exception:  # never fail open: no layer chosen relays nothing
            log.exception("could not check the next layer; nothing is relayed on this connection")
            nextlayer.layer = None

    def server_connect(self, data: Any) -> None:
        """mitmproxy never connects upstream on the broker's behalf (the broker's own client does,
        after a route was matched and the dispatch recorded): any connection mitmproxy itself
        is about to open is killed, so that no path through mitmproxy fails open."""
        log.warning("mitmproxy was about to connect to %s itself; refused", data.server.address)
        data.server.error = "the broker does not let the proxy core connect upstream"

    def client_disconnected(self, client: Client) -> None:
        self.auth.forget(client)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            if flow.response is None and self.auth.agent_of(flow) is None:
                flow.response = self.auth.refusal(flow)
            elif flow.response is None and (wrong := wrong_http1_version(flow)) is not None:
                flow.response = wrong
            elif flow.response is None and flow.request.is_http2 and (why := http2_malformed(flow.request)) is not None:
                flow.response = http2_refused(why)
        except Exception:
            log.exception("request screening failed unexpectedly")
            flow.response = _internal_error()

    async def request(self, flow: http.HTTPFlow) -> None:
        self.garbage.seen(len(flow.request.raw_content or b""))  # refused ones too: mitmproxy read it
        if flow.response is not None:
            return
        try:
            agent = self.auth.agent_of(flow)
            if agent is None:
                flow.response = self.auth.refusal(flow)
                return
            r = flow.request
            if r.trailers:  # HTTP/2 (HTTP/1 trailers are refused in the proxy core)
                flow.response = trailers_refused()
                return
            req = AgentRequest(
                agent=agent,
                scheme=r.scheme,
                host=canonical_host(r.host),
                port=r.port,
                # mitmproxy upper-cases the method, in Unicode: 'PO\u017fT' would become 'POST'.
                # Only an ASCII one is taken so; any other is passed as sent, to be refused.
                method=r.method if r.data.method.isascii() else r.data.method.decode("utf-8", "surrogateescape"),
                path=r.path,
                headers=agent_fields(r),
                body=r.raw_content or b"",
            )
            if (why := unrecordable(req)) is not None:
                log.info("refused a request of agent %s it cannot record: 400 %s: %s", agent, Code.MALFORMED_REQUEST.value, why)
                flow.response = _refusal(400, Code.MALFORMED_REQUEST, why)
                return
            if (gone := flow.metadata.get(_GONE)) is not None:
                req.leave(gone)  # the agent left before the broker began: nothing is sent
            self._live[flow.id] = req
            try:
                reply = await self.broker.handle(req)
            finally:
                self._live.pop(flow.id, None)
            if req.caller_gone.is_set() or flow.error is not None:
                if reply.undelivered is not None:
                    reply.undelivered(req.left_as if req.caller_gone.is_set() else _how_left(flow))
                return
            flow.response = _reply_to_response(reply)
            if self.broker.stop_begun and r.http_version.startswith("HTTP/1"):
                flow.response.headers["Connection"] = "close"  # the agent's next request goes to a broker that runs
            self._unsent[flow.id] = reply
        except Exception:
            log.exception("the broker failed on a request; answering with an envelope")
            flow.response = _internal_error()

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            self.garbage.seen(len(flow.response.raw_content or b""))
        reply = self._unsent.pop(flow.id, None)
        if reply is None:
            return
        failpoint_now("during_delivery")
        loop = asyncio.get_running_loop()
        if flow.error is not None or flow.client_conn.timestamp_end is not None:
            if reply.undelivered is not None:
                loop.call_soon(_record_delivery, functools.partial(reply.undelivered, _how_left(flow)), reply.invocation_id)
        elif reply.delivered is not None and self.handover is not None:
            # mitmproxy writes the response once this hook returns; looking afterwards takes that
            # work off the caller's wait, and sees whether it all left at once (a small answer)
            # or waits for the agent to read.
            loop.call_soon(_when_handed_over, self.handover.watch(flow), reply, flow, 0.0)
        elif reply.delivered is not None:
            loop.call_soon(_record_delivery, reply.delivered, reply.invocation_id)

    def caller_left(self, flow: http.HTTPFlow) -> None:
        """The agent abandoned ``flow`` (see :func:`install_caller_watch`); if the broker is
        still handling it, the broker stops waiting for the agent's sake, as when an agent goes."""
        try:
            how = _how_left(flow)
            if how is CallerDisposition.CANCELLED:  # an HTTP/2 stream reset: it wants no more of this one
                flow.metadata[_LEFT] = True
            req = self._live.get(flow.id)
            if req is not None:
                req.leave(how)
            else:  # before its request hook began (a reset read with the request's end): it begins with the caller gone
                flow.metadata.setdefault(_GONE, how)
        except Exception:
            log.exception("could not note that a caller left")

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            self.caller_left(flow)
            reply = self._unsent.pop(flow.id, None)
            if reply is not None and reply.undelivered is not None:
                reply.undelivered(_how_left(flow))
        except Exception:
            log.exception("could not record a caller's disconnect")



#: Body bytes after which the cycle collector runs in full (see :class:`BodyGarbage`).
COLLECT_AFTER_BYTES = 64 * 1024 * 1024


class BodyGarbage:
    """A full cycle collection once flows have carried ``limit`` bytes of bodies since the last.

    A finished flow's objects sit in reference cycles (mitmproxy's flows and layers), and so its
    bodies with them, until the cycle collector runs; the broker's thresholds count objects
    (:func:`proxy.app.tune_gc`), which a few large bodies barely move, so hundreds of MiB of dead
    bodies could stay (a few dozen 10 MiB uploads, refused ones included: mitmproxy reads the
    body before the 407 goes out). Counting bytes bounds that garbage. The collection runs after
    the current step, and only walks objects made since start-up (the rest are frozen)."""

    def __init__(self, limit: int = COLLECT_AFTER_BYTES):
        self.limit = limit
        self.bytes = 0

    def seen(self, size: int) -> None:
        self.bytes += size
        if self.bytes >= self.limit:
            self.bytes = 0
            asyncio.get_running_loop().call_soon(gc.collect)


#: How long a response may stay unwritten after its hook before the watch stops waiting for it.
_UNWRITTEN_FOR = 10.0


def _when_handed_over(check: Callable[[], bool | None], reply: Reply, flow: http.HTTPFlow, waited: float) -> None:
    """Record the delivery once the response has all left (see :class:`Handover`), or its failure."""
    try:
        handed = check()
    except Exception:  # never lose the delivery fact over this: recorded as written, as before
        log.exception("could not see whether the response of %s left whole; recorded as delivered", reply.invocation_id)
        handed = True
    if handed is None:  # not written yet, or the agent reads slowly (or not at all): look again, less often over time
        loop = asyncio.get_running_loop()
        if waited == 0.0:  # mitmproxy 12 writes a step after the hook: the next turn usually sees it all
            loop.call_soon(_when_handed_over, check, reply, flow, 1e-9)
            return
        if flow.live and waited > _UNWRITTEN_FOR:
            # mitmproxy has not ended the flow's life long after the hook: not how the versions
            # this knows behave. Recorded as written, as mitmproxy's own hooks see it.
            log.warning("the response of %s was not written %g s after its hook; recorded as delivered",
                        reply.invocation_id, _UNWRITTEN_FOR)
            handed = True
        else:
            pause = min(0.005 + waited / 10, 0.5)
            loop.call_later(pause, _when_handed_over, check, reply, flow, waited + pause)
            return
    if handed:
        _record_delivery(reply.delivered, reply.invocation_id)  # type: ignore[arg-type]
    elif reply.undelivered is not None:
        how = CallerDisposition.CANCELLED if flow.metadata.get(_LEFT) else CallerDisposition.DISCONNECTED
        _record_delivery(functools.partial(reply.undelivered, how), reply.invocation_id)


def _record_delivery(record: Callable[[], None], invocation_id: str | None) -> None:
    try:
        record()
    except Exception:
        log.exception("could not record delivery of %s", invocation_id)


def _internal_error() -> http.Response:
    """Last resort for a bug in the adapter: claim nothing the broker cannot prove."""
    return _reply_to_response(internal_error(
        "The broker hit an internal error while handling this request and cannot say whether it was "
        "sent. Do not re-send blindly; operators: see the broker log and the journal."))
