"""A hostile HTTP/1.1 upstream that misbehaves on purpose, per request, at the byte level.

The proxy must record exactly what it knows about a remote effect. To prove that, a test
needs an upstream that applies the effect and *then* breaks the exchange in a precise way
(close before a byte, truncate the body, never answer...), and that counts what it
actually applied. An HTTP framework would "fix" most of these breakages for us, so this
server parses HTTP/1.1 itself on asyncio streams.

The loop runs in a daemon thread so synchronous pytest tests can drive it. The behaviour
is picked per request from the path ``/h/<behaviour>[/anything][?query]``; any other path
is ``ok``. See :data:`BEHAVIOURS` and the ``_b_*`` methods for what each one does and
exactly when it applies the effect.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

from .certs import TLS_KINDS, TestPKI

FirstByteHook = Callable[[int, bytes], Any]

_MAX_HEAD = 64 * 1024
_READ_SIZE = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: behaviours that send "100 Continue" before reading the body even without Expect.
_ALWAYS_CONTINUE = {"continue_close", "continue_final"}
#: Behaviours that answer after the head, before (and without) reading the body.
_BEFORE_BODY = {"early_answer", "early_ok"}


def free_port() -> int:
    """A 127.0.0.1 port with no listener, for "connection refused" tests.

    Another process could grab it in between; on a test box that race is negligible.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Received:
    """One request as the upstream saw it. Mutated in place while the exchange runs."""

    conn_id: int
    index: int  # position of this request on its connection, from 0
    tls: str | None  # TLS kind of the listener, None for plain HTTP
    sni: str | None  # server name the client sent in its TLS ClientHello
    t_first_byte: float  # time.monotonic() when the first byte of this request arrived
    t_end: float | None = None  # when the whole request (head and body) had been read
    method: str = ""  # "" if the connection died before the request head was complete
    path: str = ""  # the request target exactly as sent (normally origin-form, with query)
    version: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""  # de-chunked
    raw_head: bytes = b""  # only kept for a head that never completed
    behaviour: str = ""
    complete: bool = False  # head and body fully read
    first_byte_probe: Any = None  # return value of on_first_byte
    first_byte_error: BaseException | None = None  # what on_first_byte raised, if anything
    effect_applied: bool = False
    client_gone: bool = False  # the client disconnected before the effect was applied
    idempotency_key: str | None = None
    response_status: int | None = None  # final status line sent (even if truncated after)

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (case-insensitive), or None."""
        lname = name.lower()
        return next((v for n, v in self.headers if n.lower() == lname), None)

    @property
    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlsplit(self.path).query).items()}

    @property
    def body_sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


class _Closed(Exception):
    """The peer closed the connection while we needed more bytes."""


class _BadRequest(Exception):
    pass


class _Conn:
    """One accepted connection: a byte buffer over an asyncio stream.

    We keep our own buffer (not StreamReader's line helpers) so the first byte of a
    request can be observed before anything else is parsed.
    """

    def __init__(self, conn_id: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: str | None, sni: str | None) -> None:
        self.id, self.reader, self.writer, self.tls, self.sni = conn_id, reader, writer, tls, sni
        self.buf = bytearray()

    async def fill(self) -> bool:
        """Append whatever the peer sends next; False on EOF."""
        try:
            data = await self.reader.read(_READ_SIZE)
        except (ConnectionError, ssl.SSLError):
            data = b""
        self.buf += data
        return bool(data)

    async def wait_input(self, timeout: float | None) -> str:
        """Wait for more input: "data", "eof" or "timeout". Data goes into the buffer."""
        try:
            got = await asyncio.wait_for(self.fill(), timeout)
        except asyncio.TimeoutError:
            return "timeout"
        return "data" if got else "eof"

    async def read_until(self, sep: bytes, limit: int) -> bytes:
        while (i := self.buf.find(sep)) < 0:
            if len(self.buf) > limit:
                raise _BadRequest("head too large")
            if not await self.fill():
                raise _Closed
        out = bytes(self.buf[: i + len(sep)])
        del self.buf[: i + len(sep)]
        return out

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise _Closed
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self, rst: bool = False, cut: bool = False) -> None:
        """Close (FIN, after TLS close_notify); with ``rst`` reset at once (SO_LINGER 0, abort);
        with ``cut`` a FIN with no TLS close_notify before it (what a truncating middlebox sends)."""
        if not rst and not cut:
            self.writer.close()
            return
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            if rst:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                sock.shutdown(socket.SHUT_RDWR)  # the FIN goes out before TLS can add anything
        self.writer.transport.abort()


def _encoded(body: bytes, coding: str) -> tuple[bytes, str]:
    """``body`` in a content coding, and the Content-Encoding value to send with it."""
    import zlib

    from mitmproxy.net import encoding

    if coding == "raw-deflate":  # what some servers send as "deflate"
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return c.compress(body) + c.flush(), "deflate"
    if coding == "bomb":  # 64 MiB of zeros, then the echo: small on the wire, huge decoded
        c = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        zeros = b"\0" * (1024 * 1024)
        parts = [c.compress(zeros) for _ in range(64)]
        return b"".join(parts) + c.compress(body) + c.flush(), "gzip"
    if coding == "gzip,br":
        return encoding.encode(encoding.encode(body, "gzip"), "br"), "gzip, br"
    if coding.startswith("gzip*"):  # gzip applied N times over, each declared
        for _ in range(int(coding[5:])):
            body = encoding.encode(body, "gzip")
        return body, ", ".join(["gzip"] * int(coding[5:]))
    return encoding.encode(body, coding), coding


def _response(status: int, body: bytes = b"", headers: list[tuple[str, str]] | None = None, *, close: bool = False,
              length: bool = True, reason: str | None = None) -> bytes:
    """Serialize a response. ``length=False`` omits Content-Length (close-delimited body)."""
    hs = list(headers or [])
    if body and not any(n.lower() == "content-type" for n, _ in hs):
        hs.insert(0, ("Content-Type", "application/json"))
    if length and status >= 200 and status not in (204, 304):
        hs.append(("Content-Length", str(len(body))))
    if close:
        hs.append(("Connection", "close"))
    try:
        reason = reason or HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{n}: {v}" for n, v in hs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _flag(q: dict[str, str], name: str) -> bool:
    return q.get(name, "") not in ("", "0", "false", "no")


def _wants_close(entry: Received) -> bool:
    tokens = {t.strip().lower() for t in (entry.header("Connection") or "").split(",")}
    if entry.version == "HTTP/1.0":
        return "keep-alive" not in tokens
    return "close" in tokens


class HostileUpstream:
    """The hostile upstream: one plain port, one TLS port per ``TLS_KINDS``, one stall port.

    Thread-safety: every public attribute can be read from the test thread at any time;
    ``received``, ``effects`` and ``effects_by_key`` return snapshots taken under a lock.
    """

    def __init__(self, pki: TestPKI | None = None, *, host: str = "127.0.0.1") -> None:
        self.pki, self.host = pki, host
        #: Called in the server thread, synchronously, as ``hook(conn_id, bytes_so_far)``
        #: when the first byte of each request arrives, before the rest is read.
        self.on_first_byte: FirstByteHook | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._received: list[Received] = []
        self._effects = 0
        self._effects_by_key: dict[str, int] = {}
        self._idem_store: dict[tuple[str, str], tuple[str, bytes]] = {}
        self._errors: list[str] = []
        self._tls_errors: list[tuple[int, str, str]] = []
        self._next_conn = 0
        self._ports: dict[str | None, int] = {}
        self._stall_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._gates: dict[str, asyncio.Event] = {}

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> "HostileUpstream":
        """Start the loop thread and open every listener; ports are known on return."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hostile-upstream", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close every listener and connection (ending hang/stall waits) and join the thread."""
        if self._thread is None or self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
            self._thread = None

    def __enter__(self) -> "HostileUpstream":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _open(self) -> None:
        self._servers, self._ports = [], {}
        for kind in TLS_KINDS if self.pki else ():
            assert self.pki is not None
            self._contexts[kind] = ctx = self.pki.server_context(kind)
            ctx.sni_callback = _remember_sni
        for kind in [None, *self._contexts]:
            srv = await asyncio.start_server(lambda r, w, k=kind: self._track(self._serve(r, w, k)), self.host, 0)
            self._servers.append(srv)
            self._ports[kind] = srv.sockets[0].getsockname()[1]
        stall = await asyncio.start_server(lambda r, w: self._track(self._stall(r, w)), self.host, 0)
        self._servers.append(stall)
        self._stall_port = stall.sockets[0].getsockname()[1]

    def _track(self, coro: Awaitable[None]) -> Awaitable[None]:
        """Run a connection handler as a task; the set holds it (the loop only keeps weak refs)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _close(self) -> None:
        for srv in self._servers:
            srv.close()
        # An accept already in flight is an asyncio-internal task that becomes one of our
        # handler tasks a few iterations later; cancel everything until nothing is left,
        # or that socket would outlive stop() unclosed.
        me = asyncio.current_task()
        while pending := [t for t in asyncio.all_tasks() if t is not me]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)
        await asyncio.sleep(0)  # run the socket closes the cancelled handlers scheduled
        for srv in self._servers:
            # Since Python 3.12 this also waits for every connection the server accepted to close,
            # and a TLS one whose peer never answers its close_notify takes asyncio's 30 s SSL
            # shutdown timeout: at teardown nothing waits on those sockets, so do not wait for them.
            try:
                await asyncio.wait_for(srv.wait_closed(), 1.0)
            except TimeoutError:
                pass

    # ----------------------------------------------------------------- addresses

    @property
    def http_port(self) -> int:
        return self._ports[None]

    def tls_port(self, kind: str) -> int:
        if kind not in self._ports:
            raise KeyError(f"no TLS listener {kind!r} (started without a TestPKI?)")
        return self._ports[kind]

    @property
    def tls_stall_port(self) -> int:
        """Accepts TCP, reads and discards, and never answers the TLS ClientHello."""
        return self._stall_port

    free_port = staticmethod(free_port)

    def url(self, path: str = "/", tls: str | None = None, host: str | None = None) -> str:
        """Absolute URL for ``path`` on the plain listener or the ``tls`` kind listener."""
        port = self.http_port if tls is None else self.tls_port(tls)
        return f"{'https' if tls else 'http'}://{host or self.host}:{port}{path}"

    # ----------------------------------------------------------------- observations

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    @property
    def effects(self) -> int:
        with self._lock:
            return self._effects

    @property
    def effects_by_key(self) -> dict[str, int]:
        with self._lock:
            return dict(self._effects_by_key)

    @property
    def errors(self) -> list[str]:
        """Unexpected exceptions inside the server; a self-test bug if ever non-empty."""
        with self._lock:
            return list(self._errors)

    @property
    def tls_errors(self) -> list[tuple[int, str, str]]:
        """(conn_id, kind, error) for each failed server-side TLS handshake."""
        with self._lock:
            return list(self._tls_errors)

    def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[Received]:
        """Block until at least ``n`` requests have been recorded; TimeoutError otherwise."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._received) >= n, timeout):
                raise TimeoutError(f"{len(self._received)} of {n} requests after {timeout}s")
            return list(self._received)

    def reset(self) -> None:
        """Forget requests, effects, idempotency records, errors and the hook.

        Connection ids keep counting so a connection left open by an earlier test can
        never be confused with a new one.
        """
        with self._lock:
            self._received.clear()
            self._effects = 0
            self._effects_by_key.clear()
            self._idem_store.clear()
            self._errors.clear()
            self._tls_errors.clear()
            self.on_first_byte = None

    # ----------------------------------------------------------------- connection loop

    async def _stall(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(_READ_SIZE):
                pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str | None) -> None:
        with self._lock:
            self._next_conn += 1
            conn_id = self._next_conn
        sni: str | None = None
        if kind is not None:
            # TLS is started by hand (not start_server(ssl=)) so failed handshakes are
            # still connections we can count and report.
            try:
                await writer.start_tls(self._contexts[kind], ssl_handshake_timeout=10)
            except (ssl.SSLError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
                with self._lock:
                    self._tls_errors.append((conn_id, kind, repr(exc)))
                writer.transport.abort()
                return
            sni = getattr(writer.get_extra_info("ssl_object"), "_hostile_sni", None)
        conn = _Conn(conn_id, reader, writer, kind, sni)
        try:
            index = 0
            while await self._one_request(conn, index):
                index += 1
        except (_Closed, ConnectionError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            conn.writer.transport.abort()
            raise
        except Exception as exc:  # a bug in this server: make it visible to the test
            with self._lock:
                self._errors.append(f"conn {conn_id}: {exc!r}")
        finally:
            conn.close()

    def _record(self, entry: Received) -> None:
        with self._arrived:
            self._received.append(entry)
            self._arrived.notify_all()

    async def _one_request(self, conn: _Conn, index: int) -> bool:
        """Read, record and answer one request; returns whether to keep the connection."""
        if not conn.buf and not await conn.fill():
            return False  # an idle keep-alive connection closed by the client
        entry = Received(conn.id, index, conn.tls, conn.sni, time.monotonic())
        hook = self.on_first_byte
        if hook is not None:
            try:
                entry.first_byte_probe = hook(conn.id, bytes(conn.buf))
            except BaseException as exc:  # pytest.fail() is a BaseException; the test asserts on it
                entry.first_byte_error = exc
        try:
            head = await conn.read_until(b"\r\n\r\n", _MAX_HEAD)
            _parse_head(entry, head)
        except _Closed:
            entry.raw_head = bytes(conn.buf)
            self._record(entry)
            raise
        except _BadRequest as exc:
            self._record(entry)
            await conn.send(_response(400, _json({"error": str(exc)}), close=True))
            return False
        self._record(entry)

        parts = urlsplit(entry.path).path.split("/")  # absolute-form routes the same way
        entry.behaviour = parts[2] if len(parts) > 2 and parts[1] == "h" else "ok"
        if entry.behaviour in _BEFORE_BODY:
            return bool(await getattr(self, f"_b_{entry.behaviour}")(conn, entry, entry.query))
        if entry.behaviour in _ALWAYS_CONTINUE or (entry.header("Expect") or "").lower() == "100-continue":
            await conn.send(_CONTINUE)
        try:
            entry.body = await _read_body(conn, entry)
        except _BadRequest as exc:
            await conn.send(_response(400, _json({"error": str(exc)}), close=True))
            return False
        entry.t_end = time.monotonic()
        entry.complete = True

        if entry.behaviour not in BEHAVIOURS:
            return await self._send(conn, entry, 404, _json({"error": f"unknown behaviour {entry.behaviour!r}"}))
        return bool(await getattr(self, f"_b_{entry.behaviour}")(conn, entry, entry.query))

    # ----------------------------------------------------------------- helpers for behaviours

    def _apply(self, entry: Received, key: str | None = None) -> int:
        """Apply the effect: the one place the counters move. Returns the new total."""
        with self._lock:
            self._effects += 1
            if key is not None:
                self._effects_by_key[key] = self._effects_by_key.get(key, 0) + 1
            entry.effect_applied = True
            return self._effects

    def _echo(self, conn: _Conn, entry: Received, effects: int) -> bytes:
        headers = [[n, v] for n, v in entry.headers]
        return _json({"method": entry.method, "path": entry.path, "headers": headers, "body_sha256": entry.body_sha256,
                      "body_length": len(entry.body), "conn_id": conn.id, "effects": effects})

    async def _send(self, conn: _Conn, entry: Received, status: int, body: bytes = b"", headers: list[tuple[str, str]] | None = None) -> bool:
        """Send a complete response, honouring the client's Connection preference. ``?encode=``
        a content coding (``gzip``, ``br``, ``zstd``, ``deflate``; ``raw-deflate``, ``bomb``):
        the body is sent with that coding whatever the client accepts."""
        close = _wants_close(entry)
        entry.response_status = status
        coding = entry.query.get("encode")
        if coding and body:
            body, label = _encoded(body, coding)
            headers = [*(headers or []), ("Content-Encoding", label)]
        if entry.query.get("te") == "gzip" and body:  # a transfer coding besides chunked (RFC 9112 7)
            from mitmproxy.net import encoding

            coded = encoding.encode(body, "gzip")
            head = _response(status, b"", [*(headers or []), ("Content-Type", "application/json"),
                                           ("Transfer-Encoding", "gzip, chunked")], close=close, length=False)
            await conn.send(head + b"%x\r\n" % len(coded) + coded + b"\r\n0\r\n\r\n")
            entry.response_status = status
            return not close
        data = _response(status, body, headers, close=close)
        if entry.method == "HEAD":
            data = data[: data.index(b"\r\n\r\n") + 4]
        await conn.send(data)
        return not close

    async def _send_and_close(self, conn: _Conn, entry: Received, q: dict[str, str], data: bytes, status: int | None = None) -> bool:
        entry.response_status = status
        if data:
            await conn.send(data)
        conn.close(rst=_flag(q, "rst"), cut=_flag(q, "cut"))
        return False

    async def _idempotent(self, conn: _Conn, entry: Received, q: dict[str, str], strict: bool) -> bool:
        key = entry.header(q.get("header", "Idempotency-Key"))
        entry.idempotency_key = key
        if key is None:
            return await self._send(conn, entry, 200, self._echo(conn, entry, self._apply(entry)))
        stored = self._idem_store.get((entry.behaviour, key))
        if stored is not None:
            sha, raw = stored
            if strict and sha != entry.body_sha256:
                err = {"error": "idempotency_key_reused", "detail": "same key, different body"}
                return await self._send(conn, entry, 422, _json(err))
            await self._hold(q)
            entry.response_status = int(raw.split(b" ", 2)[1])
            await conn.send(raw)  # byte-identical replay, whatever the client asked
            return not _wants_close(entry)
        # No await between the lookup above and storing below: concurrent first requests
        # for one key cannot both apply the effect.
        code = int(q.get("code", "200"))
        raw = _response(code, self._echo(conn, entry, self._apply(entry, key)))
        self._idem_store[(entry.behaviour, key)] = (entry.body_sha256, raw)
        if self._lose(q, key):
            return await self._send_and_close(conn, entry, q, b"")
        await self._hold(q)
        entry.response_status = code
        await conn.send(raw)
        return not _wants_close(entry)

    async def _hold(self, q: dict[str, str]) -> None:
        """Before an answer that is sent: ``?delay=S`` waits S seconds, ``?gate=NAME`` waits until
        the test calls :meth:`open_gate` (bounded)."""
        if "delay" in q:
            await asyncio.sleep(float(q["delay"]))
        if "gate" in q:
            await asyncio.wait_for(self._gate(q["gate"]).wait(), 30)

    def _gate(self, name: str) -> asyncio.Event:
        return self._gates.setdefault(name, asyncio.Event())

    def open_gate(self, name: str) -> None:
        """Let every response waiting at ``?gate=name`` go (and any later one pass at once)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: self._gate(name).set())

    def _lose(self, q: dict[str, str], key: str | None) -> bool:
        """``?lose=1``: the response to the first request per key is lost (the effect stays
        applied); ``?lose=all``: every response that follows an applied effect is lost."""
        lose = q.get("lose")
        if lose == "all":
            return True
        return lose == "1" and self._effects_by_key.get(key or "", 0) == 1

    # ----------------------------------------------------------------- behaviours
    # ``_b_<name>`` serves ``/h/<name>``; it returns whether to keep the connection open.
    # Each docstring states when the effect is applied. ``?rst=1`` on any behaviour that
    # closes makes it reset the connection (RST) instead of closing it (FIN).

    async def _b_ok(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect after the whole request is read; then (after ``?delay=``/``?gate=``, see
        :meth:`_hold`) a complete 200 JSON echo."""
        n = self._apply(entry)
        await self._hold(q)
        return await self._send(conn, entry, 200, self._echo(conn, entry, n))

    async def _b_status(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect, then a complete ``?code=`` (200) response; ``?retry_after=``, ``?location=``, ``?job=``,
        ``?header=Name:Value`` for any extra response header, ``?hop=Name`` for a header ``Name``
        that the response's ``Connection`` header names (an option of that hop only), ``?nest=N``
        for a body of N ``[`` (JSON nested past any parser's depth), ``?pad=N`` for an ``X-Pad``
        header of N bytes, ``?surrogate=1`` for a JSON job id holding a lone surrogate escape."""
        code = int(q.get("code", "200"))
        n = self._apply(entry)
        headers = [(h, q[p]) for p, h in (("retry_after", "Retry-After"), ("location", "Location")) if p in q]
        if "header" in q:
            name, _, value = q["header"].partition(":")
            headers.append((name, value))
        if "hop" in q:
            headers += [("Connection", q["hop"]), (q["hop"], "this hop only")]
        if "pad" in q:
            headers.append(("X-Pad", "p" * int(q["pad"])))
        body = _json({"job_id": q["job"], "status": "pending"} if "job" in q else {"status": code, "effects": n})
        if "nest" in q:  # a JSON document nested ?nest= levels deep, never closed
            body = b"[" * int(q["nest"])
        if "surrogate" in q:  # a job id JSON can spell but no text encoding can store
            body = b'{"job_id": "job-\\ud800-7", "status": "pending"}'
        return await self._send(conn, entry, code, b"" if code in (204, 304) else body, headers)

    async def _b_big(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect, then a complete 200 of ``?bytes=`` (1 MiB) bytes of ``x``: more than socket
        buffers hold, for agents that read slowly or not at all."""
        self._apply(entry)
        return await self._send(conn, entry, 200, b"x" * int(q.get("bytes", str(1 << 20))), [("Content-Type", "text/plain")])

    async def _b_mirror(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect, then a complete response that puts the credential it received (the
        ``Authorization`` value after its scheme) where a careless proxy would not look:
        ``?into=location`` (a 201's ``Location``), ``name`` (a header's *name*), ``reason`` (the
        reason phrase), ``job`` (a 202's job id), ``query`` (a 201's ``Location`` with the credential
        form-encoded in its query, and the same in a form-encoded body), ``coding`` (its
        ``Content-Encoding``), ``transfer`` (its ``Transfer-Encoding``, before ``chunked``)."""
        secret = (entry.header("Authorization") or "").partition(" ")[2]
        into = q.get("into", "location")
        n = self._apply(entry)
        status, body, headers, reason = 200, _json({"effects": n}), [], None
        if into == "location":
            status, headers = 201, [("Location", f"/things/{secret}")]
        elif into == "name":
            headers = [(f"X-Seen-{secret}", "1"), ("X-Kept", "yes")]
        elif into == "job":
            status, body = 202, _json({"job_id": f"job-{secret}", "status": "pending"})
        elif into == "reason":
            reason = f"OK {secret}"
        elif into == "query":
            encoded = urllib.parse.quote_plus(secret)
            status, headers, body = 201, [("Location", f"/things?token={encoded}")], f"token={encoded}".encode()
        elif into == "coding":
            headers = [("Content-Encoding", secret)]
        elif into == "transfer":
            entry.response_status = status
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %s, chunked\r\nConnection: close\r\n\r\n"
                            b"%x\r\n%s\r\n0\r\n\r\n" % (secret.encode(), len(body), body))
            conn.close()
            return False
        entry.response_status = status
        close = _wants_close(entry)
        await conn.send(_response(status, body, headers, close=close, reason=reason))
        return not close

    async def _b_reencode(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect, then a 200 that carries the credential it received re-encoded, as a careless
        upstream's debug output does (see :func:`reencodings`): in headers, in a ``Location``
        and in a JSON body (``?encode=`` applies). The credential is the ``Authorization`` value
        after its scheme, and for ``Basic`` also the password inside it."""
        scheme, _, value = (entry.header("Authorization") or "").partition(" ")
        seen = [value]
        if scheme.lower() == "basic":
            seen.append(base64.b64decode(value).decode().partition(":")[2])
        forms = {f"{i}:{name}": text for i, secret in enumerate(seen) for name, text in reencodings(secret).items()}
        first = reencodings(seen[-1])
        headers = [("X-Debug-Authorization", first["base64 of the header line"]), ("X-Token-Hex", first["hex, upper case"]),
                   ("X-Token", first["upper case"]), ("Location", f"/next?token={first['percent-encoded twice']}")]
        return await self._send(conn, entry, 200, _json({"effects": self._apply(entry), "debug": forms}), headers)

    async def _b_hang(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect after the whole request; never answers; holds until client close or stop()."""
        self._apply(entry)
        while await conn.wait_input(None) == "data":
            conn.buf.clear()
        return False

    async def _b_close_after_effect(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect after the whole request; then close without sending a single byte."""
        self._apply(entry)
        return await self._send_and_close(conn, entry, q, b"")

    async def _b_close_mid_headers(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; then half a header block and close."""
        self._apply(entry)
        return await self._send_and_close(conn, entry, q, b"HTTP/1.1 200 OK\r\nContent-Type: appl", 200)

    async def _b_short_body(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; ``Content-Length: 100`` but only 40 bytes (a padded JSON object); close."""
        n = self._apply(entry)
        body = _json({"partial": True, "effects": n}).ljust(40)[:40]
        head = _response(200, b"", [("Content-Type", "application/json"), ("Content-Length", "100")], length=False)
        return await self._send_and_close(conn, entry, q, head + body, 200)

    async def _b_chunked_truncated(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; chunked 200 with two chunks of JSON and no terminating chunk; close."""
        n = self._apply(entry)
        head = _response(200, b"", [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")], length=False)
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b'{"effects":%d,' % n, b'"items":['))
        return await self._send_and_close(conn, entry, q, head + chunks, 200)

    async def _b_close_delimited(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; 200 with neither Content-Length nor chunked, body ends at close (legal)."""
        body = self._echo(conn, entry, self._apply(entry))
        return await self._send_and_close(conn, entry, q, _response(200, body, close=True, length=False), 200)

    async def _b_early_answer(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """No effect; ``413`` (keep-alive) right after the head, the body never read; stops reading
        for ``?hold=S`` seconds (5), then closes: an upstream that refuses early."""
        conn.writer.transport.pause_reading()
        entry.response_status = 413
        await conn.send(_response(413, _json({"error": "too large"})))
        await asyncio.sleep(float(q.get("hold", 5)))
        return False

    async def _b_early_ok(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """No effect; ``200`` (keep-alive) right after the head, and the body is never read: it
        stays in the connection and is parsed as the start of the next request on it. A naive
        server (non-conforming), the kind a pooled client must not let one caller's body reach
        another caller's request through."""
        entry.response_status = 200
        await conn.send(_response(200, _json({"early": True, "conn_id": conn.id})))
        return True

    async def _b_continue_close(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """``100 Continue`` before the body; effect after the body; close with no final response."""
        self._apply(entry)
        return await self._send_and_close(conn, entry, q, b"")

    async def _b_continue_final(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """``100 Continue``; effect after the body; complete ``?code=`` (201) echo response."""
        body = self._echo(conn, entry, self._apply(entry))
        return await self._send(conn, entry, int(q.get("code", "201")), body)

    async def _b_slow(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Wait ``?delay=`` (1.0) s; effect at the end even if the client left; then 200 echo."""
        deadline = time.monotonic() + float(q.get("delay", "1.0"))
        while (left := deadline - time.monotonic()) > 0:
            if await conn.wait_input(left) == "eof":
                entry.client_gone = True
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                break
        n = self._apply(entry)
        if entry.client_gone:
            return False
        return await self._send(conn, entry, 200, self._echo(conn, entry, n))

    async def _b_stall_mid_body(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; a 200 head promising 100 bytes and 10 of them; then nothing for ``?delay=`` (10)
        s or until the client leaves; then close."""
        self._apply(entry)
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"effects":'[:10])
        entry.response_status = 200
        await conn.wait_input(float(q.get("delay", "10")))
        return False

    async def _b_idle_close(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; keep-alive 200 echo; close ``?after=`` (0.2) s later if the client stays idle.

        Like a real server's idle timer: a request arriving before then is served normally.
        """
        body = self._echo(conn, entry, self._apply(entry))
        if not await self._send(conn, entry, 200, body, [("Keep-Alive", "timeout=60")]):
            return False
        if conn.buf:
            return True
        return await conn.wait_input(float(q.get("after", "0.2"))) == "data"

    async def _b_redirect(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Effect; complete ``?code=`` (307) with ``Location: ?to=`` (default /h/ok)."""
        n = self._apply(entry)
        code = int(q.get("code", "307"))
        return await self._send(conn, entry, code, _json({"effects": n}), [("Location", q.get("to", "/h/ok"))])

    async def _b_idem_honour(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """First request per key: effect + stored ``?code=`` (200); repeats: stored bytes, no
        effect. ``?lose=1|all`` drops the response after the effect (see ``_lose``)."""
        return await self._idempotent(conn, entry, q, strict=False)

    async def _b_idem_strict(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """As idem_honour, but a repeat key with a different body gets 422 and no effect."""
        return await self._idempotent(conn, entry, q, strict=True)

    async def _b_idem_ignore(self, conn: _Conn, entry: Received, q: dict[str, str]) -> bool:
        """Ignores the key: effect every time (also counted per key)."""
        key = entry.header(q.get("header", "Idempotency-Key"))
        entry.idempotency_key = key
        body = self._echo(conn, entry, self._apply(entry, key))
        if self._lose(q, key):
            return await self._send_and_close(conn, entry, q, b"")
        return await self._send(conn, entry, int(q.get("code", "200")), body)


#: Every behaviour name, for tests that want to iterate over them.
def reencodings(secret: str) -> dict[str, str]:
    """The credential as a careless upstream re-encodes it: base64 (both alphabets) with 0, 1
    or 2 bytes before it, alone and inside the echoed header line; hex in both cases; the secret
    upper- and lower-cased; percent-encoded twice and three times over."""
    raw = secret.encode()
    forms = {}
    for before in (b"", b"x", b"xy"):
        forms[f"base64 after {len(before)} bytes"] = base64.b64encode(before + raw + b"!").decode()
        forms[f"URL-safe base64 after {len(before)} bytes"] = base64.urlsafe_b64encode(before + raw).decode().rstrip("=")
    forms["base64 of the header line"] = base64.b64encode(b"Authorization: Bearer " + raw).decode()
    forms["hex"] = raw.hex()
    forms["hex, upper case"] = raw.hex().upper()
    forms["upper case"] = secret.upper()
    forms["lower case"] = secret.lower()
    forms["percent-encoded twice"] = urllib.parse.quote(urllib.parse.quote(secret, safe=""), safe="")
    forms["form-encoded, then percent-encoded"] = urllib.parse.quote(urllib.parse.quote_plus(secret), safe="")
    forms["percent-encoded three times"] = urllib.parse.quote(forms["percent-encoded twice"], safe="")
    return forms


BEHAVIOURS: tuple[str, ...] = tuple(sorted(n[3:] for n in vars(HostileUpstream) if n.startswith("_b_")))


def _remember_sni(sslobj: Any, name: str | None, ctx: ssl.SSLContext) -> None:
    # ssl.SSLObject has no __slots__, so the name can ride on the object itself.
    sslobj._hostile_sni = name


def _parse_head(entry: Received, head: bytes) -> None:
    try:
        lines = head.decode("latin-1").split("\r\n")[:-2]
        entry.method, entry.path, entry.version = lines[0].split(" ")
    except ValueError:
        entry.raw_head = head
        raise _BadRequest("bad request line") from None
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(f"bad header line {line!r}")
        entry.headers.append((name, value.strip()))


async def _read_body(conn: _Conn, entry: Received) -> bytes:
    if "chunked" in (entry.header("Transfer-Encoding") or "").lower():
        body = bytearray()
        while True:
            size_line = await conn.read_until(b"\r\n", 1024)
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadRequest("bad chunk size") from None
            if size == 0:
                while await conn.read_until(b"\r\n", _MAX_HEAD) != b"\r\n":
                    pass  # trailers: read and drop
                return bytes(body)
            body += await conn.read_exact(size)
            await conn.read_exact(2)
    length = entry.header("Content-Length") or "0"
    if not length.isdigit():
        raise _BadRequest(f"bad Content-Length {length!r}")
    return await conn.read_exact(int(length))
