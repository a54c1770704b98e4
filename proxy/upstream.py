"""The upstream exchange: the broker, not mitmproxy, talks to the remote.

mitmproxy handles the agent's side (CONNECT, TLS interception, parsing); this module performs
the request to the upstream in a task that may outlive the agent's connection, so a result that
arrives after the caller left is still read, recorded and fetchable.

The broker drives each connection itself, one step at a time, so the dispatch boundary is a line
of code rather than a library's promise: resolve the name (stage ``dns``), connect (``tcp_connect``),
shake hands and verify the certificate (``tls_handshake``), or take an idle pooled connection;
then await :meth:`ExchangeObserver.dispatch`, which commits ``DISPATCH_STARTED``; only then write
the request, in one ``write`` of bytes prepared before the boundary. Anything that fails before
it is connection setup (``not_attempted``); anything after it is remote execution (``unknown``
unless a complete response arrives). A request is written at most once: nothing here re-sends.

The response is parsed by ``httptools`` (llhttp, the parser of Node.js): framing errors (a short
body, an unterminated chunk, bytes that are not HTTP) are errors, and a body delimited by the
connection's close is complete only when the close is clean.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httptools

from .config import RESERVED_HEADERS
from .contract import Code

# Hop-by-hop and proxy headers never cross the broker (RFC 9110 section 7.6.1).
#: What the broker itself reads, sets or drops on the way upstream (one list with the
#: configuration's, which refuses these as an injected or idempotency header).
HOP_BY_HOP = RESERVED_HEADERS


def list_tokens(headers: list[tuple[str, str]], name: str) -> set[str]:
    """The lower-cased members of the list header ``name`` (every line of it, comma-separated)."""
    name = name.lower()
    return {token.strip().lower() for k, v in headers if k.lower() == name for token in v.split(",") if token.strip()}


def connection_options(headers: list[tuple[str, str]]) -> set[str]:
    """The field names a ``Connection`` header lists: options of this hop only, which a proxy
    removes before it forwards the message (RFC 9110 7.6.1), such as ``HTTP2-Settings`` beside
    ``Upgrade: h2c``."""
    return list_tokens(headers, "connection")


def end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` without the hop-by-hop ones: the fixed set and those ``Connection`` names."""
    named = connection_options(headers)
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


# OpenSSL verify codes (X509_V_ERR_*) that name the reason a certificate was refused.
_EXPIRED = {10}  # CERT_HAS_EXPIRED
_NOT_YET_VALID = {9}
_HOSTNAME = {62}  # HOSTNAME_MISMATCH
_UNTRUSTED = {18, 19, 20, 21, 2, 24, 27, 28}  # self-signed, unknown issuer, untrusted, rejected

#: A response head (status line and headers) larger than this is refused as broken; the heads of
#: interim responses before it (100 Continue, 103 Early Hints) count towards it too.
MAX_RESPONSE_HEAD = 64 * 1024

#: Plaintext read from a TLS connection's buffer per call.
TLS_READ_SIZE = 256 * 1024

#: An idle pooled connection older than this is closed rather than reused (the default of
#: ``[upstream] keepalive``).
KEEPALIVE_SECONDS = 30.0


class ExchangeObserver(Protocol):
    """What the broker learns while an exchange runs. ``dispatch`` may refuse to go on."""

    async def dispatch(self, attempt: int, connection: str) -> None: ...

    async def request_sent(self) -> None: ...

    async def response_started(self, status: int) -> None: ...

    async def body_started(self) -> None: ...


class DispatchRefused(Exception):
    """Raised by an observer at the boundary: nothing may be written (journal down, fence lost)."""

    def __init__(self, code: Code, message: str, *, unwritten: bool = False):
        super().__init__(message)
        self.code = code
        #: JOURNAL_UNAVAILABLE: the DISPATCH_STARTED write is known not written (else it may have
        #: landed unconfirmed).
        self.unwritten = unwritten


class SetupFailed(Exception):
    """The connection could not be set up; no request byte was handed to any transport."""

    def __init__(self, stage: str, code: Code, diagnostic: str, *, out_of_files: bool = False):
        super().__init__(diagnostic)
        self.stage = stage
        self.code = code
        self.diagnostic = diagnostic
        #: The broker's own process had no file descriptor left (EMFILE/ENFILE): says nothing
        #: about the upstream.
        self.out_of_files = out_of_files


class ExchangeFailed(Exception):
    """The request was (or may have been) dispatched and no complete response was received."""

    def __init__(self, code: Code, diagnostic: str, *, request_complete: bool, headers_received: bool):
        super().__init__(diagnostic)
        self.code = code
        self.diagnostic = diagnostic
        self.request_complete = request_complete
        self.headers_received = headers_received


def _may_have_left_body_unread(request: "UpstreamRequest", reading: "_Reading") -> bool:
    """Whether the upstream may have answered without reading the request's body. A refusal (or
    a redirect) is often decided from the head alone, and a server that then keeps the connection
    open without reading the body on leaves those bytes ahead of the next request on it: that
    one would be read as garbage, or lost in the reset that closes such a connection, and end
    ``unknown`` though it never reached the application. The socket taking every byte proves
    nothing here: a body that fits in the kernel's buffers is taken whether or not anyone reads
    it. So such a connection is not reused; a 2xx answer means the body was taken."""
    return bool(request.body) and not 200 <= reading.status < 300


class ResponseTooLarge(Exception):
    pass


class ResponseBroken(Exception):
    """The response's bytes stopped before its framing said they would end, or were not HTTP."""


class ResponseHeadTooLarge(ResponseBroken):
    """The response's status line and header fields are longer than the broker reads."""


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    scheme: str  # http | https
    host: str
    port: int
    target: str  # origin form: path and query
    headers: list[tuple[str, str]]
    body: bytes
    connect_timeout: float = 10.0
    max_response_body: int = 32 * 1024 * 1024
    #: Whose idle connections this request may take (the broker: the agent and the route). A
    #: connection is never shared beyond it: an upstream that answered without reading a body
    #: leaves those bytes ahead of the next request on the connection, which must then be the
    #: same caller's, under the same credential.
    pool: str = ""
    #: False: a connection of its own, taken from no pool and given back to none, which the
    #: request asks the upstream to close after its answer (``Connection: close``).
    reuse: bool = True

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(slots=True)
class UpstreamResponse:
    """A complete, framed final response from the verified peer."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    framing: str  # content-length | chunked | close | none
    peer_certificate_sha256: str | None
    http_version: str
    #: False when the answer came before the socket took the request's last byte (an upstream
    #: that answered early, a 413 say, and stopped reading).
    request_complete: bool = True

    @property
    def body_sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def all_of(self, name: str) -> str | None:
        """Every value of a list header (several lines of it joined with ", "), or None."""
        name = name.lower()
        return ", ".join(v for k, v in self.headers if k.lower() == name) or None


def request_head(request: UpstreamRequest) -> bytes:
    """The request line and headers, as written upstream. Raises ValueError for a header that
    would split the request (a line break or NUL in a name or value)."""
    lines = [f"{request.method} {request.target or '/'} HTTP/1.1", f"Host: {request.authority}"]
    for name, value in request.headers:
        if name.lower() not in HOP_BY_HOP:
            lines.append(f"{name}: {value}")
    if request.body or request.method not in ("GET", "HEAD"):
        lines.append(f"Content-Length: {len(request.body)}")
    if not request.reuse:
        lines.append("Connection: close")
    head = "\n".join(lines)
    if head.count("\n") != len(lines) - 1 or "\r" in head or "\0" in head:
        raise ValueError("a header name or value contains a line break or NUL; it would split the request")
    return head.replace("\n", "\r\n").encode("utf-8", "surrogateescape") + b"\r\n\r\n"


def framing_of(method: str, status: int, headers: list[tuple[str, str]]) -> str:
    if method == "HEAD" or status in (204, 304):
        return "none"
    names = {k.lower(): v for k, v in headers}
    if "transfer-encoding" in names:
        # RFC 9112 section 6.3: chunked only when it is the last coding; any other
        # Transfer-Encoding (which overrides Content-Length) leaves the close as the framing.
        codings = [c.strip().lower() for c in names["transfer-encoding"].split(",")]
        return "chunked" if codings[-1] == "chunked" else "close"
    if "content-length" in names:
        return "content-length"
    return "close"


def _stopping() -> SetupFailed:
    return SetupFailed("request", Code.CONNECT_FAILED, "the broker is stopping; nothing was sent")


def classify_setup_failure(exc: BaseException, stage: str) -> tuple[str, Code]:
    """(stage, code) for a failure before the dispatch boundary."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        verify_code = exc.verify_code
        if verify_code in _EXPIRED or verify_code in _NOT_YET_VALID:
            return "tls_handshake", Code.TLS_CERT_EXPIRED
        if verify_code in _HOSTNAME:
            return "tls_handshake", Code.TLS_HOSTNAME_MISMATCH
        if verify_code in _UNTRUSTED:
            return "tls_handshake", Code.TLS_CERT_UNTRUSTED
        return "tls_handshake", Code.TLS_CERT_INVALID
    if isinstance(exc, ssl.SSLError):
        return "tls_handshake", Code.TLS_HANDSHAKE_FAILED
    if isinstance(exc, socket.gaierror):
        return "dns", Code.DNS_FAILED
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return stage, Code.CONNECT_TIMEOUT
    if isinstance(exc, ConnectionRefusedError) and stage == "tcp_connect":
        return "tcp_connect", Code.CONNECT_REFUSED
    if stage == "tls_handshake":
        return "tls_handshake", Code.TLS_HANDSHAKE_FAILED  # a reset mid-handshake, say
    if stage == "dns":
        return "dns", Code.DNS_FAILED
    return stage, Code.CONNECT_FAILED


