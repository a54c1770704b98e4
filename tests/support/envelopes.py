"""Every envelope the suite receives is checked against docs/envelope.schema.json: tests call
:func:`check_envelope` on what they inspect, and the httpx clients of tests/support/broker.py
check every broker-originated failure they receive, whether the test looks at it or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "envelope.schema.json").read_text())
_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

#: The codes of the envelopes validated in this run.
VALIDATED: list[str] = []


def check_envelope(body: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """Parse and validate an envelope; fails the test with the schema's reason."""
    envelope = json.loads(body) if isinstance(body, (bytes, str)) else body
    errors = sorted(_VALIDATOR.iter_errors(envelope), key=lambda e: list(e.path))
    assert not errors, "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
    VALIDATED.append(envelope["error"]["code"])
    return envelope
