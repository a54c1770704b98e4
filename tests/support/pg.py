"""PostgreSQL helpers for Affidavit's tests.

Three needs drive this module:

* Most journal tests want a real PostgreSQL database of their own, created and
  dropped around the test, on whatever server the machine (or CI) provides:
  :func:`server_url`, :func:`require_postgres`, :func:`fresh_database`,
  :func:`drop_stale_test_databases`.
* Outage tests must crash and restart a server, which must never be the
  machine's shared one: :class:`ThrowawayCluster` runs a private cluster in a
  temporary directory and stops it however the test likes.
* All of it must be callable from plain synchronous pytest fixtures, so the
  asyncpg calls are wrapped in :func:`run_sync`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import glob
import os
import pwd
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import asyncpg
import pytest
from sqlalchemy.engine import URL, make_url

__all__ = [
    "DEFAULT_SERVER_URL",
    "START_HINT",
    "ThrowawayCluster",
    "connect_kwargs",
    "drop_stale_test_databases",
    "fresh_database",
    "require_postgres",
    "run_sync",
    "server_available",
    "server_url",
    "sweep_stale_clusters",
]

T = TypeVar("T")

DEFAULT_SERVER_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
START_HINT = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
_ENV_URL = "AFFIDAVIT_TEST_DATABASE_URL"
_PREFIX_RE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_CLUSTER_DIR_PREFIX = "affidavit-pg-"
_OWNER_FILE = "owner.pid"


# --------------------------------------------------------------------------- basics


def run_sync(factory: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """Run ``factory()`` to completion from synchronous code, bounded by ``timeout``.

    Takes a coroutine *function* so nothing is created before we know which loop
    runs it. When the calling thread already runs an event loop (an async test
    calling a sync helper), ``asyncio.run`` would refuse, so the work moves to a
    short-lived worker thread with its own loop.
    """

    async def bounded() -> T:
        return await asyncio.wait_for(factory(), timeout)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(bounded())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, bounded()).result(timeout + 5)


def connect_kwargs(url: str | URL) -> dict[str, Any]:
    """asyncpg ``connect()`` keyword arguments for a SQLAlchemy URL.

    Only host, port, user, password and database are carried over; that is all
    the test servers need, and it keeps driver-specific query options out.
    """
    u = make_url(url) if isinstance(url, str) else url
    return {
        "host": u.host,
        "port": u.port,
        "user": u.username,
        "password": u.password,
        "database": u.database,
    }


def _render(url: URL) -> str:
    """A URL string that still carries its password (SQLAlchemy hides it by default)."""
    return url.render_as_string(hide_password=False)


def _redacted(url: str | URL) -> str:
    """A URL fit for error messages: the password, if any, masked."""
    return (make_url(url) if isinstance(url, str) else url).render_as_string(hide_password=True)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (signal 0 probes only)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- shared server


def server_url() -> str:
    """Admin URL of the PostgreSQL server the tests use.

    ``AFFIDAVIT_TEST_DATABASE_URL`` wins so CI or a developer can point the suite
    elsewhere; otherwise the machine's own server with trust auth.
    """
    return os.environ.get(_ENV_URL) or DEFAULT_SERVER_URL


def server_available(url: str, timeout: float = 3.0) -> bool:
    """True when ``url`` accepts a connection and answers ``SELECT 1`` within ``timeout`` s.

    Short on purpose: a missing server should cost a test run seconds, not minutes.
    """

    async def probe() -> bool:
        conn = await asyncpg.connect(**connect_kwargs(url), timeout=timeout)
        try:
            return await conn.fetchval("SELECT 1", timeout=timeout) == 1
        finally:
            await conn.close(timeout=timeout)

    try:
        return run_sync(probe, timeout=timeout + 1)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncio.TimeoutError, TimeoutError):
        return False


def require_postgres(url: str | None = None) -> str:
    """Return the test server URL, or skip (locally) / fail (CI) when it is down.

    A developer without PostgreSQL should still be able to run the rest of the
    suite, but CI (``CI=true``) must never turn a missing database into a green
    run of skipped tests.
    """
    url = url or server_url()
    if server_available(url):
        return url
    message = (
        f"PostgreSQL is not reachable at {_redacted(url)}. Start it with: {START_HINT}"
        f" (or point {_ENV_URL} at a running server)"
    )
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _test_db_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}_(\d+)_[0-9a-f]{{8}}$")


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"database prefix must match {_PREFIX_RE.pattern!r}: {prefix!r}")


async def _drop_database(admin_url: str, name: str) -> None:
    """Terminate leftover sessions on ``name``, then drop it (no error if absent).

    Termination is asynchronous on the server side, so the DROP is retried for a
    few seconds while the terminated backends are still exiting.
    """
    conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=10)
    try:
        deadline = time.monotonic() + 10
        while True:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
            try:
                await conn.execute(f"DROP DATABASE IF EXISTS {_quote_ident(name)}")
                return
            except asyncpg.ObjectInUseError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await conn.close(timeout=5)


def fresh_database(admin_url: str, prefix: str = "affidavit_test", template: str | None = None) -> tuple[str, Callable[[], None]]:
    """Create a new, uniquely named database and return ``(url, drop)``.

    The name is ``{prefix}_{pid}_{8 hex}``: the pid lets
    :func:`drop_stale_test_databases` recognise databases orphaned by a crashed
    run, the random part keeps parallel fixtures apart. The URL keeps the admin
    URL's driver and credentials. ``drop()`` is idempotent.

    ``template``: the name of a database on the same server to copy (``CREATE DATABASE ...
    TEMPLATE``), say one already migrated; nobody may be connected to it meanwhile.
    """
    _check_prefix(prefix)
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    statement = f"CREATE DATABASE {_quote_ident(name)}"
    if template is not None:
        statement += f" TEMPLATE {_quote_ident(template)}"

    async def create() -> None:
        conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=10)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    await conn.execute(statement)
                    return
                except asyncpg.ObjectInUseError:  # the template's last user is still leaving
                    if template is None or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
        finally:
            await conn.close(timeout=5)

    run_sync(create)
    url = _render(make_url(admin_url).set(database=name))

    def drop() -> None:
        run_sync(lambda: _drop_database(admin_url, name))

    return url, drop


def drop_stale_test_databases(admin_url: str, prefix: str = "affidavit_test") -> list[str]:
    """Drop ``{prefix}_{pid}_{hex}`` databases whose creating process is gone.

    Called once per session so that databases left by killed runs do not pile
    up. Databases of live processes (a parallel run, this run) are left alone.
    Assumes the server and the tests see the same pid space, which holds for a
    server on this machine; a remote server's orphans are simply kept whenever
    the pid happens to be alive here. Returns the names dropped.
    """
    _check_prefix(prefix)
    pattern = _test_db_pattern(prefix)

    async def list_names() -> list[str]:
        conn = await asyncpg.connect(**connect_kwargs(admin_url), timeout=10)
        try:
            rows = await conn.fetch("SELECT datname FROM pg_database")
        finally:
            await conn.close(timeout=5)
        return [r["datname"] for r in rows]

    stale: list[str] = []
    for name in run_sync(list_names):
        match = pattern.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not _pid_alive(pid):
            stale.append(name)
    for name in stale:
        run_sync(lambda name=name: _drop_database(admin_url, name))
    return stale


# --------------------------------------------------------------------------- throwaway cluster


def _find_bindir() -> Path:
    """Directory of initdb/pg_ctl: ``AFFIDAVIT_PG_BINDIR``, else the newest Debian install, else PATH."""
    env = os.environ.get("AFFIDAVIT_PG_BINDIR")
    if env:
        return Path(env)

    def version(path: str) -> float:
        try:
            return float(Path(path).parent.name)
        except ValueError:
            return 0.0

    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found; set AFFIDAVIT_PG_BINDIR")


def _free_port() -> int:
    """An ephemeral port free right now on 127.0.0.1 (racy by nature; start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayCluster:
    """A private PostgreSQL cluster in a temporary directory, for outage tests.

    Tests may crash it (``stop("immediate")``), restart it and delete it without
    disturbing the machine's server: it has its own data directory, its own
    127.0.0.1 port and its own unix socket directory. PostgreSQL refuses to run
    as root, so when the tests run as root every server command runs as the
    ``postgres`` OS user, who owns the directory. ``fsync`` stays on because the
    tests built on this check durability; only initdb skips syncing, for speed.

    Use as a context manager (``with ThrowawayCluster() as pg:``), which starts
    it and cleans up; an ``atexit`` hook also cleans up after forgotten ones.
    """

    def __init__(
        self,
        *,
        os_user: str = "postgres",
        port: int | None = None,
        max_connections: int = 50,
        extra_conf: Mapping[str, str] | None = None,
        startup_timeout: float = 30.0,
        base_dir: str | None = None,
    ) -> None:
        self.bindir = _find_bindir()
        self.os_user = os_user
        self.max_connections = max_connections
        self.extra_conf = dict(extra_conf or {})
        self.startup_timeout = startup_timeout
        self._fixed_port = port is not None
        self.port = port if port is not None else _free_port()
        self._base_dir = base_dir
        self.root: Path | None = None
        self._initialized = False

    # -- paths --------------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self._require_root() / "data"

    @property
    def log_file(self) -> Path:
        return self._require_root() / "server.log"

    def _require_root(self) -> Path:
        if self.root is None:
            raise RuntimeError("cluster not initialised; call init() or start() first")
        return self.root

    # -- running commands as the cluster owner ----------------------------------------

    def _as_owner(self, argv: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return argv
        runuser = shutil.which("runuser")
        if runuser:
            return [runuser, "-u", self.os_user, "--", *argv]
        return ["su", self.os_user, "-s", "/bin/sh", "-c", shlex.join(argv)]

    def _run(self, argv: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        proc = subprocess.run(
            self._as_owner(argv),
            cwd=self._require_root(),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
                f"\nserver log tail:\n{self.log_tail()}"
            )
        return proc

    def _chown(self, path: Path) -> None:
        """Hand ``path`` to the cluster owner when we are root (the server must own its files)."""
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.os_user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _bin(self, name: str) -> str:
        return str(self.bindir / name)

    # -- lifecycle --------------------------------------------------------------------

    def init(self) -> None:
        """Create the directory and run initdb (idempotent). ``start()`` calls it when needed."""
        if self._initialized:
            return
        root = Path(tempfile.mkdtemp(prefix=_CLUSTER_DIR_PREFIX, dir=self._base_dir))
        self.root = root
        (root / _OWNER_FILE).write_text(str(os.getpid()))
        self._chown(root)
        atexit.register(self.cleanup)
        try:
            self._run(
                [
                    self._bin("initdb"),
                    "-D", str(self.data_dir),
                    "-A", "trust",
                    "-U", "postgres",
                    "-E", "UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
                timeout=120,
            )
            self._write_conf()
        except BaseException:
            self.cleanup()
            raise
        self._initialized = True

    def _write_conf(self) -> None:
        """Settings live in an included file so a port change can simply rewrite it."""
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self._require_root()}'",
            "fsync": "on",
            "max_connections": str(self.max_connections),
            "shared_buffers": "'16MB'",
            **self.extra_conf,
        }
        lines = [f"{k} = {v}" for k, v in settings.items()]
        (self.data_dir / "affidavit.conf").write_text("\n".join(lines) + "\n")
        conf = self.data_dir / "postgresql.conf"
        text = conf.read_text()
        if "include 'affidavit.conf'" not in text:
            conf.write_text(text + "\ninclude 'affidavit.conf'\n")
        self._chown(self.data_dir / "affidavit.conf")

    def start(self) -> None:
        """Start the server and return once it answers queries over TCP.

        Bounded by ``startup_timeout``; on failure the error carries the server
        log tail. If the randomly chosen port was grabbed in the meantime, a new
        one is picked (only before the first successful start, so a URL handed
        out earlier stays valid across restarts).
        """
        self.init()
        if self.is_running():
            return
        for attempt in range(3):
            log_size = self.log_file.stat().st_size if self.log_file.exists() else 0
            proc = self._run(
                [
                    self._bin("pg_ctl"),
                    "start",
                    "-D", str(self.data_dir),
                    "-l", str(self.log_file),
                    "-w",
                    "-t", str(int(self.startup_timeout)),
                ],
                timeout=self.startup_timeout + 10,
                check=False,
            )
            if proc.returncode == 0:
                break
            new_log = self._log_since(log_size)
            if not self._fixed_port and attempt < 2 and "could not bind" in new_log:
                self.port = _free_port()
                self._write_conf()
                continue
            raise RuntimeError(
                f"throwaway PostgreSQL failed to start (pg_ctl exit {proc.returncode}):\n"
                f"{proc.stdout}{proc.stderr}\nserver log tail:\n{self.log_tail()}"
            )
        self._fixed_port = True
        self._wait_for_queries()

    def _wait_for_queries(self) -> None:
        """pg_ctl -w watches the pid file; only a real query proves TCP clients get in."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if server_available(self.url(), timeout=2.0):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"throwaway PostgreSQL on port {self.port} did not accept connections within "
            f"{self.startup_timeout} s\nserver log tail:\n{self.log_tail()}"
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server. ``"immediate"`` is crash-like: no checkpoint, recovery on next start."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown stop mode {mode!r}")
        if not self._initialized or not self.is_running():
            return
        self._run(
            [self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "30"],
            timeout=40,
        )

    def restart(self, mode: str = "fast") -> None:
        """Stop (with ``mode``) and start again on the same port."""
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        """Whether the postmaster is up (``pg_ctl status``), not whether it accepts queries yet."""
        if not self._initialized:
            return False
        proc = self._run([self._bin("pg_ctl"), "status", "-D", str(self.data_dir)], timeout=10, check=False)
        return proc.returncode == 0

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy asyncpg URL of a database on this cluster."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` on this cluster and return its URL."""

        async def create() -> None:
            conn = await asyncpg.connect(**connect_kwargs(self.url()), timeout=10)
            try:
                await conn.execute(f"CREATE DATABASE {_quote_ident(name)}")
            finally:
                await conn.close(timeout=5)

        run_sync(create)
        return self.url(name)

    def cleanup(self) -> None:
        """Stop the server (immediately: its data is about to go) and delete the directory. Idempotent."""
        atexit.unregister(self.cleanup)
        if self.root is None:
            return
        try:
            if self._initialized and self.root.exists():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self._initialized = False

    # -- diagnostics ------------------------------------------------------------------

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log, for error messages."""
        if self.root is None or not self.log_file.exists():
            return "(no server log)"
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def _log_since(self, offset: int) -> str:
        if not self.log_file.exists():
            return ""
        with self.log_file.open("r", errors="replace") as f:
            f.seek(offset)
            return f.read()

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> ThrowawayCluster:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"ThrowawayCluster(port={self.port}, root={self.root})"


def sweep_stale_clusters(base_dir: str | None = None, os_user: str = "postgres") -> list[Path]:
    """Stop and delete throwaway clusters whose creating process is gone.

    A killed test run cannot run its cleanup, and its postmaster would keep
    running (pg_ctl detaches it). Call once per session next to
    :func:`drop_stale_test_databases`. Returns the directories removed.
    """
    base = Path(base_dir or tempfile.gettempdir())
    removed: list[Path] = []
    for root in base.glob(_CLUSTER_DIR_PREFIX + "*"):
        try:
            owner = int((root / _OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if owner == os.getpid() or _pid_alive(owner):
            continue
        stale = ThrowawayCluster(os_user=os_user, port=0)
        stale.root = root
        stale._initialized = (root / "data" / "PG_VERSION").exists()
        try:
            stale.cleanup()
        except (RuntimeError, subprocess.SubprocessError, OSError):
            shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed
