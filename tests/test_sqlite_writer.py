"""The SQLite journal's writer process: the same rows as in-process statements, faults of the
process itself (hung, killed, orphaned) cost at most the batch it held, and it inherits no secrets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import httpx
import orjson
import pytest
from sqlalchemy import select

from proxy.invocation_log import new_invocation_id
from proxy.store import migrate
from proxy.store.journal import GENESIS, EventRow, Fence, Journal, JournalUnavailable, Write, make_engine, projection_row
from proxy.store.schema import events, invocations
from proxy.store import sqlite_writer
from proxy.store.sqlite_writer import SqliteWriter
from proxy.store.statements import SqliteStatements
from tests.support.broker import AFFIDAVIT
from tests.support.envelopes import check_envelope
from tests.test_journal_statements import _stored, invocation_row

NOW = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
ON_THE_SECOND = datetime(2026, 11, 30, 12, 0, 1, tzinfo=UTC)  # no fraction: ISO text without one
ELSEWHERE = datetime(2026, 11, 30, 14, 0, 2, 5, tzinfo=timezone(timedelta(hours=2)))  # stored as SQLAlchemy does
NAIVE = datetime(2026, 11, 30, 12, 0, 3, 999999)


def _migrated(path: Path) -> str:
    url = f"sqlite+aiosqlite:///{path}"
    migrate.upgrade(url)
    return url


async def _in_a_writer_process(path: Path, document: bytes) -> list:
    """One document through a writer process of its own; the refused checks it answers."""
    writer = SqliteWriter(str(path), 5.0)
    try:
        return await writer.write(document)
    finally:
        await writer.close()


def _batch(earlier: str, fresh: str, keyed: str) -> list[Write]:
    """Every part of a document: a fenced update, a claim, inserts, events (binary payloads,
    times with and without a fraction), a result."""
    moved = invocation_row(earlier, stage="dispatched", phase="remote_execution", outcome="unknown",
                           dispatch_started=True, dispatch_seq=2, last_seq=2, updated_at=ON_THE_SECOND)
    return [
        Write(events=[EventRow(earlier, 2, "DISPATCH_STARTED", ON_THE_SECOND, b'{"attempt":1}')],
              update_invocation=projection_row(earlier, moved), fence=Fence(earlier, 2, "broker-a", NOW)),
        Write(events=[EventRow(keyed, 1, "ACTION_ACCEPTED", ELSEWHERE, b"\x00\xff binary", key_id="k2026")],
              insert_invocation=invocation_row(keyed, key="fresh-key"), claim=True),
        Write(events=[EventRow(fresh, 1, "ACTION_ACCEPTED", NOW, b"{}"), EventRow(fresh, 2, "PREFLIGHT_VALIDATED", NOW, b"{}")],
              insert_invocation=invocation_row(fresh, generation=0),
              result={"invocation_id": fresh, "stored_at": NAIVE, "status": 201, "headers": '[["Ä","\\\\x41 ✓"]]',
                      "body": b"\x00\x01 body", "body_sha256": "3" * 64, "framing": "content-length", "key_id": None}),
    ]


def test_the_writer_process_stores_a_batch_exactly_as_in_process_statements_do(tmp_path):
    ids = [new_invocation_id() for _ in range(3)]
    earlier = ids[0]
    stored, raw = {}, {}
    for way in ("process", "in-process"):
        path = tmp_path / f"{way}.db"
        journal = Journal(make_engine(_migrated(path)), writer="w1")
        setup = SqliteStatements.connect(str(path), 5.0)
        with setup.transaction():
            setup.insert(invocations, [invocation_row(earlier)])
        writes = _batch(*ids)
        if way == "process":
            document, _ = journal._payload(writes, [0, GENESIS])
            assert asyncio.run(_in_a_writer_process(path, document)) == [], "nothing refused"
        else:
            assert journal._statements(setup, writes, isolate=False) == {}
        setup.close()
        asyncio.run(journal.engine.dispose())
        stored[way] = _stored(path)
        raw[way] = _raw(path)
    assert raw["process"] == raw["in-process"], "the very text, bytes and types SQLite holds"
    assert stored["process"] == stored["in-process"]
    # And what was stored is what was handed over: bytes as bytes, times to the microsecond.
    rows = {(e["invocation_id"], e["seq"]): e for e in stored["process"]["events"]}
    assert rows[(earlier, 2)]["at"] == ON_THE_SECOND.replace(tzinfo=None)
    assert b"\x00\xff binary" in [e["payload"] for e in rows.values()]
    assert stored["process"]["results"][0]["body"] == b"\x00\x01 body"
    projection = {r["invocation_id"]: r for r in stored["process"]["invocations"]}[earlier]
    assert (projection["stage"], projection["updated_at"]) == ("dispatched", ON_THE_SECOND.replace(tzinfo=None))


def _raw(path: Path) -> dict[str, list[tuple]]:
    """Every stored value as SQLite holds it, with its storage class (no type conversion), and the
    chain checkpoint but for its wall-clock time."""
    conn = sqlite3.connect(path)
    try:
        out = {}
        for table in ("invocations", "events", "results", "chain_checkpoints"):
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})") if row[1] != "at" or table != "chain_checkpoints"]
            select_list = ", ".join([*columns, *(f"typeof({c})" for c in columns)])
            out[table] = sorted(conn.execute(f"SELECT {select_list} FROM {table}").fetchall(), key=repr)
        return out
    finally:
        conn.close()


def test_a_refused_check_in_the_writer_process_writes_nothing_of_its_batch(tmp_path):
    path = tmp_path / "refused.db"
    url = _migrated(path)
    earlier = new_invocation_id()
    setup = SqliteStatements.connect(str(path), 5.0)
    with setup.transaction():
        setup.insert(invocations, [invocation_row(earlier)])
    setup.close()
    writes = _batch(earlier, new_invocation_id(), new_invocation_id())
    writes[0].fence = Fence(earlier, 9, "broker-a", NOW)  # a generation the invocation is not at
    journal = Journal(make_engine(url), writer="w1")
    document, _ = journal._payload(writes, [0, GENESIS])
    asyncio.run(journal.engine.dispose())
    assert asyncio.run(_in_a_writer_process(path, document)) == [{"write": 0, "why": "fence"}]
    stored = _stored(path)
    assert [r["invocation_id"] for r in stored["invocations"]] == [earlier], "not even the claim's insert"
    assert stored["events"] == [] and stored["results"] == []


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs nothing and holds no lock)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True


async def _until(check, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _write(invocation_id: str) -> Write:
    return Write(events=[EventRow(invocation_id, 1, "ACTION_ACCEPTED", NOW, b"{}")],
                 insert_invocation=invocation_row(invocation_id, generation=0))


async def _stored_ids(journal: Journal) -> list[str]:
    async with journal.engine.connect() as conn:
        return sorted((await conn.execute(select(events.c.invocation_id))).scalars())


def test_a_hung_writer_process_fails_only_its_batch_within_the_timeout_and_a_new_one_takes_the_next(tmp_path):
    url = _migrated(tmp_path / "hung.db")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        first, lost, after = new_invocation_id(), new_invocation_id(), new_invocation_id()
        await journal.commit(_write(first))
        hung = journal._sqlite_writer.pid
        os.kill(hung, signal.SIGSTOP)  # the fault: alive, holding its pipe, answering nothing
        journal.timeout = 1.0
        started = time.monotonic()
        with pytest.raises(JournalUnavailable):
            await journal.commit(_write(lost))
        assert time.monotonic() - started < 3.0, "bounded by the journal's timeout"
        journal.timeout = 5.0
        assert journal.writer != "w1", "an unanswered batch ends the chain; the next rows start a new one"
        await _until(lambda: _gone(hung))  # killed: a late commit must not land after the answer
        await journal.commit(_write(after))
        assert journal._sqlite_writer.pid not in (None, hung)
        assert await _stored_ids(journal) == sorted([first, after]), "the stopped process read nothing"
        writer = journal._sqlite_writer.pid
        await journal.close()
        assert _gone(writer), "closing the journal ends its writer process"
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_a_writer_process_that_died_idle_is_replaced_without_failing_the_next_batch(tmp_path):
    url = _migrated(tmp_path / "killed.db")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        first, after = new_invocation_id(), new_invocation_id()
        await journal.commit(_write(first))
        killed = journal._sqlite_writer.pid
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not _gone(killed):  # blocking: the loop cannot learn of the exit before the commit
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert journal._sqlite_writer.pid == killed, "the broker has not noticed yet"
        await journal.commit(_write(after))  # the hand-over fails, so a new child takes the batch
        assert journal._sqlite_writer.pid not in (None, killed)
        assert await _stored_ids(journal) == sorted([first, after])
        assert journal.healthy
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_the_writer_process_inherits_no_secrets_from_the_environment(tmp_path, monkeypatch):
    canary = "canary-" + os.urandom(8).hex()
    monkeypatch.setenv("AFFIDAVIT_AGENT_TOKEN", canary)
    monkeypatch.setenv("PAYMENTS_API_KEY", canary)
    url = _migrated(tmp_path / "env.db")

    async def scenario() -> bytes:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        await journal.commit(_write(new_invocation_id()))
        environ = Path(f"/proc/{journal._sqlite_writer.pid}/environ").read_bytes()
        await journal.close()
        await journal.engine.dispose()
        return environ

    environ = asyncio.run(scenario())
    assert canary.encode() not in environ
    assert b"PATH=" in environ, "what Python needs to start is still there"


def test_the_writer_process_dies_with_its_broker_even_while_it_waits_for_the_lock(tmp_path):
    """A broker killed outright while its writer waits for SQLite's write lock: the writer must
    not commit that batch later (whatever recovers the broker's records has moved on by then)."""
    path = tmp_path / "orphan.db"
    url = _migrated(path)
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("PRAGMA journal_mode=WAL")  # as every journal connection has it
    lock.execute("BEGIN IMMEDIATE")  # another connection holds the write lock
    invocation_id = new_invocation_id()
    broker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import asyncio
            from tests.test_sqlite_writer import _write
            from proxy.store.journal import Journal, make_engine
            async def main():
                journal = Journal(make_engine({url!r}), writer="w1", timeout=30.0)
                await journal.start()
                print(journal._sqlite_writer.pid, flush=True)
                await journal.commit(_write({invocation_id!r}))
                print("committed", flush=True)
            asyncio.run(main())
        """)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )
    try:
        writer = int(broker.stdout.readline())
        time.sleep(1.0)  # the batch is in the writer, which waits for the lock (15 s busy timeout)
        assert not _gone(writer) and broker.poll() is None
        os.kill(broker.pid, signal.SIGKILL)
        broker.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(writer):
            assert time.monotonic() < deadline, "the writer process outlived its broker"
            time.sleep(0.05)
        lock.execute("COMMIT")  # the lock is free: a surviving writer would commit now
        time.sleep(0.5)
        assert lock.execute("SELECT count(*) FROM events").fetchone() == (0,)
    finally:
        lock.close()
        broker.kill()
        broker.wait(10)


def test_a_broker_whose_writer_process_cannot_start_refuses_to_start(make_broker, upstream):
    """A broken install (the child cannot start) must not give a broker that says it is ready
    and refuses every request: it stops the start, saying why."""
    broker = make_broker(start=False, env={"AFFIDAVIT_FAILPOINTS": "sqlite_writer_start=raise"})
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path)],
                          cwd=broker.workdir, env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "affidavit: cannot start: the SQLite journal's writer process could not start" in done.stderr, done.stderr[-3000:]
    assert "proxy listening on" not in done.stdout
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", broker.proxy_port)) != 0, "nothing is left listening"


CRASH_TEXT = "CrashCanary: the writer process cannot import its schema"


def _crashing_writer_hook(directory: Path) -> tuple[Path, Path]:
    """A ``sitecustomize`` on PYTHONPATH (which the writer process inherits) that, while the flag
    file exists, makes every new writer process print a two-line error and exit with status 3 at
    start-up, as a broken install would, and while ``<flag>.hang`` exists makes it hang there;
    while ``<flag>.batch`` exists, a writer process that started exits with status 4 when it
    reads a batch, and while ``<flag>.batchhang`` exists it hangs there. It counts the starts it
    saw. Returns (flag, starts)."""
    flag, starts = directory / "crash", directory / "starts"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, sys, time
        if "proxy.store.sqlite_writer" in getattr(sys, "orig_argv", ()):
            with open({str(starts)!r}, "a") as fh:
                fh.write("start\\n")
            if os.path.exists({str(flag)!r}):
                sys.stderr.write("Traceback (most recent call last):\\n{CRASH_TEXT}\\n")
                sys.stderr.flush()
                os._exit(3)
            while os.path.exists({str(flag) + ".hang"!r}):
                time.sleep(0.05)
            import orjson
            _loads = orjson.loads
            def _dying_loads(data):
                if os.path.exists({str(flag) + ".batch"!r}):
                    os._exit(4)
                while os.path.exists({str(flag) + ".batchhang"!r}):
                    time.sleep(0.05)
                return _loads(data)
            orjson.loads = _dying_loads  # the writer parses each batch with orjson.loads
    """))
    return flag, starts


