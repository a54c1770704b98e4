"""The request fingerprint: what makes two requests the same operation.

sha256 over a canonical JSON form of the method, the normalized target, the body's hash and the
headers that define the operation. The injected credential is never part of it (the fingerprint
is computed from the agent's request, before injection), so it can be stored, shown to an
approver and compared on retries without revealing anything secret.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable

#: Headers that change what the remote does with the same bytes.
OPERATION_HEADERS = ("content-type", "content-encoding")


def normalized_target(scheme: str, host: str, port: int, path: str) -> str:
    """Lower-case scheme and host, explicit port, path and query exactly as sent."""
    host = host.lower().rstrip(".")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme.lower()}://{host}:{port}{path or '/'}"


def body_sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def fingerprint(
    method: str,
    target: str,
    body: bytes,
    headers: Iterable[tuple[str, str]],
    extra_headers: Iterable[str] = (),
) -> str:
    wanted = set(OPERATION_HEADERS) | {h.lower() for h in extra_headers}
    selected: dict[str, list[str]] = {}
    for name, value in headers:
        key = name.lower()
        if key in wanted:
            selected.setdefault(key, []).append(value.strip())
    canonical = {
        "v": 1,
        "method": method.upper(),
        "target": target,
        "body_sha256": body_sha256(body),
        "headers": {k: selected[k] for k in sorted(selected)},
    }
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest}"


def approval_fingerprint(
    method: str, target: str, body_sha256: str, credential_id: str | None, credential_version: str | None, injection: str | None
) -> str:
    """What an approval approves (contract section 12): this target, method and body, sent with
    this credential version and injection method, and nothing else."""
    canonical = {
        "v": 1,
        "method": method.upper(),
        "target": target,
        "body_sha256": body_sha256,
        "credential_id": credential_id,
        "credential_version": credential_version,
        "injection": injection,
    }
    return "sha256:" + hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_digest(route_config: str) -> str:
    """A digest of the route's configuration: an approval given under one config authorises
    nothing under another."""
    return "sha256:" + hashlib.sha256(route_config.encode()).hexdigest()
