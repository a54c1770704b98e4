"""Self-tests for tests/support: the database and network helpers other tests trust.

Every check uses real connections, because a helper that only looks right would
turn outage tests into false greens. Each test is bounded by a pytest timeout
and by client-side timeouts on every connection.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from tests.support.pg import (
    DEFAULT_SERVER_URL,
    START_HINT,
    ThrowawayCluster,
    connect_kwargs,
    drop_stale_test_databases,
    fresh_database,
    require_postgres,
    run_sync,
    server_available,
    server_url,
    sweep_stale_clusters,
)
from tests.support.relay import TcpRelay

pytestmark = pytest.mark.timeout(60)

# What a client may see when the relay resets its socket: asyncpg wraps some
# resets in its own errors, others surface as plain OSErrors.
CONNECTION_LOST = (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError)


def _dead_pid() -> int:
    """A pid that belonged to a process which has just exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def _databases(admin_url: str) -> set[str]:
    conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=5)
    try:
        return {r["datname"] for r in await conn.fetch("SELECT datname FROM pg_database")}
    finally:
        await conn.close(timeout=5)


async def _select_one(url: str, timeout: float = 5.0) -> int:
    conn = await asyncpg.connect(**connect_kwargs(url), timeout=timeout)
    try:
        return int(await conn.fetchval("SELECT 1", timeout=timeout))
    finally:
        await conn.close(timeout=timeout)


@pytest.fixture(scope="module")
def admin_url() -> str:
    return require_postgres()


@pytest.fixture
def relay(admin_url: str) -> Iterator[TcpRelay]:
    kw = connect_kwargs(admin_url)
    with TcpRelay(kw["host"] or "127.0.0.1", kw["port"] or 5432) as r:
        yield r


def _via(relay: TcpRelay, url: str) -> str:
    """The same URL, routed through the relay."""
    return make_url(url).set(host="127.0.0.1", port=relay.listen_port).render_as_string(hide_password=False)


# --------------------------------------------------------------------------- server URL / availability


def test_server_url_prefers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AFFIDAVIT_TEST_DATABASE_URL", raising=False)
    assert server_url() == DEFAULT_SERVER_URL
    monkeypatch.setenv("AFFIDAVIT_TEST_DATABASE_URL", "postgresql+asyncpg://u@db.invalid:6543/x")
    assert server_url() == "postgresql+asyncpg://u@db.invalid:6543/x"


UNREACHABLE = "postgresql+asyncpg://postgres@127.0.0.1:1/postgres"


def test_require_postgres_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as info:
        require_postgres(UNREACHABLE)
    assert START_HINT in str(info.value)


def test_require_postgres_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as info:
        require_postgres(UNREACHABLE)
    assert START_HINT in str(info.value)


