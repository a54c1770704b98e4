"""Deadlines for an agent's request that arrives slowly (a slowloris defence); part of the
mitmproxy adapter, beside proxy/addon.py, whose wrappers of mitmproxy's HTTP/1 and HTTP/2 readers
call in here.

mitmproxy closes an agent connection only after 600 s without a single byte, and bounds nothing
else: a client that sends one byte every few minutes would keep a connection, and the request it
holds in memory, for ever. So each request gets two clocks, one at a time:

- the head clock (``[proxy] request_head_timeout``) runs from the first byte of a request line
  until the blank line that ends the headers. A keep-alive connection waiting between requests
  runs no clock (that wait stays mitmproxy's idle close);
- the body clock (``[proxy] request_body_timeout``) runs from the end of the head until the end
  of the body.

When one runs out, the agent gets ``408 REQUEST_TIMEOUT`` (validation, not_attempted, retry
``backoff``: nothing was recorded, nothing was sent, and sending the request again is safe), and:

- over HTTP/1 (plain, or inside a CONNECT tunnel) the answer says ``Connection: close`` and the
  connection is closed;
- over HTTP/2 only that stream is answered and reset (``NO_ERROR``: the agent need not send the
  rest), and the connection's other streams go on. HTTP/2 has a body clock only: a stream exists
  for mitmproxy (and for h2) once its whole header block has arrived, so its head cannot be timed
  per request, and the only answer to a connection whose header block (or any frame outside a
  body) trickles would be to end the connection, with every other request on it.

What no clock bounds, since no request exists yet: a TLS handshake inside a CONNECT tunnel, and
HTTP/2 frames outside a stream's body. These, like an idle connection, end with mitmproxy's idle
close (600 s without a byte). A request answered before its body ended (a 407 for its head) gets
no second answer when its body stalls: its connection is closed (HTTP/1) or its stream reset.

Cost: an HTTP/1 clock is started only when a read leaves a head or a body incomplete, so a
request that arrives in one read (the usual case) starts none; an HTTP/2 stream with a body starts
one and stops it at its end. Each clock is one ``loop.call_later`` timer, cancelled when the head
or body completes; nothing polls.

The seam. mitmproxy's layers run only when an event reaches them, and an expiry is no event of
mitmproxy's own. So the timer delivers mitmproxy's ``Wakeup`` event (the reply a layer gets to a
``RequestWakeup`` command it yielded) to the connection's layer stack, exactly as mitmproxy
delivers the wakeups HTTP/2 asks for: through ``ConnectionHandler.server_event``, and routed at
each ``HttpLayer`` by its ``command_sources`` map (command -> the child layer that yielded it),
which is filled here, on expiry, along the reading layer's ``context.layers`` (each layer follows
its parent there, as mitmproxy's ``HttpStream.mode`` itself assumes). The reading layer then
answers with commands of its own, which pass up the stack like any it yields: inside a CONNECT
tunnel the TLS layer encrypts the 408 and closes with ``close_notify``. No ``RequestWakeup`` is
ever yielded (mitmproxy would start a task for each, uncancellable, alive until its delay passed).
Pinned by tests/test_request_deadlines.py, which drives a real broker on HTTP/1 (plain and
through CONNECT with TLS interception) and HTTP/2, on mitmproxy 11 and 12.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Generator

import h2.errors
import h2.events
import h2.exceptions
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http.http1 import assemble_response
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http import HttpLayer, RequestProtocolError
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import StreamState

from . import metrics
from .addon import _refusal, connection_handler
from .contract import Code, Retry
from .logs import LogThrottle

try:  # mitmproxy 12: a protocol error's code is an ErrorCode
    from mitmproxy.proxy.layers.http import ErrorCode

    _CLIENT_ERROR: Any = ErrorCode.GENERIC_CLIENT_ERROR
except ImportError:  # mitmproxy 11: the HTTP status itself
    _CLIENT_ERROR = 408

log = logging.getLogger("affidavit.deadlines")

HEAD = "head"
BODY = "body"

_SLOT = "_affidavit_clock"  # on an Http1Server: the clock of its current request, or None
_STREAM_CLOCKS = "_affidavit_clocks"  # on an Http2Server: stream id -> the clock of that stream's body
_DELIVERIES: set[asyncio.Task[None]] = set()  # expiries on their way into mitmproxy (held: tasks are weak)
_UNDELIVERABLE = False  # an expiry found a layer stack it cannot route through (logged once)


class Clock:
    """One running deadline: of a request's head or body, on one connection (or HTTP/2 stream)."""

    __slots__ = ("part", "seconds", "stream_id", "handle")

    def __init__(self, part: str, seconds: float, stream_id: int):
        self.part = part
        self.seconds = seconds
        self.stream_id = stream_id
        self.handle: asyncio.TimerHandle | None = None

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Expired(commands.RequestWakeup):
    """The command a ``Wakeup`` event answers: here, that ``clock`` ran out. Never yielded to
    mitmproxy (which would start a task for it): only its answer is delivered."""

    def __init__(self, clock: Clock):
        super().__init__(clock.seconds)
        self.clock = clock


