"""The key ring: AES-256-GCM from ``cryptography``, keys from [crypto] keys, AAD binding, codecs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from proxy.config import CryptoSection
from proxy.crypto import (
    AuthenticationFailed,
    KeyRing,
    KeyRingError,
    UnknownKeyId,
    decode_key,
    event_aad,
    generate_key,
    payload_codec,
    payload_decoder,
    result_codec,
    result_decoder,
)


def ring(*ids: str) -> KeyRing:
    return KeyRing([(key_id, os.urandom(32)) for key_id in ids])


def test_a_round_trip_uses_the_first_key_and_a_fresh_nonce_every_time():
    keys = ring("k2", "k1")
    first = keys.encrypt(b"hello", b"here")
    second = keys.encrypt(b"hello", b"here")
    assert first[0] == second[0] == "k2"
    assert first[1][:12] != second[1][:12], "a nonce must never repeat under one key"
    assert first[1] != second[1]
    assert b"hello" not in first[1]
    assert len(first[1]) == 12 + len(b"hello") + 16
    assert keys.decrypt(*first, b"here") == b"hello"


def test_every_listed_key_decrypts_so_rotation_keeps_old_ciphertext_readable():
    old = KeyRing([("k1", b"\x01" * 32)])
    key_id, blob = old.encrypt(b"secret", b"aad")
    rotated = KeyRing([("k2", b"\x02" * 32), ("k1", b"\x01" * 32)])
    assert rotated.decrypt(key_id, blob, b"aad") == b"secret"
    assert rotated.encrypt(b"x", b"aad")[0] == "k2"


def test_a_ciphertext_moved_to_another_place_fails_authentication():
    keys = ring("k1")
    key_id, blob = keys.encrypt(b"payload", event_aad("act_1", 3))
    with pytest.raises(AuthenticationFailed):
        keys.decrypt(key_id, blob, event_aad("act_1", 4))
    with pytest.raises(AuthenticationFailed):
        keys.decrypt(key_id, blob, event_aad("act_2", 3))


def test_a_flipped_bit_or_a_truncated_blob_fails_authentication():
    keys = ring("k1")
    key_id, blob = keys.encrypt(b"payload", b"aad")
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with pytest.raises(AuthenticationFailed):
        keys.decrypt(key_id, bytes(flipped), b"aad")
    with pytest.raises(AuthenticationFailed):
        keys.decrypt(key_id, blob[:20], b"aad")


def test_the_same_id_with_other_key_material_fails_authentication():
    key_id, blob = KeyRing([("k1", b"\x01" * 32)]).encrypt(b"payload", b"aad")
    with pytest.raises(AuthenticationFailed):
        KeyRing([("k1", b"\x03" * 32)]).decrypt(key_id, blob, b"aad")


def test_an_unknown_key_id_is_its_own_error_and_names_the_id():
    key_id, blob = ring("k1").encrypt(b"payload", b"aad")
    with pytest.raises(UnknownKeyId, match="'k1'"):
        ring("k2").decrypt(key_id, blob, b"aad")
    with pytest.raises(UnknownKeyId):
        KeyRing.empty().decrypt(key_id, blob, b"aad")
    with pytest.raises(UnknownKeyId):
        KeyRing.empty().encrypt(b"x", b"aad")


def test_keys_load_from_env_and_file_in_standard_or_urlsafe_base64(tmp_path, monkeypatch):
    raw_env, raw_file = os.urandom(32), b"\xfb\xff" * 16  # the file key has '-' / '_' in urlsafe form
    monkeypatch.setenv("AFFIDAVIT_TEST_KEY", base64.b64encode(raw_env).decode())
    path = tmp_path / "k2.key"
    path.write_text(base64.urlsafe_b64encode(raw_file).decode().rstrip("=") + "\n")
    keys = KeyRing.from_settings(CryptoSection(keys=["k1=env:AFFIDAVIT_TEST_KEY", f"k2=file:{path}"]))
    assert keys.key_ids == ["k1", "k2"] and keys.encrypting_key_id == "k1"
    assert KeyRing([("k1", raw_env)]).decrypt(*keys.encrypt(b"m", b"a"), b"a") == b"m"
    k2_id, blob = KeyRing([("k2", raw_file)]).encrypt(b"m", b"a")
    assert keys.decrypt(k2_id, blob, b"a") == b"m"


@pytest.mark.parametrize(
    ("material", "complaint"),
    [
        (base64.b64encode(os.urandom(16)).decode(), "16 bytes"),
        ("not base64 at all!!", "not base64"),
    ],
    ids=["short-key", "not-base64"],  # fixed ids: parallel workers must collect the same tests
)
def test_a_bad_key_is_a_config_error_naming_id_and_source_never_the_key(monkeypatch, material, complaint):
    monkeypatch.setenv("AFFIDAVIT_BAD_KEY", material)
    with pytest.raises(KeyRingError) as caught:
        KeyRing.from_settings(CryptoSection(keys=["kbad=env:AFFIDAVIT_BAD_KEY"]))
    message = str(caught.value)
    assert "kbad" in message and "env:AFFIDAVIT_BAD_KEY" in message and complaint in message
    assert material not in message


def test_a_missing_key_source_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.delenv("AFFIDAVIT_NO_SUCH_KEY", raising=False)
    with pytest.raises(KeyRingError, match="k1.*AFFIDAVIT_NO_SUCH_KEY"):
        KeyRing.from_settings(CryptoSection(keys=["k1=env:AFFIDAVIT_NO_SUCH_KEY"]))
    with pytest.raises(KeyRingError, match="k9"):
        KeyRing.from_settings(CryptoSection(keys=[f"k9=file:{tmp_path / 'absent.key'}"]))


def test_no_keys_means_an_empty_ring():
    keys = KeyRing.from_settings(CryptoSection())
    assert not keys.enabled and keys.encrypting_key_id is None


def test_generated_keys_are_32_random_bytes_and_repr_never_shows_material():
    a, b = generate_key(), generate_key()
    assert a != b
    assert len(decode_key(a, what="k")) == 32
    material = os.urandom(32)
    keys = KeyRing([("k1", material)])
    assert "k1" in repr(keys)
    for form in (material.hex(), base64.b64encode(material).decode(), repr(material)):
        assert form not in repr(keys)


def test_the_payload_codec_is_plain_json_without_keys_and_ciphertext_with_them():
    data = {"status": 201, "b": "x", "a": [1, 2]}
    plain, key_id = payload_codec(KeyRing.empty())("act_1", 1, data)
    assert key_id is None
    assert plain == b'{"a":[1,2],"b":"x","status":201}', "turning encryption off must store what the journal stores today"
    assert payload_decoder(KeyRing.empty())(plain, None, "act_1", 1) == data

    keys = ring("k1")
    blob, key_id = payload_codec(keys)("act_1", 5, data)
    assert key_id == "k1" and b"status" not in blob
    assert payload_decoder(keys)(blob, key_id, "act_1", 5) == data
    with pytest.raises(AuthenticationFailed):
        payload_decoder(keys)(blob, key_id, "act_1", 6)


def test_the_result_codec_encrypts_body_and_headers_bound_to_the_invocation():
    headers = json.dumps([["Content-Type", "application/json"], ["X-Charge", "ch_123"]])
    body = b'{"id": "ch_123"}'
    keys = ring("k1")
    stored_body, stored_headers, key_id = result_codec(keys)("act_1", body, headers)
    assert key_id == "k1"
    assert b"ch_123" not in stored_body and "ch_123" not in stored_headers
    assert result_decoder(keys)("act_1", stored_body, stored_headers, key_id) == (body, headers)
    with pytest.raises(AuthenticationFailed):
        result_decoder(keys)("act_2", stored_body, stored_headers, key_id)
    # Body and headers are bound apart: swapping them is caught too.
    swapped = base64.b64encode(stored_body).decode()
    with pytest.raises(AuthenticationFailed):
        result_decoder(keys)("act_1", stored_body, swapped, key_id)

    assert result_codec(KeyRing.empty())("act_1", body, headers) == (body, headers, None)
    assert result_decoder(KeyRing.empty())("act_1", body, headers, None) == (body, headers)


# -- affidavit keys generate -------------------------------------------------------------------------


def test_keys_generate_writes_a_private_key_file_and_prints_only_how_to_reference_it(tmp_path):
    config = tmp_path / "affidavit.toml"
    config.write_text('[crypto]\nkeys = ["k1=env:AFFIDAVIT_OLD_KEY"]\n')
    out = tmp_path / "keys" / "k2.key"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    runner = "from proxy.cli_security import keys_app; keys_app(prog_name='affidavit')"
    done = subprocess.run(
        [sys.executable, "-c", runner, "generate", "--id", "k2", "--out", str(out), "-c", str(config)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    key = out.read_text().strip()
    assert len(base64.b64decode(key)) == 32
    assert key not in done.stdout + done.stderr
    assert base64.b64decode(key).hex() not in done.stdout + done.stderr
    assert f'keys = ["k2=file:{out}", "k1=env:AFFIDAVIT_OLD_KEY"]' in done.stdout
    loaded = KeyRing.from_settings(CryptoSection(keys=[f"k2=file:{out}"]))
    assert loaded.key_ids == ["k2"]

    again = subprocess.run(
        [sys.executable, "-c", runner, "generate", "--id", "k2", "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert out.read_text().strip() == key
    listed = subprocess.run(  # an id the configuration already lists, to another file
        [sys.executable, "-c", runner, "generate", "--id", "k1", "--out", str(tmp_path / "k1b.key"), "-c", str(config)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert listed.returncode == 2 and "already lists a key 'k1'" in listed.stderr, listed.stderr
    assert not (tmp_path / "k1b.key").exists() and "keys = [" not in listed.stdout

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bare = subprocess.run(  # no configuration file here: said, as every command says it
        [sys.executable, "-c", runner, "generate", "--id", "k3", "--out", str(elsewhere / "k3.key")],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60,
    )
    assert bare.returncode == 0 and "no --config and no affidavit.toml" in bare.stderr, bare.stderr


def test_keys_generate_refuses_an_invalid_configuration_and_makes_missing_directories_private(tmp_path):
    """It reads the configuration for the keys already listed: an invalid one is exit 2, as for
    every command that reads it, and no key is written; parents it has to make are 0700."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[proxy]\nlisten = "nope"\n[bogus]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    runner = "from proxy.cli_security import keys_app; keys_app(prog_name='affidavit')"
    out = tmp_path / "a" / "b" / "k.key"
    done = subprocess.run([sys.executable, "-c", runner, "generate", "--id", "kk", "--out", str(out), "-c", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 2 and "proxy.listen" in done.stderr and "no key was written" in done.stderr, done.stderr
    assert not (tmp_path / "a").exists()
    done = subprocess.run([sys.executable, "-c", runner, "generate", "--id", "kk", "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / p).stat().st_mode & 0o777 for p in ("a", "a/b")] == [0o700, 0o700]
    assert out.stat().st_mode & 0o777 == 0o600


def test_keys_generate_refuses_an_id_the_configuration_would_reject(tmp_path):
    from proxy.cli_security import keys_app

    result = CliRunner().invoke(keys_app, ["generate", "--id", "bad id!", "--out", str(tmp_path / "k.key")])
    assert result.exit_code == 2
    assert not (tmp_path / "k.key").exists()
