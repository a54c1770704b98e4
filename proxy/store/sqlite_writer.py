"""The SQLite journal's transactions, run in a child process of the broker.

Why a process and not a thread: Python's ``sqlite3`` lets go of the GIL around every step of
every statement, and a writer thread must take it back from the event loop, which holds it
until its next system call or the 5 ms switch interval. Measured at concurrency 32, a commit of
~30 flows' rows took 7 ms of wall time for 3 ms of work; the flows waited for hand-overs. The
child has an interpreter of its own, so a commit takes the time SQLite takes, on the second
core, and the broker's loop only writes one request and reads one answer per batch, as it does
for PostgreSQL.

The child takes the very document ``affidavit_write`` takes on PostgreSQL (``checks``,
``inserts``, ``events``, ``updates``, ``results``, ``checkpoints``; see
:meth:`proxy.store.journal.Journal._payload`) and applies it the same way: the checks row by
row first, and if one is refused nothing is written and the refusals are answered; otherwise
every row, in one ``BEGIN IMMEDIATE`` ... ``COMMIT``.

Frames on the child's stdin and stdout: a 4-byte big-endian length, then JSON. The child's first
frame says it is ready; then each answer is ``{"refused": [...]}`` (empty: durable) or
``{"error": "integrity" | "database", "message": ...}`` (rolled back). The child's life is bound
to the broker's: it ends at end of input, and on Linux the kernel kills it the moment the broker
dies (``PR_SET_PDEATHSIG``), so a batch it still holds cannot commit after the broker is gone. It
runs in a process group of its own and ignores SIGINT and SIGTERM, so a stop signal meant for the
broker cannot end it before the broker has written its last batch. Its SQLite busy timeout is half
the journal's timeout, so lock contention comes back as a clean error before the broker gives up
on the child.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sqlite3
import struct
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from datetime import datetime
from typing import Any, BinaryIO

import orjson
from sqlalchemy import DateTime, LargeBinary, Table

from ..failpoints import failpoint_now
from .schema import events, invocations, results
from .statements import Fence, SqliteStatements, store_rows
from .vault_schema import chain_checkpoints

log = logging.getLogger("affidavit.journal")

_FRAME = struct.Struct(">I")
#: How long a new child may take to import and say it is ready (a loaded machine: ~1.5 s).
_START_TIMEOUT = 30.0
#: After a start that failed, the next one waits this long, doubling per failure up to the second
#: figure; batches meanwhile fail at once instead of each paying for a start that fails. Failures
#: of both kinds (a start, a run of deaths on batches) count together until a batch is answered.
_RETRY_AFTER = (1.0, 30.0)
#: A child that dies on this many batches in a row (none answered in between) is treated like one
#: that cannot start: the journal reports it cannot write and waits before the next child, so a
#: crash on every batch costs one start per wait, not one per batch. One death is replaced at once.
_DEATHS_IN_A_ROW = 3
_PR_SET_PDEATHSIG = 1
#: What the child inherits from the broker's environment: enough to start Python, no secrets.
_ENVIRONMENT = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ")


class WriterGone(Exception):
    """The writer process ended, or stopped answering, before it answered a batch."""


class SqliteWriter:
    """The broker's end: one child process, one batch at a time (the journal writer task's)."""

    def __init__(self, path: str, timeout: float):
        self.path = path
        self.timeout = timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._starting = asyncio.Lock()
        #: Why no writer process can run now (a start failed, or children keep dying on their
        #: batches; the next start is scheduled), else None.
        self.problem: str | None = None
        self._batch_deaths = 0  # batches in a row the child died on, without an answer between
        #: Back-offs since a batch was last answered: the next wait doubles with each, whichever
        #: kind of failure caused it (a child that starts but dies on its batches, then one that
        #: cannot start, is the same outage getting no better).
        self._backoffs = 0
        self._retry_at = 0.0
        self._retry: asyncio.Task[None] | None = None
        self._relays: set[asyncio.Task[None]] = set()
        self._closed = False
        #: (device, inode) of the journal file when the first writer process started.
        self._identity: tuple[int, int] | None = None
        #: Set, for good, once a writer found the journal's file (or its -wal or -shm) deleted or
        #: replaced: nothing more is written until the broker restarts with the file back.
        self.replaced: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        """Start the child now and wait until it says it is ready (it imports the schema, ~0.4 s;
        better at start-up than on the first request). Raises :class:`WriterGone` if it cannot.

        A failed start is tried again in the background after a wait that doubles per failure
        (1 s up to 30 s); until then, and while that try runs, this raises at once, saying why."""
        if self._closed:
            raise WriterGone("the journal is closing")
        if self.problem is not None and self._starting.locked():
            raise WriterGone(f"{self.problem}; a new writer process is starting")
        async with self._starting:
            if self._proc is not None and self._proc.returncode is None:
                return
            wait = self._retry_at - time.monotonic()
            if self.problem is not None and wait > 0:
                raise WriterGone(f"{self.problem}; the next try is in {wait:.1f} s")
            try:
                await self._spawn()
            except BaseException as exc:
                self._failed(exc)
                raise
            self.problem = None

    def _failed(self, exc: BaseException) -> None:
        if self._closed:  # a start cut short by close(): nothing to report or to try again
            return
        if isinstance(exc, WriterGone):
            problem = str(exc)
        elif isinstance(exc, asyncio.CancelledError):
            problem = "the SQLite writer process did not start within the journal's timeout"
        else:
            problem = f"the SQLite writer process could not start: {str(exc) or type(exc).__name__}"
        self._back_off(problem)

    def _died_on_batch(self, proc: asyncio.subprocess.Process) -> None:
        """The child took a batch and ended (or hung) without answering it."""
        if self._closed:
            return
        self._batch_deaths += 1
        if self._batch_deaths < _DEATHS_IN_A_ROW:
            return
        status = f", exit status {proc.returncode}" if proc.returncode is not None else ", killed: no answer in time"
        self._back_off(
            f"{self._batch_deaths} SQLite writer processes in a row ended while writing a batch "
            f"(the last: pid {proc.pid}{status}; what they printed is logged as 'SQLite writer process (pid N): ...')",
        )

    def _back_off(self, problem: str) -> None:
        """No writer process for now: say why, and try again after a wait that doubles per failure."""
        self._backoffs += 1
        delay = min(_RETRY_AFTER[0] * 2 ** (self._backoffs - 1), _RETRY_AFTER[1])
        self._retry_at = time.monotonic() + delay
        self.problem = problem
        log.error("journal: %s; trying again in %.0f s", problem, delay)
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._start_later(), name="sqlite writer restart")

    async def _start_later(self) -> None:
        while self.problem is not None:
            await asyncio.sleep(max(0.0, self._retry_at - time.monotonic()))
            try:
                await self.start()
            except Exception:  # logged by _failed, which set the next try
                continue
            if self.pid is not None:
                log.info("journal: the SQLite writer process started again (pid %s)", self.pid)

    async def _spawn(self) -> None:
        failpoint_now("sqlite_writer_start")
        if self._identity is None:  # the file the journal is: every child checks it is still there
            self._identity = file_identity(os.path.abspath(self.path))
        proc = self._proc = await asyncio.create_subprocess_exec(
            # -P: never import from the working directory (it may be writable by others).
            sys.executable, "-P", "-m", __name__,
            os.path.abspath(self.path), str(self.timeout / 2), str(os.getpid()),
            "%d:%d" % self._identity if self._identity else "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={name: os.environ[name] for name in _ENVIRONMENT if name in os.environ},
            # A session (and process group) of its own: signals to the broker's group do not reach it.
            # (start_new_session, not process_group, which uvloop does not take.)
            start_new_session=True,
        )
        relay = asyncio.get_running_loop().create_task(_relay_output(proc), name=f"sqlite writer {proc.pid} output")
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        async with self._killed_on_failure(proc, f"did not start (what it printed is logged as 'SQLite writer process (pid {proc.pid}): ...')"):
            async with asyncio.timeout(_START_TIMEOUT):
                await self._answer(proc)

    async def write(self, document: bytes) -> list[dict[str, Any]]:
        """Apply one batch document; returns the refused checks (empty: the rows are durable).

        Raises ``sqlite3.IntegrityError`` (a row collided; nothing written), ``sqlite3.Error``
        (the database refused; nothing written) or :class:`WriterGone` (no answer: the batch
        may or may not have committed). After anything but an answer, including a cancelled
        wait, the child is killed: its frames are out of step, and a late commit must not go on.
        A child found gone while the batch is being handed over never had all of it, so the
        batch goes to a new child, once.
        """
        if self.replaced is not None:
            raise sqlite3.OperationalError(self.replaced)
        frame = _FRAME.pack(len(document)) + document
        for handover in (1, 2):
            await self.start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            try:
                async with self._killed_on_failure(proc, "ended before it took the batch"):
                    proc.stdin.write(frame)
                    await proc.stdin.drain()
                    if proc.stdin.is_closing():  # the write failed (EPIPE); drain says so only next time
                        raise ConnectionResetError("the writer process's input is closed")
            except WriterGone:
                if handover == 2:
                    raise
                continue
            break
        try:
            async with self._killed_on_failure(proc, "ended without answering; a new one starts with the next batch"):
                answer = await self._answer(proc)
        except (WriterGone, asyncio.CancelledError):
            # Gone, or hung until the journal's timeout cancelled the wait (it was killed then).
            self._died_on_batch(proc)
            raise
        self._batch_deaths = self._backoffs = 0
        if answer.get("error") == "replaced":
            self.replaced = answer["message"]
            log.error("journal: %s", self.replaced)  # whole, once: the refusals after it are cut short
        if "error" in answer:
            error = sqlite3.IntegrityError if answer["error"] == "integrity" else sqlite3.OperationalError
            raise error(answer["message"])
        return list(answer["refused"])

    @asynccontextmanager
    async def _killed_on_failure(self, proc: asyncio.subprocess.Process, gone: str) -> AsyncIterator[None]:
        """Any failure, a cancelled wait included, kills the child (its frames are out of step);
        one that says the child is gone becomes :class:`WriterGone`, saying ``gone`` and, when
        the child has exited, its exit status."""
        try:
            yield
        except BaseException as exc:
            try:
                if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                    # Its pipes closed: it is exiting. Let asyncio reap it and learn how; a kill
                    # now would reap it behind asyncio's back and lose the status.
                    with suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(proc.wait(), 1.0)
            finally:
                self.kill(proc)
            if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError, TimeoutError)):
                status = f", exit status {proc.returncode}" if proc.returncode is not None else ""
                raise WriterGone(f"the SQLite writer process (pid {proc.pid}{status}) {gone}") from None
            raise

    @staticmethod
    async def _answer(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        (size,) = _FRAME.unpack(await proc.stdout.readexactly(_FRAME.size))
        answer: dict[str, Any] = orjson.loads(await proc.stdout.readexactly(size))
        return answer

    def kill(self, proc: asyncio.subprocess.Process | None = None) -> None:
        """Kill ``proc`` (default: the current child) and forget it if it is the current one."""
        proc = proc if proc is not None else self._proc
        if proc is self._proc:
            self._proc = None
        if proc is not None and proc.returncode is None:
            proc.kill()

    async def close(self) -> None:
        """End of input: the child finishes the batch it has (none, after the last flush) and exits."""
        self._closed = True
        if self._retry is not None:  # a child it is starting is killed, unannounced
            self._retry.cancel()
            with suppress(asyncio.CancelledError):
                await self._retry
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), self.timeout)
            except asyncio.TimeoutError:
                log.warning("the SQLite writer process (pid %s) did not exit; killing it", proc.pid)
                proc.kill()
                await proc.wait()
        if self._relays:  # the last words of the children, up to the end of their output
            _, silent = await asyncio.wait(self._relays, timeout=1.0)
            for relay in silent:
                relay.cancel()


async def _relay_output(proc: asyncio.subprocess.Process) -> None:
    """What the child prints (a crash's traceback, a warning) goes into the broker's log as log
    records, a line each, never as raw text between the broker's JSON lines."""
    assert proc.stderr is not None
    while True:
        try:
            line = await proc.stderr.readline()
        except ValueError:  # a line longer than the stream's limit; asyncio dropped it
            line = b"(a line too long to relay)"
        except Exception:  # the pipe broke; the child is gone either way
            return
        if not line:
            return
        text = line.decode(errors="replace").rstrip()
        if text:
            log.warning("SQLite writer process (pid %s): %s", proc.pid, text)


# -- the child ---------------------------------------------------------------------------------


def _columns_of(kind: type) -> dict[str, frozenset[str]]:
    tables: list[Table] = [invocations, events, results, chain_checkpoints]
    return {t.name: frozenset(c.name for c in t.columns if isinstance(c.type, kind)) for t in tables}


#: Columns whose JSON text is a time (ISO 8601) or bytes (PostgreSQL's ``\\x`` hex), per table.
_TIMES = _columns_of(DateTime)
_BYTES = _columns_of(LargeBinary)


def _revive(table: str, row: dict[str, Any]) -> dict[str, Any]:
    """A JSON row back into the values the journal handed over (datetimes, bytes)."""
    for name in _TIMES[table]:
        value = row.get(name)
        if isinstance(value, str):
            row[name] = datetime.fromisoformat(value)
    for name in _BYTES[table]:
        value = row.get(name)
        if isinstance(value, str):
            row[name] = bytes.fromhex(value[2:])
    return row


def _rows(document: dict[str, Any], part: str, table: Table) -> list[dict[str, Any]]:
    return [_revive(table.name, row) for row in document.get(part, ())]


class _Refused(Exception):
    def __init__(self, refused: list[dict[str, Any]]):
        self.refused = refused


def apply_document(statements: SqliteStatements, document: dict[str, Any]) -> list[dict[str, Any]]:
    """One batch in one transaction; returns the refused checks (and then writes nothing: the
    transaction is rolled back, the checks' own writes, claims, with it)."""
    try:
        with statements.transaction():
            if refused := _refused_checks(statements, document.get("checks", ())):
                raise _Refused(refused)
            updates = _rows(document, "updates", invocations)
            for row in updates:
                row["b_invocation_id"] = row.pop("invocation_id")
            store_rows(statements, _rows(document, "inserts", invocations), _rows(document, "events", events),
                       updates, _rows(document, "results", results))
            if checkpoints := _rows(document, "checkpoints", chain_checkpoints):
                statements.insert(chain_checkpoints, checkpoints)
    except _Refused as exc:
        return exc.refused
    return []


def _refused_checks(statements: SqliteStatements, checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fences and claims, row by row, as ``affidavit_write`` checks them."""
    refused = []
    for check in checks:
        fence = check.get("fence")
        if fence is not None:
            now = datetime.fromisoformat(fence["now"])
            if not statements.holds(Fence(fence["invocation_id"], fence["generation"], fence["owner"], now,
                                          fence["check_expiry"])):
                refused.append({"write": check["write"], "why": "fence"})
                continue
        claim = check.get("claim")
        if claim is not None and not statements.claim(_revive("invocations", claim)):
            refused.append({"write": check["write"], "why": "claim"})
    return refused


def serve(path: str, timeout: float, requests: BinaryIO, answers: BinaryIO, expected: tuple[int, int] | None = None) -> None:
    """Answer batch documents from ``requests`` until end of file. ``expected``: the (device,
    inode) the journal file had when the broker first started a writer (None: take the first)."""
    statements: SqliteStatements | None = None
    opened = expected
    sides: dict[str, tuple[int, int] | None] = {}  # the -wal and -shm files this writer's connection has open
    while True:
        head = requests.read(_FRAME.size)
        if len(head) < _FRAME.size:
            break
        (size,) = _FRAME.unpack(head)
        body = requests.read(size)
        if len(body) < size:
            break
        try:
            opened = _still_the_journal(path, opened)  # before connecting, which would make a new, empty one
            _still_its_side_files(path, sides)
            if statements is None:
                statements = SqliteStatements.connect(path, timeout)
            answer: dict[str, Any] = {"refused": apply_document(statements, orjson.loads(body))}
            if not sides:  # they exist now (WAL mode, a write made): the ones this connection uses
                sides.update({suffix: file_identity(path + suffix) for suffix in _SIDE_FILES})
        except sqlite3.IntegrityError as exc:
            answer = {"error": "integrity", "message": str(exc)}
        except JournalReplaced as exc:  # the connection stays open: it keeps the deleted file readable
            answer = {"error": "replaced", "message": str(exc)}
        except Exception as exc:  # the database refused: the next batch starts on a fresh connection
            answer = {"error": "database", "message": str(exc) or type(exc).__name__}
            if statements is not None:
                statements.close()
                statements = None
                # Closing the last connection lets SQLite checkpoint and delete the -wal and -shm
                # itself: the next connection's files are looked at anew.
                sides.clear()
        out = orjson.dumps(answer)
        answers.write(_FRAME.pack(len(out)) + out)
        answers.flush()
    if statements is not None:
        statements.close()


class JournalReplaced(Exception):
    """The journal file was deleted or replaced under a running broker."""


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, None if there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _still_the_journal(path: str, opened: tuple[int, int] | None) -> tuple[int, int] | None:
    """The file at ``path`` is the one the journal opened first; raises if it was deleted or
    replaced since (a connection would go on writing to the old, unlinked file: durable to no one
    who looks, while every answer said "committed")."""
    now = file_identity(path)
    if opened is None:
        return now
    if now != opened:
        raise JournalReplaced(
            f"the journal file {path} was deleted or replaced while the broker ran; nothing was written (writes would "
            "go to a file no one reads). Restart the broker once the file is back: while this writer process (pid "
            f"{os.getpid()}) lives, the file it had open is still readable in /proc/{os.getpid()}/fd (the entry marked "
            f"'(deleted)'): copy it back to {path}, with its -wal file")
    return opened


#: SQLite's files beside the journal in WAL mode: commits live in the -wal until a checkpoint.
_SIDE_FILES = ("-wal", "-shm")


def _still_its_side_files(path: str, sides: dict[str, tuple[int, int] | None]) -> None:
    """The journal's -wal and -shm files are the ones this writer's connection has open; raises
    if one was deleted or replaced (the connection would go on committing into an unlinked -wal,
    and every commit since the last checkpoint would be gone at the next start)."""
    for suffix, opened in sides.items():
        if opened is not None and file_identity(path + suffix) != opened:
            raise JournalReplaced(
                f"the journal's {path}{suffix} file was deleted or replaced while the broker ran, so its latest "
                "commits are in a file no one reads; nothing more is written. Before the broker stops, copy the entry "
                f"marked '(deleted)' in /proc/{os.getpid()}/fd back to {path}{suffix} (this writer process, pid "
                f"{os.getpid()}, still has it open), then restart the broker")


def _die_with(parent: int) -> None:
    """Be killed the moment the broker dies (Linux), so a batch still waiting for the lock here
    cannot commit after the broker, and whatever recovers its records, has moved on. Elsewhere
    the child still ends at end of input, after the batch in hand."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the broker died before the signal was armed
        sys.exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path, timeout, parent = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    expected = tuple(int(n) for n in sys.argv[4].split(":")) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    _die_with(parent)
    # Answers go to a private copy of stdout; anything else that prints goes to stderr (the log).
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    ready = orjson.dumps({"ready": True})
    answers.write(_FRAME.pack(len(ready)) + ready)
    answers.flush()
    serve(path, timeout, sys.stdin.buffer, answers, expected)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
