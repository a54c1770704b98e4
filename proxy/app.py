"""Run the broker: mitmproxy (embedded, lean) and the side API in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import ssl
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from typing import Any, Callable

import uvicorn
from mitmproxy import exceptions, hooks, options
from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig
from mitmproxy.addonmanager import AddonManager, safecall, traverse
from mitmproxy.master import Master
from ulid import ULID

from . import logs
from .addon import AgentAuth, BrokerAddon, install_caller_watch, install_core_refusals
from .api import bounded_head, create_app
from .broker import Broker
from .config import ConfigError, Settings, parse_listen, redact_url
from .credentials import CredentialUnavailable, Credentials, read_source
from .deadlines import RequestClocks
from .crypto import KeyRing
from .failpoints import failpoint
from .keychecks import KeyMismatch, check_keys
from .recovery import Recovery
from .store import migrate, queries
from .store.journal import Journal, brief, make_engine
from .store.reads import ResultReader
from .upstream import Upstream

log = logging.getLogger("affidavit")

CA_FILE = "mitmproxy-ca-cert.pem"


def ca_path(settings: Settings) -> Path:
    """Absolute, but with its symbolic links kept: a Kubernetes Secret mount reaches the file
    through ``..data``, a link the kubelet moves to a new directory at every update, so a resolved
    path handed to agents would name a directory that is gone after the next one."""
    return (settings.proxy.confdir / CA_FILE).absolute()


#: Tokens shorter than this are warned about at start.
SHORT_TOKEN = 16


def resolve_tokens(settings: Settings) -> tuple[dict[str, str], str | None]:
    """Agent and operator tokens are needed to serve at all: a missing one stops the start."""
    tokens: dict[str, str] = {}
    problems: list[str] = []
    for i, agent in enumerate(settings.agents):
        try:
            tokens[agent.name], _ = read_source(agent.token, what=f"agents[{i}].token")
        except CredentialUnavailable as exc:
            problems.append(exc.message)
    operator = None
    if settings.api.operator_token:
        try:
            operator, _ = read_source(settings.api.operator_token, what="api.operator_token")
        except CredentialUnavailable as exc:
            problems.append(exc.message)
    if problems:
        raise ConfigError("cannot start; tokens unavailable:\n  " + "\n  ".join(problems))
    _tokens_distinct(settings, tokens, operator)
    holders = [(f"agents[{i}].token (agent {agent.name!r})", tokens[agent.name]) for i, agent in enumerate(settings.agents)]
    for key, token in holders + ([("api.operator_token", operator)] if operator is not None else []):
        if len(token) < SHORT_TOKEN:
            # Taken (a test setup may want one), but anyone who can reach the ports can guess it.
            log.warning("%s is %d characters long: a token this short can be guessed by anyone who can reach the "
                        "proxy or the side API. Use at least %d random characters (`openssl rand -hex 32`)",
                        key, len(token), SHORT_TOKEN)
    for i, agent in enumerate(settings.agents):
        if (odd := sorted(set(tokens[agent.name]) - _URL_SAFE)):
            # Taken as it is, but a proxy URL holding it raw breaks ('@', ':', '/', a space...).
            shown = "".join(odd).encode("unicode_escape").decode("ascii")
            log.warning("agents[%d].token (agent %r) holds characters a proxy URL must percent-encode (%s): its agent "
                        "must send it encoded in HTTPS_PROXY (`affidavit env --agent %s --token ...` prints it so), or "
                        "use a token of letters, digits, '-', '_', '.' and '~' only", i, agent.name, shown, agent.name)
    return tokens, operator


def _tokens_distinct(settings: Settings, tokens: dict[str, str], operator: str | None) -> None:
    """Each token names one holder. The side API knows its caller by the token alone, so a token
    two agents share reads one agent's records as the other's, and an agent's token that is also
    the operator's lists every agent's records and approves the agent's own held requests."""
    holders: dict[str, list[str]] = {}
    for i, agent in enumerate(settings.agents):
        holders.setdefault(tokens[agent.name], []).append(f"agents[{i}].token (agent {agent.name!r})")
    if operator is not None:
        holders.setdefault(operator, []).append("api.operator_token")
    shared = [names for names in holders.values() if len(names) > 1]
    if shared:
        raise ConfigError(
            "cannot start; these tokens have the same value: " + "; ".join(" and ".join(names) for names in shared)
            + ". A token is who its holder is to the side API: an agent could read another agent's records, or act "
            "as the operator (list every record, approve its own held requests). Give each agent, and the operator, "
            "a token of its own (`openssl rand -hex 32`).")


