"""Encryption at rest, end to end: a real broker with [crypto] keys, a vault credential, a
response body that must not rest in plaintext, and an audit chain that verifies without keys."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest

from proxy.crypto import generate_key
from tests.support.broker import AFFIDAVIT, BrokerProcess
from tests.support.envelopes import check_envelope
from tests.support.hostile import HostileUpstream
from tests.support.journal import dump_journal, query

VAULT_CANARY = "vk_canary_" + secrets.token_hex(12)


def vault_routes(up: HostileUpstream) -> list[dict]:
    return [
        {"name": "vaulted", "host": "vaulted.example.test", "methods": ["GET", "POST"], "agents": ["builder"],
         "connect_to": f"127.0.0.1:{up.tls_port('good')}", "credential": "vaulted-key",
         "inject": {"header": "Authorization", "value": "Bearer {secret}"}},
    ]


def start_with_keys(make_broker, upstream: HostileUpstream, dialect: str, tmp_path: Path, keys: bool) -> BrokerProcess:
    key_file = tmp_path / f"k1-{dialect}.key"
    key_file.write_text(generate_key())
    crypto = {"keys": [f"k1=file:{key_file}"]} if keys else {"keys": []}
    broker = make_broker(dialect, routes=vault_routes(upstream), start=False, crypto=crypto)
    broker.config["secrets"].append({"name": "vaulted-key", "from": "vault:vaulted-key"})
    broker.config_path.write_text(__import__("tomli_w").dumps(broker.config))
    if dialect == "postgresql":
        assert broker.command("db", "upgrade").returncode == 0
    else:
        from proxy.store import migrate

        migrate.upgrade(broker.database_url)
    if keys:
        stored = broker.command("secrets", "set", "vaulted-key", input=VAULT_CANARY.encode())
        assert stored.returncode == 0, stored.stderr
        assert VAULT_CANARY.encode() not in stored.stdout + stored.stderr
    return broker.start()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_results_and_payloads_rest_encrypted_and_the_vault_secret_never_appears(make_broker, upstream, tmp_path, dialect):
    broker = start_with_keys(make_broker, upstream, dialect, tmp_path, keys=True)
    body_canary = "body_canary_" + secrets.token_hex(10)
    with broker.client() as client:
        response = client.get("https://vaulted.example.test/h/ok", headers={"X-Canary": body_canary})
    assert response.status_code == 200
    assert upstream.received[0].header("Authorization") == f"Bearer {VAULT_CANARY}"
    assert body_canary in response.text, "the agent gets the real body"
    invocation_id = response.headers["affidavit-invocation-id"]
    record = broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    assert record["credential"]["id"] == "vaulted-key" and record["credential"]["version"] == "v1"
    with broker.api() as api:
        replay = api.get(f"/v1/invocations/{invocation_id}/result")
    assert replay.status_code == 200 and body_canary in replay.text, "the side API decrypts"
    key_ids = query(broker.database_url, "SELECT DISTINCT key_id FROM events")
    assert key_ids == [("k1",)], "every payload is encrypted with the configured key"
    assert query(broker.database_url, "SELECT key_id FROM results") == [("k1",)]
    broker.stop()
    dump = dump_journal(broker.database_url)
    for canary in (body_canary, VAULT_CANARY):
        assert canary not in dump and canary.encode().hex() not in dump
    assert "VAULT" not in broker.logs() and VAULT_CANARY not in broker.logs() and body_canary not in broker.logs()
    # The chain covers the ciphertext: it verifies without any key, and the writer left checkpoints.
    assert int(query(broker.database_url, "SELECT count(*) FROM chain_checkpoints")[0][0]) >= 1
    verify = broker.command("audit", "verify", "--database", broker.database_url)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_without_keys_the_same_body_is_visible_in_the_database(make_broker, upstream, tmp_path):
    """The control: it shows the test above can see a plaintext body when one is there."""
    broker = make_broker("sqlite", routes=[{**vault_routes(upstream)[0], "credential": "payments-key"}])
    body_canary = "body_canary_" + secrets.token_hex(10)
    with broker.client() as client:
        assert client.get("https://vaulted.example.test/h/ok", headers={"X-Canary": body_canary}).status_code == 200
    broker.stop()
    assert body_canary in dump_journal(broker.database_url)


def test_a_vault_credential_without_keys_is_vault_locked(make_broker, upstream, tmp_path):
    broker = start_with_keys(make_broker, upstream, "sqlite", tmp_path, keys=False)
    with broker.client() as client:
        refused = client.get("https://vaulted.example.test/h/ok")
    assert refused.status_code == 503
    body = refused.json()
    assert (body["error"]["code"], body["error"]["phase"], body["error"]["outcome"]) == (
        "VAULT_LOCKED", "credential_injection", "not_attempted")
    assert upstream.received == []


def test_records_under_a_dropped_key_get_clear_answers_not_bare_500s(make_broker, upstream, tmp_path):
    """The operator removes the old key too early: the side API and a same-key repeat say what is
    wrong (the key), and nothing is sent."""
    broker = start_with_keys(make_broker, upstream, "sqlite", tmp_path, keys=True)
    key = "dropped-" + secrets.token_hex(4)
    with broker.client() as client:
        first = client.post("https://vaulted.example.test/h/ok", content=b"{}", headers={"Idempotency-Key": key})
    assert first.status_code == 200
    invocation_id = first.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    broker.stop()
    other = tmp_path / "k2.key"
    other.write_text(generate_key())
    broker.config["crypto"] = {"keys": [f"k2=file:{other}"]}
    broker.config_path.write_text(__import__("tomli_w").dumps(broker.config))
    broker.start()
    with broker.operator() as api:
        for path in (f"/v1/invocations/{invocation_id}", f"/v1/invocations/{invocation_id}/result"):
            answer = api.get(path)
            assert answer.status_code == 500 and answer.headers["content-type"] == "application/problem+json", answer.text
            assert "stored under key 'k1'" in answer.json()["detail"] and "[crypto] keys" in answer.json()["detail"]
    for args in (("invocations", "show", invocation_id), ("invocations", "result", invocation_id)):
        shown = broker.command(*args)
        err = shown.stderr.decode()
        assert shown.returncode == 1 and "stored under key 'k1'" in err and "back in [crypto] keys" in err, (args, err)
        assert "database.url" not in err, "the journal answered: the database is not what to check"
    impostor = tmp_path / "k1-impostor.key"  # the same id, another key: the bytes do not authenticate
    impostor.write_text(generate_key())
    config = {**broker.config, "crypto": {"keys": [f"k1=file:{impostor}"]}}
    (tmp_path / "impostor.toml").write_text(__import__("tomli_w").dumps(config))
    shown = subprocess.run([AFFIDAVIT, "invocations", "show", invocation_id, "-c", str(tmp_path / "impostor.toml")],
                           cwd=broker.workdir, env=broker._env(), capture_output=True, timeout=60)
    err = shown.stderr.decode()
    assert shown.returncode == 1 and "altered or moved, or the key behind that id" in err and "audit verify" in err, err
    assert "back in [crypto] keys" not in err
    elsewhere = {**broker.config, "crypto": {"keys": [f"k2=file:{other}", f"k1=file:{tmp_path / 'not-on-this-host.key'}"]}}
    (tmp_path / "elsewhere.toml").write_text(__import__("tomli_w").dumps(elsewhere))
    shown = subprocess.run([AFFIDAVIT, "invocations", "show", invocation_id, "-c", str(tmp_path / "elsewhere.toml")],
                           cwd=broker.workdir, env=broker._env(), capture_output=True, timeout=60)
    err = shown.stderr.decode()
    assert shown.returncode == 1 and "note: [crypto] key 'k1'" in err, err  # the key file is on another host
    assert "stored under key 'k1', which is listed in [crypto] keys but cannot be read here" in err, err
    assert "Run the command where the brokers' key files" in err and "back in [crypto] keys" not in err, err
    sent = len(upstream.received)
    with broker.client() as client:
        again = client.post("https://vaulted.example.test/h/ok", content=b"{}", headers={"Idempotency-Key": key})
    body = check_envelope(again.content)
    assert (again.status_code, body["error"]["code"], body["error"]["outcome"]) == (503, "JOURNAL_UNAVAILABLE", "not_attempted")
    assert "encrypted under a key" in body["error"]["message"]
    assert len(upstream.received) == sent, "nothing was sent"
    assert "Traceback" not in broker.logs()


def test_a_record_under_a_removed_key_holds_up_the_recovery_of_no_other(make_broker, upstream, tmp_path):
    """A record left in flight under a key later removed from [crypto] keys cannot be read, so
    recovery cannot close it; the error aborted the whole sweep, at every sweep, and the records
    after it (under the key still listed) stayed "in flight, caller waiting" as well. Now that one
    is named in the log with what to do, and the others are closed."""
    import tomli_w

    from tests.test_crash import _post_in_background, _record_for

    keys = {}
    for name in ("k1", "k2"):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_text(generate_key())
    routes = [{"name": "slow", "host": "slow.example.test", "methods": ["POST"], "agents": ["builder"],
               "connect_to": f"127.0.0.1:{upstream.tls_port('good')}"}]
    broker = make_broker("sqlite", routes=routes, crypto={"keys": [f"k1=file:{keys['k1']}"]})

    def left_in_flight(marker: str) -> str:
        pending = _post_in_background(broker, f"https://slow.example.test/h/slow?delay=8&n={marker}")
        invocation_id = _record_for(broker, marker)
        broker.wait_for(invocation_id, lambda r: r["stage"] == "sent", timeout=10)
        broker.kill()
        pending.exception(timeout=20)
        return invocation_id

    under_k1 = left_in_flight("under-k1")
    broker.config["crypto"] = {"keys": [f"k2=file:{keys['k2']}"]}
    broker.config_path.write_text(tomli_w.dumps(broker.config))
    broker.start()
    under_k2 = left_in_flight("under-k2")
    broker.start()
    deadline = time.monotonic() + 15
    while query(broker.database_url, f"SELECT stage FROM invocations WHERE invocation_id = '{under_k2}'") != [("ended_unknown",)]:
        assert time.monotonic() < deadline, broker.logs()[-3000:]
        time.sleep(0.2)
    assert query(broker.database_url, f"SELECT stage FROM invocations WHERE invocation_id = '{under_k1}'") == [("sent",)]
    logs = broker.logs()
    assert f"invocation {under_k1} was left in flight by " in logs and "stored under key 'k1'" in logs, logs[-3000:]
    assert "Put the key it was stored under back in [crypto] keys and restart the broker" in logs
    assert "recovery sweep failed" not in logs


def test_a_vault_that_cannot_be_read_is_a_credential_failure_and_the_record_ends(make_broker, upstream, tmp_path):
    """The vault's table could not be read (a role without SELECT on it; here, renamed under the
    broker): the error escaped the attempt, the agent got a 500 "unknown, reconcile" for a
    request never sent, and its record stayed "validated, caller waiting" while the broker ran.
    It is a credential that cannot be had: CREDENTIAL_MISSING, not attempted, the record ended."""
    broker = start_with_keys(make_broker, upstream, "postgresql", tmp_path, keys=True)
    query(broker.database_url, "ALTER TABLE vault_secrets RENAME TO vault_secrets_moved")
    try:
        with broker.client() as client:
            answer = client.get("https://vaulted.example.test/h/ok")
    finally:
        query(broker.database_url, "ALTER TABLE vault_secrets_moved RENAME TO vault_secrets")
    body = check_envelope(answer.content)
    assert (answer.status_code, body["error"]["code"], body["error"]["phase"], body["error"]["outcome"]) == (
        502, "CREDENTIAL_MISSING", "credential_injection", "not_attempted"), answer.text
    record = broker.wait_for(body["invocation_id"], lambda r: r["stage"] == "ended_not_attempted")
    assert record["caller_disposition"] == "completed", record
    assert upstream.received == [], "nothing was sent"
    assert "the vault could not be read" in broker.logs() and VAULT_CANARY not in broker.logs()


def test_a_key_file_not_readable_here_does_not_stop_commands_from_showing_what_is_stored_without_it(make_broker, upstream, tmp_path):
    """An operator's host without the brokers' key file: `invocations show`/`result` of a record
    stored unencrypted still work (with a note), as `invocations list` and `metrics` do. Before,
    both refused with exit 2 whatever the record."""
    broker = make_broker("sqlite")
    with broker.client() as client:
        ok = client.get("https://api.payments.test/h/ok")
    assert ok.status_code == 200, ok.text
    invocation_id = ok.headers["affidavit-invocation-id"]
    broker.wait_for(invocation_id, lambda r: r["stage"] == "delivered")
    config = {**broker.config, "crypto": {"keys": [f"k1=file:{tmp_path / 'on-the-brokers-host.key'}"]}}
    (tmp_path / "reader.toml").write_text(__import__("tomli_w").dumps(config))
    for args in (("invocations", "show", invocation_id), ("invocations", "result", invocation_id)):
        done = subprocess.run([AFFIDAVIT, *args, "-c", str(tmp_path / "reader.toml")], cwd=broker.workdir,
                              env=broker._env(), capture_output=True, timeout=60)
        err = done.stderr.decode()
        assert done.returncode == 0, (args, err)
        assert "note: [crypto] key 'k1' (file:" in err and "records stored under that key cannot be shown here" in err, err
    assert invocation_id.encode() in subprocess.run(
        [AFFIDAVIT, "invocations", "show", invocation_id, "-c", str(tmp_path / "reader.toml")], cwd=broker.workdir,
        env=broker._env(), capture_output=True, timeout=60).stdout
