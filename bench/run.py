#!/usr/bin/env python3
"""Affidavit benchmark: bare ``mitmdump`` vs. Affidavit (PostgreSQL and SQLite journals), side by side.

    python bench/run.py            # full matrix: {http,https} x {1,32,128} x 3 targets, 3 rounds (~6 min)
    python bench/run.py --quick    # 1 round, concurrency {1,32}, 2 s per run (~1 min)
    python bench/run.py --api      # the side API's result fetch instead (bench/api.py)

Why it is built this way (see bench/README.md for how to read the output):

* The machine is small (2 cores) and noisy, so absolute figures mean little. Every target runs
  in the same invocation against the same upstream, rounds are interleaved with a rotating
  order, and the report gives medians over rounds and *paired ratios* against bare mitmdump.
* The upstream (nginx if installed, else bench/upstream.py), the load generator
  (bench/loadgen.py) and each proxy are separate processes, so the CPU read from /proc for the
  proxy is the proxy's alone (its whole process tree: ``--workers N`` is a supervisor and N
  workers).
* ``--api`` measures the side API's result fetch instead (bench/api.py), with the same matrix.
* Affidavit promises one journal row per accepted request; after every Affidavit run the
  harness compares the growth of ``invocations`` with the requests the load generator sent and
  prints a loud FAIL when they differ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


if __name__ == "__main__":
    from project_venv import reexec_in_project_venv

    reexec_in_project_venv(__file__)

import argparse  # noqa: E402
import atexit  # noqa: E402
import datetime as dt  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import api  # noqa: E402
import services  # noqa: E402
from services import Pki, StartError, Target, Upstream  # noqa: E402

ALL_TARGETS = ("bare", "affidavit-pg", "affidavit-sqlite")
# direct: no proxy, the upstream + load generator ceiling; lean: the broker's mitmproxy master
# with no broker addon (bench/lean_master.py); *-workers: `affidavit run --workers N`.
OPTIONAL_TARGETS = ("direct", "lean", "affidavit-pg-workers", "affidavit-sqlite-workers")
#: Affidavit targets: name -> (journal, runs `--workers N`).
AFFIDAVIT_TARGETS = {
    "affidavit-pg": ("pg", False),
    "affidavit-sqlite": ("sqlite", False),
    "affidavit-pg-workers": ("pg", True),
    "affidavit-sqlite-workers": ("sqlite", True),
}
API_TARGETS = ("affidavit-pg", "affidavit-sqlite")  # --api's default targets
LOUD = "!" * 100


# -- options -----------------------------------------------------------------------------------


def _csv(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Throughput, latency and CPU per request: bare mitmdump vs. Affidavit (pg, sqlite).",
    )
    p.add_argument(
        "--quick", action="store_true", help="1 round, concurrency 1,32, 2 s per run (unless given explicitly)"
    )
    p.add_argument("--paths", type=_csv(str), help="comma list of http,https [both]")
    p.add_argument(
        "--concurrency", type=_csv(int), help="comma list of connection counts [1,32,128; quick and --api: 1,32]"
    )
    p.add_argument(
        "--targets",
        type=_csv(str),
        help=f"comma list of {','.join(ALL_TARGETS + OPTIONAL_TARGETS)} [{','.join(ALL_TARGETS)}; "
        f"--api: {','.join(API_TARGETS)}]; bare is the reference",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes of the *-workers targets (`affidavit run --workers N`) [2]",
    )
    p.add_argument(
        "--api",
        action="store_true",
        help="benchmark the side API's GET /v1/invocations/{id}/result instead of the proxy (affidavit targets)",
    )
    p.add_argument(
        "--api-ids", type=int, default=200, help="--api: invocations recorded per target and cycled through [200]"
    )
    p.add_argument("--duration", type=float, help="measured seconds per run [5; quick: 2]")
    p.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds before each measured window [1]")
    p.add_argument("--rounds", type=int, help="interleaved rounds; the report shows medians [3; quick: 1]")
    p.add_argument("--pause", type=float, default=0.2, help="seconds of rest between runs [0.2]")
    p.add_argument("--upstream", choices=["auto", "nginx", "asyncio"], default="auto", help="[auto] = nginx if installed, else asyncio")
    p.add_argument("--mitmdump", help="mitmdump binary (default: the project's venv)")
    p.add_argument("--affidavit", help="affidavit binary (default: the project's venv)")
    p.add_argument(
        "--baseline",
        help="a second affidavit binary (say, an older checkout's venv) run as extra targets "
        "named <target>@base in the same interleaved rounds, to compare two builds without drift",
    )
    p.add_argument(
        "--cpu-idle-poll",
        action="store_true",
        help="hold /dev/cpu_dma_latency at 0 for the run (needs root): idle CPUs poll instead of halting, "
        "so waking a process costs no halt exit; every target runs under the same setting",
    )
    p.add_argument("--results-dir", type=Path, default=HERE / "results", help="[bench/results]")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (configs, logs, sqlite db)")
    a = p.parse_args(argv)
    if a.api and a.paths is not None:
        p.error("--paths does not apply to --api (it measures the side API, not the proxy); drop one of them")
    defaults = {
        "rounds": 1 if a.quick else 3,
        "duration": 2.0 if a.quick else 5.0,
        "concurrency": [1, 32] if a.quick or a.api else [1, 32, 128],
        "paths": ["api"] if a.api else ["http", "https"],
        "targets": list(API_TARGETS if a.api else ALL_TARGETS),
    }
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    for path in a.paths:
        if path not in ("http", "https") and not a.api:
            p.error(f"--paths: unknown path {path!r}")
    if a.baseline:
        a.targets += [f"{t}@base" for t in a.targets if t in AFFIDAVIT_TARGETS]
    for t in (t.removesuffix("@base") for t in a.targets):
        if t not in ALL_TARGETS + OPTIONAL_TARGETS:
            p.error(f"--targets: unknown target {t!r}")
        if a.api and t not in AFFIDAVIT_TARGETS:
            p.error(f"--targets: {t!r} has no side API; --api takes {','.join(AFFIDAVIT_TARGETS)}")
    if any(c < 1 for c in a.concurrency) or a.rounds < 1 or a.duration <= 0 or a.warmup < 0:
        p.error("concurrency and rounds must be >= 1, duration > 0, warmup >= 0")
    if a.workers < 2 or a.api_ids < 1:
        p.error("--workers must be >= 2 (1 is the plain affidavit target) and --api-ids >= 1")
    return a


def _hold_cpu_latency_at_zero() -> int:
    """Ask the kernel's PM QoS for zero wake-up latency while the returned descriptor stays open
    (until the process exits): the cpuidle governor then keeps idle CPUs polling. On a virtual
    machine whose idle CPUs halt (this one: `haltpoll` with no guest polling), every wake-up of a
    process on an idle CPU otherwise costs an exit to the host, and at concurrency 1 a request
    crosses processes several times (the broker's two commits add four crossings)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(fd, struct.pack("i", 0))
    except OSError as exc:
        raise SystemExit(f"--cpu-idle-poll: cannot hold /dev/cpu_dma_latency at 0 ({exc.strerror}); run as root") from None
    return fd


# -- cleanup -----------------------------------------------------------------------------------


class Cleanup:
    """Idempotent LIFO cleanup, run from ``finally`` and (as a backstop) from ``atexit``."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Any]] = []

    def push(self, what: str, fn: Any) -> None:
        self._steps.append((what, fn))

    def run(self) -> None:
        while self._steps:
            what, fn = self._steps.pop()
            try:
                problems = fn()
                for problem in problems or []:
                    print(f"cleanup: {problem}", file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - keep cleaning whatever happens
                print(f"cleanup: {what} failed: {exc!r}", file=sys.stderr)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -- one measurement ---------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    pki: Pki
    upstream: Upstream
    targets: dict[str, Target] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # target -> why it stopped being measured
    runs: list[dict[str, Any]] = field(default_factory=list)
    fails: list[str] = field(default_factory=list)  # loud problems: journal mismatches, errors
    api_ids: dict[str, list[str]] = field(default_factory=dict)  # --api: target -> recorded invocation ids

    @property
    def name_w(self) -> int:
        """Width of the target column in progress lines: the longest selected target name + 1."""
        return _name_width(self.args.targets) + 1

    def plan(self, target: Target, path: str, concurrency: int, warmup: float, duration: float) -> dict[str, Any]:
        if path == "api":
            return api.plan(target, self.api_ids[target.name], concurrency, warmup, duration)
        direct = target.name == "direct"
        watch = {"upstream": self.upstream.child.pid}
        if not direct:
            watch["proxy"] = target.child.pid
        return {
            "proxy_host": "127.0.0.1",
            "proxy_port": target.port,
            "path": path,
            "target_host": "127.0.0.1" if path == "http" else "localhost",
            "target_port": self.upstream.http_port if path == "http" else self.upstream.https_port,
            "concurrency": concurrency,
            "warmup": warmup,
            "duration": duration,
            # Bare gets the same Proxy-Authorization bytes, so both parse identical requests.
            "auth": None if direct else f"{services.AGENT}:{services.TOKEN}",
            "proxy_ca": str(target.ca),
            "direct": direct,
            "upstream_ca": str(self.pki.ca),
            "watch": watch,
            "pg_database": target.pg_database,
        }

    def measure(
        self, target: Target, path: str, concurrency: int, *, warmup: float, duration: float, label: str
    ) -> dict[str, Any]:
        """One load-generator run against one target, with the journal count check around it
        (every request through the proxy is one new invocation; side-API reads make none) and a
        check that the target's process tree stayed the same."""
        plan = self.plan(target, path, concurrency, warmup, duration)
        record: dict[str, Any] = {"target": target.name, "path": path, "concurrency": concurrency, "label": label}
        before = self.count(target)
        timeout = 30 + warmup + duration + 10 + 30
        try:
            proc = subprocess.run(
                [sys.executable, str(HERE / "loadgen.py"), "--plan", json.dumps(plan)],
                capture_output=True,
                text=True,
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            record["fatal"] = f"load generator did not finish within {timeout:.0f}s"
            return record
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            record["fatal"] = f"load generator exited {proc.returncode} without a result: {proc.stderr.strip()[-800:]}"
            return record
        result = json.loads(lines[-1])
        if "fatal" in result:
            record["fatal"] = result["fatal"]
            return record
        record.update(result)
        self._derive(record)
        self._check_tree(target, record)
        if before is not None:
            if path == "api":
                self.check_journal(target, record, before, 0, "side-API reads record no invocation")
            else:
                why = (
                    f"the load generator sent {record['sent']} requests "
                    f"(unfinished {record.get('unfinished')}, errors {record.get('all_errors')})"
                )
                self.check_journal(target, record, before, int(record["sent"]), why)
        return record

    def count(self, target: Target) -> int | None:
        if target.count_invocations is None:
            return None
        try:
            return target.count_invocations()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"{target.name}: cannot count invocations: {exc}")
            return None

    def _fail(self, msg: str) -> None:
        self.fails.append(msg)
        print(f"{LOUD}\nFAIL {msg}\n{LOUD}", flush=True)

    def _check_tree(self, target: Target, record: dict[str, Any]) -> None:
        """The proxy (or API) process tree must be the one of the target's first window, at both
        edges of every window, with at least the supervisor and its workers: under ``--workers N``
        a worker that crashed is restarted by the supervisor (and a SQLite journal's writer
        process by its broker), so only a changed pid shows it."""
        for name in ("proxy", "api"):
            if name not in record["tree_pids"]:
                continue
            first, last = (sorted(pids) for pids in record["tree_pids"][name])
            if target.pids is None:
                target.pids = first
            if first != last or first != target.pids or len(first) < target.processes:
                self._fail(
                    f"{target.name} {record['label']}: expected the processes {target.pids} "
                    f"(at least {target.processes}) throughout, found pids {first} at the start of the "
                    f"window and {last} at its end (a crashed or restarted process?); see {target.child.log}"
                )

    def check_journal(self, target: Target, record: dict[str, Any], before: int, growth: int, why: str) -> None:
        """The journal must grow by exactly ``growth`` rows in ``invocations``. Rows may land a
        moment after the response (write-behind), so poll - bounded - until the count is reached."""
        expected = before + growth
        deadline = time.monotonic() + 10
        after = before
        while True:
            count = self.count(target)
            if count is None:
                return
            after = count
            if after >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        record["journal_rows"] = after - before
        record["journal_ok"] = after == expected
        if after != expected:
            self._fail(
                f"{target.name} {record['label']}: journal grew by {after - before} invocations, "
                f"expected {growth}: {why}"
            )

    @staticmethod
    def _derive(r: dict[str, Any]) -> None:
        """Per-request and per-second CPU figures; the watched trees are ``proxy`` and
        ``upstream`` (``direct``: upstream only) or, for the side API, ``api``."""
        cpu = r["cpu_s"]
        window = r["window_s"]
        n = r["ok"] + r["errors_total"]
        per = (lambda s: s / n * 1e6) if n else (lambda s: None)
        watched = list(r["tree_pids"])
        for name in watched:
            r[f"{name}_us_per_req"] = per(cpu[name])
            r[f"{name}_cores"] = cpu[name] / window
        r["pg_us_per_req"] = per(cpu["pg_own"])
        r["pg_all_us_per_req"] = per(cpu["pg_all"])
        r["loadgen_cores"] = cpu["loadgen"] / window
        known = sum(cpu[name] for name in watched) + cpu["loadgen"] + cpu["pg_all"]
        r["machine_cores"] = cpu["machine_busy"] / window
        r["other_cores"] = max(0.0, (cpu["machine_busy"] - known) / window)


# -- the run -----------------------------------------------------------------------------------


def source_digest() -> str:
    """A digest of the broker's source as it is on disk now: the working tree may differ from
    the commit (it is being edited), and results are only comparable for the same digest."""
    h = hashlib.sha256()
    for path in sorted([*(REPO / "proxy").rglob("*.py"), *(REPO / "migrations").rglob("*.py")]):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def versions(args: argparse.Namespace, mitmdump: str | None, affidavit: str | None) -> dict[str, Any]:
    from importlib import metadata

    def pkg(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    def first_line(argv: list[str]) -> str | None:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            return None

    commit = dirty = None
    try:
        git = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        commit = git.stdout.strip() or None
        status = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "proxy", "migrations"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = bool(status.stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    return {
        "python": platform.python_version(),
        "mitmproxy": pkg("mitmproxy"),
        "mitmdump": first_line([mitmdump, "--version"]) if mitmdump else None,
        "affidavit": pkg("affidavit"),
        "affidavit_bin": affidavit,
        "git_commit": commit,
        "git_dirty": dirty,
        "proxy_source_sha256": source_digest(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg(),
    }


def start_targets(bench: Bench, tmp: Path, cleanup: Cleanup, mitmdump: str | None, affidavit: str | None) -> None:
    """Start each selected proxy once; a failure is recorded and the others still start."""
    for name in bench.args.targets:
        t0 = time.monotonic()
        try:
            if name == "direct":
                target = Target("direct", 0, bench.pki.ca, bench.upstream.child)
            elif name == "bare":
                if not mitmdump:
                    raise StartError("no mitmdump binary found (use --mitmdump)")
                target = services.start_bare(tmp, bench.pki, mitmdump)
            elif name == "lean":
                target = services.start_lean(tmp, bench.pki)
            else:
                if not affidavit:
                    raise StartError("no affidavit binary found (use --affidavit)")
                db, workers = AFFIDAVIT_TARGETS[name.removesuffix("@base")]
                binary = bench.args.baseline if name.endswith("@base") else affidavit
                target = services.start_affidavit(
                    name, tmp, bench.pki, binary, bench.upstream, db, bench.args.workers if workers else 1
                )
        except Exception as exc:  # noqa: BLE001 - report it; the other targets still run
            bench.failed[name] = f"did not start: {exc}"
            print(f"{LOUD}\nFAIL {name} did not start: {exc}\n{LOUD}", flush=True)
            continue
        bench.targets[name] = target
        if name != "direct":
            cleanup.push(f"stop {name}", lambda t=target: services.stop_target(t))
        workers = f"  (supervisor of workers {target.info['worker_pids']})" if "worker_pids" in target.info else ""
        print(
            f"  started {name:<{bench.name_w}} pid {target.child.pid:<7} port {target.port:<6} "
            f"in {time.monotonic() - t0:.1f}s{workers}",
            flush=True,
        )


def record_api_invocations(bench: Bench) -> None:
    """--api: record ``--api-ids`` invocations through each target's proxy, to be read back."""
    for name, target in list(bench.targets.items()):
        before = bench.count(target)
        try:
            ids = api.record_invocations(target, bench.upstream, bench.args.api_ids)
        except api.SeedError as exc:
            log = services.tail(target.child.log, 15)
            bench.failed[name] = f"could not record invocations: {exc}\n{log}"
            print(f"{LOUD}\nFAIL {name}: could not record invocations: {exc}\n{log}\n{LOUD}", flush=True)
            del bench.targets[name]
            continue
        bench.api_ids[name] = ids
        if before is not None:
            record = {"label": "recording invocations for --api"}
            bench.check_journal(target, record, before, len(ids), f"{len(ids)} requests answered through the proxy")
        print(f"  recorded {len(ids)} invocations through {name}", flush=True)


def smoke(bench: Bench) -> None:
    """A short run per target and path before the matrix: catches a broken target early (and
    lets mitmproxy mint its certificate for ``localhost`` outside the measurements)."""
    for name, target in list(bench.targets.items()):
        for path in bench.args.paths:
            r = bench.measure(target, path, 1, warmup=0.0, duration=0.3, label=f"smoke {path}")
            problem = r.get("fatal") or (
                f"errors {r['all_errors']}" if r.get("all_errors") else ("no response" if not r.get("ok") else None)
            )
            if problem:
                log = services.tail(target.child.log, 15)
                bench.failed[name] = f"smoke test ({path}) failed: {problem}\n{log}"
                print(f"{LOUD}\nFAIL {name} smoke test ({path}): {problem}\n{log}\n{LOUD}", flush=True)
                del bench.targets[name]
                break
            print(
                f"  smoke {name:<{bench.name_w}} {path:<5} ok ({r['ok']} requests, p50 {r['p50_ms']:.2f} ms)",
                flush=True,
            )


def run_matrix(bench: Bench) -> None:
    a = bench.args
    names = [t for t in a.targets if t in bench.targets]
    cells = [(path, c) for path in a.paths for c in a.concurrency]
    total = a.rounds * len(cells) * len(names)
    done = 0
    t0 = time.monotonic()
    for rnd in range(a.rounds):
        for path, conc in cells:
            k = rnd % len(names) if names else 0
            for name in names[k:] + names[:k]:  # rotate who goes first each round
                done += 1
                target = bench.targets.get(name)
                if target is None:
                    continue  # it died earlier
                label = f"r{rnd + 1} {path} c{conc}"
                r = bench.measure(target, path, conc, warmup=a.warmup, duration=a.duration, label=label)
                r["round"] = rnd + 1
                bench.runs.append(r)
                elapsed = time.monotonic() - t0
                head = f"[{done:>3}/{total}] {elapsed:5.0f}s  {label:<14} {name:<{bench.name_w}}"
                if "fatal" in r:
                    print(f"{head} FAILED: {r['fatal']}", flush=True)
                else:
                    errs = f"  errors {r['errors']}" if r["errors"] else ""
                    cpu = _cpu_name(path)
                    print(
                        f"{head} {r['rps']:8.0f} req/s  p50 {r['p50_ms'] or 0:7.2f} ms  p99 {r['p99_ms'] or 0:7.2f} ms"
                        f"  {cpu} {_fmt(r.get(f'{cpu}_us_per_req'), 0):>5} us/req"
                        f"  pg {_fmt(r['pg_us_per_req'], 0):>4} us/req"
                        f"  other {r['other_cores']:.2f} cores{errs}",
                        flush=True,
                    )
                    if r["errors"]:
                        bench.fails.append(f"{name} {label}: non-200 responses or failures {r['errors']}")
                if name != "direct" and not target.child.alive():
                    code = target.child.proc.returncode
                    why = f"exited with code {code} during {label}:\n{services.tail(target.child.log)}"
                    bench.failed[name] = why
                    print(f"{LOUD}\nFAIL {name} {why}\n{LOUD}", flush=True)
                    del bench.targets[name]
                time.sleep(a.pause)


# -- report ------------------------------------------------------------------------------------


def _name_width(names: Iterable[str]) -> int:
    return max([16, *map(len, names)])


def _cpu_name(path: str) -> str:
    """Which watched process tree a run on ``path`` is about: the proxy, or the side API."""
    return "api" if path == "api" else "proxy"


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(bench: Bench) -> list[dict[str, Any]]:
    """Medians over rounds per (path, concurrency, target); ratios are paired within a round."""
    a = bench.args
    ok_runs = [r for r in bench.runs if "fatal" not in r]
    by_key: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in ok_runs:
        by_key.setdefault((r["path"], r["concurrency"], r["target"]), []).append(r)
    rows: list[dict[str, Any]] = []
    for path in a.paths:
        cpu = _cpu_name(path)
        for conc in a.concurrency:
            bare = {r["round"]: r for r in by_key.get((path, conc, "bare"), [])}
            for name in a.targets:
                runs = by_key.get((path, conc, name), [])
                if not runs:
                    continue
                row: dict[str, Any] = {
                    "path": path,
                    "concurrency": conc,
                    "target": name,
                    "rounds": len(runs),
                    "rps": _median([r["rps"] for r in runs]),
                    "p50_ms": _median([r["p50_ms"] for r in runs]),
                    "p99_ms": _median([r["p99_ms"] for r in runs]),
                    f"{cpu}_us_per_req": _median([r.get(f"{cpu}_us_per_req") for r in runs]),
                    f"{cpu}_cores": _median([r.get(f"{cpu}_cores") for r in runs]),
                    "pg_us_per_req": _median([r["pg_us_per_req"] for r in runs]),
                    "loadgen_cores": _median([r["loadgen_cores"] for r in runs]),
                    "other_cores": _median([r["other_cores"] for r in runs]),
                    "errors": sum(r["errors_total"] for r in runs),
                }
                if path != "api":
                    row["upstream_us_per_req"] = _median([r["upstream_us_per_req"] for r in runs])
                    row.update(_vs_bare([(r, bare[r["round"]]) for r in runs if r["round"] in bare], conc))
                rows.append(row)
    return rows


def _vs_bare(paired: list[tuple[dict[str, Any], dict[str, Any]]], conc: int) -> dict[str, float | None]:
    """A target's ratios to bare mitmdump, from (run, bare's run in the same round) pairs."""
    return {
        "rps_vs_bare": _median([r["rps"] / b["rps"] for r, b in paired if b["rps"]]),
        "proxy_cpu_vs_bare": _median(
            [
                r["proxy_us_per_req"] / b["proxy_us_per_req"]
                for r, b in paired
                if r.get("proxy_us_per_req") and b["proxy_us_per_req"]
            ]
        ),
        "added_p50_ms_vs_bare": _median(
            [r["p50_ms"] - b["p50_ms"] for r, b in paired if r["p50_ms"] is not None and b["p50_ms"] is not None]
        )
        if conc == 1
        else None,
    }


Column = tuple[str, int, Callable[[dict[str, Any]], str]]


def _lead_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """What every table starts with: the cell (path, concurrency, target) and its req/s."""
    return [
        ("path", 5, lambda r: r["path"]),
        ("conc", 4, lambda r: str(r["concurrency"])),
        ("target", _name_width(r["target"] for r in rows), lambda r: r["target"]),
        ("req/s", 7, lambda r: _fmt(r["rps"], 0)),
    ]


def _latency_columns() -> list[Column]:
    return [("p50 ms", 7, lambda r: _fmt(r["p50_ms"], 2)), ("p99 ms", 7, lambda r: _fmt(r["p99_ms"], 2))]


def print_table(rows: list[dict[str, Any]]) -> None:
    """The proxy matrix: one line per (path, concurrency, target), with the ratios to bare."""
    print_rows(
        rows,
        [
            *_lead_columns(rows),
            ("x bare", 6, lambda r: _fmt(r["rps_vs_bare"], 2)),
            *_latency_columns(),
            ("+p50 ms", 7, lambda r: _fmt(r["added_p50_ms_vs_bare"], 2)),
            ("proxy us/req", 12, lambda r: _fmt(r["proxy_us_per_req"], 0)),
            ("cpu x bare", 10, lambda r: _fmt(r["proxy_cpu_vs_bare"], 2)),
            ("pg us/req", 9, lambda r: _fmt(r["pg_us_per_req"], 0)),
            ("errors", 6, lambda r: str(r["errors"])),
        ],
    )


def print_api_table(rows: list[dict[str, Any]]) -> None:
    """--api: one line per (concurrency, target), then whether the req/s goal is met."""
    print_rows(
        rows,
        [
            *_lead_columns(rows),
            *_latency_columns(),
            ("api us/req", 10, lambda r: _fmt(r["api_us_per_req"], 0)),
            ("api cores", 9, lambda r: _fmt(r["api_cores"], 2)),
            ("pg us/req", 9, lambda r: _fmt(r["pg_us_per_req"], 0)),
            ("errors", 6, lambda r: str(r["errors"])),
        ],
    )
    for r in rows:
        if r["concurrency"] == api.GOAL_CONCURRENCY:
            verdict = "met" if r["rps"] >= api.GOAL_RPS else "NOT met"
            print(
                f"goal >= {api.GOAL_RPS:.0f} req/s at concurrency {api.GOAL_CONCURRENCY}: "
                f"{r['target']} {r['rps']:.0f} req/s, {verdict}"
            )


def print_rows(rows: list[dict[str, Any]], cols: list[Column]) -> None:
    """Left-aligned key columns (the first three), right-aligned figures; a blank line between cells."""
    header = "  ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}" for i, (name, w, _) in enumerate(cols))
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        if last is not None and (r["path"], r["concurrency"]) != last:
            print()
        last = (r["path"], r["concurrency"])
        print("  ".join(f"{fn(r):>{w}}" if i > 2 else f"{fn(r):<{w}}" for i, (_, w, fn) in enumerate(cols)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    idle_poll = _hold_cpu_latency_at_zero() if args.cpu_idle_poll else None
    started = dt.datetime.now(dt.UTC)
    mitmdump = services.find_tool("mitmdump", args.mitmdump)
    affidavit = services.find_tool("affidavit", args.affidavit)
    meta = versions(args, mitmdump, affidavit)
    meta["cpu_idle_poll"] = idle_poll is not None
    print(
        f"affidavit bench: python {meta['python']}, mitmproxy {meta['mitmproxy']}, nproc {meta['nproc']}, "
        f"affidavit {meta['affidavit']} (commit {meta['git_commit'] or '-'}{'+dirty' if meta['git_dirty'] else ''}, "
        f"source {meta['proxy_source_sha256']}), load {meta['loadavg_at_start'][0]:.2f}"
        + (", idle CPUs poll (--cpu-idle-poll)" if idle_poll is not None else "")
    )
    what = (
        f"side API: GET /v1/invocations/{{id}}/result over {args.api_ids} recorded ids"
        if args.api
        else f"matrix: paths {','.join(args.paths)}"
    )
    print(
        f"{what} x concurrency {','.join(map(str, args.concurrency))} x targets {','.join(args.targets)}"
        f"{f' (--workers {args.workers})' if any(t.endswith('-workers') for t in args.targets) else ''}; "
        f"{args.rounds} round(s) of {args.warmup:g}s warm-up + {args.duration:g}s",
        flush=True,
    )

    cleanup = Cleanup()
    atexit.register(cleanup.run)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="affidavit-bench-"))
    keep_tmp = args.keep_tmp
    bench: Bench | None = None
    interrupted = False
    try:
        pki = services.make_pki(tmp / "pki")
        upstream = services.start_upstream(args.upstream, tmp, pki)
        cleanup.push("stop upstream", upstream.child.stop)
        print(f"upstream: {upstream.kind} ({upstream.version}) http :{upstream.http_port} https :{upstream.https_port}")
        meta["upstream"] = {"kind": upstream.kind, "version": upstream.version}
        bench = Bench(args, pki, upstream)
        start_targets(bench, tmp, cleanup, mitmdump, affidavit)
        if args.api:
            record_api_invocations(bench)
        smoke(bench)
        if "bare" not in bench.targets and not args.api:
            print("note: bare mitmdump is not running, so there are no ratios against it")
        run_matrix(bench)
        if not args.api and any(AFFIDAVIT_TARGETS.get(t.removesuffix("@base"), ("",))[0] == "pg" for t in bench.targets):
            meta["pg_commit_floor"] = floor = services.commit_floor()
            print(
                f"PostgreSQL alone: one-row INSERT+COMMIT p50 {floor['insert_commit_us']:.0f} us, "
                f"SELECT 1 p50 {floor['select_1_us']:.0f} us (asyncpg, one after another). At c=1 every Affidavit "
                "request waits for two commits in series: about twice the first figure of its latency is the journal's."
            )
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr)
    except StartError as exc:
        print(f"{LOUD}\nFAIL {exc}\n{LOUD}", file=sys.stderr)
        keep_tmp = True
    finally:
        cleanup.run()

    if bench is None:
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return 130 if interrupted else 2
    rows = summarize(bench)
    print()
    if args.api:
        print(f"medians over {args.rounds} round(s); every response a 200 with '{api.REPLAYED_HEADER}'")
        print_api_table(rows)
    else:
        print(f"medians over {args.rounds} round(s); 'x bare' and '+p50' are paired with bare in the same round")
        print_table(rows)
    noise = [r["other_cores"] for r in bench.runs if "other_cores" in r]
    if noise:
        median, top = statistics.median(noise), max(noise)
        print(f"\noutside load during runs (cores used by other processes): median {median:.2f}, max {top:.2f}")
    busy_loadgen = [r for r in bench.runs if r.get("loadgen_cores", 0) > 0.8 and r["target"] != "direct"]
    if busy_loadgen:
        print(f"warning: the load generator used > 0.8 core in {len(busy_loadgen)} run(s); those may be client-bound")

    problems = [f"{name}: {why}" for name, why in bench.failed.items()] + bench.fails
    if problems:
        keep_tmp = True
        print(f"\n{LOUD}\nFAIL: {len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p.splitlines()[0]}")
        print(LOUD)

    finished = dt.datetime.now(dt.UTC)
    meta.update(
        {
            "started": started.isoformat(),
            "finished": finished.isoformat(),
            "seconds": round((finished - started).total_seconds(), 1),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "interrupted": interrupted,
        }
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(
        json.dumps(
            {"meta": meta, "summary": rows, "runs": bench.runs, "failed_targets": bench.failed, "fails": bench.fails},
            indent=2,
        )
    )
    print(f"\nresults: {out}  ({meta['seconds']:.0f}s)")
    if keep_tmp:
        print(f"temp dir kept (configs, logs): {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    if interrupted:
        return 130
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
