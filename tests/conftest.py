"""Shared fixtures: test PKI, the hostile upstream, databases on both dialects, real brokers.

PostgreSQL is the machine's server (or ``AFFIDAVIT_TEST_DATABASE_URL``), one fresh database per
broker. When neither answers, the run starts a throwaway cluster of its own (``initdb`` from the
machine's PostgreSQL binaries) and removes it at the end; only without those binaries are the
PostgreSQL tests skipped, and with ``CI=true`` that fails the run instead.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.support.broker import Agent, BrokerProcess, free_ports
from tests.support.canaries import CANARIES
from tests.support.certs import TestPKI
from tests.support.hostile import HostileUpstream
from sqlalchemy.engine import make_url

from tests.support.pg import (
    ThrowawayCluster,
    drop_stale_test_databases,
    fresh_database,
    require_postgres,
    server_available,
    server_url,
)

DIALECTS = ["sqlite", "postgresql"]

# The suite starts some 140 brokers as `python -O -m proxy run`. pip compiles a fresh venv's
# packages for plain `python` only, so without this every one of those starts compiled mitmproxy,
# SQLAlchemy, pydantic and the rest from source again (~5 s of CPU each) on a machine whose
# environment says PYTHONDONTWRITEBYTECODE=1 (this kind of machine, and CI on it, do). Children
# inherit the environment: the first start writes the optimized bytecode, later ones read it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def upstream_server(pki: TestPKI) -> Iterator[HostileUpstream]:
    with HostileUpstream(pki) as server:
        yield server


@pytest.fixture
def upstream(upstream_server: HostileUpstream) -> Iterator[HostileUpstream]:
    upstream_server.reset()
    yield upstream_server
    assert not upstream_server.errors, upstream_server.errors


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = require_postgres(server_url())
    drop_stale_test_databases(url)
    return url


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> Iterator[str]:
    """The name of a PostgreSQL database at the current schema, migrated once per worker: a
    database that must start migrated is a copy of it (``CREATE DATABASE ... TEMPLATE``), the
    same tables, triggers, functions and views as an upgrade of an empty one, without running
    the nine migrations (and, for a broker, the ``affidavit db upgrade`` process) every time."""
    from proxy.store import migrate

    url, drop = fresh_database(pg_admin_url)
    migrate.upgrade(url)
    yield make_url(url).database
    drop()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite journal at the current schema, migrated once per worker, copied for every SQLite
    database that must start migrated (the migrations' many commits each wait for the disk)."""
    from proxy.store import migrate

    path = tmp_path_factory.mktemp("sqlite-template") / "journal.db"
    migrate.upgrade(f"sqlite+aiosqlite:///{path}")
    leftovers = [p.name for p in path.parent.iterdir() if p != path]
    assert not leftovers, f"the migrated journal must be one closed file to be copied: {leftovers}"
    return path


def database_url(
    dialect: str,
    workdir: Path,
    request: pytest.FixtureRequest,
    cleanup: list[Callable[[], None]] | None = None,
    *,
    migrated: bool = False,
) -> str:
    """A fresh database of ``dialect`` that is dropped when the test (or module) ends, or by
    whoever holds ``cleanup`` (when brokers on it must stop first). Empty, or with ``migrated``
    at the current schema (a copy of a migrated template: :func:`pg_template`,
    :func:`sqlite_template`)."""
    if dialect == "sqlite":
        path = workdir / "journal.db"
        if migrated:
            shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite+aiosqlite:///{path}"
    admin = request.getfixturevalue("pg_admin_url")
    url, drop = fresh_database(admin, template=request.getfixturevalue("pg_template") if migrated else None)
    if cleanup is not None:
        cleanup.append(drop)
    else:
        request.addfinalizer(drop)
    return url


