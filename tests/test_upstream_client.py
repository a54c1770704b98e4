"""The broker's upstream client on its own: real loopback sockets, scripted servers, no broker.

What matters here is the dispatch boundary (no byte before ``dispatch`` returns, nothing after a
refusal), where each failure is placed (setup or exchange), and which connections are reused.
The end-to-end behaviour through mitmproxy and the journal is in test_broker_e2e.py and
test_hostile_contract.py.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any, Awaitable, Callable

import pytest

from proxy.contract import Code
from proxy.upstream import DispatchRefused, ExchangeFailed, SetupFailed, Upstream, UpstreamRequest, _connect_socket, end_to_end
from tests.support.certs import TestPKI

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A loopback server whose every connection runs ``handler``; it counts connections and
    keeps every byte it read, in order."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None):
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.received = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> "Server":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: Any) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.received += head
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.received += body
        return head + body


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server, response: bytes = OK) -> None:
    while True:
        await server.read_request(reader)
        writer.write(response)
        await writer.drain()


class Observer:
    """Records what the client tells; ``on_dispatch`` runs inside the boundary."""

    def __init__(self, on_dispatch: Callable[[], Awaitable[None]] | None = None):
        self.on_dispatch = on_dispatch
        self.calls: list[tuple[str, Any]] = []

    async def dispatch(self, attempt: int, connection: str) -> None:
        self.calls.append(("dispatch", connection))
        if self.on_dispatch is not None:
            await self.on_dispatch()

    async def request_sent(self) -> None:
        self.calls.append(("request_sent", None))

    async def response_started(self, status: int) -> None:
        self.calls.append(("response_started", status))

    async def body_started(self) -> None:
        self.calls.append(("body_started", None))


def request(port: int, method: str = "POST", body: bytes = b"{}", headers: list[tuple[str, str]] | None = None, **kw: Any) -> UpstreamRequest:
    return UpstreamRequest(method=method, scheme=kw.pop("scheme", "http"), host="127.0.0.1", port=port, target="/x",
                           headers=headers or [("Content-Type", "application/json")], body=body, **kw)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_no_request_byte_reaches_the_upstream_before_dispatch_returns():
    async def main() -> None:
        async with Server(answer_each) as server:
            upstream = Upstream()
            seen_at_boundary: list[int] = []

            async def boundary() -> None:
                await asyncio.sleep(0.2)  # a slow commit: the upstream must still have nothing
                seen_at_boundary.append(len(server.received))

            try:
                for _ in range(2):
                    observer = Observer(boundary)
                    response = await upstream.exchange(request(server.port), observer)
                    assert response.status == 200 and response.body == b"ok" and response.framing == "content-length"
            finally:
                await upstream.close()
            assert seen_at_boundary == [0, len(server.received) // 2]
            assert server.connections == 1, "the second exchange reuses the first connection"
            assert observer.calls == [("dispatch", "reused"), ("request_sent", None), ("response_started", 200), ("body_started", None)]

    run(main())


def test_a_refused_dispatch_writes_nothing_and_the_connection_serves_the_next_request():
    async def main() -> None:
        async with Server(answer_each) as server:
            upstream = Upstream()

            async def refuse() -> None:
                raise DispatchRefused(Code.JOURNAL_UNAVAILABLE, "journal down")

            try:
                with pytest.raises(DispatchRefused):
                    await upstream.exchange(request(server.port), Observer(refuse))
                await asyncio.sleep(0.1)
                assert server.received == b"" and server.connections == 1
                observer = Observer()
                await upstream.exchange(request(server.port), observer)
                assert observer.calls[0] == ("dispatch", "reused") and server.received.startswith(b"POST /x HTTP/1.1\r\n")
            finally:
                await upstream.close()

    run(main())


def test_a_header_that_would_split_the_request_fails_setup_before_any_connection():
    async def main() -> None:
        async with Server(answer_each) as server:
            upstream = Upstream()
            observer = Observer()
            try:
                with pytest.raises(SetupFailed) as failed:
                    await upstream.exchange(request(server.port, headers=[("X-Key", "abc\r\nX-Evil: 1")]), observer)
            finally:
                await upstream.close()
            assert failed.value.stage == "request" and failed.value.code is Code.CONNECT_FAILED
            assert observer.calls == [] and server.connections == 0

    run(main())


def test_the_request_as_written_upstream():
    async def main() -> None:
        async with Server(answer_each) as server:
            upstream = Upstream()
            try:
                await upstream.exchange(request(server.port, body=b'{"a":1}', headers=[
                    ("Content-Type", "application/json"), ("Connection", "close"), ("Host", "forged"),
                    ("Content-Length", "999"), ("Proxy-Authorization", "Basic secret"), ("X-Two", "1"), ("X-Two", "2"),
                ]), Observer())
                await upstream.exchange(request(server.port, method="GET", body=b""), Observer())
            finally:
                await upstream.close()
            first, second = bytes(server.received).split(b"}", 1)
            assert first + b"}" == (
                b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\nX-Two: 1\r\nX-Two: 2\r\n"
                b"Content-Length: 7\r\n\r\n{\"a\":1}" % server.port
            )
            assert second == b"GET /x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n\r\n" % server.port

    run(main())


@pytest.mark.parametrize("tls", [False, True])
def test_setup_failures_name_their_stage(tls: bool):
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await asyncio.sleep(5)  # accepts, never speaks (no TLS handshake either)

    async def main() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))  # bound, not listening: refused
            closed = probe.getsockname()[1]
            upstream = Upstream()
            observer = Observer()
            try:
                with pytest.raises(SetupFailed) as refused:
                    await upstream.exchange(request(closed, scheme="https" if tls else "http"), observer)
                assert (refused.value.stage, refused.value.code) == ("tcp_connect", Code.CONNECT_REFUSED)
                if tls:
                    async with Server(silent) as server:
                        with pytest.raises(SetupFailed) as stalled:
                            await upstream.exchange(request(server.port, scheme="https", connect_timeout=0.3), observer)
                    assert (stalled.value.stage, stalled.value.code) == ("tls_handshake", Code.CONNECT_TIMEOUT)
            finally:
                await upstream.close()
            assert observer.calls == []

    run(main())


async def _one(handler: Handler, method: str = "POST", limit: int = 1024) -> tuple[Any, Observer, Server]:
    async with Server(handler) as server:
        upstream = Upstream()
        observer = Observer()
        try:
            return await upstream.exchange(request(server.port, method=method, max_response_body=limit), observer), observer, server
        except (ExchangeFailed, SetupFailed) as exc:
            return exc, observer, server
        finally:
            await upstream.close()


def _replying(response: bytes, then_close: bool = True) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(response)
        await writer.drain()
        if not then_close:
            await asyncio.sleep(5)

    return handler


def test_a_close_delimited_body_is_complete_at_a_clean_close():
    response, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")))
    assert response.body == b"all of it" and response.framing == "close"


def test_a_short_body_is_incomplete_and_no_answer_is_unknown():
    short, observer, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")))
    assert isinstance(short, ExchangeFailed) and short.code is Code.REMOTE_RESULT_INCOMPLETE
    assert short.headers_received and short.request_complete
    assert ("response_started", 200) in observer.calls
    chunked, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc")))
    assert isinstance(chunked, ExchangeFailed) and chunked.code is Code.REMOTE_RESULT_INCOMPLETE
    silent, observer, _ = run(_one(_replying(b"")))
    assert isinstance(silent, ExchangeFailed) and silent.code is Code.REMOTE_OUTCOME_UNKNOWN
    assert silent.request_complete and not silent.headers_received
    assert [c[0] for c in observer.calls] == ["dispatch", "request_sent"]
    garbage, _, _ = run(_one(_replying(b"NOT HTTP AT ALL\r\n\r\n")))
    assert isinstance(garbage, ExchangeFailed) and garbage.code is Code.REMOTE_OUTCOME_UNKNOWN


@pytest.mark.parametrize("status", [b"099", b"000", b"042"])
def test_a_status_below_100_is_no_answer_at_once_not_an_interim_one(status: bytes):
    """llhttp reads any three digits; taken for a 1xx, the exchange would wait for a final
    response until the response timeout (it did: 504 after response_timeout)."""
    started = time.monotonic()
    broken, _, _ = run(_one(_replying(b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 2\r\n\r\nok", then_close=False)))
    assert isinstance(broken, ExchangeFailed) and broken.code is Code.REMOTE_OUTCOME_UNKNOWN, broken
    assert not broken.headers_received and time.monotonic() - started < 2


def test_interim_responses_are_skipped():
    final, _, _ = run(_one(_replying(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK, then_close=False)))
    assert (final.status, final.body, final.headers) == (200, b"ok", [("Content-Length", "2")])


def test_a_head_response_has_no_body_and_its_connection_is_not_reused():
    """llhttp would read the next response as the body a HEAD response announced."""

    async def head_then_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while True:
            is_head = (await server.read_request(reader)).startswith(b"HEAD ")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" if is_head else OK)
            await writer.drain()

    async def main() -> None:
        async with Server(head_then_get) as server:
            upstream = Upstream()
            try:
                head = await upstream.exchange(request(server.port, method="HEAD", body=b""), Observer())
                get = await upstream.exchange(request(server.port, method="GET", body=b""), Observer())
            finally:
                await upstream.close()
            assert (head.status, head.body, head.framing) == (200, b"", "none")
            assert (get.status, get.body) == (200, b"ok") and server.connections == 2

    run(main())


@pytest.mark.parametrize("size", [100_000, 250_000])
def test_a_large_body_in_the_same_write_as_the_head_is_complete(size: int):
    """One read may hold the head and most of the body: only the head counts towards its limit."""
    body = bytes(range(256)) * (size // 256)
    response, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body), limit=1 << 20))
    assert not isinstance(response, Exception), response
    assert response.status == 200 and response.body == body


def test_a_head_over_its_limit_is_still_refused():
    huge = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\nContent-Length: 2\r\n\r\nok"
    broken, _, _ = run(_one(_replying(huge), limit=1 << 20))
    assert isinstance(broken, ExchangeFailed) and "head exceeds" in broken.diagnostic, broken
    assert broken.code is Code.RESULT_TOO_LARGE and not broken.headers_received, "not a connection that broke"


def test_a_body_over_the_limit_is_result_too_large():
    big, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000), limit=1000))
    assert isinstance(big, ExchangeFailed) and big.code is Code.RESULT_TOO_LARGE and big.headers_received


@pytest.mark.parametrize("after", [b"", b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"], ids=["close", "unsolicited"])
def test_a_pooled_connection_the_upstream_gave_up_is_not_reused(after: bytes):
    """The upstream closes an idle keep-alive connection (or says 408 on it first): the next
    request goes on a new connection, rather than onto one whose write would be lost."""

    async def once_then_give_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(after)
        await writer.drain()
        if after:
            await asyncio.sleep(5)

    async def main() -> None:
        async with Server(once_then_give_up) as server:
            upstream = Upstream()
            try:
                await upstream.exchange(request(server.port), Observer())
                await asyncio.sleep(0.3)
                observer = Observer()
                response = await upstream.exchange(request(server.port), observer)
            finally:
                await upstream.close()
            assert response.status == 200 and observer.calls[0] == ("dispatch", "new") and server.connections == 2

    run(main())


def test_a_connection_closing_response_is_not_reused():
    async def main() -> None:
        async with Server(lambda r, w, s: answer_each(r, w, s, b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")) as server:
            upstream = Upstream()
            try:
                for _ in range(2):
                    observer = Observer()
                    await upstream.exchange(request(server.port), observer)
                    assert observer.calls[0] == ("dispatch", "new")
            finally:
                await upstream.close()
            assert server.connections == 2

    run(main())


def test_an_idle_connection_is_reused_within_keepalive_only():
    """[upstream] keepalive: a connection idle longer is closed, not written on (an upstream whose
    own idle timeout is shorter may be closing it, and a write there has an unknown outcome)."""
    async def main() -> None:
        async with Server(answer_each) as server:
            upstream = Upstream(keepalive=0.3)
            try:
                seen = []
                for pause in (0.0, 0.05, 0.6, 0.05):
                    await asyncio.sleep(pause)
                    observer = Observer()
                    await upstream.exchange(request(server.port), observer)
                    seen.append(observer.calls[0][1])
            finally:
                await upstream.close()
            assert seen == ["new", "reused", "new", "reused"]
            assert server.connections == 2

    run(main())


def test_a_close_delimited_body_cut_by_the_broker_itself_is_not_complete():
    """At shutdown the broker closes its connections; the end of the connection is then no
    evidence that a close-delimited body was whole."""

    async def main() -> None:
        async with Server(_replying(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe first half", then_close=False)) as server:
            upstream = Upstream()
            exchange = asyncio.ensure_future(upstream.exchange(request(server.port), Observer()))
            await asyncio.sleep(0.3)
            await upstream.close()
            with pytest.raises(ExchangeFailed) as cut:
                await exchange
            assert cut.value.code is Code.REMOTE_RESULT_INCOMPLETE and cut.value.headers_received

    run(main())


@pytest.mark.parametrize("stray", [b"HTTP/1.1 500 Injected\r\nX-Evil: 1\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 201 Cre"],
                         ids=["whole", "partial"])
def test_bytes_after_the_response_neither_change_it_nor_reach_the_next_request(stray: bytes):
    """A second response in the same segment as the first must not be parsed into the recorded
    one, and its connection must not carry the next request (whose answer it would corrupt)."""

    answered: list[int] = []

    async def reply_with_stray(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while True:
            await server.read_request(reader)
            answered.append(1)
            writer.write(OK + stray if len(answered) == 1 else b"HTTP/1.1 409 Conflict\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with Server(reply_with_stray) as server:
            upstream = Upstream()
            try:
                first = await upstream.exchange(request(server.port), Observer())
                await asyncio.sleep(0.1)
                second = await upstream.exchange(request(server.port), Observer())
            finally:
                await upstream.close()
            assert (first.status, first.reason, first.headers, first.body) == (200, "OK", [("Content-Length", "2")], b"ok")
            assert second.status == 409 and server.connections == 2

    run(main())


def test_an_endless_response_head_is_broken_not_buffered():
    huge, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 0\r\n\r\n")))
    assert isinstance(huge, ExchangeFailed) and huge.code is Code.RESULT_TOO_LARGE and "exceeds" in huge.diagnostic


@pytest.mark.parametrize("interim", [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"],
                         ids=["100", "103"])
def test_a_head_over_its_limit_after_an_interim_response_in_the_same_read_is_broken(interim: bytes):
    """The final head that follows an interim response in the same read is a head too, not body.
    (100 KB reaches the client in one read on loopback; a read takes up to 256 KiB.)"""
    final = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\nContent-Length: 0\r\n\r\n"
    huge, _, _ = run(_one(_replying(interim + final)))
    assert isinstance(huge, ExchangeFailed) and huge.code is Code.RESULT_TOO_LARGE and "exceeds" in huge.diagnostic, huge
    assert not huge.headers_received


def test_interim_heads_and_the_final_head_share_the_limit_and_its_body_does_not_count():
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </" + b"a" * 40_000 + b">\r\n\r\n"
    big = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 30_000 + b"\r\nContent-Length: 2\r\n\r\nok"
    broken, _, _ = run(_one(_replying(hints + big)))
    assert isinstance(broken, ExchangeFailed) and "head exceeds" in broken.diagnostic, broken
    body = bytes(range(256)) * 800
    response, _, _ = run(_one(_replying(hints + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body), limit=1 << 20))
    assert not isinstance(response, Exception), response
    assert response.status == 200 and response.body == body


# -- TLS ------------------------------------------------------------------------------------------


def _tls_replying(response: bytes, end: str) -> Handler:
    """Answer every request with ``response``; after the first, end the connection: ``keep`` (do
    not), ``close_notify`` (a clean TLS close, then FIN) or ``cut`` (a TCP FIN and no
    close_notify: what a truncating middlebox would send)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while True:
            await server.read_request(reader)
            writer.write(response)
            await writer.drain()
            if end == "cut":
                await asyncio.sleep(0.05)  # the response's records are on the wire first
                writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
                writer.transport.abort()
                return
            if end == "close_notify":
                return  # Server closes the writer: close_notify, then FIN

    return handler


