"""The vault: secrets stored in the journal database, encrypted with the key ring.

A secret has a name and numbered versions (1, 2, 3... shown as ``v1``, ``v2``...); storing a
value adds a version and never overwrites one (the table is append-only), so the version an
invocation recorded always names the value it used. The newest version is the one in use.
Values are AES-GCM ciphertext bound to (name, version): a ciphertext copied onto another name or
version fails to decrypt instead of handing out the wrong secret.

Errors are :class:`~proxy.credentials.CredentialUnavailable` with the contract's codes:
``VAULT_LOCKED`` (no key configured), ``CREDENTIAL_MISSING`` (no such secret),
``CREDENTIAL_DECRYPT_FAILED`` (the key is missing from the ring or does not open the value).
Messages name the secret, the version and the key id, never the value.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from .contract import Code
from .credentials import CredentialUnavailable
from .crypto import AuthenticationFailed, KeyRing, UnknownKeyId, vault_aad
from .keychecks import check_keys
from .store import queries
from .store.journal import brief
from .store.reading import reading
from .store.vault_schema import vault_secrets

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_PUT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class SecretVersion:
    """What may be shown about a stored version: never its value."""

    version: str
    key_id: str
    created_at: datetime


def label(version: int) -> str:
    """The non-secret version id recorded per invocation and printed by the CLI."""
    return f"v{version}"


def check_name(name: str) -> None:
    """Refuse (ValueError) a name no secret can have, before anything else is asked or done."""
    if not NAME.match(name):
        raise ValueError("a secret name is 1-100 characters of letters, digits, '_', '.' or '-'")


def check_unlocked(ring: KeyRing, name: str) -> None:
    """Refuse (VAULT_LOCKED) to store ``name`` without a key to encrypt it."""
    if not ring.enabled:
        raise _locked(f"secret '{name}'")


def nothing_to_rotate(name: str) -> CredentialUnavailable:
    return CredentialUnavailable(
        Code.CREDENTIAL_MISSING,
        f"secret '{name}' is not in the vault, so there is nothing to rotate; store it first with `affidavit secrets set {name}`",
    )


def _locked(what: str) -> CredentialUnavailable:
    return CredentialUnavailable(
        Code.VAULT_LOCKED,
        f"{what}: the vault is locked because no [crypto] keys are configured; "
        "create one with `affidavit keys generate` and list it in [crypto] keys",
    )


async def put(engine: AsyncEngine, ring: KeyRing, name: str, value: str) -> str:
    """Store ``value`` as the next version of ``name`` (creating it); returns the version label."""
    return await _store(engine, ring, name, value, must_exist=False)


async def rotate(engine: AsyncEngine, ring: KeyRing, name: str, value: str) -> str:
    """Like :func:`put`, but only for a name that already has a version (catches typos)."""
    return await _store(engine, ring, name, value, must_exist=True)


async def _store(engine: AsyncEngine, ring: KeyRing, name: str, value: str, *, must_exist: bool) -> str:
    check_name(name)
    check_unlocked(ring, name)
    if not value:
        raise ValueError("an empty value cannot be stored")
    await check_keys(engine, ring, by=stored_by("rotate" if must_exist else "set"))
    v = vault_secrets.c
    for _ in range(_PUT_ATTEMPTS):
        try:
            async with engine.begin() as conn:
                current = (await conn.execute(select(func.max(v.version)).where(v.name == name))).scalar()
                if current is None and must_exist:
                    raise nothing_to_rotate(name)
                version = (current or 0) + 1
                key_id, blob = ring.encrypt(value.encode(), vault_aad(name, version))
                await conn.execute(
                    insert(vault_secrets).values(
                        name=name, version=version, key_id=key_id, ciphertext=blob, created_at=datetime.now(UTC)
                    )
                )
            return label(version)
        except IntegrityError:
            continue  # another writer took this version number first; read the new maximum
    raise RuntimeError(f"secret '{name}': {_PUT_ATTEMPTS} concurrent writers raced for the next version; try again")


def stored_by(verb: str) -> str:
    """Who wrote a key check from a ``secrets`` command, as the check records it."""
    return f"`affidavit secrets {verb}` on {socket.gethostname()}"


async def latest_version(engine: AsyncEngine, name: str) -> str | None:
    """The label of the newest version of ``name`` (no decryption, no key needed), or None."""
    v = vault_secrets.c
    async with reading(engine) as conn:
        version = (await conn.execute(select(func.max(v.version)).where(v.name == name))).scalar()
    return label(version) if version is not None else None


async def latest(engine: AsyncEngine, ring: KeyRing, name: str, *, what: str | None = None) -> tuple[str, str]:
    """(value, version label) of the newest version of ``name``.

    ``what`` prefixes messages (e.g. "credential 'payments-key'"), as in
    :func:`proxy.credentials.read_source`.
    """
    what = what or f"secret '{name}'"
    if not ring.enabled:
        raise _locked(what)
    v = vault_secrets.c
    try:
        async with reading(engine) as conn:
            row = (
                await conn.execute(select(vault_secrets).where(v.name == name).order_by(v.version.desc()).limit(1))
            ).mappings().first()
    except queries.DATABASE_ERRORS as exc:
        # Before anything is sent: the attempt ends not attempted, never as an internal error that
        # cannot say whether it was sent (a role without SELECT on the vault, or the database away).
        raise CredentialUnavailable(
            Code.CREDENTIAL_MISSING,
            f"{what}: the vault could not be read ({brief(exc)}); check the database and that the broker's role may "
            "read vault_secrets",
        ) from None
    if row is None:
        raise CredentialUnavailable(
            Code.CREDENTIAL_MISSING,
            f"{what}: the vault has no secret '{name}'; store it with `affidavit secrets set {name}`",
        )
    version = label(row["version"])
    try:
        plain = ring.decrypt(row["key_id"], row["ciphertext"], vault_aad(name, row["version"]))
    except UnknownKeyId:
        raise CredentialUnavailable(
            Code.CREDENTIAL_DECRYPT_FAILED,
            f"{what}: '{name}' {version} is encrypted with key '{row['key_id']}', which is not in [crypto] keys; "
            f"list that key again, or store a new version with `affidavit secrets rotate {name}`",
        ) from None
    except AuthenticationFailed:
        raise CredentialUnavailable(
            Code.CREDENTIAL_DECRYPT_FAILED,
            f"{what}: key '{row['key_id']}' does not open '{name}' {version}: the key material behind that id "
            "is not the one the value was stored with, or the stored row was altered; check the key's source",
        ) from None
    return plain.decode(), version


async def list_secrets(engine: AsyncEngine) -> dict[str, list[SecretVersion]]:
    """Every name with its versions, oldest first. Reads no ciphertext."""
    v = vault_secrets.c
    query = select(v.name, v.version, v.key_id, v.created_at).order_by(v.name, v.version)
    out: dict[str, list[SecretVersion]] = {}
    async with reading(engine) as conn:
        for name, version, key_id, created_at in await conn.execute(query):
            out.setdefault(name, []).append(SecretVersion(label(version), key_id, created_at))
    return out
