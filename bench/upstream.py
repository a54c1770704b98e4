"""The fallback upstream: a tiny asyncio HTTP/1.1 server answering 50 bytes of JSON, keep-alive.

Used when nginx is not installed (``--upstream asyncio``, or ``auto`` without nginx). It runs in
its own process so its CPU never lands in the proxies' accounting, and it is deliberately
minimal (``asyncio.Protocol``, one pre-built response, no header parsing beyond framing) so it
stays far faster than any proxy under test: the proxy, not the upstream, must be the
bottleneck. Serves plain HTTP and TLS (certificate and key given as files) on two ports.

Run: ``python bench/upstream.py --cert chain.pem --key key.pem`` (ports 0 = pick free ones).
Prints one JSON line ``{"http": PORT, "https": PORT}`` on stdout when listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl
import sys

#: Exactly 50 bytes of JSON; both upstreams (this one and nginx) serve the same body.
BODY = b'{"ok":true,"pad":"' + b"x" * 30 + b'"}'
assert len(BODY) == 50, len(BODY)

RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 50\r\nConnection: keep-alive\r\n\r\n" + BODY
)
RESPONSE_CLOSE = RESPONSE.replace(b"keep-alive", b"close")
_MAX_HEAD = 64 * 1024


class _Http(asyncio.Protocol):
    """One connection: answer every complete request (pipelined ones too) with RESPONSE."""

    __slots__ = ("transport", "buf", "skip")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.skip = 0  # request-body bytes still to discard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out: list[bytes] = []
        while True:
            if self.skip:
                n = min(self.skip, len(buf))
                del buf[:n]
                self.skip -= n
                if self.skip:
                    break
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self._fail()
                    return
                break
            head = bytes(buf[:end]).lower()
            del buf[: end + 4]
            if b"\r\ntransfer-encoding:" in head:
                # Not needed by the benchmark; refuse rather than mis-frame.
                out.append(b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self._flush(out, close=True)
                return
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.skip = int(head[i + 17 : j if j >= 0 else None])
            if b"\r\nconnection: close" in head:
                out.append(RESPONSE_CLOSE)
                self._flush(out, close=True)
                return
            out.append(RESPONSE)
        if out:
            self._flush(out, close=False)

    def _flush(self, out: list[bytes], *, close: bool) -> None:
        assert self.transport is not None
        self.transport.write(b"".join(out) if len(out) > 1 else out[0])
        if close:
            self.transport.close()

    def _fail(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        self.transport.close()


async def serve(host: str, http_port: int, tls_port: int, cert: str, key: str) -> None:
    loop = asyncio.get_running_loop()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    plain = await loop.create_server(_Http, host, http_port, backlog=1024, reuse_address=True)
    tls = await loop.create_server(_Http, host, tls_port, ssl=ctx, backlog=1024, reuse_address=True)
    ports = {"http": plain.sockets[0].getsockname()[1], "https": tls.sockets[0].getsockname()[1]}
    print(json.dumps(ports), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    plain.close()
    tls.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--tls-port", type=int, default=0)
    p.add_argument("--cert", required=True, help="PEM certificate chain")
    p.add_argument("--key", required=True, help="PEM private key")
    a = p.parse_args()
    try:
        asyncio.run(serve(a.host, a.http_port, a.tls_port, a.cert, a.key))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
