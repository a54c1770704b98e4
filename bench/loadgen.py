"""Closed-loop keep-alive HTTP/1.1 load generator, run in its own process by ``run.py``.

Why not an off-the-shelf tool: the benchmark needs, in one tool, plain-HTTP proxying
(absolute-form request line), HTTPS through ``CONNECT`` with ``Proxy-Authorization`` and a TLS
session *to the proxy* that trusts the proxy's own CA, exact request counts (they are checked
against the broker's journal), and CPU snapshots taken at the exact edges of the measured window.

How it works: N persistent connections, each sending a pre-built request, waiting for the
response, and sending the next one at once (a closed loop: offered load = what the proxy can
take). The loop is driven from ``data_received`` callbacks - no coroutine or future per request -
so the client stays cheap next to a Python proxy. Only the status line and the framing
(Content-Length, or chunked) are parsed, plus, when the plan names one, a header every 200
response must carry. The same client drives the side-API benchmark: direct connections to the
API, the requests cycling through a list of URIs (one per recorded invocation).

Timeline: connect all (bounded) -> warm-up (not counted) -> measured window (responses that
*complete* inside it are counted; CPU of the watched processes is sampled at both edges) ->
drain (no new requests; in-flight ones may finish, bounded) -> close. Every request written is
counted in ``sent`` so the harness can compare it with the journal's row count.

Prints one JSON object on stdout; diagnostics on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import ssl
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import procstat

_MAX_HEAD = 64 * 1024


class ProtocolError(Exception):
    pass


def parse_response(buf: bytearray, *, no_body: bool = False) -> tuple[int, int, int] | None:
    """``(status, length of the head, length of the whole response)`` if ``buf`` holds a
    complete response, else None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > _MAX_HEAD:
            raise ProtocolError("response head too large")
        return None
    if buf[:5] != b"HTTP/":
        raise ProtocolError(f"not an HTTP response: {bytes(buf[:40])!r}")
    status = int(buf[9:12])
    start = end + 4
    if no_body or status in (204, 304) or status < 200:
        return status, start, start
    head = bytes(buf[:end]).lower()
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        total = start + int(head[i + 17 : j if j >= 0 else None])
        return (status, start, total) if len(buf) >= total else None
    if b"\r\ntransfer-encoding:" in head and b"chunked" in head:
        pos = start
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                if buf[pos : pos + 2] == b"\r\n":
                    return status, start, pos + 2
                trailer_end = buf.find(b"\r\n\r\n", pos)
                return (status, start, trailer_end + 4) if trailer_end >= 0 else None
            pos += size + 2
            if len(buf) < pos:
                return None
    raise ProtocolError(f"response {status} has no Content-Length and is not chunked")


@dataclass
class Plan:
    proxy_host: str
    proxy_port: int
    path: str  # "http" | "https"
    target_host: str
    target_port: int
    concurrency: int
    warmup: float
    duration: float
    auth: str | None  # "agent:token" for Proxy-Authorization, or None
    proxy_ca: str | None  # CA file the proxy's TLS interception certificates chain to
    direct: bool = False  # no proxy at all: talk to the target itself (upstream ceiling)
    upstream_ca: str | None = None  # only for direct https
    setup_timeout: float = 30.0
    drain_timeout: float = 10.0
    max_reconnects: int = 200
    watch: dict[str, int] = field(default_factory=dict)  # name -> pid (process tree)
    pg_database: str | None = None
    uris: list[str] = field(default_factory=lambda: ["/"])  # request targets, cycled one per request
    headers: dict[str, str] = field(default_factory=dict)  # extra request headers (e.g. Authorization)
    expect_header: str | None = None  # "Name: value" every 200 response must carry, else an error


