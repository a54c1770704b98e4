"""Prometheus metrics (``GET /metrics``). Labels are closed enums and configured route names only:
never a URL, an id, a token or anything else unbounded or secret.

Phase and outcome are separate labels: ``connection_setup``/``not_attempted`` rising means routing,
certificates or auth; ``remote_execution``/``unknown`` rising means reconciliation work.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# No `*_created` gauge beside each counter and histogram (the time the series began, one more
# series per label set): Prometheus does not need it, and docs/api.md lists what is exposed.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)

INVOCATIONS = Counter(
    "affidavit_invocations",
    "Ended invocation attempts, by where they stopped and what is known of the effect.",
    ["route", "phase", "outcome", "code"],
    registry=REGISTRY,
)
DISPATCH_RECORD = Histogram(
    "affidavit_dispatch_record_seconds",
    "Time to make DISPATCH_STARTED durable (the wait before the first request byte).",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
JOURNAL_ERRORS = Counter(
    "affidavit_journal_errors", "Journal batches that could not be made durable.", registry=REGISTRY
)
IN_FLIGHT = Gauge(
    "affidavit_in_flight", "Agent requests being handled right now.", registry=REGISTRY, multiprocess_mode="livesum"
)
REPLAYS = Counter("affidavit_replays", "Recorded results served again instead of re-executing.", ["channel"], registry=REGISTRY)
PROXY_AUTH_REJECTED = Counter(
    "affidavit_proxy_auth_rejected",
    "Requests refused with 407 for wrong proxy credentials, by configured agent name ((unknown) otherwise).",
    ["agent"],
    registry=REGISTRY,
)
REQUEST_TIMEOUTS = Counter(
    "affidavit_request_timeouts",
    "Agent requests refused with 408 because their head (request line and headers) or body did not arrive "
    "within its deadline, by which part.",
    ["part"],
    registry=REGISTRY,
)
for _part in ("head", "body"):  # zero until the first, so that an alert on its rate has a series to watch
    REQUEST_TIMEOUTS.labels(_part)
RECOVERED = Counter(
    "affidavit_recovered", "In-flight records of stopped brokers closed by this broker.", registry=REGISTRY
)


def invocation_ended(route: str | None, phase: str, outcome: str, code: str | None) -> None:
    INVOCATIONS.labels(route or "(none)", phase, outcome, code or "").inc()


def exposition() -> tuple[bytes, str]:
    """This process's metrics; under ``--workers N`` (a shared ``PROMETHEUS_MULTIPROC_DIR``),
    every worker's, summed, whichever worker answers."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
