"""``affidavit run --workers N``: N broker processes on the same ports, one journal.

mitmproxy runs a request on one core, so one broker process is bound by one core. The
supervisor (this module, the process the operator started) checks what it can, creates the CA
once (so every worker presents the same one), then starts N workers. Each worker is a whole
broker (``affidavit run --worker-index i``) that binds the proxy and side-API ports with
``SO_REUSEPORT``; the kernel spreads new connections across them. They share nothing but the
journal, which already serves several brokers (leases, fencing, recovery).

* Start: the supervisor prints the banner once every worker printed its ready line. A worker
  that exits during start-up stops the others, and the supervisor exits 1.
* Running: a worker that dies is restarted at once (its earlier incarnation's in-flight records
  are recovered by the new one when it starts, see proxy/recovery.py). Five deaths of serving
  workers within a minute stop everything: something is wrong that a restart will not fix (a
  worker stopped cleanly, by a signal sent to it alone, is restarted and counts for nothing). A
  restart that fails before the worker is ready (the database is down, say) is tried again after
  a wait that doubles per failure (1 s up to 30 s) and stops nothing: the other workers go on
  serving, as one broker does through an outage.
* Stop: SIGTERM, SIGINT or SIGHUP to the supervisor reaches every worker; each drains like a single
  broker. A worker whose supervisor disappears (even by SIGKILL) stops within a second.
* Metrics: the workers share a Prometheus multiprocess directory, so ``/metrics`` from any
  worker counts all of them. It is removed when the supervisor stops; one left by a supervisor
  killed with SIGKILL (its name carries that supervisor's pid) is removed by the next one to start.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from . import logs
from .config import Settings, parse_listen

#: What happens to the workers while they serve: JSON lines with a timestamp, as the workers' own.
log = logging.getLogger("affidavit.workers")

READY_PREFIX = "affidavit: worker "
#: Serving workers that died this often within ``CRASH_WINDOW`` seconds stop the broker.
CRASH_LIMIT, CRASH_WINDOW = 5, 60.0
#: Clean stops of single workers (exit status 0) within ``CRASH_WINDOW``, per worker of the pool,
#: that are restarted without counting as deaths; one more counts (a worker that keeps ending
#: by itself).
CLEAN_STOP_LIMIT = 10
#: After a restart that failed before the worker was ready, the next waits this long, doubling
#: per failure in a row up to the second figure.
RESTART_BACKOFF = (1.0, 30.0)
START_TIMEOUT = 120.0
#: How long the workers have to stop after the supervisor's SIGTERM beyond their [proxy] drain
#: (then the journal's last writes, bounded at about 10 s) before they are killed.
STOP_GRACE = 20.0


class Worker:
    def __init__(self, index: int, argv: list[str], env: dict[str, str]):
        self.index = index
        self.argv = argv
        self.env = env
        self.ready = threading.Event()
        self.process: subprocess.Popen[str] | None = None
        self.relay: threading.Thread | None = None
        #: Restarts in a row that ended before the worker was ready.
        self.failed_starts = 0
        #: When a worker that is down starts again (monotonic), else None.
        self.restart_at: float | None = None

    def start(self) -> None:
        self.ready.clear()
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.relay = threading.Thread(target=self._relay, args=(self.process,), daemon=True)
        self.relay.start()

    def _relay(self, process: subprocess.Popen[str]) -> None:
        """Pass the worker's stdout on, and notice its ready line."""
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(READY_PREFIX) and " ready " in line:
                self.ready.set()
            sys.stdout.write(line)
            sys.stdout.flush()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)


def ports_free(settings: Settings) -> str | None:
    """Why the broker's ports cannot be taken, or None. Bound without ``SO_REUSEPORT``, so a
    port held by anything (another broker with workers included) is found."""
    from .app import listens_clash

    if (clash := listens_clash(settings)) is not None:
        return clash
    for key, listen in (("proxy.listen", settings.proxy.listen), ("api.listen", settings.api.listen)):
        host, port = parse_listen(listen)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return f"{key} {listen}: {exc.strerror or exc} (is another broker running?)"
    return None


def worker_argv(config: Path | None, index: int) -> list[str]:
    optimize = ["-O"] if sys.flags.optimize else []
    return [sys.executable, *optimize, "-m", "proxy", "run", *(["--config", str(config)] if config else []),
            "--worker-index", str(index)]


METRICS_PREFIX = "affidavit-metrics-"


