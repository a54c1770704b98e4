"""Everything the harness starts and stops: TLS material, the upstream, the proxies, a database.

Every child runs in its own session (``start_new_session``) so a Ctrl-C in the terminal reaches
only the harness, which then stops the children in order (broker before its database is
dropped). Every wait is bounded; a child that does not come up is reported with the tail of its
log instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

BENCH_DB_PREFIX = "affidavit_bench_"
PG_ADMIN_DSN = os.environ.get("AFFIDAVIT_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


class StartError(Exception):
    """A service did not come up; the message says why and carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a child's log, indented, with the log's path (it is kept on failure)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"    (no log at {path})"
    body = "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"
    return f"  log {path}:\n{body}"


def find_tool(name: str, override: str | None) -> str | None:
    """A tool next to the running interpreter (the venv), in the repo's .venv, or on PATH."""
    if override:
        return override
    for candidate in (Path(sys.executable).parent / name, REPO / ".venv" / "bin" / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process of the harness, in its own process group, with its output in a file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the child's own process group, then SIGKILL it if it lingers."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> Child:
    fh = open(log, "wb")
    try:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        fh.close()
    return Child(name, proc, log)


def wait_until(check: Callable[[], bool], child: Child, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise StartError(f"{child.name} exited with code {child.proc.returncode} before {what}:\n{tail(child.log)}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise StartError(f"{child.name}: no {what} within {timeout:.0f}s:\n{tail(child.log)}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- TLS material ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path  # the throwaway CA the proxies trust for the upstream
    chain: Path  # the upstream's certificate chain (leaf + CA)
    key: Path


def make_pki(directory: Path) -> Pki:
    """A throwaway CA and a leaf for ``localhost``/``127.0.0.1``, made with ``cryptography``
    (a runtime dependency of Affidavit, unlike trustme, which is only a dev extra)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Affidavit bench throwaway CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_path = directory / "upstream-ca.pem"
    chain_path = directory / "upstream-chain.pem"
    key_path = directory / "upstream-key.pem"
    ca_path.write_bytes(ca_cert.public_bytes(pem))
    chain_path.write_bytes(leaf.public_bytes(pem) + ca_cert.public_bytes(pem))
    key_path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return Pki(ca=ca_path, chain=chain_path, key=key_path)


# -- the upstream ------------------------------------------------------------------------------


@dataclass
class Upstream:
    kind: str  # "nginx" | "asyncio"
    child: Child
    http_port: int
    https_port: int
    version: str


def start_upstream(kind: str, tmp: Path, pki: Pki) -> Upstream:
    """``auto`` picks nginx when installed (faster, C, off the proxies' CPU), else asyncio."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if kind == "auto":
        kind = "nginx" if nginx else "asyncio"
    if kind == "nginx":
        if not nginx:
            raise StartError("--upstream nginx: no nginx binary (apt-get install -y nginx-light)")
        return _start_nginx(nginx, tmp, pki)
    return _start_asyncio(tmp, pki)


_NGINX_CONF = """\
worker_processes 1;
daemon off;
master_process on;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    server_tokens off;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    default_type application/json;
    server {{
        listen 127.0.0.1:{http} backlog=1024;
        listen 127.0.0.1:{https} ssl backlog=1024;
        ssl_certificate {chain};
        ssl_certificate_key {key};
        location / {{ return 200 '{body}'; }}
    }}
}}
"""


def _start_nginx(nginx: str, tmp: Path, pki: Pki) -> Upstream:
    from upstream import BODY

    root = tmp / "nginx"
    root.mkdir(parents=True, exist_ok=True)
    http, https = free_port(), free_port()
    conf = root / "nginx.conf"
    conf.write_text(
        _NGINX_CONF.format(root=root, http=http, https=https, chain=pki.chain, key=pki.key, body=BODY.decode())
    )
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=10).stderr.strip()
    # -e: the error log before the configuration is read (else /var/log/nginx/error.log).
    child = spawn(
        "upstream(nginx)", [nginx, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")], root / "stdout.log"
    )
    try:
        wait_until(lambda: port_open(http) and port_open(https), child, 15, "listening ports")
    except StartError as exc:
        raise StartError(f"{exc}\n  nginx error.log:\n{tail(root / 'error.log')}") from None
    return Upstream("nginx", child, http, https, version.removeprefix("nginx version: "))


def _start_asyncio(tmp: Path, pki: Pki) -> Upstream:
    log = tmp / "upstream.log"
    child = spawn(
        "upstream(asyncio)",
        [sys.executable, str(HERE / "upstream.py"), "--cert", str(pki.chain), "--key", str(pki.key)],
        log,
    )
    ports: dict[str, int] = {}

    def listening() -> bool:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                ports.update(json.loads(line))
                return True
        return False

    wait_until(listening, child, 15, "its ports line")
    return Upstream("asyncio", child, ports["http"], ports["https"], f"python {sys.version.split()[0]}")


# -- PostgreSQL --------------------------------------------------------------------------------


def _pg(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(coro_fn(), 30))


def _admin_connect() -> Any:
    import asyncpg

    return asyncpg.connect(PG_ADMIN_DSN, timeout=10)


def create_database() -> str:
    name = f"{BENCH_DB_PREFIX}{os.getpid()}_{secrets.token_hex(3)}"

    async def go() -> None:
        conn = await _admin_connect()
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    _pg(go)
    return name


def drop_database(name: str) -> None:
    assert name.startswith(BENCH_DB_PREFIX)

    async def go() -> None:
        conn = await _admin_connect()
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    _pg(go)


def pg_dsn(name: str) -> str:
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    return f"{base}/{name}"


def count_invocations_pg(name: str) -> int:
    async def go() -> int:
        import asyncpg

        conn = await asyncpg.connect(pg_dsn(name), timeout=10)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM invocations"))
        finally:
            await conn.close()

    return _pg(go)


def commit_floor(samples: int = 2000) -> dict[str, float]:
    """What one durable commit costs by itself: p50 of a one-row INSERT (autocommit, so one
    fsync each) and of ``SELECT 1``, one after another through asyncpg, in a throwaway database.

    Affidavit waits for two commits in series on every request, so at concurrency 1 these set a
    floor under its added latency that no change in the broker can go below.
    """
    name = create_database()

    async def go() -> dict[str, float]:
        import asyncpg

        conn = await asyncpg.connect(pg_dsn(name), timeout=10)
        try:
            await conn.execute("CREATE TABLE floor (n integer)")
            timings: dict[str, float] = {}
            for label, sql, args in (("select_1_us", "SELECT 1", ()), ("insert_commit_us", "INSERT INTO floor VALUES ($1)", (1,))):
                statement = await conn.prepare(sql)
                spent = []
                for _ in range(samples):
                    t0 = time.perf_counter()
                    await statement.fetch(*args)
                    spent.append(time.perf_counter() - t0)
                timings[label] = round(statistics.median(spent) * 1e6, 1)
            return timings
        finally:
            await conn.close()

    try:
        return _pg(go)
    finally:
        drop_database(name)


def count_invocations_sqlite(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return int(conn.execute("SELECT count(*) FROM invocations").fetchone()[0])
    finally:
        conn.close()


# -- the proxies under test --------------------------------------------------------------------


@dataclass
class Target:
    """One proxy under test, as the load generator needs to see it."""

    name: str
    port: int
    ca: Path  # the proxy's interception CA (clients trust it for HTTPS)
    child: Child
    count_invocations: Callable[[], int] | None = None
    pg_database: str | None = None
    info: dict[str, str] = field(default_factory=dict)
    api_port: int | None = None  # Affidavit's side API (``[api] listen``)
    processes: int = 1  # the least size of its process tree: 1 + N under ``--workers N``
    pids: list[int] | None = None  # its process tree as the first measured window found it


def _start_mitmproxy(
    name: str, tmp: Path, argv_for: Callable[[int, Path], list[str]], wrap: Sequence[str], timeout: float
) -> Target:
    """A mitmproxy-based target without a side API: ``wrap + argv_for(port, confdir)`` is its
    command; it is up once it listens and has written its CA."""
    confdir = tmp / f"{name}-conf"
    confdir.mkdir()
    port = free_port()
    argv = [*wrap, *argv_for(port, confdir)]
    child = spawn(name, argv, tmp / f"{name}.log")
    ca = confdir / "mitmproxy-ca-cert.pem"
    wait_until(lambda: port_open(port) and ca.is_file(), child, timeout, "listening port")
    return Target(name, port, ca, child, info={"argv": " ".join(argv)})


def start_bare(tmp: Path, pki: Pki, mitmdump: str, wrap: Sequence[str] = (), timeout: float = 60) -> Target:
    """Plain ``mitmdump``: its default addons, no scripts, upstream CA trusted (no --ssl-insecure).
    ``wrap`` is a command prefix (``bench/instructions.py`` runs targets under valgrind)."""
    return _start_mitmproxy("bare", tmp, wrap=wrap, timeout=timeout, argv_for=lambda port, confdir: [
        mitmdump, "-q", "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={pki.ca}",
    ])


def start_lean(tmp: Path, pki: Pki, wrap: Sequence[str] = (), timeout: float = 60) -> Target:
    """The broker's own lean master with no broker addon (``bench/lean_master.py``), under
    ``python -O`` like the broker: what mitmproxy costs the broker before its own work."""
    script = str(Path(__file__).with_name("lean_master.py"))
    return _start_mitmproxy("lean", tmp, wrap=wrap, timeout=timeout, argv_for=lambda port, confdir: [
        sys.executable, "-O", script, str(port), str(confdir), str(pki.ca),
    ])


AGENT = "bench"
#: One agent token per harness run, shared by every target: bare mitmdump receives the very
#: same Proxy-Authorization bytes (it ignores them), so all proxies parse identical requests.
TOKEN = secrets.token_urlsafe(18)


def start_affidavit(
    name: str,
    tmp: Path,
    pki: Pki,
    affidavit: str,
    upstream: Upstream,
    database: str,
    workers: int = 1,
    wrap: Sequence[str] = (),
    timeout: float = 90,
) -> Target:
    """``affidavit run -c <generated config>``; ``database`` is "pg" or "sqlite". With
    ``workers`` > 1, ``affidavit run --workers N``: a supervisor and N worker processes sharing
    the ports; it is ready once it printed the banner and the workers' pids. With a command
    prefix ``wrap``, the broker is started as ``wrap + [<its venv's python>, "-O", "-m",
    "proxy", "run", ...]``: the prefix then wraps the serving process itself, not a launcher that
    re-executes itself under ``python -O``.

    The PostgreSQL database is created here and dropped by :func:`stop_target`."""
    home = tmp / name
    home.mkdir()
    port, api_port = free_port(), free_port()
    token = TOKEN
    pg_name: str | None = None
    if database == "pg":
        pg_name = create_database()
        url = "postgresql+asyncpg://" + pg_dsn(pg_name).split("://", 1)[1]
    else:
        url = f"sqlite+aiosqlite:///{home / 'bench.db'}"
    confdir = home / "aff-conf"
    config = home / "config.toml"
    config.write_text(
        f"""\
[proxy]
listen = "127.0.0.1:{port}"
confdir = "{confdir}"

[api]
listen = "127.0.0.1:{api_port}"
operator_token = "env:AFFIDAVIT_BENCH_OPERATOR"

[database]
url = "{url}"
auto_upgrade = true

[upstream]
ca_bundle = "{pki.ca}"

[[agents]]
name = "{AGENT}"
token = "env:AFFIDAVIT_BENCH_TOKEN"

[[routes]]
name = "bench-http"
host = "127.0.0.1"
port = {upstream.http_port}
scheme = "http"
methods = ["GET", "POST"]
agents = ["{AGENT}"]

[[routes]]
name = "bench-https"
host = "localhost"
port = {upstream.https_port}
scheme = "https"
methods = ["GET", "POST"]
agents = ["{AGENT}"]
"""
    )
    # A clean environment: no stray AFFIDAVIT_* override from the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFFIDAVIT_")}
    env["AFFIDAVIT_BENCH_TOKEN"] = token
    env["AFFIDAVIT_BENCH_OPERATOR"] = secrets.token_urlsafe(18)
    env["PYTHONUNBUFFERED"] = "1"
    launcher = [str(Path(affidavit).with_name("python")), "-O", "-m", "proxy"] if wrap else [affidavit]
    argv = [*wrap, *launcher, "run", "-c", str(config), *(["--workers", str(workers)] if workers > 1 else [])]
    child = spawn(name, argv, home / "broker.log", env=env, cwd=home)
    target = Target(name, port, confdir / "mitmproxy-ca-cert.pem", child, pg_database=pg_name, api_port=api_port)
    # The supervisor and its workers; each broker process on SQLite also has a journal writer
    # process (a child of its own), which the tree check learns from the first window.
    target.processes = 1 + workers if workers > 1 else 1
    if pg_name is not None:
        target.count_invocations = lambda: count_invocations_pg(pg_name)
    else:
        db_file = home / "bench.db"
        target.count_invocations = lambda: count_invocations_sqlite(db_file)
    target.info = {"config": str(config), "database": url, "argv": " ".join(argv)}
    if workers == 1:
        what, banner = "'proxy listening on' banner", re.compile("proxy listening on")
    else:
        what = f"'{workers} workers share these ports (pids ...)' line"
        banner = re.compile(rf"affidavit: {workers} workers share these ports \(pids ([\d, ]+)\)")

    def ready() -> bool:
        if not banner.search(child.log.read_text(errors="replace")):
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except urllib.error.URLError:
            return False

    try:
        wait_until(ready, child, timeout, f"{what} and /readyz 200")
    except BaseException:
        stop_target(target)
        raise
    if workers > 1:
        line = banner.search(child.log.read_text(errors="replace"))
        assert line is not None  # ready() saw it
        target.info["worker_pids"] = line.group(1)
    return target


def stop_target(target: Target) -> list[str]:
    """Stop the proxy, then drop its database. Returns problems (never raises)."""
    problems: list[str] = []
    try:
        target.child.stop()
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{target.name}: could not stop: {exc}")
    if target.pg_database:
        try:
            drop_database(target.pg_database)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{target.name}: could not drop database {target.pg_database}: {exc}")
        else:
            target.pg_database = None
    return problems