class Conn(asyncio.Protocol):
    """One persistent client connection; its response callback sends the next request."""

    def __init__(self, gen: LoadGen) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.setup_waiter: asyncio.Future[int] | None = None
        self.expect_no_body = False
        self.sent_ns = 0
        self.in_flight = False
        self.closed = asyncio.get_running_loop().create_future()

    # -- asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            while True:
                parsed = parse_response(self.buf, no_body=self.expect_no_body)
                if parsed is None:
                    return
                status, head, n = parsed
                if self.setup_waiter is not None:
                    del self.buf[:n]
                    waiter, self.setup_waiter = self.setup_waiter, None
                    if not waiter.done():
                        waiter.set_result(status)
                    return
                expect = self.gen.expect
                missing = expect is not None and status == 200 and expect not in bytes(self.buf[:head]).lower()
                del self.buf[:n]
                self.gen.on_response(self, status, missing)
        except (ProtocolError, ValueError) as exc:
            self.gen.note_error(f"protocol: {exc}")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.setup_waiter is not None and not self.setup_waiter.done():
            self.setup_waiter.set_exception(ConnectionError(f"closed during setup: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)
        self.gen.on_lost(self)

    # -- actions --------------------------------------------------------------------------
    def send(self) -> None:
        assert self.transport is not None
        self.in_flight = True
        self.gen.sent += 1
        self.sent_ns = time.perf_counter_ns()
        self.transport.write(self.gen.next_request())


class LoadGen:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.loop = asyncio.get_running_loop()
        self.requests = self._build_requests()
        self.next_index = 0
        self.expect = f"\r\n{plan.expect_header.lower()}\r\n".encode() if plan.expect_header else None
        self.conns: list[Conn] = []
        self.running = False
        self.measure_start_ns = 0
        self.measure_end_ns = 1 << 62
        self.latencies_ns: list[int] = []
        self.ok = 0
        self.errors: Counter[str] = Counter()  # in the window: non-200 statuses and failures
        self.all_errors: Counter[str] = Counter()  # whole run, warm-up and drain included
        self.sent = 0
        self.completed = 0
        self.reconnects = 0
        self.idle_event = asyncio.Event()
        self.ssl_ctx = self._ssl_context()

    # -- request bytes and TLS ------------------------------------------------------------
    def _build_requests(self) -> list[bytes]:
        """One request per URI of the plan, built once; ``next_request`` cycles through them."""
        p = self.plan
        authority = f"{p.target_host}:{p.target_port}"
        out = []
        for uri in p.uris:
            lines: list[str]
            if p.path == "http" and not p.direct:
                lines = [f"GET http://{authority}{uri} HTTP/1.1", f"Host: {authority}"]
                if p.auth:
                    lines.append(f"Proxy-Authorization: Basic {base64.b64encode(p.auth.encode()).decode()}")
            else:
                lines = [f"GET {uri} HTTP/1.1", f"Host: {authority}"]
            lines += ["User-Agent: affidavit-bench", "Accept: */*", *(f"{k}: {v}" for k, v in p.headers.items())]
            out.append(("\r\n".join(lines) + "\r\n\r\n").encode())
        return out

    def next_request(self) -> bytes:
        request = self.requests[self.next_index]
        self.next_index = (self.next_index + 1) % len(self.requests)
        return request

    def _connect_request(self) -> bytes:
        p = self.plan
        authority = f"{p.target_host}:{p.target_port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if p.auth:
            lines.append(f"Proxy-Authorization: Basic {base64.b64encode(p.auth.encode()).decode()}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def _ssl_context(self) -> ssl.SSLContext | None:
        p = self.plan
        if p.path != "https":
            return None
        ca = p.upstream_ca if p.direct else p.proxy_ca
        ctx = ssl.create_default_context(cafile=ca)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    # -- connection setup -----------------------------------------------------------------
    async def open_one(self) -> Conn:
        p = self.plan
        host, port = (p.target_host, p.target_port) if p.direct else (p.proxy_host, p.proxy_port)
        if p.direct:
            host = "127.0.0.1"  # the upstream listens on 127.0.0.1 only
        transport, conn = await self.loop.create_connection(lambda: Conn(self), host, port)
        if p.path == "https":
            if not p.direct:
                conn.expect_no_body = True
                conn.setup_waiter = self.loop.create_future()
                transport.write(self._connect_request())
                status = await conn.setup_waiter
                conn.expect_no_body = False
                if status != 200:
                    transport.close()
                    raise ConnectionError(f"CONNECT answered {status}")
            assert self.ssl_ctx is not None
            tls = await self.loop.start_tls(
                transport, conn, self.ssl_ctx, server_hostname=p.target_host, ssl_handshake_timeout=p.setup_timeout
            )
            assert tls is not None
            conn.transport = tls
        return conn

    async def open_all(self) -> None:
        sem = asyncio.Semaphore(16)  # do not stampede a single-threaded proxy with handshakes

        async def one() -> Conn:
            async with sem:
                return await self.open_one()

        self.conns = list(
            await asyncio.wait_for(
                asyncio.gather(*(one() for _ in range(self.plan.concurrency))), self.plan.setup_timeout
            )
        )

    # -- the hot path ---------------------------------------------------------------------
    def on_response(self, conn: Conn, status: int, missing_header: bool) -> None:
        """``missing_header``: a 200 without the plan's ``expect_header`` (counted as an error)."""
        now = time.perf_counter_ns()
        conn.in_flight = False
        self.completed += 1
        good = status == 200 and not missing_header
        what = f"200 without {self.plan.expect_header}" if missing_header else str(status)
        if self.measure_start_ns <= now <= self.measure_end_ns:
            if good:
                self.ok += 1
                self.latencies_ns.append(now - conn.sent_ns)
            else:
                self.errors[what] += 1
        if not good:
            self.all_errors[what] += 1
        if self.running:
            conn.send()
        else:
            self._maybe_idle()

    def note_error(self, what: str) -> None:
        now = time.perf_counter_ns()
        if self.measure_start_ns <= now <= self.measure_end_ns:
            self.errors[what] += 1
        self.all_errors[what] += 1

    def on_lost(self, conn: Conn) -> None:
        if conn in self.conns and (self.running or conn.in_flight):
            self.note_error("connection lost")
            conn.in_flight = False
            self.conns.remove(conn)
            if self.running and self.reconnects < self.plan.max_reconnects:
                self.reconnects += 1
                self.loop.create_task(self._replace())
            self._maybe_idle()

    async def _replace(self) -> None:
        try:
            conn = await asyncio.wait_for(self.open_one(), self.plan.setup_timeout)
        except Exception as exc:  # noqa: BLE001 - any failure is one more error, not a crash
            self.note_error(f"reconnect failed: {type(exc).__name__}")
            return
        self.conns.append(conn)
        if self.running:
            conn.send()
        else:
            conn.transport.close()  # type: ignore[union-attr]

    def _maybe_idle(self) -> None:
        if not self.running and not any(c.in_flight for c in self.conns):
            self.idle_event.set()

    # -- CPU snapshots --------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, float], dict[str, list[int]]]:
        """CPU seconds of everything watched, and the pids of each watched process tree."""
        trees = procstat.trees_cpu(self.plan.watch)
        snap = {name: tree.seconds for name, tree in trees.items()}
        pg = procstat.postgres_cpu(self.plan.pg_database)
        snap["pg_own"] = pg.own
        snap["pg_all"] = pg.all
        t = os.times()
        snap["loadgen"] = t.user + t.system
        m = procstat.machine_cpu()
        snap["machine_busy"] = m.busy
        snap["machine_total"] = m.total
        return snap, {name: tree.pids for name, tree in trees.items()}

    async def run(self) -> dict[str, object]:
        p = self.plan
        t_setup = time.perf_counter()
        await self.open_all()
        setup_s = time.perf_counter() - t_setup

        self.running = True
        self.measure_start_ns = 1 << 62  # nothing counts during warm-up
        for conn in list(self.conns):
            conn.send()
        await asyncio.sleep(p.warmup)

        before, pids_before = self.snapshot()
        self.measure_start_ns = time.perf_counter_ns()
        self.measure_end_ns = self.measure_start_ns + int(p.duration * 1e9)
        await asyncio.sleep(p.duration)
        self.running = False
        window_ns = time.perf_counter_ns() - self.measure_start_ns
        after, pids_after = self.snapshot()

        self._maybe_idle()
        drained = True
        try:
            await asyncio.wait_for(self.idle_event.wait(), p.drain_timeout)
        except TimeoutError:
            drained = False
        unfinished = sum(1 for c in self.conns if c.in_flight)
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.close()
        if self.conns:
            await asyncio.wait([c.closed for c in self.conns], timeout=5)

        window_s = window_ns / 1e9
        lat = sorted(self.latencies_ns)
        cpu = {k: after[k] - before[k] for k in after}
        return {
            "ok": self.ok,
            "errors": dict(self.errors),
            "errors_total": sum(self.errors.values()),
            "all_errors": dict(self.all_errors),
            "sent": self.sent,
            "completed": self.completed,
            "unfinished": unfinished,
            "drained": drained,
            "reconnects": self.reconnects,
            "window_s": window_s,
            "setup_s": setup_s,
            "rps": self.ok / window_s if window_s > 0 else 0.0,
            "p50_ms": _pct(lat, 0.50),
            "p90_ms": _pct(lat, 0.90),
            "p99_ms": _pct(lat, 0.99),
            "max_ms": lat[-1] / 1e6 if lat else None,
            "mean_ms": sum(lat) / len(lat) / 1e6 if lat else None,
            "cpu_s": cpu,
            # Each watched tree's pids at the start and at the end of the window: a process
            # that died or was restarted in between shows up as a difference.
            "tree_pids": {name: [pids_before[name], pids_after[name]] for name in pids_before},
        }


def _pct(sorted_ns: list[int], q: float) -> float | None:
    if not sorted_ns:
        return None
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e6


async def _main(plan: Plan) -> dict[str, object]:
    gen = LoadGen(plan)
    return await gen.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True, help="JSON object with the fields of Plan")
    a = ap.parse_args()
    plan = Plan(**json.loads(a.plan))
    try:
        result = asyncio.run(_main(plan))
    except Exception as exc:  # noqa: BLE001 - report any failure as JSON for the harness
        print(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
