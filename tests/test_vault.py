"""The vault on both dialects: encrypted versions, the contract's codes, and a CLI that never leaks."""

from __future__ import annotations

import asyncio
import base64
import os
import pty
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from sqlalchemy import insert, select as sql_select
from typer.testing import CliRunner

from proxy import vault
from proxy.contract import Code
from proxy.credentials import CredentialUnavailable
from proxy.crypto import KeyRing, generate_key
from proxy.keychecks import KeyMismatch
from proxy.store.journal import on_engine
from proxy.store.vault_schema import vault_secrets
from tests.support.journal import dump_journal

KEY_ENV = "AFFIDAVIT_TEST_VAULT_KEY"


def canary() -> str:
    return "sk_vault_canary_" + secrets.token_hex(12)


def ring(material: bytes | None = None, key_id: str = "k1") -> KeyRing:
    return KeyRing([(key_id, material or os.urandom(32))])


def with_engine(url: str, work):
    return asyncio.run(on_engine(url, work))


def leaked(value: str, text: str) -> bool:
    """The value in any form a dump shows bytes: plain (SQLite files, text) or hex (PostgreSQL bytea)."""
    return value in text or value.encode().hex() in text.lower()


# -- the API -------------------------------------------------------------------------------------


def test_a_stored_secret_reads_back_and_never_appears_in_the_database(db):
    value = canary()
    keys = ring()

    async def scenario(engine):
        version = await vault.put(engine, keys, "payments-key", value)
        return version, await vault.latest(engine, keys, "payments-key")

    version, (read, read_version) = with_engine(db, scenario)
    assert version == read_version == "v1"
    assert read == value
    dump = dump_journal(db)
    assert "vault_secrets" in dump or "payments-key" in dump, "the dump must include the vault table"
    assert not leaked(value, dump)


def test_rotation_adds_a_version_and_latest_returns_it(db):
    keys = ring()
    first, second = canary(), canary()

    async def scenario(engine):
        v1 = await vault.put(engine, keys, "payments-key", first)
        v2 = await vault.rotate(engine, keys, "payments-key", second)
        return v1, v2, await vault.latest(engine, keys, "payments-key"), await vault.list_secrets(engine)

    v1, v2, (value, version), listing = with_engine(db, scenario)
    assert (v1, v2) == ("v1", "v2")
    assert (value, version) == (second, "v2")
    assert [v.version for v in listing["payments-key"]] == ["v1", "v2"]
    assert all(v.key_id == "k1" for v in listing["payments-key"])


def test_rotate_refuses_a_name_that_is_not_in_the_vault(db):
    keys = ring()

    async def scenario(engine):
        with pytest.raises(CredentialUnavailable) as caught:
            await vault.rotate(engine, keys, "typo-key", canary())
        return caught.value, await vault.list_secrets(engine)

    error, listing = with_engine(db, scenario)
    assert error.code is Code.CREDENTIAL_MISSING
    assert listing == {}


def test_without_keys_the_vault_is_locked(db):
    async def scenario(engine):
        with pytest.raises(CredentialUnavailable) as on_put:
            await vault.put(engine, KeyRing.empty(), "payments-key", canary())
        await vault.put(engine, ring(), "payments-key", canary())
        with pytest.raises(CredentialUnavailable) as on_read:
            await vault.latest(engine, KeyRing.empty(), "payments-key")
        return on_put.value, on_read.value, await vault.list_secrets(engine)

    on_put, on_read, listing = with_engine(db, scenario)
    assert on_put.code is Code.VAULT_LOCKED and on_read.code is Code.VAULT_LOCKED
    assert "[crypto] keys" in on_read.message
    assert [v.version for v in listing["payments-key"]] == ["v1"], "the locked put stored nothing"


def test_a_missing_secret_is_credential_missing(db):
    async def scenario(engine):
        with pytest.raises(CredentialUnavailable) as caught:
            await vault.latest(engine, ring(), "nothing-here", what="credential 'payments-key'")
        return caught.value

    error = with_engine(db, scenario)
    assert error.code is Code.CREDENTIAL_MISSING
    assert error.message.startswith("credential 'payments-key':")