_URL_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def prepare_database(settings: Settings, *, nothing: str = "Nothing was started", then: str = "start again") -> None:
    """SQLite (the embedded default) upgrades itself; PostgreSQL only when asked to. ``nothing``
    and ``then`` finish the message of an unusable database for the command that asks."""
    auto = settings.database.auto_upgrade
    if auto is None:
        auto = settings.database.is_sqlite
    if (problem := migrate.sqlite_file_problem(settings.database.url)) is not None:
        raise StartupError(f"database.url {redact_url(settings.database.url)}: {problem}. {nothing}; fix database.url, "
                           f"then {then}.")
    if (problem := migrate.sqlite_unwritable(settings.database.url)) is not None:
        raise StartupError(f"database.url {redact_url(settings.database.url)}: {problem}. {nothing}; give this user "
                           f"write access there, or point database.url at a file it can write, then {then}.")
    if (database := migrate.sqlite_file(settings.database.url)) is not None and _empty_file(Path(database)):
        # SQLite takes an empty file for a new database: a journal truncated to nothing (a full
        # disk at a copy, a bad restore) would be replaced by a new one without a word.
        log.warning("database.url %s: the file is empty (0 bytes), so a new, empty journal starts in it. If it held a "
                    "journal, that journal is gone and every earlier invocation is unknown to this broker: stop it and "
                    "restore the file from a backup.", redact_url(settings.database.url))
    try:
        current = schema_revision(settings.database.url)
        if auto:
            migrate.upgrade(settings.database.url)
            return
    except ConfigError:
        raise
    except Exception as exc:  # the database cannot be reached or used: one line, not a traceback
        raise StartupError(
            f"database.url {redact_url(settings.database.url)}: {brief(exc)}. {nothing}; {queries.what_to_check(exc)}, "
            f"then {then}."
        ) from None
    if current != migrate.head():
        raise ConfigError(
            f"database.url {redact_url(settings.database.url)}: "
            f"{f'the schema is at {current}' if current else 'the database has no journal schema yet'}, "
            f"this broker needs {migrate.head()}. "
            "Run `affidavit db upgrade` first (or set database.auto_upgrade = true)."
        )


