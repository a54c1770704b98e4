"""Alembic environment: one history for SQLite and PostgreSQL, run with the async drivers."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

import proxy.store.vault_schema  # noqa: F401  (its tables share the metadata)
from proxy.store.migrate import connect_args
from proxy.store.schema import metadata

config = context.config
#: The advisory lock key an upgrade of a PostgreSQL journal holds ("AFDV" in ASCII).
UPGRADE_LOCK = 0x41464456


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # One upgrade at a time (two operators, two brokers with auto_upgrade): a second waits
            # here until the first commits, then finds the schema it made, instead of failing on
            # the same CREATE. (SQLite: proxy.store.migrate.upgrade holds a lock on the file.)
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({UPGRADE_LOCK})")
        config.attributes["revision_before"] = context.get_context().get_current_revision()
        context.run_migrations()


async def _online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    engine = create_async_engine(url, connect_args=connect_args(url))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_online())
