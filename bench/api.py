"""The side-API benchmark (``python bench/run.py --api``): fetching recorded results.

Agents read results back with ``GET /v1/invocations/{id}/result`` far more often than they call
anything else on the side API. To measure it, each Affidavit target first records real
invocations (plain-HTTP requests through its proxy; every response names its invocation in
``Affidavit-Invocation-Id``), then ``loadgen.py`` drives the side API directly: keep-alive
connections, ``Authorization: Bearer <agent token>``, the requests cycling through the ids.
Every answer must be a 200 carrying ``Affidavit-Replayed: true`` (a replay of the stored
result); anything else is an error of the run.
"""

from __future__ import annotations

import base64
import http.client
from typing import Any

from services import AGENT, TOKEN, Target, Upstream

#: The goal the side API was tuned for (req/s at concurrency 32); the report says whether it is met.
GOAL_RPS, GOAL_CONCURRENCY = 2000.0, 32
INVOCATION_HEADER = "Affidavit-Invocation-Id"
REPLAYED_HEADER = "Affidavit-Replayed: true"


class SeedError(Exception):
    """Recording the invocations failed; the message says which request and how."""


def record_invocations(target: Target, upstream: Upstream, count: int, timeout: float = 10.0) -> list[str]:
    """Send ``count`` requests through the target's proxy (one keep-alive connection) and
    return the invocation id of each."""
    auth = base64.b64encode(f"{AGENT}:{TOKEN}".encode()).decode()
    url = f"http://127.0.0.1:{upstream.http_port}/"
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=timeout)
    ids: list[str] = []
    try:
        for i in range(count):
            conn.request("GET", url, headers={"Proxy-Authorization": f"Basic {auth}"})
            resp = conn.getresponse()
            body = resp.read()
            invocation = resp.getheader(INVOCATION_HEADER)
            if resp.status != 200 or not invocation:
                raise SeedError(
                    f"request {i + 1}/{count} through {target.name}'s proxy answered {resp.status} "
                    f"{'without' if not invocation else 'with'} {INVOCATION_HEADER}: {body[:200]!r}"
                )
            ids.append(invocation)
    except (OSError, http.client.HTTPException) as exc:
        raise SeedError(f"request {len(ids) + 1}/{count} through {target.name}'s proxy failed: {exc!r}") from None
    finally:
        conn.close()
    if len(set(ids)) != count:
        raise SeedError(f"{target.name} answered {count} requests with only {len(set(ids))} distinct invocation ids")
    return ids


def plan(target: Target, ids: list[str], concurrency: int, warmup: float, duration: float) -> dict[str, Any]:
    """A ``loadgen.py`` plan against the target's side API; its CPU is watched as ``api``."""
    assert target.api_port is not None
    return {
        "proxy_host": "127.0.0.1",
        "proxy_port": 0,  # direct: no proxy in between
        "path": "http",
        "direct": True,
        "target_host": "127.0.0.1",
        "target_port": target.api_port,
        "concurrency": concurrency,
        "warmup": warmup,
        "duration": duration,
        "auth": None,
        "proxy_ca": None,
        "uris": [f"/v1/invocations/{i}/result" for i in ids],
        "headers": {"Authorization": f"Bearer {TOKEN}"},
        "expect_header": REPLAYED_HEADER,
        "watch": {"api": target.child.pid},
        "pg_database": target.pg_database,
    }
