"""Outcome metrics straight from SQL: the views count a journal with known contents."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from proxy.contract import Code, EventKind, Phase
from proxy.invocation_log import Identity, InvocationLog, new_invocation_id
from proxy.store.journal import Journal, make_engine


def _entry(journal: Journal, route: str) -> InvocationLog:
    identity = Identity(new_invocation_id(), "builder", route, "POST", "https://x.test:443/", "sha256:" + "1" * 64, False)
    entry = InvocationLog(journal, identity, "test")
    entry.append(EventKind.ACTION_ACCEPTED)
    entry.append(EventKind.PREFLIGHT_VALIDATED)
    entry.append(EventKind.CREDENTIAL_AUTHORIZED)
    return entry


async def _populate(journal: Journal) -> None:
    for _ in range(3):  # committed
        entry = _entry(journal, "payments.create")
        entry.append(EventKind.DISPATCH_STARTED, attempt=1)
        entry.append(EventKind.REMOTE_RESPONSE_COMPLETE, status=201)
        entry.append(EventKind.RESULT_COMMITTED)
        entry.append(EventKind.RESULT_DELIVERED)
        await entry.commit()
    for _ in range(2):  # unknown
        entry = _entry(journal, "payments.create")
        entry.append(EventKind.DISPATCH_STARTED, attempt=1)
        entry.append(EventKind.FAILED, phase=Phase.REMOTE_EXECUTION, code=Code.REMOTE_OUTCOME_UNKNOWN)
        await entry.commit()
    entry = _entry(journal, "github.read")  # not attempted: certificate
    entry.append(EventKind.FAILED, phase=Phase.CONNECTION_SETUP, code=Code.TLS_CERT_EXPIRED)
    await entry.commit()


def test_invocation_outcomes_view_counts_phase_and_outcome_separately(db):
    async def scenario():
        engine = make_engine(db)
        journal = Journal(engine, writer="w")
        await journal.start()
        await _populate(journal)
        await journal.close()
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                "SELECT route, phase, outcome, code, sum(invocations) FROM invocation_outcomes "
                "GROUP BY route, phase, outcome, code ORDER BY route, outcome"))).all()
            buckets = (await conn.execute(text("SELECT DISTINCT bucket FROM invocation_outcomes"))).all()
            unknown = (await conn.execute(text("SELECT invocation_id, code FROM unknown_outcomes"))).all()
        await engine.dispose()
        return rows, buckets, unknown

    rows, buckets, unknown = asyncio.run(scenario())
    assert [tuple(r) for r in rows] == [
        ("github.read", "connection_setup", "not_attempted", "TLS_CERT_EXPIRED", 1),
        ("payments.create", "result_delivery", "committed", None, 3),
        ("payments.create", "remote_execution", "unknown", "REMOTE_OUTCOME_UNKNOWN", 2),
    ]
    assert len(buckets) == 1 and buckets[0][0] is not None
    assert [code for _, code in unknown] == ["REMOTE_OUTCOME_UNKNOWN"] * 2
