"""Structured logs: one JSON object per line on stderr, never a secret.

Every record carries ``ts``, ``level``, ``logger`` and ``msg``; fields passed with ``extra=``
(invocation id, route, phase, outcome, code, durations) become top-level keys, so a log pipeline
can filter on them. Library loggers (mitmproxy, hpack, uvicorn, SQLAlchemy...) are kept at WARNING
whatever the level: their debug output would log headers and rows.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any, Callable, Hashable

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


class LogThrottle:
    """Whether to log one more event of a kind that a client can cause at will (wrong proxy
    credentials, a request that arrives too slowly), without letting a flood of them flood the
    log: the first event of a key (say, a client address) is logged at once; further ones within
    ``window`` seconds are counted, and the next one after the window is logged with that count.
    At most ``keys`` keys are remembered (quiet ones are forgotten first)."""

    def __init__(self, window: float = 60.0, keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self._keys = keys
        self._clock = clock
        self._seen: dict[Hashable, list[float | int]] = {}  # key -> [logged at, not logged since]

    def admit(self, key: Hashable) -> int | None:
        """None: do not log this one (it is counted into the next line); otherwise log it, saying
        how many of this key were not logged in the window before (the returned number)."""
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.window:
            seen[1] += 1
            return None
        skipped = int(seen[1]) if seen is not None else 0
        if seen is None and len(self._seen) >= self._keys:
            self._forget_quiet(now)
        self._seen[key] = [now, 0]
        return skipped

    def suffix(self, key: Hashable, what: str = "like it") -> str | None:
        """:meth:`admit` for a line of its own: None to leave this one out, else what to append to
        it (:meth:`note`)."""
        skipped = self.admit(key)
        return None if skipped is None else self.note(skipped, what)

    def note(self, skipped: int, what: str = "like it") -> str:
        """What a logged line appends: "" or how many ``what`` were left out in the window before."""
        return f" ({skipped} more {what} in the {self.window:.0f} s before, not logged one by one)" if skipped else ""

    def _forget_quiet(self, now: float) -> None:
        quiet = [key for key, (at, skipped) in self._seen.items() if now - at >= self.window and not skipped]
        for key in quiet or list(self._seen)[: len(self._seen) // 2]:
            del self._seen[key]
