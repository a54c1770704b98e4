"""Key checks: another key file behind a [crypto] key id is refused before it encrypts anything,
by `secrets set`/`rotate` and by a broker's start, on both dialects (real databases, a real
broker process)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import tomli_w
from sqlalchemy import insert, select

from proxy.crypto import KeyRing, generate_key, payload_codec, result_codec, vault_aad
from proxy import keychecks
from proxy.keychecks import CHECK_TEXT, KeyMismatch, check_keys
from proxy.store.journal import on_engine
from proxy.store.schema import events, invocations, results
from proxy.store.vault_schema import key_checks, key_ids_before_checks, vault_secrets
from tests.support.broker import AFFIDAVIT
from tests.support.journal import query


def ring(*keys: tuple[str, bytes]) -> KeyRing:
    return KeyRing(list(keys))


def run(url: str, work):
    return asyncio.run(on_engine(url, work))


async def checks(engine) -> list[dict]:
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(select(key_checks))).mappings()]


def test_the_first_writer_under_an_id_leaves_a_check_and_another_key_file_behind_that_id_is_refused(db):
    right, wrong = os.urandom(32), os.urandom(32)

    async def scenario(engine):
        await check_keys(engine, ring(("k1", right)), by="broker one")
        await check_keys(engine, ring(("k1", right)), by="broker two")  # the same file again: fine, no new row
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k1", wrong)), by="broker three")
        return await checks(engine), refused.value

    rows, error = run(db, scenario)
    assert [(r["key_id"], r["created_by"]) for r in rows] == [("k1", "broker one")]
    assert CHECK_TEXT not in bytes(rows[0]["sealed"]), "the check is ciphertext"
    said = str(error)
    assert "'k1'" in said and "broker one" in said and "another key file" in said and "configure the key file" in said


def test_a_listed_key_that_no_longer_encrypts_is_checked_too_and_a_new_id_gets_its_own_check(db):
    """After a rotation the old id is only read with; another file behind it would read nothing
    the journal holds under it, so it is refused as well."""
    k1, k2 = os.urandom(32), os.urandom(32)

    async def scenario(engine):
        await check_keys(engine, ring(("k1", k1)), by="before the rotation")
        await check_keys(engine, ring(("k2", k2), ("k1", k1)), by="after the rotation")
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k2", k2), ("k1", os.urandom(32))), by="a copied config")
        return await checks(engine), refused.value

    rows, error = run(db, scenario)
    assert sorted((r["key_id"], r["created_by"]) for r in rows) == [("k1", "before the rotation"), ("k2", "after the rotation")]
    assert "'k1'" in str(error) and "before the rotation" in str(error)


@pytest.mark.parametrize("rival_has_the_same_file", [False, True])
def test_a_check_written_by_another_writer_between_the_look_and_the_write_is_opened_not_overwritten(db, monkeypatch, rival_has_the_same_file):
    """Workers starting together: another writes the id's check after this one found none. The
    insert collides, and this one opens theirs: refused if the files differ, fine if not."""
    mine = os.urandom(32)
    rival = mine if rival_has_the_same_file else os.urandom(32)
    original = keychecks.try_stored

    async def scenario(engine):
        async def rival_first(conn, keys, key_id, **how):
            await keychecks._write_check(engine, ring(("k1", rival)), key_id, "the rival worker")
            return await original(conn, keys, key_id, **how)

        monkeypatch.setattr(keychecks, "try_stored", rival_first)
        try:
            await check_keys(engine, ring(("k1", mine)), by="this worker")
        except KeyMismatch as exc:
            return exc, await checks(engine)
        return None, await checks(engine)

    error, rows = run(db, scenario)
    assert [r["created_by"] for r in rows] == ["the rival worker"], "one check, the first writer's"
    if rival_has_the_same_file:
        assert error is None
    else:
        assert isinstance(error, KeyMismatch) and "the rival worker" in str(error), error


def test_two_writers_with_different_files_racing_for_a_new_id_one_check_wins_and_the_other_is_refused(db):
    a, b = os.urandom(32), os.urandom(32)

    async def scenario(engine):
        outcomes = await asyncio.gather(*(check_keys(engine, ring(("k1", m)), by=f"writer {n}") for n, m in enumerate((a, b))),
                                        return_exceptions=True)
        return outcomes, await checks(engine)

    outcomes, rows = run(db, scenario)
    assert len(rows) == 1
    winner = int(rows[0]["created_by"].split()[-1])
    assert outcomes[winner] is None and isinstance(outcomes[1 - winner], KeyMismatch), outcomes


async def _rows_from_before_the_checks(engine, material: bytes, kind: str, *, key_id: str = "k1",
                                      version: int = 1, altered: bool = False, upgraded: bool = True) -> None:
    """A journal from before migration 0013, as the migration leaves it: one row of ``kind`` (an
    event, a result, a vault version) encrypted under ``key_id`` (``altered``: its bytes
    replaced), the id in ``key_ids_before_checks``, and no key check (``upgraded=False``: a
    journal still at 0012, which has neither table)."""
    keys = ring((key_id, material))
    invocation_id = "inv_" + os.urandom(8).hex()
    now = datetime.now(UTC)
    spoil = (lambda blob: os.urandom(len(blob))) if altered else (lambda blob: blob)
    async with engine.begin() as conn:
        listed = upgraded and (await conn.execute(
            select(key_ids_before_checks).where(key_ids_before_checks.c.key_id == key_id))).first() is not None
        if upgraded and not listed:  # as migration 0013 lists the ids rows are stored under
            await conn.execute(insert(key_ids_before_checks).values(key_id=key_id))
        await conn.execute(insert(invocations).values(
            invocation_id=invocation_id, created_at=now, updated_at=now, agent="a", route="r", method="GET",
            target="https://x.test/", fingerprint="f", idempotent=True, remote_contract=False, stage="delivered",
            phase="completed", outcome="succeeded", caller_disposition="delivered", dispatch_started=True,
            last_seq=1, owner="old", generation=0, attempts_used=1, retry_budget=0))
        if kind == "event":
            payload, stored_under = payload_codec(keys)(invocation_id, 1, {"kind": "ACTION_ACCEPTED"})
            await conn.execute(insert(events).values(
                invocation_id=invocation_id, seq=1, kind="ACTION_ACCEPTED", at=now, writer="old", writer_seq=version,
                prev_hash="0" * 64, hash="1" * 64, key_id=stored_under, payload=spoil(payload)))
        elif kind == "result":
            body, headers, stored_under = result_codec(keys)(invocation_id, b"{}", "[]")
            if altered:
                headers = base64.b64encode(os.urandom(48)).decode()
            await conn.execute(insert(results).values(
                invocation_id=invocation_id, stored_at=now, status=200, headers=headers, body=body,
                body_sha256="0" * 64, framing="complete", key_id=stored_under))
        else:
            stored_under, sealed = keys.encrypt(b"sk_old_secret", vault_aad("old", version))
            await conn.execute(insert(vault_secrets).values(name="old", version=version, key_id=stored_under,
                                                            ciphertext=spoil(sealed), created_at=now))


@pytest.mark.parametrize("kind", ["event", "result", "vault"])
def test_on_a_journal_from_before_the_checks_the_key_must_open_its_newest_rows_before_a_check_is_written(db, kind):
    right = os.urandom(32)

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, right, kind)
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k1", os.urandom(32))), by="the wrong file")
        nothing = await checks(engine)
        await check_keys(engine, ring(("k1", right)), by="the right file")
        return refused.value, nothing, await checks(engine)

    error, before, after = run(db, scenario)
    assert before == [], "the wrong file wrote no check"
    assert "opens none of the 1 row(s) stored under that same id that it tried" in str(error) and "'k1'" in str(error), str(error)
    assert [r["created_by"] for r in after] == ["the right file"]


def _use_key(broker, key_file: Path) -> None:
    broker.config["crypto"] = {"keys": [f"k1=file:{key_file}"]}
    broker.config_path.write_text(tomli_w.dumps(broker.config))


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_broker_or_secrets_set_with_another_key_file_behind_k1_is_refused_and_writes_nothing(make_broker, tmp_path, dialect):
    """A broker started with another file behind a listed id would have served, ready, writing
    records the others cannot read; `secrets set` would have stored a version the brokers
    cannot open. Both refuse, naming the id and who wrote its check; nothing is written; the
    right file still starts."""
    right, wrong = tmp_path / "right.key", tmp_path / "wrong.key"
    right.write_text(generate_key())
    wrong.write_text(generate_key())
    broker = make_broker(dialect, crypto={"keys": [f"k1=file:{right}"]})
    with broker.client("reviewer") as client:
        assert client.get("https://review.example.test/h/ok").status_code == 200
    broker.stop()
    url = broker.database_url
    before = rows(url)
    assert before["events"] > 0 and before["key_checks"] == 1

    _use_key(broker, wrong)
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path)], cwd=broker.workdir,
                          env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "affidavit: cannot start: the [crypto] key 'k1' configured here is not the key behind 'k1'" in done.stderr, done.stderr[-3000:]
    assert "wrote with it on" in done.stderr and "Nothing was started" in done.stderr and "Traceback" not in done.stderr
    assert "proxy listening on" not in done.stdout
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", broker.proxy_port)) != 0, "nothing is left listening"

    for value in (b"sk_wrong_file_" + os.urandom(8).hex().encode(), b""):  # refused before the value is read
        stored = broker.command("secrets", "set", "payments-key", input=value)
        assert stored.returncode == 2, stored.stderr
        assert b"the [crypto] key 'k1' configured here is not the key behind 'k1'" in stored.stderr
        assert stored.stderr.rstrip().endswith(b"nothing was stored"), stored.stderr
    assert rows(url) == before, "neither wrote anything"

    _use_key(broker, right)
    broker.start()
    with broker.client("reviewer") as client:
        assert client.get("https://review.example.test/h/ok").status_code == 200
    assert rows(url)["key_checks"] == 1


def rows(url: str) -> dict[str, int]:
    return {table: int(query(url, f"SELECT count(*) FROM {table}")[0][0])
            for table in ("invocations", "events", "results", "vault_secrets", "key_checks")}


def test_a_keyed_repeat_of_a_record_under_a_key_no_longer_listed_says_so_not_that_the_database_is_down(make_broker, upstream, tmp_path):
    """The journal answered; the record is under a key this broker does not have (it was dropped
    from [crypto] keys too early). The agent is told that, nothing is sent, and the log names the
    key to list again."""
    old, new = tmp_path / "old.key", tmp_path / "new.key"
    old.write_text(generate_key())
    new.write_text(generate_key())
    broker = make_broker("sqlite", crypto={"keys": [f"k1=file:{old}"]})
    key = "op-" + os.urandom(6).hex()
    with broker.client() as client:
        first = client.post("https://api.payments.test/h/ok", headers={"Idempotency-Key": key}, content=b"{}")
    assert first.status_code == 200, first.text
    broker.stop()
    broker.config["crypto"] = {"keys": [f"k2=file:{new}"]}
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    broker.start()
    sent = len(upstream.received)
    with broker.client() as client:
        repeat = client.post("https://api.payments.test/h/ok", headers={"Idempotency-Key": key}, content=b"{}")
    assert repeat.status_code == 503, repeat.text
    body = repeat.json()
    error = body["error"]
    assert (error["code"], error["outcome"], body["invocation_id"]) == ("JOURNAL_UNAVAILABLE", "not_attempted", None), body
    assert "did not answer" not in error["message"] and "encrypted under a key this broker no longer has" in error["message"]
    assert "with the same key, never a new one" in error["message"], error
    assert body["evidence"]["dispatch_started"] is False
    assert len(upstream.received) == sent, "nothing was sent"
    logged = broker.logs()
    assert "stored under key 'k1', which is not in [crypto] keys" in logged and "Put the key back" in logged, logged[-3000:]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_keys_list_shows_what_each_key_id_holds_and_whether_the_configured_key_is_the_one_behind_it(make_broker, tmp_path, dialect):
    """What an operator needs before dropping an old key (step 3 of a rotation): which ids rows are
    stored under, and whether a configuration's key files are the ones behind their ids."""
    k1, k2, wrong = tmp_path / "k1.key", tmp_path / "k2.key", tmp_path / "wrong.key"
    for file in (k1, k2, wrong):
        file.write_text(generate_key())
    broker = make_broker(dialect, crypto={"keys": [f"k1=file:{k1}"]})
    with broker.client("reviewer") as client:
        assert client.get("https://review.example.test/h/ok").status_code == 200
    broker.stop()

    def listing(*keys: str) -> subprocess.CompletedProcess[bytes]:
        broker.config["crypto"] = {"keys": list(keys)}
        broker.config_path.write_text(tomli_w.dumps(broker.config))
        return broker.command("keys", "list")

    rotated = listing(f"k2=file:{k2}", f"k1=file:{k1}")
    out = rotated.stdout.decode()
    assert rotated.returncode == 0, rotated.stderr
    assert "  k2: listed first, encrypts new rows; no key check yet" in out and "      no rows" in out, out
    k1_events = int(query(broker.database_url, "SELECT count(*) FROM events WHERE key_id = 'k1'")[0][0])
    assert k1_events > 0
    assert "  k1: listed, reads only; the key configured here opens its key check (written by broker " in out, out
    assert f"      {k1_events} event(s) (newest " in out and "1 result(s)" in out, out

    dropped = listing(f"k2=file:{k2}")
    assert dropped.returncode == 0, dropped.stderr
    assert f"  k1: NOT configured: what is stored under it ({k1_events} event(s)" in dropped.stdout.decode(), dropped.stdout

    mismatched = listing(f"k2=file:{k2}", f"k1=file:{wrong}")
    assert mismatched.returncode == 1, mismatched.stderr
    assert "  k1: listed, reads only; the key configured here is NOT the key behind 'k1'" in mismatched.stdout.decode()

    empty_old = listing(f"k1=file:{k1}", f"k2=file:{k2}")  # k2 listed but holding nothing
    assert "nothing in this journal is stored under 'k2': it can go from [crypto] keys" in empty_old.stdout.decode()
    for done in (rotated, dropped, mismatched, empty_old):
        for file in (k1, k2, wrong):
            assert file.read_text().strip().encode() not in done.stdout + done.stderr, "no key material is shown"


