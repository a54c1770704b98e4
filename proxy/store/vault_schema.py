"""Tables of the vault and the audit checkpoints, on the journal's one ``MetaData``.

Kept apart from :mod:`proxy.store.schema` so the vault and the audit can change without touching
the journal's hot-path tables; they share its ``metadata`` so Alembic still sees one schema.
These tables are append-only in the database (migrations 0005 and 0013), like ``events``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, LargeBinary, String, Table

from .schema import Timestamp, metadata

#: One row per version of a secret. ``version`` counts 1, 2, 3... per name (shown as "v1",
#: "v2"); a new value is a new row, never an update, so every version an invocation recorded
#: stays explainable. ``ciphertext`` is AES-GCM under ``key_id``, bound to (name, version).
vault_secrets = Table(
    "vault_secrets",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("key_id", String(64), nullable=False),
    Column("ciphertext", LargeBinary, nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

#: "Writer ``writer`` had written ``writer_seq`` events, the last hashing to ``hash``." Lets
#: ``audit verify`` notice a deleted tail, or a chain rewritten with recomputed hashes.
chain_checkpoints = Table(
    "chain_checkpoints",
    metadata,
    Column("writer", String(100), primary_key=True),
    Column("writer_seq", BigInteger, primary_key=True, autoincrement=False),
    Column("hash", String(64), nullable=False),
    Column("at", Timestamp, nullable=False),
)

#: "The key listed under ``key_id`` is the one that sealed ``sealed``": a known text, AES-GCM under
#: that key, bound to the id (proxy.keychecks). Written by the first broker or command that uses
#: the id; every later one opens it before it writes, so another key file behind the same id is
#: refused instead of storing what the others cannot read.
key_checks = Table(
    "key_checks",
    metadata,
    Column("key_id", String(64), primary_key=True),
    Column("sealed", LargeBinary, nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("created_by", String(200), nullable=False),
)

#: The key ids rows were stored under when key checks began (migration 0013 lists them). Every
#: row stored since is under an id bound first, so an id without a check and not listed here has
#: nothing stored under it, and no table need be read through to find out.
key_ids_before_checks = Table(
    "key_ids_before_checks",
    metadata,
    Column("key_id", String(64), primary_key=True),
)

#: How often a journal writer should record a checkpoint: whichever comes first. Rows written
#: after the newest checkpoint can be cut off the tail unnoticed, so this bounds that window.
CHECKPOINT_EVERY_EVENTS = 256
CHECKPOINT_EVERY_SECONDS = 10.0


def checkpoint_row(writer: str, writer_seq: int, hash: str, at: datetime) -> dict[str, Any]:
    """The ``chain_checkpoints`` row saying ``writer`` reached ``writer_seq`` with ``hash``.

    Insert it in the same transaction as the events it covers (so it never claims rows that did
    not commit), with the writer's chain head after that batch.
    """
    if writer_seq < 1 or len(hash) != 64:
        raise ValueError("a checkpoint covers at least one event and carries a 64-hex-digit hash")
    return {"writer": writer, "writer_seq": int(writer_seq), "hash": hash, "at": at}


def checkpoint_due(writer_seq: int, last_checkpoint_seq: int, seconds_since_last: float) -> bool:
    """Whether the batch that brought the chain to ``writer_seq`` should also write a checkpoint."""
    if writer_seq <= last_checkpoint_seq:
        return False
    return writer_seq - last_checkpoint_seq >= CHECKPOINT_EVERY_EVENTS or seconds_since_last >= CHECKPOINT_EVERY_SECONDS