async def _tls_exchanges(pki: TestPKI, handler: Handler, count: int = 1) -> tuple[list[Any], Server]:
    async with Server(handler, pki.server_context("good")) as server:
        upstream = Upstream(ca_bundle=pki.ca_cert)
        results: list[Any] = []
        try:
            for _ in range(count):
                try:
                    results.append(await upstream.exchange(request(server.port, scheme="https"), Observer()))
                except ExchangeFailed as exc:
                    results.append(exc)
                await asyncio.sleep(0.1)  # session tickets and closes arrive while the connection idles
        finally:
            await upstream.close()
        return results, server


CLOSE_DELIMITED = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"


def test_tls_connections_are_verified_and_reused(pki: TestPKI):
    (first, second), server = run(_tls_exchanges(pki, _tls_replying(OK, "keep"), count=2))
    assert first.body == second.body == b"ok" and first.peer_certificate_sha256.startswith("sha256:")
    assert server.connections == 1, "the TLS connection (and its session tickets) kept for the next request"


def test_a_close_delimited_tls_body_is_complete_only_after_close_notify(pki: TestPKI):
    (clean,), _ = run(_tls_exchanges(pki, _tls_replying(CLOSE_DELIMITED, "close_notify")))
    assert clean.body == b"all of it" and clean.framing == "close"
    (cut,), _ = run(_tls_exchanges(pki, _tls_replying(CLOSE_DELIMITED, "cut")))
    assert isinstance(cut, ExchangeFailed) and cut.code is Code.REMOTE_RESULT_INCOMPLETE, cut
    assert "close_notify" in cut.diagnostic


