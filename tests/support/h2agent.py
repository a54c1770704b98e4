"""An HTTP/2 agent that writes its own frames, for what httpx and curl do not expose: resetting one
request's stream (RST_STREAM) while the connection, and its other streams, carry on.

It speaks through the broker as any agent does: CONNECT with its credentials, TLS trusting the
broker's CA, ALPN ``h2``. The frames come from the ``h2`` library, which mitmproxy depends on.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events

from .broker import BrokerProcess


class H2Agent:
    def __init__(self, broker: BrokerProcess, host: str, port: int = 443, agent: str = "builder", *, strict: bool = True) -> None:
        """``strict=False``: header fields go out exactly as given, even those HTTP/2 forbids
        (upper case, whitespace around a value, connection-specific fields)."""
        self.authority = f"{host}:{port}"
        self.sock = broker.tunnel(host, port, alpn="h2", agent=agent)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8", validate_outbound_headers=strict,
                                           normalize_outbound_headers=strict)
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self._flush()
        #: per stream: {"headers": [...], "body": bytes, "ended": "StreamEnded" | "StreamReset" | None,
        #: and "reset": the error code of a RST_STREAM the broker sent, once one came}
        self.streams: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> "H2Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None,
                *, content_length: int | None = None, end_stream: bool = True, flush: bool = True) -> int:
        """Send a request on a new stream; returns the stream's id. ``content_length``: the length
        it declares, if not its body's; ``end_stream=False``: its body goes on (:meth:`send`);
        ``flush=False``: its frames go out with the next ones sent, in one write."""
        stream_id = self.conn.get_next_available_stream_id()
        declared = len(body) if content_length is None else content_length
        fields = [(":method", method), (":scheme", "https"), (":authority", self.authority), (":path", path),
                  *(headers or []), *([("content-length", str(declared))] if body or declared else [])]
        self.conn.send_headers(stream_id, fields, end_stream=not body and end_stream)
        if body:
            self.conn.send_data(stream_id, body, end_stream=end_stream)
        if flush:
            self._flush()
        self.streams[stream_id] = {"headers": None, "body": b"", "ended": None}
        return stream_id

    def send(self, stream_id: int, data: bytes, end_stream: bool = True, flush: bool = True) -> None:
        """More of a request's body (a DATA frame), or only its end."""
        self.conn.send_data(stream_id, data, end_stream=end_stream)
        if flush:
            self._flush()

    def reset(self, stream_id: int) -> None:
        """RST_STREAM(CANCEL): the HTTP/2 way to abandon one request; the connection stays."""
        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self._flush()

    def response(self, stream_id: int, timeout: float = 15) -> tuple[int, dict[str, str], bytes]:
        """Read until ``stream_id`` has a complete response: (status, headers, body)."""
        self.read_until(lambda: self.streams[stream_id]["ended"] is not None, timeout, f"complete response on stream {stream_id}")
        state = self.streams[stream_id]
        assert state["ended"] == "StreamEnded", state
        headers = dict(state["headers"])
        return int(headers.pop(":status")), headers, state["body"]

    def read_until(self, done: Callable[[], bool], timeout: float = 15, what: str = "such frames") -> None:
        """Read and take in the broker's frames until ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, f"no {what} in {timeout}s"
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            assert data, "the broker closed the connection"
            take_in(self.conn, self.streams, data)
            self._flush()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def take_in(conn: h2.connection.H2Connection, streams: dict[int, dict[str, Any]], data: bytes) -> int | None:
    """Feed what the broker sent to ``conn``, noting each stream's response in ``streams`` (its
    ``headers``, ``body``, how it ``ended`` and a RST_STREAM's ``reset`` code); the error code of a
    GOAWAY that ended the connection, if one came."""
    goaway = None
    for event in conn.receive_data(data):
        state = streams.get(getattr(event, "stream_id", None) or 0)
        if isinstance(event, h2.events.ResponseReceived) and state is not None:
            state["headers"] = event.headers
        elif isinstance(event, h2.events.DataReceived):
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if state is not None:
                state["body"] += event.data
        elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)) and state is not None:
            state["ended"] = state["ended"] or type(event).__name__  # a reset after a whole answer: ended
            if isinstance(event, h2.events.StreamReset):
                state["reset"] = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            goaway = event.error_code
    return goaway