def test_the_wrong_key_or_a_removed_key_is_a_decrypt_failure_that_never_shows_the_value(db):
    value = canary()
    material = os.urandom(32)

    async def scenario(engine):
        await vault.put(engine, ring(material), "payments-key", value)
        errors = []
        for keys in (ring(os.urandom(32)), ring(key_id="k2")):  # same id, other key; other id only
            with pytest.raises(CredentialUnavailable) as caught:
                await vault.latest(engine, keys, "payments-key")
            errors.append(caught.value)
        return errors

    wrong_material, unknown_id = with_engine(db, scenario)
    assert wrong_material.code is Code.CREDENTIAL_DECRYPT_FAILED
    assert unknown_id.code is Code.CREDENTIAL_DECRYPT_FAILED
    assert "'k1'" in unknown_id.message and "not in [crypto] keys" in unknown_id.message
    for error in (wrong_material, unknown_id):
        assert value not in error.message and "v1" in error.message


@pytest.mark.parametrize("verb", ["put", "rotate"])
def test_a_secret_is_not_stored_under_an_id_whose_key_file_is_another(db, verb):
    """Another key file behind the same id (a copied config, a regenerated file): what it stored no
    broker with the right file could read, and every credentialed route would refuse, while the
    command said "stored" and `secrets list` looked healthy. Refused, naming the id; nothing stored."""
    material = os.urandom(32)

    async def scenario(engine):
        await vault.put(engine, ring(material), "payments-key", canary())
        with pytest.raises(KeyMismatch) as caught:
            await getattr(vault, verb)(engine, ring(os.urandom(32)), "payments-key" if verb == "rotate" else "other",
                                       canary())
        await vault.put(engine, ring(material), "payments-key", canary())  # the right file still stores
        return caught.value, await vault.latest_version(engine, "payments-key"), await vault.latest_version(engine, "other")

    error, latest, other = with_engine(db, scenario)
    assert "'k1'" in str(error) and "another key file" in str(error) and "`affidavit secrets set` on" in str(error)
    assert (latest, other) == ("v2", None), "nothing was stored by the mismatched key"


def test_one_row_that_no_longer_opens_does_not_stop_the_right_key_from_storing(db):
    """An altered row under the key's id (here a forged newest version) opens with no key: the
    right key file may still store, so that `secrets rotate`, the fix vault.md gives for an altered
    row, works (the id's key check, written by the first put, is what the key is checked against;
    tests/test_keychecks.py has the journals from before the checks). Another key file is refused
    with both causes said."""
    material = os.urandom(32)

    async def scenario(engine):
        await vault.put(engine, ring(material), "payments-key", canary())
        async with engine.begin() as conn:
            stored = (await conn.execute(sql_select(vault_secrets).where(vault_secrets.c.name == "payments-key"))).mappings().one()
            await conn.execute(insert(vault_secrets).values({**stored, "version": stored["version"] + 1,
                                                             "ciphertext": os.urandom(len(stored["ciphertext"]))}))
        await vault.rotate(engine, ring(material), "payments-key", canary())
        with pytest.raises(KeyMismatch) as caught:
            await vault.put(engine, ring(os.urandom(32)), "other", canary())
        return await vault.latest_version(engine, "payments-key"), caught.value

    latest, error = with_engine(db, scenario)
    assert latest == "v3", "stored past the altered row"
    assert "another key file" in str(error) and "that check was altered" in str(error), str(error)


def test_a_ciphertext_copied_onto_another_secret_does_not_decrypt(db):
    keys = ring()

    async def scenario(engine):
        await vault.put(engine, keys, "admin-key", canary())
        async with engine.begin() as conn:
            stolen = (await conn.execute(sql_select(vault_secrets).where(vault_secrets.c.name == "admin-key"))).mappings().one()
            # An attacker with INSERT rights plants admin-key's ciphertext as a new secret.
            await conn.execute(insert(vault_secrets).values({**stolen, "name": "reader-key"}))
        with pytest.raises(CredentialUnavailable) as caught:
            await vault.latest(engine, keys, "reader-key")
        return caught.value

    assert with_engine(db, scenario).code is Code.CREDENTIAL_DECRYPT_FAILED


