"""Whether the key behind each [crypto] key id is the one the journal's rows under that id use.

A key id is only a name in the configuration; the key itself is a file or an environment
variable on each host. Another key file behind the same id (a copied config, a regenerated key)
would encrypt new rows that no broker with the right file can read, while everything looked
healthy. So each id has a key check (``key_checks``): a known text sealed with the id's key by the
first broker or command that encrypted under it. :func:`check_keys` runs before a broker serves
and before ``secrets set``/``rotate`` store: it opens the check of every listed id that has one;
an id without one gets it once its key opens one of the newest rows already stored under it (a
journal from before the checks existed), and the encrypting id gets it even with none stored.
:func:`key_usage` is what ``affidavit keys list`` shows.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .crypto import AuthenticationFailed, KeyRing, event_aad, key_check_aad, result_aad, vault_aad
from .store.queries import DATABASE_ERRORS, causes
from .store.reading import reading
from .store.schema import events, invocations, results
from .store.vault_schema import key_checks, vault_secrets

log = logging.getLogger("affidavit.keys")

#: What a key check seals: a known text (AES-GCM authenticates it; its secrecy does not matter).
CHECK_TEXT = b"affidavit key check"
#: How many of the newest stored rows of each kind are tried when an id has no check yet.
_ROWS_TRIED = 20
#: Among how many of the newest invocations their events and results are looked for.
_RECENT_INVOCATIONS = 50


class KeyMismatch(ValueError):
    """The key configured under an id is not the one the journal's rows under that id were
    encrypted with (another key file behind the same id), or those rows were altered."""


@dataclass(frozen=True, slots=True)
class _Sealed:
    """A ciphertext stored under a key id and what it is bound to (``what`` names it for people)."""

    what: str
    blob: bytes
    aad: bytes


@dataclass(slots=True)
class Tried:
    """What trying a key on the newest rows stored under its id found: whether one opened, and
    which of those tried before it did not."""

    opened: bool = False
    failed: list[str] = field(default_factory=list)
    #: Rows beyond the newest invocations' were looked for too (None: that look timed out).
    everywhere: bool | None = False

    @property
    def nothing_stored(self) -> bool:
        """No row under the id at all (the whole journal was looked through)."""
        return self.everywhere is True and not self.failed and not self.opened

    @property
    def refuted(self) -> bool:
        """Rows are stored under the id and none opens: another key, or every one altered."""
        return bool(self.failed) and not self.opened


async def check_keys(engine: AsyncEngine, ring: KeyRing, *, by: str) -> None:
    """Raise :class:`KeyMismatch` if a listed key is not the one behind its id in this journal;
    otherwise make sure the encrypting id has a key check, and every other listed id with rows
    under it too (``by`` is recorded as who wrote it). Database errors are raised as they come."""
    if not ring.enabled:
        return
    async with reading(engine) as conn:  # on SQLite a plain connection would take the write lock
        checks = {row["key_id"]: row for row in (
            await conn.execute(select(key_checks).where(key_checks.c.key_id.in_(ring.key_ids)))
        ).mappings()}
    for row in checks.values():
        _open_check(ring, row)
    verdicts: dict[str, Tried] = {}
    for key_id in ring.key_ids:  # all tried before any check is written: a refused start binds nothing
        if key_id not in checks:
            async with reading(engine) as conn:
                verdicts[key_id] = tried = await try_stored(conn, ring, key_id, bounded=True)
            if tried.refuted:
                raise _refuted(key_id, tried.failed)
    for key_id, tried in verdicts.items():
        if tried.everywhere is None:
            log.warning("[crypto] key '%s' has no key check, and no row is stored under it among the %d newest "
                        "invocations or the vault; the look through older events and results did not finish in time, "
                        "so its key check is written without comparing this key with them. `affidavit keys list` "
                        "compares without a time limit", key_id, _RECENT_INVOCATIONS)
        if tried.failed:
            log.warning("[crypto] key '%s' opens the newest rows stored under it but not %d tried before them (%s): "
                        "they were altered, or written by a broker with another key file behind '%s'; its key check "
                        "is written now, binding the id to this key", key_id, len(tried.failed), _shown(tried.failed),
                        key_id)
        await _write_check(engine, ring, key_id, by)  # it opened a row, or there is none to open


async def _write_check(engine: AsyncEngine, ring: KeyRing, key_id: str, by: str) -> None:
    _, sealed = ring.encrypt(CHECK_TEXT, key_check_aad(key_id), key_id=key_id)
    try:
        async with engine.begin() as conn:
            await conn.execute(key_checks.insert().values(
                key_id=key_id, sealed=sealed, created_at=datetime.now(UTC), created_by=by[:200]))
    except IntegrityError:
        # Another broker or command wrote it first (workers starting together): open theirs.
        async with reading(engine) as conn:
            row = (await conn.execute(select(key_checks).where(key_checks.c.key_id == key_id))).mappings().one()
        _open_check(ring, row)


def opens_check(ring: KeyRing, row: Any) -> bool:
    """Whether ``ring``'s key under the check row's id opens it (False for another key or an
    altered row; :class:`~proxy.crypto.UnknownKeyId` if the ring has no such id)."""
    key_id = row["key_id"]
    try:
        return ring.decrypt(key_id, row["sealed"], key_check_aad(key_id)) == CHECK_TEXT
    except AuthenticationFailed:
        return False


_LOST_KEY = ("if that key file is lost, take '{key_id}' out of [crypto] keys and list a new key first under a new "
             "id (`affidavit keys generate`), on every broker before any of them stores under it: what is stored "
             "under '{key_id}' stays unreadable")


def _open_check(ring: KeyRing, row: Any) -> None:
    key_id = row["key_id"]
    if opens_check(ring, row):
        return
    raise KeyMismatch(
        f"the [crypto] key '{key_id}' configured here is not the key behind '{key_id}' in this journal: it does not "
        f"open the key check that {row['created_by']} wrote with it on {row['created_at']:%Y-%m-%d %H:%M:%S} UTC. "
        f"Either this is another key file than the one the brokers encrypt with under '{key_id}' (what it stored "
        f"they could not read, and it cannot read theirs): configure the key file the other brokers use for "
        f"'{key_id}' ({_LOST_KEY.format(key_id=key_id)}); or, if every broker has this very file, that check was "
        f"altered in the database (docs/vault.md, 'Key checks')"
    )


def _refuted(key_id: str, failed: list[str]) -> KeyMismatch:
    return KeyMismatch(
        f"the [crypto] key '{key_id}' configured here opens none of the {len(failed)} newest row(s) stored under that "
        f"same id ({_shown(failed)}). Either this is another key file than the one they were encrypted with (then "
        f"what it stored no broker with the right file could read: configure the key file the brokers use for "
        f"'{key_id}'; {_LOST_KEY.format(key_id=key_id)}), or those rows were altered in the database (then no key "
        f"opens them: take '{key_id}' out of [crypto] keys, list a new key first, made with `affidavit keys "
        f"generate`, and store the secrets again under it)"
    )


def _shown(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


async def try_stored(conn: AsyncConnection, ring: KeyRing, key_id: str, *, bounded: bool = False) -> Tried:
    """Try ``ring``'s key under ``key_id`` on the newest rows stored under that id, until one
    opens: events of the newest invocations, then vault versions, then results (their headers:
    a body may be large). One that does not open is not enough to refuse (it may have been
    altered): any one that opens shows the key is the right one.

    Only when none of those is under the id are older events and results looked for: ``events``
    has no index on ``key_id``, so that look reads until it finds some, or the whole table when
    there are none (once per id: the id is bound after). ``bounded``: a look that runs out of the
    connection's statement time is given up (``everywhere`` None) rather than raised."""
    tried = Tried()
    for recent_only in (True, False):
        try:
            async with aclosing(_stored_under(conn, key_id, recent_only=recent_only)) as stored:
                async for item in stored:
                    try:
                        ring.decrypt(key_id, item.blob, item.aad)
                    except AuthenticationFailed:
                        tried.failed.append(item.what)
                        continue
                    tried.opened = True
                    return tried
        except DATABASE_ERRORS as exc:
            if recent_only or not bounded or not _timed_out(exc):
                raise
            tried.everywhere = None
            return tried
        if tried.failed:
            return tried
    tried.everywhere = True
    return tried


