"""Structured logs: one JSON object per line on stderr, never a secret.

Every record carries ``ts``, ``level``, ``logger`` and ``msg``; fields passed with ``extra=``
(invocation id, route, phase, outcome, code, durations) become top-level keys, so a log pipeline
can filter on them. Library loggers (mitmproxy, hpack, uvicorn, SQLAlchemy...) are kept at WARNING
whatever the level: their debug output would log headers and rows.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # orjson: one line per ended invocation is on the hot path.
        return orjson.dumps(entry, default=str).decode()


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = getattr(logging, level.upper(), logging.INFO)
    # Only the broker's own loggers follow the level. Libraries stay at WARNING even at "debug":
    # their debug output holds what the broker must never log (hpack logs every header an agent
    # sends, its tokens included; SQLAlchemy logs rows).
    root.setLevel(max(numeric, logging.WARNING))
    logging.getLogger("affidavit").setLevel(numeric)
    for name in ("mitmproxy", "uvicorn", "uvicorn.error", "asyncio", "alembic", "sqlalchemy", "hpack", "h2"):
        logging.getLogger(name).setLevel(logging.WARNING)
