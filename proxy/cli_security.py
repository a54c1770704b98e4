"""``affidavit secrets``, ``affidavit audit`` and ``affidavit keys``: the vault, the audit chain, keys.

Registered in :mod:`proxy.cli`. Nothing here prints a secret value or key material: values are
read from stdin or a hidden prompt (never argv, which shell history and ``ps`` keep), keys are
written to a 0600 file and only its path is shown.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer

from .cli_operator import ConfigOption, defaults_notice, settings_or_exit, with_engine
from .store.migrate import sqlite_file, sqlite_where
from .config import KEY_ID, ConfigError, load_settings, redact_url
from .credentials import CredentialUnavailable

if TYPE_CHECKING:
    from .config import Settings
    from .keychecks import KeyUse


secrets_app = typer.Typer(help="Secrets in the encrypted vault (values from stdin or a prompt, never argv).", no_args_is_help=True)
audit_app = typer.Typer(help="The audit hash chain: verify offline without any key, export.", no_args_is_help=True)
keys_app = typer.Typer(help="Encryption keys (the crypto.keys setting) for the vault, payloads and results.", no_args_is_help=True)


@secrets_app.callback()
def _secrets() -> None:
    """Secrets in the encrypted vault (values from stdin or a prompt, never argv)."""


@audit_app.callback()
def _audit() -> None:
    """The audit hash chain: verify offline without any key, export."""


@keys_app.callback()
def _keys() -> None:
    """Encryption keys (the crypto.keys setting) for the vault, payloads and results."""


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"affidavit: {message}", err=True)
    raise typer.Exit(code)


# -- secrets ---------------------------------------------------------------------------------

_ARGV_REFUSED = (
    "secret values are never taken from the command line (shell history and process lists keep "
    "them); nothing was stored. Pipe the value in: `printf %s \"$VALUE\" | affidavit secrets {verb} NAME`, "
    "or run the command in a terminal to be prompted"
)
_EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def _read_value() -> str:
    if sys.stdin is None or not sys.stdin.isatty():
        raw = sys.stdin.buffer.read() if sys.stdin is not None else b""
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # never the bytes themselves: they are the secret
            _fail(f"the value is not UTF-8 text (at byte {exc.start + 1} of {len(raw)}); a secret is stored and sent as "
                  "text: pipe it in as UTF-8 (a binary key base64-encoded, say, as its service expects it); nothing "
                  "was stored")
        value = value.removesuffix("\n").removesuffix("\r")  # the one newline `echo` adds
    else:
        value = typer.prompt("Value", hide_input=True, confirmation_prompt=True)
    if not value:
        _fail("no value was given (stdin was empty); nothing was stored")
    from .credentials import MIN_SECRET_LENGTH

    if len(value.strip()) < MIN_SECRET_LENGTH:  # the broker would refuse to send it (it could not be redacted)
        _fail(f"the value is shorter than {MIN_SECRET_LENGTH} characters (surrounding spaces aside): the broker never "
              "sends a secret that short, since an echo of it could not be kept from the agent; nothing was stored")
    return value


def _store(ctx: typer.Context, config: Path | None, name: str, verb: str) -> None:
    from . import vault
    from .app import StartupError, prepare_database
    from .crypto import KeyRing
    from .keychecks import check_keys

    # The arguments first: a usage error must not wait for a value typed twice or piped in.
    if ctx.args:
        _fail(_ARGV_REFUSED.format(verb=verb), 2)  # never echo ctx.args: it is the secret
    try:
        vault.check_name(name)
    except ValueError as exc:
        _fail(f"{exc}; nothing was stored", 2)
    settings = settings_or_exit(config)
    try:
        # Everything that can refuse before the value is asked for (typed twice, or piped in).
        ring = KeyRing.from_settings(settings.crypto)
        vault.check_unlocked(ring, name)
        # The schema as `affidavit run` would have it: a new SQLite journal is created and
        # upgraded (the vault lives in it); PostgreSQL must have been upgraded already.
        database = sqlite_file(settings.database.url)
        new = database is not None and not Path(database).exists()
        prepare_database(settings, nothing="Nothing was stored", then="run the command again")
        if new:  # a relative database.url run from another directory, say: the broker would never see it
            typer.echo(f"affidavit: note: there was no journal at {sqlite_where(database)}, so a new one was made there "
                       "to hold the vault; a broker reads this secret only if its database.url names this file (run "
                       "the command where the broker runs, or pass its --config)", err=True)
        if verb == "rotate" and with_engine(settings, lambda engine: vault.latest_version(engine, name), writes=True) is None:
            raise vault.nothing_to_rotate(name)
        # Whether this key file is the one behind its id, before the value is typed twice.
        with_engine(settings, lambda engine: check_keys(engine, ring, by=vault.stored_by(verb), write=False), writes=True)
        value = _read_value()
        store = vault.rotate if verb == "rotate" else vault.put
        version = with_engine(settings, lambda engine: store(engine, ring, name, value), writes=True)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except StartupError as exc:
        _fail(str(exc))
    except CredentialUnavailable as exc:
        _fail(f"{exc.message} ({exc.code.value}); nothing was stored")
    except ValueError as exc:
        _fail(f"{exc}; nothing was stored", 2)
    typer.echo(f"affidavit: stored {name} {version}")


@secrets_app.command("set", context_settings=_EXTRA_ARGS)
def secrets_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The secret's name, as in `from = \"vault:NAME\"`.")],
    config: ConfigOption = None,
) -> None:
    """Store a new version of NAME (created if new). The value comes from stdin or a hidden prompt."""
    _store(ctx, config, name, "set")


@secrets_app.command("rotate", context_settings=_EXTRA_ARGS)
def secrets_rotate(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A secret already in the vault.")],
    config: ConfigOption = None,
) -> None:
    """Store a new version of an existing NAME; new invocations use it, old records keep theirs."""
    _store(ctx, config, name, "rotate")


@secrets_app.command("list")
def secrets_list(config: ConfigOption = None) -> None:
    """Names and versions in the vault (never values)."""
    from . import vault

    settings = settings_or_exit(config)
    listing = with_engine(settings, vault.list_secrets)  # a read: a SQLite journal that is not there is said so
    if not listing:
        typer.echo("affidavit: the vault is empty; store a secret with `affidavit secrets set NAME`")
        return
    for name, versions in listing.items():
        shown = ", ".join(f"{v.version} (key {v.key_id}, {v.created_at:%Y-%m-%d %H:%M})" for v in versions)
        typer.echo(f"{name}: {shown}; in use: {versions[-1].version}")


# -- audit -----------------------------------------------------------------------------------


@audit_app.command("verify")
def audit_verify(
    config: ConfigOption = None,
    database: Annotated[Optional[str], typer.Option("--database", help="Database URL (default: the configured journal).")] = None,
    dump: Annotated[Optional[Path], typer.Option("--dump", help="A file written by `affidavit audit export`.")] = None,
    checkpoints: Annotated[
        Optional[Path], typer.Option("--checkpoints", help="An earlier export whose checkpoints must also hold (kept off the database host).")
    ] = None,
) -> None:
    """Check the hash chains offline, over the stored bytes, without any key. Exit 1 if broken."""
    from . import audit

    if database is not None and dump is not None:
        _fail("give --database or --dump, not both", 2)
    try:
        earlier = audit.read_export(checkpoints, events=False) if checkpoints is not None else None
        extra = earlier.checkpoints if earlier is not None else []
        if dump is not None:
            result, source = audit.verify_dump(dump, extra), str(dump)
        else:
            url = database or settings_or_exit(config).database.url
            result, source = audit.verify_database(url, extra), redact_url(url)
    except audit.AuditInputError as exc:
        _fail(str(exc), 2)
    for path, unended in ((dump, result.unended), (checkpoints, earlier is not None and not earlier.ended)):
        if unended:
            typer.echo(f"affidavit: warning: {path} has no end line (an older affidavit wrote it), so had it been cut "
                       "short at a line boundary it would read as whole here: its last events or checkpoints may be "
                       "missing unseen. Exports written now end with a line that counts them.", err=True)
    if dump is None and (newer := _newer_schema(url)) is not None:
        typer.echo(f"affidavit: warning: {source} is at schema revision {newer[0]}, which a newer affidavit made (this "
                   f"one knows up to {newer[1]}): events it stores in a form this version does not know can read as damage "
                   "here, and damage in such a form can go unseen. Verify with the version that runs the brokers.",
                   err=True)
    if result.read_immutable:
        typer.echo(f"affidavit: warning: {source} could not be opened for shared reading (a read-only file system, or a "
                   "directory this user cannot write), so it was read as an immutable file: a -wal file beside it, if "
                   "any, was not read, and neither are writes a broker makes meanwhile. For a journal a broker still "
                   "writes, verify a copy (`sqlite3 DB .backup FILE`) or verify as a user who can write its directory.",
                   err=True)
    if result.unreadable:
        missing = ", ".join(result.unreadable)
        typer.echo(f"affidavit: warning: this database role may not read {missing}, so what is checked against "
                   f"{'it' if len(result.unreadable) == 1 else 'them'} was not (docs/audit.md: the checks beside the "
                   f"chain); grant SELECT on {missing} for a whole verify", err=True)
    counts = (
        f"{result.events} event(s) in {result.writers} writer chain(s), {result.invocations} invocation(s), "
        f"{result.checkpoints} checkpoint(s)"
    )
    if result.ok:
        typer.echo(f"affidavit: audit chain intact in {source}: {counts}; verified without any key")
        if result.events == 0:
            typer.echo(f"affidavit: warning: {source} holds no events at all, so there was nothing to verify: is "
                       "it the broker's journal? (A copy of a SQLite journal made without its -wal file can lack "
                       "everything written since the last checkpoint: copy with `sqlite3 DB .backup FILE`.)", err=True)
        return
    first = result.first
    assert first is not None
    typer.echo(f"affidavit: audit chain BROKEN in {source} at {first.describe()}", err=True)
    if len(result.breaks) > 1:
        typer.echo(f"affidavit: {len(result.breaks) - 1} more problem(s):", err=True)
        for other in result.breaks[1:]:
            typer.echo(f"  {other.describe()}", err=True)
    in_a_chain = any(b.writer is not None for b in result.breaks)
    typer.echo(
        f"affidavit: ({counts}.) " + ("In a broken chain, events from its first broken position on cannot be trusted "
                                      "(for `rewritten`: everything up to the checkpoint); " if in_a_chain else
                                      "The rows named above were altered; ")
        + "compare with a backup or an earlier `affidavit audit export`, and see docs/audit.md",
        err=True,
    )
    raise typer.Exit(1)


def _newer_schema(url: str) -> tuple[str, str] | None:
    """The journal's schema revision and this version's head if a newer affidavit made the
    journal's; None if this version knows it, or it cannot be read (an auditor may be granted
    only the two tables a verify reads)."""
    from .store import migrate

    try:
        revision = migrate.current(url)
    except Exception:
        return None
    return (revision, migrate.head()) if revision is not None and not migrate.known(revision) else None


@audit_app.command("export")
def audit_export(
    out: Annotated[Path, typer.Option("--out", help="File to write (JSON lines, mode 0600).")],
    config: ConfigOption = None,
    database: Annotated[Optional[str], typer.Option("--database", help="Database URL (default: the configured journal).")] = None,
) -> None:
    """Write every event (payload as stored, base64) and checkpoint, for offline verification."""
    from . import audit

    url = database or settings_or_exit(config).database.url
    try:
        count, marks = audit.export_events(url, out)
    except audit.AuditInputError as exc:
        _fail(str(exc), 2)
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror}", 2)
    typer.echo(f"affidavit: wrote {count} event(s) and {marks} checkpoint(s) to {out}; verify with `affidavit audit verify --dump {out}`")


# -- keys ------------------------------------------------------------------------------------



@keys_app.command("generate")
def keys_generate(
    config: ConfigOption = None,
    key_id: Annotated[Optional[str], typer.Option("--id", help="Key id (default k<UTC timestamp>).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write the key (default .affidavit/keys/<id>.key).")] = None,
) -> None:
    """Write a new random 256-bit key to a file only you can read; print how to list it."""
    from .crypto import generate_key

    key_id = key_id or f"k{datetime.now(UTC):%Y%m%d%H%M%S}"
    if not KEY_ID.fullmatch(key_id):
        _fail("a key id is 1-64 letters, digits, '_', '.' or '-'", 2)
    settings = _settings_for_a_key(config)  # an invalid configuration stops here, before a key is written
    existing = list(settings.crypto.keys)
    if any(entry.partition("=")[0].strip() == key_id for entry in existing):
        _fail(f"the configuration already lists a key '{key_id}': two keys under one id do not load, and another "
              f"file behind '{key_id}' would leave everything stored under the old one unreadable. Choose a new "
              "--id (the default is k<UTC timestamp>); no key was written", 2)
    _refuse_an_id_the_journal_holds(settings.database.url, key_id)
    path = (out or Path(".affidavit") / "keys" / f"{key_id}.key").absolute()
    try:
        _private_dirs(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        _fail(f"{path} already exists; a key file is never overwritten (choose another --out or --id)", 2)
    except OSError as exc:
        _fail(f"cannot create {path}: {exc.strerror}", 2)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(generate_key() + "\n")
    listed = ", ".join(f'"{entry}"' for entry in [f"{key_id}=file:{path}", *existing])
    typer.echo(f"affidavit: wrote a new key '{key_id}' to {path} (mode 0600)")
    typer.echo("Reference it in affidavit.toml; the first key encrypts, the others still decrypt:")
    typer.echo("  [crypto]")
    typer.echo(f"  keys = [{listed}]")


@keys_app.command("list")
def keys_list(config: ConfigOption = None) -> None:
    """Which key ids the journal's rows are stored under, and whether the configured keys are the
    ones behind their ids. Exit 1 if one is not. Reads every event and result (read-only)."""
    from .crypto import KeyRing, UnknownKeyId
    from .keychecks import Tried, in_use, key_usage, opens_check, try_stored

    settings = settings_or_exit(config)
    listed = [key_id for key_id, _ in settings.crypto.entries()]
    try:
        ring: KeyRing | None = KeyRing.from_settings(settings.crypto)
    except ConfigError as exc:
        ring = None
        typer.echo(f"affidavit: note: the configured keys cannot be read here ({exc}), so whether they are the ones "
                   "behind their ids is not shown; run the command where the brokers' key files are", err=True)

    async def survey(engine: Any) -> tuple[dict[str | None, KeyUse], dict[str, Tried]]:
        uses = await key_usage(engine)
        tried: dict[str, Tried] = {}
        for key_id in listed if ring is not None else []:  # no check yet: try the key as a broker's start would
            use = uses.get(key_id)
            if use is not None and use.check is None and not use.empty:
                tried[key_id] = await try_stored(engine, ring, key_id, older=True)  # type: ignore[arg-type]
        return uses, tried

    uses, tried = with_engine(settings, survey, scans=True)
    where = redact_url(settings.database.url)
    if not listed and not uses:
        typer.echo(f"affidavit: no [crypto] keys are configured and {where} holds nothing yet")
        return
    typer.echo(f"affidavit: keys in {where} (configured: {', '.join(listed) or 'none'})")
    wrong = []
    for key_id in [*listed, *sorted(k for k in uses if k is not None and k not in listed), *([None] if None in uses else [])]:
        use = uses.get(key_id)
        if key_id is None:
            typer.echo(f"  (no key): {_stored(use)}, stored unencrypted (while [crypto] keys was empty)")
            continue
        if key_id not in listed:
            typer.echo(f"  {key_id}: not configured; nothing stored under it (only its key check)" if use is None or use.empty
                       else f"  {key_id}: NOT configured: what is stored under it ({_stored(use)}) cannot be read with this configuration; list "
                       "its key to read them")
            continue
        role = "listed first, encrypts new rows" if key_id == listed[0] else "listed, reads only"
        check = use.check if use is not None else None
        if check is None and key_id in tried and tried[key_id].refuted:
            said = (f"no key check yet, and the key configured here is NOT the key behind '{key_id}': it opens none "
                    f"of the {len(tried[key_id].failed)} rows stored under it that it tried; brokers with this "
                    "configuration will not start (docs/vault.md, Key checks)")
            wrong.append(key_id)
        elif check is None and key_id in tried and tried[key_id].opened:
            said = ("no key check yet; the key configured here opens what is stored under it (a broker writes its "
                    "check at its next start)")
        elif check is None:
            said = "no key check yet (the next broker to start with it writes one)"
        else:
            written = f"written by {check['created_by']} on {check['created_at']:%Y-%m-%d %H:%M:%S} UTC"
            if ring is None:
                said = f"key check {written}"
            else:
                try:
                    opens = opens_check(ring, check)
                except UnknownKeyId:
                    opens = False
                said = f"the key configured here opens its key check ({written})" if opens else (
                    f"the key configured here is NOT the key behind '{key_id}': it does not open its key check "
                    f"({written}); brokers with this configuration will not start (docs/vault.md, Key checks)")
                if not opens:
                    wrong.append(key_id)
        typer.echo(f"  {key_id}: {role}; {said}")
        typer.echo(f"      {_stored(use)}")
        if key_id != listed[0] and (use is None or use.empty):
            typer.echo(f"      nothing in this journal is stored under '{key_id}': it can go from [crypto] keys (unless "
                       "a backup you may restore holds rows under it); never give its id to another key")
    established = in_use((k for k, use in uses.items() if k is not None and use.check is not None), tried)
    for first, second in ring.twins() if ring is not None else []:
        both = first in established and second in established
        typer.echo(f"  '{first}' and '{second}' are the same key" + (
            ": both were in use with it before, so brokers still start; a new key needs a new id and new material"
            if both else "; brokers with this configuration will not start (a new id needs a new key: `affidavit "
            "keys generate`)"))
        if not both:
            wrong.append(second)
    if wrong:
        raise typer.Exit(1)


def _stored(use: "KeyUse | None") -> str:
    if use is None or use.empty:
        return "no rows"
    parts = [f"{use.events} event(s)" + (f" (newest {use.newest_event:%Y-%m-%d %H:%M} UTC)" if use.newest_event else ""),
             f"{use.results} result(s)"]
    if use.vault_versions:
        parts.append(f"{use.vault_versions} vault version(s), {use.vault_in_use} in use")
    return ", ".join(parts)


def _private_dirs(directory: Path) -> None:
    """Make ``directory`` and every missing parent readable by the owner only (``mkdir -p`` gives
    the parents the default mode, 0755 under the usual umask)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for each in reversed(missing):
        each.mkdir(mode=0o700)