def _starts(starts: Path) -> int:
    return len(starts.read_text().splitlines()) if starts.exists() else 0


def _journal_with_crash_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retry_after: float = 3.0) -> tuple[Path, Path, str]:
    """:func:`_crashing_writer_hook` on the writer processes' PYTHONPATH, the first retry of a
    failed start after ``retry_after`` s (3 s: slow enough for a loaded machine), and a migrated
    SQLite journal. Returns (flag, starts, url)."""
    flag, starts = _crashing_writer_hook(tmp_path / "hook")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "hook"))
    monkeypatch.setattr(sqlite_writer, "_RETRY_AFTER", (retry_after, 30.0))
    return flag, starts, _migrated(tmp_path / "journal.db")


def test_a_writer_process_that_cannot_start_again_is_retried_with_growing_waits_and_logged(tmp_path, monkeypatch, caplog, capfd):
    """The writer dies and every new one crashes at start: batches fail closed at once instead of
    each paying for a start, the journal says it cannot write, the crash's output is in the log as
    records (not raw text on the broker's stderr), and once a start works again the journal writes."""
    flag, starts, url = _journal_with_crash_hook(tmp_path, monkeypatch)
    caplog.set_level("INFO", logger="affidavit.journal")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        before, after = new_invocation_id(), new_invocation_id()
        await journal.commit(_write(before))
        assert journal.write_problem is None
        flag.touch()
        dead = journal._sqlite_writer.pid
        os.kill(dead, signal.SIGKILL)
        await _until(lambda: _gone(dead))
        with pytest.raises(JournalUnavailable, match=r"exit status 3\) did not start"):
            await journal.commit(_write(new_invocation_id()))  # a new writer is started, and crashes
        assert _starts(starts) == 2
        assert journal.write_problem is not None
        started = time.monotonic()
        for _ in range(5):
            with pytest.raises(JournalUnavailable, match="the next try is in"):
                await journal.commit(_write(new_invocation_id()))
        assert time.monotonic() - started < 2.5 and _starts(starts) == 2, "no start per batch while waiting"
        await _until(lambda: _starts(starts) >= 3, seconds=15)  # the retry in the background, after 3 s
        await _until(lambda: journal._sqlite_writer._backoffs >= 2)
        assert journal._sqlite_writer._retry_at - time.monotonic() > 3.0, "the wait doubled (6 s)"
        flag.unlink()
        await _until(lambda: journal.write_problem is None, seconds=30)
        await journal.commit(_write(after))
        assert await _stored_ids(journal) == sorted([before, after]), "the refused batches wrote nothing"
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())
    relayed = [r.getMessage() for r in caplog.records if "SQLite writer process (pid" in r.getMessage()]
    assert any(m.endswith(CRASH_TEXT) for m in relayed), relayed
    assert any(m.endswith("Traceback (most recent call last):") for m in relayed), "a record per line"
    assert CRASH_TEXT not in capfd.readouterr().err, "the child's output is relayed, not inherited"
    assert not [r for r in caplog.records if "Unknown child process" in r.getMessage()], "asyncio reaped each child"


