"""Connections that only read (kept apart from :mod:`proxy.store.journal`, which the readers of
:mod:`proxy.store.leases` and :mod:`proxy.store.queries` would otherwise import in a circle)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

#: The execution option that marks a connection as reading only (see :func:`reading`).
READ_ONLY = "affidavit_read_only"


def reading(engine: AsyncEngine) -> AsyncConnection:
    """A connection for reads only (``async with reading(engine) as conn``). On SQLite its
    transactions begin deferred: they read a snapshot beside the writer instead of taking the write
    lock (BEGIN IMMEDIATE, which every other transaction takes so that writers queue rather than
    deadlock). A read that took the write lock waited behind any writer, and held up every journal
    write (each dispatch) for as long as it ran. PostgreSQL ignores the option."""
    held = engine.sync_engine.__dict__  # made once per engine: a new option engine costs ~0.1 ms
    reader = held.get("_affidavit_reader")
    if reader is None:
        reader = held["_affidavit_reader"] = engine.execution_options(**{READ_ONLY: True})
    return reader.connect()
