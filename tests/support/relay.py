"""A controllable TCP relay for network-failure tests.

Put a :class:`TcpRelay` between the proxy and its database (or any TCP peer)
and the test can break the network without touching the server: ``cut()`` is a
pulled cable with resets, ``blackhole()`` is a hung network that answers
nothing, ``restore()`` heals it. The relay runs its own asyncio loop in a
background thread, so it works the same from synchronous tests and from tests
whose own loop is busy (or blocked) talking through it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Literal

__all__ = ["TcpRelay"]

Mode = Literal["forward", "cut", "blackhole", "deaf"]

_CHUNK = 64 * 1024


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close a socket abruptly: SO_LINGER 0 makes the kernel send RST, not FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Relayed:
    """One accepted client connection and, once forwarding, its upstream twin."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.upstream)
        if self.task is not None:
            self.task.cancel()


class TcpRelay:
    """Relay from an ephemeral port on 127.0.0.1 to ``(target_host, target_port)``.

    Modes (switching is synchronous: when the call returns, the relay behaves
    the new way):

    * ``forward``: normal relaying (the state after ``start()`` and ``restore()``).
    * ``cut()``: every live connection is reset (RST) on both sides, and new
      ones are accepted and reset at once, so clients fail fast.
    * ``deafen()``: what clients send still reaches the server, its answers are
      held (until ``restore()``): a commit that lands and is never acknowledged.
    * ``deafen_after(marker)``: forward until a client sends ``marker`` (within one read), then
      deaf from that message on: it reaches the server, its answer is held. One chosen write lands
      unacknowledged while the reads before it were answered.
    * ``hold_after(marker, seconds)``: forward, but hold the client's message that holds
      ``marker`` (once) for ``seconds`` before passing it on: a write held up in the network,
      which reaches the server after its sender gave up on it (and what the connection sends
      after it waits behind it).
    * ``blackhole()``: nothing moves in either direction; live connections stall
      with their data held, new connections are accepted but never answered.
      ``restore()`` lets held data and held connections continue, like a
      network that heals (TCP would retransmit); clients that gave up meanwhile
      simply find their sockets closed by themselves.

    ``connections`` counts accepted client connections still open (held ones
    included); ``bytes_forwarded`` counts payload bytes relayed in both directions.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        connect_timeout: float = 5.0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.connect_timeout = connect_timeout
        self.bytes_forwarded = 0
        self._mode: Mode = "forward"
        self._conns: set[_Relayed] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._answering: asyncio.Event | None = None
        self._listen_port: int | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._deaf_after: bytes | None = None
        self._hold: tuple[bytes, float] | None = None

    # -- public surface ---------------------------------------------------------------

    @property
    def listen_port(self) -> int:
        if self._listen_port is None:
            raise RuntimeError("relay not started")
        return self._listen_port

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def connections(self) -> int:
        return len(self._conns)

    def start(self, timeout: float = 5.0) -> TcpRelay:
        """Bind the listening socket and start relaying; returns once bound."""
        if self._thread is not None:
            raise RuntimeError("relay already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"TcpRelay->{self.target_port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"relay did not start within {timeout} s")
        if self._startup_error is not None:
            self._thread.join(timeout)
            self._thread = None
            raise RuntimeError(f"relay failed to start: {self._startup_error!r}") from self._startup_error
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Reset every connection, close the listener, end the thread (joined within ``timeout``)."""
        if self._thread is None or self._loop is None:
            return
        try:
            self._call(self._shutdown(), timeout)
        except (RuntimeError, TimeoutError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"relay thread did not stop within {timeout} s")
        self._thread = None

    def cut(self) -> None:
        """Reset all live connections and reset new ones on arrival."""
        self._call(self._set_mode("cut"))

    def blackhole(self) -> None:
        """Stop moving bytes: live connections stall, new ones are accepted and held."""
        self._call(self._set_mode("blackhole"))

    def deafen(self) -> None:
        """Requests still reach the server, its answers are held: a commit lands unacknowledged."""
        self._call(self._set_mode("deaf"))

    def deafen_after(self, marker: bytes) -> None:
        """Forward until a client sends ``marker``; then deaf, from that message on."""
        self._call(self._arm(marker))

    def hold_after(self, marker: bytes, seconds: float) -> None:
        """Hold the next client message holding ``marker`` for ``seconds``, then pass it on."""
        self._call(self._arm_hold(marker, seconds))

    def restore(self) -> None:
        """Forward normally again (held connections resume)."""
        self._call(self._set_mode("forward"))

    # -- loop-thread side -------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, None], timeout: float = 5.0) -> None:
        """Run ``coro`` on the relay's loop and wait (bounded) for it to finish."""
        if self._loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("relay not started")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._open())
        except BaseException as exc:  # reported to start()
            self._startup_error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=2))
            loop.close()

    async def _open(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._answering = asyncio.Event()
        self._answering.set()
        self._server = await asyncio.start_server(self._handle, self.listen_host, 0)
        self._listen_port = int(self._server.sockets[0].getsockname()[1])

    async def _arm_hold(self, marker: bytes, seconds: float) -> None:
        await self._set_mode("forward")
        self._hold = (marker, seconds)

    async def _arm(self, marker: bytes) -> None:
        await self._set_mode("forward")
        self._deaf_after = marker

    async def _set_mode(self, mode: Mode) -> None:
        assert self._flowing is not None and self._answering is not None
        self._mode = mode
        self._deaf_after = self._hold = None
        if mode in ("forward", "deaf"):
            self._flowing.set()
            if mode == "forward":
                self._answering.set()
            else:
                self._answering.clear()
            return
        self._flowing.clear()
        if mode == "cut":
            for conn in list(self._conns):
                conn.reset()
            self._conns.clear()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()
        self._conns.clear()
        if self._flowing is not None:
            self._flowing.set()  # wake anything held so cancellation is prompt

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "cut":
            _reset(writer)
            return
        conn = _Relayed(writer)
        conn.task = asyncio.current_task()
        self._conns.add(conn)
        assert self._flowing is not None
        try:
            await self._flowing.wait()  # blackhole: hold the client, reach nobody
            if self._mode == "cut" or conn not in self._conns:
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout
                )
            except (OSError, asyncio.TimeoutError):
                _reset(writer)
                return
            conn.upstream = up_writer
            if conn not in self._conns:  # cut while connecting
                conn.reset()
                return
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer, answers=True))
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None and not w.transport.is_closing():
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, answers: bool = False) -> None:
        """Copy one direction; held while blackholed (``answers``, the server's direction: also
        while deaf); on EOF pass a half-close along."""
        assert self._flowing is not None and self._answering is not None
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    if dst.can_write_eof() and not dst.transport.is_closing():
                        dst.write_eof()
                    return
                await self._flowing.wait()
                if answers:
                    await self._answering.wait()
                if self._mode == "cut":
                    return
                if not answers and self._deaf_after is not None and self._deaf_after in data:
                    await self._set_mode("deaf")  # before it reaches the server: its answer is held
                if not answers and self._hold is not None and self._hold[0] in data:
                    seconds, self._hold = self._hold[1], None
                    await asyncio.sleep(seconds)
                    if dst.transport.is_closing():
                        return  # the server's end went meanwhile: the message never arrives
                dst.write(data)
                await dst.drain()
                self.bytes_forwarded += len(data)
        except (ConnectionError, OSError):
            # One side died: take the other down with it, as a real network path would.
            dst.transport.abort()

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> TcpRelay:
        return self.start() if self._thread is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        port = self._listen_port if self._listen_port is not None else "?"
        return f"TcpRelay(127.0.0.1:{port} -> {self.target_host}:{self.target_port}, mode={self._mode})"
