"""Read a broker's journal from outside the broker, synchronously, for assertions.

Deliberately independent of the broker's code: SQLite through the stdlib, PostgreSQL through
``psql``/``pg_dump``, so a test sees what is durably on disk, not what the broker believes.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

from sqlalchemy.engine import make_url


def _sqlite_path(url: str) -> Path:
    return Path(make_url(url).database or "")


def _pg_args(url: str) -> list[str]:
    u = make_url(url)
    return ["-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres", "-d", u.database or ""]


def query(url: str, sql: str) -> list[tuple[str, ...]]:
    """Rows of ``sql`` as strings (both dialects)."""
    if url.startswith("sqlite"):
        with sqlite3.connect(f"file:{_sqlite_path(url)}?mode=ro", uri=True, timeout=10) as conn:
            return [tuple("" if v is None else str(v) for v in row) for row in conn.execute(sql)]
    out = subprocess.run(["psql", "-X", "-q", "-At", "-F", "\t", *_pg_args(url), "-c", sql], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return [tuple(line.split("\t")) for line in out.stdout.splitlines() if line]


def dispatched_ids(url: str) -> set[str]:
    return {row[0] for row in query(url, "SELECT invocation_id FROM events WHERE kind = 'DISPATCH_STARTED'")}


def dump_journal(url: str) -> str:
    """Everything the database holds, as text: a logical dump plus (SQLite) the raw files."""
    if url.startswith("sqlite"):
        path = _sqlite_path(url)
        parts = []
        for suffix in ("", "-wal", "-shm"):
            file = Path(str(path) + suffix)
            if file.exists():
                parts.append(file.read_bytes().decode("latin-1"))
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10) as conn:
            parts.extend(conn.iterdump())
        return "\n".join(parts)
    out = subprocess.run(["pg_dump", "--data-only", "--inserts", *_pg_args(url)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout
