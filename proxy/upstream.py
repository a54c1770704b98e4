"""The upstream exchange: the broker, not mitmproxy, talks to the remote (adapter over aiohttp).

mitmproxy handles the agent's side (CONNECT, TLS interception, parsing); this module performs
the request to the upstream in a task that may outlive the agent's connection, so a result that
arrives after the caller left is still read, recorded and fetchable.

The dispatch boundary is an awaited aiohttp trace signal: ``on_connection_create_end`` fires
once a *new* connection is established and its certificate verified, ``on_connection_reuseconn``
when a pooled one is taken, and in both cases aiohttp writes no request byte until the signal's
callbacks return. :meth:`ExchangeObserver.dispatch` commits ``DISPATCH_STARTED`` there. Anything
that fails before it is connection setup (``not_attempted``); anything after it is remote
execution (``unknown`` unless a complete response arrives).

All knowledge of aiohttp's exceptions lives here, in :func:`classify_setup_failure` and
:func:`classify_exchange_failure`; nothing else in the broker inspects them.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from .contract import Code

# Hop-by-hop and proxy headers never cross the broker (RFC 9110 section 7.6.1).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

# OpenSSL verify codes (X509_V_ERR_*) that name the reason a certificate was refused.
_EXPIRED = {10}  # CERT_HAS_EXPIRED
_NOT_YET_VALID = {9}
_HOSTNAME = {62}  # HOSTNAME_MISMATCH
_UNTRUSTED = {18, 19, 20, 21, 2, 24, 27, 28}  # self-signed, unknown issuer, untrusted, rejected


class ExchangeObserver(Protocol):
    """What the broker learns while an exchange runs. ``dispatch`` may refuse to go on."""

    async def dispatch(self, attempt: int, connection: str) -> None: ...

    async def request_sent(self) -> None: ...

    async def response_started(self, status: int) -> None: ...

    async def body_started(self) -> None: ...


class DispatchRefused(Exception):
    """Raised by an observer at the boundary: nothing may be written (journal down, fence lost)."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


class SetupFailed(Exception):
    """The connection could not be set up; no request byte was handed to any transport."""

    def __init__(self, stage: str, code: Code, diagnostic: str):
        super().__init__(diagnostic)
        self.stage = stage
        self.code = code
        self.diagnostic = diagnostic


class ExchangeFailed(Exception):
    """The request was (or may have been) dispatched and no complete response was received."""

    def __init__(self, code: Code, diagnostic: str, *, request_complete: bool, headers_received: bool):
        super().__init__(diagnostic)
        self.code = code
        self.diagnostic = diagnostic
        self.request_complete = request_complete
        self.headers_received = headers_received


class _SilentResend(Exception):
    """aiohttp tried to send the same request again on its own; the broker never allows that."""


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    connect_to: tuple[str, int] | None = None
    connect_timeout: float = 10.0
    max_response_body: int = 32 * 1024 * 1024


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

    @property
    def body_sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass(slots=True)
class _Progress:
    """Per-exchange state the trace callbacks fill in (aiohttp's ``trace_request_ctx``)."""

    observer: ExchangeObserver
    body_length: int
    tls: bool = False
    stage: str = "dns"
    dispatched: bool = False
    bytes_sent: int = 0
    request_complete: bool = False
    headers_received: bool = False
    attempt: int = 1
    errors: list[str] = field(default_factory=list)


class _Resolver(AbstractResolver):
    """Resolves through the system, except for hosts a route pins with ``connect_to``."""

    def __init__(self, timeout: float):
        self._system = ThreadedResolver()
        self._pins: dict[tuple[str, int], tuple[str, int]] = {}
        self._timeout = timeout

    def pin(self, host: str, port: int, target: tuple[str, int]) -> None:
        self._pins[(host.lower(), port)] = target

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        pinned = self._pins.get((host.lower(), port))
        if pinned is not None:
            address, real_port = pinned
            fam = socket.AF_INET6 if ":" in address else socket.AF_INET
            return [
                {"hostname": host, "host": address, "port": real_port, "family": fam, "proto": 0, "flags": socket.AI_NUMERICHOST}
            ]
        return await asyncio.wait_for(self._system.resolve(host, port, family), self._timeout)

    async def close(self) -> None:
        await self._system.close()


#: The exchange a new upstream connection is being opened for (aiohttp opens it in the task of
#: the request, so the socket factory below finds it here).
_OPENING: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar("affidavit_opening", default=None)