def expired(event: Any) -> Clock | None:
    """The clock a ``Wakeup`` event says ran out, if it is one of these clocks'."""
    command = getattr(event, "command", None)
    return command.clock if isinstance(command, Expired) else None


def _seconds(value: float) -> str:
    return f"{value:g} s"


class RequestClocks:
    """The two deadlines of every request an agent sends, and what an expiry does."""

    def __init__(self, head: float, body: float, log_window: float = 60.0):
        self.head = head
        self.body = body
        self.throttle = LogThrottle(window=log_window)

    # -- starting and stopping ------------------------------------------------------------------

    def _start(self, layer: Any, part: str, stream_id: int) -> Clock:
        clock = Clock(part, self.head if part == HEAD else self.body, stream_id)
        # A weak reference: a timer left running on a connection that ended keeps nothing of it.
        clock.handle = asyncio.get_running_loop().call_later(clock.seconds, self._ran_out, weakref.ref(layer), clock)
        return clock

    def http1_read(self, server: Any, event: Any) -> None:
        """After mitmproxy's ``Http1Server`` read from the agent: start the clock of the part of
        the request it now waits for (a head with bytes of it in hand, or a body), keep the one
        that runs for that part, or stop it once the part is complete (or the connection closed)."""
        clock = server.__dict__.get(_SLOT)
        state = getattr(server.state, "__func__", None)
        if isinstance(event, events.ConnectionClosed):
            part = None
        elif state is Http1Server.read_headers:
            part = HEAD if len(server.buf) else None  # no byte of a head yet: an idle connection
        elif state is Http1Server.read_body:
            part = BODY
        else:
            part = None  # the request is complete (or refused)
        if clock is not None:
            if clock.part == part:
                return
            clock.stop()
            server.__dict__[_SLOT] = None
        if part is not None:
            server.__dict__[_SLOT] = self._start(server, part, server.stream_id)

    def http2_event(self, server: Any, event: Any) -> None:
        """After mitmproxy's ``Http2Server`` handled an h2 event: a stream whose headers did not
        end it starts its body clock; its end, or its reset, stops it."""
        if isinstance(event, h2.events.RequestReceived):
            if not event.stream_ended and server.streams.get(event.stream_id) is StreamState.HEADERS_RECEIVED:
                server.__dict__.setdefault(_STREAM_CLOCKS, {})[event.stream_id] = self._start(server, BODY, event.stream_id)
        elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
            clocks = server.__dict__.get(_STREAM_CLOCKS)
            if clocks and (clock := clocks.pop(event.stream_id, None)) is not None:
                clock.stop()

    # -- running out ----------------------------------------------------------------------------

    @staticmethod
    def _running(layer: Any, clock: Clock) -> bool:
        """Whether ``clock`` is still the one running for its request on ``layer``."""
        return layer.__dict__.get(_SLOT) is clock or (layer.__dict__.get(_STREAM_CLOCKS) or {}).get(clock.stream_id) is clock

    def _ran_out(self, ref: weakref.ref[Any], clock: Clock) -> None:
        """The timer: hand the expiry to the layer's connection, as mitmproxy hands a wakeup."""
        clock.handle = None
        layer = ref()
        if layer is None or not self._running(layer, clock):
            return
        task = asyncio.ensure_future(self._deliver(ref, clock))
        _DELIVERIES.add(task)
        task.add_done_callback(_DELIVERIES.discard)

    async def _deliver(self, ref: weakref.ref[Any], clock: Clock) -> None:
        # Checked and delivered in one step (server_event runs to its end without suspending):
        # nothing the agent sends in between can find the layer expecting a wakeup it no longer
        # expects, and no routing entry is left behind.
        layer = ref()
        if layer is None or not self._running(layer, clock):
            return
        handler = connection_handler(layer.conn)
        if handler is None:
            return  # the connection is gone
        stack = layer.context.layers
        if not stack or stack[-1] is not layer:
            global _UNDELIVERABLE
            if not _UNDELIVERABLE:  # once: it would be the same for every slow request
                _UNDELIVERABLE = True
                log.error("cannot time out a slow request: mitmproxy's layer stack is not what this broker knows "
                          "(another mitmproxy version?); such connections stay open until mitmproxy's idle close")
            return
        wake = Expired(clock)
        for parent, child in zip(stack, stack[1:]):
            if isinstance(parent, HttpLayer):
                parent.command_sources[wake] = child
        await handler.server_event(events.Wakeup(wake))

    def http1_expired(self, server: Any, event: Any) -> Generator[Any, Any, None]:
        """The head or the body of ``server``'s current request did not arrive in time: answer
        408 (unless an answer went out already: a refusal of the head), close the connection, and
        end the request's stream in mitmproxy if it had one (a body's)."""
        clock = expired(event)
        if clock is None or server.__dict__.get(_SLOT) is not clock:
            return  # stopped meanwhile: the head or body completed
        server.__dict__[_SLOT] = None
        state = getattr(server.state, "__func__", None)
        if state is not (Http1Server.read_headers if clock.part == HEAD else Http1Server.read_body):
            return
        detail = self._http1_progress(server, clock)
        response = self._refusal(clock, detail)
        over = server.request.http_version if server.request is not None else "HTTP/1"
        self._count_and_log(clock, server.conn, over + (" in a CONNECT tunnel" if server.conn.tls_established else ""), detail)
        # A final answer may have gone out already (a refusal of the head); a 100 Continue is no answer.
        answered = server.response is not None and server.response.status_code >= 200
        if not answered and server.conn.state & ConnectionState.CAN_WRITE:
            response.headers["Connection"] = "close"
            yield commands.SendData(server.conn, assemble_response(response))
        yield commands.CloseConnection(server.conn)
        if clock.part == BODY:
            yield ReceiveHttp(RequestProtocolError(server.stream_id, self._error(clock), _CLIENT_ERROR))
        server.state = server.done

    def http2_expired(self, server: Any, event: Any) -> Generator[Any, Any, None]:
        """A stream's body did not arrive in time: answer it 408 and reset it (the agent need not
        send the rest); end it in mitmproxy. The connection's other streams go on."""
        clock = expired(event)
        clocks = server.__dict__.get(_STREAM_CLOCKS) or {}
        if clock is None or clocks.get(clock.stream_id) is not clock:
            return
        del clocks[clock.stream_id]
        stream_id = clock.stream_id
        stream = server.h2_conn.streams.get(stream_id)
        if server.streams.get(stream_id) is not StreamState.HEADERS_RECEIVED or stream is None or stream.closed:
            return
        declared = getattr(stream, "_expected_content_length", None)
        received = getattr(stream, "_actual_content_length", None)
        detail = _body_progress(received, declared if isinstance(declared, int) else None, chunked=False)
        response = self._refusal(clock, detail)
        self._count_and_log(clock, server.conn, f"HTTP/2 stream {stream_id}", detail)
        answered = stream.state_machine.headers_sent  # a refusal of its head went out already
        if not answered and server.is_open_for_us(stream_id):
            fields = [(b":status", b"408"), *((k.lower(), v) for k, v in response.headers.fields)]
            try:
                server.h2_conn.send_headers(stream_id, fields)
                server.h2_conn.send_data(stream_id, response.content or b"", end_stream=True)
                answered = True
            except h2.exceptions.H2Error:  # the agent's window does not admit the answer
                pass
        if not stream.closed:
            # After a complete answer, NO_ERROR asks the agent to stop sending (RFC 9113 8.1).
            server.h2_conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR if answered else h2.errors.ErrorCodes.CANCEL)
        yield commands.SendData(server.conn, server.h2_conn.data_to_send())
        yield ReceiveHttp(RequestProtocolError(stream_id, self._error(clock), _CLIENT_ERROR))
        server.streams.pop(stream_id, None)

    # -- what the agent and the operator are told ---------------------------------------------

    def _http1_progress(self, server: Any, clock: Clock) -> str:
        if clock.part == HEAD:
            return f"{len(server.buf)} bytes of it had arrived"
        reader = getattr(server.body_reader, "reader", server.body_reader)  # addon.py's AgentBodyReader wraps h11's
        length, remaining = getattr(reader, "_length", None), getattr(reader, "_remaining", None)
        if isinstance(length, int) and isinstance(remaining, int):
            return _body_progress(length - remaining, length, chunked=False)
        return _body_progress(None, None, chunked=True)

    def _error(self, clock: Clock) -> str:
        """``flow.error`` of a request whose body did not arrive in time (the ``error`` hook's words)."""
        return f"the request {clock.part} did not arrive within {_seconds(clock.seconds)} (request_{clock.part}_timeout)"

    def _refusal(self, clock: Clock, detail: str) -> http.Response:
        if clock.part == HEAD:
            what = (f"The request line and headers did not arrive within {_seconds(clock.seconds)} of their first byte "
                    f"({detail}; [proxy] request_head_timeout)")
        else:
            what = (f"The request body did not arrive within {_seconds(clock.seconds)} of the end of the headers "
                    f"({detail}; [proxy] request_body_timeout)")
        hint = (" If it keeps happening, the client or its network stalls while sending; check that a client sends as "
                "many body bytes as its Content-Length declares." if clock.part == BODY else
                " If it keeps happening, the client or its network stalls while sending its headers.")
        return _refusal(
            408, Code.REQUEST_TIMEOUT,
            f"{what}, so the broker stopped waiting for it. Nothing was sent upstream and nothing was recorded: "
            f"sending the request again is safe.{hint}",
            retry=Retry.BACKOFF,
            evidence={"dispatch_started": False, "request_complete": False, "timeout": f"request_{clock.part}"},
        )

    def _count_and_log(self, clock: Clock, conn: Any, over: str, detail: str) -> None:
        """Count every expiry; log it, at most one line per client address per window."""
        metrics.REQUEST_TIMEOUTS.labels(clock.part).inc()
        address = str(conn.peername[0]) if conn.peername else "?"
        skipped = self.throttle.admit(address)
        if skipped is None:
            return
        more = self.throttle.note(skipped, "from there")
        done = ("answered 408 REQUEST_TIMEOUT on its stream and reset it (the connection's other requests go on)"
                if over.startswith("HTTP/2") else "answered 408 REQUEST_TIMEOUT and closed the connection")
        log.warning(
            "request %s not received within %s from %s (%s; %s): %s; nothing was sent upstream or recorded%s. "
            "If %s is one of your agents, it stalls while sending or its link is slow (if its requests are sound, "
            "raise [proxy] request_%s_timeout); if not, it may be holding connections open on purpose, and this "
            "deadline cut it off",
            clock.part, _seconds(clock.seconds), address, over, detail, done, more, address, clock.part,
            extra={"code": Code.REQUEST_TIMEOUT.value, "part": clock.part, "client": address,
                   "waited_s": clock.seconds, "not_logged": skipped},
        )


def _body_progress(received: int | None, declared: int | None, *, chunked: bool) -> str:
    if chunked:
        return "a chunked body, not ended"
    if declared is not None and received is not None:
        return f"{received} of the {declared} bytes its content-length declares had arrived"
    if received is not None:
        return f"{received} bytes of it had arrived"
    return "the body had not ended"
