"""The journal's format across versions: what a broker stores that another version must read.

A broker only starts on a schema revision it knows (``affidavit run`` and ``db upgrade`` refuse a
newer one), so a value a new version stores (an event kind, a code, a stage...) must come with a
schema revision of its own: then a broker too old to read it is never started on the journal. The
first test holds that rule. The others: a broker that meets a record it cannot read anyway (in a
rolling upgrade, while old brokers still run) says so plainly and sends nothing.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from pathlib import Path

import pytest

from proxy import contract
from proxy.store import migrate
from proxy.store.journal import EventRow, Journal, Write, make_engine
from proxy.invocation_log import utcnow
from tests.conftest import DIALECTS
from tests.support.broker import BrokerProcess
from tests.support.envelopes import check_envelope
from tests.support.journal import query
from tests.test_crash import SAFE, _post_in_background, _record_for, crash_routes, post

FORMATS = Path(__file__).parent / "support" / "journal_format.json"


def stored_values() -> dict[str, list[str]]:
    """Every value of the contract's closed enums, by enum: what the journal's rows may hold."""
    return {obj.__name__: sorted(m.value for m in obj) for obj in vars(contract).values()
            if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__module__ == contract.__name__}


def test_the_values_the_journal_stores_change_only_with_a_schema_revision():
    formats = json.loads(FORMATS.read_text())
    head = migrate.head()
    assert head in formats, (
        f"the schema's head revision {head} has no entry in {FORMATS.name}: add it with the values of this version")
    assert stored_values() == formats[head], (
        f"the contract's enums differ from what revision {head} recorded in {FORMATS.name}. A broker of revision "
        f"{head} could not read a journal holding the new values, yet would start on it. Add a migration (a no-op "
        "is enough, as 0010) and an entry for it in the file with the new values; see migrations/versions/0010.")
    for revision, values in formats.items():
        assert migrate.known(revision), f"{FORMATS.name} names revision {revision}, which migrations/ does not have"
        assert all(set(values.get(name, ())) <= set(now) for name, now in stored_values().items()), (
            f"a value recorded at revision {revision} is gone: a journal may still hold it, and this version must read it")


def _append(url: str, invocation_id: str, kind: str, data: dict) -> None:
    """Append an event as a newer broker would (its own writer, straight to the journal)."""
    async def write() -> None:
        journal = Journal(make_engine(url), writer="newer-broker")
        await journal.start()
        try:
            [(last,)] = await asyncio.to_thread(query, url, f"SELECT max(seq) FROM events WHERE invocation_id = '{invocation_id}'")
            seq = int(last) + 1
            payload, key_id = journal.encode_payload(invocation_id, seq, data)
            await journal.submit(Write(events=[EventRow(invocation_id, seq, kind, utcnow(), payload, key_id)]))
        finally:
            await journal.close()
            await journal.engine.dispose()

    asyncio.run(write())


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("unknown", ["an event kind", "a value in an event"])
def test_a_record_a_newer_broker_wrote_is_refused_plainly_and_nothing_is_sent(make_broker, upstream, dialect, unknown):
    broker: BrokerProcess = make_broker(dialect, routes=crash_routes(upstream))
    key = f"newer-{dialect}-{len(unknown)}"
    first = post(broker, SAFE + "/h/ok", key)
    assert first.status_code == 200
    invocation_id = first.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    if unknown == "an event kind":
        _append(broker.database_url, invocation_id, "FUTURE_KIND", {"note": "a fact this version has no word for"})
    else:  # a finding whose certainty this version does not know
        _append(broker.database_url, invocation_id, "RECONCILED", {"outcome": "committed", "certainty": "crystal_ball"})
    sent = len([r for r in upstream.received if r.method])

    repeat = post(broker, SAFE + "/h/ok", key)
    body = check_envelope(repeat.content)
    assert (repeat.status_code, body["error"]["code"], body["error"]["outcome"], body["error"]["retry"]) == \
        (503, "JOURNAL_UNAVAILABLE", "not_attempted", "backoff"), repeat.text
    assert "written by a newer version of the broker" in body["error"]["message"], body
    assert "with the same key, never a new one" in body["error"]["message"], body
    assert len([r for r in upstream.received if r.method]) == sent, "nothing was sent"

    with broker.api(broker.operator_token) as api:
        shown = api.get(f"/v1/invocations/{invocation_id}")
    assert shown.status_code == 503 and shown.headers["retry-after"], shown.text
    assert "does not know" in shown.json()["detail"] and "upgrade this broker" in shown.json()["detail"], shown.text

    cli = broker.command("invocations", "show", invocation_id)
    assert cli.returncode == 1 and b"does not know" in cli.stderr and b"Traceback" not in cli.stderr, cli.stderr
    logs = broker.logs()
    assert "Traceback" not in logs and "upgrade this broker" in logs.lower(), logs[-2000:]


def test_recovery_leaves_a_record_it_cannot_read_to_a_broker_that_can_and_closes_the_others(make_broker, upstream):
    """A stopped broker's records in flight, the older of them holding a newer broker's event: the
    sweep says once that it cannot close that one, and closes the other (it used to stop at the
    first it could not read, at every sweep)."""
    broker = make_broker("postgresql", routes=crash_routes(upstream),
                         recovery={"heartbeat": "0.3s", "stale_after": "1.5s", "sweep_every": "0.3s"})
    ids = []
    for n in ("unreadable", "readable"):  # in this order: the sweep takes the oldest first
        _post_in_background(broker, SAFE + f"/h/slow?delay=5&n={n}")
        ids.append(_record_for(broker, n))
        broker.wait_for(ids[-1], lambda r: r["stage"] in ("dispatched", "sent"), timeout=5)
    unreadable, readable = ids
    broker.kill()
    _append(broker.database_url, unreadable, "FUTURE_KIND", {})
    broker.start()  # the same instance: its earlier incarnation's records are closed at once
    closed = broker.wait_for(readable, lambda r: r["stage"] == "ended_unknown", timeout=15)
    assert closed["outcome"] == "unknown"
    time.sleep(1.5)  # several more sweeps
    said = [line for line in broker.logs().splitlines() if "cannot close it" in line]
    assert len(said) == 1 and unreadable in said[0] and "upgrade this one" in said[0], said
    [(stage,)] = query(broker.database_url, f"SELECT stage FROM invocations WHERE invocation_id = '{unreadable}'")
    assert stage in ("dispatched", "sent"), "left to a broker that can read it"
    assert "recovery sweep failed" not in broker.logs()


def test_a_migrated_journal_has_every_index_the_schema_declares(db):
    """The migrations are the schema a journal gets; proxy/store/schema.py is what the code
    assumes. An index declared there and never migrated (the recovery sweep's, say) would leave
    every sweep reading the whole table on real journals, which no small test would notice."""
    from sqlalchemy import inspect

    from proxy.store.schema import metadata

    async def indexes() -> dict[str, set[str]]:
        engine = make_engine(db)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(lambda c: {
                    table: {i["name"] for i in inspect(c).get_indexes(table)} for table in metadata.tables})
        finally:
            await engine.dispose()

    present = asyncio.run(indexes())
    for table in metadata.tables.values():
        declared = {index.name for index in table.indexes}
        assert declared <= present[table.name], (table.name, declared - present[table.name])