def test_a_writer_process_that_dies_on_every_batch_is_not_replaced_per_batch_for_ever(tmp_path, monkeypatch, caplog):
    """A writer that starts but dies on each batch it reads: one or two deaths are replaced at
    once (an isolated crash must not stop the journal), three in a row make the journal say it
    cannot write and wait before the next start, doubling; a batch answered again resets it."""
    flag, starts, url = _journal_with_crash_hook(tmp_path, monkeypatch)
    on_batch = Path(str(flag) + ".batch")
    caplog.set_level("INFO", logger="affidavit.journal")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        before, after = new_invocation_id(), new_invocation_id()
        await journal.commit(_write(before))
        on_batch.touch()
        for death in (1, 2):
            with pytest.raises(JournalUnavailable, match=r"exit status 4\) ended without answering"):
                await journal.commit(_write(new_invocation_id()))
            assert journal.write_problem is None, f"death {death}: replaced, not yet a problem"
        with pytest.raises(JournalUnavailable, match=r"exit status 4\) ended without answering"):
            await journal.commit(_write(new_invocation_id()))
        problem = journal.write_problem
        assert problem is not None and "3 SQLite writer processes in a row ended while writing a batch" in problem
        assert "exit status 4" in problem
        seen = _starts(starts)
        started = time.monotonic()
        for _ in range(5):
            with pytest.raises(JournalUnavailable, match="the next try is in"):
                await journal.commit(_write(new_invocation_id()))
        assert time.monotonic() - started < 2.5 and _starts(starts) == seen, "no start per batch while waiting"
        await _until(lambda: journal.write_problem is None, seconds=15)  # a new child after ~3 s
        with pytest.raises(JournalUnavailable, match="ended without answering"):
            await journal.commit(_write(new_invocation_id()))  # it dies too: the fourth in a row
        assert journal.write_problem is not None
        assert journal._sqlite_writer._retry_at - time.monotonic() > 3.0, "the wait doubled (6 s)"
        on_batch.unlink()
        await _until(lambda: journal.write_problem is None, seconds=30)
        await journal.commit(_write(after))
        assert journal._sqlite_writer._batch_deaths == journal._sqlite_writer._backoffs == 0, "an answered batch ends the run"
        assert await _stored_ids(journal) == sorted([before, after]), "the failed batches wrote nothing"
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())
    backed_off = [r for r in caplog.records if "in a row ended while writing a batch" in r.getMessage()
                  and "trying again in" in r.getMessage()]
    assert [r.levelname for r in backed_off] == ["ERROR", "ERROR"], "the third and the fourth death, each once"