def test_a_framed_tls_response_stands_whatever_follows_it(pki: TestPKI):
    """The cut only matters where the close is the framing: a Content-Length body that arrived
    whole is complete, and a connection that ended without close_notify is simply not reused."""
    (first, second), server = run(_tls_exchanges(pki, _tls_replying(OK, "cut"), count=2))
    assert first.body == second.body == b"ok" and server.connections == 2


def test_closing_the_client_ends_an_exchange_in_flight_at_once(pki: TestPKI):
    """Shutdown must not wait for an upstream's TLS goodbye (asyncio's TLS transport waits up to
    30 s for it); the exchange in flight ends, as incomplete, right away."""

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(CLOSE_DELIMITED)
        await writer.drain()
        writer.transport.pause_reading()  # a hung upstream: it will not answer a close_notify
        await asyncio.sleep(5)

    async def main() -> None:
        async with Server(hung, pki.server_context("good")) as server:
            upstream = Upstream(ca_bundle=pki.ca_cert)
            exchange = asyncio.ensure_future(upstream.exchange(request(server.port, scheme="https"), Observer()))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await upstream.close()
            with pytest.raises(ExchangeFailed) as cut:
                await asyncio.wait_for(exchange, 2)
            assert cut.value.code is Code.REMOTE_RESULT_INCOMPLETE and time.monotonic() - started < 1

    run(main())


