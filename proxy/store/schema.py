"""The journal's tables, declared once with SQLAlchemy Core (both dialects).

``events`` is the append-only truth; ``invocations`` is a projection of it (one row per
invocation, rewritten as events arrive) kept so lookups and metrics need no replay;
``results`` holds the retrievable final response of each invocation that has one.

Timestamps are for humans; order is by ``events.seq``, which is monotonic per invocation.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

Timestamp = DateTime(timezone=True)

invocations = Table(
    "invocations",
    metadata,
    Column("invocation_id", String(40), primary_key=True),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Column("agent", String(100), nullable=False),
    Column("route", String(200)),
    Column("method", String(16), nullable=False),
    Column("target", Text, nullable=False),
    Column("fingerprint", String(80), nullable=False),
    Column("idempotent", Boolean, nullable=False),
    Column("credential_id", String(100)),
    Column("credential_version", String(100)),
    Column("injection", String(20)),
    Column("idempotency_key", String(255)),
    Column("idempotency_scope", String(200)),
    Column("idempotency_expires_at", Timestamp),
    Column("remote_contract", Boolean, nullable=False, default=False),
    # The projection (see proxy.contract.Record); rewritten on every commit of new events.
    Column("stage", String(32), nullable=False),
    Column("phase", String(32), nullable=False),
    Column("outcome", String(32), nullable=False),
    Column("retry", String(32)),
    Column("code", String(64)),
    Column("caller_disposition", String(32), nullable=False),
    Column("dispatch_started", Boolean, nullable=False),
    Column("dispatch_seq", Integer),
    Column("status", Integer),
    Column("last_seq", Integer, nullable=False),
    # Ownership, leases and fencing: which broker runs the invocation now, and until when.
    Column("owner", String(100), nullable=False),
    Column("lease_expires_at", Timestamp),
    Column("generation", Integer, nullable=False, default=0),
    Column("attempts_used", Integer, nullable=False, default=0),
    Column("retry_budget", Integer, nullable=False, default=0),
    # How many times the recorded result was served again (same key, or a result fetch).
    Column("replays", Integer, nullable=False, default=0, server_default="0"),
)

Index("ix_invocations_created_at", invocations.c.created_at)
Index("ix_invocations_outcome_route", invocations.c.outcome, invocations.c.route)
Index("ix_invocations_owner_stage", invocations.c.owner, invocations.c.stage)
# Records in flight, oldest first: the recovery sweep and the approvals list (migration 0011).
Index("ix_invocations_stage_created_at", invocations.c.stage, invocations.c.created_at)
Index(
    "uq_invocations_idempotency",
    invocations.c.agent,
    invocations.c.idempotency_scope,
    invocations.c.idempotency_key,
    unique=True,
)

events = Table(
    "events",
    metadata,
    Column("invocation_id", String(40), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("kind", String(40), nullable=False),
    Column("at", Timestamp, nullable=False),
    # The audit chain: each writer (broker process) keeps its own chain, so brokers never
    # serialise behind one lock; `hash` covers the canonical stored bytes of the row.
    Column("writer", String(100), nullable=False),
    Column("writer_seq", BigInteger, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
    Column("key_id", String(64)),
    Column("payload", LargeBinary, nullable=False),
)

Index("uq_events_writer_seq", events.c.writer, events.c.writer_seq, unique=True)

results = Table(
    "results",
    metadata,
    Column("invocation_id", String(40), primary_key=True),
    Column("stored_at", Timestamp, nullable=False),
    Column("status", Integer, nullable=False),
    Column("headers", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("body_sha256", String(64), nullable=False),
    Column("framing", String(32), nullable=False),
    Column("key_id", String(64)),
)

brokers = Table(
    "brokers",
    metadata,
    Column("owner", String(100), primary_key=True),
    Column("instance", String(100), nullable=False),
    Column("started_at", Timestamp, nullable=False),
    Column("heartbeat_at", Timestamp, nullable=False),
)