def diagnostic(exc: BaseException) -> str:
    """Library text for the internal diagnostic field only (never an envelope's message)."""
    text = str(exc).strip() or exc.__class__.__name__
    return f"{exc.__class__.__module__}.{exc.__class__.__qualname__}: {text}"[:500]


class _Reading:
    """One response being read: what the connection's parser callbacks fill in."""

    __slots__ = ("method", "limit", "status", "reason", "headers", "chunks", "size", "head_bytes", "head_tail", "head", "done",
                 "first_body")

    def __init__(self, loop: asyncio.AbstractEventLoop, method: str, limit: int):
        self.method = method
        self.limit = limit
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.head_bytes = 0  # of every head so far, interim responses' included
        self.head_tail = b""  # the last bytes of the head being read, for a blank line split across reads
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        #: Resolved by the first body byte or the end of the response, whichever comes first.
        self.first_body: asyncio.Future[None] = loop.create_future()


def _head_end(tail: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to the head being read, up to and including its blank
    line, which may straddle reads (``tail`` holds the head's last bytes so far); -1 if the head
    goes on past ``data``."""
    if tail:
        straddle = (tail + data[:3]).find(b"\r\n\r\n")
        if straddle >= 0:
            return straddle + 4 - len(tail)
    end = data.find(b"\r\n\r\n")
    return -1 if end < 0 else end + 4


def _resolve(future: asyncio.Future[None], exc: BaseException | None = None) -> None:
    if not future.done():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
            future.exception()  # read here: an unawaited head or first_body must not warn


class _Connection(asyncio.Protocol):
    """One upstream connection: one request at a time, its response parsed as it arrives.

    TLS runs here too, through an :class:`ssl.SSLObject` on memory buffers rather than asyncio's
    TLS transport, for one fact that transport hides: whether the upstream ended the TLS session
    with ``close_notify`` or the TCP connection simply stopped. Only the first proves that a body
    delimited by the connection's end is all there is; a bare TCP close may be anyone's cut.
    """

    def __init__(self, tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reading: _Reading | None = None
        self.lost = False
        self.reusable = True
        #: The broker closed it (shutdown, a broken or oversized response): an end that says
        #: nothing about the response's framing.
        self.closed_here = False
        self.peer_certificate: str | None = None
        self.idle_since = 0.0
        self._tls_in = self._tls_out = None
        self.tls: ssl.SSLObject | None = None
        if tls is not None:
            self._tls_in, self._tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = tls.wrap_bio(self._tls_in, self._tls_out, server_hostname=server_hostname)
        #: Resolved when the TLS handshake succeeds (or fails); None for plain HTTP.
        self.handshake: asyncio.Future[None] | None = None
        self.secure = False
        #: The upstream sent TLS close_notify: the session ended cleanly.
        self.tls_closed = False
        #: Pending while the transport holds bytes the socket has not taken (see pause_writing).
        self.drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Told the moment the transport buffers anything, and the moment its buffer is empty
        # again: a request is complete when the socket has taken its last byte.
        self.transport.set_write_buffer_limits(high=0)
        if self.tls is not None:
            self.handshake = asyncio.get_running_loop().create_future()
            self._shake()

    def data_received(self, data: bytes) -> None:
        if self.tls is not None:
            data = self._decrypt(data)
            if data:
                self._received(data)
            if self.tls_closed:
                self._ended(None)
            return
        self._received(data)

    def eof_received(self) -> bool | None:
        if self.tls is not None and not self.tls_closed:
            self._ended(ConnectionResetError("the upstream closed the TCP connection without ending TLS (no close_notify)"))
        else:
            self._ended(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None:
            _resolve(self.drained)

    def _received(self, data: bytes) -> None:
        reading = self.reading
        if reading is None or reading.done.done():
            self._broken(None)  # bytes nobody asked for: the connection cannot be trusted again
            return
        # Until the final head has come, the parser is fed one head at a time, each counted
        # against the limit: after a head's blank line comes another head if it was an interim
        # response (100 Continue, 103 Early Hints), the body if it was the final one, and only
        # the parser knows which. One read can hold several heads and much of the body (256 KiB).
        while data and not reading.head.done():
            end = _head_end(reading.head_tail, data)
            part = len(data) if end < 0 else end
            if reading.head_bytes + part > MAX_RESPONSE_HEAD:
                self._broken(ResponseHeadTooLarge(f"the upstream's response head exceeds {MAX_RESPONSE_HEAD} bytes"))
                return
            reading.head_bytes += part
            reading.head_tail = b"" if end >= 0 else (reading.head_tail + data[-3:])[-3:]
            if not self._feed(data[:part]):
                return
            data = data[part:]
        if data and not self._feed(data):
            return
        if reading.size > reading.limit:
            self._broken(ResponseTooLarge())

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; False if it is not HTTP/1.1 (the exchange has failed then)."""
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._broken(ResponseBroken(f"the upstream's response is not valid HTTP/1.1: {exc}"))
            return False
        return True

    # -- TLS ----------------------------------------------------------------------------------

    def _shake(self) -> None:
        assert self.tls is not None and self.handshake is not None
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except Exception as exc:  # a refused certificate, a protocol error
            self._flush()  # the alert, so the upstream's logs say why
            _resolve(self.handshake, exc)
            self._broken(None)
            return
        self._flush()
        self.secure = True
        der = self.tls.getpeercert(binary_form=True)
        self.peer_certificate = "sha256:" + hashlib.sha256(der).hexdigest() if der else None
        _resolve(self.handshake)

    def _decrypt(self, data: bytes) -> bytes:
        """The plaintext in ``data`` (b"" while the handshake runs, or for TLS's own messages)."""
        assert self.tls is not None and self._tls_in is not None
        self._tls_in.write(data)
        if not self.secure:
            self._shake()
            if not self.secure:
                return b""
        chunks = []
        try:
            while True:
                chunk = self.tls.read(TLS_READ_SIZE)
                if not chunk:
                    self.tls_closed = True  # close_notify
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as exc:
            if chunks:  # what came before the bad record still counts (it may end the response)
                self._received(b"".join(chunks))
            self._broken(ResponseBroken(f"the upstream's TLS stream is broken: {exc}"))
            return b""
        self._flush()  # what TLS itself answers (a key update), if anything
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _flush(self) -> None:
        assert self._tls_out is not None
        pending = self._tls_out.read()
        if pending and self.transport is not None and not self.transport.is_closing():
            self.transport.write(pending)

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        reading = self.reading
        if reading is not None and reading.status >= 200:
            # A second response after the final one, in the same bytes: nobody asked for it.
            # Stop the parser here so it cannot touch the recorded response, and retire the
            # connection (raised errors end feed_data as HttpParserCallbackError).
            raise ResponseBroken("the upstream sent a response nobody asked for")
        # A new head: Content-Length beside Transfer-Encoding is ambiguous framing again (see
        # on_headers_complete, which allows it in a chunked body's trailer section only).
        self.parser.set_dangerous_leniencies(lenient_chunked_length=False)

    def on_status(self, reason: bytes) -> None:
        assert self.reading is not None
        self.reading.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        reading = self.reading
        assert reading is not None
        if reading.head.done():
            # A trailer field of a chunked body. Not a header (RFC 9110 6.5.1): merged, a
            # `Transfer-Encoding` there would change the framing recorded, a `Content-Encoding`
            # how the body is read. The broker's answer has a Content-Length and no trailer
            # section, so trailers are not passed on.
            return
        reading.headers.append((name, value))

    def on_headers_complete(self) -> None:
        reading = self.reading
        assert reading is not None
        status = self.parser.get_status_code()
        if status < 100 or status > 599:
            # Not an HTTP status (RFC 9110 15: 100 to 599; "600..999" are for other protocols'
            # internal use): the answer is not HTTP. Taken for an interim one, the exchange would
            # wait for a final one until it timed out; taken for a final one, neither an agent's
            # client nor the side API's replay could carry it.
            raise ResponseBroken(f"the upstream answered with status {status:03d}, which is no HTTP status")
        if status < 200:
            # An interim response (100 Continue, 103 Early Hints): not the answer; llhttp ends
            # it here and parses the final response that follows on the same connection.
            reading.headers = []
            reading.reason = b""
            return
        reading.status = status
        # The final head is parsed, its framing checked. A `Content-Length` that comes after it is
        # a trailer field of a chunked body, which frames nothing (RFC 9110 6.5.1); llhttp would
        # refuse it beside Transfer-Encoding, and the complete answer would be recorded as cut.
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        _resolve(reading.head)
        if reading.method == "HEAD":
            # llhttp cannot be told that a response to HEAD has no body; it would wait for
            # Content-Length bytes. The response is complete; the connection is not reused.
            self.reusable = False
            self._complete()

    def on_body(self, body: bytes) -> None:
        reading = self.reading
        assert reading is not None
        if reading.done.done():
            return  # the body llhttp expects after a response to HEAD, which has none
        reading.size += len(body)
        if reading.size <= reading.limit:
            reading.chunks.append(body)
        _resolve(reading.first_body)

    def on_message_complete(self) -> None:
        reading = self.reading
        if reading is not None and reading.status >= 200:
            if not self.parser.should_keep_alive():
                self.reusable = False
            self._complete()

    # -- the exchange's side ----------------------------------------------------------------

    def _complete(self) -> None:
        reading = self.reading
        assert reading is not None
        _resolve(reading.first_body)
        _resolve(reading.done)

    def _ended(self, exc: Exception | None) -> None:
        """The upstream closed (or the connection broke): the end of a close-delimited body, or
        the end of a response that was cut short."""
        self.lost = True
        if self.handshake is not None and not self.handshake.done():
            _resolve(self.handshake, exc or ConnectionResetError("the upstream closed the connection during the TLS handshake"))
        reading = self.reading
        if reading is None or reading.done.done():
            return
        if self.closed_here:
            self._fail(ConnectionAbortedError("the broker closed the connection before the response ended"))
            return
        if reading.head.done() and exc is None and framing_of(reading.method, reading.status, _text(reading.headers)) == "close":
            self.reusable = False
            self._complete()
            return
        if reading.head.done():
            why = f" ({exc})" if exc is not None else ""
            self._fail(ResponseBroken(f"the connection closed before the response's framing said it would end{why}"))
        else:
            self._fail(exc or ConnectionResetError("the upstream closed the connection without a response"))

    def _broken(self, exc: BaseException | None) -> None:
        self.reusable = False
        self.closed_here = True
        if self.transport is not None:
            self.transport.abort()
        if exc is not None:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        reading = self.reading
        if reading is not None:
            for future in (reading.head, reading.first_body, reading.done):
                _resolve(future, exc)

    def send(self, data: bytes, reading: _Reading) -> None:
        assert self.transport is not None
        self.reading = reading
        if self.lost or self.transport.is_closing():
            self._fail(ConnectionResetError("the pooled connection closed before the request was written"))
            return
        if self.tls is None:
            self.transport.write(data)
            return
        try:
            self.tls.write(data)
        except ssl.SSLError as exc:  # only a renegotiation the upstream asked for, which TLS 1.3 has not
            self._broken(exc)
            return
        self._flush()

    @property
    def flushed(self) -> bool:
        """The socket has taken every byte written so far."""
        return self.drained is None or self.drained.done()

    def close(self) -> None:
        """Close now, a response in progress included; TLS says close_notify first (best effort:
        nothing waits for the upstream's answer to it)."""
        self.reusable = False
        self.closed_here = True
        if self.transport is None:
            return
        if not self.flushed or (self.reading is not None and not self.reading.done.done()):
            # Mid-exchange: the broker gave up on it. Nothing more goes out (not the rest of a
            # body, not a close_notify a hung upstream would never answer), and the exchange
            # ends at once (connection_lost), as cut by the broker.
            self.transport.abort()
            return
        if self.tls is not None and self.secure and not self.transport.is_closing():
            try:
                self.tls.unwrap()
            except ssl.SSLError:
                pass  # SSLWantReadError: ours is written, the upstream's has not come
            self._flush()
        self.transport.close()

    @property
    def idle_and_open(self) -> bool:
        return not self.lost and self.reusable and self.transport is not None and not self.transport.is_closing()


def _text(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]


@dataclass(slots=True)
class _Progress:
    stage: str = "dns"
    request_complete: bool = False


class Upstream:
    """The broker's upstream client: one pool of keep-alive connections per broker process."""

    def __init__(self, *, ca_bundle: str = "", dns_timeout: float = 10.0, keepalive: float = KEEPALIVE_SECONDS):
        context = ssl.create_default_context()
        if ca_bundle:
            context.load_verify_locations(cafile=ca_bundle)
        self._tls = context
        self._dns_timeout = dns_timeout
        self._keepalive = keepalive
        self._pins: dict[tuple[str, int], tuple[str, int]] = {}
        self._idle: dict[tuple[str, str, str, int], list[_Connection]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._open: set[_Connection] = set()
        self.closed = False  # the broker is stopping: nothing new is sent

    def pin(self, host: str, port: int, target: tuple[str, int]) -> None:
        """Connect to ``target`` for ``host:port`` (a route's ``connect_to``); TLS still checks
        the certificate against ``host``."""
        self._pins[(host.lower(), port)] = target

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    async def exchange(self, request: UpstreamRequest, observer: ExchangeObserver, attempt: int = 1) -> UpstreamResponse:
        """Send ``request`` once. Raises :class:`SetupFailed`, :class:`DispatchRefused` or
        :class:`ExchangeFailed`; returns only a complete response."""
        progress = _Progress()
        if self.closed:
            raise _stopping()
        try:
            data = request_head(request) + request.body
        except ValueError as exc:
            raise SetupFailed("request", Code.CONNECT_FAILED, str(exc)) from None
        key = (request.pool, request.scheme, request.host.lower(), request.port)
        conn = self._take(key) if request.reuse else None
        how = "reused"
        if conn is None:
            how = "new"
            try:
                conn = await self._connect(request, progress)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is classified by where it happened
                stage, code = classify_setup_failure(exc, progress.stage)
                raise SetupFailed(stage, code, diagnostic(exc),
                                  out_of_files=isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)) from None
        if self.closed:  # it stopped while this connection was being set up
            conn.close()
            raise _stopping()
        try:
            await observer.dispatch(attempt, how)
        except BaseException:
            self._give_back(key, conn)  # nothing was written on it
            raise
        if self.closed:  # it stopped during the dispatch commit: the record says dispatched, nothing is sent
            conn.close()
            raise ExchangeFailed(Code.REMOTE_OUTCOME_UNKNOWN, "the broker stopped before sending; nothing was sent",
                                 request_complete=False, headers_received=False)
        progress.stage = "dispatched"
        reading = _Reading(asyncio.get_running_loop(), request.method, request.max_response_body)
        try:
            return await self._exchange(conn, data, reading, request, observer, progress)
        finally:
            if (request.reuse and reading.done.done() and not reading.done.exception() and conn.reusable and not conn.lost
                    and conn.flushed and not _may_have_left_body_unread(request, reading)):
                conn.reading = None
                self._give_back(key, conn)
            else:
                self._forget(conn)

    async def _exchange(
        self, conn: _Connection, data: bytes, reading: _Reading, request: UpstreamRequest,
        observer: ExchangeObserver, progress: _Progress,
    ) -> UpstreamResponse:
        conn.send(data, reading)
        if not conn.flushed:
            # The socket has not taken every byte yet (a large body, an upstream slow to read):
            # the request is complete when it has, not when it was queued. An answer or a
            # broken connection ends the wait too.
            assert conn.drained is not None
            await asyncio.wait((conn.drained, reading.head), return_when=asyncio.FIRST_COMPLETED)
        if not reading.done.done() and conn.flushed:
            # Every byte is with the kernel; a connection that had closed before the write
            # failed the reading instead.
            progress.request_complete = True
            await observer.request_sent()
        try:
            await reading.head
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ExchangeFailed(
                Code.RESULT_TOO_LARGE if isinstance(exc, ResponseHeadTooLarge) else Code.REMOTE_OUTCOME_UNKNOWN,
                diagnostic(exc), request_complete=progress.request_complete, headers_received=False,
            ) from None
        try:
            await observer.response_started(reading.status)
            await reading.first_body
            if reading.chunks:
                await observer.body_started()
            await reading.done
        except ResponseTooLarge:
            raise ExchangeFailed(
                Code.RESULT_TOO_LARGE, f"response body exceeds {request.max_response_body} bytes",
                request_complete=conn.flushed, headers_received=True,
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ExchangeFailed(
                Code.REMOTE_RESULT_INCOMPLETE, diagnostic(exc), request_complete=conn.flushed, headers_received=True,
            ) from None
        if reading.size > reading.limit:  # the last bytes arrived with the end of the response
            raise ExchangeFailed(
                Code.RESULT_TOO_LARGE, f"response body exceeds {request.max_response_body} bytes",
                request_complete=conn.flushed, headers_received=True,
            )
        headers = _text(reading.headers)
        return UpstreamResponse(
            status=reading.status,
            reason=reading.reason.decode("latin-1"),
            headers=headers,
            body=b"".join(reading.chunks),
            framing=framing_of(request.method, reading.status, headers),
            peer_certificate_sha256=conn.peer_certificate,
            http_version=f"HTTP/{conn.parser.get_http_version()}",
            request_complete=conn.flushed,
        )

    # -- connections --------------------------------------------------------------------------

    async def _connect(self, request: UpstreamRequest, progress: _Progress) -> _Connection:
        loop = asyncio.get_running_loop()
        progress.stage = "dns"
        addresses = await self._resolve(request.host, request.port)
        progress.stage = "tcp_connect"
        async with asyncio.timeout(request.connect_timeout):
            sock = await _connect_socket(loop, addresses, request.connect_timeout)
            conn: _Connection | None = None
            try:
                if request.scheme == "https":
                    progress.stage = "tls_handshake"
                    tls = self._tls
                    hostname: str | None = request.host.strip("[]")
                else:
                    tls, hostname = None, None
                _, conn = await loop.create_connection(lambda: _Connection(tls, hostname), sock=sock)
                if conn.handshake is not None:
                    await conn.handshake
            except BaseException:
                if conn is not None and conn.transport is not None:
                    conn.transport.abort()
                else:
                    sock.close()
                raise
        self._open.add(conn)
        return conn

    async def _resolve(self, host: str, port: int) -> list[tuple[Any, ...]]:
        pinned = self._pins.get((host.lower(), port))
        if pinned is not None:
            host, port = pinned
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._dns_timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        if not infos:
            raise socket.gaierror(socket.EAI_NONAME, f"no address for {host}")
        return infos

    def _take(self, key: tuple[str, str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive
            if conn.idle_and_open and now - conn.idle_since < self._keepalive:
                return conn
            self._forget(conn)
        return None

    def _give_back(self, key: tuple[str, str, str, int], conn: _Connection) -> None:
        if not conn.idle_and_open:
            self._forget(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self._keepalive, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def _sweep(self) -> None:
        """Close connections idle past the keep-alive time (those the upstream closed are gone
        already: their protocol saw the close)."""
        self._sweeper = None
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.idle_and_open and now - c.idle_since < self._keepalive]
            for conn in idle:
                if conn not in keep:
                    self._forget(conn)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        self._open = {c for c in self._open if not c.lost}
        if self._idle:
            self._sweeper = asyncio.get_running_loop().call_later(self._keepalive / 2, self._sweep)


async def _connect_socket(loop: asyncio.AbstractEventLoop, addresses: list[tuple[Any, ...]], timeout: float) -> socket.socket:
    """A connected socket to the first address that accepts; the last address's error if none.

    Each address gets an even share of the time left, so one that never answers (a blackholed
    IPv6 route, say) leaves the next addresses time to be tried within ``timeout``."""
    deadline = loop.time() + timeout
    error: BaseException | None = None
    for i, (family, kind, proto, _, address) in enumerate(addresses):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            async with asyncio.timeout((deadline - loop.time()) / (len(addresses) - i)):
                await loop.sock_connect(sock, address)
            return sock
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError):  # TimeoutError is one
                raise
            error = exc
    assert error is not None
    raise error