@pytest.mark.parametrize("kind", ["event", "result", "vault"])
def test_on_a_journal_from_before_the_checks_an_altered_newest_row_does_not_refuse_the_right_key(db, kind, caplog):
    """A row altered in the database opens with no key, so it proves nothing; an older one that
    opens proves the key. The altered one is logged. With none that opens, both causes are said."""
    right = os.urandom(32)

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, right, kind, version=1)
        await _rows_from_before_the_checks(engine, right, kind, version=2, altered=True)
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k1", os.urandom(32))), by="the wrong file")
        with caplog.at_level(logging.WARNING, logger="affidavit.keys"):
            await check_keys(engine, ring(("k1", right)), by="the right file")
        return refused.value, await checks(engine)

    error, rows = run(db, scenario)
    assert "opens none of the 2 row(s) stored under that same id that it tried" in str(error) and "or those rows were altered" in str(error), str(error)
    assert [r["created_by"] for r in rows] == ["the right file"]
    assert any("opens a row stored under it but not 1 tried before it" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_an_id_that_only_reads_is_bound_too_once_its_key_opens_what_is_stored_under_it(db):
    """A journal upgraded to the checks mid-rotation (keys = [k2, k1]): k1 encrypts nothing more,
    but another file behind it would read nothing the journal holds under it, so it is checked
    against those rows and then bound like the encrypting id."""
    k1, k2 = os.urandom(32), os.urandom(32)

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, k1, "event")
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k2", k2), ("k1", os.urandom(32))), by="a wrong k1")
        nothing = await checks(engine)
        await check_keys(engine, ring(("k2", k2), ("k1", k1)), by="the rotation")
        bound = await checks(engine)
        with pytest.raises(KeyMismatch) as later:
            await check_keys(engine, ring(("k2", k2), ("k1", os.urandom(32))), by="a wrong k1 later")
        return refused.value, nothing, bound, later.value

    refused, nothing, bound, later = run(db, scenario)
    assert "'k1'" in str(refused) and "opens none of the 1 row(s) stored under that same id that it tried" in str(refused), str(refused)
    assert nothing == [], "a refused start binds nothing"
    assert sorted(r["key_id"] for r in bound) == ["k1", "k2"]
    assert "does not open the key check that the rotation wrote" in str(later), str(later)