def test_concurrent_puts_get_distinct_versions(db):
    keys = ring()
    values = [canary() for _ in range(5)]

    async def scenario(engine):
        versions = await asyncio.gather(*(vault.put(engine, keys, "payments-key", v) for v in values))
        return versions, await vault.latest(engine, keys, "payments-key")

    versions, (value, version) = with_engine(db, scenario)
    assert sorted(versions, key=lambda v: int(v[1:])) == ["v1", "v2", "v3", "v4", "v5"]
    assert value == values[versions.index("v5")] and version == "v5"


# -- the command line ------------------------------------------------------------------------------

RUNNER = "import sys; from proxy.cli_security import {app}; {app}(prog_name='affidavit')"


def write_config(workdir: Path, url: str, keys: bool = True) -> Path:
    config = {"database": {"url": url}}
    if keys:
        config["crypto"] = {"keys": [f"k1=env:{KEY_ENV}"]}
    path = workdir / "affidavit.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def cli_env(key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    if key is not None:
        env[KEY_ENV] = key
    return env


def run_cli(app: str, *args: str, cwd: Path, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a real process: ``python -c '<app>()' ARGS`` with stdin a pipe, not a terminal."""
    return subprocess.run(
        [sys.executable, "-c", RUNNER.format(app=app), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
    )


@pytest.fixture
def cli(db: str, tmp_path: Path):
    workdir = tmp_path / "cli"
    workdir.mkdir()
    config = write_config(workdir, db)
    key = generate_key()
    keys = KeyRing([("k1", base64.b64decode(key))])
    return db, workdir, config, key, keys


def test_secrets_set_reads_stdin_prints_only_name_and_version_and_stores_ciphertext(cli):
    db, workdir, config, key, keys = cli
    first, second = canary(), canary()
    outputs = []
    for verb, value in (("set", first), ("rotate", second)):
        done = run_cli("secrets_app", verb, "payments-key", "-c", str(config), cwd=workdir, env=cli_env(key), stdin=value + "\n")
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout + done.stderr)
    listed = run_cli("secrets_app", "list", "-c", str(config), cwd=workdir, env=cli_env(key))
    assert listed.returncode == 0, listed.stderr
    assert outputs[0].strip() == "affidavit: stored payments-key v1"
    assert outputs[1].strip() == "affidavit: stored payments-key v2"
    assert "payments-key: v1 (key k1" in listed.stdout and "in use: v2" in listed.stdout
    value, version = with_engine(db, lambda engine: vault.latest(engine, keys, "payments-key"))
    assert (value, version) == (second, "v2"), "the trailing newline of stdin is not part of the value"
    dump = dump_journal(db)
    for secret in (first, second):
        assert not leaked(secret, dump)
        assert not any(secret in text for text in (*outputs, listed.stdout, listed.stderr))


def test_secrets_set_refuses_a_value_too_short_to_be_redacted(cli):
    db, workdir, config, key, keys = cli
    done = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(key), stdin="k7Q \n")
    assert done.returncode == 1 and "shorter than 4 characters" in done.stderr and "nothing was stored" in done.stderr
    assert "k7Q" not in done.stdout + done.stderr
    assert with_engine(db, vault.list_secrets) == {}


def test_secrets_set_refuses_a_value_that_is_not_utf8_without_showing_it(cli):
    db, workdir, config, key, keys = cli
    done = subprocess.run([sys.executable, "-c", RUNNER.format(app="secrets_app"), "set", "payments-key", "-c", str(config)],
                          input=b"caf\xe9-zqxjv9-\xff\n", capture_output=True, cwd=workdir, env=cli_env(key), timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 1 and "the value is not UTF-8 text (at byte 4 of 14)" in err and "nothing was stored" in err, err
    assert b"zqxjv9" not in done.stdout + done.stderr and "surrogates" not in err
    assert with_engine(db, vault.list_secrets) == {}


@pytest.mark.parametrize("argv", [["payments-key", "{value}"], ["payments-key", "--value={value}"], ["payments-key", "--value", "{value}"]])
def test_secrets_set_refuses_a_value_on_the_command_line_and_does_not_echo_it(cli, argv):
    db, workdir, config, key, keys = cli
    value = canary()
    args = [a.format(value=value) for a in argv]
    done = run_cli("secrets_app", "set", *args, "-c", str(config), cwd=workdir, env=cli_env(key), stdin=canary())
    assert done.returncode == 2
    assert "never taken from the command line" in done.stderr and "nothing was stored" in done.stderr
    assert value not in done.stdout + done.stderr
    assert with_engine(db, vault.list_secrets) == {}, "nothing may be stored, not even the stdin value"

    from proxy.cli_security import secrets_app

    result = CliRunner().invoke(secrets_app, ["set", *args, "-c", str(config)], input=canary(), env=cli_env(key))
    assert result.exit_code == 2 and value not in result.output
    assert with_engine(db, vault.list_secrets) == {}


def test_secrets_commands_without_keys_say_the_vault_is_locked(cli):
    db, workdir, _, key, _ = cli
    (workdir / "nokeys").mkdir()
    config = write_config(workdir / "nokeys", db, keys=False)
    value = canary()
    done = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(None), stdin=value)
    assert done.returncode == 1
    assert "VAULT_LOCKED" in done.stderr and "affidavit keys generate" in done.stderr
    assert value not in done.stdout + done.stderr
    assert with_engine(db, vault.list_secrets) == {}


def test_secrets_rotate_refuses_an_unknown_name_through_the_cli(cli):
    db, workdir, config, key, _ = cli
    done = run_cli("secrets_app", "rotate", "typo-key", "-c", str(config), cwd=workdir, env=cli_env(key), stdin=canary())
    assert done.returncode == 1 and "CREDENTIAL_MISSING" in done.stderr and "secrets set typo-key" in done.stderr
    assert with_engine(db, vault.list_secrets) == {}


def test_secrets_set_in_a_terminal_prompts_twice_without_echo(cli):
    db, workdir, config, key, keys = cli
    value = canary()
    argv = [sys.executable, "-c", RUNNER.format(app="secrets_app"), "set", "payments-key", "-c", str(config)]
    output, status = in_terminal(argv, cwd=workdir, env=cli_env(key), answers=[("Value", value), ("Repeat", value)])
    assert status == 0, output
    assert "stored payments-key v1" in output
    assert value not in output, "a hidden prompt must not echo the value"
    assert with_engine(db, lambda engine: vault.latest(engine, keys, "payments-key")) == (value, "v1")


def in_terminal(argv: list[str], *, cwd: Path, env: dict[str, str], answers: list[tuple[str, str]], timeout: float = 60) -> tuple[str, int]:
    """Run ``argv`` with a pseudo-terminal as its controlling terminal, answering prompts.

    An answer is typed only once the prompt ends in ": " (getpass writes that after turning
    echo off and before reading; typing earlier would be echoed, then flushed).
    """
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the command
        os.chdir(cwd)
        os.execve(argv[0], argv, env)
    output = b""
    pending = list(answers)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            last_line = output.rsplit(b"\n", 1)[-1]
            if pending and pending[0][0].encode() in last_line and last_line.endswith(b": "):
                os.write(fd, pending.pop(0)[1].encode() + b"\n")
                output += b"\n"
    finally:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:  # still waiting for input we never gave: stop it
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
        os.close(fd)
    return output.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def test_secrets_list_where_there_is_no_journal_says_so_and_creates_none(tmp_path: Path):
    """A read, like every other: run in the wrong directory it must not leave an empty journal
    behind (after which the other commands would advise `db upgrade` there)."""
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}")
    done = run_cli("secrets_app", "list", "-c", str(config), cwd=workdir, env=cli_env(generate_key()))
    assert done.returncode == 1 and f"no journal at {workdir / 'journal.db'}" in done.stderr, done.stderr
    assert not (workdir / "journal.db").exists()


def test_secrets_set_on_a_new_sqlite_journal_creates_it_as_the_broker_would(tmp_path: Path):
    """The vault lives in the journal; on the embedded default a fresh directory has none yet."""
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}")
    key = generate_key()
    done = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(key), stdin=canary())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "affidavit: stored payments-key v1"
    # Said: run from the wrong directory (a relative database.url), no broker would see the secret.
    assert f"there was no journal at {workdir / 'journal.db'}, so a new one was made there" in done.stderr, done.stderr
    listed = run_cli("secrets_app", "list", "-c", str(config), cwd=workdir, env=cli_env(key))
    assert "payments-key: v1" in listed.stdout, listed.stderr
    again = run_cli("secrets_app", "rotate", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(key), stdin=canary())
    assert again.returncode == 0 and "no journal" not in again.stderr, again.stderr


def test_secrets_set_under_another_key_file_says_so_not_that_the_journal_failed(tmp_path: Path):
    """The vault's own refusal (exit 2, what to do about the key) must not come out as "the
    journal could not be written ... check that it names the broker's journal" (exit 1)."""
    workdir = tmp_path / "keys"
    workdir.mkdir()
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}")
    first = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(generate_key()),
                    stdin=canary())
    assert first.returncode == 0, first.stderr
    other = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(generate_key()),
                    stdin=canary())
    assert other.returncode == 2 and "another key file" in other.stderr and "nothing was stored" in other.stderr, other.stderr
    assert "could not be written" not in other.stderr, other.stderr