def _settings_for_a_key(config: Path | None) -> "Settings":
    """The configuration, for the key references already listed (not keys: the printed line keeps
    them) and the journal. An invalid one is refused (exit 2), as every command that reads it does."""
    defaults_notice(config)
    try:
        return load_settings(config)
    except ConfigError as exc:
        _fail(f"{exc}; no key was written", 2)


def _refuse_an_id_the_journal_holds(url: str, key_id: str) -> None:
    """Exit 2 if the journal already binds ``key_id`` to a key (a broker would refuse a new file
    behind it at start, after the operator had rolled it out). A journal that does not exist yet
    holds no id; one that cannot be read now is said, and the key is written anyway (making a key
    needs no database; the brokers' start still checks)."""
    import asyncio

    from .keychecks import taken
    from .store import queries
    from .store.journal import brief, on_engine

    database = sqlite_file(url)
    if database is not None and not Path(database).is_file():
        return
    try:
        why = asyncio.run(on_engine(url, lambda engine: taken(engine, key_id), pool_size=1))
    except queries.DATABASE_ERRORS as exc:
        typer.echo(f"affidavit: note: could not look in the journal ({redact_url(url)}) for the id '{key_id}' "
                   f"({'it predates key checks: run `affidavit db upgrade`' if queries.schema_missing(exc) else brief(exc)}); "
                   f"if the journal already holds a key under '{key_id}', brokers will refuse this one at start "
                   "(`affidavit keys list` shows the ids in use)", err=True)
        return
    if why is not None:
        _fail(f"the journal ({redact_url(url)}) already has a key behind '{key_id}' ({why}), though this configuration "
              f"does not list it: brokers refuse another key under that id at start, and what is stored under it stays "
              f"readable only with its own key. Choose a new --id (the default is k<UTC "
              "timestamp>); no key was written", 2)
