"""Schema upgrades through the one Alembic history in ``migrations/``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config


def migrations_dir() -> Path:
    """The history ships inside the wheel as ``proxy/_migrations``; a checkout uses ``migrations/``."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("the migrations directory is missing from this installation")


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> str | None:
    """Bring the database at ``url`` to ``revision``; returns the revision it was at, read under
    the upgrade's lock (None: no schema). Synchronous: call it outside the event loop."""
    config = _config(url)
    with _one_upgrade_at_a_time(sqlite_file(url)):
        command.upgrade(config, revision)
    return config.attributes.get("revision_before")


@contextmanager
def _one_upgrade_at_a_time(database: str | None) -> Iterator[None]:
    """Concurrent upgrades of one journal take turns (they failed on each other's CREATE).
    PostgreSQL (``database`` None): env.py takes an advisory lock in the upgrade's transaction.
    SQLite: a flock on the journal file itself; SQLite's own locks are fcntl record locks, which
    a flock neither takes nor waits for. Opening it creates the file, as the upgrade would."""
    if database is None:
        yield
        return
    import fcntl

    with open(database, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


#: How long the commands that run outside the broker (migrations, `audit`) wait for PostgreSQL
#: to accept a connection; asyncpg's own default is a minute, spent in silence.
CONNECT_TIMEOUT = 10.0


def connect_args(url: str) -> dict[str, float]:
    """The driver's arguments for a connection that gives up on a server that does not answer.
    Only the connection is bounded: a migration or an export may take longer than that."""
    return {"timeout": CONNECT_TIMEOUT} if url.startswith("postgresql") else {}


def sqlite_file(url: str) -> str | None:
    """The path of the SQLite file ``url`` names, as written; None for PostgreSQL, an in-memory
    database or a ``file:`` URI (SQLite reads those itself)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database.startswith("file:") \
            or parsed.query.get("uri") in ("true", "1"):
        return None
    return parsed.database


def sqlite_where(database: str) -> str:
    """A SQLite path for a message: absolute, and, when written relative, where it was resolved
    from (the working directory, not the configuration file's: a command given ``-c`` elsewhere
    looks in the wrong place)."""
    path = Path(database)
    if path.is_absolute():
        return str(path)
    return f"{path.absolute()} (database.url's path {database} is relative: it is read from the working directory {Path.cwd()})"


def sqlite_file_problem(url: str, setting: str = "database.url") -> str | None:
    """Why the SQLite journal file at ``url`` cannot be opened (a directory, or a directory that
    does not exist), said before SQLite says only "unable to open database file"; None for
    PostgreSQL, a ``file:`` URI, or a path that can hold the journal."""
    from pathlib import Path

    if (database := sqlite_file(url)) is None:
        return None
    path = Path(database).absolute()
    if path.is_dir():
        return f"{path} is a directory; the journal is a file, such as {path / 'affidavit.db'}"
    if not path.parent.is_dir():
        return f"the directory of {path} does not exist; create it, or point {setting} at a file in one that does"
    return None


def sqlite_unwritable(url: str) -> str | None:
    """Why this user cannot write the SQLite journal at ``url`` (the file, or its directory, where
    SQLite creates the file and keeps its -wal and -shm files), or None. The broker must write
    its journal: it forwards nothing without a durable record."""
    import os
    from pathlib import Path

    if (database := sqlite_file(url)) is None:
        return None
    path = Path(database).absolute()
    who = f"this user (uid {os.getuid()})"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        what = "cannot be created there" if not path.exists() else "cannot keep its -wal and -shm files beside it"
        return f"the directory {path.parent} is not writable by {who}, so the journal {what}"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"the journal file {path} is not readable and writable by {who}"
    return None


def current(url: str) -> str | None:
    """The revision the database is at, or None for a database without the version table."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    async def read() -> str | None:
        engine = create_async_engine(url, connect_args=connect_args(url))
        try:
            return await revision(engine)
        finally:
            await engine.dispose()

    return asyncio.run(read())


async def revision(engine: Any) -> str | None:
    """:func:`current` on an engine the caller holds."""
    from sqlalchemy import text

    from .queries import schema_missing

    async with engine.connect() as conn:
        try:
            return (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
        except Exception as exc:
            if schema_missing(exc):
                return None
            raise  # permission denied, say: not "no schema", which an upgrade would act on


def head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config("sqlite://")).get_current_head() or ""


def known(revision: str) -> bool:
    """Whether this installation's history has ``revision`` (a newer broker's schema is not)."""
    from alembic.script import ScriptDirectory

    return any(script.revision == revision for script in ScriptDirectory.from_config(_config("sqlite://")).walk_revisions())