def test_a_start_that_fails_after_deaths_on_batches_waits_longer_not_from_the_start(tmp_path, monkeypatch):
    """Children that die on their batches, then one that cannot even start: one outage getting no
    better, so the wait keeps doubling (3 s, then 6 s) instead of starting again at 3 s."""
    flag, starts, url = _journal_with_crash_hook(tmp_path, monkeypatch)
    on_batch = Path(str(flag) + ".batch")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        on_batch.touch()
        for _ in range(3):
            with pytest.raises(JournalUnavailable, match="ended without answering"):
                await journal.commit(_write(new_invocation_id()))
        writer = journal._sqlite_writer
        assert writer.problem is not None and 2.0 < writer._retry_at - time.monotonic() <= 3.0
        seen = _starts(starts)
        flag.touch()  # the next child crashes at start
        await _until(lambda: _starts(starts) > seen, seconds=15)
        await _until(lambda: "did not start" in (writer.problem or ""))
        assert writer._retry_at - time.monotonic() > 3.0, "the wait doubled (6 s)"
        flag.unlink()
        on_batch.unlink()
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_writer_processes_that_hang_on_their_batches_count_as_dying_on_them(tmp_path, monkeypatch):
    """A child that takes a batch and never answers is killed at the journal's timeout; three in
    a row and the journal says it cannot write, like three that died."""
    flag, _, url = _journal_with_crash_hook(tmp_path, monkeypatch)
    hang = Path(str(flag) + ".batchhang")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1", timeout=2.0)
        await journal.start()
        try:
            await journal.commit(_write(new_invocation_id()))
            hang.touch()
            for _ in range(3):
                assert journal.write_problem is None
                with pytest.raises(JournalUnavailable, match="did not answer in time"):
                    await journal.commit(_write(new_invocation_id()))
            problem = journal.write_problem or ""
            assert "3 SQLite writer processes in a row" in problem and "no answer in time" in problem, problem
            hang.unlink()
            await _until(lambda: journal.write_problem is None, seconds=15)
            await journal.commit(_write(new_invocation_id()))
        finally:
            hang.unlink(missing_ok=True)
            await journal.close()
            await journal.engine.dispose()

    asyncio.run(scenario())