class _WatchedSocket(socket.socket):
    """A socket that tells its exchange when the TCP connection is up, so that a stall after
    that (in the TLS handshake) is recorded as such and not as a TCP connect. asyncio learns of
    the connection from ``connect()`` returning, or from ``SO_ERROR`` reading 0 once the socket
    turns writable; both calls come through here."""

    progress: _Progress | None = None

    def connect(self, address: Any) -> None:
        super().connect(address)
        self._up()

    def getsockopt(self, *args: Any) -> Any:
        value = super().getsockopt(*args)
        if args[:2] == (socket.SOL_SOCKET, socket.SO_ERROR) and value == 0:
            self._up()
        return value

    def _up(self) -> None:
        # Dropped once told: a pooled connection outlives the exchange that opened it.
        p, self.progress = self.progress, None
        if p is not None and p.tls and p.stage == "tcp_connect":
            p.stage = "tls_handshake"


def _open_socket(addr_info: Any) -> socket.socket:
    family, kind, proto = addr_info[:3]
    sock = _WatchedSocket(family, kind, proto)
    sock.progress = _OPENING.get()
    return sock


def _ctx(params_ctx: Any) -> _Progress | None:
    ctx = getattr(params_ctx, "trace_request_ctx", None)
    return ctx if isinstance(ctx, _Progress) else None