def _timed_out(exc: BaseException) -> bool:
    return any(isinstance(error, (TimeoutError, asyncio.TimeoutError)) or getattr(error, "sqlstate", None) == "57014"
               for error in causes(exc))


async def _stored_under(conn: AsyncConnection, key_id: str, *, recent_only: bool) -> AsyncIterator[_Sealed]:
    """Ciphertexts under ``key_id``: of the newest invocations and the vault (``recent_only``), or
    any events and results at all (the rest)."""
    i, e, r_, v = invocations.c, events.c, results.c, vault_secrets.c
    if recent_only:
        recent = select(i.invocation_id, i.created_at).order_by(i.created_at.desc()).limit(_RECENT_INVOCATIONS).subquery()
        newest_first = (recent.c.created_at.desc(), recent.c.invocation_id)
        event_rows = (select(e.invocation_id, e.seq, e.payload).join(recent, recent.c.invocation_id == e.invocation_id)
                      .where(e.key_id == key_id).order_by(*newest_first, e.seq.desc()))
        result_rows = (select(r_.invocation_id, r_.headers).join(recent, recent.c.invocation_id == r_.invocation_id)
                       .where(r_.key_id == key_id).order_by(*newest_first))
    else:
        event_rows = select(e.invocation_id, e.seq, e.payload).where(e.key_id == key_id)
        result_rows = select(r_.invocation_id, r_.headers).where(r_.key_id == key_id)
    for row in (await conn.execute(event_rows.limit(_ROWS_TRIED))).mappings().all():
        yield _Sealed(f"event {row['invocation_id']} #{row['seq']}", bytes(row["payload"]),
                      event_aad(row["invocation_id"], row["seq"]))
    if recent_only:
        for row in (await conn.execute(select(vault_secrets).where(v.key_id == key_id)
                                       .order_by(v.created_at.desc(), v.version.desc()).limit(_ROWS_TRIED))).mappings().all():
            yield _Sealed(f"vault '{row['name']}' v{row['version']}", bytes(row["ciphertext"]),
                          vault_aad(row["name"], row["version"]))
    for row in (await conn.execute(result_rows.limit(_ROWS_TRIED))).mappings().all():
        yield _Sealed(f"result of {row['invocation_id']}", _headers_blob(row["headers"]),
                      result_aad(row["invocation_id"], "headers"))