def test_batches_during_a_restart_fail_at_once_and_closing_ends_the_restart(tmp_path, monkeypatch, caplog):
    """While a retry's new child is starting (here: hangs at start-up), a batch is refused at
    once instead of waiting its whole timeout, and closing the journal ends that start: the
    half-started child is killed, nothing is reported as a failure, nothing is left running."""
    flag, starts, url = _journal_with_crash_hook(tmp_path, monkeypatch, retry_after=0.2)
    caplog.set_level("INFO", logger="affidavit.journal")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        try:
            await _restart_hangs_and_close(journal)
        finally:  # a failed check must not leave the retry spawning: asyncio.run would cancel the
            await journal.close()  # spawn mid-way and hang for ever (CPython gh-125502, Python < 3.12.8)
            await journal.engine.dispose()

    async def _restart_hangs_and_close(journal: Journal) -> None:
        flag.touch()
        dead = journal._sqlite_writer.pid
        os.kill(dead, signal.SIGKILL)
        await _until(lambda: _gone(dead))
        Path(str(flag) + ".hang").touch()
        with pytest.raises(JournalUnavailable):
            await journal.commit(_write(new_invocation_id()))  # the replacement crashes
        flag.unlink()  # from now on a new child hangs at start-up
        # The child counts its start before the broker has its process object: wait for both.
        await _until(lambda: _starts(starts) >= 3 and journal._sqlite_writer._proc is not None, seconds=15)
        hanging = journal._sqlite_writer._proc.pid
        started = time.monotonic()
        with pytest.raises(JournalUnavailable, match="a new writer process is starting"):
            await journal.commit(_write(new_invocation_id()))
        assert time.monotonic() - started < 1.0, "refused at once, not after the journal's timeout"
        caplog.clear()
        started = time.monotonic()
        await journal.close()
        assert time.monotonic() - started < 3.0
        await _until(lambda: _gone(hanging))
        assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")], caplog.text

    asyncio.run(scenario())


