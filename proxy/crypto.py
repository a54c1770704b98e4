"""The key ring: AES-256-GCM (from ``cryptography``) for event payloads, results and the vault.

Keys come from ``[crypto] keys``; the first one encrypts, every listed one decrypts, so a key is
rotated by putting a new one first and keeping the old one until nothing stored needs it.

Every ciphertext is bound to its place by the associated data (AAD): an event payload to its
``(invocation_id, seq)``, a result to its ``invocation_id``, a vault secret to ``(name,
version)``. A ciphertext copied into another row then fails authentication instead of being
read as that row's data. Nothing here ever prints, logs or ``repr``s key material.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
from collections.abc import Callable
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .config import ConfigError, CryptoSection
from .credentials import CredentialUnavailable, read_source

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


class KeyRingError(ConfigError):
    """A configured key cannot be loaded; the message names the key id and source, never the key."""


class DecryptError(Exception):
    """A ciphertext cannot be opened with this ring."""


class UnknownKeyId(DecryptError):
    """The ciphertext names a key id that is not in ``[crypto] keys`` (removed, or never there)."""


class KeyNotReadableHere(UnknownKeyId):
    """The ciphertext's key id is listed, but its key could not be read here (a command run on
    a host without the brokers' key file, say)."""


class AuthenticationFailed(DecryptError):
    """The key is known but the ciphertext, its AAD or the key behind that id does not match."""


def generate_key() -> str:
    """A fresh 256-bit key, base64 (the form ``[crypto] keys`` sources hold)."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode("ascii")


def decode_key(text: str, *, what: str) -> bytes:
    """32 bytes from standard or URL-safe base64 (padding optional). ``what`` names the key."""
    compact = "".join(text.split())
    compact += "=" * (-len(compact) % 4)
    for altchars in (None, b"-_"):
        try:
            raw = base64.b64decode(compact, altchars=altchars, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) != KEY_BYTES:
            raise KeyRingError(
                f"{what} decodes to {len(raw)} bytes; AES-256-GCM needs {KEY_BYTES}. "
                "Create one with `affidavit keys generate`."
            )
        return raw
    raise KeyRingError(f"{what} is not base64; create a key with `affidavit keys generate`.")


def _read_key(key_id: str, source: str) -> bytes:
    what = f"[crypto] key '{key_id}' ({source})"
    try:
        text, _version = read_source(source, what=what)
    except CredentialUnavailable as exc:
        raise KeyRingError(exc.message) from None
    return decode_key(text, what=what)


class KeyRing:
    """Named AES-GCM keys; the first encrypts. An empty ring means encryption is off."""

    def __init__(self, keys: list[tuple[str, bytes]], *, unreadable: dict[str, str] | None = None):
        self._unreadable = dict(unreadable or {})  # listed, but not readable here: id -> why
        self._ids = [key_id for key_id, _ in keys]
        self._keys = {key_id: AESGCM(material) for key_id, material in keys}
        if len(self._keys) != len(self._ids):
            raise KeyRingError("a key id is listed twice in [crypto] keys")
        self._twins = [(a, b) for n, (a, one) in enumerate(keys) for b, other in keys[n + 1:]
                       if hmac.compare_digest(one, other)]

    @classmethod
    def empty(cls) -> KeyRing:
        return cls([])

    @classmethod
    def from_settings(cls, crypto: CryptoSection) -> KeyRing:
        """Read every ``ID=env:NAME`` / ``ID=file:/path`` source now, so a bad key fails at start."""
        return cls([(key_id, _read_key(key_id, source)) for key_id, source in crypto.entries()])

    @classmethod
    def for_reading(cls, crypto: CryptoSection) -> tuple[KeyRing, dict[str, str]]:
        """For a command that only reads: the keys that can be read here, and why each other one
        cannot (id -> message). Rows under a readable key, or under none, can still be shown;
        one under an unreadable key raises :class:`KeyNotReadableHere` when it is opened."""
        keys, unreadable = [], {}
        for key_id, source in crypto.entries():
            try:
                keys.append((key_id, _read_key(key_id, source)))
            except KeyRingError as exc:
                unreadable[key_id] = str(exc)
        return cls(keys, unreadable=unreadable), unreadable

    @property
    def enabled(self) -> bool:
        return bool(self._ids)

    @property
    def key_ids(self) -> list[str]:
        return list(self._ids)

    def twins(self) -> list[tuple[str, str]]:
        """Pairs of ids listed with the same key material."""
        return list(self._twins)

    @property
    def encrypting_key_id(self) -> str | None:
        return self._ids[0] if self._ids else None

    def __repr__(self) -> str:
        return f"KeyRing(key_ids={self._ids!r})"

    def encrypt(self, plaintext: bytes, aad: bytes, *, key_id: str | None = None) -> tuple[str, bytes]:
        """(key id, nonce || ciphertext+tag) under the first key (or ``key_id``'s), with a fresh
        random nonce."""
        if not self._ids:
            raise UnknownKeyId("no [crypto] keys are configured; nothing can be encrypted")
        key_id = key_id or self._ids[0]
        if key_id not in self._keys:
            raise UnknownKeyId(f"no key '{key_id}' in [crypto] keys")
        nonce = os.urandom(NONCE_BYTES)
        return key_id, nonce + self._keys[key_id].encrypt(nonce, plaintext, aad)

    def decrypt(self, key_id: str, blob: bytes, aad: bytes) -> bytes:
        key = self._keys.get(key_id)
        if key is None and key_id in self._unreadable:
            raise KeyNotReadableHere(f"stored under key '{key_id}', which is listed in [crypto] keys but cannot be read "
                                     f"here: {self._unreadable[key_id]}")
        if key is None:
            listed = ", ".join(self._ids) or "none"
            raise UnknownKeyId(f"stored under key '{key_id}', which is not in [crypto] keys (listed: {listed})")
        blob = bytes(blob)
        if len(blob) < NONCE_BYTES + TAG_BYTES:
            raise AuthenticationFailed(f"the ciphertext under key '{key_id}' is truncated")
        try:
            return key.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
        except InvalidTag:
            raise AuthenticationFailed(
                f"key '{key_id}' does not open this ciphertext: the key behind that id changed, "
                "or the stored bytes were altered or moved from another row"
            ) from None


# -- where a ciphertext belongs (AAD) ---------------------------------------------------------


def _aad(*parts: Any) -> bytes:
    """An unambiguous encoding: a JSON list, so ("a", "b:c") and ("a:b", "c") never collide."""
    return json.dumps(["affidavit", *parts], separators=(",", ":")).encode()


def event_aad(invocation_id: str, seq: int) -> bytes:
    return _aad("event", invocation_id, int(seq))


def result_aad(invocation_id: str, part: str) -> bytes:
    return _aad("result", part, invocation_id)


def vault_aad(name: str, version: int) -> bytes:
    return _aad("vault", name, int(version))


def key_check_aad(key_id: str) -> bytes:
    return _aad("key-check", key_id)


# -- codecs the journal plugs in ---------------------------------------------------------------

PayloadCodec = Callable[[str, int, dict[str, Any]], tuple[bytes, str | None]]
PayloadDecoder = Callable[[bytes, str | None, str, int], dict[str, Any]]
ResultCodec = Callable[[str, bytes, str], tuple[bytes, str, str | None]]
ResultDecoder = Callable[[str, bytes, str, str | None], tuple[bytes, str]]


def _json(data: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON with sorted keys (orjson: this runs for every event on the hot path)."""
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)


