"""Test-only failpoints at the boundaries between durable steps.

Inert unless ``AFFIDAVIT_FAILPOINTS`` is set when the process starts, e.g.::

    AFFIDAVIT_FAILPOINTS="after_dispatch_commit=kill;after_lease=pause:3@1"

Each entry is ``name=action[@count]``; actions are ``kill`` (SIGKILL this process: no clean-up,
no flush, like a crash), ``raise`` (an exception at that point), and ``pause:SECONDS``.
``@count`` fires the failpoint only that many times. A process started without the variable
pays one dictionary lookup per failpoint and nothing else.

Names (see :data:`NAMES`) are documented in docs/operations.md; an unknown name in the variable is
an error at start, so a typo cannot silently disable a crash test.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("affidavit.failpoints")

ENV = "AFFIDAVIT_FAILPOINTS"

NAMES = frozenset(
    {
        "before_claim",  # a keyed request was looked up (no record has its key), its key is not bound yet
        "before_credential",  # after PREFLIGHT_VALIDATED is durable, before the secret is read
        "during_tls",  # the new upstream connection is established, DISPATCH_STARTED not yet written
        "after_dispatch_commit",  # DISPATCH_STARTED durable, no request byte written yet
        "after_request_sent",  # the whole request was handed to the transport
        "mid_response_headers",  # response headers are being received
        "mid_response_body",  # the framed body is being read
        "after_response_complete",  # the response is complete, nothing about it recorded yet
        "after_result_commit",  # RESULT_COMMITTED durable, not yet handed to the caller
        "during_delivery",  # the response is being handed to the caller
        "after_lease",  # a re-send took its lease, DISPATCH_STARTED not yet written
        "after_approval",  # an operator approved; the credential is not read yet
        "journal_before_commit",  # the journal writer is about to commit a batch
        "worker_start",  # a worker of `run --workers N` listens on the shared ports, not yet ready
        "sqlite_writer_start",  # the SQLite journal is about to start its writer process
        "heartbeat",  # recovery is about to write this broker's heartbeat
    }
)


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""


@dataclass
class _Action:
    kind: str
    seconds: float = 0.0
    remaining: int | None = None


def _parse(spec: str) -> dict[str, _Action]:
    actions: dict[str, _Action] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, action = entry.partition("=")
        if name not in NAMES:
            raise ValueError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(sorted(NAMES))})")
        action, _, count = action.partition("@")
        kind, _, arg = action.partition(":")
        if kind not in ("kill", "raise", "pause"):
            raise ValueError(f"{ENV}: {name}: action must be kill, raise or pause:SECONDS")
        try:
            seconds, remaining = float(arg or 0), int(count) if count else None
        except ValueError:
            seconds, remaining = math.nan, None
        if (not math.isfinite(seconds) or seconds < 0 or (kind != "pause" and arg) or (kind == "pause" and not arg)
                or (remaining is not None and remaining < 1)):
            raise ValueError(f"{ENV}: {name}: {entry!r} is not name=action[@count] (pause takes a finite number of "
                             "seconds, 0 or more; kill and raise take none; count is a whole number, 1 or more)")
        actions[name] = _Action(kind, seconds, remaining)
    return actions


def _load(spec: str) -> tuple[dict[str, _Action], str | None]:
    try:
        return _parse(spec), None
    except ValueError as exc:
        return {}, str(exc)


#: The failpoints set, and why the variable could not be read (``affidavit run`` refuses to start
#: then: a drill that silently ran without its fault would prove nothing).
_ACTIVE, PROBLEM = _load(os.environ.get(ENV, ""))


def active() -> bool:
    return bool(_ACTIVE)


def _fire(name: str, *, may_pause: bool) -> _Action | None:
    """Count one firing of an armed failpoint and do ``kill``/``raise``; a ``pause`` (when it
    may act here) is returned for the caller to sleep."""
    action = _ACTIVE.get(name)
    if action is None or action.remaining == 0 or (action.kind == "pause" and not may_pause):
        return None
    if action.remaining is not None:
        action.remaining -= 1
    log.warning("failpoint %s: %s", name, action.kind)
    if action.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.kind == "raise":
        raise FailpointError(f"failpoint {name}")
    return action


def failpoint_now(name: str) -> None:
    """The synchronous form, for hooks that must not yield: ``kill`` and ``raise`` only."""
    if _ACTIVE:
        _fire(name, may_pause=False)


async def failpoint(name: str) -> None:
    """Act if the failpoint ``name`` is armed; otherwise return at once."""
    if _ACTIVE and (pause := _fire(name, may_pause=True)) is not None:
        await asyncio.sleep(pause.seconds)