def test_an_address_that_never_answers_leaves_time_for_the_next():
    """A name with two addresses, the first silently dropping SYNs (a listener whose backlog is
    full): the second is tried within the same connect timeout."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with socket.socket() as full, socket.socket() as filler, socket.socket() as good:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            filler.connect(full.getsockname())  # the one place in the backlog; the next SYN waits
            good.bind(("127.0.0.1", 0))
            good.listen(1)
            addresses = [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", a) for a in (full.getsockname(), good.getsockname())]
            started = time.monotonic()
            sock = await asyncio.wait_for(_connect_socket(loop, addresses, 2.0), 5)
            took = time.monotonic() - started
            with sock:
                assert sock.getpeername() == good.getsockname()
            assert 0.9 < took < 1.5, took  # half of the timeout on the first address, then the second

            with pytest.raises(TimeoutError):
                await _connect_socket(loop, addresses[:1], 0.3)

    run(main())


def test_a_request_the_upstream_has_not_read_is_not_complete():
    """``request_sent`` (REQUEST_SENT, ``evidence.request_complete``) means the socket took the
    last byte, not that it was queued: an upstream that stops reading after the head leaves a
    large body in the broker's buffer, and the evidence must say the request is not complete."""
    body = b"x" * (48 * 1024 * 1024)  # more than loopback's socket buffers hold

    async def read_head_then_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        server.received += await reader.readuntil(b"\r\n\r\n")
        writer.transport.pause_reading()
        await asyncio.sleep(5)

    async def main() -> None:
        async with Server(read_head_then_stall) as server:
            upstream = Upstream()
            observer = Observer()
            exchange = asyncio.ensure_future(upstream.exchange(request(server.port, body=body), observer))
            await asyncio.sleep(0.5)
            assert [c for c, _ in observer.calls] == ["dispatch"], observer.calls
            # Shutting down does not wait for the upstream to read the rest: nothing more is
            # sent, and the exchange ends at once, its request incomplete.
            started = time.monotonic()
            await upstream.close()
            with pytest.raises(ExchangeFailed) as cut:
                await asyncio.wait_for(exchange, 2)
            assert not cut.value.request_complete and time.monotonic() - started < 1

            # A closed client sends nothing new (the broker is stopping); a fresh one, to an
            # upstream that reads, reports the request complete.
            with pytest.raises(SetupFailed, match="stopping"):
                await upstream.exchange(request(server.port, body=b"x"), Observer())
            fresh = Upstream()
            try:
                async with Server(answer_each) as reading_server:
                    observer = Observer()
                    response = await fresh.exchange(request(reading_server.port, body=body), observer)
                    assert response.status == 200 and len(reading_server.received) > len(body)
                    assert [c for c, _ in observer.calls][:2] == ["dispatch", "request_sent"]
            finally:
                await fresh.close()

    run(main())