def test_secrets_set_on_a_file_that_is_no_journal_says_it_is_damaged_not_locked(tmp_path: Path):
    """The advice was the one for a locked file ("check that no other process holds it locked")."""
    workdir = tmp_path / "garbage"
    workdir.mkdir()
    (workdir / "journal.db").write_bytes(b"not a database, " * 512)
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}")
    value = canary()
    done = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(generate_key()),
                   stdin=value)
    assert done.returncode == 1, done.stderr
    assert "its storage is damaged" in done.stderr and "restore the journal from a backup" in done.stderr
    assert "locked" not in done.stderr and value not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize("verb", ["set", "rotate"])
def test_an_invalid_secret_name_is_a_usage_error_before_any_value_is_read(tmp_path: Path, verb):
    """Refused from the arguments alone: not after a value was piped in or typed twice, and before
    the journal is touched (a new SQLite one would have been created for nothing)."""
    workdir = tmp_path / "usage"
    workdir.mkdir()
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}")
    env = cli_env(generate_key())
    for stdin in ("", canary()):
        done = run_cli("secrets_app", verb, "bad name!", "-c", str(config), cwd=workdir, env=env, stdin=stdin)
        assert done.returncode == 2, done.stderr
        assert "a secret name is 1-100 characters" in done.stderr and "nothing was stored" in done.stderr, done.stderr
        assert "no value was given" not in done.stderr, done.stderr
    argv = [sys.executable, "-c", RUNNER.format(app="secrets_app"), verb, "bad name!", "-c", str(config)]
    output, status = in_terminal(argv, cwd=workdir, env=env, answers=[], timeout=20)
    assert status == 2 and "Value" not in output, output
    assert not (workdir / "journal.db").exists()


