"""Whether the key behind each [crypto] key id is the one the journal's rows under that id use.

A key id is only a name in the configuration; the key itself is a file or an environment
variable on each host. Another key file behind the same id (a copied config, a regenerated key)
would encrypt new rows that no broker with the right file can read, while everything looked
healthy. So each id has a key check (``key_checks``): a known text sealed with the id's key by the
first broker or command that used the id. :func:`check_keys` runs before a broker serves and
before ``secrets set``/``rotate`` store: it opens the check of every listed id that has one, and
binds every other listed id to its key, once that key opens one of the rows already stored under
the id (a journal from before the checks existed, migration 0013), or at once when nothing is.
:func:`key_usage` is what ``affidavit keys list`` shows."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .crypto import AuthenticationFailed, KeyRing, event_aad, key_check_aad, result_aad, vault_aad
from .store.journal import on_engine
from .store.reading import reading
from .store.schema import events, invocations, results
from .store.vault_schema import key_checks, key_ids_before_checks, vault_secrets

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
    """What trying a key on rows stored under its id found: whether one opened, and which of
    those tried before it did not."""

    opened: bool = False
    failed: list[str] = field(default_factory=list)

    @property
    def refuted(self) -> bool:
        """Rows are stored under the id and none of those tried opens: another key, or every one
        altered."""
        return bool(self.failed) and not self.opened


async def check_keys(engine: AsyncEngine, ring: KeyRing, *, by: str, write: bool = True) -> None:
    """Raise :class:`KeyMismatch` if a listed key is not the one behind its id in this journal;
    otherwise (``write``) bind every listed id that has no key check yet to its key (``by`` is
    recorded as who did). Without ``write`` it only checks. Database errors are raised as they come."""
    if not ring.enabled:
        return
    async with reading(engine) as conn:  # on SQLite a plain connection would take the write lock
        checks = {row["key_id"]: row for row in (
            await conn.execute(select(key_checks).where(key_checks.c.key_id.in_(ring.key_ids)))
        ).mappings()}
        older = set((await conn.execute(select(key_ids_before_checks.c.key_id).where(
            key_ids_before_checks.c.key_id.in_(ring.key_ids)))).scalars())
    for row in checks.values():
        _open_check(ring, row)
    verdicts: dict[str, Tried] = {}
    for key_id in ring.key_ids:  # all tried before any check is written: a refused start binds nothing
        if key_id not in checks:
            verdicts[key_id] = tried = await try_stored(engine, ring, key_id, older=key_id in older)
            if tried.refuted:
                raise _refuted(key_id, tried.failed)
    _same_key_for_a_new_id(ring, in_use(checks, verdicts))
    if not write:
        return
    for key_id, tried in verdicts.items():
        if tried.failed:
            log.warning("[crypto] key '%s' opens a row stored under it but not %d tried before it (%s): they were "
                        "altered, or written by a broker with another key file behind '%s'; its key check is written "
                        "now, binding the id to this key", key_id, len(tried.failed), _shown(tried.failed), key_id)
        await _write_check(engine, ring, key_id, by)  # it opened a row, or there is none to open


async def taken(engine: AsyncEngine, key_id: str) -> str | None:
    """Why ``key_id`` already stands for a key in this journal (its key check, or rows stored under
    it before checks existed), said for a message; None when the id is free. Another key under a
    taken id is refused at every broker's start, so ``keys generate`` asks this before it writes."""
    async with reading(engine) as conn:
        check = (await conn.execute(select(key_checks.c.created_by, key_checks.c.created_at)
                                    .where(key_checks.c.key_id == key_id))).first()
        older = (await conn.execute(select(key_ids_before_checks.c.key_id)
                                    .where(key_ids_before_checks.c.key_id == key_id))).first()
    if check is not None:
        return f"its key check was written by {check.created_by} on {check.created_at:%Y-%m-%d %H:%M:%S} UTC"
    if older is not None:
        return "rows were stored under it before key checks began"
    return None


