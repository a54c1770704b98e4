"""Canary secrets: planted as upstream credentials. No database, log, envelope, metric or API
answer may ever contain them; the upstream must receive them."""

from __future__ import annotations

import secrets

CANARIES = {
    "PAYMENTS_KEY": "sk_canary_" + secrets.token_hex(12),
    "BASIC_KEY": "bk_canary_" + secrets.token_hex(12),
}