def sweep_metrics_dirs(parent: str | None = None) -> list[str]:
    """Remove the metrics directories of supervisors that are gone (a SIGKILL gives one no chance
    to remove its own); the names removed. A directory whose supervisor pid is alive, or that is
    not this user's, or whose name carries no pid, is left alone."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        pid_text = entry.name[len(METRICS_PREFIX):].partition("-")[0]
        if not (entry.name.startswith(METRICS_PREFIX) and pid_text.isdigit()):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _alive(int(pid_text)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def supervise(settings: Settings, config: Path | None, workers: int, announce=print) -> int:
    """Run ``workers`` broker processes until a signal; the exit status of the whole broker."""
    from .app import StartupError, banner, prepare_ca

    logs.setup(settings.log.level)
    problem = ports_free(settings)
    if problem is not None:
        print(f"affidavit: cannot start: {problem}", file=sys.stderr)
        return 1
    try:
        prepare_ca(settings)  # before the workers start, so they all load the same one
    except StartupError as exc:
        print(f"affidavit: cannot start: {exc}", file=sys.stderr)
        return 1
    sweep_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir, "AFFIDAVIT_SUPERVISOR_PID": str(os.getpid())}
    pool = [Worker(i, worker_argv(config, i), env) for i in range(workers)]
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for worker in pool:
            worker.start()
        status = _await_start(pool, stopping)
        if status is not None:
            return status
        announce(banner(settings) + f"\naffidavit: {workers} workers share these ports (pids "
                 + ", ".join(str(w.process.pid) for w in pool if w.process) + ")")
        sys.stdout.flush()
        return _watch(pool, stopping, metrics_dir)
    finally:
        _stop_all(pool, settings.proxy.drain + STOP_GRACE)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if stopping.is_set():  # a signal: every worker has stopped, as one broker says when it has
            print("affidavit: stopped", flush=True)


def _await_start(pool: list[Worker], stopping: threading.Event) -> int | None:
    deadline = time.monotonic() + START_TIMEOUT
    while not all(w.ready.is_set() for w in pool):
        if stopping.is_set():
            return 0
        for worker in pool:
            assert worker.process is not None
            if worker.process.poll() is not None:
                print(f"affidavit: cannot start: worker {worker.index} exited with status {worker.process.returncode} "
                      "during start-up (its reason is above); stopping the others", file=sys.stderr)
                return 1
        if time.monotonic() > deadline:
            print(f"affidavit: cannot start: the workers were not ready within {START_TIMEOUT:.0f}s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    return None


def _watch(pool: list[Worker], stopping: threading.Event, metrics_dir: str) -> int:
    from prometheus_client import multiprocess

    deaths: deque[float] = deque()
    clean: deque[float] = deque()
    while not stopping.wait(0.2):
        for worker in pool:
            assert worker.process is not None
            now = time.monotonic()
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    worker.restart_at = None
                    worker.start()
                continue
            code = worker.process.poll()
            if code is None:
                if worker.ready.is_set():
                    worker.failed_starts = 0
                continue
            multiprocess.mark_process_dead(worker.process.pid, metrics_dir)
            if worker.relay is not None:  # its last lines (a ready line among them) are read first
                worker.relay.join(timeout=1.0)
            pid, how = worker.process.pid, _exit_of(code)
            if not worker.ready.is_set():  # this restart never served: wait, then try again
                worker.failed_starts += 1
                delay = min(RESTART_BACKOFF[0] * 2 ** (worker.failed_starts - 1), RESTART_BACKOFF[1])
                worker.restart_at = now + delay
                log.error(
                    "worker %d (pid %d) %s before it was ready (%d start(s) in a row; its reason is above); trying "
                    "again in %.0f s. The other workers go on serving; its in-flight records are recovered once one "
                    "of its restarts starts.", worker.index, pid, how, worker.failed_starts, delay,
                    extra={"worker": worker.index, "pid": pid, "exit": how, "retry_in_s": delay},
                )
                continue
            if stopping.is_set():
                break  # the stop has begun: a worker that just ended is not started again
            if code == 0 and _recent(clean, now) < CLEAN_STOP_LIMIT * len(pool):
                # A clean stop of this worker alone (a signal sent to it, which it logged): asked
                # for, so no death towards CRASH_LIMIT; only endlessly many of them stop the broker.
                clean.append(now)
                log.warning("worker %d (pid %d) stopped cleanly (exit status 0: a signal to it alone, say); restarting it",
                            worker.index, pid, extra={"worker": worker.index, "pid": pid, "exit": how})
                worker.start()
                continue
            deaths.append(now)
            if _recent(deaths, now) >= CRASH_LIMIT:
                log.error(
                    "workers died %d times within %.0fs while serving (worker %d: %s); stopping the broker. See the "
                    "log above for why.", len(deaths), CRASH_WINDOW, worker.index, how,
                    extra={"worker": worker.index, "pid": pid, "exit": how},
                )
                return 1
            log.error(
                "worker %d (pid %d) %s; restarting it (its in-flight records are recovered when it starts)",
                worker.index, pid, how, extra={"worker": worker.index, "pid": pid, "exit": how},
            )
            worker.start()
    return 0


def _recent(times: deque[float], now: float) -> int:
    """How many of ``times`` fall within the last ``CRASH_WINDOW`` seconds (older ones dropped)."""
    while times and times[0] < now - CRASH_WINDOW:
        times.popleft()
    return len(times)


def _exit_of(code: int) -> str:
    """How a worker ended, for the log: its exit status, or the signal that killed it."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by signal {-code} ({name})"


def _stop_all(pool: list[Worker], grace: float) -> None:
    for worker in pool:
        worker.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for worker in pool:
        if worker.process is None:
            continue
        try:
            worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
