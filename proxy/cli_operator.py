"""Operator commands that read the journal directly: ``invocations``, ``metrics``.

They need only the configuration (the database URL), not a running broker, so they work at 3 a.m.
when the brokers are the problem. Nothing they print can hold a secret: the journal holds none.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Awaitable, Callable, Optional, TypeVar
from urllib.parse import quote

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .contract import Code, Outcome, Phase, UnreadableRecord
from .config import DEFAULT_CONFIG, ConfigError, Settings, load_settings, parse_duration
from .crypto import KeyRing, payload_decoder, result_decoder
from .decisions import RECONCILABLE
from .invocation_view import describe
from .store import queries
from .store.journal import on_engine

T = TypeVar("T")

ConfigOption = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", envvar="AFFIDAVIT_CONFIG", help="TOML configuration file (default ./affidavit.toml)."),
]



def _utf8(value: str | None) -> str | None:
    """Bytes that are not UTF-8 reach ``argv`` as lone surrogates (Python's surrogateescape):
    no id or text the journal could hold, so a usage error before anything is asked."""
    if value is not None and any("\ud800" <= c <= "\udfff" for c in value):
        raise typer.BadParameter("is not UTF-8 text (bytes in another encoding: is the terminal's locale UTF-8?)")
    return value


InvocationId = Annotated[str, typer.Argument(callback=_utf8, help="The invocation's id (act_...).")]
NoteOption = Annotated[Optional[str], typer.Option(callback=_utf8, help="Why, for the record.")]

invocations_app = typer.Typer(help="Recorded invocations, straight from the journal.", no_args_is_help=True)
console = Console()


def defaults_notice(config: Path | None) -> None:
    """Say on stderr that the built-in defaults apply, when there is no configuration file."""
    if config is None and not DEFAULT_CONFIG.is_file():
        typer.echo(
            f"affidavit: no --config and no {DEFAULT_CONFIG} in {Path.cwd()}: using the built-in defaults "
            "and AFFIDAVIT_* variables",
            err=True,
        )


def settings_or_exit(config: Path | None, *, quiet: bool = False) -> Settings:
    """The configuration, or exit 2 saying why. Without ``--config`` and without ``./affidavit.toml``
    the built-in defaults apply, which is said on stderr (unless ``quiet``: a worker, whose
    supervisor said it once): a command run from the wrong directory would otherwise look at the
    wrong journal without a word."""
    if not quiet:
        defaults_notice(config)
    try:
        return load_settings(config)
    except ConfigError as exc:
        typer.echo(f"affidavit: {exc}", err=True)
        raise typer.Exit(2) from None


def ring_of(settings: Settings) -> KeyRing:
    """The configured keys that can be read here, for reading encrypted payloads and results. A
    key that cannot be read (its file is on the brokers' hosts, say) is a note, not a refusal:
    records stored without it can still be shown, and one stored under it says so when read."""
    ring, unreadable = KeyRing.for_reading(settings.crypto)
    for problem in unreadable.values():
        typer.echo(f"affidavit: note: {problem}; records stored under that key cannot be shown here", err=True)
    return ring


def with_engine(settings: Settings, work: Callable[[Any], Awaitable[T]], *, writes: bool = False,
                scans: bool = False) -> T:
    """Run ``work(engine)`` against the configured journal; a database error is one clear line.
    A SQLite journal that does not exist is said so (connecting would create an empty file).

    A read of a SQLite journal this user may read but not share (a read-only file system, or a
    directory it cannot write, where SQLite cannot make the shared-memory file a WAL reader
    needs) reads the file as immutable instead, but only when no ``-wal`` file holds commits the
    file does not: then nothing is missed. ``writes``: the work writes (no such fallback).
    ``scans``: the work reads whole tables on purpose; its statements get no time bound."""
    from .store.migrate import sqlite_file, sqlite_file_problem, sqlite_where

    database = sqlite_file(settings.database.url)
    if (problem := sqlite_file_problem(settings.database.url)) is not None:
        typer.echo(f"affidavit: database.url {database}: {problem}", err=True)
        raise typer.Exit(1)
    if database is not None and not Path(database).is_file():
        typer.echo(
            f"affidavit: no journal at {sqlite_where(database)}: nothing was recorded there, or this is not "
            "the broker's directory; run the command where the broker runs, or pass its --config",
            err=True,
        )
        raise typer.Exit(1)
    seen: dict[str, str | None] = {}
    try:
        answer = asyncio.run(on_engine(settings.database.url, lambda engine: _with_revision(engine, work, seen), pool_size=2,
                                       unbounded_statements=scans))
    except Exception as exc:
        _note_revision(seen.get("revision"))  # a schema not this version's may be why the work failed
        if isinstance(exc, typer.Exit) or (writes and not isinstance(exc, queries.DATABASE_ERRORS)):
            raise  # a write's own refusal (the vault's, say) is its caller's to word
        if not writes and (immutable := _read_only_copy(settings.database.url, exc)) is not None:
            try:
                answer = asyncio.run(on_engine(immutable, lambda engine: _with_revision(engine, work, seen), pool_size=1,
                                               unbounded_statements=scans))
            except Exception:
                pass  # the first error says best what is wrong
            else:
                typer.echo(f"affidavit: note: {database} could not be opened for shared reading (a read-only file system, "
                           "or a directory this user cannot write), and no -wal file holds commits it lacks, so it was "
                           "read as it is on disk.", err=True)
                return answer
        from .config import redact_url
        from .crypto import DecryptError, KeyNotReadableHere, UnknownKeyId
        from .store.journal import brief

        if isinstance(exc, UnreadableRecord):  # a newer broker wrote it
            typer.echo(f"affidavit: {exc}. Nothing was changed. Run this command from the version of affidavit that "
                       "wrote it, or upgrade this one (docs/operations.md, Upgrading).", err=True)
            raise typer.Exit(1) from None
        if isinstance(exc, KeyNotReadableHere):
            typer.echo(f"affidavit: a record could not be read: {exc}. Nothing was changed. Run the command where the "
                       "brokers' key files (or variables) are, or make that key readable here.", err=True)
            raise typer.Exit(1) from None
        if isinstance(exc, UnknownKeyId):  # the journal answered; the record is under a key not configured here
            typer.echo(f"affidavit: a record could not be read: {exc}. Nothing was changed. Put the key it was stored "
                       "under back in [crypto] keys (docs/vault.md, key rotation), then run the command again.", err=True)
            raise typer.Exit(1) from None
        if isinstance(exc, DecryptError):  # a known key, but the bytes do not authenticate under it
            typer.echo(f"affidavit: a record could not be read: {exc}. Nothing was changed. The stored bytes were "
                       "altered or moved, or the key behind that id in [crypto] keys is not the one they were written "
                       "with: check the key, and run `affidavit audit verify`.", err=True)
            raise typer.Exit(1) from None

        where = f"database.url is {redact_url(settings.database.url)}"
        names_it = (f"{where}: check that it names the broker's journal (a SQLite file the broker made, or its "
                    "PostgreSQL database)")
        if queries.damaged(exc):
            advice = f"{names_it}; if it does, the journal's storage is damaged: {queries.DAMAGED_ADVICE}. Nothing was changed"
        elif queries.schema_missing(exc):
            advice = (f"{where}, which has no journal schema, or an older one: run `affidavit db upgrade` with this "
                      "configuration (or start the broker with database.auto_upgrade = true)")
        elif queries.unreachable(exc):
            advice = f"{where}: {queries.what_to_check(exc)}, then run the command again"
        else:
            advice = f"{names_it}; nothing was changed"
        typer.echo(f"affidavit: the journal could not be {'written' if writes else 'read'} ({exc.__class__.__name__}: "
                   f"{brief(exc)}); {advice}",
                   err=True)
        raise typer.Exit(1) from None
    _note_revision(seen.get("revision"))
    return answer


async def _with_revision(engine: Any, work: Callable[[Any], Awaitable[T]], seen: dict[str, str | None]) -> T:
    """``work(engine)``, once the journal's schema revision is in ``seen`` (None if it cannot be
    read: an auditor may be granted only the tables a command reads)."""
    from .store import migrate

    try:
        seen["revision"] = await migrate.revision(engine)
    except Exception:
        seen["revision"] = None  # the work, if it fails too, says best what is wrong
    return await work(engine)


def _note_revision(revision: str | None) -> None:
    """A note on stderr when the journal's schema is not the one this version writes: a newer
    affidavit's records can hold what this version does not show; an older one needs
    ``affidavit db upgrade`` (or a broker with ``database.auto_upgrade``) before this version's
    brokers use it."""
    from .store import migrate

    if revision is None or revision == (head := migrate.head()):
        return
    if not migrate.known(revision):
        typer.echo(f"affidavit: note: the journal is at schema revision {revision}, which a newer affidavit made (this "
                   f"one knows up to {head}): what that version records in a form this one does not know is not "
                   "shown here. Run the command from the version the brokers run.", err=True)
    else:
        typer.echo(f"affidavit: note: the journal is at schema revision {revision}, older than this version's {head}: "
                   "the brokers that wrote it are older than this command. Before brokers of this version use it, run "
                   "`affidavit db upgrade` with their configuration (or start them with database.auto_upgrade = true).",
                   err=True)


def _read_only_copy(url: str, exc: BaseException) -> str | None:
    """The URL that reads the SQLite journal at ``url`` as an immutable file, when ``exc`` says it
    could not be opened for shared reading and no non-empty ``-wal`` file lies beside it."""
    from .audit import immutable_url
    from .store.migrate import sqlite_file

    immutable = immutable_url(url, exc)
    wal = Path(f"{sqlite_file(url)}-wal")
    if immutable is None or (wal.exists() and wal.stat().st_size > 0):
        return None
    return immutable


def _whole_table(title: str, columns: tuple[str, ...], cells: list[list[str]]) -> bool:
    """Print ``cells`` as a table if every cell fits the terminal whole; False (nothing printed)
    when it does not, and the caller prints a few lines per row instead."""
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    if sum(widths) + 3 * len(columns) > console.width:
        return False
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=True)
    for line in cells:
        table.add_row(*line)
    console.print(table)
    return True


def _window(since: str) -> float:
    try:
        return parse_duration(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None


def _one_of(value: str | None, allowed: type[Outcome] | type[Phase] | type[Code], option: str) -> str | None:
    """A filter value checked against its closed enum: a typo would otherwise list nothing."""
    if value is None or value in {member.value for member in allowed}:
        return value
    raise typer.BadParameter(f"{value!r} is not one of: {', '.join(m.value for m in allowed)}", param_hint=option)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):  # to the second, in UTC: the table is for reading
        return (value if value.tzinfo is None else value.astimezone(UTC)).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


@invocations_app.callback()
def _invocations() -> None:
    """Recorded invocations, straight from the journal."""


@invocations_app.command("list")
def invocations_list(
    config: ConfigOption = None,
    outcome: Annotated[Optional[str], typer.Option(help="not_attempted, rejected, committed, partial_effect, unknown")] = None,
    route: Annotated[Optional[str], typer.Option(help="A route name (also one no longer configured).")] = None,
    phase: Annotated[Optional[str], typer.Option(
        help="validation, credential_injection, connection_setup, remote_execution, result_delivery")] = None,
    code: Annotated[Optional[str], typer.Option(help="A code, e.g. REMOTE_OUTCOME_UNKNOWN.")] = None,
    since: Annotated[str, typer.Option(help="Time window, e.g. 1h, 24h, 7d.")] = "24h",
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many rows, newest first.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """The newest invocations, filtered."""
    outcome, phase = _one_of(outcome, Outcome, "--outcome"), _one_of(phase, Phase, "--phase")
    code = _one_of(code, Code, "--code")
    settings = settings_or_exit(config)
    _unknown_route_notice(settings, route)
    since_at = queries.window_start(_window(since))
    rows = with_engine(
        settings,
        lambda engine: queries.list_invocations(
            engine, outcome=outcome, route=route, phase=phase, code=code, since=since_at, limit=limit
        ),
    )
    columns = ("invocation_id", "created_at", "agent", "route", "method", "phase", "outcome", "code", "retry", "status")
    if as_json:
        for row in rows:
            typer.echo(json.dumps({c: row[c] for c in columns}, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v)))
        return
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    if _whole_table(f"invocations (last {since}, UTC)", columns, cells):
        return
    # Too narrow for one row each: a few lines per invocation, wrapped between words, nothing cut.
    console.print(f"invocations (last {since}, UTC), newest first", highlight=False)
    for invocation_id, at, agent, route_, method, phase_, outcome_, code_, retry, status in cells:
        console.print(f"{invocation_id}  {at}  {agent}  {method}", highlight=False)
        _print_facts([f"route {route_ or '-'}", outcome_, phase_, code_ or "-", f"retry {retry or '-'}",
                      f"status {status or '-'}"])


def _unknown_route_notice(settings: Settings, route: str | None) -> None:
    """A --route the configuration does not name is still looked up (a route since removed keeps
    its records), but said on stderr: a typo would otherwise read as "nothing happened"."""
    names = [r.name for r in settings.routes]
    if route is not None and route not in names:
        typer.echo(f"affidavit: note: the configuration has no route {route!r} (it has: {', '.join(names) or 'none'}); "
                   "listing what the journal holds under that name anyway", err=True)


@invocations_app.command("show")
def invocations_show(invocation_id: InvocationId, config: ConfigOption = None) -> None:
    """One invocation's whole record, as the side API shows it to the operator (JSON)."""
    settings = settings_or_exit(config)

    async def read(engine: Any) -> dict[str, Any] | None:
        row = await queries.invocation(engine, invocation_id)
        if row is None:
            return None
        rows, events = await queries.events_of(engine, invocation_id, payload_decoder(ring_of(settings)))
        owner = await queries.holder(engine, row, settings.recovery.stale_after)
        return describe(row, events, operator=True, event_times={r["seq"]: r["at"] for r in rows}, owner=owner)

    view = with_engine(settings, read)
    if view is None:
        typer.echo(f"affidavit: no invocation {invocation_id!r} in the journal", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(view, indent=2, default=str))
    if (owner := view.get("owner")) is not None and owner["stale"]:
        typer.echo(f"affidavit: the broker that holds this record, {owner['broker']}, last beat {owner['silent_s']:.0f} s "
                   f"ago (recovery.stale_after is {settings.recovery.stale_after:g} s): it has stopped, so no caller waits "
                   "on it any more, whatever caller_disposition says. A running broker closes the record "
                   "(recovery, docs/operations.md); held and approved records wait for the agent's repeat instead. "
                   "If no broker runs, start one.", err=True)


@invocations_app.command("result")
def invocations_result(
    invocation_id: InvocationId,
    config: ConfigOption = None,
    headers: Annotated[bool, typer.Option(help="Print the status line and headers too.")] = False,
) -> None:
    """Write the recorded final response's body to stdout (a read: nothing is re-executed)."""
    settings = settings_or_exit(config)
    decode = result_decoder(ring_of(settings))
    async def read(engine: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        stored = await queries.stored_result(engine, invocation_id, decode)
        return stored, (await queries.invocation(engine, invocation_id) if stored is None else None)

    stored, row = with_engine(settings, read)
    if stored is None:
        if row is None:
            typer.echo(f"affidavit: no invocation {invocation_id!r} in the journal", err=True)
        else:
            why = ("it was never sent, so there is no response" if row["outcome"] == "not_attempted"
                   else "no complete response was recorded")
            typer.echo(f"affidavit: invocation {invocation_id!r} has no stored result (outcome {row['outcome']}, code "
                       f"{row['code'] or '-'}): {why}. `affidavit invocations show {invocation_id}` has the record.",
                       err=True)
        raise typer.Exit(1)
    if headers:
        typer.echo(f"HTTP {stored['status']}")
        for name, value in stored["headers"]:
            typer.echo(f"{name}: {value}")
        typer.echo("")
    sys.stdout.buffer.write(bytes(stored["body"]))
    sys.stdout.flush()


PHASES = ("validation", "credential_injection", "connection_setup", "remote_execution", "result_delivery")
OUTCOMES = ("not_attempted", "rejected", "committed", "unknown", "partial_effect")


def metrics(
    config: ConfigOption = None,
    since: Annotated[str, typer.Option(help="Time window, e.g. 1h, 24h, 7d.")] = "24h",
    route: Annotated[Optional[str], typer.Option(help="Only this route (also one no longer configured).")] = None,
) -> None:
    """The phase x outcome table of the invocations ended in a time window (as the
    invocation_outcomes view counts them, from whole hours)."""
    settings = settings_or_exit(config)
    since_at = queries.window_start(_window(since)).replace(minute=0, second=0, microsecond=0)
    _unknown_route_notice(settings, route)
    rows = with_engine(settings, lambda engine: queries.outcome_counts(engine, since_at, route))
    counts = {(phase, outcome): int(n) for phase, outcome, n in rows}
    table = Table(title=f"invocations by phase x outcome, last {since}" + (f", route {route}" if route else ""))
    # Whole enum names, never cut: the table is read and grepped (it needs ~100 columns).
    table.add_column("phase", no_wrap=True)
    for outcome in OUTCOMES:
        table.add_column(outcome, justify="right", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    for phase in PHASES:
        values = [counts.get((phase, outcome), 0) for outcome in OUTCOMES]
        table.add_row(phase, *(str(v) if v else "." for v in values), str(sum(values)))
    totals = [sum(counts.get((p, o), 0) for p in PHASES) for o in OUTCOMES]
    table.add_row("total", *(str(v) for v in totals), str(sum(totals)), style="bold")
    Console(width=max(console.width, 110)).print(table)
    unknown = counts.get(("remote_execution", "unknown"), 0)
    setup = counts.get(("connection_setup", "not_attempted"), 0)
    # One line each, whatever the terminal's width (scripts grep them).
    console.print(f"remote_execution/unknown: {unknown} (may have had effects: reconcile, never re-send blindly)", soft_wrap=True)
    console.print(f"connection_setup/not_attempted: {setup} (nothing was sent)", soft_wrap=True)


# -- decisions, through the side API of a running broker ----------------------------------------

approvals_app = typer.Typer(help="Requests held for an operator's approval.", no_args_is_help=True)


def operator_api(settings: Settings) -> Any:
    """The side API of the configured broker, with the operator token from its configured source."""
    from .client import SideAPI
    from .credentials import CredentialUnavailable, read_source

    if not settings.api.operator_token:
        typer.echo("affidavit: api.operator_token is not configured; operator commands need it. Set it in the "
                   "broker's configuration ([api] operator_token = \"file:/path/to/token\" or \"env:VARIABLE\", "
                   "docs/configuration.md) and restart the broker: it reads the token when it starts.", err=True)
        raise typer.Exit(2)
    try:
        token, _ = read_source(settings.api.operator_token, what="api.operator_token")
    except CredentialUnavailable as exc:
        typer.echo(f"affidavit: {exc.message}", err=True)
        raise typer.Exit(2) from None
    host, port = settings.api.listen.rsplit(":", 1)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    return SideAPI(f"http://{host}:{port}", token, timeout=60)


def call_api(settings: Settings, method: str, path: str, body: Any = None, *, fields: tuple[str, ...] = (),
             invocation_id: str | None = None) -> Any:
    """One operator call of the side API: its answer, whose ``fields`` must be there; or exit 1,
    saying why. ``invocation_id``: the record a decision (a POST) is about, to look at when the
    broker did not answer in time (it may still be making the decision)."""
    from .client import SideAPIUnavailable

    api = operator_api(settings)
    try:
        status, answer = api.call(method, path, body)
    except SideAPIUnavailable as exc:
        if method != "GET" and isinstance(exc.__cause__, TimeoutError) and exc.sent:
            look = f" (affidavit invocations show {invocation_id})" if invocation_id else ""
            lookup = (" (a lookup is a request to the remote of its own, and may wait on its route)"
                      if isinstance(body, dict) and body.get("lookup") else "")
            typer.echo(f"affidavit: {exc}: no answer within {api.timeout:g} s. The broker may still make this "
                       f"change{lookup}: look at the record{look} before you repeat it.", err=True)
        else:
            typer.echo(f"affidavit: {exc} (is the broker running?)", err=True)
        raise typer.Exit(1) from None
    unlike = None  # what an answer lacks that the side API's has: another server at api.listen
    if status < 400 and (not isinstance(answer, dict) or any(f not in answer for f in fields)):
        unlike = f"no {', '.join(f for f in fields if not isinstance(answer, dict) or f not in answer) or 'JSON object'}"
    elif status >= 400 and not (isinstance(answer, dict) and "detail" in answer):
        text = " ".join(str(answer).split())
        unlike = f"no problem document; it began: {text[:120]!r}{'...' if len(text) > 120 else ''}"
    if unlike is not None:
        typer.echo(f"affidavit: the server at {api.base_url} answered {status}, but not as an Affidavit side API does "
                   f"({unlike}): is api.listen in this configuration the broker's side API, and is it this broker's "
                   "configuration (--config)?" + (" Whether the change was made, the record says." if method != "GET" else ""),
                   err=True)
        raise typer.Exit(1)
    if status >= 400:
        detail = answer["detail"]
        if isinstance(detail, list):  # a 422's problems, one per field: never their input (a long note, say)
            detail = "; ".join(
                f"{'.'.join(str(part) for part in item.get('loc', [])[1:]) or 'the request'}: {item.get('msg', item)}"
                if isinstance(item, dict) else str(item)
                for item in detail
            )
        if status == 401:
            detail = (f"{detail} This command read the operator token from api.operator_token "
                      f"({settings.api.operator_token}); a broker reads its tokens when it starts, so after a change of "
                      "the token restart the broker, or give this command the source the broker was started with.")
        if status == 404 and isinstance(detail, str) and detail.endswith(" is visible to this token."):
            # The operator sees every invocation: an id it cannot see is not in this journal.
            detail = detail.replace(" is visible to this token.", f" is in the journal of the broker at {api.base_url} "
                                    "(is the id right, and is this the broker that recorded it? pass its --config).")
        typer.echo(f"affidavit: {status} from the broker at {api.base_url}: {detail}", err=True)
        raise typer.Exit(1)
    return answer


@approvals_app.callback()
def _approvals() -> None:
    """Requests held for an operator's approval."""


#: Cards asked for per side-API call by `approvals list`, which follows the pages to the end.
APPROVALS_PAGE = 500


@approvals_app.command("list")
def approvals_list(
    config: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """Held requests with what each approval would authorise."""
    settings = settings_or_exit(config)
    items: list[dict[str, Any]] = []
    page: dict[str, Any] = {"next": None}
    while True:  # every page, oldest first: each starts past the last one's ids, so this ends
        after = f"&after={page['next']}" if page["next"] else ""
        page = call_api(settings, "GET", f"/v1/approvals?limit={APPROVALS_PAGE}{after}", fields=("items",))
        items.extend(page["items"])
        if not page.get("next"):
            break
    if as_json:
        for card in items:
            typer.echo(json.dumps(card))
        return
    if not items:
        console.print("no request is waiting for approval")
        return
    columns = ("invocation_id", "agent", "route", "method", "target", "body", "credential", "approves", "retry?", "caller")
    cells = [
        [card["invocation_id"], card["agent"], card["route"], card["method"], card["target"],
         f"{card['body_bytes']} B sha256:{card['body_sha256'][:12]}",
         f"{card.get('credential_id') or '-'} {card.get('credential_version') or ''}".strip(),
         card["approves"][:19], "uncertain retry" if card.get("retry_of_uncertain_action") else "", _caller(card)]
        for card in items
    ]
    if _whole_table("held for approval", columns, cells):
        return
    # Too narrow for one row each (a pipe, a small terminal): a few lines per card, nothing cut.
    console.print("held for approval", highlight=False)
    for invocation_id, agent, route, method, target, body, credential, approves, retry, caller in cells:
        console.print(f"{invocation_id}  {agent}  {route}  {method} {target}", highlight=False)
        _print_facts([f"body {body}", f"credential {credential}", f"approves {approves}", *([retry] if retry else []),
                      f"caller {caller}"])


def _print_facts(facts: list[str], indent: str = "    ") -> None:
    """``facts`` on indented lines under a row's first line, as many to a line as fit the
    terminal: a label stays with its value, and a line is broken only between facts (one fact
    wider than the terminal alone wraps)."""
    line = ""
    for fact in facts:
        if line and len(indent) + len(line) + 2 + len(fact) > console.width:
            console.print(indent + line, highlight=False)
            line = ""
        line = f"{line}  {fact}" if line else fact
    if line:
        console.print(indent + line, highlight=False)


def _caller(card: dict[str, Any]) -> str:
    """Whether an agent still waits on the card: not once the broker holding it has stopped (its
    heartbeat stale); an approval then waits for the agent's repeat with the same key."""
    owner = card.get("owner") or {}
    return "gone (approval waits for a repeat)" if owner.get("stale") else "waiting"


def _decide(config: Path | None, invocation_id: str, decision: str, note: str | None) -> None:
    settings = settings_or_exit(config)
    record = call_api(settings, "POST", f"/v1/approvals/{quote(invocation_id, safe='')}", {"decision": decision, "note": note},
                      fields=("stage", "outcome"), invocation_id=invocation_id)
    done = {"approve": "approved", "deny": "denied"}[decision]
    typer.echo(f"{invocation_id}: {done} (stage {record['stage']}, outcome {record['outcome']})")
    if decision == "approve" and (record.get("owner") or {}).get("stale"):
        typer.echo(f"{invocation_id}: the broker that held it has stopped, so no caller waits on it: nothing is sent "
                   "until the agent repeats the request with the same Idempotency-Key (then it is sent under this "
                   "approval, once)")


@approvals_app.command("approve")
def approvals_approve(invocation_id: InvocationId, config: ConfigOption = None, note: NoteOption = None) -> None:
    """Approve exactly the request on the card (one attempt, this fingerprint)."""
    _decide(config, invocation_id, "approve", note)


@approvals_app.command("deny")
def approvals_deny(invocation_id: InvocationId, config: ConfigOption = None, note: NoteOption = None) -> None:
    """Deny a held request: nothing is sent, no secret is touched."""
    _decide(config, invocation_id, "deny", note)


def reconcile(
    invocation_id: InvocationId,
    config: ConfigOption = None,
    outcome: Annotated[Optional[str], typer.Option(help="committed, rejected or partial_effect")] = None,
    reference: Annotated[Optional[str], typer.Option(help="The remote's id for the operation.", callback=_utf8)] = None,
    note: NoteOption = None,
    lookup: Annotated[bool, typer.Option("--lookup", help="Ask the remote through the route's declared lookup.")] = False,
    override: Annotated[bool, typer.Option(
        "--override", help="The finding changes the outcome of a record that holds the remote's complete answer "
        "(say, it refunded); refused without this.")] = False,
) -> None:
    """Append what is known about an invocation's effect; its original record stays as it was."""
    findings = [o.value for o in RECONCILABLE]
    if outcome is not None and outcome not in findings:
        raise typer.BadParameter(f"{outcome!r} is not a finding; one of: {', '.join(findings)} (a reconciliation "
                                 "says what happened, so never not_attempted or unknown)", param_hint="--outcome")
    if outcome is None and not lookup:
        raise typer.BadParameter(f"say what happened ({', '.join(findings)}), or ask the remote with --lookup",
                                 param_hint="--outcome")
    if outcome is not None and lookup:
        raise typer.BadParameter("give an outcome or ask the remote with --lookup, not both: the lookup's answer is "
                                 "the finding then", param_hint="--outcome")
    settings = settings_or_exit(config)
    body = {"outcome": outcome, "reference": reference, "note": note, "lookup": lookup}
    if override:  # only when asked: a broker from before the field refuses unknown fields
        body["override"] = True
    record = call_api(settings, "POST", f"/v1/invocations/{quote(invocation_id, safe='')}/reconcile", body,
                      fields=("outcome", "evidence", "caller_disposition", "retry"), invocation_id=invocation_id)
    found = record.get("lookup")
    if found:
        typer.echo(f"lookup {found['lookup_invocation_id']} answered {found['status']}: {found['finding']}")
    typer.echo(
        f"{invocation_id}: outcome {record['outcome']} ({record['evidence']['certainty']}), "
        f"caller disposition {record['caller_disposition']}, retry {record['retry']}"
    )