async def _on_dns_start(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        p.stage = "dns"


async def _on_dns_end(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        p.stage = "tcp_connect"


async def _on_create_start(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None and not p.dispatched:
        p.stage = "dns"


async def _boundary(p: _Progress, connection: str) -> None:
    if p.dispatched:
        # aiohttp retries a failed idempotent request on a new connection by itself; the broker
        # decides retries from evidence and route declarations, so the second send never starts.
        raise _SilentResend()
    await p.observer.dispatch(p.attempt, connection)
    p.dispatched = True
    p.stage = "dispatched"


async def _on_create_end(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        await _boundary(p, "new")


async def _on_reuse(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        await _boundary(p, "reused")


async def _sent(p: _Progress) -> None:
    if not p.request_complete and p.bytes_sent >= p.body_length:
        p.request_complete = True
        await p.observer.request_sent()


async def _on_headers_sent(_s: Any, tctx: Any, _p: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        await _sent(p)


async def _on_chunk_sent(_s: Any, tctx: Any, params: Any) -> None:
    if (p := _ctx(tctx)) is not None:
        p.bytes_sent += len(params.chunk)
        await _sent(p)


def _trace_config() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_dns_resolvehost_start.append(_on_dns_start)
    trace.on_dns_resolvehost_end.append(_on_dns_end)
    trace.on_connection_create_start.append(_on_create_start)
    trace.on_connection_create_end.append(_on_create_end)
    trace.on_connection_reuseconn.append(_on_reuse)
    trace.on_request_headers_sent.append(_on_headers_sent)
    trace.on_request_chunk_sent.append(_on_chunk_sent)
    return trace


def classify_setup_failure(exc: BaseException, stage: str) -> tuple[str, Code]:
    """(stage, code) for a failure before the dispatch boundary."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert_error = exc.certificate_error
        verify_code = getattr(cert_error, "verify_code", None)
        if verify_code in _EXPIRED or verify_code in _NOT_YET_VALID:
            return "tls_handshake", Code.TLS_CERT_EXPIRED
        if verify_code in _HOSTNAME:
            return "tls_handshake", Code.TLS_HOSTNAME_MISMATCH
        if verify_code in _UNTRUSTED:
            return "tls_handshake", Code.TLS_CERT_UNTRUSTED
        return "tls_handshake", Code.TLS_CERT_INVALID
    if isinstance(exc, (aiohttp.ClientConnectorSSLError, ssl.SSLError)):
        return "tls_handshake", Code.TLS_HANDSHAKE_FAILED
    if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(exc, socket.gaierror):
        return "dns", Code.DNS_FAILED
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ConnectionTimeoutError, aiohttp.ServerTimeoutError)):
        return (stage if stage != "dispatched" else "tcp_connect"), Code.CONNECT_TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "tcp_connect", Code.CONNECT_REFUSED
        if isinstance(exc.os_error, ssl.SSLError) or stage == "tls_handshake":
            return "tls_handshake", Code.TLS_HANDSHAKE_FAILED  # a reset mid-handshake, say
        if stage == "dns":
            return "dns", Code.DNS_FAILED
        return "tcp_connect", Code.CONNECT_FAILED
    return stage, Code.CONNECT_FAILED


def classify_exchange_failure(exc: BaseException, p: _Progress) -> Code:
    """The code for a failure after the boundary: the outcome is unknown either way."""
    if p.headers_received and isinstance(exc, aiohttp.ClientPayloadError):
        return Code.REMOTE_RESULT_INCOMPLETE
    return Code.REMOTE_OUTCOME_UNKNOWN


def framing_of(method: str, status: int, headers: Any) -> str:
    if method == "HEAD" or status in (204, 304):
        return "none"
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        return "chunked"
    if "Content-Length" in headers:
        return "content-length"
    return "close"


def diagnostic(exc: BaseException) -> str:
    """Library text for the internal diagnostic field only (never an envelope's message)."""
    text = str(exc).strip() or exc.__class__.__name__
    return f"{exc.__class__.__module__}.{exc.__class__.__qualname__}: {text}"[:500]


class ResponseTooLarge(Exception):
    pass


class Upstream:
    """One pooled aiohttp session per broker process."""

    def __init__(self, *, ca_bundle: str = "", dns_timeout: float = 10.0):
        context = ssl.create_default_context()
        if ca_bundle:
            context.load_verify_locations(cafile=ca_bundle)
        self._resolver = _Resolver(dns_timeout)
        self._connector = aiohttp.TCPConnector(
            limit=0,
            ssl=context,
            resolver=self._resolver,
            enable_cleanup_closed=False,
            keepalive_timeout=30,
            socket_factory=_open_socket,
        )
        self._session = aiohttp.ClientSession(
            connector=self._connector,
            trace_configs=[_trace_config()],
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        await self._session.close()

    def pin(self, host: str, port: int, target: tuple[str, int]) -> None:
        self._resolver.pin(host, port, target)

    async def exchange(self, request: UpstreamRequest, observer: ExchangeObserver, attempt: int = 1) -> UpstreamResponse:
        """Send ``request`` once. Raises :class:`SetupFailed`, :class:`DispatchRefused` or
        :class:`ExchangeFailed`; returns only a complete response."""
        progress = _Progress(observer=observer, body_length=len(request.body), attempt=attempt,
                             tls=request.url.startswith("https:"))
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        opening = _OPENING.set(progress)
        try:
            response = await self._session.request(
                request.method,
                request.url,
                headers=headers,
                data=request.body if request.body or request.method not in ("GET", "HEAD") else None,
                allow_redirects=False,
                trace_request_ctx=progress,
                timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=request.connect_timeout),
                read_until_eof=True,
            )
        except DispatchRefused:
            raise
        except asyncio.CancelledError:
            raise
        except _SilentResend:
            raise ExchangeFailed(
                Code.REMOTE_OUTCOME_UNKNOWN,
                "connection lost after dispatch; the transport's own re-send was refused",
                request_complete=progress.request_complete,
                headers_received=False,
            ) from None
        except Exception as exc:  # every other failure is classified by where it happened
            if not progress.dispatched:
                stage, code = classify_setup_failure(exc, progress.stage)
                raise SetupFailed(stage, code, diagnostic(exc)) from None
            raise ExchangeFailed(
                classify_exchange_failure(exc, progress),
                diagnostic(exc),
                request_complete=progress.request_complete,
                headers_received=False,
            ) from None
        finally:
            _OPENING.reset(opening)

        progress.headers_received = True
        if not progress.request_complete:
            # A complete response cannot precede the whole request on HTTP/1.1 unless the
            # server answered early; the bytes were at least handed over up to now.
            progress.request_complete = True
        peer = _peer_certificate(response)
        framing = framing_of(request.method, response.status, response.headers)
        try:
            await observer.response_started(response.status)
            body = await _read_body(response, request.max_response_body, observer)
        except ResponseTooLarge:
            response.close()
            raise ExchangeFailed(
                Code.RESULT_TOO_LARGE,
                f"response body exceeds {request.max_response_body} bytes",
                request_complete=True,
                headers_received=True,
            ) from None
        except asyncio.CancelledError:
            response.close()
            raise
        except Exception as exc:
            response.close()
            raise ExchangeFailed(
                classify_exchange_failure(exc, progress),
                diagnostic(exc),
                request_complete=True,
                headers_received=True,
            ) from None
        finally:
            response.release()
        return UpstreamResponse(
            status=response.status,
            reason=response.reason or "",
            headers=_headers(response),
            body=body,
            framing=framing,
            peer_certificate_sha256=peer,
            http_version=f"HTTP/{response.version.major}.{response.version.minor}" if response.version else "HTTP/1.1",
        )


def _headers(response: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]


async def _read_body(response: aiohttp.ClientResponse, limit: int, observer: ExchangeObserver) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ResponseTooLarge()
        if not chunks:
            await observer.body_started()
        chunks.append(chunk)
    # iter_any ends quietly at EOF; a framing error surfaces as an exception from the parser.
    if response.content.exception() is not None:
        raise response.content.exception()  # type: ignore[misc]
    return b"".join(chunks)


def _peer_certificate(response: aiohttp.ClientResponse) -> str | None:
    """The verified peer's certificate, bound to the record.

    A small response is complete (and its connection back in the pool) by the time the request
    returns, so ``response.connection`` is often None; the protocol object stays attached to the
    transport. Relying on ``_protocol`` is pinned by the end-to-end TLS tests.
    """
    connection = response.connection
    protocol = connection.protocol if connection is not None else getattr(response, "_protocol", None)
    transport = getattr(protocol, "transport", None)
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return "sha256:" + hashlib.sha256(der).hexdigest() if der else None