def test_keys_list_on_a_journal_from_before_the_checks_tries_the_key_on_the_stored_rows(db, tmp_path):
    """No check yet under 'k1', rows under it: `keys list` says whether the configured key opens
    them, as a broker's start would, and exits 1 if not."""
    right = os.urandom(32)
    run(db, lambda engine: _rows_from_before_the_checks(engine, right, "event"))
    outputs = []
    for material, status in ((os.urandom(32), 1), (right, 0)):
        key_file = tmp_path / "k1.key"
        key_file.write_text(base64.b64encode(material).decode())
        config = tmp_path / "affidavit.toml"
        config.write_text(tomli_w.dumps({"database": {"url": db}, "crypto": {"keys": [f"k1=file:{key_file}"]}}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
        done = subprocess.run([AFFIDAVIT, "keys", "list", "--config", str(config)], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == status, done.stdout + done.stderr
        outputs.append(done.stdout)
    assert "  k1: listed first, encrypts new rows; no key check yet, and the key configured here is NOT the key behind 'k1'" in outputs[0], outputs[0]
    assert "  k1: listed first, encrypts new rows; no key check yet; the key configured here opens what is stored under it" in outputs[1], outputs[1]
    assert run(db, checks) == [], "keys list writes nothing"


def test_rows_under_an_id_older_than_the_newest_invocations_are_still_found_and_tried(db, tmp_path):
    """A journal from before the checks whose rows under 'k1' are all older than the newest
    invocations looked at first (k1 listed first again after a rotation, say): another file behind
    'k1' was bound as if nothing were stored under it, and the right file then refused. The older
    rows are looked for, and `keys list` tries them too."""
    k1, k2 = os.urandom(32), os.urandom(32)

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, k1, "event")
        for n in range(keychecks._RECENT_INVOCATIONS + 2):  # newer invocations, all under k2
            await _rows_from_before_the_checks(engine, k2, "event", key_id="k2", version=n + 2)
        with pytest.raises(KeyMismatch) as refused:
            await check_keys(engine, ring(("k1", os.urandom(32)), ("k2", k2)), by="a rolled-back config, wrong k1")
        nothing = await checks(engine)
        await check_keys(engine, ring(("k1", k1), ("k2", k2)), by="the right files")
        return refused.value, nothing, await checks(engine)

    error, nothing, bound = run(db, scenario)
    assert "'k1'" in str(error) and "opens none of the 1 row(s) stored under that same id that it tried" in str(error), str(error)
    assert nothing == []
    assert sorted((r["key_id"], r["created_by"]) for r in bound) == [("k1", "the right files"), ("k2", "the right files")]


def test_an_id_without_rows_from_before_the_checks_is_bound_without_reading_the_tables_through(db, monkeypatch):
    """A new key (here on a journal that holds rows under another id): nothing can be stored under
    it, since every row stored since the checks began is under a bound id, so the look through all
    events and results (no index on their key id) is never made."""
    def no_full_read(*_args, **_kwargs):
        raise AssertionError("read the tables through for an id nothing can be stored under")

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, os.urandom(32), "event", key_id="k1")
        monkeypatch.setattr(keychecks, "_try_unbounded", no_full_read)
        k2 = os.urandom(32)
        await check_keys(engine, ring(("k2", k2)), by="a new key")
        await check_keys(engine, ring(("k2", k2)), by="a second start")
        return await checks(engine)

    assert [(r["key_id"], r["created_by"]) for r in run(db, scenario)] == [("k2", "a new key")]


def test_one_key_file_listed_under_a_new_id_and_an_old_one_is_refused_at_start(make_broker, tmp_path):
    """Both ids would be bound to one key for good, and a "rotation" onto the new one would change
    nothing while every listing said it had."""
    key = tmp_path / "k.key"
    key.write_text(generate_key())
    broker = make_broker("sqlite", crypto={"keys": [f"k1=file:{key}"]})
    broker.stop()
    broker.config["crypto"] = {"keys": [f"k2=file:{key}", f"k1=file:{key}"]}
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    done = subprocess.run([AFFIDAVIT, "run", "--config", str(broker.config_path)], cwd=broker.workdir,
                          env=broker._env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "affidavit: cannot start: [crypto] keys 'k2' and 'k1' are the same key" in done.stderr, done.stderr[-3000:]
    listing = broker.command("keys", "list")
    assert listing.returncode == 1 and b"  'k2' and 'k1' are the same key; brokers with this configuration will not start" in listing.stdout
    for out in (done.stdout + done.stderr, (listing.stdout + listing.stderr).decode()):
        assert key.read_text().strip() not in out
    assert query(broker.database_url, "SELECT key_id FROM key_checks") == [("k1",)], "k2 was not bound"


def test_two_ids_bound_to_one_key_before_are_only_warned_of(db, caplog):
    """Refusing them would leave no way to read what is stored under either."""
    same = os.urandom(32)

    async def scenario(engine):
        await check_keys(engine, ring(("k1", same)), by="one config")
        await check_keys(engine, ring(("k2", same)), by="another config")
        with caplog.at_level(logging.WARNING, logger="affidavit.keys"):
            await check_keys(engine, ring(("k2", same), ("k1", same)), by="both")
        with pytest.raises(KeyMismatch):
            await check_keys(engine, ring(("k3", same), ("k1", same)), by="a new id on the same key")
        return await checks(engine)

    rows = run(db, scenario)
    assert sorted(r["key_id"] for r in rows) == ["k1", "k2"]
    assert any("'k2' and 'k1' are the same key; both were in use with it before" in r.getMessage() for r in caplog.records)


def test_two_ids_with_rows_under_one_key_from_before_the_checks_are_only_warned_of_and_bound(db, caplog):
    """An id "renamed" by listing one file twice, before the checks: both hold rows the key opens."""
    same = os.urandom(32)

    async def scenario(engine):
        await _rows_from_before_the_checks(engine, same, "event", key_id="k1")
        await _rows_from_before_the_checks(engine, same, "result", key_id="k2")
        with caplog.at_level(logging.WARNING, logger="affidavit.keys"):
            await check_keys(engine, ring(("k2", same), ("k1", same)), by="the renamed id")
        return await checks(engine)

    assert sorted(r["key_id"] for r in run(db, scenario)) == ["k1", "k2"]
    assert any("are the same key; both were in use with it before" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_upgrade_to_key_checks_lists_the_ids_rows_are_stored_under(request, tmp_path, dialect):
    from proxy.store import migrate
    from tests.conftest import database_url

    url = database_url(dialect, tmp_path, request)
    migrate.upgrade(url, "0012")
    k1, k3 = os.urandom(32), os.urandom(32)

    async def before(engine):
        await _rows_from_before_the_checks(engine, k1, "event", key_id="k1", upgraded=False)
        await _rows_from_before_the_checks(engine, k3, "vault", key_id="k3", upgraded=False)

    run(url, before)
    migrate.upgrade(url)
    listed = sorted(r[0] for r in query(url, "SELECT key_id FROM key_ids_before_checks"))
    assert listed == ["k1", "k3"]


def test_keys_generate_refuses_an_id_the_journal_already_holds_though_the_configuration_no_longer_lists_it(db, tmp_path):
    """An id taken out of [crypto] keys after a rotation is still bound in the journal (or rows from
    before the checks are stored under it): a new key under it would be written, rolled out, and
    then refused at every broker's start. Refused before the file is written; a free id is not."""
    async def scenario(engine):
        await check_keys(engine, ring(("k1", os.urandom(32))), by="broker one")
        async with engine.begin() as conn:
            await conn.execute(insert(key_ids_before_checks).values(key_id="k0"))

    run(db, scenario)
    config = tmp_path / "affidavit.toml"
    config.write_text(tomli_w.dumps({"database": {"url": db}, "crypto": {"keys": ["k2=env:AFFIDAVIT_K2"]}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}

    def generate(key_id: str, config_path: Path = config) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AFFIDAVIT, "keys", "generate", "--id", key_id, "--out", str(tmp_path / f"{key_id}.key"),
                               "--config", str(config_path)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)

    bound, older, free = generate("k1"), generate("k0"), generate("k3")
    assert bound.returncode == 2, bound.stdout + bound.stderr
    assert "already has a key behind 'k1' (its key check was written by broker one on " in bound.stderr, bound.stderr
    assert "), though this configuration does not list it: brokers refuse another key under that id at start, and what " \
        "is stored under it stays readable only with its own key. Choose a new --id" in bound.stderr, bound.stderr
    assert "no key was written" in bound.stderr and not (tmp_path / "k1.key").exists()
    assert older.returncode == 2 and "(rows were stored under it before key checks began)" in older.stderr, older.stderr
    assert not (tmp_path / "k0.key").exists()
    assert free.returncode == 0 and (tmp_path / "k3.key").exists(), free.stderr
    assert "could not look" not in free.stderr and "keys = [" in free.stdout

    with socket.socket() as probe:  # a journal that cannot be read now: said, and the key is written
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    away = tmp_path / "away.toml"
    away.write_text(tomli_w.dumps({"database": {"url": f"postgresql+asyncpg://postgres@127.0.0.1:{port}/none"}}))
    done = generate("k1", away)
    assert done.returncode == 0 and (tmp_path / "k1.key").exists(), done.stderr
    assert "note: could not look in the journal" in done.stderr and "brokers will refuse this one at start" in done.stderr