def in_use(checked: Iterable[str], verdicts: dict[str, Tried]) -> set[str]:
    """The ids already in use with their key: bound (``checked``), or with stored rows it opens."""
    return {*checked, *(key_id for key_id, tried in verdicts.items() if tried.opened)}


def _same_key_for_a_new_id(ring: KeyRing, established: set[str]) -> None:
    """One key listed under two ids would bind both to it for good, and a rotation onto the
    second would change nothing. Refused for a new id; two ids already in use with that key
    (bound, or with rows it opens) are only warned of: refusing them would leave no way to read
    either."""
    for first, second in ring.twins():
        if first in established and second in established:
            log.warning("[crypto] keys '%s' and '%s' are the same key; both were in use with it before, so the broker "
                        "goes on, but a new key needs a new id and new material (`affidavit keys generate`)",
                        first, second)
            continue
        raise KeyMismatch(
            f"[crypto] keys '{first}' and '{second}' are the same key: a key is listed once, under one id (each id is "
            f"bound in the journal to its key, and a rotation onto the other would change nothing). A new id needs "
            f"a new key: `affidavit keys generate`")


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


_LOST_KEY = ("if that key file is lost, take '{key_id}' out of [crypto] keys and list a new key under a new id "
             "(`affidavit keys generate`) on every broker, as in a key rotation (docs/operations.md): what is stored "
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
        f"the [crypto] key '{key_id}' configured here opens none of the {len(failed)} row(s) stored under that same "
        f"id that it tried ({_shown(failed)}). Either this is another key file than the one they were encrypted with "
        f"(then what it stored no broker with the right file could read: configure the key file the brokers use for "
        f"'{key_id}'; {_LOST_KEY.format(key_id=key_id)}), or those rows were altered in the database (then no key "
        f"opens them: take '{key_id}' out of [crypto] keys, list a new key, made with `affidavit keys generate`, as "
        f"in a key rotation, and store the secrets again under it)"
    )


def _shown(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


async def try_stored(engine: AsyncEngine, ring: KeyRing, key_id: str, *, older: bool) -> Tried:
    """Try ``ring``'s key under ``key_id`` on rows stored under that id, until one opens: events
    of the newest invocations, then vault versions, then results (their headers: a body may be
    large), newest first; then, if none opened and ``older`` (the id had rows when the checks
    began, migration 0013), any older events and results. One that does not open is not enough
    to refuse (it may have been altered): any one that opens shows the key is the right one.

    Rows written since the checks began are all under ids that were bound first, so an id without
    a check has older rows only if ``older``: without it the whole tables (no index on
    ``key_id``) are never read. With it, the read stops at the first rows it finds, with no time
    limit (such rows exist)."""
    tried = Tried()
    async with reading(engine) as conn:
        await _try(conn, ring, key_id, tried, recent_only=True)
    if older and not tried.opened:
        url = engine.url.render_as_string(hide_password=False)
        await on_engine(url, lambda unbounded: _try_unbounded(unbounded, ring, key_id, tried), pool_size=1,
                        unbounded_statements=True)
    return tried


async def _try_unbounded(engine: AsyncEngine, ring: KeyRing, key_id: str, tried: Tried) -> None:
    async with reading(engine) as conn:
        await _try(conn, ring, key_id, tried, recent_only=False)


async def _try(conn: AsyncConnection, ring: KeyRing, key_id: str, tried: Tried, *, recent_only: bool) -> None:
    async with aclosing(_stored_under(conn, key_id, recent_only=recent_only)) as stored:
        async for item in stored:
            if item.what in tried.failed:  # the look through older rows meets the newest again
                continue
            try:
                ring.decrypt(key_id, item.blob, item.aad)
            except AuthenticationFailed:
                tried.failed.append(item.what)
                continue
            tried.opened = True
            return


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