@pytest.fixture(params=DIALECTS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database per dialect, migrated to the current schema."""
    return database_url(request.param, tmp_path, request, migrated=True)


def standard_routes(up: HostileUpstream) -> list[dict[str, Any]]:
    good = f"127.0.0.1:{up.tls_port('good')}"
    return [
        {
            "name": "payments.create",
            "host": "api.payments.test",
            "port": 443,
            "methods": ["GET", "POST", "PUT", "DELETE"],
            "path": "/*",
            "agents": ["builder"],
            "credential": "payments-key",
            "inject": {"header": "Authorization", "value": "Bearer {secret}"},
            "max_body": "64KiB",
            "connect_to": good,
        },
        {
            "name": "basic",
            "host": "basic.example.test",
            "port": 443,
            "methods": ["GET", "POST"],
            "agents": ["builder"],
            "credential": "basic-key",
            "inject": {"basic": "svc"},
            "connect_to": good,
        },
        {
            "name": "plain",
            "host": "plain.example.test",
            "port": 80,
            "scheme": "http",
            "methods": ["GET", "POST"],
            "agents": ["builder"],
            "credential": "payments-key",
            "inject": {"header": "X-Api-Key", "value": "{secret}"},
            "connect_to": f"127.0.0.1:{up.http_port}",
        },
        {
            "name": "review",
            "host": "review.example.test",
            "port": 443,
            "methods": ["GET"],
            "agents": ["reviewer"],
            "connect_to": good,
        },
    ]


def make_config(workdir: Path, db_url: str, pki: TestPKI, routes: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    proxy_port, api_port = free_ports(2)
    config: dict[str, Any] = {
        # A stop cuts what is in flight at once, as most stop tests want; the drain has its own tests.
        "proxy": {"listen": f"127.0.0.1:{proxy_port}", "confdir": str(workdir / "conf"), "drain": "10ms"},
        "api": {"listen": f"127.0.0.1:{api_port}", "operator_token": "env:AFFIDAVIT_TEST_OPERATOR"},
        "database": {"url": db_url},
        "upstream": {"ca_bundle": pki.ca_cert, "connect_timeout": "3s", "response_timeout": "10s", "result_horizon": "30s"},
        "agents": [
            {"name": "builder", "token": "env:BUILDER_TOKEN"},
            {"name": "reviewer", "token": "env:REVIEWER_TOKEN"},
        ],
        "secrets": [
            {"name": "payments-key", "from": "env:PAYMENTS_KEY"},
            {"name": "basic-key", "from": "env:BASIC_KEY"},
        ],
        "routes": routes,
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


BrokerFactory = Callable[..., BrokerProcess]


@pytest.fixture
def make_broker(tmp_path: Path, pki: TestPKI, upstream: HostileUpstream, request: pytest.FixtureRequest) -> Iterator[BrokerFactory]:
    """Start a broker on the given dialect; every broker is stopped when the test ends."""
    started: list[BrokerProcess] = []
    # Databases made here are dropped after the brokers stop. A finalizer added while the test
    # runs would run first (finalizers are last in, first out), dropping a database under a
    # running broker that keeps reconnecting to it.
    drops: list[Callable[[], None]] = []

    def factory(
        dialect: str = "sqlite",
        routes: list[dict[str, Any]] | None = None,
        start: bool = True,
        like: BrokerProcess | None = None,
        env: dict[str, str] | None = None,
        db_url: str | None = None,
        **sections: Any,
    ) -> BrokerProcess:
        """A new broker; ``like=other`` makes a replica on the same database with the same tokens;
        ``db_url`` puts it on a database the test made (through a relay, a throwaway cluster)."""
        workdir = tmp_path / f"broker{len(started)}"
        workdir.mkdir()
        # A database made here starts at the current schema (a copy of a migrated template), so
        # the broker needs no `affidavit db upgrade` first; one the test made (``db_url``) may not.
        migrated = db_url is None and (like is None or like.migrated)
        if db_url is None:
            db_url = like.database_url if like is not None else database_url(dialect, workdir, request, drops, migrated=True)
        broker = new_broker(workdir, db_url, pki, routes or standard_routes(upstream), like=like, env=env,
                            migrated=migrated, **sections)
        started.append(broker)
        return broker.start() if start else broker

    yield factory
    try:
        for broker in started:
            broker.stop()
    finally:
        for drop in drops:
            drop()


def new_broker(
    workdir: Path,
    db_url: str,
    pki: TestPKI,
    routes: list[dict[str, Any]],
    *,
    like: BrokerProcess | None = None,
    env: dict[str, str] | None = None,
    migrated: bool = False,
    **sections: Any,
) -> BrokerProcess:
    """A broker process (not started). ``like``: share that broker's tokens (a replica);
    ``migrated``: the database is at the current schema already (no ``affidavit db upgrade``)."""
    if like is not None:
        agents, operator = like.agents, like.operator_token
    else:
        agents = {"builder": Agent("builder", secrets.token_hex(8)), "reviewer": Agent("reviewer", secrets.token_hex(8))}
        operator = secrets.token_hex(8)
    extra_env = env or {}
    env = {
        "BUILDER_TOKEN": agents["builder"].token,
        "REVIEWER_TOKEN": agents["reviewer"].token,
        "AFFIDAVIT_TEST_OPERATOR": operator,
        **CANARIES,
        **extra_env,
    }
    return BrokerProcess(workdir, make_config(workdir, db_url, pki, routes, **sections), env, agents, operator,
                         migrated=migrated)


@pytest.fixture(scope="module", params=DIALECTS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pki: TestPKI, upstream_server: HostileUpstream) -> Iterator[BrokerProcess]:
    """One broker per module and dialect, with the standard routes."""
    yield from module_broker(request, tmp_path_factory, pki, standard_routes(upstream_server), name="broker")


def module_broker(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    pki: TestPKI,
    routes: list[dict[str, Any]],
    *,
    name: str,
    dialect: str | None = None,
    prepare: Callable[[BrokerProcess], BrokerProcess] | None = None,
    **sections: Any,
) -> Iterator[BrokerProcess]:
    """The body of a module-scoped broker fixture: one broker for all of a module's tests, on
    ``dialect`` (default: the fixture's parameter); ``prepare`` adjusts it before it starts."""
    dialect = dialect or request.param
    workdir = tmp_path_factory.mktemp(f"{name}-{dialect}")
    process = new_broker(workdir, database_url(dialect, workdir, request, migrated=True), pki, routes, migrated=True,
                         **sections)
    if prepare is not None:
        process = prepare(process)
    process.start()
    yield process
    process.stop()


_MEASUREMENTS: list[str] = []


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``report(line)``: a measurement printed in the run's summary (not hidden by capture).

    The line travels with the test's report, so it reaches the summary from parallel workers too.
    """
    return lambda line: request.node.user_properties.append((_MEASUREMENT, line))


_MEASUREMENT = "affidavit measurement"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _MEASUREMENTS.extend(line for name, line in report.user_properties if name == _MEASUREMENT)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MEASUREMENTS:
        terminalreporter.section("affidavit measurements")
        for line in _MEASUREMENTS:
            terminalreporter.write_line(line)


# The modules that take longest (brokers, CLI processes; measured on two cores), longest first.
# The parallel workers start on these and end on the quick unit-test modules, instead of one
# worker finishing test_workers.py (the last file by name) alone while the others idle. Modules
# not named here run after them, in their usual order; a module's own tests keep theirs.
LONGEST_FIRST = [
    "test_crash.py",
    "test_config.py",
    "test_vault.py",
    "test_audit.py",
    "test_human_control_branches.py",
    "test_operator_signals.py",
    "test_workers.py",
    "test_broker_e2e.py",
    "test_human_control.py",
    "test_evidence_and_views.py",
    "test_retries.py",
    "test_sqlite_writer.py",
    "test_encryption_e2e.py",
    "test_deploy.py",
    "test_hostile_contract.py",
    "test_routing_and_keys.py",
    "test_agents_clients.py",
]


@pytest.hookimpl(trylast=True)  # after pytest grouped the tests by their fixtures' parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: modules stay whole


_OWN_CLUSTER: list[ThrowawayCluster] = []


def pytest_configure(config: pytest.Config) -> None:
    """No PostgreSQL answering: start one for this run, so the PostgreSQL tests still run."""
    if os.environ.get("AFFIDAVIT_TEST_DATABASE_URL") or server_available(server_url()):
        return
    cluster = ThrowawayCluster(max_connections=200)
    try:
        cluster.start()
    except Exception as exc:  # no initdb here (or no postgres user): require_postgres() says what to do
        cluster.cleanup()
        config.stash[_NO_CLUSTER] = f"could not start a throwaway PostgreSQL cluster either: {exc}"
        return
    _OWN_CLUSTER.append(cluster)
    os.environ["AFFIDAVIT_TEST_DATABASE_URL"] = cluster.url()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _OWN_CLUSTER:
        _OWN_CLUSTER.pop().cleanup()


_NO_CLUSTER = pytest.StashKey[str]()


def pytest_report_header(config: pytest.Config) -> str:
    url = server_url()
    where = "a throwaway cluster of this run" if _OWN_CLUSTER else "the configured server"
    line = f"affidavit: PostgreSQL for tests at {url.split('@')[-1]}, {where} ({'up' if server_available(url) else 'DOWN'})"
    return line + (f"; {config.stash[_NO_CLUSTER]}" if _NO_CLUSTER in config.stash else "")