@pytest.mark.parametrize(("verb", "keys", "key", "status", "said"), [
    ("set", False, None, 1, "VAULT_LOCKED"),  # no [crypto] keys
    ("set", True, "not base64!", 2, "k1"),  # a key that cannot be used
    ("rotate", True, None, 1, "CREDENTIAL_MISSING"),  # nothing of that name to rotate
])
def test_secrets_set_and_rotate_refuse_before_asking_for_the_value(tmp_path: Path, verb, keys, key, status, said):
    """In a terminal the value is typed twice: not for a store that was going to be refused."""
    workdir = tmp_path / "early"
    workdir.mkdir()
    config = write_config(workdir, f"sqlite+aiosqlite:///{workdir / 'journal.db'}", keys=keys)
    env = cli_env(key if key is not None else generate_key())
    argv = [sys.executable, "-c", RUNNER.format(app="secrets_app"), verb, "payments-key", "-c", str(config)]
    output, exit_status = in_terminal(argv, cwd=workdir, env=env, answers=[], timeout=30)
    assert exit_status == status and said in output and "Value" not in output, output


def test_secrets_set_with_the_database_down_says_nothing_was_stored_and_to_run_it_again(tmp_path: Path):
    """The broker's start-up words ("Nothing was started ... start again") are not this command's."""
    from tests.support.broker import free_port

    workdir = tmp_path / "down"
    workdir.mkdir()
    config = write_config(workdir, f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nowhere")
    value = canary()
    done = run_cli("secrets_app", "set", "payments-key", "-c", str(config), cwd=workdir, env=cli_env(generate_key()),
                   stdin=value)
    assert done.returncode == 1, done.stderr
    assert ("Nothing was stored; nothing accepts connections at its host and port; check that the database is up"
            in done.stderr and "run the command again" in done.stderr), done.stderr
    assert "started" not in done.stderr and "start again" not in done.stderr and ".;" not in done.stderr, done.stderr
    assert value not in done.stdout + done.stderr