def _writer_of(broker_pid: int) -> int:
    for child in Path(f"/proc/{broker_pid}/task/{broker_pid}/children").read_text().split():
        if b"proxy.store.sqlite_writer" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError("the broker has no SQLite writer process")


def test_a_broker_whose_writer_process_cannot_restart_is_not_ready_forwards_nothing_and_recovers(make_broker, upstream, tmp_path):
    hook = tmp_path / "hook"
    flag, _ = _crashing_writer_hook(hook)
    broker = make_broker(env={"PYTHONPATH": str(hook)})
    with broker.client() as client:
        assert client.get("http://plain.example.test/h/ok").status_code == 200
        flag.touch()
        writer = _writer_of(broker.proc.pid)
        os.kill(writer, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not _gone(writer):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = client.get("http://plain.example.test/h/ok")  # the batch finds it gone; its successor crashes
        body = check_envelope(refused.content)
        assert refused.status_code == 503
        assert (body["error"]["code"], body["error"]["outcome"]) == ("JOURNAL_UNAVAILABLE", "not_attempted")
        ready = httpx.get(broker.api_url + "/readyz", timeout=10)
        assert (ready.status_code, ready.json()) == (503, {"status": "unavailable", "journal": "unwritable"})
        flag.unlink()
        deadline = time.monotonic() + 40
        while httpx.get(broker.api_url + "/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the writer process was not started again"
            time.sleep(0.2)
        assert client.get("http://plain.example.test/h/ok").status_code == 200
    assert upstream.effects == 2, "nothing was forwarded while the journal could not write"
    lines = broker.logs().splitlines()
    crash = [line for line in lines if CRASH_TEXT in line]
    assert crash and all(line.startswith("{") and json.loads(line)["msg"].endswith(CRASH_TEXT) for line in crash), crash


def test_a_stop_signal_meant_for_the_broker_does_not_end_its_writer_process(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group, and a supervisor may
    signal a group too: the writer must still be there to commit the broker's last batch."""
    url = _migrated(tmp_path / "signals.db")

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        writer = journal._sqlite_writer.pid
        assert os.getpgid(writer) != os.getpgid(0), "a group of its own"
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(writer, sig)  # even sent to it directly
        last = new_invocation_id()
        await asyncio.sleep(0.3)
        await journal.commit(_write(last))
        assert journal._sqlite_writer.pid == writer, "the same process committed after both signals"
        assert await _stored_ids(journal) == [last]
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


@pytest.mark.parametrize(("deleted", "said"), [
    (("", "-wal", "-shm"), "the journal file {path} was deleted or replaced"),
    (("-wal",), "the journal's {path}-wal file was deleted"),
    (("-shm",), "the journal's {path}-shm file was deleted"),
])
def test_a_journal_file_deleted_while_the_broker_runs_fails_closed_for_good(tmp_path, deleted, said):
    """An open SQLite connection goes on writing to a deleted file, and every commit succeeds:
    durable to no one (for the -wal, every commit since the last checkpoint is gone at the next
    start; a deleted -shm breaks the locking other connections rely on). The writer process
    checks, per batch, that the paths are still the files it opened; a deleted or replaced one
    fails the batch (nothing forwarded) and every one after it, and the journal says it cannot
    write (readiness turns unwritable) until the broker restarts with the file back."""
    path = tmp_path / "journal.db"
    url = _migrated(path)

    async def scenario() -> None:
        journal = Journal(make_engine(url), writer="w1")
        await journal.start()
        await journal.commit(_write(new_invocation_id()))
        assert journal.write_problem is None
        for suffix in deleted:
            Path(str(path) + suffix).unlink(missing_ok=True)
        for _ in range(2):  # and it stays refused: no new, empty journal in its place
            with pytest.raises(JournalUnavailable, match=re.escape(said.format(path=path))):
                await journal.commit(_write(new_invocation_id()))
        assert journal.write_problem is not None and "deleted or replaced" in journal.write_problem
        writer = journal._sqlite_writer.pid
        held = [os.readlink(f"/proc/{writer}/fd/{fd}") for fd in os.listdir(f"/proc/{writer}/fd")]
        assert f"{path}{deleted[0]} (deleted)" in held, "the writer keeps the deleted file open, as its message says"
        journal._sqlite_writer.kill()  # and after its writer process, still refused
        with pytest.raises(JournalUnavailable, match="deleted or replaced while the broker ran"):
            await journal.commit(_write(new_invocation_id()))
        assert journal._sqlite_writer.pid != writer
        if "" in deleted:
            assert not path.exists(), "no new, empty journal in its place"
        await journal.close()
        await journal.engine.dispose()

    asyncio.run(scenario())


def test_a_writer_that_reset_its_connection_does_not_take_sqlites_own_wal_cleanup_for_a_deletion(tmp_path):
    """A batch the database refuses closes the writer's connection; if it was the last one, SQLite
    checkpoints and deletes the -wal and -shm itself. That is no operator's deletion: the next
    connection's files are looked at anew, and writes go on."""
    import io

    from proxy.store.sqlite_writer import _FRAME, serve

    path = tmp_path / "journal.db"
    _migrated(path)
    batches = [{}, {"checks": [{"write": 0, "fence": {"invocation_id": "act_x", "generation": 1, "owner": "o",
                                                       "now": "not a time", "check_expiry": True}}]}, {}, {}]
    requests = io.BytesIO(b"".join(_FRAME.pack(len(b)) + b for b in (orjson.dumps(d) for d in batches)))
    answers = io.BytesIO()
    serve(str(path), 5.0, requests, answers)
    answers.seek(0)
    replies = []
    while head := answers.read(_FRAME.size):
        replies.append(orjson.loads(answers.read(_FRAME.unpack(head)[0])))
    assert [r.get("error") for r in replies] == [None, "database", None, None], replies