def _headers_blob(stored: str) -> bytes:
    try:
        return base64.b64decode(stored, validate=True)
    except ValueError:
        return b""  # altered: opens with no key


@dataclass(slots=True)
class KeyUse:
    """What the journal holds under one key id (None: stored unencrypted)."""

    key_id: str | None
    events: int = 0
    newest_event: datetime | None = None
    results: int = 0
    newest_result: datetime | None = None
    vault_versions: int = 0
    vault_in_use: int = 0
    check: dict[str, Any] | None = None

    @property
    def empty(self) -> bool:
        return not (self.events or self.results or self.vault_versions)


async def key_usage(engine: AsyncEngine) -> dict[str | None, KeyUse]:
    """Per key id, how many events, results and vault versions are stored under it, and its key
    check. Reads every event and result (a full scan of each: no index on ``key_id``)."""
    uses: dict[str | None, KeyUse] = {}

    def use(key_id: str | None) -> KeyUse:
        return uses.setdefault(key_id, KeyUse(key_id))

    e, r, v = events.c, results.c, vault_secrets.c
    async with reading(engine) as conn:
        for key_id, count, newest in await conn.execute(select(e.key_id, func.count(), func.max(e.at)).group_by(e.key_id)):
            use(key_id).events, use(key_id).newest_event = int(count), newest
        for key_id, count, newest in await conn.execute(select(r.key_id, func.count(), func.max(r.stored_at)).group_by(r.key_id)):
            use(key_id).results, use(key_id).newest_result = int(count), newest
        for key_id, count in await conn.execute(select(v.key_id, func.count()).group_by(v.key_id)):
            use(key_id).vault_versions = int(count)
        newest_versions = select(v.name, func.max(v.version).label("version")).group_by(v.name).subquery()
        in_use = (select(v.key_id, func.count())
                  .join(newest_versions, (v.name == newest_versions.c.name) & (v.version == newest_versions.c.version))
                  .group_by(v.key_id))
        for key_id, count in await conn.execute(in_use):
            use(key_id).vault_in_use = int(count)
        for row in (await conn.execute(select(key_checks))).mappings():
            use(row["key_id"]).check = dict(row)
    return uses
