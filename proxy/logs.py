"""Structured logs: one JSON object per line on stderr, never a secret.

Every record carries ``ts``, ``level``, ``logger`` and ``msg``; fields passed with ``extra=``
(invocation id, route, phase, outcome, code, durations) become top-level keys, so a log pipeline
can filter on them. Library loggers (mitmproxy, uvicorn, asyncio) are kept at WARNING unless the
broker runs at DEBUG.
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
    root.setLevel(numeric)
    quiet = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for name in ("mitmproxy", "uvicorn", "uvicorn.error", "asyncio", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(quiet)