def payload_codec(ring: KeyRing) -> PayloadCodec:
    """``(invocation_id, seq, data) -> (stored payload, key_id)``: JSON, encrypted if the ring has keys."""

    def encode(invocation_id: str, seq: int, data: dict[str, Any]) -> tuple[bytes, str | None]:
        plain = _json(data)
        if not ring.enabled:
            return plain, None
        key_id, blob = ring.encrypt(plain, event_aad(invocation_id, seq))
        return blob, key_id

    return encode


def payload_decoder(ring: KeyRing) -> PayloadDecoder:
    """``(stored payload, key_id, invocation_id, seq) -> data``; raises :class:`DecryptError`."""

    def decode(payload: bytes, key_id: str | None, invocation_id: str, seq: int) -> dict[str, Any]:
        plain = bytes(payload) if key_id is None else ring.decrypt(key_id, payload, event_aad(invocation_id, seq))
        return json.loads(plain)

    return decode


def result_codec(ring: KeyRing) -> ResultCodec:
    """``(invocation_id, body, headers_json) -> (stored body, stored headers, key_id)``.

    ``results.headers`` is a text column, so encrypted headers are stored as base64 of the blob.
    """

    def encode(invocation_id: str, body: bytes, headers: str) -> tuple[bytes, str, str | None]:
        if not ring.enabled:
            return body, headers, None
        key_id, body_blob = ring.encrypt(body, result_aad(invocation_id, "body"))
        _, header_blob = ring.encrypt(headers.encode(), result_aad(invocation_id, "headers"))
        return body_blob, base64.b64encode(header_blob).decode("ascii"), key_id

    return encode


def result_decoder(ring: KeyRing) -> ResultDecoder:
    """``(invocation_id, stored body, stored headers, key_id) -> (body, headers_json)``."""

    def decode(invocation_id: str, body: bytes, headers: str, key_id: str | None) -> tuple[bytes, str]:
        if key_id is None:
            return bytes(body), headers
        plain_body = ring.decrypt(key_id, body, result_aad(invocation_id, "body"))
        plain_headers = ring.decrypt(key_id, base64.b64decode(headers), result_aad(invocation_id, "headers"))
        return plain_body, plain_headers.decode()

    return decode
