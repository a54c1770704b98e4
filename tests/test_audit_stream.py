"""``audit verify`` and ``audit export`` on a live journal stream it: memory does not grow with the
journal, and the findings are those of :func:`proxy.audit.verify` over every row (the reference
here: ``verify(*load_database(url))``), damage in the middle of a long chain included.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy import audit
from proxy.audit import Damage
from proxy.store.journal import GENESIS, chain_hash
from tests.conftest import DIALECTS, database_url
from tests.support.big_journal import START, build, insert, mark
from tests.test_audit import assert_first_break, chain, tamper

LONG = 3000  # events in the damaged chain: many batches of the stream, several checkpoints


def reference(url: str) -> audit.AuditResult:
    """What the whole-journal walk finds (every row in memory), then what the checks of the tables
    the chains do not cover find (a live verify makes them after its walk, in this order)."""
    rows, marks = asyncio.run(audit.load_database(url))
    result = audit.verify(rows, marks)

    async def beyond() -> list[audit.Break]:
        async with audit._snapshot(url) as (conn, tables, raw):
            outcomes = await audit._outcomes_without_evidence(conn, tables, raw)
            untrusted = audit._untrusted(rows, result.breaks)  # their events' break says it already
            return [*await audit._records_without_events(conn, tables, raw),
                    *await audit._events_without_records(conn, tables, raw),
                    *await audit._results_not_chained(conn, tables, raw),
                    *audit._outcome_break([i for i in outcomes if i not in untrusted])]

    result.breaks += asyncio.run(beyond())
    return result


@pytest.fixture(params=DIALECTS)
def long_journal(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    url = database_url(request.param, tmp_path, request, migrated=True)
    build(url, {"w1": LONG, "w2": 500})
    return url


def inner(url: str) -> tuple[int, str, int, str]:
    """A row in the middle of w1's long chain, its invocation written before and after it."""
    return next(r for r in chain(url)[LONG // 2:] if 2 <= r[2] <= 7)


@pytest.mark.parametrize("damage", ["modified", "deleted", "swapped", "cut tail"])
def test_damage_in_the_middle_of_a_long_chain_is_named_exactly(long_journal, damage):
    url = long_journal
    ws, inv, seq, _ = inner(url)
    w1 = "writer = 'w1'"
    if damage == "modified":
        tamper(url, f"UPDATE events SET kind = 'FAILED' WHERE {w1} AND writer_seq = {ws}")
        expected = (Damage.MODIFIED, "w1", ws, inv, seq)
    elif damage == "deleted":
        tamper(url, f"DELETE FROM events WHERE {w1} AND writer_seq = {ws}")
        expected = (Damage.DELETED, "w1", ws, inv, seq)
    elif damage == "swapped":
        _, next_inv, next_seq, _ = chain(url)[ws]
        tamper(url, f"UPDATE events SET writer_seq = -1 WHERE {w1} AND writer_seq = {ws}",
               f"UPDATE events SET writer_seq = {ws} WHERE {w1} AND writer_seq = {ws + 1}",
               f"UPDATE events SET writer_seq = {ws + 1} WHERE {w1} AND writer_seq = -1")
        expected = (Damage.REORDERED, "w1", ws, next_inv, next_seq)
    else:  # the checkpoints past the cut prove it
        tamper(url, f"DELETE FROM events WHERE {w1} AND writer_seq > {ws}")
        expected = (Damage.DELETED, "w1", ws + 1, None, None)
    result = audit.verify_database(url)
    assert_first_break(result, *expected)
    assert result == reference(url), "the same findings, every one, as the walk over every row"
    assert {b.writer for b in result.breaks} <= {"w1", None}, "w2 is intact and not reported"


def handover(per_part: int = 40) -> list[dict[str, Any]]:
    """Invocations begun by writer ``a`` and finished by ``b`` (a takeover), and ``c``'s own."""
    heads: dict[str, list[Any]] = {w: [GENESIS, 0] for w in "abc"}
    rows = []

    def put(writer: str, invocation_id: str, seq: int) -> None:
        head = heads[writer]
        head[1] += 1
        row = {"invocation_id": invocation_id, "seq": seq, "kind": "REQUEST_SENT", "at": START, "writer": writer,
               "writer_seq": head[1], "prev_hash": head[0], "key_id": None, "payload": b"{}"}
        row["hash"] = head[0] = chain_hash(row)
        rows.append(row)

    for writer, seqs in (("a", range(1, 5)), ("b", range(5, 9))):
        for i in range(per_part):
            for seq in seqs:
                put(writer, f"act_h{i:03d}", seq)
    for i in range(per_part):
        for seq in range(1, 9):
            put("c", f"act_c{i:03d}", seq)
    return rows


@pytest.mark.parametrize("kind", DIALECTS)
def test_only_the_damaged_chain_is_judged_and_the_writers_beside_it_are_not_reported(request, tmp_path, monkeypatch, kind):
    """A chain is diagnosed on its own rows and its invocations' (some written by another
    writer); that other writer's chain, of which only some rows were read, is not walked."""
    url = database_url(kind, tmp_path, request, migrated=True)
    rows = handover()
    insert(url, rows, lambda: [mark(max((r for r in rows if r["writer"] == w), key=lambda r: r["writer_seq"])) for w in "abc"])
    victim = next(r for r in rows if r["writer"] == "a" and r["seq"] == 2 and r["writer_seq"] > 40)
    tamper(url, f"DELETE FROM events WHERE writer = 'a' AND writer_seq = {victim['writer_seq']}")

    seen: list[tuple[list[Any], set[str] | None]] = []
    walk = audit.verify

    def spy(rows: Any, checkpoints: Any = (), *, writers: Any = None) -> audit.AuditResult:
        rows = list(rows)
        seen.append((rows, None if writers is None else set(writers)))
        return walk(rows, checkpoints, writers=writers)

    monkeypatch.setattr(audit, "verify", spy)
    result = audit.verify_database(url)
    assert_first_break(result, Damage.DELETED, "a", victim["writer_seq"], victim["invocation_id"], 2)
    [(given, writers)] = seen
    assert writers == {"a"}
    assert {r["writer"] for r in given} == {"a", "b"}, "the invocations' later events, not c's chain"
    assert len([r for r in given if r["writer"] == "b"]) == 4 * 40, "b's rows of a's invocations only"
    assert {b.writer for b in result.breaks} == {"a", None}
    monkeypatch.setattr(audit, "verify", walk)
    assert result == reference(url)


@pytest.mark.parametrize("forgery", [
    "UPDATE events SET writer = CAST(writer || x'ff' AS TEXT) WHERE writer = 'w1' AND writer_seq = {ws}",
    "UPDATE events SET invocation_id = CAST(x'ff' || invocation_id AS TEXT) WHERE writer = 'w1' AND writer_seq = {ws}",
    "UPDATE events SET invocation_id = CAST(invocation_id AS BLOB) WHERE writer = 'w1' AND writer_seq = {ws}",
    "UPDATE events SET writer = CAST(writer AS BLOB) WHERE writer = 'w1' AND writer_seq > {ws}",
])
def test_sqlite_values_stored_unlike_the_broker_stores_them_are_judged_as_over_every_row(request, tmp_path, forgery):
    """SQLite keeps whatever a forger writes: text that is not UTF-8, text stored as a blob. The
    stream groups by what the rows say, as the whole-journal walk does."""
    url = database_url("sqlite", tmp_path, request, migrated=True)
    build(url, {"w1": 600, "w2": 300})
    tamper(url, forgery.format(ws=300))
    result = audit.verify_database(url)
    assert result == reference(url)


def test_an_export_that_fails_half_way_leaves_the_earlier_file_and_no_partial_one(request, tmp_path, monkeypatch):
    url = database_url("sqlite", tmp_path, request, migrated=True)
    build(url, {"w1": 5000})
    out = tmp_path / "export.jsonl"
    out.write_text("an earlier export\n")
    calls = {"n": 0}
    line = audit._event_line

    def failing(row: Any) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] > 3000:
            raise OSError(28, "No space left on device")
        return line(row)

    monkeypatch.setattr(audit, "_event_line", failing)
    with pytest.raises(OSError):
        audit.export_events(url, out)
    assert out.read_text() == "an earlier export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.jsonl", "journal.db"], "no partial file"
    monkeypatch.setattr(audit, "_event_line", line)
    assert audit.export_events(url, out) == (5000, 20)
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    lines = out.read_text().splitlines()
    assert len(lines) == 1 + 5000 + 20 + 1 and json.loads(lines[1])["writer_seq"] == 1
    assert json.loads(lines[-1]) == {"type": "affidavit-audit-export-end", "events": 5000, "checkpoints": 20}
    assert audit.verify_dump(out).ok