def test_require_postgres_returns_url_when_up(admin_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_postgres(admin_url) == admin_url


def test_server_available_is_bounded_against_a_silent_peer() -> None:
    """A port that completes the handshake but never speaks must not hang the probe."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        started = time.monotonic()
        assert not server_available(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres", timeout=0.5)
        assert time.monotonic() - started < 3


# --------------------------------------------------------------------------- fresh databases


def test_fresh_database_is_usable_and_dropped(admin_url: str) -> None:
    url, drop = fresh_database(admin_url)
    name = url.rsplit("/", 1)[1]
    assert url.startswith("postgresql+asyncpg://")
    assert re.fullmatch(rf"affidavit_test_{os.getpid()}_[0-9a-f]{{8}}", name)

    async def use() -> list[str]:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE t (id serial PRIMARY KEY, v text NOT NULL)"))
                await conn.execute(text("INSERT INTO t (v) VALUES ('a'), ('b')"))
            async with engine.connect() as conn:
                return list((await conn.execute(text("SELECT v FROM t ORDER BY id"))).scalars())
        finally:
            await engine.dispose()

    try:
        assert asyncio.run(use()) == ["a", "b"]
        assert name in asyncio.run(_databases(admin_url))
    finally:
        drop()
    assert name not in asyncio.run(_databases(admin_url))
    drop()  # idempotent


def test_drop_terminates_leftover_connections(admin_url: str) -> None:
    """A leaked connection must not block the drop; drop() also works inside a running loop."""
    url, drop = fresh_database(admin_url)
    name = url.rsplit("/", 1)[1]

    async def leak_then_drop() -> None:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=5)
        try:
            assert await conn.fetchval("SELECT 1", timeout=5) == 1
            drop()  # synchronous call from within this loop: runs in a worker thread
            with pytest.raises(CONNECTION_LOST):
                await conn.fetchval("SELECT 1", timeout=5)
        finally:
            conn.terminate()

    try:
        asyncio.run(leak_then_drop())
    finally:
        drop()
    assert name not in asyncio.run(_databases(admin_url))


def test_drop_stale_test_databases_only_drops_orphans(admin_url: str) -> None:
    prefix = "affidavit_selftest_stale"
    orphan = f"{prefix}_{_dead_pid()}_{os.urandom(4).hex()}"

    async def create_orphan() -> None:
        conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=5)
        try:
            await conn.execute(f'CREATE DATABASE "{orphan}"')
        finally:
            await conn.close(timeout=5)

    run_sync(create_orphan)
    mine_url, drop_mine = fresh_database(admin_url, prefix=prefix)
    mine = mine_url.rsplit("/", 1)[1]
    try:
        dropped = drop_stale_test_databases(admin_url, prefix)
        assert orphan in dropped
        assert mine not in dropped
        names = asyncio.run(_databases(admin_url))
        assert orphan not in names and mine in names
    finally:
        drop_mine()
        run_sync(lambda: _drop_if_exists(admin_url, orphan))


async def _drop_if_exists(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=5)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await conn.close(timeout=5)


def test_fresh_database_rejects_odd_prefixes(admin_url: str) -> None:
    with pytest.raises(ValueError):
        fresh_database(admin_url, prefix='x"; DROP DATABASE postgres; --')


# --------------------------------------------------------------------------- throwaway cluster


def test_throwaway_cluster_survives_crash_and_restart() -> None:
    with ThrowawayCluster() as pg:
        assert pg.is_running()
        assert pg.root is not None
        root = pg.root
        assert asyncio.run(_select_one(pg.url())) == 1
        db_url = pg.create_database("journal")

        async def write() -> None:
            conn = await asyncpg.connect(**connect_kwargs(db_url), timeout=5)
            try:
                await conn.execute("CREATE TABLE t (v int)")
                await conn.execute("INSERT INTO t VALUES (42)")  # autocommit: durable once acked
            finally:
                await conn.close(timeout=5)

        asyncio.run(write())

        pg.stop("immediate")
        assert not pg.is_running()
        with pytest.raises((OSError, asyncio.TimeoutError)):
            asyncio.run(_select_one(pg.url(), timeout=2))

        port = pg.port
        pg.start()
        assert pg.port == port, "the URL handed out earlier must stay valid"

        async def read() -> int:
            conn = await asyncpg.connect(**connect_kwargs(db_url), timeout=5)
            try:
                return int(await conn.fetchval("SELECT v FROM t", timeout=5))
            finally:
                await conn.close(timeout=5)

        assert asyncio.run(read()) == 42, "committed row lost across an immediate stop"
        assert "was interrupted" in pg.log_tail(100) or "not properly shut down" in pg.log_tail(100)

        pg.restart()
        assert asyncio.run(read()) == 42
    assert not root.exists()
    assert pg.root is None


def test_throwaway_cluster_runs_beside_the_machine_server(admin_url: str) -> None:
    """The private cluster must not collide with the shared server's port or socket."""
    with ThrowawayCluster() as pg:
        assert pg.port != connect_kwargs(admin_url)["port"]
        assert asyncio.run(_select_one(pg.url())) == 1
        assert asyncio.run(_select_one(admin_url)) == 1


def test_throwaway_cluster_moves_off_a_stolen_port() -> None:
    """The free port is picked early; if someone takes it before the first start, pick another."""
    pg = ThrowawayCluster()
    try:
        pg.init()
        with socket.socket() as thief:
            thief.bind(("127.0.0.1", pg.port))
            thief.listen(1)
            stolen = pg.port
            pg.start()
            assert pg.port != stolen
            assert asyncio.run(_select_one(pg.url())) == 1
    finally:
        pg.cleanup()


def test_sweep_stale_clusters_stops_orphans() -> None:
    pg = ThrowawayCluster()
    try:
        pg.start()
        root = pg.root
        assert root is not None
        (root / "owner.pid").write_text(str(_dead_pid()))
        removed = sweep_stale_clusters(str(root.parent))
        assert root in removed
        assert not root.exists()
        assert not server_available(pg.url(), timeout=1)
    finally:
        pg.cleanup()


def test_sweep_stale_clusters_keeps_live_ones() -> None:
    with ThrowawayCluster() as pg:
        assert pg.root is not None
        assert pg.root not in sweep_stale_clusters(str(pg.root.parent))
        assert pg.is_running()


# --------------------------------------------------------------------------- TCP relay


def _wait_until(predicate: object, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(predicate())  # type: ignore[operator]


def test_relay_forwards_postgres(relay: TcpRelay, admin_url: str) -> None:
    url = _via(relay, admin_url)

    async def session() -> None:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=5)
        try:
            assert await conn.fetchval("SELECT 41 + 1", timeout=5) == 42
            assert relay.connections == 1
        finally:
            await conn.close(timeout=5)

    asyncio.run(session())
    assert relay.bytes_forwarded > 0
    assert _wait_until(lambda: relay.connections == 0)


def test_relay_cut_fails_fast_and_restore_recovers(relay: TcpRelay, admin_url: str) -> None:
    url = _via(relay, admin_url)

    async def scenario() -> None:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=5)
        try:
            assert await conn.fetchval("SELECT 1", timeout=5) == 1
            relay.cut()
            assert relay.connections == 0
            started = time.monotonic()
            with pytest.raises(CONNECTION_LOST):
                await conn.fetchval("SELECT 1", timeout=5)
            assert time.monotonic() - started < 1.0
        finally:
            conn.terminate()

        started = time.monotonic()
        with pytest.raises(CONNECTION_LOST):
            await asyncpg.connect(**connect_kwargs(url), timeout=5)
        assert time.monotonic() - started < 1.0

        relay.restore()
        assert await _select_one(url) == 1

    asyncio.run(scenario())