def _empty_file(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == 0 and not Path(f"{path}-wal").exists()
    except OSError:
        return False


def schema_revision(url: str) -> str | None:
    """The revision the journal's schema at ``url`` is at (None: it has none yet). One that a newer
    broker made is refused with :class:`ConfigError`, before anything runs against it: this broker
    cannot serve it, and its migrations cannot take it back (alembic would only say it cannot
    locate the revision)."""
    current = migrate.current(url)
    if current is not None and not migrate.known(current):
        raise ConfigError(
            f"database.url {redact_url(url)}: the schema is at {current}, which a newer broker made; this broker "
            f"knows only up to {migrate.head()} and cannot go back (there is no downgrade), so nothing was changed. "
            "Run the newer version (its broker, and its `affidavit db upgrade`) against this database."
        )
    return current


def env_lines(settings: Settings, agent: str | None = None, token: str | None = None) -> list[str]:
    """Shell exports for an agent. The token is printed only if given; otherwise the line reads
    it from the agent's configured source (``${VAR}`` or ``$(cat file)``), so no secret is ever
    written to a terminal or a log by this command."""
    host, port = _reachable(settings.proxy.listen)
    name, secret = agent or "AGENT", quote(token, safe="") if token is not None else None
    if secret is None:
        configured = next((a for a in settings.agents if a.name == agent), None)
        if configured is None:
            secret = "TOKEN"
        else:
            kind, _, ref = configured.token.partition(":")
            secret = f"${{{ref}}}" if kind == "env" else f"$(cat {ref})" if kind == "file" else "TOKEN"
    proxy = f"http://{name}:{secret}@{host}:{port}"
    ca = ca_path(settings)
    api_host, api_port = _reachable(settings.api.listen)
    exempt = api_host.strip("[]")
    return [
        f'export HTTPS_PROXY="{proxy}"',
        f'export HTTP_PROXY="{proxy}"',
        # curl reads only the lower-case http_proxy for http:// URLs; others read either.
        f'export https_proxy="{proxy}"',
        f'export http_proxy="{proxy}"',
        f'export SSL_CERT_FILE="{ca}"',
        f'export REQUESTS_CA_BUNDLE="{ca}"',
        f'export CURL_CA_BUNDLE="{ca}"',
        f'export NODE_EXTRA_CA_CERTS="{ca}"',
        "export NODE_USE_ENV_PROXY=1",
        f'export AFFIDAVIT_API_URL="http://{api_host}:{api_port}"',
        # The side API is called directly, never through the proxy (which would refuse it as a
        # target no route allows). curl, requests, httpx and Node all read NO_PROXY.
        f'export NO_PROXY="{exempt}"',
        f'export no_proxy="{exempt}"',
    ]


def _reachable(listen: str) -> tuple[str, int]:
    """Where a local agent reaches a listen address (a wildcard means this host), as it goes in
    a URL (an IPv6 address in brackets)."""
    host, port = parse_listen(listen)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return (f"[{host}]" if ":" in host else host), port


@dataclass
class Running:
    master: Master
    api: uvicorn.Server
    broker: Broker
    journal: Journal


async def serve(
    settings: Settings,
    tokens: dict[str, str],
    operator: str | None,
    ring: KeyRing,
    *,
    announce: Callable[[str], None] = print,
    worker: int | None = None,
) -> None:
    """Serve until stopped. ``worker``: this process is worker ``worker`` of ``affidavit run
    --workers N`` (proxy/workers.py): it shares the listen ports with its siblings."""
    log.info("event loop: %s (%s)", settings.proxy.event_loop, type(asyncio.get_running_loop()).__name__)
    if (clash := listens_clash(settings)) is not None:
        raise StartupError(clash)
    api_socket = listen_socket(settings.api.listen, "api.listen", shared=worker is not None)
    # Unique among live brokers: a host name and the port this process holds (two processes
    # cannot hold one port, so a restarted broker knows its earlier incarnations are dead). A
    # worker shares its port with its siblings; its supervisor restarts it only once it exited.
    instance = settings.recovery.instance or f"{socket.gethostname()}:{parse_listen(settings.proxy.listen)[1]}"
    if worker is not None:
        instance = f"{instance}#w{worker}"
    owner = f"{instance}/{ULID()}"
    engine = make_engine(settings.database.url, settings.database.pool_size)
    journal = Journal(engine, writer=owner, ring=ring)
    await journal.start()
    if journal.start_problem is not None:
        # Every request would be refused (journal_unavailable) while /readyz said ready.
        await journal.close()
        await engine.dispose()
        raise StartupError(f"{journal.start_problem}; see the log above")
    try:
        await check_keys(engine, ring, by=f"broker {owner}")
    except (KeyMismatch, *queries.DATABASE_ERRORS) as exc:
        await journal.close()
        await engine.dispose()
        if isinstance(exc, KeyMismatch):
            raise StartupError(f"{exc}. Nothing was started") from None
        advice = ("check that the database is up, and that no session holds a lock on key_checks, events or results "
                  "(PostgreSQL: pg_locks)" if isinstance(exc, TimeoutError) else queries.what_to_check(exc))
        raise StartupError(f"could not check the [crypto] keys against the journal: {brief(exc)}. Nothing was started; "
                           f"{advice}, then start the broker again") from None
    try:
        upstream = Upstream(ca_bundle=settings.upstream.ca_bundle, keepalive=settings.upstream.keepalive)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"upstream.ca_bundle {settings.upstream.ca_bundle}: {exc.strerror or exc}") from None
    credentials = Credentials(settings, engine, ring)
    reader = ResultReader(settings.database.url, size=min(4, settings.database.pool_size), timeout=5.0)
    broker = Broker(settings, journal, upstream, credentials, owner)
    recovery = Recovery(
        journal,
        owner,
        instance,
        heartbeat=settings.recovery.heartbeat,
        stale_after=settings.recovery.stale_after,
        sweep_every=settings.recovery.sweep_every,
    )
    broker.earlier_incarnation_dead = recovery.earlier_incarnation_dead

    listen_host, listen_port = parse_listen(settings.proxy.listen)
    prepare_ca(settings)
    opts = options.Options(listen_host=listen_host, listen_port=listen_port, confdir=str(settings.proxy.confdir))
    ready = asyncio.Event()
    largest = max([int(r.max_body) for r in settings.routes if r.max_body is not None] + [int(settings.proxy.max_body)])
    core_limit = largest + 1024 * 1024  # what mitmproxy reads at most, before any hook
    clocks = RequestClocks(head=settings.proxy.request_head_timeout, body=settings.proxy.request_body_timeout)
    install_core_refusals(core_limit, clocks)
    addon = BrokerAddon(broker, AgentAuth(tokens), on_running=ready.set)
    install_caller_watch(addon, clocks)
    master = lean_master(opts, addon, body_size_limit=str(core_limit))

    api_host, api_port = parse_listen(settings.api.listen)
    api = uvicorn.Server(
        uvicorn.Config(
            create_app(engine, tokens, operator, journal, broker, reader, lambda: recovery.heartbeat_failing),
            log_config=None,
            access_log=False,
            http=bounded_head(settings.api.request_timeout),
            lifespan="off",
            loop="none",
            server_header=False,
            date_header=False,
        )
    )
    # The broker's stop stops the side API too (below): uvicorn must not take the signals itself
    # (it would stop the API at once, before the proxy's drain, and raise each signal again).
    api.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]

    draining: list[asyncio.Task[None]] = []
    signalled_at: list[float] = []

    def stop(sig: signal.Signals | None = None) -> None:
        """A signal drains first (``[proxy] drain``), then stops; a second signal, or a stop
        with no signal (the supervisor gone, the proxy ended), stops at once. A worker takes
        only its supervisor's one SIGTERM, so a second one is no operator's: it is ignored, as is
        one that comes within 0.25 s of the first (a signal delivered twice, seen with SIGINT and
        SIGTERM arriving together)."""
        now = time.monotonic()
        if sig is not None and not broker.stopping and not broker.draining:  # which signal: a stop nobody expected can be traced
            log.warning("received %s: stopping; nothing new is sent, and the exchanges already sent have up to %g s "
                        "([proxy] drain) to end before the rest are cut", sig.name, settings.proxy.drain)
            broker.draining = True
            signalled_at.append(now)
            draining.append(asyncio.get_running_loop().create_task(drain_then_stop(), name="drain"))
            return
        if sig is not None and broker.draining and (worker is not None or now - signalled_at[0] < 0.25):
            return
        if sig is not None and not broker.stopping:
            log.warning("received %s again: stopping now; what is still in flight is cut and ends with what is known",
                        sig.name)
            api.force_exit = True  # nor does the side API wait for its open requests
        broker.stopping = True  # before mitmproxy cuts the agents' connections: not their leaving
        # A connection accepted as the listener closes may never get its handler started; Python
        # then warns about the handler's coroutine when it is collected (see cut_by_the_stop).
        warnings.filterwarnings("ignore", message=r"coroutine '.*handle_stream' was never awaited", category=RuntimeWarning)
        master.shutdown()

    async def drain_then_stop() -> None:
        try:
            # New connections go to a sibling worker or another broker; those open are still read.
            await master.addons.get("proxyserver").servers.update([])
            left = await broker.drained(settings.proxy.drain)
            if left:
                log.warning("%d request(s) still in flight after the drain (%g s); cutting them: each ends with what is "
                            "known", left, settings.proxy.drain)
        except Exception:  # the stop goes on whatever went wrong here
            log.exception("the drain failed; stopping at once")
        stop()

    loop = asyncio.get_running_loop()
    earlier_handler = loop.get_exception_handler()

    def cut_by_the_stop(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # A connection accepted as the stop began has its handler cancelled before it ran, and
        # asyncio's stream callback then reports the cancellation as an error with a traceback
        # (seen with --workers): expected at a stop, and no error.
        if broker.stopping and isinstance(context.get("exception"), asyncio.CancelledError):
            return
        task = context.get("task")
        if broker.stopping and isinstance(task, asyncio.Task) and _handles_a_connection(task):
            return  # the same connections' handlers, never run, dropped with the loop ("Task was destroyed")
        if earlier_handler is not None:
            earlier_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(cut_by_the_stop)
    # SIGHUP too (the terminal it runs in closed): a stop like any other, not an instant death
    # that leaves the requests in flight to another broker's recovery.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            if worker is not None and sig is not signal.SIGTERM:
                # A worker stops on its supervisor's SIGTERM. A Ctrl-C or a closed terminal reaches
                # the whole process group: taken here too, the forwarded SIGTERM would count as a
                # second signal and stop the worker without its drain.
                loop.add_signal_handler(sig, lambda: None)
            else:
                loop.add_signal_handler(sig, stop, sig)
        except NotImplementedError:  # pragma: no cover - non-Unix
            pass

    async def close_all() -> None:
        await recovery.close()
        # Cut the exchanges still in flight first: their requests then end with what is known
        # (REMOTE_OUTCOME_UNKNOWN, say) and write it while the journal still takes writes.
        await upstream.close()
        await broker.close()
        await journal.close()
        await reader.close()
        await engine.dispose()

    # Alive before serving, and beating from now on: a sibling's sweep takes an owner without a
    # heartbeat for a dead one once its records are stale_after old (a beat that fails here is
    # logged and tried again every heartbeat; this broker sweeps only once it holds its port).
    await recovery.start_beating()
    if recovery.last_failure is not None and queries.read_only(recovery.last_failure):
        # Connected, but every write is refused (a standby, a read-only role or mount): every
        # request would only be refused. The advice says where to point instead.
        refused = recovery.last_failure
        await close_all()
        raise StartupError(f"the journal refuses writes ({brief(refused)}). Nothing was started; "
                           f"{queries.what_to_check(refused)}")
    api_task = asyncio.create_task(api.serve(sockets=[api_socket]), name="side api")
    logging.getLogger("mitmproxy.addons.proxyserver").addFilter(_ReportedByTheBroker())
    master_task = asyncio.create_task(master.run(), name="mitmproxy")
    orphan_watch = asyncio.create_task(_stop_when_orphaned(stop)) if worker is not None else None
    try:
        ready_wait = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({ready_wait, master_task, api_task}, return_when=asyncio.FIRST_COMPLETED)
        if ready_wait not in done:
            ready_wait.cancel()
            for task in done:
                task.result()
            if broker.stop_begun:
                return  # a signal during start-up: a clean stop
            raise StartupError("the proxy stopped during start-up; see the log above")
        for server in master.addons.get("proxyserver").servers:
            if server.last_exception is not None:
                raise StartupError(cannot_listen("proxy.listen", settings.proxy.listen, server.last_exception))
            if not server.is_running:
                raise StartupError(f"proxy.listen {settings.proxy.listen}: not listening")
        while not api.started and not api_task.done():
            await asyncio.sleep(0.01)
        if api_task.done():
            raise StartupError(f"the side API stopped during start-up on {settings.api.listen}; see the log above")
        if worker is not None:
            await failpoint("worker_start")
        if broker.stopping:  # a signal during start-up: mitmproxy's start cleared the shutdown asked for
            master.shutdown()
        elif broker.draining:  # and the drain may have closed no listener yet
            await master.addons.get("proxyserver").servers.update([])
        # The proxy port is ours now, so earlier incarnations of this instance are dead: their
        # in-flight records can be closed at once.
        await recovery.start()
        tune_gc()
        announce(banner(settings) if worker is None else worker_ready_line(worker))
        done, _ = await asyncio.wait({master_task, api_task}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
        for task in draining:  # the stop is under way (a second signal, or the proxy ended): no drain to finish
            task.cancel()
        stop()
        api.should_exit = True
        await asyncio.gather(master_task, api_task, return_exceptions=True)
        await close_all()


def _handles_a_connection(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is part of mitmproxy's handling of one accepted connection (its handler, or
    the handler's idle watchdog)."""
    code = getattr(task.get_coro(), "cr_code", None)
    filename = code.co_filename.replace(os.sep, "/") if code is not None else ""
    return filename.endswith(("mitmproxy/proxy/server.py", "mitmproxy/proxy/mode_servers.py"))


class StartupError(Exception):
    """The broker cannot serve (a port is taken...); the message says which setting and why."""


def prepare_ca(settings: Settings) -> None:
    """The interception CA in ``proxy.confdir``: created on the first start, and read on every
    start before anything listens. mitmproxy reads it only once it runs, and a key it cannot read
    there is one log line while the broker answers ready and fails every HTTPS request. Writes the
    certificate agents trust when only the key is there (a Secret mounted with one file)."""
    from mitmproxy.certs import CertStore

    confdir = settings.proxy.confdir
    key = confdir / "mitmproxy-ca.pem"
    try:
        confdir.mkdir(parents=True, exist_ok=True)
        store = CertStore.from_store(confdir, "mitmproxy", 2048)
    except Exception as exc:  # OSError, or the key's bytes (ValueError, TypeError) from cryptography
        what = "read" if key.exists() else "created"
        raise StartupError(
            f"proxy.confdir {confdir}: the interception CA ({key.name}) could not be {what}: "
            f"{getattr(exc, 'strerror', None) or exc}. Nothing was started. Fix the file or the directory; "
            f"without {key.name} a new CA is created, which agents must then trust instead."
        ) from None
    cert = confdir / CA_FILE
    if not cert.exists():
        try:
            cert.write_bytes(store.default_ca.to_pem())
        except OSError as exc:
            log.warning("proxy.confdir %s holds the CA's key but not %s, the certificate agents must trust, and it "
                        "could not be written (%s): give agents the certificate from wherever the key came from",
                        confdir, CA_FILE, exc.strerror or exc)


def listen_socket(listen: str, key: str, *, shared: bool = False) -> socket.socket:
    """Bind ``listen`` now, so a taken port stops the start with a clear message. ``shared``:
    with ``SO_REUSEPORT``, for the workers of one broker (the kernel spreads connections)."""
    host, port = parse_listen(listen)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it a keep-alive response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise StartupError(cannot_listen(key, listen, exc)) from None
    sock.setblocking(False)
    return sock


def listens_clash(settings: Settings) -> str | None:
    """Why the proxy and the side API would ask for one port, or None. Each would find it taken
    by the other, which the socket's error blames on another broker."""
    (proxy_host, proxy_port), (api_host, api_port) = parse_listen(settings.proxy.listen), parse_listen(settings.api.listen)
    if proxy_port != api_port or (proxy_host != api_host and not {proxy_host, api_host} & {"0.0.0.0", "::", "*", ""}):
        return None
    return (f"proxy.listen ({settings.proxy.listen}) and api.listen ({settings.api.listen}) ask for the same port: the "
            "proxy and the side API each need one of their own; change one of them")


_LISTEN_HINTS = {
    errno.EADDRINUSE: "is another broker running?",
    errno.EADDRNOTAVAIL: "is that address one of this host's?",
    errno.EACCES: "ports below 1024 need privileges",
}


def cannot_listen(key: str, listen: str, exc: BaseException) -> str:
    """Why ``listen`` could not be bound, in one line. mitmproxy wraps the socket's error in one
    of its own, whose text advises its own command line (``--mode regular@<port>``)."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    if isinstance(cause, OSError) and cause.errno:
        hint = _LISTEN_HINTS.get(cause.errno)
        return f"{key} {listen}: {os.strerror(cause.errno)}" + (f" ({hint})" if hint else "")
    return f"{key} {listen}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


class _ReportedByTheBroker(logging.Filter):
    """Drops mitmproxy's own log line for a proxy port it cannot bind: the start-up reports that
    failure itself (``cannot start: proxy.listen ...``), without mitmproxy's advice to pass
    ``--mode regular@<port>``, an option the broker does not have."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to listen on" not in record.getMessage()


class _SharesPorts:
    """Mixed into a worker's event loop: every listening socket it creates (mitmproxy's proxy
    server binds its own, through ``asyncio.start_server``) is shared with the sibling workers."""

    async def create_server(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.setdefault("reuse_port", True)
        return await super().create_server(*args, **kwargs)  # type: ignore[misc]


class SharedPortLoop(_SharesPorts, asyncio.SelectorEventLoop):
    pass


def loop_factory(kind: str, worker: int | None) -> Callable[[], asyncio.AbstractEventLoop]:
    """The broker's event loop: uvloop's (libuv) by default, asyncio's own with ``[proxy]
    event_loop = "asyncio"``. uvloop runs the same code with about 10% fewer instructions per request
    (docs/performance.md)."""
    if kind == "asyncio":
        return SharedPortLoop if worker is not None else asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise StartupError(f"proxy.event_loop = \"uvloop\", but uvloop cannot be imported ({exc}); install it "
                           "(pip install uvloop) or set [proxy] event_loop = \"asyncio\"") from None
    if worker is None:
        return uvloop.new_event_loop
    return type("SharedPortUVLoop", (_SharesPorts, uvloop.Loop), {})


WORKER_READY = "affidavit: worker {worker} ready (pid {pid})"


def worker_ready_line(worker: int) -> str:
    return WORKER_READY.format(worker=worker, pid=os.getpid())


async def _stop_when_orphaned(stop: Callable[[], None]) -> None:
    """A worker outlives no supervisor: if it is gone (even killed with SIGKILL), stop, the way a
    signal stops it (the broker knows it is stopping before mitmproxy cuts the agents' connections)."""
    supervisor = int(os.environ.get("AFFIDAVIT_SUPERVISOR_PID", "0"))
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != supervisor:
            log.error("the supervisor (pid %d) is gone; this worker stops", supervisor)
            stop()
            return


def lean_master(opts: options.Options, *addons: Any, **settings: Any) -> Master:
    """A master with only the addons the broker needs, then ``addons`` (``mitmdump`` walks ~30
    built-in addons on every hook of every flow), configured with the broker's options and
    ``settings`` in one update (each update re-configures the proxy server, and a second one
    raced the first's listening socket under ``--workers``). The benchmark's ``lean`` target
    runs this master with no broker addon: the floor the broker's own work stands on."""
    master = Master(opts)
    master.addons.__class__ = LeanAddons  # the same manager (its options listener stays), minus the empty walks
    _drop_legacy_log_bridge()
    master.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(), *addons)
    opts.update(connection_strategy="lazy", upstream_cert=False, websocket=False, rawtcp=False, **settings)
    return master


class LeanAddons(AddonManager):
    """mitmproxy's addon manager, which walks only the addons that implement a hook instead of
    every addon for every hook. mitmproxy follows every lifecycle hook of a flow
    (``requestheaders``, ``request``, ``responseheaders``, ``response``, ...) with an ``update``
    hook that only its user interfaces listen to, and most hooks have one implementer among the
    master's five addons. Which addons implement which hook is remembered until one is added or
    removed; the walk itself is mitmproxy's (in chain order, each call guarded by ``safecall``, an
    ``AddonHalt`` ends it)."""

    _implementers: dict[str, list[Any]] | None = None

    def register(self, addon: Any) -> Any:
        self._implementers = None
        return super().register(addon)

    def add(self, *addons: Any) -> None:
        super().add(*addons)
        self._implementers = None

    def remove(self, addon: Any) -> None:
        super().remove(addon)
        self._implementers = None

    def clear(self) -> None:
        super().clear()
        self._implementers = None

    def implementers(self, name: str) -> list[Any]:
        """The addons of the chain that implement hook ``name`` themselves or through a child."""
        known = self._implementers
        if known is None:
            known = self._implementers = {}
        if name not in known:
            known[name] = [a for a in self.chain if any(callable(getattr(x, name, None)) for x in traverse([a]))]
        return known[name]

    async def trigger_event(self, event: hooks.Hook) -> None:
        for addon in self.implementers(event.name):
            try:
                with safecall():
                    await self.invoke_addon(addon, event)
            except exceptions.AddonHalt:
                return


def _drop_legacy_log_bridge() -> None:
    """mitmproxy's Master puts a handler on the root logger that formats every log record a
    second time and sends it to every addon as the deprecated ``add_log`` hook. No addon of the
    broker listens to it, and at one log line per invocation it cost ~2% of the CPU."""
    from mitmproxy import log as mitmproxy_log

    bridge = getattr(mitmproxy_log, "LegacyLogEvents", None)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if bridge is not None and isinstance(handler, bridge):
            root.removeHandler(handler)


def tune_gc() -> None:
    """Fewer, cheaper cycle collections on the hot path (see docs/performance.md).

    Almost everything a request allocates is freed by reference counting; the cyclic collector
    mostly re-scans the long-lived start-up objects (mitmproxy, SQLAlchemy, FastAPI), so those
    are frozen out of its view and young collections run less often.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def banner(settings: Settings) -> str:
    agent = settings.agents[0].name if settings.agents else None
    lines = [
        f"affidavit: proxy listening on {settings.proxy.listen}, side API on http://{settings.api.listen}",
        f"affidavit: journal {redact_url(settings.database.url)}",
        f"affidavit: CA certificate {ca_path(settings)}",
    ]
    if agent is None:
        lines.append("affidavit: no [[agents]] are configured, so the proxy refuses every request (407); add one "
                     "(docs/configuration.md), then `affidavit env --agent NAME` prints its settings")
    else:
        lines += [f"affidavit: for agent '{agent}' (`affidavit env --agent NAME` prints these again):",
                  *(f"  {line}" for line in env_lines(settings, agent))]
    return "\n".join(lines)


def run(settings: Settings, worker: int | None = None) -> int:
    """Check everything that can be checked before touching the database, then serve."""
    logs.setup(settings.log.level)
    tokens, operator = resolve_tokens(settings)
    ring = KeyRing.from_settings(settings.crypto)  # a bad key stops the start (ConfigError)
    try:
        factory = loop_factory(settings.proxy.event_loop, worker)
        prepare_database(settings)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(settings, tokens, operator, ring, announce=lambda text: print(text, flush=True), worker=worker))
    except KeyboardInterrupt:
        pass
    except (StartupError, OSError) as exc:
        print(f"affidavit: cannot start: {exc}", file=sys.stderr)
        return 1
    print("affidavit: stopped" if worker is None else f"affidavit: worker {worker} stopped", flush=True)
    return 0