# -- memory ------------------------------------------------------------------------------------

MEASURE = """
import resource, sys
from pathlib import Path
from proxy import audit

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # MiB (Linux: KiB)

url, warm, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
audit.verify_database(warm)  # imports, the driver, a first query: what any run costs
audit.export_events(warm, out)
before = peak()
result = audit.verify_database(url)
assert result.ok, result.breaks
print(result.events, result.writers, result.invocations, peak() - before)
before = peak()
print(*audit.export_events(url, out), peak() - before)
"""


@pytest.mark.slow
def test_verify_and_export_of_200k_events_stay_within_a_small_memory_bound(request, tmp_path):
    """The whole-journal walk took some 1.6 KB per event (325 MiB more for these 200 000); the
    stream holds a batch of rows, and per chain a few hashes."""
    url = database_url("sqlite", tmp_path, request, migrated=True)
    build(url, {"w1": 150_000, "w2": 50_000})
    (tmp_path / "warm").mkdir()
    warm = database_url("sqlite", tmp_path / "warm", request, migrated=True)
    build(warm, {"w": 10})
    done = subprocess.run([sys.executable, "-c", MEASURE, url, warm, str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    verified, exported = (list(map(int, line.split())) for line in done.stdout.splitlines())
    events, writers, invocations, growth = verified
    assert (events, writers) == (200_000, 2) and invocations > 200_000 // 8
    assert growth < 48, f"verify's peak memory grew by {growth} MiB"
    count, marks, growth = exported
    assert count == 200_000 and marks > 200_000 // 256
    assert growth < 48, f"export's peak memory grew by {growth} MiB"