def test_relay_blackhole_hangs_and_restore_recovers(relay: TcpRelay, admin_url: str) -> None:
    url = _via(relay, admin_url)

    async def scenario() -> None:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=5)
        try:
            relay.blackhole()
            forwarded = relay.bytes_forwarded
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await conn.fetchval("SELECT 1", timeout=0.5)
            assert 0.4 < time.monotonic() - started < 2.0
            assert relay.bytes_forwarded == forwarded, "a blackhole must forward nothing"
        finally:
            conn.terminate()

        with pytest.raises(asyncio.TimeoutError):
            await asyncpg.connect(**connect_kwargs(url), timeout=0.5)
        assert relay.connections >= 1  # accepted and held, like a hung network

        relay.restore()
        assert await _select_one(url) == 1

    asyncio.run(scenario())


def test_relay_blackholed_connection_resumes_on_restore(relay: TcpRelay, admin_url: str) -> None:
    """A short blackhole is a hiccup, not a reset: held bytes are delivered once it heals."""
    url = _via(relay, admin_url)

    async def scenario() -> None:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=5)
        try:
            relay.blackhole()
            query = asyncio.ensure_future(conn.fetchval("SELECT 7", timeout=5))
            await asyncio.sleep(0.3)
            assert not query.done()
            relay.restore()
            assert await query == 7
        finally:
            await conn.close(timeout=5)

    asyncio.run(scenario())


def test_relay_stop_is_bounded_with_held_connections(admin_url: str) -> None:
    kw = connect_kwargs(admin_url)
    relay = TcpRelay(kw["host"] or "127.0.0.1", kw["port"] or 5432).start()
    held = [socket.create_connection(("127.0.0.1", relay.listen_port), timeout=2) for _ in range(3)]
    try:
        relay.blackhole()
        held.append(socket.create_connection(("127.0.0.1", relay.listen_port), timeout=2))
        assert _wait_until(lambda: relay.connections == 4)
        started = time.monotonic()
        relay.stop()
        assert time.monotonic() - started < 3
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", relay.listen_port), timeout=1).close()
    finally:
        for s in held:
            s.close()


def test_cluster_directory_belongs_to_the_server_user() -> None:
    """PostgreSQL refuses a data directory it does not own, and refuses to run as root."""
    with ThrowawayCluster() as pg:
        assert pg.root is not None
        if os.geteuid() == 0:
            import pwd

            assert pg.root.stat().st_uid == pwd.getpwnam("postgres").pw_uid
        assert (pg.data_dir / "PG_VERSION").exists()
        assert (pg.root / f".s.PGSQL.{pg.port}").exists(), "socket belongs in the private directory"