@pytest.mark.parametrize(
    ("coding", "wire", "framing"),
    [
        (b"gzip, chunked", b"5\r\nhello\r\n0\r\n\r\n", "chunked"),
        (b"chunked, gzip", b"hello", "close"),  # chunked not last: the close ends the body
    ],
)
def test_the_framing_recorded_is_the_one_the_body_was_read_by(coding: bytes, wire: bytes, framing: str):
    response, _, _ = run(_one(_replying(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n" + wire)))
    assert not isinstance(response, Exception), response
    assert (response.body, response.framing) == (b"hello", framing)


def test_trailer_fields_are_not_merged_into_the_header_section():
    """RFC 9110 6.5.1: trailers are not headers, and framing fields there mean nothing. A chunked
    response whose trailer says ``Transfer-Encoding: gzip`` was read by its chunks: it is chunked
    (not close-delimited, which is weaker evidence), and its body is not gzip."""
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n5\r\nhello\r\n"
            b"0\r\nX-Checksum: abc\r\nTransfer-Encoding: gzip\r\nContent-Encoding: gzip\r\n\r\n")
    response, _, _ = run(_one(_replying(wire)))
    assert not isinstance(response, Exception), response
    assert (response.body, response.framing) == (b"hello", "chunked")
    assert [k for k, _ in response.headers] == ["Transfer-Encoding", "Trailer"], response.headers


def test_an_early_answer_to_a_request_not_taken_whole_is_recorded_so_and_its_connection_not_reused():
    """An upstream that answers (413, keep-alive) after the head and stops reading: the answer is
    the result, but the request was not complete, and the connection, with the rest of the body
    still queued on it, must not carry the next request."""
    body = b"x" * (48 * 1024 * 1024)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        if server.connections == 1:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\nno")
            writer.transport.pause_reading()
            await asyncio.sleep(5)
        else:
            await answer_each(reader, writer, server)

    async def main() -> None:
        async with Server(handler) as server:
            upstream = Upstream()
            try:
                early = await upstream.exchange(request(server.port, body=body), Observer())
                assert (early.status, early.request_complete) == (413, False)
                observer = Observer()
                second = await asyncio.wait_for(upstream.exchange(request(server.port), observer), 3)
            finally:
                await upstream.close()
            assert second.status == 200 and second.request_complete and observer.calls[0] == ("dispatch", "new")

    run(main())


def test_a_complete_tls_response_stands_when_a_bad_record_follows_it_in_the_same_segment(pki: TestPKI):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = pki.server_context("good").wrap_bio(incoming, outgoing, server_side=True)
        plain, handshaken = b"", False
        while not (b"\r\n\r\n" in plain and plain.endswith(b"{}")):  # the handshake, then the request
            try:
                if not handshaken:
                    tls.do_handshake()
                    handshaken = True
                plain += tls.read(65536)
            except ssl.SSLWantReadError:
                writer.write(outgoing.read())
                data = await reader.read(65536)
                if not data:
                    return
                incoming.write(data)
        tls.write(OK)
        writer.write(outgoing.read() + b"\x17\x03\x03\x00\x20" + b"\x00" * 32)  # then a record that fails to decrypt
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with Server(handler) as server:
            upstream = Upstream(ca_bundle=pki.ca_cert)
            try:
                response = await upstream.exchange(request(server.port, scheme="https"), Observer())
            finally:
                await upstream.close()
            assert (response.status, response.body) == (200, b"ok")

    run(main())


def test_end_to_end_drops_the_fixed_hop_by_hop_fields_and_those_connection_names():
    fields = [("Connection", "keep-alive, X-Hop ,  upgrade"), ("connection", "HTTP2-Settings"), ("Upgrade", "h2c"),
              ("x-hop", "1"), ("HTTP2-Settings", "AAMA"), ("Keep-Alive", "timeout=5"), ("X-Kept", "a"), ("X-Kept", "b"),
              ("X-Hopper", "not named")]
    assert end_to_end(fields) == [("X-Kept", "a"), ("X-Kept", "b"), ("X-Hopper", "not named")]
    assert end_to_end([("Accept", "*/*")]) == [("Accept", "*/*")]


def test_a_content_length_trailer_field_does_not_make_a_complete_chunked_answer_incomplete():
    """RFC 9110 6.5.1: a trailer field frames nothing. A chunked answer that ended (last chunk and
    blank line seen) whose trailer section holds a Content-Length is complete, not cut short; and a
    Content-Length beside chunked in the head of the next answer on the connection is still refused."""
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nContent-Length: 99\r\n\r\n"
    response, _, _ = run(_one(_replying(wire)))
    assert not isinstance(response, Exception), response
    assert (response.status, response.body, response.framing) == (200, b"hello", "chunked")
    assert [k for k, _ in response.headers] == ["Transfer-Encoding"]
    ambiguous = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    served: list[int] = []

    async def two_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while True:
            await server.read_request(reader)
            served.append(1)
            writer.write(wire if len(served) == 1 else ambiguous)
            await writer.drain()

    async def main() -> None:
        async with Server(two_answers) as server:
            upstream = Upstream()
            try:
                first = await upstream.exchange(request(server.port), Observer())
                with pytest.raises(ExchangeFailed) as second:
                    await upstream.exchange(request(server.port), Observer())
            finally:
                await upstream.close()
            assert first.body == b"hello" and server.connections == 1, "the connection was reused"
            assert second.value.code is Code.REMOTE_OUTCOME_UNKNOWN and "Content-Length" in second.value.diagnostic

    run(main())
